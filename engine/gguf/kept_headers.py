"""GGUF headers kept on disk between runs, by file version: a start reads the model's parsed
header back instead of walking its vocabulary again (#54: the walk is ~9 ms of SmolLM2's
0.35 s from launch to first token, and more for a larger vocabulary).

A file version is its resolved path, size, modification and change times and inode. A changed
file has a new change time, whatever its modification time says (`cp -p`, a download's
rename), so a kept header is only ever read for the bytes it was parsed from. A kept file that
cannot be read, or names another version, is ignored and the header parsed again; one that
cannot be written is not kept. Any thread may call this (each write is a rename).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from engine.paths import cache_dir
from engine.json_file import read_object

FORMAT = 1
KEPT_MAX = 64  # files: the oldest go first (a header is a few KiB to a few hundred)
Version = tuple[str, int, int, int, int]


def version_of(path: Path) -> Version:
    """The file version that keys its header (OSError if it cannot be stat-ed)."""
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def headers_dir() -> Path:
    return cache_dir() / "headers"


def _file_for(version: Version) -> Path:
    return headers_dir() / (hashlib.sha1(version[0].encode()).hexdigest()[:24] + ".json")


def load(version: Version) -> dict[str, Any] | None:
    """The header kept for exactly this version ({"file_bytes", "metadata", "tensors"}), or
    None."""
    kept = read_object(_file_for(version))
    if kept.get("format") != FORMAT or kept.get("version") != list(version):
        return None
    return kept


def keep(version: Version, file_bytes: int, metadata: dict[str, Any], tensors: list[list[Any]]) -> None:
    """Write this version's header (replacing the path's older one); silent if it cannot."""
    target = _file_for(version)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"format": FORMAT, "version": list(version), "file_bytes": file_bytes,
                                   "metadata": metadata, "tensors": tensors}), encoding="utf-8")
        os.replace(tmp, target)
        _prune(target.parent)
    except (OSError, ValueError, TypeError):  # a read-only cache, a value JSON cannot hold
        tmp.unlink(missing_ok=True)


def _prune(folder: Path) -> None:
    files = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime_ns)
    for old in files[:-KEPT_MAX]:
        old.unlink(missing_ok=True)
