"""The bundle's `Ebb` launcher: the window."""
import sys

from app.main import main

sys.exit(main())
