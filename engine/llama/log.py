"""Capture llama.cpp / ggml log lines so a failed load can say *why* in one line.

llama.cpp reports most load errors only through its log (the load call just returns NULL).
We keep the recent lines in a ring buffer, forward them to Python logging at DEBUG, and echo
them to stderr when EBB_LLAMA_VERBOSE=1. Installed once per process; the callback may run on
any thread that calls into llama.cpp.
"""
from __future__ import annotations

import collections
import ctypes
import logging
import os
import sys
import threading
from typing import Any

log = logging.getLogger("ebb.llama")

_LEVEL_ERROR = 3
_LEVEL_CONT = 5
_lines: collections.deque[tuple[int, str]] = collections.deque(maxlen=2000)
_lock = threading.Lock()
_partial: list[str] = []
_partial_level = [1]
_callback: Any = None
# Per-tensor listings: thousands of lines per load that would push the useful ones out.
_NOISE = ("llama_graph_n_input_tensors", "llama_model_loader: - ")  # keep the ctypes callback alive for the process


def _on_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    s = text.decode("utf-8", errors="replace") if text else ""
    with _lock:
        if level != _LEVEL_CONT:
            _partial_level[0] = level
        _partial.append(s)
        if not s.endswith("\n"):
            return
        line = "".join(_partial).rstrip("\n")
        _partial.clear()
        if line.startswith(_NOISE):
            return
        _lines.append((_partial_level[0], line))
    log.debug("%s", line)
    if os.environ.get("EBB_LLAMA_VERBOSE") == "1":
        print(line, file=sys.stderr, flush=True)


def install() -> None:
    """Route llama.cpp and ggml logging through us (idempotent)."""
    global _callback
    if _callback is not None:
        return
    from engine.llama.binding import binding

    L = binding()
    _callback = L.llama_log_callback(_on_log)
    L.llama_log_set(_callback, ctypes.c_void_p(0))


def callback() -> Any:
    """The installed ctypes log callback (for mtmd's own log setters)."""
    install()
    return _callback


def recent(n: int = 50) -> list[tuple[int, str]]:
    with _lock:
        return list(_lines)[-n:]


def clear() -> None:
    with _lock:
        _lines.clear()


def last_error(default: str = "") -> str:
    """The most telling recent error line, without llama.cpp's function-name prefix."""
    lines = recent(120)
    # The root cause comes first: "llama_model_load: error loading model: <cause>".
    for _level, line in lines:
        if "error loading model:" in line:
            return line.split("error loading model:", 1)[-1].strip()
    errors = [line for level, line in lines
              if (level == _LEVEL_ERROR or "error" in line.lower() or "failed" in line.lower())
              and line.strip()]
    if not errors:
        return default
    return errors[0].split(": ", 1)[-1].strip()
