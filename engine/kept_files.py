"""The files Ebb keeps as caches (the conversations' KV states, the encoded pictures): a magic
line, the header's length, a JSON header, then the bytes. Written through a temporary file and
a rename; read back checked against the hashes the header carries, or not at all: a file that
does not parse or whose bytes do not match is removed, never trusted. A use touches the file
(the folder's budget lets the least recently used go first).

The bytes are hashed in pieces of HASH_CHUNK, each piece's XXH3-128 in the header: reading
back, each piece is hashed on a pool thread while the next is read. The hash finds damage (a
disk, a copy cut short), not tampering: XXH3 (the `xxhash` package) does that at memory speed,
where sha256 took 19 ms of a 21 MiB state's 23 ms from disk to the KV cache (#54). Files
written before carry each piece's sha256, or one sha256 of the whole, and read back checked
the same way.

On Linux the bytes are not copied at all (`map_checked`): the file is mapped, its pages
populated with `MADV_POPULATE_READ` (which answers a file cut short or a disk error with an
error, where touching a mapped page past the end would be a SIGBUS) and hashed where they lie
in the page cache. Reading 78 MiB into a fresh buffer took 43 ms here, 32 of them faulting the
buffer's pages in; mapping and populating it takes 0.1 ms (#54). Elsewhere, and on kernels
before 5.14, the bytes are read into a buffer as before.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import hashlib
import io
import json
import mmap
import os
import struct
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import xxhash

HASH_CHUNK = 4 << 20
_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(
                max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="ebb-hash")
        return _POOL


def _sha(view: memoryview) -> str:
    return hashlib.sha256(view).hexdigest()


def _xxh3(view: memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(view)


# a header's per-piece hashes, newest first: its key and how a piece is hashed
_PIECE_HASHES: tuple[tuple[str, Callable[[memoryview], str]], ...] = (
    ("xxh3_chunks", _xxh3), ("sha256_chunks", _sha))


def digests(data: "bytes | bytearray | memoryview") -> dict[str, Any]:
    """What the header says of `data`: its length and each HASH_CHUNK piece's XXH3-128."""
    view = memoryview(data)
    return {"nbytes": len(view), "hash_chunk": HASH_CHUNK,
            "xxh3_chunks": [_xxh3(view[i:i + HASH_CHUNK]) for i in range(0, len(view), HASH_CHUNK)]}


def read_header(f: io.BufferedIOBase, magic: bytes, limit: int) -> dict[str, Any]:
    """A kept file's JSON header (after `magic` and its 8-byte length), the file left at the
    data; ValueError when it is not one."""
    if f.read(len(magic)) != magic:
        raise ValueError("not a file of ours")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > limit:
        raise ValueError("header too long")
    head = json.loads(f.read(n))
    if not isinstance(head, dict):
        raise ValueError("no header")
    return head


def read_checked(f: io.BufferedIOBase, head: dict[str, Any],
                 cancel: threading.Event | None = None) -> bytearray | None:
    """The bytes after the header, read into place and checked against the header's hashes
    (ValueError when they differ, or the file is shorter or longer); None when `cancel` was set
    between two pieces."""
    want = int(head["nbytes"])
    data = bytearray(want)
    view = memoryview(data)
    chunks, hash_piece = next(((head[k], fn) for k, fn in _PIECE_HASHES if isinstance(head.get(k), list)),
                              (None, _sha))
    piece = int(head.get("hash_chunk") or HASH_CHUNK) if isinstance(chunks, list) else 8 << 20
    whole = hashlib.sha256() if not isinstance(chunks, list) else None
    pending: list[concurrent.futures.Future[str]] = []
    got = 0
    while got < want:
        if cancel is not None and cancel.is_set():
            return None
        n = f.readinto(view[got:got + piece])
        if not n:
            break
        if whole is not None:
            whole.update(view[got:got + n])
        else:
            pending.append(_pool().submit(hash_piece, view[got:got + n]))
        got += n
    if got != want or f.read(1):
        raise ValueError("the file's length does not match its header")
    if whole is not None:
        if whole.hexdigest() != head.get("sha256"):
            raise ValueError("the bytes do not match their header")
    elif [p.result() for p in pending] != chunks:
        raise ValueError("the bytes do not match their header")
    return data


MADV_POPULATE_READ = 22  # Linux 5.14: fault a range in, or fail with an error (no SIGBUS)
_CAN_MAP = sys.platform.startswith("linux")


