"""The window's layout as the user left it: its size, the chat/panel splitter and the docks,
saved on close into the settings and put back at the next start. With nothing saved and a
screen too narrow for the chat and the Memory panel side by side, the panel starts folded (View
→ Memory), as peers fold their side panels."""
from __future__ import annotations

import base64
from typing import Any

from PySide6.QtCore import QByteArray, QObject, Slot
from PySide6.QtWidgets import QApplication
from app.mainwindow.parts import WindowParts

FOLD_PANEL_BELOW = 1000  # px: a first start on a screen (or window) narrower folds the Memory panel
PANEL_FOLDED = ("The Memory panel is folded to give the chat room on this screen: View → Memory "
                "shows it.")
KEYS = ("window_geometry", "window_state", "window_split")


class WindowLayout(QObject):
    """A child of the window: the dock's signal reaches it as a QObject's slot, so the
    connection ends with the window (a plain object's bound method would be held by the
    connection, and the window with it)."""

    def __init__(self, window: WindowParts) -> None:
        super().__init__(window.window())
        self.w = window

    def _states(self) -> tuple[tuple[str, Any, Any], ...]:
        w = self.w
        return (("window_geometry", w.saveGeometry, w.restoreGeometry),
                ("window_state", w.saveState, w.restoreState),
                ("window_split", w.split.saveState, w.split.restoreState))

    def restore(self) -> None:
        w = self.w
        if not isinstance(w.store.settings.get("window_state"), str):
            screen = QApplication.primaryScreen()
            width = screen.availableGeometry().width() if screen is not None else w.width()
            if min(width, w.width()) < FOLD_PANEL_BELOW:
                w.panel_dock.hide()
                w.notices.say(PANEL_FOLDED, "info")
                w.panel_dock.visibilityChanged.connect(self._on_panel_shown)
        for key, _save, restore in self._states():
            saved = w.store.settings.get(key)
            if isinstance(saved, str):
                try:
                    restore(QByteArray(base64.b64decode(saved)))
                except (ValueError, TypeError):
                    continue

    @Slot(bool)
    def _on_panel_shown(self, shown: bool) -> None:
        if shown:  # the folded panel's notice has said its part
            self.w.notices.area.remove_matching(PANEL_FOLDED)

    def save(self) -> None:
        from app.core.store import StoreError

        for key, save, _restore in self._states():
            try:
                self.w.store.settings.set(key, base64.b64encode(bytes(save().data())).decode())
            except StoreError:  # a full disk: the layout is not worth an error
                return
