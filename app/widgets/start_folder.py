"""Where a file dialog starts: the user's folder for that kind of file (Documents, Pictures),
when it exists, else their home folder; never the process's working folder, which is wherever
Ebb happened to be started from. GUI thread."""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QStandardPaths

Location = QStandardPaths.StandardLocation


def start_folder(location: Location = Location.DocumentsLocation) -> Path:
    """The folder a dialog opens in: `location` where it exists (Qt names ~/Documents even on a
    machine that has none, and a dialog given a missing folder starts in the working folder)."""
    named = QStandardPaths.writableLocation(location)
    if named and Path(named).is_dir():
        return Path(named)
    return Path.home()


def start_file(name: str, location: Location = Location.DocumentsLocation) -> str:
    """A save dialog's suggestion: `name` in the start folder."""
    return str(start_folder(location) / name)
