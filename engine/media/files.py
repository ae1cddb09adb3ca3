"""The checks every attached file gets before it is read: there, not empty, not too large."""
from __future__ import annotations

from pathlib import Path

from engine.errors import EbbError

MIB = 1024 * 1024


def size_words(size: int) -> str:
    """A file's size for a message: "812 bytes", "3.4 MiB"."""
    return f"{size:,} bytes" if size < MIB else f"{size / MIB:.1f} MiB"


def over_words(size: int, limit_bytes: int) -> tuple[str, str]:
    """(the size, the limit) in words that tell them apart: to the byte where rounding would
    make them read the same ("2.0 MiB" for 2 MiB and one byte)."""
    a, b = size_words(size), size_words(limit_bytes)
    return (a, b) if a != b else (f"{size:,} bytes", f"{limit_bytes:,} bytes")


def too_large(name: str, size: int, limit_bytes: int, use: str) -> EbbError:
    """The refusal of a file over its limit."""
    a, b = over_words(size, limit_bytes)
    return EbbError(f"{name} is {a}, more than the {b} Ebb takes", f"use {use} of at most {b}")


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
        raise too_large(path.name, size, limit_bytes, use)
    return size
