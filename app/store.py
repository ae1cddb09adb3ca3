"""Conversations, messages, attachments, per-reply stats and settings in SQLite (WAL).

Images are stored once, named by content hash, under the data folder. The user's message is
committed before the reply starts and the reply when it ends, so a crash loses at most the reply
in progress. GUI thread only (SQLite connections are per thread). No Qt here.
"""
from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY, title TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL, text TEXT NOT NULL, created REAL NOT NULL, stats TEXT);
CREATE TABLE IF NOT EXISTS attachments (
    message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
    position INTEGER NOT NULL, sha256 TEXT NOT NULL, filename TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""


@dataclass
class Message:
    id: int
    role: str
    text: str
    images: list[Path] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class Conversation:
    id: int
    title: str
    updated: float


class Store:
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.images_dir = self.folder / "images"
        self.images_dir.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.folder / "ebb.sqlite3")
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)
        self.db.commit()

    def close(self) -> None:
        self.db.close()

    # ------------------------------------------------------------ conversations

    def conversations(self, search: str = "") -> list[Conversation]:
        rows = self.db.execute(
            "SELECT id, title, updated FROM conversations WHERE title LIKE ? ORDER BY updated DESC",
            (f"%{search}%",)).fetchall()
        return [Conversation(*r) for r in rows]

    def create_conversation(self, title: str = "New chat") -> int:
        now = time.time()
        with self.db:
            cur = self.db.execute("INSERT INTO conversations (title, created, updated) VALUES (?,?,?)",
                                  (title, now, now))
        return int(cur.lastrowid or 0)

    def rename(self, conversation_id: int, title: str) -> None:
        with self.db:
            self.db.execute("UPDATE conversations SET title=? WHERE id=?", (title.strip() or "Chat",
                                                                             conversation_id))

    def delete(self, conversation_id: int) -> None:
        with self.db:
            self.db.execute("DELETE FROM conversations WHERE id=?", (conversation_id,))
        self._drop_unused_images()

    def title(self, conversation_id: int) -> str:
        row = self.db.execute("SELECT title FROM conversations WHERE id=?", (conversation_id,)).fetchone()
        return str(row[0]) if row else ""

    # ------------------------------------------------------------ messages

    def store_image(self, path: Path) -> tuple[str, str]:
        """Copy an image into the store once (by content hash); returns (sha256, filename)."""
        data = Path(path).read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        name = sha + (Path(path).suffix.lower() or ".img")
        target = self.images_dir / name
        if not target.exists():
            tmp = target.with_suffix(".part")
            tmp.write_bytes(data)
            tmp.replace(target)
        return sha, name

    def add_message(self, conversation_id: int, role: str, text: str,
                    images: list[Path] | None = None, stats: dict[str, Any] | None = None) -> int:
        stored = [self.store_image(p) for p in images or []]
        now = time.time()
        with self.db:
            cur = self.db.execute(
                "INSERT INTO messages (conversation_id, role, text, created, stats) VALUES (?,?,?,?,?)",
                (conversation_id, role, text, now, json.dumps(stats or {})))
            mid = int(cur.lastrowid or 0)
            self.db.executemany(
                "INSERT INTO attachments (message_id, position, sha256, filename) VALUES (?,?,?,?)",
                [(mid, i, sha, name) for i, (sha, name) in enumerate(stored)])
            self.db.execute("UPDATE conversations SET updated=? WHERE id=?", (now, conversation_id))
        return mid

    def update_message(self, message_id: int, text: str, stats: dict[str, Any]) -> None:
        """A reply that went on (Continue): its whole text and its stats now."""
        with self.db:
            self.db.execute("UPDATE messages SET text=?, stats=? WHERE id=?",
                            (text, json.dumps(stats), message_id))

    def message(self, message_id: int) -> Message | None:
        row = self.db.execute("SELECT conversation_id FROM messages WHERE id=?",
                              (message_id,)).fetchone()
        if row is None:
            return None
        return next((m for m in self.messages(int(row[0]), message_id)), None)

    def last_message_id(self, conversation_id: int) -> int:
        row = self.db.execute("SELECT MAX(id) FROM messages WHERE conversation_id=?",
                              (conversation_id,)).fetchone()
        return int(row[0] or 0)

    def message_ids(self, conversation_id: int) -> list[int]:
        return [int(r[0]) for r in self.db.execute(
            "SELECT id FROM messages WHERE conversation_id=? ORDER BY id", (conversation_id,))]

    def n_messages(self, conversation_id: int) -> int:
        row = self.db.execute("SELECT COUNT(*) FROM messages WHERE conversation_id=?",
                              (conversation_id,)).fetchone()
        return int(row[0])

    def delete_message(self, message_id: int) -> None:
        with self.db:
            self.db.execute("DELETE FROM messages WHERE id=?", (message_id,))

    def messages(self, conversation_id: int, only: int | None = None) -> list[Message]:
        """The conversation's messages in order (or only the message `only`): two queries
        however long it is."""
        where: str = "conversation_id=?"
        args: tuple[int, ...] = (conversation_id,)
        if only is not None:
            where, args = "conversation_id=? AND id=?", (conversation_id, only)
        out = [Message(mid, role, text, [], json.loads(stats or "{}")) for mid, role, text, stats
               in self.db.execute(f"SELECT id, role, text, stats FROM messages WHERE {where} "
                                  "ORDER BY id", args)]
        by_id = {m.id: m for m in out}
        for mid, name in self.db.execute(
                "SELECT a.message_id, a.filename FROM attachments a JOIN messages m "
                f"ON m.id = a.message_id WHERE m.{where.replace(' AND id', ' AND m.id')} "
                "ORDER BY a.message_id, a.position", args):
            by_id[mid].images.append(self.images_dir / name)
        return out

    def _drop_unused_images(self) -> None:
        used = {name for (name,) in self.db.execute("SELECT DISTINCT filename FROM attachments")}
        for f in self.images_dir.iterdir():
            if f.is_file() and f.name not in used:
                f.unlink(missing_ok=True)

    # ------------------------------------------------------------ settings

    def setting(self, key: str, default: Any = None) -> Any:
        row = self.db.execute("SELECT value FROM settings WHERE key=?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    def set_setting(self, key: str, value: Any) -> None:
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO settings (key, value) VALUES (?,?)",
                            (key, json.dumps(value)))
