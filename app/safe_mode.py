"""After a native crash: the banner that says what happened and offers safe mode.

llama.cpp's native code can kill the process (a bad build for this CPU, a driver); the engine
leaves a sentinel around a model's first decode (engine.llama.native), so the next start knows.
Then the window does not load the model at once (it would crash again at every start): this
banner says what happened and lets the user start in safe mode (CPU only, no extra weight
layouts, remembered in the settings) or try again as before. While safe mode is on, the banner
says so and offers to leave it at the next start. GUI thread only.
"""
from __future__ import annotations

from typing import Callable

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton

from engine.llama import native

SAFE_MODE_SETTING = "safe_mode"
SAFE_MODE_TEXT = ("Safe mode runs llama.cpp on the CPU only, without extra weight layouts "
                  "(slower, but the plainest path llama.cpp has).")


class Banner(QFrame):
    """A message above the chat with buttons; it stays until a button closes it."""

    def __init__(self, text: str, buttons: list[tuple[str, Callable[[], None]]]) -> None:
        super().__init__()
        self.setObjectName("crash-banner")
        self.setStyleSheet("#crash-banner { background: #f8d7da; border: 1px solid #e0a0a6; }"
                           "#crash-banner QLabel { color: #58151c; }")
        row = QHBoxLayout(self)
        self.label = QLabel(text, wordWrap=True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        row.addWidget(self.label, 1)
        self.buttons: dict[str, QPushButton] = {}
        for title, action in buttons:
            b = QPushButton(title)
            b.clicked.connect(lambda _=False, a=action: self._press(a))
            row.addWidget(b)
            self.buttons[title] = b

    def _press(self, action: Callable[[], None]) -> None:
        self.hide()
        action()


def crash_banner(crash: native.Crash, store: object, load: Callable[[], None]) -> Banner:
    """What happened, and the way on: safe mode (kept in the settings) or the same again."""

    def safe() -> None:
        store.settings.set(SAFE_MODE_SETTING, True)  # type: ignore[attr-defined]
        native.set_safe_mode(True)
        load()

    if crash.safe_mode:
        text = (f"{crash.describe()} It crashed in safe mode too, so this build of llama.cpp "
                "cannot run here as it is: please report it with Help → Copy diagnostics.")
        return Banner(text, [("Try again", load)])
    text = (f"{crash.describe()} The model was not loaded again, so that it cannot crash at "
            f"every start. {SAFE_MODE_TEXT}")
    return Banner(text, [("Start in safe mode", safe), ("Try again normally", load)])


def safe_mode_banner(store: object) -> Banner:
    def leave() -> None:
        store.settings.set(SAFE_MODE_SETTING, False)  # type: ignore[attr-defined]

    return Banner(f"Safe mode is on ({native.safe_mode_reason()}). {SAFE_MODE_TEXT}",
                  [("Leave safe mode at the next start", leave)])
