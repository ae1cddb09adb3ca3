"""Settings → Local server: the OpenAI-compatible endpoint (engine/server) answered by the
window's own engine worker, so HTTP clients and the window's chats share one model and one
queue, in arrival order, and the memory panel shows their turns labelled by client.

`WindowBackend` is what the HTTP side submits to (any thread). A job waits in its bounded
queue and the worker is woken with a queued call: the worker's thread takes the oldest job in
the same event queue as the window's sends, answers it on the window's session, and puts the
window's conversation back.
"""
from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

from PySide6.QtCore import QMetaObject, Qt
from PySide6.QtWidgets import QLabel

from app.core.settings import Settings
from app.mainwindow.worker import EngineWorker
from engine.server.api.common import ApiError
from engine.server.jobs import Job, QueuedBackend, read_ahead

DEFAULT_QUEUE = 8


class WindowBackend(QueuedBackend):
    def __init__(self, worker: EngineWorker, max_queue: int = DEFAULT_QUEUE) -> None:
        super().__init__(max_queue)
        self.worker = worker
        self.image_dir = Path(tempfile.mkdtemp(prefix="ebb-window-server-"))
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.model_id = ""
        self.model_path = Path()
        self.served = 0
        self.vision = False  # the loaded model's projector takes pictures
        self.hearing = False  # ... and sound clips

    def set_model(self, path: str, vision: bool = False, hearing: bool = False) -> None:
        """The window loaded a model: requests name it from now on."""
        self.vision, self.hearing = vision, hearing
        self.model_path = Path(path)
        self.model_id = self.model_path.stem
        self.ready.set()

    def submit(self, job: Job) -> int:
        if not self.ready.is_set():
            raise ApiError(503, "the window has not loaded a model yet: try again shortly")
        job.image_dir = self.image_dir
        place = self.jobs.submit(job)
        read_ahead(self.worker.session, job)  # its conversation's kept state, while it waits
        # wakes the worker's thread; it takes the oldest waiting job, behind the window's sends
        QMetaObject.invokeMethod(self.worker, "serve_next", Qt.ConnectionType.QueuedConnection)
        return place

    def answering(self) -> bool:
        """A request, or the window's own reply, is being answered (it goes first)."""
        return super().answering() or self.worker.turn_running.is_set()

    def close(self) -> None:
        self.stop_all("the window is closing")  # the running job stops: the window can close
        if self.image_dir.exists():
            for f in self.image_dir.glob("*"):
                f.unlink(missing_ok=True)
            self.image_dir.rmdir()


def server_label(url: str, host: str, served: int, waiting: int) -> str:
    from engine.llama.rpc_server import is_loopback

    where = "" if is_loopback(host) else " — reachable from other machines"
    queue = f", {waiting} waiting" if waiting else ""
    return f"Local server {url}{where} ({served} answered{queue})"


class LocalServer:
    """The window's local server, one owner: started, restarted or stopped as Settings say
    (`apply`), its address and count in a status-bar label, stopped when the window closes.
    Problems go to `notify` (the window's notice area). GUI thread."""

    def __init__(self, worker: EngineWorker, label: QLabel, notify: Callable[[str], None]) -> None:
        self.backend = WindowBackend(worker)
        worker.server_backend = self.backend
        self.label = label  # a QLabel in the status bar, shown while serving
        self.notify = notify
        self.thread: Any = None  # engine.server.http.ServerThread, while serving
        self._wanted: tuple[str, int, str] | None = None
        # the label's "N waiting" as requests come and go (they wait behind the window's reply)
        from PySide6.QtCore import QTimer

        self._refresh = QTimer(label, interval=1000, timeout=self.update_status)

    def apply(self, settings: Settings) -> None:
        from engine.errors import EbbError
        from engine.server.http import ServerThread, is_loopback

        s = settings
        want = (s.server_host, s.server_port, s.server_api_key) if s.server else None
        if want == self._wanted and (want is None or self.thread is not None):
            return
        self._stop_thread()
        self._wanted = want
        if want is None:
            self.label.hide()
            return
        host, port, key = want
        try:
            self.thread = ServerThread(self.backend, host, port, api_key=key or None)
        except EbbError as exc:
            self.label.hide()
            self.notify(f"The local server did not start: {exc}")
            return
        self.update_status()
        self.label.show()
        self._refresh.start()
        if not is_loopback(host):
            self.notify(f"The local server listens on {host}: other machines that reach port "
                        f"{port} can use the model" + ("" if key else ", and no API key is set"))

    def update_status(self) -> None:
        if self.thread is not None:
            self.label.setText(server_label(self.thread.url, self.thread.host, self.backend.served,
                                            self.backend.waiting()))

    def _stop_thread(self) -> None:
        self._refresh.stop()
        if self.thread is not None:
            self.thread.stop()
            self.thread = None

    def close(self) -> None:
        """No new requests; those waiting are told; the running one stops between tokens."""
        self._stop_thread()
        self.backend.close()
