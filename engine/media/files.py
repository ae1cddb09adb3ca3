"""The checks every attached file gets before it is read: there, not empty, not too large."""
from __future__ import annotations

from pathlib import Path

from engine.errors import EbbError

MIB = 1024 * 1024


def checked_file(path: Path, noun: str, limit_bytes: int, use: str, another: str = "") -> int:
    """The file's size; an EbbError naming it when it is missing, empty or over `limit_bytes`
    (0: no limit). `noun`: what it is ("sound clip"); `use`: what to use instead ("a clip");
    `another`: the fix for an empty one (default: choose another `noun`)."""
    path = Path(path)
    if not path.is_file():
        raise EbbError(f"{noun} not found: {path}", "check the path")
    size = path.stat().st_size
    if size == 0:
        raise EbbError(f"{path.name} is empty (0 bytes)", another or f"choose another {noun}")
    if limit_bytes and size > limit_bytes:
        raise EbbError(f"{path.name} is {size // MIB} MiB, too large",
                       f"use {use} under {limit_bytes // MIB} MiB")
    return size
