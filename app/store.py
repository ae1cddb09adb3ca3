"""Conversations, messages, attachments, per-reply stats and settings in SQLite (WAL).

Images are stored once, named by content hash, under the data folder. The user's message is
committed before the reply starts; the reply is committed while it streams (state `streaming`)
and marked `complete` at its end, so a crash loses at most the last second of a reply, and the
next start shows it as `interrupted`. GUI thread only (SQLite connections are per thread).

A data folder gone bad never stops the window: a damaged database, or one from a newer Ebb, is
moved aside with a timestamp (never written over) and what can be read of it is copied into a
fresh one; a folder that cannot be written (read-only, full disk) gives a store in memory
holding what could be read. `problem` says what happened and where, for the window to show.
A write that fails later (a full disk) raises StoreError with a message for the user; nothing
half-written is left in the images folder. No Qt here.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sqlite3
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from engine.errors import EbbError

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY, title TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL, text TEXT NOT NULL, created REAL NOT NULL, stats TEXT,
    state TEXT NOT NULL DEFAULT 'complete');
CREATE TABLE IF NOT EXISTS attachments (
    message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
    position INTEGER NOT NULL, sha256 TEXT NOT NULL, filename TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""
# full-text search over the messages (SQLite's FTS5), kept by triggers; a SQLite without FTS5
# searches titles and messages with LIKE instead
FTS_SCHEMA = """
CREATE VIRTUAL TABLE IF NOT EXISTS messages_fts USING fts5(text, content='messages', content_rowid='id');
CREATE TRIGGER IF NOT EXISTS messages_fts_ai AFTER INSERT ON messages BEGIN
  INSERT INTO messages_fts(rowid, text) VALUES (new.id, new.text); END;
CREATE TRIGGER IF NOT EXISTS messages_fts_ad AFTER DELETE ON messages BEGIN
  INSERT INTO messages_fts(messages_fts, rowid, text) VALUES ('delete', old.id, old.text); END;
CREATE TRIGGER IF NOT EXISTS messages_fts_au AFTER UPDATE OF text ON messages BEGIN
  INSERT INTO messages_fts(messages_fts, rowid, text) VALUES ('delete', old.id, old.text);
  INSERT INTO messages_fts(rowid, text) VALUES (new.id, new.text); END;
