"""The window's left column: New chat, the search box and the list of conversations, with each
one's menu (Rename…, Export…, Delete…).

It changes which conversation is open through ChatState (app/core/chat_state.py) and says so with
`opened`; the window then sends that conversation to the engine and draws it. GUI thread only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from PySide6.QtCore import QPoint, Qt, Signal
from PySide6.QtWidgets import (
    QFileDialog,
    QInputDialog,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.core.chat_state import ChatState
from app.core.store import Store
from engine.errors import EbbError


class ConversationList(QWidget):
    opened = Signal()  # another conversation is open (chosen, new, or the open one deleted)
    deleted = Signal(int)  # a chat went to the trash (the window offers Undo)

    def __init__(self, store: Store, chat: ChatState, show_error: Callable[[str], None],
                 say: Callable[[str, int], None]) -> None:
        super().__init__()
        self.store, self.chat = store, chat
        self._show_error, self._say = show_error, say  # an error above the chat; the status line
        self.setMinimumWidth(170)
        # a search result opened: the message found and the words to mark (taken by the window)
        self.found: tuple[int, list[str]] | None = None
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
            item.setData(Qt.ItemDataRole.UserRole + 1, c.match_id)
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

    def _on_selected(self, item: QListWidgetItem | None, _prev: QListWidgetItem | None) -> None:
        if item is None:
            return
        self.open_item(item)

    def open_item(self, item: QListWidgetItem) -> None:
        """Open a chat; a search's result opens on the branch where the words were found."""
        match_id = int(item.data(Qt.ItemDataRole.UserRole + 1) or 0)
        if not self.chat.select(int(item.data(Qt.ItemDataRole.UserRole))):
            self._say("A reply is being written: Stop it, or wait, to open another chat", 8000)
            return
        self.found = None
        if match_id:
            try:
                self.store.open_branch(match_id)
            except EbbError as exc:
                self._show_error(str(exc))
            self.found = (match_id, self.search.text().split())
        self.opened.emit()

    def take_found(self) -> tuple[int, list[str]] | None:
        found, self.found = self.found, None
        return found

    def _on_menu(self, pos: QPoint) -> None:
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
            elif chosen is delete:
                self.delete_chat(cid)
        except EbbError as exc:  # a full disk
            self._show_error(str(exc))
        self.refresh()

    def delete_chat(self, cid: int) -> bool:
        """Into the trash, with Undo (the window's notice); the chat a reply is being written
        into is not deleted: the user is told to stop it first."""
        if self.chat.busy and cid == self.chat.conv_id:
            self._show_error(f"“{self.store.title(cid)}” is writing a reply: Stop it first, "
                             "then delete the chat.")
            return False
        went_open = self.chat.delete(cid)
        self.refresh()
        self.deleted.emit(cid)
        if went_open:
            self.opened.emit()  # the open one went: another is open now
        return True

    def undo_delete(self, cid: int) -> None:
        try:
            if not self.chat.undo_delete(cid):  # busy elsewhere: back in the list, not opened
                self._say(f"“{self.store.title(cid)}” is back in the list", 8000)
                self.refresh()
                return
        except EbbError as exc:
            self._show_error(str(exc))
            return
        self.refresh()
        self.opened.emit()

    def export_chat(self, cid: int, path: str | None = None, every_branch: bool = False) -> Path | None:
        """The chat as Markdown or JSON (by the file's extension), the open branch or every
        branch, where the user says (starting in their documents folder); its pictures are
        copied into a folder beside the file."""
        from app.core.export import export_chat
        from app.core.settings import chat_params

        if path is None:
            from app.widgets.start_folder import start_file

            safe = "".join(ch if ch.isalnum() or ch in " -_" else "_" for ch in self.store.title(cid))
            start = start_file(f"{safe.strip() or 'chat'}.md")
            path, chosen = QFileDialog.getSaveFileName(
                self, "Export chat", start, ";;".join(EXPORT_FILTERS))
            if not path:
                return None
            every_branch = "every branch" in chosen
        out = Path(path)
        params = chat_params(self.store, cid).to_dict()
        meta = {"system_prompt": params.pop("system_prompt"), "sampling": params}
        try:
            export_chat(self.store, cid, out, every_branch, meta)
        except OSError as exc:
            self._show_error(f"Could not export the chat to {out}: {exc.strerror or exc}")
            return None
        self._say(f"Exported to {out}", 8000)
        return out


EXPORT_FILTERS = ("Markdown (*.md)", "JSON (*.json)", "Markdown, every branch (*.md)",
                  "JSON, every branch (*.json)")
