"""`python -m engine` is the same as the `ebb-engine` command."""
import sys

from engine.cli import main

sys.exit(main())
