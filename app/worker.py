"""EngineWorker: the one QObject, on its own QThread, that owns every llama.cpp object.

The window calls its slots only through queued signals; it emits exactly one engine event
object per signal. `cancel()` is the one method the GUI thread may call directly.
"""
from __future__ import annotations

import threading
import traceback

from PySide6.QtCore import QObject, Signal, Slot

from engine import events
from engine.errors import EbbError
from engine.runtime import GenParams, LoadParams, TextRuntime


class EngineWorker(QObject):
    event = Signal(object)

    def __init__(self) -> None:
        super().__init__()
        self._runtime: TextRuntime | None = None
        self._cancel = threading.Event()

    def cancel(self) -> None:
        """Any thread: ask the running generation to stop at the next token."""
        self._cancel.set()

    @Slot(object)
    def load(self, params: LoadParams) -> None:
        self.event.emit(events.ModelLoading(0, model_path=str(params.model_path)))
        try:
            self._close_runtime()
            rt = TextRuntime(params)
        except EbbError as exc:
            self.event.emit(events.EngineFailed(0, message=str(exc)))
            return
        except Exception as exc:  # keep the window alive; show what happened
            traceback.print_exc()
            self.event.emit(events.EngineFailed(0, message=f"{type(exc).__name__}: {exc}"))
            return
        self._runtime = rt
        self.event.emit(events.ModelLoaded(
            0, model_path=str(params.model_path), model_name=rt.info.name,
            n_layers=rt.info.n_layers, n_ctx=rt.n_ctx, n_threads=rt.n_threads, load_s=rt.load_s))

    @Slot(int, object, object)
    def generate(self, request_id: int, messages: list[dict[str, str]], gp: GenParams) -> None:
        if self._runtime is None:
            self.event.emit(events.EngineFailed(request_id, message="no model is loaded"))
            return
        self._cancel.clear()
        try:
            result = self._runtime.generate(
                messages, gp, cancel=self._cancel,
                on_text=lambda s: self.event.emit(events.TokenText(request_id, text=s)))
        except EbbError as exc:
            self.event.emit(events.EngineFailed(request_id, message=str(exc)))
            return
        self.event.emit(events.TurnFinished(request_id, result=result.to_dict()))

    @Slot()
    def shutdown(self) -> None:
        self._close_runtime()

    def _close_runtime(self) -> None:
        if self._runtime is not None:
            self._runtime.close()
            self._runtime = None
