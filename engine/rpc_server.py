"""`ebb-engine rpc-serve`: serve this machine's devices with ggml's RPC server (blocks).

ggml RPC has no authentication: bind to loopback unless the user names another address.
"""
from __future__ import annotations

import ctypes
import ipaddress
import signal
import sys

from engine import ggml
from engine.devices import list_devices
from engine.errors import EbbError
from engine.hw import physical_cores

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


def serve(host: str, port: int, cache_dir: str | None, n_threads: int | None) -> None:
    g = ggml.lib()
    if g.rpc is None:
        raise EbbError("this llama.cpp was built without RPC support", "rebuild with `make setup`")
    local = [d for d in list_devices() if not d.remote]
    served = [d for d in local if d.is_accelerator] or [d for d in local if d.kind == "cpu"]
    endpoint = f"{host}:{port}"
    if not is_loopback(host):
        print(NO_AUTH_WARNING.format(endpoint=endpoint), file=sys.stderr, flush=True)
    names = ", ".join(f"{d.name} ({d.description})" for d in served)
    print(f"ebb-engine rpc-serve: serving {names} on {endpoint}"
          + (f", tensor cache {cache_dir}" if cache_dir else ""), flush=True)
    arr = (ctypes.c_void_p * len(served))(*[d.handle for d in served])
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # the server blocks in C: let Ctrl-C end it
    g.rpc.ggml_backend_rpc_start_server(endpoint.encode(), cache_dir.encode() if cache_dir else None,
                                        n_threads or physical_cores(), len(served), arr)
