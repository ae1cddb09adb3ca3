"""Conversations, messages, attachments and per-reply stats in SQLite (WAL); the settings' table
is read and written through `settings_store.py`.

Images are stored once, named by content hash, under the data folder. The user's message is
committed before the reply starts; the reply is committed while it streams (state `streaming`)
and marked `complete` at its end, so a crash loses at most the last second of a reply, and the
next start shows it as `interrupted`. GUI thread only (SQLite connections are per thread).

A data folder gone bad never stops the window: a damaged database, or one from a newer Ebb, is
moved aside with a timestamp (never written over) and what can be read of it is copied into a
fresh one; a folder that cannot be written (read-only, full disk) gives a store in memory
holding what could be read (the file's schema, migrations and salvage: `store_file.py`).
`problem` says what happened and where, for the window to show.
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

from engine.media.attachments import split as split_ref
from engine.errors import EbbError

from app.core import store_file
from app.core.reply_stats import ReplyStats
from app.core.settings_store import SettingsStore

TRASH_DAYS = 7  # a deleted chat or branch can be brought back this long (then it is purged)
DB_NAME = "ebb.sqlite3"


_LEAF = object()  # add_message's default parent: the open branch's last message


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
    stats: ReplyStats = field(default_factory=ReplyStats)
    state: str = "complete"  # streaming (being written) | interrupted (Ebb stopped) | complete
    parent_id: int | None = None  # the message it answers or follows (None: the first)
    # its versions: the live messages with the same parent, itself among them, oldest first
    siblings: tuple[int, ...] = ()
    # an attachment's name as the user's file had it (the store keeps it by content hash)
    shown_names: dict[str, str] = field(default_factory=dict)
    # what was taken from an attachment (a video's frames, a PDF's pages: "frames=0,4,8"), by
    # its stored path; engine/media/attachments.py reads it
    fragments: dict[str, str] = field(default_factory=dict)
    # role "tool": the call and how it went (engine/tools/loop.py CallRecord.to_stored); its
    # text is the result as the model read it, its attachments the result's pictures and clips
    tool: dict[str, Any] | None = None

    def refs(self) -> list[Path]:
        """The attachments as the engine takes them: each stored file with what was taken."""
        return [Path(f"{p}#{self.fragments[str(p)]}") if self.fragments.get(str(p)) else p
                for p in self.images]


@dataclass
class Conversation:
    id: int
    title: str
    updated: float
    match: str = ""  # with a search: the first matching line of its messages
    match_id: int = 0  # and the message it is in (on whatever branch)


class Store:
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.images_dir = self.folder / "images"
        self.problem: str | None = None  # what went wrong with the data folder, for the window
        self.in_memory = False
        path = self.folder / DB_NAME
        try:
            self.images_dir.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):  # the pictures and voices people send: theirs alone
                self.images_dir.chmod(0o700)
            self.db = store_file.open_checked(path)
        except sqlite3.DatabaseError as exc:  # damaged, not a database, or from a newer Ebb
            if store_file.is_write_failure(exc):
                self._open_in_memory(path, exc)
            else:
                self._set_aside(path, exc)
        except OSError as exc:  # the folder cannot be made or written
            self._open_in_memory(path, exc)
        self.settings = SettingsStore(lambda: self.db, self._writing)  # the key-values
        self.recovered = self._mark_interrupted()
        if not self.in_memory:
            self.purge_trash()

    def _set_aside(self, path: Path, exc: BaseException) -> None:
        """Move the bad database aside, start a fresh one with what can be read of the old."""
        try:
            self.db, self.problem = store_file.set_aside(path, exc)
        except (OSError, sqlite3.DatabaseError) as exc2:
            self._open_in_memory(path, exc2)

    def _open_in_memory(self, path: Path, exc: BaseException) -> None:
        """The folder cannot be written: a store in memory, with what can be read of the one
        on disk; nothing is saved."""
        self.in_memory = True
        self.db, n_conv = store_file.in_memory(path)
        if not os.access(self.images_dir, os.W_OK):  # new images go to a temporary folder
            self.images_dir = Path(tempfile.mkdtemp(prefix="ebb-images-"))
            old = self.folder / "images"
            if old.is_dir():
                for f in old.iterdir():
                    with contextlib.suppress(OSError):
                        shutil.copy2(f, self.images_dir / f.name)
        self.problem = (f"The data folder {self.folder} cannot be written ({store_file.reason(exc)}): "
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
                                   "WHERE deleted IS NULL ORDER BY updated DESC").fetchall()
            return [Conversation(*r) for r in rows]
        words = search.split()
        matches: dict[int, tuple[str, int]] = {}  # every branch is searched
        try:
            query = " ".join('"' + w.replace('"', '""') + '"' for w in words) + "*"
            for cid, mid, snippet in self.db.execute(
                    "SELECT m.conversation_id, m.id, snippet(messages_fts, 0, '', '', '…', 12) "
                    "FROM messages_fts JOIN messages m ON m.id = messages_fts.rowid "
                    "WHERE messages_fts MATCH ? AND m.deleted IS NULL ORDER BY m.id", (query,)):
                matches.setdefault(int(cid), (" ".join(str(snippet).split()), int(mid)))
        except sqlite3.OperationalError:  # no FTS5 here: LIKE, every word
            like = " AND ".join("text LIKE ?" for _ in words)
            for cid, mid, text in self.db.execute(
                    f"SELECT conversation_id, id, text FROM messages WHERE {like} AND deleted IS NULL "
                    "ORDER BY id", [f"%{w}%" for w in words]):
                matches.setdefault(int(cid), (_line_with(str(text), words[0]), int(mid)))
        title_like = " AND ".join("title LIKE ?" for _ in words)
        by_title = {int(r[0]) for r in self.db.execute(
            f"SELECT id FROM conversations WHERE {title_like}", [f"%{w}%" for w in words])}
        listed = self.db.execute("SELECT id, title, updated FROM conversations WHERE deleted IS NULL "
                                 "ORDER BY updated DESC")
        return [Conversation(r[0], r[1], r[2], *matches.get(int(r[0]), ("", 0)))
                for r in listed if int(r[0]) in by_title or int(r[0]) in matches]

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
        """Into the trash (`restore` brings it back for TRASH_DAYS)."""
        with self._writing("the deletion"):
            self.db.execute("UPDATE conversations SET deleted=? WHERE id=?",
                            (time.time(), conversation_id))

    def restore(self, conversation_id: int) -> None:
        with self._writing("the chat"):
            self.db.execute("UPDATE conversations SET deleted=NULL WHERE id=?", (conversation_id,))

    def purge_trash(self, days: float = TRASH_DAYS) -> None:
        """Chats and branches deleted more than `days` ago go for good (and their pictures)."""
        cutoff = time.time() - days * 86400
        try:
            with self.db:
                self.db.execute("DELETE FROM conversations WHERE deleted < ?", (cutoff,))
                self.db.execute("DELETE FROM messages WHERE deleted < ?", (cutoff,))
            self._drop_unused_images()
        except (sqlite3.DatabaseError, OSError):
            pass  # tried again at the next start

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

    def _shown_name(self, src: Path) -> str:
        """The name to show for an attachment from `src`: its own, or for one of the store's
        copies (an edit, a regeneration) the name it was first attached under."""
        if src.parent == self.images_dir:
            row = self.db.execute("SELECT shown_name FROM attachments WHERE filename=? AND "
                                  "shown_name IS NOT NULL LIMIT 1", (src.name,)).fetchone()
            if row:
                return str(row[0])
        return src.name

    def add_message(self, conversation_id: int, role: str, text: str,
                    images: list[Path] | None = None, stats: ReplyStats | None = None,
                    state: str = "complete", parent: int | None | object = _LEAF,
                    tool: dict[str, Any] | None = None) -> int:
        """Save a message after `parent` (default: the open branch's last message; None: a
        first message) and make it the open branch's end. StoreError when it cannot be saved:
        nothing of it is kept then."""
        refs = [split_ref(p) for p in images or []]
        stored = [self.store_image(src) for src, _ in refs]
        now = time.time()
        if parent is _LEAF:  # the open branch's end as it is stored (None: a first message)
            parent = self._stored_leaf(conversation_id) or None
        try:
            with self.db:
                cur = self.db.execute(
                    "INSERT INTO messages (conversation_id, role, text, created, stats, state, "
                    "parent_id, visited, tool) VALUES (?,?,?,?,?,?,?,?,?)",
                    (conversation_id, role, text, now,
                     json.dumps(stats.to_json() if stats is not None else {}), state, parent, now,
                     json.dumps(tool) if tool is not None else None))
                mid = int(cur.lastrowid or 0)
                self.db.executemany(
                    "INSERT INTO attachments (message_id, position, sha256, filename, shown_name, "
                    "fragment) VALUES (?,?,?,?,?,?)",
                    [(mid, i, sha, name, self._shown_name(src), frag or None)
                     for i, ((sha, name), (src, frag)) in enumerate(zip(stored, refs))])
                self.db.execute("UPDATE conversations SET updated=?, leaf_id=? WHERE id=?",
                                (now, mid, conversation_id))
        except sqlite3.DatabaseError as exc:
            raise _write_error("the message", exc, self.folder) from None
        return mid

    def make_tool_message(self, message_id: int, text: str, files: list[Path],
                          tool: dict[str, Any]) -> None:
        """The reply row a turn began with became a tool call (engine/tools/loop.py): it keeps
        the call's record, the result as the model read it and the result's files."""
        stored = [self.store_image(p) for p in files]
        try:
            with self.db:
                self.db.execute("UPDATE messages SET role='tool', text=?, tool=?, state='complete' "
                                "WHERE id=?", (text, json.dumps(tool), message_id))
                self.db.executemany(
                    "INSERT INTO attachments (message_id, position, sha256, filename, shown_name, "
                    "fragment) VALUES (?,?,?,?,?,NULL)",
                    [(message_id, i, sha, name, None) for i, (sha, name) in enumerate(stored)])
        except sqlite3.DatabaseError as exc:
            raise _write_error("the tool's result", exc, self.folder) from None

    def set_fragments(self, message_id: int, fragments: list[str]) -> None:
        """What the engine took from each attachment of a sent message (its frames, its pages),
        in order: a reopened chat puts back exactly that."""
        try:
            with self.db:
                self.db.executemany("UPDATE attachments SET fragment=? WHERE message_id=? AND position=?",
                                    [(f or None, message_id, i) for i, f in enumerate(fragments)])
        except sqlite3.DatabaseError as exc:
            raise _write_error("the message", exc, self.folder) from None

    def update_message(self, message_id: int, text: str, stats: ReplyStats | None = None,
                       state: str = "complete") -> None:
        """A reply as it stands: while it streams (`streaming`, stats kept), or whole."""
        try:
            with self.db:
                if stats is None:
                    self.db.execute("UPDATE messages SET text=?, state=? WHERE id=?",
                                    (text, state, message_id))
                else:
                    self.db.execute("UPDATE messages SET text=?, stats=?, state=? WHERE id=?",
                                    (text, json.dumps(stats.to_json()), state, message_id))
        except sqlite3.DatabaseError as exc:
            raise _write_error("the reply", exc, self.folder) from None

    def message(self, message_id: int) -> Message | None:
        row = self.db.execute("SELECT conversation_id FROM messages WHERE id=?",
                              (message_id,)).fetchone()
        if row is None:
            return None
        return next((m for m in self.messages(int(row[0]), message_id)), None)

    def conversation_of(self, message_id: int) -> int:
        row = self.db.execute("SELECT conversation_id FROM messages WHERE id=?",
                              (message_id,)).fetchone()
        return int(row[0]) if row else 0

    def last_message_id(self, conversation_id: int) -> int:
        """The open branch's last message (0: none)."""
        return self.leaf(conversation_id)

    def message_ids(self, conversation_id: int) -> list[int]:
        """The open branch, first message first."""
        return self._branch(conversation_id, self._parents(conversation_id))

    def n_messages(self, conversation_id: int) -> int:
        """Every live message of the chat, on every branch."""
        row = self.db.execute("SELECT COUNT(*) FROM messages WHERE conversation_id=? AND "
                              "deleted IS NULL", (conversation_id,)).fetchone()
        return int(row[0])

    def has_messages(self) -> bool:
        """Whether any conversation holds a message (the first start's welcome shows until
        one does)."""
        return bool(self.db.execute(
            "SELECT EXISTS(SELECT 1 FROM messages m JOIN conversations c ON c.id = m.conversation_id "
            "WHERE m.deleted IS NULL AND c.deleted IS NULL)").fetchone()[0] == 1)

    def delete_message(self, message_id: int) -> None:
        """Remove a message and what follows it for good (a message the engine did not answer);
        the open branch ends where it branched off (`trash_branch` is the user's delete)."""
        cid = self.conversation_of(message_id)
        parents = self._parents(cid, live=False)
        gone = _subtree(parents, message_id)
        with self._writing("the deletion"):
            was_open = self._raw_leaf(cid) in gone or not self._raw_leaf(cid)
            self.db.executemany("DELETE FROM messages WHERE id=?", [(m,) for m in gone])
            if was_open:  # the open branch ends where it branched off
                parent = parents.get(message_id)
                self._set_leaf(cid, self.best_leaf(cid, parent if parent in parents else None))

    # ------------------------------------------------------------ the tree

    def _parents(self, conversation_id: int, live: bool = True) -> dict[int, int | None]:
        """Each message's parent (the live ones, or all)."""
        where = " AND deleted IS NULL" if live else ""
        return {int(m): (int(p) if p is not None else None) for m, p in self.db.execute(
            f"SELECT id, parent_id FROM messages WHERE conversation_id=?{where}", (conversation_id,))}

    def _stored_leaf(self, conversation_id: int) -> int:
        """The leaf as stored, when it is a live message of this chat (0: none)."""
        row = self.db.execute("SELECT c.leaf_id FROM conversations c JOIN messages m "
                              "ON m.id = c.leaf_id AND m.conversation_id = c.id "
                              "WHERE c.id=? AND m.deleted IS NULL", (conversation_id,)).fetchone()
        return int(row[0]) if row is not None and row[0] else 0

    def _raw_leaf(self, conversation_id: int) -> int:
        """The leaf column itself, whatever it names (0: NULL)."""
        row = self.db.execute("SELECT leaf_id FROM conversations WHERE id=?",
                              (conversation_id,)).fetchone()
        return int(row[0]) if row is not None and row[0] else 0

    def leaf(self, conversation_id: int) -> int:
        """The open branch's last message (0: the chat is empty)."""
        return self._stored_leaf(conversation_id) or self.best_leaf(conversation_id, None)

    def _branch(self, conversation_id: int, parents: dict[int, int | None]) -> list[int]:
        out: list[int] = []
        m = self.leaf(conversation_id) or None
        while m is not None and m in parents and len(out) <= len(parents):
            out.append(m)
            m = parents[m]
        return out[::-1]

    def best_leaf(self, conversation_id: int, under: int | None) -> int:
        """The end of the branch last open below `under` (None: anywhere in the chat): of the
        live leaves there, the one visited last; `under` itself when nothing follows it."""
        parents = self._parents(conversation_id)
        if under not in parents:  # gone, or in the trash: anywhere in the chat
            under = None
        nodes = _subtree(parents, under) if under is not None else set(parents)
        if not nodes:
            return 0
        has_child = {p for p in parents.values() if p is not None}
        leaves = [m for m in nodes if m not in has_child]
        marks = ",".join("?" * len(leaves))
        row = self.db.execute(f"SELECT id FROM messages WHERE id IN ({marks}) "
                              "ORDER BY COALESCE(visited, created) DESC, id DESC LIMIT 1",
                              leaves).fetchone()
        return int(row[0]) if row else 0

    def _set_leaf(self, conversation_id: int, leaf: int) -> None:
        self.db.execute("UPDATE conversations SET leaf_id=? WHERE id=?", (leaf or None, conversation_id))
        if leaf:
            self.db.execute("UPDATE messages SET visited=? WHERE id=?", (time.time(), leaf))

    def open_branch(self, message_id: int) -> None:
        """Show the branch through `message_id` (a version chosen, a search result): to the
        end of the branch last open below it."""
        cid = self.conversation_of(message_id)
        if cid:
            with self._writing("the open branch"):
                self._set_leaf(cid, self.best_leaf(cid, message_id))

    def end_branch_at(self, message_id: int | None, conversation_id: int) -> None:
        """The open branch ends at `message_id` (None: empty), for a new version after it."""
        with self._writing("the open branch"):
            self.db.execute("UPDATE conversations SET leaf_id=? WHERE id=?",
                            (message_id, conversation_id))

    def trash_branch(self, message_id: int) -> list[int]:
        """Delete a message and what follows it, into the trash (`restore_branch` brings it
        back); the open branch moves to a sibling's, or ends before it. Returns what went."""
        cid = self.conversation_of(message_id)
        parents = self._parents(cid)
        gone = sorted(_subtree(parents, message_id))
        with self._writing("the deletion"):
            was_open = self._raw_leaf(cid) in gone or not self._stored_leaf(cid)
            stamp = time.time()
            self.db.executemany("UPDATE messages SET deleted=? WHERE id=?", [(stamp, m) for m in gone])
            if was_open:  # the version beside it stays open (the one before, else after)
                parent = parents.get(message_id)
                versions = sorted(m for m, p in parents.items() if p == parent)
                i = versions.index(message_id)
                beside = [*versions[:i][::-1], *versions[i + 1:]]
                self._set_leaf(cid, self.best_leaf(cid, beside[0]) if beside
                               else self.best_leaf(cid, parent) if parent is not None
                               else self.best_leaf(cid, None))
        return gone

    def restore_branch(self, ids: list[int]) -> None:
        """Bring back what trash_branch took (its branch is open again)."""
        if not ids:
            return
        with self._writing("the messages"):
            self.db.executemany("UPDATE messages SET deleted=NULL WHERE id=?", [(m,) for m in ids])
            cid = self.conversation_of(ids[0])
            self._set_leaf(cid, self.best_leaf(cid, ids[0]))

    def leaves(self, conversation_id: int) -> list[int]:
        """Every branch's last message, oldest branch first."""
        parents = self._parents(conversation_id)
        has_child = {p for p in parents.values() if p is not None}
        return sorted(m for m in parents if m not in has_child)

    def branch_to(self, message_id: int) -> list[int]:
        """The messages from the first to `message_id`, in order."""
        parents = self._parents(self.conversation_of(message_id), live=False)
        out: list[int] = []
        m: int | None = message_id
        while m is not None and m in parents and len(out) <= len(parents):
            out.append(m)
            m = parents[m]
        return out[::-1]

    def messages(self, conversation_id: int, only: int | None = None,
                 ids: list[int] | None = None) -> list[Message]:
        """The open branch's messages in order (or only the message `only`, or those `ids`),
        each with its versions (`siblings`)."""
        parents = self._parents(conversation_id)
        if only is not None:
            wanted = [only]
        elif ids is not None:
            wanted = list(ids)
        else:
            wanted = self._branch(conversation_id, parents)
        if not wanted:
            return []
        children: dict[int | None, list[int]] = {}
        for m in sorted(parents):
            children.setdefault(parents[m], []).append(m)
        rows: dict[int, Message] = {}
        for chunk in _chunks(wanted):
            marks = ",".join("?" * len(chunk))
            for mid, role, text, stats, state, parent, tool in self.db.execute(
                    "SELECT id, role, text, stats, state, parent_id, tool FROM messages "
                    f"WHERE id IN ({marks})", chunk):
                rows[int(mid)] = Message(int(mid), role, text, [], ReplyStats.from_json(json.loads(stats or "{}")), state,
                                         parent, tuple(children.get(parent, [mid])),
                                         tool=_tool(tool))
            for mid, name, shown, frag in self.db.execute(
                    f"SELECT message_id, filename, shown_name, fragment FROM attachments "
                    f"WHERE message_id IN ({marks}) ORDER BY message_id, position", chunk):
                rows[int(mid)].images.append(self.images_dir / name)
                if shown:
                    rows[int(mid)].shown_names[str(self.images_dir / name)] = str(shown)
                if frag:
                    rows[int(mid)].fragments[str(self.images_dir / name)] = str(frag)
        return [rows[m] for m in wanted if m in rows]

    def _drop_unused_images(self) -> None:
        used = {name for (name,) in self.db.execute("SELECT DISTINCT filename FROM attachments")}
        for f in self.images_dir.iterdir():
            if f.is_file() and f.name not in used:
                f.unlink(missing_ok=True)


def _tool(text: str | None) -> dict[str, Any] | None:
    try:
        value = json.loads(text) if text else None
    except ValueError:
        return {"state": "failed", "label": "?", "arguments": {}}
    return value if isinstance(value, dict) else None


def _subtree(parents: dict[int, int | None], root: int) -> set[int]:
    """`root` and every message below it."""
    children: dict[int | None, list[int]] = {}
    for m, p in parents.items():
        children.setdefault(p, []).append(m)
    out, todo = set(), [root]
    while todo:
        m = todo.pop()
        if m in out:
            continue
        out.add(m)
        todo.extend(children.get(m, []))
    return out


def _chunks(ids: list[int], n: int = 900) -> Iterator[list[int]]:
    """SQLite takes a bounded number of `?` in one statement."""
    for i in range(0, len(ids), n):
        yield ids[i:i + n]


def _line_with(text: str, word: str) -> str:
    low = word.lower()
    for line in text.splitlines():
        if low in line.lower():
            return " ".join(line.split())[:120]
    return ""
