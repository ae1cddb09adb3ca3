"""When ggml gives up: a remote device that dies *during* a step makes ggml-rpc call
GGML_ABORT, which ends the process. ggml lets us see the message first (its abort callback,
called on the thread that failed); we use it to say what happened in one clear line and to
leave on our own terms: the CLI exits with code 3, the window starts itself again without the
lost server (the conversation is in its database). The handler must not return: ggml calls
abort() right after it.
"""
from __future__ import annotations

import ctypes
import os
import re
import sys
import time
from typing import Callable

from engine.llama import ggml

EXIT_DEVICE_LOST = 3
_CB = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_installed: list[object] = []  # keeps the ctypes callback alive


def lost_endpoints() -> list[str]:
    """RPC servers that went away: our own sockets tell; failing that (they may be closing
    under us while ggml gives up), a server that refuses a fresh connection is gone."""
    from engine.llama.devices import check_rpc_servers, refused_endpoints

    def ours() -> list[str]:
        return check_rpc_servers(timeout_s=0.2)

    probes: tuple[Callable[[], list[str]], ...] = (ours, refused_endpoints)
    deadline = time.monotonic() + 2.0  # a killed server's port may close a moment later
    while True:
        for probe in probes:
            try:
                lost = probe()
            except Exception:  # noqa: BLE001 - we are already failing; say what we can
                continue
            if lost:
                return lost
        if time.monotonic() > deadline:
            return []
        time.sleep(0.1)


def describe(message: str, lost: list[str]) -> str:
    message = re.sub(r"^\S+:\d+: ", "", message.strip())  # ggml's source file and line
    if lost:
        return (f"the RPC server {', '.join(lost)} went away during a step; llama.cpp cannot "
                f"continue in this process ({message.strip()})")
    return f"llama.cpp stopped: {message.strip()}"


def install(on_fatal: Callable[[str, list[str]], None]) -> None:
    """Call `on_fatal(message, lost endpoints)` when ggml aborts. It must exit or exec."""
    g = ggml.lib()
    fn = getattr(g.base, "ggml_set_abort_callback", None)
    if fn is None:
        return
    fn.restype = ctypes.c_void_p
    fn.argtypes = [_CB]

    def handler(msg: bytes | None) -> None:
        try:
            text = (msg or b"").decode(errors="replace")
            on_fatal(text, lost_endpoints())
        finally:
            os._exit(EXIT_DEVICE_LOST)

    cb = _CB(handler)
    _installed.append(cb)
    fn(cb)


def exit_with_message(prog: str) -> Callable[[str, list[str]], None]:
    """The CLI's handler: one line on stderr, exit code 3."""
    def on_fatal(message: str, lost: list[str]) -> None:
        sys.stdout.flush()
        print(f"{prog}: error: {describe(message, lost)}", file=sys.stderr, flush=True)
        os._exit(EXIT_DEVICE_LOST)
    return on_fatal
