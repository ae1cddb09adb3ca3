"""Files under resources/: the same lookup from a source checkout and from a frozen build."""
from __future__ import annotations

import sys
from pathlib import Path


def resource_path(name: str) -> Path:
    base = Path(getattr(sys, "_MEIPASS", Path(__file__).resolve().parent.parent))
    return base / "resources" / name
