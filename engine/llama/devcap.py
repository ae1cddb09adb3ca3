"""A device with a fixed amount of memory, for `ebb-engine rpc-serve --device-memory SIZE`.

ggml's RPC server serves this machine's RAM as a device whose memory is the whole of RAM. With
a cap it behaves like a GPU of that size: it reports the cap as its memory, and an allocation
that would pass it fails as a full GPU's does (the client's llama.cpp says it could not
allocate), instead of the process hitting an address-space limit in the middle of a graph. The
cap lives in a small preloaded library (`devcap.c`, built with the C compiler on first use and
kept in the cache folder); the server re-executes itself with it.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.errors import EbbError
from engine.paths import cache_dir

SOURCE = Path(__file__).with_name("devcap.c")
ENV_LIMIT = "EBB_DEVICE_MEMORY"
BUNDLED = "engine/llama/libebb-devcap.so"  # inside a bundle (packaging/dist.py builds it)


def shim_path() -> Path:
    """Where the built library lives for this source (its hash is in the name)."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    return cache_dir() / "lib" / f"libebb-devcap-{digest}.so"


def build() -> Path:
    """The library, built on first use. EbbError when there is no C compiler."""
    if not sys.platform.startswith("linux"):
        raise EbbError("--device-memory works on Linux only")
    meipass = getattr(sys, "_MEIPASS", None)  # the desktop bundle carries it, built: no compiler
    if meipass is not None and (Path(meipass) / BUNDLED).is_file():
        return Path(meipass) / BUNDLED
    out = shim_path()
    if out.exists():
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise EbbError("--device-memory needs a C compiler once, to build its small library",
                       "install gcc (or set CC)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    r = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(tmp), str(SOURCE), "-ldl",
                        "-lpthread"], capture_output=True, text=True)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise EbbError(f"could not build the device-memory library: {r.stderr.strip()[-400:]}")
    tmp.replace(out)
    return out


def active() -> bool:
    """True in a process the library was preloaded into."""
    return hasattr(ctypes.CDLL(None), "ebb_devcap_stats")


def preload_env(limit_bytes: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment that starts a process with the cap."""
    e = dict(os.environ if env is None else env)
    shim = str(build())
    e["LD_PRELOAD"] = " ".join(p for p in (shim, e.get("LD_PRELOAD", "")) if p)
    e[ENV_LIMIT] = str(limit_bytes)
    return e


@dataclass(frozen=True)
class CapStats:
    used_bytes: int
    peak_bytes: int
    cap_bytes: int
    refused: int


def stats() -> CapStats | None:
    """The cap's figures in this process, or None without the library."""
    if not active():
        return None
    fn = ctypes.CDLL(None).ebb_devcap_stats
    used, peak, cap = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_size_t()
    refused = ctypes.c_ulong()
    fn(ctypes.byref(used), ctypes.byref(peak), ctypes.byref(cap), ctypes.byref(refused))
    return CapStats(used.value, peak.value, cap.value, refused.value)