class Mapped:
    """A kept file's bytes where they lie, mapped (copy on write, never written) from the page
    cache: what `map_checked` gives instead of a buffer. Its pages are populated before every
    use (`populated`), so a file cut short or a disk error under it is an error, not a SIGBUS.
    Its hashes may still be being checked on the pool while a C call reads it (`intact` waits
    for them). The mapping goes when the last reference to it does."""

    def __init__(self, mm: mmap.mmap, offset: int, nbytes: int) -> None:
        self._mm, self._offset, self._nbytes = mm, offset, nbytes
        self._check: tuple[list[concurrent.futures.Future[str]], list[str]] | None = None
        self._intact: bool | None = None
        self.on_damaged: Callable[[], None] | None = None  # told once, when `intact` finds it so

    def check(self, chunks: list[str], piece: int, hash_piece: Callable[[memoryview], str]) -> None:
        """Start hashing each `piece` bytes on the pool, against `chunks` (`intact` waits)."""
        view = self.view()  # each future holds its piece's view: the mapping stays until they are done
        self._check = ([_pool().submit(hash_piece, view[i:i + piece]) for i in range(0, self._nbytes, piece)],
                       list(chunks))

    def intact(self) -> bool:
        """Whether the bytes match their header's hashes (waiting for a check still running)."""
        if self._intact is None:
            futures, want = self._check or ([], [])
            self._intact = [f.result() for f in futures] == want
            self._check = None
            if not self._intact and self.on_damaged is not None:
                self.on_damaged()
        return self._intact

    def __len__(self) -> int:
        return self._nbytes

    def view(self) -> memoryview:
        return memoryview(self._mm)[self._offset:self._offset + self._nbytes]

    def populated(self) -> bool:
        """Every page is in memory and mapped (the kernel said so), so reading them cannot fault."""
        return self.populate() == 0

    def populate(self) -> int:
        """0, or the errno the kernel answered (EINVAL: a kernel without MADV_POPULATE_READ;
        EFAULT, EIO: the file is shorter than the mapping or the disk failed)."""
        try:
            self._mm.madvise(MADV_POPULATE_READ)
            return 0
        except OSError as e:
            return e.errno or errno.EIO
        except ValueError:  # the mapping was closed
            return errno.EBADF

    def as_ctypes(self) -> "ctypes.Array[ctypes.c_uint8]":
        """The bytes as a ctypes array over the mapping, for a C call that reads them."""
        return (ctypes.c_uint8 * self._nbytes).from_buffer(self._mm, self._offset)


def map_checked(f: io.BufferedIOBase, head: dict[str, Any], cancel: threading.Event | None = None,
                checked_later: bool = False) -> "Mapped | bytearray | None":
    """`read_checked`'s bytes without copying them: the file mapped from where `f` stands and
    checked against the header's hashes (ValueError when they differ, or the file is shorter
    or longer). `checked_later`: the pieces are hashed on the pool while the caller goes on
    (a restore copies the bytes meanwhile), and `Mapped.intact` says how that ended. Where a
    mapping cannot be made or populated safely (not Linux, a kernel before 5.14, a file system
    that cannot map, a header without per-piece hashes) the bytes are read into a buffer and
    checked, as `read_checked` does."""
    chunks, hash_piece = next(((head[k], fn) for k, fn in _PIECE_HASHES if isinstance(head.get(k), list)),
                              (None, _sha))
    if not _CAN_MAP or not isinstance(chunks, list):
        return read_checked(f, head, cancel)
    want, offset = int(head["nbytes"]), f.tell()
    if os.fstat(f.fileno()).st_size != offset + want:
        raise ValueError("the file's length does not match its header")
    if want == 0:
        return read_checked(f, head, cancel)
    try:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except OSError:  # a file system that cannot map (some FUSE and network ones): read it
        return read_checked(f, head, cancel)
    mapped = Mapped(mm, offset, want)
    err = mapped.populate()
    if err in (errno.EFAULT, errno.EIO, getattr(errno, "EHWPOISON", errno.EIO)):
        raise ValueError(f"the file could not be read ({os.strerror(err)})")
    if err:  # an older kernel (EINVAL), short of memory: read it as before
        del mapped
        mm.close()
        return read_checked(f, head, cancel)
    if cancel is not None and cancel.is_set():
        return None
    mapped.check(chunks, int(head.get("hash_chunk") or HASH_CHUNK), hash_piece)
    if not checked_later and not mapped.intact():
        raise ValueError("the bytes do not match their header")
    return mapped


def write_atomically(path: Path, magic: bytes, head: dict[str, Any], data: bytes | bytearray | memoryview) -> bool:
    """`magic`, the header's length, the header, then `data`, through a temporary file and a
    rename; False (and nothing left) when the disk refused (full, read-only)."""
    raw = json.dumps(head, separators=(",", ":")).encode()
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(magic + struct.pack("<Q", len(raw)) + raw)
            f.write(data)
        os.replace(tmp, path)
        return True
    except OSError:
        remove(tmp)
        return False


def touch(path: Path) -> None:
    """Used: the last to leave."""
    try:
        os.utime(path)
    except OSError:
        pass


def remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