"""
SCHEMA_VERSION = 3  # 1: no user_version (before `state`); 2: messages.state; 3: messages_fts
DB_NAME = "ebb.sqlite3"
# columns copied when what can be read of a bad database is saved
SALVAGE = {"conversations": ("id", "title", "created", "updated"),
           "messages": ("id", "conversation_id", "role", "text", "created", "stats"),
           "attachments": ("message_id", "position", "sha256", "filename"),
           "settings": ("key", "value")}


class StoreError(EbbError):
    """A write the store could not make (e.g. the disk is full): a message for the user."""


def _write_error(what: str, exc: BaseException, folder: Path) -> StoreError:
    text = str(exc)
    if "full" in text or getattr(exc, "errno", None) == 28:
        why = "the disk is full"
    elif "readonly" in text or "read-only" in text or isinstance(exc, PermissionError):
        why = "the data folder cannot be written"
    else:
        why = text
    return StoreError(f"could not save {what}: {why} ({folder})")


@dataclass
class Message:
    id: int
    role: str
    text: str
    images: list[Path] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    state: str = "complete"  # streaming (being written) | interrupted (Ebb stopped) | complete


@dataclass
class Conversation:
    id: int
    title: str
    updated: float
    match: str = ""  # with a search: the first matching line of its messages


class Store:
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.images_dir = self.folder / "images"
        self.problem: str | None = None  # what went wrong with the data folder, for the window
        self.in_memory = False
        path = self.folder / DB_NAME
        try:
            self.images_dir.mkdir(parents=True, exist_ok=True)
            self.db = self._open(path)
        except sqlite3.DatabaseError as exc:  # damaged, not a database, or from a newer Ebb
            if _is_write_failure(exc):
                self._open_in_memory(path, exc)
            else:
                self._set_aside(path, exc)
        except OSError as exc:  # the folder cannot be made or written
            self._open_in_memory(path, exc)
        self.recovered = self._mark_interrupted()

    def _open(self, path: Path) -> sqlite3.Connection:
        db = sqlite3.connect(path)
        try:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise sqlite3.DatabaseError(f"it was written by a newer version of Ebb "
                                            f"(schema {version}, this one knows {SCHEMA_VERSION})")
            check = db.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise sqlite3.DatabaseError(f"it is damaged ({check})")
            db.execute("PRAGMA journal_mode=WAL")
            # a commit reaches the OS (a killed process loses nothing) without waiting for the
            # disk (fsync at checkpoints only): the streaming reply's commits never stall the GUI
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA foreign_keys=ON")
            db.executescript(SCHEMA)
            cols = {r[1] for r in db.execute("PRAGMA table_info(messages)")}
            if "state" not in cols:  # a database from before crash-safe replies
                db.execute("ALTER TABLE messages ADD COLUMN state TEXT NOT NULL DEFAULT 'complete'")
            _add_fts(db, rebuild=version < 3)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            db.commit()
        except BaseException:
            db.close()
            raise
        return db

    def _set_aside(self, path: Path, exc: BaseException) -> None:
        """Move the bad database aside (with its WAL), start a fresh one, copy in what can be
        read of the old one."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = path.with_name(f"{path.name}.bad-{stamp}")
        try:
            path.replace(aside)
            for suffix in ("-wal", "-shm"):
                extra = path.with_name(path.name + suffix)
                if extra.exists():
                    extra.replace(aside.with_name(aside.name + suffix))
            self.db = self._open(path)
        except (OSError, sqlite3.DatabaseError) as exc2:
            self._open_in_memory(path, exc2)
            return
        n_conv, n_msg = _salvage(aside, self.db)
        self.problem = (f"The conversation database {path} could not be used: {_reason(exc)}. "
                        f"It was moved aside to {aside.name} (kept, never written over). "
                        + (f"{n_conv} conversations with {n_msg} messages could be read from it "
                           "and are shown." if n_conv else "Nothing could be read from it."))

    def _open_in_memory(self, path: Path, exc: BaseException) -> None:
        """The folder cannot be written: a store in memory, with what can be read of the one
        on disk; nothing is saved."""
        self.in_memory = True
        self.db = sqlite3.connect(":memory:")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)
        _add_fts(self.db, rebuild=False)
        self.db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        n_conv = 0
        if path.exists():
            n_conv, _ = _salvage(path, self.db)
        if not os.access(self.images_dir, os.W_OK):  # new images go to a temporary folder
            self.images_dir = Path(tempfile.mkdtemp(prefix="ebb-images-"))
            old = self.folder / "images"
            if old.is_dir():
                for f in old.iterdir():
                    with contextlib.suppress(OSError):
                        shutil.copy2(f, self.images_dir / f.name)
        self.problem = (f"The data folder {self.folder} cannot be written ({_reason(exc)}): "
                        "nothing in this session will be saved. "
                        + (f"{n_conv} conversations could be read and are shown. " if n_conv else "")
                        + "Free some space or fix the folder's permissions, then start Ebb again.")

    @contextlib.contextmanager
    def _writing(self, what: str) -> Iterator[None]:
        """One transaction; a failure (a full disk) is a StoreError saying so."""
        try:
            with self.db:
                yield
        except sqlite3.DatabaseError as exc:
            raise _write_error(what, exc, self.folder) from None

    def _mark_interrupted(self) -> int:
        """Replies that were being written when Ebb stopped: shown as interrupted."""
        try:
            with self.db:
                cur = self.db.execute("UPDATE messages SET state='interrupted' WHERE state='streaming'")
            return int(cur.rowcount or 0)
        except sqlite3.DatabaseError:
            return 0

    def close(self) -> None:
        self.db.close()

    # ------------------------------------------------------------ conversations

    def conversations(self, search: str = "") -> list[Conversation]:
        """Newest first; with `search`, those whose title or any message holds every word of it,
        each with the first matching line of its messages (`match`)."""
        if not search.strip():
            rows = self.db.execute("SELECT id, title, updated FROM conversations "
                                   "ORDER BY updated DESC").fetchall()
            return [Conversation(*r) for r in rows]
        words = search.split()
        matches: dict[int, str] = {}
        try:
            query = " ".join('"' + w.replace('"', '""') + '"' for w in words) + "*"
            for cid, snippet in self.db.execute(
                    "SELECT m.conversation_id, snippet(messages_fts, 0, '', '', '…', 12) "
                    "FROM messages_fts JOIN messages m ON m.id = messages_fts.rowid "
                    "WHERE messages_fts MATCH ? ORDER BY m.id", (query,)):
                matches.setdefault(int(cid), " ".join(str(snippet).split()))
        except sqlite3.OperationalError:  # no FTS5 here: LIKE, every word
            like = " AND ".join("text LIKE ?" for _ in words)
            for cid, text in self.db.execute(f"SELECT conversation_id, text FROM messages WHERE {like} "
                                             "ORDER BY id", [f"%{w}%" for w in words]):
                matches.setdefault(int(cid), _line_with(str(text), words[0]))
        title_like = " AND ".join("title LIKE ?" for _ in words)
        by_title = {int(r[0]) for r in self.db.execute(
            f"SELECT id FROM conversations WHERE {title_like}", [f"%{w}%" for w in words])}
        listed = self.db.execute("SELECT id, title, updated FROM conversations ORDER BY updated DESC")
        return [Conversation(r[0], r[1], r[2], matches.get(int(r[0]), ""))
                for r in listed if int(r[0]) in by_title or int(r[0]) in matches]

    def export(self, conversation_id: int, fmt: str) -> str:
        """A conversation as Markdown (`md`) or JSON (`json`): every message, images by path."""
        title = self.title(conversation_id)
        msgs = self.messages(conversation_id)
        if fmt == "json":
            return json.dumps({"title": title, "messages": [
                {"role": m.role, "text": m.text, "images": [str(p) for p in m.images],
                 "stats": m.stats, "state": m.state} for m in msgs]}, indent=1, ensure_ascii=False)
        out = [f"# {title}", ""]
        for m in msgs:
            out += [f"## {'You' if m.role == 'user' else 'Ebb'}", ""]
            out += [f"![image]({p.as_uri()})" for p in m.images]
            out += [m.text, ""]
        return "\n".join(out)

    def create_conversation(self, title: str = "New chat") -> int:
        now = time.time()
        with self._writing("the new chat"):
            cur = self.db.execute("INSERT INTO conversations (title, created, updated) VALUES (?,?,?)",
                                  (title, now, now))
        return int(cur.lastrowid or 0)

    def rename(self, conversation_id: int, title: str) -> None:
        with self._writing("the title"):
            self.db.execute("UPDATE conversations SET title=? WHERE id=?", (title.strip() or "Chat",
                                                                             conversation_id))

    def delete(self, conversation_id: int) -> None:
        with self._writing("the deletion"):
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
            try:
                tmp.write_bytes(data)
                tmp.replace(target)
            except OSError as exc:
                tmp.unlink(missing_ok=True)  # nothing half-written is left behind
                raise _write_error("the image", exc, self.folder) from None
        return sha, name

    def add_message(self, conversation_id: int, role: str, text: str,
                    images: list[Path] | None = None, stats: dict[str, Any] | None = None,
                    state: str = "complete") -> int:
        """Save a message (StoreError when it cannot be: nothing of it is kept then)."""
        stored = [self.store_image(p) for p in images or []]
        now = time.time()
        try:
            with self.db:
                cur = self.db.execute(
                    "INSERT INTO messages (conversation_id, role, text, created, stats, state) "
                    "VALUES (?,?,?,?,?,?)",
                    (conversation_id, role, text, now, json.dumps(stats or {}), state))
                mid = int(cur.lastrowid or 0)
                self.db.executemany(
                    "INSERT INTO attachments (message_id, position, sha256, filename) VALUES (?,?,?,?)",
                    [(mid, i, sha, name) for i, (sha, name) in enumerate(stored)])
                self.db.execute("UPDATE conversations SET updated=? WHERE id=?", (now, conversation_id))
        except sqlite3.DatabaseError as exc:
            raise _write_error("the message", exc, self.folder) from None
        return mid

    def update_message(self, message_id: int, text: str, stats: dict[str, Any] | None = None,
                       state: str = "complete") -> None:
        """A reply as it stands: while it streams (`streaming`, stats kept), or whole."""
        try:
            with self.db:
                if stats is None:
                    self.db.execute("UPDATE messages SET text=?, state=? WHERE id=?",
                                    (text, state, message_id))
                else:
                    self.db.execute("UPDATE messages SET text=?, stats=?, state=? WHERE id=?",
                                    (text, json.dumps(stats), state, message_id))
        except sqlite3.DatabaseError as exc:
            raise _write_error("the reply", exc, self.folder) from None

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

    def has_messages(self) -> bool:
        """Whether any conversation holds a message (the first start's welcome shows until
        one does)."""
        return bool(self.db.execute("SELECT EXISTS(SELECT 1 FROM messages)").fetchone()[0] == 1)

    def delete_message(self, message_id: int) -> None:
        with self._writing("the deletion"):
            self.db.execute("DELETE FROM messages WHERE id=?", (message_id,))

    def messages(self, conversation_id: int, only: int | None = None) -> list[Message]:
        """The conversation's messages in order (or only the message `only`): two queries
        however long it is."""
        where: str = "conversation_id=?"
        args: tuple[int, ...] = (conversation_id,)
        if only is not None:
            where, args = "conversation_id=? AND id=?", (conversation_id, only)
        out = [Message(mid, role, text, [], json.loads(stats or "{}"), state)
               for mid, role, text, stats, state
               in self.db.execute(f"SELECT id, role, text, stats, state FROM messages WHERE {where} "
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
        with self._writing("the setting"):
            self.db.execute("INSERT OR REPLACE INTO settings (key, value) VALUES (?,?)",
                            (key, json.dumps(value)))


def _is_write_failure(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(w in text for w in ("disk is full", "readonly", "read-only", "unable to open",
                                   "disk i/o error"))


def _reason(exc: BaseException) -> str:
    text = str(exc)
    if "file is not a database" in text:
        return "it is not a database (the file was overwritten or is not Ebb's)"
    if "malformed" in text:
        return "it is damaged"
    if "disk is full" in text or getattr(exc, "errno", None) == 28:
        return "the disk is full"
    return text


def _add_fts(db: sqlite3.Connection, rebuild: bool) -> None:
    """The full-text index (if this SQLite has FTS5); filled from the messages when new."""
    try:
        db.executescript(FTS_SCHEMA)
        if rebuild:
            db.execute("INSERT INTO messages_fts(messages_fts) VALUES ('rebuild')")
    except sqlite3.OperationalError:
        pass


def _line_with(text: str, word: str) -> str:
    low = word.lower()
    for line in text.splitlines():
        if low in line.lower():
            return " ".join(line.split())[:120]
    return ""


def _salvage(bad: Path, into: sqlite3.Connection) -> tuple[int, int]:
    """Copy what can be read of a bad database into `into`, table by table and, where a read
    fails part way, row by row. Returns (conversations, messages) copied."""
    with tempfile.TemporaryDirectory(prefix="ebb-salvage-") as tmp:
        # read a copy (with its WAL, so the newest commits count): SQLite never touches the
        # original, which may sit in a folder that cannot be written
        copy = Path(tmp) / "copy.sqlite3"
        try:
            shutil.copyfile(bad, copy)
            wal = bad.with_name(bad.name + "-wal")
            if wal.exists():
                shutil.copyfile(wal, copy.with_name(copy.name + "-wal"))
            src = sqlite3.connect(copy)
        except (OSError, sqlite3.DatabaseError):
            try:
                src = sqlite3.connect(f"file:{bad}?mode=ro&immutable=1", uri=True)
            except sqlite3.DatabaseError:
                return 0, 0
        # as sqlite3's .dump does: a schema that names pages past a truncated end (an index
        # there) must not stop the tables that can still be read
        with contextlib.suppress(sqlite3.DatabaseError):
            src.execute("PRAGMA writable_schema=ON")
        return _copy_rows(src, into)


def _copy_rows(src: sqlite3.Connection, into: sqlite3.Connection) -> tuple[int, int]:
    try:
        for table, cols in SALVAGE.items():
            rows = _readable_rows(src, table, cols)
            if not rows:
                continue
            marks = ",".join("?" * len(cols))
            with into:
                into.execute("PRAGMA foreign_keys=OFF")
                for row in rows:
                    with contextlib.suppress(sqlite3.DatabaseError):
                        into.execute(f"INSERT OR IGNORE INTO {table} ({','.join(cols)}) VALUES ({marks})", row)
                into.execute("PRAGMA foreign_keys=ON")
        with into:  # rows whose parents could not be read are of no use
            into.execute("DELETE FROM messages WHERE conversation_id NOT IN (SELECT id FROM conversations)")
            into.execute("DELETE FROM attachments WHERE message_id NOT IN (SELECT id FROM messages)")
        n_conv = into.execute("SELECT COUNT(*) FROM conversations").fetchone()[0]
        n_msg = into.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
        return int(n_conv), int(n_msg)
    finally:
        src.close()


def _readable_rows(src: sqlite3.Connection, table: str, cols: tuple[str, ...]) -> list[tuple[Any, ...]]:
    """Every row that can be read, as sqlite3's .dump reads a damaged table: forwards until a
    bad page, backwards from the end until one, then row by row in between."""
    select = f"SELECT rowid, {','.join(cols)} FROM {table}"
    rows: dict[int, tuple[Any, ...]] = {}

    def scan(sql: str) -> bool:
        try:
            for r in src.execute(sql):
                rows[int(r[0])] = tuple(r[1:])
        except sqlite3.DatabaseError:
            return False
        return True

    if scan(select):
        return [rows[k] for k in sorted(rows)]
    scan(f"{select} ORDER BY rowid DESC")
    try:
        top = int(src.execute(f"SELECT max(rowid) FROM {table}").fetchone()[0] or 0)
    except sqlite3.DatabaseError:
        top = 20_000
    for rowid in range(1, min(max([top, *rows]), 1_000_000) + 1):
        if rowid in rows:
            continue
        try:
            r = src.execute(f"{select} WHERE rowid=?", (rowid,)).fetchone()
        except sqlite3.DatabaseError:
            continue
        if r is not None:
            rows[int(r[0])] = tuple(r[1:])
    return [rows[k] for k in sorted(rows)]
