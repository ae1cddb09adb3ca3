"""Where Ebb keeps files: platformdirs folders, overridable for tests with EBB_* variables."""
from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "ebb"


def cache_dir() -> Path:
    """Models and built wheels (re-creatable). Same folder packaging/bootstrap.py uses."""
    env = os.environ.get("EBB_CACHE_DIR")
    return Path(env) if env else Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False))


def data_dir() -> Path:
    """Conversations and images (the user's data)."""
    env = os.environ.get("EBB_DATA_DIR")
    return Path(env) if env else Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))


def models_dir() -> Path:
    return cache_dir() / "models"


def engine_argv() -> list[str]:
    """The command that runs `ebb-engine` as a child process: the bundle's own launcher when
    frozen (PyInstaller; `sys.executable` is then the launcher that is running, perhaps the
    window's), else this Python with `-m engine`."""
    import sys

    if getattr(sys, "frozen", False):
        return [str(Path(sys.executable).with_name("ebb-engine"))]
    return [sys.executable, "-m", "engine"]
