"""The model's memory of conversations, kept on disk: KV states that outlive the process.

A conversation's KV state (llama.cpp's `llama_state_seq_get_data`: host bytes) is written here
when Ebb leaves it (another chat or branch, another client of the endpoint, the window closing,
a while idle) and read back when a prompt shares more with it than the cache does, so a
reopened chat evaluates only what is new. It is a cache: the database stays the conversation,
and a state that does not match exactly is ignored, never trusted.

One file per state, `<tag>-<prefix hash>.ebbkv`: a magic line, the header's length, the header
(JSON), then the state's bytes. The header says what the state belongs to (`identity`: the
model file by size and the sha256 of its first and last MiB, the context and KV settings, the
llama.cpp build, this format), the cells' keys (token ids, `[image key, i]` for an image's
cells), their positions, the next position, the tag (the chat it belongs to, for deleting it
with the chat) and the length and per-piece XXH3 hashes of the bytes (`engine/kept_files.py`).
A file whose identity differs, whose bytes do not hash to the header's or that cannot be parsed
is passed over (a damaged one is removed). A state is read back mapped from the file (on
Linux), not copied: llama.cpp copies it into the KV cache from the page cache. The folder keeps within a byte budget, least recently used first out (a load touches
the file). Writes go through a temporary file and a rename, on a writer thread of their own, so
the engine thread does not wait for the disk; `flush` waits (before the process exits).
Pure file work: no llama.cpp here (the runtime saves and restores).
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import io
import json
import re
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from engine.kept_files import Mapped, digests, map_checked, read_header, remove, touch, write_atomically

# (bytes, the cells' keys, each cell's position, the next position): TextRuntime.save_state;
# a state read back from disk holds its file's bytes mapped (`Mapped`), not a copy of them
State = tuple["bytes | bytearray | Mapped", list[Any], list[int], int]


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many keys `a` and `b` share from the start."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

MAGIC = b"EBBKV\x01\n"
FORMAT = 1
SUFFIX = ".ebbkv"
DEFAULT_BUDGET_BYTES = 4 << 30
_TAG_RE = re.compile(r"[^A-Za-z0-9_.]+")


def file_identity(path: Path) -> str:
    """A model or projector file by what it holds, not its name: its size and the sha256 of
    its first and last MiB (a GGUF's header and tensor table, and its last weights)."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(size - (1 << 20))
            h.update(f.read())
    return h.hexdigest()[:32]


def _json_keys(keys: Sequence[Any]) -> list[Any]:
    return [list(k) if isinstance(k, tuple) else k for k in keys]


def _py_keys(keys: Sequence[Any]) -> list[Any]:
    return [tuple(k) if isinstance(k, list) else k for k in keys]


def prefix_hash(keys: Sequence[Any]) -> str:
    return hashlib.sha256(json.dumps(_json_keys(keys), separators=(",", ":")).encode()).hexdigest()[:24]


def safe_tag(tag: str) -> str:
    return _TAG_RE.sub("_", tag)[:40] or "x"


@dataclass
class Entry:
    path: Path
    tag: str
    keys: list[Any]
    nbytes: int  # the file's size


class StateFiles:
    def __init__(self, folder: Path, identity: dict[str, Any],
                 budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.folder = folder
        self.identity = dict(identity, format=FORMAT)
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()  # the index, between the engine and the writer thread
        self._index: dict[Path, Entry] = {}
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ebb-states")
        self._pending: list[concurrent.futures.Future[Any]] = []
        self._reader: concurrent.futures.ThreadPoolExecutor | None = None  # read_ahead's
        self._ahead: tuple[Path, concurrent.futures.Future[State | None], threading.Event] | None = None
        self.n_read_ahead = 0  # loads that found their state read ahead (a test counts them)
        self._closed = False
        self.n_ignored = 0  # files passed over: another model or setting, damaged
        self._scan()
        self._writer.submit(self._trim)  # the budget may have shrunk since the last run

    # ------------------------------------------------------------ the index

    def _scan(self) -> None:
        try:
            paths = sorted(self.folder.glob("*" + SUFFIX))
        except OSError:
            return
        for p in paths:
            head = self._read_header(p)
            if head is not None:
                self._index[p] = Entry(p, str(head.get("tag", "")), _py_keys(head["keys"]),
                                       p.stat().st_size)

    def _read_header(self, path: Path, f: io.BufferedIOBase | None = None) -> dict[str, Any] | None:
        """The header of a state of this identity, else None (and a damaged file removed);
        from the open file `f` when given (left at the state's bytes)."""
        try:
            if f is None:
                with open(path, "rb") as own:
                    head = read_header(own, MAGIC, 1 << 30)
            else:
                head = read_header(f, MAGIC, 1 << 30)
            if not isinstance(head.get("keys"), list):
                raise ValueError("no keys")
        except (OSError, ValueError, struct.error, UnicodeDecodeError):
            self.n_ignored += 1
            remove(path)
            return None
        if head.get("identity") != self.identity:
            self.n_ignored += 1  # another model, context or build: left for that one
            return None
        return head

    def entries(self) -> list[Entry]:
        with self._lock:
            return list(self._index.values())

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries())

    def usage(self) -> tuple[int, int]:
        """(states kept, bytes of them and of the encoded pictures) in the folder, every
        model's (what Settings shows)."""
        return folder_usage(self.folder)

    # ------------------------------------------------------------ finding and loading

    def best(self, keys: Sequence[Any], than: int) -> tuple[Entry | None, int]:
        """The kept state sharing the longest prefix with `keys` (more than `than`)."""
        best, best_n = None, than
        for e in self.entries():
            n = common_prefix(e.keys, keys)
            if n > best_n:
                best, best_n = e, n
        return best, best_n

    def longest(self, tag: str) -> Entry | None:
        """The longest kept state of the conversation `tag`."""
        return max((e for e in self.entries() if e.tag == tag), key=lambda e: len(e.keys), default=None)

    def read_ahead(self, entry: Entry) -> None:
        """Any thread: start reading `entry`'s state now, on a reader thread, for the `load`
        that will ask for it (a request of the endpoint, before its prompt is rendered and
        tokenized, or while it waits behind another). One at a time: a newer one stops the
        last; a `load` of another state drops it."""
        with self._lock:
            if self._closed or (self._ahead is not None and self._ahead[0] == entry.path):
                return
            self._drop_ahead()
            if self._reader is None:
                self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ebb-states-read")
            stop = threading.Event()
            self._ahead = (entry.path, self._reader.submit(self._load, entry, stop), stop)

    def _drop_ahead(self) -> None:
        if self._ahead is not None:
            self._ahead[2].set()  # its bytes are let go as soon as its read stops
            self._ahead = None

    def load(self, entry: Entry, cancel: threading.Event | None = None) -> State | None:
        """The state in `entry`'s file, checked against its header; None when it is not this
        identity's, is damaged (removed then) or the load was stopped. A read started ahead
        for it is waited for instead of reading again."""
        with self._lock:
            ahead, self._ahead = self._ahead, None
            if ahead is not None and ahead[0] != entry.path:
                ahead[2].set()
                ahead = None
        if ahead is not None:
            fut, stop = ahead[1], ahead[2]
            while not concurrent.futures.wait([fut], timeout=0.05).done:
                if cancel is not None and cancel.is_set():
                    stop.set()
                    return None
            state = fut.result()
            if state is not None:
                self.n_read_ahead += 1
                return state
        return self._load(entry, cancel, checked_later=True)

    def _load(self, entry: Entry, cancel: threading.Event | None, checked_later: bool = False) -> State | None:
        """`checked_later`: the bytes' hashes are still being checked when this returns (a
        restore copies them meanwhile, then asks `Mapped.intact`); a damaged file found then
        goes as one found here does."""
        path = entry.path
        try:
            with open(path, "rb") as f:
                head = self._read_header(path, f)
                if head is None:
                    self._forget(path)
                    return None
                # mapped: llama.cpp reads it where it lies
                data = map_checked(f, head, cancel, checked_later=checked_later)
            if data is None:
                return None
            if isinstance(data, Mapped):
                data.on_damaged = lambda: self._damaged(path)
            state: State = (data, _py_keys(head["keys"]), [int(p) for p in head["cell_pos"]],
                            int(head["n_past"]))
            if len(state[1]) != len(state[2]):
                raise ValueError("keys and positions differ in length")
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            self._damaged(path)
            return None
        touch(path)
        return state

    def _damaged(self, path: Path) -> None:
        self.n_ignored += 1
        remove(path)
        self._forget(path)

    # ------------------------------------------------------------ saving and leaving

    def has(self, keys: Sequence[Any]) -> bool:
        """A state of exactly these cells is kept already."""
        return any(len(e.keys) == len(keys) and common_prefix(e.keys, keys) == len(keys)
                   for e in self.entries())

    def save(self, state: State, tag: str, on_done: Callable[[], None] | None = None) -> None:
        """Write `state` in the background (nothing when it is kept already or larger than
        the whole budget); a state whose cells are a prefix of it goes."""
        data, keys, cell_pos, n_past = state
        if isinstance(data, Mapped) or len(data) > self.budget_bytes or self.has(keys):
            return  # (a mapped state was read from a file of ours: it is kept already)
        fut = self._writer.submit(self._write, data, list(keys), list(cell_pos), n_past, tag)
        if on_done is not None:
            fut.add_done_callback(lambda _f: on_done())
        self._pending = [f for f in self._pending if not f.done()] + [fut]

    def _write(self, data: "bytes | bytearray", keys: list[Any], cell_pos: list[int], n_past: int,
               tag: str) -> None:
        head = {"identity": self.identity, "tag": tag, "keys": _json_keys(keys),
                "cell_pos": cell_pos, "n_past": n_past, **digests(data), "saved": time.time()}
        path = self.folder / f"{safe_tag(tag)}-{prefix_hash(keys)}{SUFFIX}"
        if not write_atomically(path, MAGIC, head, data):
            return  # a full or read-only disk: the state is a cache, nothing is lost
        with self._lock:
            for p, e in list(self._index.items()):  # a prefix of this one is of no more use
                if p != path and len(e.keys) <= len(keys) and common_prefix(e.keys, keys) == len(e.keys):
                    del self._index[p]
                    remove(p)
            self._index[path] = Entry(path, tag, keys, path.stat().st_size)
        self._trim()

    def _trim(self) -> None:
        """Least recently used first out, until every model's states and the encoded
        pictures fit the budget."""
        for p in trim_folder(self.folder, self.budget_bytes):
            self._forget(p)

    def set_budget(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._writer.submit(self._trim)

    def delete_tag(self, tag: str) -> int:
        """Remove every state of the chat `tag` (any model's). Returns how many went."""
        self.flush()
        return delete_tagged(self.folder, tag, self._forget)

    def _forget(self, path: Path) -> None:
        with self._lock:
            self._index.pop(path, None)

    def flush(self) -> None:
        """Wait for the writes in flight."""
        for f in list(self._pending):
            f.result()
        self._pending.clear()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop_ahead()
        if self._reader is not None:
            self._reader.shutdown(wait=True)
        self.flush()
        self._writer.shutdown(wait=True)


def _kept_files(folder: Path) -> list[Path]:
    try:
        return list(folder.glob("*" + SUFFIX)) + list((folder / "pictures").glob("*.ebbemb"))
    except OSError:
        return []


def folder_usage(folder: Path) -> tuple[int, int]:
    """(states, bytes of states and pictures) kept in `folder`."""
    n = total = 0
    for p in _kept_files(folder):
        try:
            total += p.stat().st_size
        except OSError:
            continue
        n += p.suffix == SUFFIX
    return n, total


def trim_folder(folder: Path, budget_bytes: int) -> list[Path]:
    """Remove the least recently used files until the rest fit `budget_bytes`; returns them."""
    files = []
    for p in _kept_files(folder):
        try:
            st = p.stat()
        except OSError:
            continue
        files.append((st.st_mtime, st.st_size, p))
    total = sum(s for _, s, _ in files)
    gone = []
    for _, size, p in sorted(files):
        if total <= budget_bytes:
            break
        try:
            p.unlink()
        except OSError:
            continue
        gone.append(p)
        total -= size
    return gone


def delete_tagged(folder: Path, tag: str, forget: Callable[[Path], None] | None = None) -> int:
    """Remove every state file of the chat `tag` in `folder`."""
    n = 0
    try:
        paths = list(folder.glob(f"{safe_tag(tag)}-*{SUFFIX}"))
    except OSError:
        return 0
    for p in paths:
        try:
            p.unlink()
            n += 1
        except OSError:
            continue
        if forget is not None:
            forget(p)
    return n
