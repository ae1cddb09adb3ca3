"""The window's downloads from the Hub: they belong to the window, not to the Get models dialog,
so closing the dialog leaves them running and opening it again shows them (#52).

Each download runs on a short-lived Python thread (never the GUI thread, never the engine's
worker); its progress comes back to the GUI thread through queued signals. Pause keeps the
parts (Download again, or a later start, goes on from there); Cancel deletes them; closing the
window pauses them all. A download that ends while the dialog is shut says so in a notice, with
Open.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import QObject, Signal

from engine.errors import EbbError
from engine.units import fmt_bytes

if TYPE_CHECKING:
    from engine.hub.catalog import HubFile, Quant
    from engine.hub.download import Progress
    from engine.hub.fetch import Fetched

RUNNING, PAUSED, CANCELLED, FAILED, DONE = "downloading", "paused", "cancelled", "failed", "done"


@dataclass
class Download:
    """One model (all its parts) and its projector, fetched together."""
    number: int
    repo: str
    quant: Quant
    projector: HubFile | None
    endpoint: str | None
    token: str | None
    folder: Path
    state: str = RUNNING
    words: str = ""  # the latest progress line, or why it failed
    fraction: float = 0.0  # over every file of the pair
    fetched: Fetched | None = None  # once done
    stop: threading.Event = field(default_factory=threading.Event)
    cancelling: bool = False

    @property
    def files(self) -> list[Any]:
        return [*self.quant.parts, *([self.projector] if self.projector is not None else [])]

    @property
    def name(self) -> str:
        return f"{self.repo} {self.quant.label}" + (" with its projector" if self.projector else "")

    def line(self) -> str:
        """The downloads list's row: what, how far, and the state."""
        if self.state == RUNNING:
            return f"{self.name}: {int(self.fraction * 100)}% · {self.words}"
        if self.state == DONE and self.fetched is not None:
            return f"{self.name}: done, in {self.fetched.model.parent}"
        return {PAUSED: f"{self.name}: paused at {int(self.fraction * 100)}% (Download goes on from there)",
                CANCELLED: f"{self.name}: cancelled, nothing kept",
                FAILED: f"{self.name}: failed: {self.words}"}.get(self.state, self.name)


class Downloads(QObject):
    """Every download of this window's life, oldest first. `changed(number)` on any news of
    one; `ended(number)` when one stops being under way (done, paused, cancelled, failed)."""
    changed = Signal(int)
    ended = Signal(int)
    _progress = Signal(int, object)  # from the download's thread
    _fetched = Signal(int, object)
    _stopped = Signal(int)
    _failed = Signal(int, str)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.all: list[Download] = []
        self._progress.connect(self._on_progress)
        self._fetched.connect(self._on_fetched)
        self._stopped.connect(self._on_stopped)
        self._failed.connect(self._on_failed)

    def get(self, number: int) -> Download:
        return self.all[number]

    def running(self) -> list[Download]:
        return [d for d in self.all if d.state == RUNNING]

    def start(self, repo: str, quant: Quant, projector: HubFile | None, endpoint: str | None,
              token: str | None) -> Download:
        """Fetch the pair (a paused one's parts are taken up again)."""
        from engine.hub.fetch import repo_folder

        same = next((d for d in self.running() if d.repo == repo and d.quant.label == quant.label), None)
        if same is not None:  # already under way: one writer a file
            return same
        # a paused or failed one of the same files goes on in its own row (not a second one
        # beside an old "paused at 15 %")
        again = next((d for d in reversed(self.all) if d.repo == repo and d.quant.label == quant.label
                      and d.state in (PAUSED, FAILED)), None)
        if again is not None:
            d = again
            d.projector, d.endpoint, d.token = projector, endpoint, token
            d.state, d.words, d.stop, d.cancelling = RUNNING, "", threading.Event(), False
        else:
            d = Download(len(self.all), repo, quant, projector, endpoint, token, repo_folder(repo))
            self.all.append(d)
        threading.Thread(target=self._work, args=(d,), name="ebb-download", daemon=True).start()
        self.changed.emit(d.number)
        return d

    def _work(self, d: Download) -> None:
        from engine.hub.download import DownloadPaused
        from engine.hub.fetch import fetch_pair

        try:
            got = fetch_pair(d.repo, d.quant, d.projector, d.endpoint, d.token,
                             lambda p: self._progress.emit(d.number, p), d.stop)
        except DownloadPaused:
            self._stopped.emit(d.number)
        except EbbError as exc:
            self._failed.emit(d.number, str(exc))
        except Exception as exc:  # noqa: BLE001 - nothing escapes a download's thread unsaid
            self._failed.emit(d.number, f"{type(exc).__name__}: {exc}")
        else:
            self._fetched.emit(d.number, got)

    def pause(self, number: int) -> None:
        self.all[number].stop.set()

    def cancel(self, number: int) -> None:
        """Stop it and delete what it had written (Pause keeps it)."""
        d = self.all[number]
        if d.state == RUNNING:
            d.cancelling = True
            d.stop.set()
        elif d.state == PAUSED:
            self._delete_parts(d)
            d.state = CANCELLED
            self.changed.emit(number)

    def pause_all(self) -> None:
        """The window closes: every download pauses, its parts kept for the next start."""
        for d in self.running():
            d.stop.set()

    def _on_progress(self, number: int, p: Progress) -> None:
        """One fraction over every file of the pair (the model's parts and the projector)."""
        d = self.all[number]
        if d.state != RUNNING:
            return
        total = sum(f.size_bytes for f in d.files) or p.total_bytes
        before = 0
        for f in d.files:  # the files ahead of this one are done
            if f.name == p.name:
                break
            before += f.size_bytes
        d.fraction = min(1.0, (before + p.done_bytes) / max(total, 1))
        d.words = p.words() + (f" · {fmt_bytes(before + p.done_bytes)} of {fmt_bytes(total)} in all"
                               if len(d.files) > 1 else "")
        self.changed.emit(number)

    def _on_fetched(self, number: int, got: Fetched) -> None:
        d = self.all[number]
        d.state, d.fetched, d.fraction = DONE, got, 1.0
        self._end(number)

    def _on_stopped(self, number: int) -> None:
        d = self.all[number]
        if d.cancelling:
            self._delete_parts(d)
            d.state = CANCELLED
        else:
            d.state = PAUSED
        self._end(number)

    def _on_failed(self, number: int, text: str) -> None:
        d = self.all[number]
        d.state, d.words = FAILED, text
        self._end(number)

    def _end(self, number: int) -> None:
        self.changed.emit(number)
        self.ended.emit(number)

    @staticmethod
    def _delete_parts(d: Download) -> None:
        from engine.hub.download import part_path

        for f in d.files:
            part = part_path(d.folder / f.name)
            for leftover in (part, part.with_name(part.name + ".etag")):
                leftover.unlink(missing_ok=True)
