"""The small JSON files Ebb keeps beside its caches (a build's record, the headers read, the
self-test's logits, calibration, the hash memo, a download's pairing note): read as an object,
or as none at all when missing or damaged (a cache is never worth a failure); written through
a temporary file and a rename, so a reader never sees half of one. Any thread."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_object(path: Path) -> dict[str, Any]:
    """The file's JSON object; {} when it is missing, unreadable, not JSON or not an object."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_object(path: Path, data: dict[str, Any], indent: int | None = None) -> None:
    """Write `data` whole or not at all (OSError when the folder cannot be written)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=indent), encoding="utf-8")
    os.replace(tmp, path)
