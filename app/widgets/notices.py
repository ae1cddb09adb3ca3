"""Messages above the chat that stay until read: errors, warnings and notes, each with a close
button. The status line is for transient information only (it is easy to miss, and the model's
line fills it); whatever went wrong is said here. GUI thread only.
"""
from __future__ import annotations

from typing import Callable

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

STYLES = {
    "error": ("#f8d7da", "#58151c", "#e0a0a6"),
    "warning": ("#fff3cd", "#5c4400", "#e8d48a"),
    "info": ("#e7f1fb", "#1d2b36", "#c5dcf0"),
}
MAX_SHOWN = 6  # older ones leave first: the chat keeps its room


class Notice(QFrame):
    def __init__(self, text: str, kind: str,
                 action: tuple[str, Callable[[], None]] | None = None) -> None:
        super().__init__()
        self.kind = kind
        bg, fg, border = STYLES.get(kind, STYLES["warning"])
        self.setObjectName("notice")
        self.setStyleSheet(f"#notice {{ background: {bg}; border: 1px solid {border}; }}"
                           f"#notice QLabel {{ color: {fg}; }}")
        row = QHBoxLayout(self)
        row.setContentsMargins(8, 4, 4, 4)
        self.label = QLabel(text, wordWrap=True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        row.addWidget(self.label, 1)
        self.action_button: QPushButton | None = None
        if action is not None:  # e.g. Undo: done, and the notice goes
            name, do = action
            self.action_button = QPushButton(name)
            self.action_button.clicked.connect(do)
            self.action_button.clicked.connect(self.close_notice)
            row.addWidget(self.action_button, 0, Qt.AlignmentFlag.AlignTop)
        close = QToolButton(text="✕", toolTip="Close this message", autoRaise=True)
        close.clicked.connect(self.close_notice)
        row.addWidget(close, 0, Qt.AlignmentFlag.AlignTop)
        self.close_button = close

    def text(self) -> str:
        return self.label.text()

    def close_notice(self) -> None:
        self.hide()
        self.setParent(None)
        self.deleteLater()


class NoticeArea(QWidget):
    """A column of notices; `text()` is every shown notice's text (what tests and diagnostics
    read)."""

    def __init__(self) -> None:
        super().__init__()
        self._layout = QVBoxLayout(self)
        self._layout.setContentsMargins(0, 0, 0, 0)
        self._layout.setSpacing(4)
        self.hide()

    def notices(self) -> list[Notice]:
        return [n for n in self.findChildren(Notice) if n.parent() is self and not n.isHidden()]

    def add(self, text: str, kind: str = "warning",
            action: tuple[str, Callable[[], None]] | None = None,
            timeout_s: float = 0) -> Notice | None:
        """`action`: a button (its name, what it does) that closes the notice when pressed;
        `timeout_s`: the notice goes by itself after that long (0: when closed)."""
        text = text.strip()
        if not text:
            return None
        for n in self.notices():
            if n.text() == text and action is None:  # said already: once is enough
                return n
        notice = Notice(text, kind, action)
        notice.close_button.clicked.connect(self._update)
        if notice.action_button is not None:
            notice.action_button.clicked.connect(self._update)
        if timeout_s:
            QTimer.singleShot(int(timeout_s * 1000), notice, lambda: self._expire(notice))
        self._layout.addWidget(notice)
        notice.show()  # now: a layout shows a child it gets later only on the next event loop pass
        shown = self.notices()
        for old in shown[:-MAX_SHOWN]:
            old.close_notice()
        self.show()
        return notice

    def _expire(self, notice: Notice) -> None:
        notice.close_notice()
        self._update()

    def remove_matching(self, fragment: str) -> None:
        """Close notices that are no longer true (e.g. a load error once a model loaded)."""
        for n in self.notices():
            if fragment in n.text():
                n.close_notice()
        self._update()

    def text(self) -> str:
        return " ".join(n.text() for n in self.notices())

    def _update(self) -> None:
        self.setVisible(bool([n for n in self.notices() if n.isVisibleTo(self) or not n.isHidden()]))
