"""`ebb-engine rpc-serve`: serve this machine's devices with ggml's RPC server (blocks).

ggml RPC has no authentication: bind to loopback unless the user names another address.
"""
from __future__ import annotations

import ctypes
import ipaddress
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from engine.errors import EbbError
from engine.models.default import existing_file
from engine.config import default_threads
from engine.llama import ggml
from engine.llama.devices import list_devices
from engine.units import fmt_bytes

NO_AUTH_WARNING = ("WARNING: ggml RPC has no authentication or encryption: anyone who can reach "
                   "{endpoint} can use this machine's memory and devices. Use it only on a "
                   "trusted network.")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


HASH_THRESHOLD_BYTES = ggml.RPC_HASH_THRESHOLD_BYTES


def cacheable_bytes(model: Path) -> tuple[int, int]:
    """(bytes of weight tensors over ggml's 10 MiB hash threshold, all tensor bytes)."""
    from engine.gguf.info import read_gguf

    gf = read_gguf(model)
    return sum(t.n_bytes for t in gf.tensors if t.n_bytes > HASH_THRESHOLD_BYTES), gf.tensor_bytes


def _wait_for_port(host: str, port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise EbbError(f"the RPC server did not start on {host}:{port}")


def warm_cache(endpoint: str, models: list[Path]) -> None:
    """Load each model through a loopback client onto this server, with every layer on it, so
    the server's tensor cache holds its weights; later clients then send hashes instead."""
    from engine.llama.devices import connect_rpc
    from engine.llama.loaded_model import LoadedModel, LoadParams

    names = connect_rpc(endpoint)
    for model in models:
        t0 = time.monotonic()
        m = LoadedModel(LoadParams(model, n_gpu_layers=10_000, devices=tuple(names)))
        m.close()
        print(f"ebb-engine rpc-serve: warmed the cache from {model.name} in "
              f"{time.monotonic() - t0:.1f}s", flush=True)


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's ceiling: larger blocks are always mapped afresh
TRIM_THRESHOLD_BYTES = 2**31 - 1  # the most mallopt takes: up to 2 GiB of freed heap is kept


def keep_freed_memory() -> bool:
    """Make this process's device memory behave like VRAM: freed buffers stay resident for the
    next allocation instead of going back to the OS and returning as fresh pages (a page fault
    per 4 KiB on first touch). With glibc's defaults the thresholds move with the history of
    allocations; once a swap's layers came back as fresh pages every time (~11k faults, twice
    the copy time on loopback). Blocks up to 32 MiB come from the heap, and the heap is not
    trimmed, so resident memory stays at its high-water mark, as a GPU's does. Linux/glibc
    only; False where it does not apply."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return (bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
            and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)))


def serve(host: str, port: int, cache_dir: str | None, n_threads: int | None,
          warm_from: list[str] | None = None, device_memory: int = 0) -> None:
    g = ggml.lib()
    warm = [existing_file(m, "model") for m in warm_from or []]
    if warm and not cache_dir:
        raise EbbError("--warm-from fills the tensor cache", "pass --cache DIR too")
    for model in warm:
        cacheable, total = cacheable_bytes(model)
        print(f"ebb-engine rpc-serve: {model.name}: {fmt_bytes(cacheable)} of {fmt_bytes(total)} "
              f"is cacheable (ggml caches weight tensors over 10 MiB; smaller ones are sent on "
              f"every load)", flush=True)
    if g.rpc is None:
        raise EbbError("this llama.cpp was built without RPC support", "rebuild with `make setup`")
    local = [d for d in list_devices() if not d.remote]
    served = [d for d in local if d.is_accelerator] or [d for d in local if d.kind == "cpu"]
    endpoint = f"{host}:{port}"
    if not is_loopback(host):
        print(NO_AUTH_WARNING.format(endpoint=endpoint), file=sys.stderr, flush=True)
    names = ", ".join(f"{d.name} ({d.description})" for d in served)
    print(f"ebb-engine rpc-serve: serving {names} on {endpoint}"
          + (f", tensor cache {cache_dir}" if cache_dir else "")
          + (f", device memory {fmt_bytes(device_memory)}" if device_memory else ""), flush=True)
    keep_freed_memory()
    arr = (ctypes.c_void_p * len(served))(*[d.handle for d in served])
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # the server blocks in C: let Ctrl-C end it
    if cache_dir:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
    args = (endpoint.encode(), cache_dir.encode() if cache_dir else None,
            default_threads(n_threads), len(served), arr)
    if not warm:
        g.rpc.ggml_backend_rpc_start_server(*args)
        return
    server = threading.Thread(target=g.rpc.ggml_backend_rpc_start_server, args=args, daemon=True)
    server.start()
    _wait_for_port("127.0.0.1" if host in ("0.0.0.0", "::") else host, port)
    warm_cache(f"{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}", warm)
    print("ebb-engine rpc-serve: ready", flush=True)
    server.join()
