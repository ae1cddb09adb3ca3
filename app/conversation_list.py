"""The window's left column: New chat, the search box and the list of conversations, with each
one's menu (Rename…, Export…, Delete…).

It changes which conversation is open through ChatState (app/chat_state.py) and says so with
`opened`; the window then sends that conversation to the engine and draws it. GUI thread only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QFileDialog,
    QInputDialog,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QMessageBox,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.chat_state import ChatState
from app.store import Store
from engine.errors import EbbError


class ConversationList(QWidget):
    opened = Signal()  # another conversation is open (chosen, new, or the open one deleted)

    def __init__(self, store: Store, chat: ChatState, show_error: Callable[[str], None],
                 say: Callable[[str, int], None]) -> None:
        super().__init__()
        self.store, self.chat = store, chat
        self._show_error, self._say = show_error, say  # an error above the chat; the status line
        self.setMinimumWidth(170)
        self.search = QLineEdit(placeholderText="Search chats")
        self.search.textChanged.connect(self.refresh)
        self.list = QListWidget()
        # a long title is cut with "…" (whole in its tooltip), never scrolled sideways
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.currentItemChanged.connect(self._on_selected)
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.customContextMenuRequested.connect(self._on_menu)
        layout = QVBoxLayout(self)
        layout.addWidget(QPushButton("New chat", clicked=self.new_chat))
        layout.addWidget(self.search)
        layout.addWidget(self.list, 1)

    def refresh(self) -> None:
        """The list afresh from the store (a new title, a search, a rename), the open one current."""
        self.list.blockSignals(True)
        self.list.clear()
        for c in self.store.conversations(self.search.text()):
            # a search shows the line that matched under the title
            item = QListWidgetItem(f"{c.title}\n  {c.match}" if c.match else c.title, self.list)
            item.setToolTip(f"{c.title}\n{c.match}" if c.match else c.title)
            item.setData(Qt.ItemDataRole.UserRole, c.id)
            if c.id == self.chat.conv_id:
                self.list.setCurrentItem(item)
        self.list.blockSignals(False)

    def new_chat(self) -> None:
        try:
            if not self.chat.new_conversation():
                return
        except EbbError as exc:  # a full disk
            self._show_error(str(exc))
            return
        self.refresh()
        self.opened.emit()

    def _on_selected(self, item: QListWidgetItem | None, _prev: Any) -> None:
        if item is not None and self.chat.select(int(item.data(Qt.ItemDataRole.UserRole))):
            self.opened.emit()

    def _on_menu(self, pos: Any) -> None:
        item = self.list.itemAt(pos)
        if item is None:
            return
        cid = int(item.data(Qt.ItemDataRole.UserRole))
        menu = QMenu(self)
        rename = menu.addAction("Rename…")
        export = menu.addAction("Export…")
        delete = menu.addAction("Delete…")
        chosen = menu.exec(self.list.mapToGlobal(pos))
        try:
            if chosen is rename:
                title, ok = QInputDialog.getText(self, "Rename chat", "Title", text=self.store.title(cid))
                if ok:
                    self.store.rename(cid, title)
            elif chosen is export:
                self.export_chat(cid)
            elif chosen is delete and self.confirm_delete(cid) and self.chat.delete(cid):
                self.opened.emit()  # the open one went: another is open now
        except EbbError as exc:  # a full disk
            self._show_error(str(exc))
        self.refresh()

    def confirm_delete(self, cid: int) -> bool:
        """Deleting cannot be undone: ask, naming the chat and its messages."""
        n = self.store.n_messages(cid)
        answer = QMessageBox.question(
            self, "Delete chat", f"Delete “{self.store.title(cid)}” and its {n} message"
            f"{'' if n == 1 else 's'}? This cannot be undone (Export… keeps a copy).",
            QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
            QMessageBox.StandardButton.No)
        return answer == QMessageBox.StandardButton.Yes

    def export_chat(self, cid: int, path: str | None = None) -> Path | None:
        """The chat as Markdown or JSON (by the file's extension), where the user says."""
        if path is None:
            safe = "".join(ch if ch.isalnum() or ch in " -_" else "_" for ch in self.store.title(cid))
            path, _ = QFileDialog.getSaveFileName(self, "Export chat", f"{safe.strip() or 'chat'}.md",
                                                  "Markdown (*.md);;JSON (*.json)")
            if not path:
                return None
        out = Path(path)
        try:
            out.write_text(self.store.export(cid, "json" if out.suffix.lower() == ".json" else "md"))
        except OSError as exc:
            self._show_error(f"Could not export the chat to {out}: {exc.strerror or exc}")
            return None
        self._say(f"Exported to {out}", 8000)
        return out
