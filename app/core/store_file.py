"""The conversation database as a file: its schema and the migrations from every older one,
opened checked; a bad one moved aside (never written over) and what can be read of it copied
into a fresh one, as sqlite3's .dump reads a damaged file; a store in memory where the folder
cannot be written. The Store (store.py) keeps the messages in it. No Qt here."""
from __future__ import annotations

import contextlib
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY, title TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL,
    leaf_id INTEGER, deleted REAL);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL, text TEXT NOT NULL, created REAL NOT NULL, stats TEXT,
    state TEXT NOT NULL DEFAULT 'complete', parent_id INTEGER, deleted REAL, visited REAL,
    tool TEXT);
CREATE TABLE IF NOT EXISTS attachments (
    message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
    position INTEGER NOT NULL, sha256 TEXT NOT NULL, filename TEXT NOT NULL, shown_name TEXT,
    fragment TEXT);
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
CREATE TRIGGER IF NOT EXISTS leaf_in_its_own_chat BEFORE UPDATE OF leaf_id ON conversations
WHEN NEW.leaf_id IS NOT NULL AND NOT EXISTS (
    SELECT 1 FROM messages WHERE id = NEW.leaf_id AND conversation_id = NEW.id)
BEGIN SELECT RAISE(ABORT, 'a chat''s open branch must end at one of its own messages'); END;
CREATE TRIGGER IF NOT EXISTS leaf_goes_with_its_message AFTER DELETE ON messages BEGIN
    UPDATE conversations SET leaf_id = NULL WHERE leaf_id = old.id; END;
"""
# The two triggers keep a chat's open branch (`leaf_id`) on a message of that chat: a leaf is
# never set to another chat's message, and a message deleted for good takes the leaf with it
# (SQLite reuses a deleted row's id, so a leaf left on it would name the next chat's message and
# show its own chat empty). A store that already holds such a leaf is repaired on open.
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
# 1: no user_version (before `state`); 2: messages.state; 3: messages_fts; 4: a tree (each
# message its parent, each conversation its current leaf) and a trash (`deleted`)
SCHEMA_VERSION = 4
# columns copied when what can be read of a bad database is saved
SALVAGE = {"conversations": ("id", "title", "created", "updated", "leaf_id", "deleted"),
           "messages": ("id", "conversation_id", "role", "text", "created", "stats", "parent_id",
                        "deleted", "visited"),
           "attachments": ("message_id", "position", "sha256", "filename", "shown_name", "fragment"),
           "settings": ("key", "value")}


def open_checked(path: Path) -> sqlite3.Connection:
    """The database at `path`, checked (sqlite3.DatabaseError when it is damaged, not a
    database, or from a newer Ebb), brought to this schema from any older one."""
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
        if "parent_id" not in cols:  # a database from before branches: each chat a line
            for col in ("parent_id INTEGER", "deleted REAL", "visited REAL"):
                db.execute(f"ALTER TABLE messages ADD COLUMN {col}")
            for col in ("leaf_id INTEGER", "deleted REAL"):
                db.execute(f"ALTER TABLE conversations ADD COLUMN {col}")
            _link_linear(db)
        if "shown_name" not in {r[1] for r in db.execute("PRAGMA table_info(attachments)")}:
            # the name the user's file had (a clip's chip says it): added, not a new schema
            # (an older Ebb reads and writes the table as before)
            db.execute("ALTER TABLE attachments ADD COLUMN shown_name TEXT")
        if "fragment" not in {r[1] for r in db.execute("PRAGMA table_info(attachments)")}:
            # what was taken from a video or a PDF (an older Ebb sees the whole file)
            db.execute("ALTER TABLE attachments ADD COLUMN fragment TEXT")
        if "tool" not in {r[1] for r in db.execute("PRAGMA table_info(messages)")}:
            # a tool's call and its result (role "tool", JSON): added, not a new schema (an
            # older Ebb shows such a message as a reply)
            db.execute("ALTER TABLE messages ADD COLUMN tool TEXT")
        db.execute("CREATE INDEX IF NOT EXISTS messages_by_parent "
                   "ON messages(conversation_id, parent_id)")
        _add_fts(db, rebuild=version < 3)
        _repair_leaves(db)
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        db.commit()
    except BaseException:
        db.close()
        raise
    return db


def set_aside(path: Path, exc: BaseException) -> tuple[sqlite3.Connection, str]:
    """Move the bad database aside (with its WAL), open a fresh one and copy in what can be
    read of the old one. Returns it and what happened, in the user's words; OSError or
    sqlite3.DatabaseError when a fresh one cannot be made there either."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = path.with_name(f"{path.name}.bad-{stamp}")
    path.replace(aside)
    for suffix in ("-wal", "-shm"):
        extra = path.with_name(path.name + suffix)
        if extra.exists():
            extra.replace(aside.with_name(aside.name + suffix))
    db = open_checked(path)
    n_conv, n_msg = _salvage(aside, db)
    return db, (f"The conversation database {path} could not be used: {reason(exc)}. "
                f"It was moved aside to {aside.name} (kept, never written over). "
                + (f"{n_conv} conversations with {n_msg} messages could be read from it "
                   "and are shown." if n_conv else "Nothing could be read from it."))


