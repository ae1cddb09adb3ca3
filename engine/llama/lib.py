"""The llama.cpp binding, imported once: its log routed through ours and the backend initialised.
Every module that calls llama.cpp gets it from `llama()`. Engine thread (any thread may import)."""
from __future__ import annotations

from typing import Any

from engine.llama import log as llama_log

_backend_ready = False


def llama() -> Any:
    """Import llama_cpp once, with logging routed and the backend initialised."""
    global _backend_ready
    import llama_cpp

    if not _backend_ready:
        llama_log.install()
        llama_cpp.llama_backend_init()
        _backend_ready = True
    return llama_cpp
