"""What the window says until it is read: errors, warnings and notes above the chat (each until
its ✕, app/widgets/notices.py), banners with buttons, and what a download that ended while Get
models was shut came to. The status line is for what passes."""
from __future__ import annotations

import sys
from typing import Callable

from PySide6.QtWidgets import QBoxLayout, QWidget

from app.widgets.downloads import DONE, FAILED, Downloads
from app.widgets.notices import NoticeArea


class Notices:
    """The window's messages: `area` is the widget above the chat; `last_error` the last error
    said (the About dialog's diagnostics, tests)."""

    def __init__(self, downloads: Downloads, open_pair: Callable[[str, str], None],
                 hub_dialog_shown: Callable[[], bool]) -> None:
        self.area = NoticeArea()
        self.last_error = ""
        self._downloads = downloads
        self._open_pair = open_pair
        self._hub_dialog_shown = hub_dialog_shown
        downloads.ended.connect(self.download_ended)

    def say(self, text: str, kind: str = "warning",
            action: tuple[str, Callable[[], None]] | None = None, timeout_s: float = 0) -> None:
        """A message above the chat until its ✕ is pressed (what went wrong with the data
        folder, what happened before a restart, a device that came up short); `action`: a
        button that does something and closes it (Undo, Open it)."""
        self.area.add(text, kind, action, timeout_s=timeout_s)

    def error(self, text: str) -> None:
        """An error, where the user looks (above the chat) and until read; stderr too."""
        self.last_error = text
        print(f"ebb: error: {text}", file=sys.stderr, flush=True)
        self.area.add(text, "error")

    def add_banner(self, banner: QWidget) -> None:
        """A message with buttons above the chat (app/safe_mode.py), under the notices."""
        parent = self.area.parentWidget()
        layout = parent.layout() if parent is not None else None
        assert isinstance(layout, QBoxLayout), "the notices sit in the chat column's box"
        layout.insertWidget(layout.indexOf(self.area) + 1, banner)

    def download_ended(self, number: int) -> None:
        """A download that ends while Get models is shut says so here (Open it, or why not)."""
        if self._hub_dialog_shown():
            return  # the dialog says it
        d = self._downloads.get(number)
        if d.state == DONE and d.fetched is not None:
            got = d.fetched
            model, proj = str(got.model), str(got.projector) if got.projector else ""
            self.say(f"Downloaded {got.model.name}" + (f" with {got.projector.name}" if got.projector else "")
                     + f" to {got.model.parent}.", "info",
                     action=("Open it", lambda: self._open_pair(model, proj)))
        elif d.state == FAILED:
            self.error(f"The download of {d.name} stopped: {d.words} (Model → Get models… "
                       "goes on from where it stopped)")
