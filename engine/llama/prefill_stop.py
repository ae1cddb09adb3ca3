"""Stop during a prompt. Between batches the runtime looks at `asked`; within one, llama.cpp's
abort callback stops the graph. ggml calls that callback for every graph node on its own
threads, so it is C, not Python (a Python callback took the GIL per node: the prefill ran 13%
slower): libc's strlen on a one-byte flag, which a watcher thread sets when the cancel event is
set (it looks at once, before the prompt starts, then every ABORT_POLL_S)."""
from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from typing import Any, Iterator

from engine.llama.lib import llama

ABORT_POLL_S = 0.05  # how often the watcher looks at Stop


@functools.lru_cache(maxsize=1)
def _strlen_callback() -> Any:
    """libc's strlen as a ggml_abort_callback: it returns the length of the flag's text, 0
    (go on) or 1 (stop), read as a bool; no Python, no GIL, per graph node."""
    libc = ctypes.CDLL(None)  # this process's own symbols: libc is among them
    return llama().ggml_abort_callback(ctypes.cast(libc.strlen, ctypes.c_void_p).value)


class PrefillStop:
    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self._cancel: threading.Event | None = None  # set while a prefill may be stopped
        self._flag: Any = None  # the abort callback's flag, while a prefill runs

    @property
    def asked(self) -> bool:
        """Stop was asked for (the runtime looks between batches)."""
        return self._cancel is not None and self._cancel.is_set()

    @property
    def fired(self) -> bool:
        """The abort callback stopped a graph: llama_decode's code 2 was ours."""
        return self._flag is not None and bool(self._flag.value)

    @contextlib.contextmanager
    def armed(self, cancel: threading.Event | None) -> Iterator[None]:
        """While the prompt runs, `cancel` stops it."""
        if cancel is None:
            yield
            return
        L = llama()
        self._cancel = cancel
        flag = ctypes.create_string_buffer(2)  # "": go on; "x": stop
        self._flag = flag
        done, looked = threading.Event(), threading.Event()

        def watch() -> None:
            while True:
                if cancel.is_set():
                    flag.value = b"x"
                looked.set()
                if flag.value or done.wait(ABORT_POLL_S):
                    return

        L.llama_set_abort_callback(self.ctx, _strlen_callback(), ctypes.cast(flag, ctypes.c_void_p))
        watcher = threading.Thread(target=watch, name="ebb-prefill-stop", daemon=True)
        watcher.start()
        looked.wait()  # a Stop pressed before the prompt began stops its first graph
        try:
            yield
        finally:
            done.set()
            watcher.join()
            L.llama_set_abort_callback(self.ctx, L.ggml_abort_callback(0), None)
            self._cancel = None
            self._flag = None
