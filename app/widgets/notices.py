"""Messages above the chat that stay until read: errors, warnings and notes, each with a close
button. The status line is for transient information only (it is easy to miss, and the model's
line fills it); whatever went wrong is said here. GUI thread only.
"""
from __future__ import annotations

from typing import Callable

from PySide6.QtCore import QSize, Qt, QTimer
from PySide6.QtGui import QResizeEvent
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

STYLES = {
    "error": ("#f8d7da", "#58151c", "#e0a0a6"),
    "warning": ("#fff3cd", "#5c4400", "#e8d48a"),
    "info": ("#e7f1fb", "#1d2b36", "#c5dcf0"),
}
MAX_SHOWN = 3  # older ones leave first: the chat keeps its room
SHARE_OF_WINDOW = 0.3  # more than this share of the window's height scrolls inside the area
CAUSE_CHARS = 80  # a notice's cause: its words before the first colon within this many


def cause_of(text: str) -> str:
    """What a notice is about, to keep one per cause: the words before its first colon ("Could
    not regenerate the reply: ..."), else all of it."""
    head, colon, _rest = text.partition(":")
    return head.strip() if colon and len(head) <= CAUSE_CHARS else text.strip()


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


class NoticeArea(QScrollArea):
    """A column of notices, newest first, one per cause, at most MAX_SHOWN; taller than
    SHARE_OF_WINDOW of the window, it scrolls (the chat below keeps its room). `text()` is every
    shown notice's text (what tests and diagnostics read)."""

    def __init__(self) -> None:
        super().__init__(widgetResizable=True, frameShape=QFrame.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Maximum)
        self._column = QWidget()
        self._layout = QVBoxLayout(self._column)
        self._layout.setContentsMargins(0, 0, 0, 0)
        self._layout.setSpacing(4)
        self.setWidget(self._column)
        self.hide()

    def sizeHint(self) -> QSize:
        want = self._column.sizeHint()
        width = self.viewport().width()
        height = (self._layout.totalHeightForWidth(width) if self._layout.hasHeightForWidth()
                  else want.height())  # wrapped at the width it has
        window = self.window()
        cap = int(window.height() * SHARE_OF_WINDOW) if window is not self else height
        return QSize(want.width(), max(0, min(height, max(cap, 60))))

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        self.updateGeometry()

    def notices(self) -> list[Notice]:
        """The shown notices, newest first."""
        items = (self._layout.itemAt(i) for i in range(self._layout.count()))
        widgets = (it.widget() for it in items if it is not None)
        return [n for n in widgets if isinstance(n, Notice) and not n.isHidden()]

    def add(self, text: str, kind: str = "warning",
            action: tuple[str, Callable[[], None]] | None = None,
            timeout_s: float = 0) -> Notice | None:
        """`action`: a button (its name, what it does) that closes the notice when pressed;
        `timeout_s`: the notice goes by itself after that long (0: when closed)."""
        text = text.strip()
        if not text:
            return None
        for n in self.notices():
            if action is None and n.action_button is None and cause_of(n.text()) == cause_of(text):
                n.close_notice()  # the newest word on the same thing replaces the older one, on top
        notice = Notice(text, kind, action)
        notice.close_button.clicked.connect(self._update)
        if notice.action_button is not None:
            notice.action_button.clicked.connect(self._update)
        if timeout_s:  # a timer of the notice's own, gone with it (not QTimer.singleShot:
            # with a delay, PySide makes a timer that deletes itself later; the suite once
            # crashed in one whose Python wrapper had gone before it)
            QTimer(notice, singleShot=True, interval=int(timeout_s * 1000),
                   timeout=lambda: self._expire(notice)).start()
        self._layout.insertWidget(0, notice)  # newest first
        notice.show()  # now: a layout shows a child it gets later only on the next event loop pass
        for old in self.notices()[MAX_SHOWN:]:
            old.close_notice()
        self.show()
        self.verticalScrollBar().setValue(0)
        self.updateGeometry()
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
        self.setVisible(bool(self.notices()))
        self.updateGeometry()