def in_memory(path: Path) -> tuple[sqlite3.Connection, int]:
    """A database in memory (nothing saved) with what can be read of the one at `path`, and
    how many conversations that was."""
    db = sqlite3.connect(":memory:")
    db.execute("PRAGMA foreign_keys=ON")
    db.executescript(SCHEMA)
    _add_fts(db, rebuild=False)
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    return db, (_salvage(path, db)[0] if path.exists() else 0)


def _link_linear(db: sqlite3.Connection) -> None:
    """Conversations without a leaf (from before branches, or salvaged without their links)
    become lines: each message's parent is the one before it, the last is the open one. A link
    to a message that is gone (lost in a salvage) goes to the message before instead."""
    with db:
        db.execute("UPDATE messages SET parent_id = (SELECT MAX(p.id) FROM messages p "
                   "WHERE p.conversation_id = messages.conversation_id AND p.id < messages.id) "
                   "WHERE conversation_id IN (SELECT id FROM conversations WHERE leaf_id IS NULL) "
                   "OR (parent_id IS NOT NULL AND parent_id NOT IN (SELECT id FROM messages))")
        db.execute("UPDATE conversations SET leaf_id = (SELECT MAX(m.id) FROM messages m "
                   "WHERE m.conversation_id = conversations.id AND m.deleted IS NULL) "
                   "WHERE leaf_id IS NULL OR leaf_id NOT IN (SELECT id FROM messages)")


def _repair_leaves(db: sqlite3.Connection) -> int:
    """A chat whose open branch names no live message of its own (an older Ebb left one on a
    deleted message whose id the next chat's message took): its deepest message, the newest
    of those as deep. Returns how many chats were repaired."""
    bad = [int(r[0]) for r in db.execute(
        "SELECT c.id FROM conversations c WHERE c.leaf_id IS NOT NULL AND NOT EXISTS ("
        "SELECT 1 FROM messages m WHERE m.id = c.leaf_id AND m.conversation_id = c.id "
        "AND m.deleted IS NULL)")]
    for cid in bad:
        parents = {int(m): (int(p) if p is not None else None) for m, p in db.execute(
            "SELECT id, parent_id FROM messages WHERE conversation_id=? AND deleted IS NULL",
            (cid,))}
        depth: dict[int, int] = {}

        def depth_of(m: int) -> int:
            path: list[int] = []
            while m not in depth and m in parents and len(path) <= len(parents):
                path.append(m)
                m = parents[m]  # type: ignore[assignment]
            d = depth.get(m, 0)
            for n in reversed(path):
                d += 1
                depth[n] = d
            return depth[path[0]] if path else d

        deepest = max(parents, key=lambda m: (depth_of(m), m), default=None)
        with db:
            db.execute("UPDATE conversations SET leaf_id=? WHERE id=?", (deepest, cid))
    return len(bad)


def is_write_failure(exc: BaseException) -> bool:
    """Whether the folder refused the write (full, read-only), not the file its contents."""
    text = str(exc).lower()
    return any(w in text for w in ("disk is full", "readonly", "read-only", "unable to open",
                                   "disk i/o error"))


def reason(exc: BaseException) -> str:
    """Why a database could not be used, in the user's words."""
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
        for table, wanted in SALVAGE.items():
            try:
                have = {r[1] for r in src.execute(f"PRAGMA table_info({table})")}
            except sqlite3.DatabaseError:
                have = set(wanted)
            cols = tuple(c for c in wanted if c in have) or wanted
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
        _link_linear(into)  # chats from before branches (or whose links were lost) are lines
        _repair_leaves(into)
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
