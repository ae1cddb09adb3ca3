"""The window's stand-in accelerator, one owner: Model → Start a stand-in accelerator… (and the
welcome's link) asks for its size, starts `app/core/standin.py`'s child process, polls it on a timer
until it serves, then hands the window its endpoint; the stand-in ends with the window. It also
answers what the window asks of it: whether a load's device is the stand-in, and what the
session's config needs for it (the swap shown; its memory not kept back). GUI thread."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from PySide6.QtCore import QObject, QTimer
from PySide6.QtGui import QAction
from PySide6.QtWidgets import QInputDialog, QWidget

from engine import events
from engine.config import SessionConfig
from engine.errors import EbbError

if TYPE_CHECKING:
    from app.core.standin import StandIn

# of the stand-in accelerator's memory, what the session may use (its own cap is exact)
STANDIN_SHARE = 0.95


class StandInControl(QObject):
    def __init__(self, window: QWidget, log_dir: Path | None, status: Callable[[str, int], None],
                 error: Callable[[str], None], ready: Callable[[str], None]) -> None:
        super().__init__(window)
        self.window = window
        self.log_dir = log_dir  # its log beside the window's (None: in memory)
        self.status, self.error, self.ready = status, error, ready
        self.standin: StandIn | None = None  # while it runs
        self.action = QAction("Start a stand-in accelerator…", window)
        self.action.triggered.connect(lambda _checked=False: self.start())
        self.action.setStatusTip("Serve part of this machine's RAM as a device of a "
                                 "size you pick (loopback only), to watch the swap")
        self._poll = QTimer(self, interval=200)
        self._poll.timeout.connect(self._on_poll)

    @property
    def label(self) -> str:
        return self.standin.label if self.standin is not None else ""

    def start(self, size: str | None = None) -> None:
        """Start the stand-in (a child `rpc-serve --device-memory`); `ready(endpoint)` once it
        serves. `size`: None asks the user."""
        from app.core.standin import DEFAULT_BYTES, StandIn
        from engine.units import fmt_bytes, parse_size

        if self.standin is not None:
            self.status(f"The {self.standin.label} is already running", 8000)
            return
        if size is None:
            size, ok = QInputDialog.getText(
                self.window, "Stand-in accelerator",
                "Memory of the stand-in device (from this machine's RAM). The default holds "
                "the demo model but not the model and its projector together, so the projector "
                "borrows the layers' room:", text=fmt_bytes(DEFAULT_BYTES).replace(" ", ""))
            if not ok:
                return
        try:
            self.standin = StandIn(parse_size(size.strip()), log_dir=self.log_dir)
        except (EbbError, OSError) as exc:
            self.error(f"Could not start the stand-in accelerator: {exc}")
            return
        self.action.setEnabled(False)
        self.status(f"Starting the {self.standin.label}…", 0)
        self._poll.start()

    def _on_poll(self) -> None:
        standin = self.standin
        if standin is None:  # stopped meanwhile
            self._poll.stop()
            return
        try:
            if not standin.ready():
                return
        except EbbError as exc:
            self._poll.stop()
            self.standin = None
            self.action.setEnabled(True)
            self.error(f"Could not start the stand-in accelerator: {exc}")
            return
        self._poll.stop()
        self.status(f"The {standin.label} is ready: loading the model onto it", 15000)
        self.ready(standin.endpoint)

    def is_standin(self, d: events.LoadDetails) -> bool:
        return (self.standin is not None and bool(d.accelerator)
                and d.accelerator_endpoint == self.standin.endpoint)

    def accel_name(self, d: events.LoadDetails) -> str:
        """The accelerator as the user knows it: the stand-in is named so wherever it shows."""
        return f"{d.accelerator}, the {self.label}" if self.is_standin(d) else str(d.accelerator)

    def adjust(self, cfg: SessionConfig) -> SessionConfig:
        """A load's config while the stand-in runs: it is there to show the swap (on loopback,
        auto may judge the CPU as fast: it is the same CPU; a strategy set in Settings is kept),
        and nothing else uses its memory (the margin a shared GPU needs would take most of it)."""
        if self.standin is None:
            return cfg
        if cfg.vision == "auto":
            cfg = replace(cfg, vision="swap")
        if cfg.vram_budget_bytes is None:
            cfg = replace(cfg, vram_budget_bytes=int(self.standin.memory_bytes * STANDIN_SHARE))
        return cfg

    def stop(self) -> None:
        """After the session let go of its memory: the stand-in ends with the window."""
        self._poll.stop()
        if self.standin is not None:
            from engine.llama.devices import forget_server

            self.standin.stop()
            forget_server(self.standin.endpoint)
            self.standin = None
