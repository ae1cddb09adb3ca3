"""The bundle's `ebb-engine` launcher: the engine's command line."""
import sys

from engine.cli import main

sys.exit(main())
