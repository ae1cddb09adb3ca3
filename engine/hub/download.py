"""Downloading a model's files so that nothing is lost: huggingface_hub resumes only within one
call and checks no content hash, so the durable part is Ebb's.

- Bytes go to `NAME.part` beside the destination; a later call (after a pause, a dropped
  connection, a crash or a restart) asks for the rest with Range and `If-Range: ETAG`, so a
  file that changed on the Hub starts again instead of being spliced.
- A dropped connection or a stall (no byte for STALL_S) is retried with backoff, from the last
  byte written, up to `retries` times in a row.
- The sha256 is computed while writing (over the part already on disk first) and checked
  against the Hub's LFS hash; a mismatch is said plainly and the file kept aside as
  `NAME.sha256-mismatch`, never deleted.
- Free disk is checked before the first byte; a disk that fills mid-way keeps the part, and
  the next call resumes once there is room.
- One download per file at a time (a lock beside the part): a second is told, not spliced in.

`download_file` runs on the calling thread (a worker's, or the CLI's main thread); `cancel`
pauses it between reads, keeping the part.
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import EbbError
from engine.gguf.info import not_gguf_words
from engine.hub.catalog import HubFile
from engine.hub.remote import hub_error

CHUNK_BYTES = 1 << 20
STALL_S = 30.0  # no byte for this long: the connection is dropped and tried again
FREE_MARGIN_BYTES = 256 << 20  # left free on the disk beside what the file needs


class DownloadPaused(Exception):
    """The cancel event was set: the part is kept for the next call."""


@dataclass(frozen=True)
class Progress:
    name: str
    done_bytes: int
    total_bytes: int
    rate_Bps: float  # over the last few seconds
    attempt: int  # 1, then 2, 3... after retries
    retry_in_s: float = 0.0  # > 0: the link failed; the next try comes this many seconds on

    @property
    def left_s(self) -> float | None:
        return (self.total_bytes - self.done_bytes) / self.rate_Bps if self.rate_Bps > 0 else None

    def words(self) -> str:
        """What the CLI and the dialog say of it: bytes, rate, time left, and a retry's wait."""
        from engine.units import fmt_bytes

        head = f"{self.name}: {fmt_bytes(self.done_bytes)} of {fmt_bytes(self.total_bytes)}"
        if self.retry_in_s > 0:
            return (f"{head}: the link stopped; retrying ({self.attempt - 1}), next try in "
                    f"{self.retry_in_s:.0f} s")
        left = f", about {self.left_s:.0f} s left" if self.left_s is not None else ""
        retry = f" (try {self.attempt})" if self.attempt > 1 else ""
        return (f"{head} ({self.done_bytes / max(self.total_bytes, 1):.0%}), "
                f"{fmt_bytes(int(self.rate_Bps))}/s{left}{retry}")


GGUF_MAGIC = b"GGUF"


def part_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".part")


def _lock(dest: Path) -> Any:
    """An exclusive lock beside the part (fcntl, released when the process ends), or an error
    saying another download of this file is under way."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fh = open(dest.with_name(dest.name + ".lock"), "a+")
    try:
        import fcntl

        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ImportError:  # not POSIX: no lock, as before
        pass
    except OSError:
        fh.close()
        raise EbbError(f"{dest.name} is being downloaded already (another window or command)",
                       "wait for that download, or stop it") from None
    return fh


def _hash_part(part: Path) -> Any:
    h = hashlib.sha256()
    if part.exists():
        with open(part, "rb") as fh:
            for block in iter(lambda: fh.read(CHUNK_BYTES), b""):
                h.update(block)
    return h


def _check_room(folder: Path, need_bytes: int, name: str) -> None:
    free = shutil.disk_usage(folder).free
    if free < need_bytes + FREE_MARGIN_BYTES:
        raise EbbError(f"not enough free disk for {name}: {need_bytes / 2**30:.2f} GiB more is "
                       f"needed and {FREE_MARGIN_BYTES / 2**20:.0f} MiB is kept free beside it, "
                       f"{free / 2**30:.2f} GiB is free in {folder}",
                       "free some space; the part already downloaded is kept")


def _sha_note(dest: Path) -> Path:
    return dest.with_name(dest.name + ".sha256")


def _is_current(dest: Path, f: HubFile) -> bool:
    """Whether the finished `dest` is the Hub's `f`: its size, and its sha256 (noted when it was
    verified, else hashed now, once) against the listing's (a same-size file replaced upstream
    was called ready: #52)."""
    if not dest.exists() or dest.stat().st_size != f.size_bytes:
        return False
    if not f.sha256:
        return True
    note = _sha_note(dest)
    have = note.read_text().strip() if note.exists() else _hash_part(dest).hexdigest()
    if not note.exists():
        note.write_text(have)
    return have == f.sha256


def _stale_part(part: Path, f: HubFile) -> bool:
    """A part whose saved ETag names another file than the listing's (the Hub's ETag of an LFS
    file is its sha256): it is started again before any byte is asked for."""
    etag_file = part.with_name(part.name + ".etag")
    if not (f.sha256 and part.exists() and etag_file.exists()):
        return False
    etag = etag_file.read_text().strip().removeprefix("W/").strip('"')
    return len(etag) == 64 and etag != f.sha256


def download_file(repo: str, f: HubFile, dest: Path, endpoint: str | None = None,
                  token: str | None = None, on_progress: Callable[[Progress], None] | None = None,
                  cancel: threading.Event | None = None, retries: int = 8,
                  backoff_s: float = 1.0) -> Path:
    """`f` of `repo` into `dest`, resumed from any part left before. Returns `dest`. A file
    here that is not the Hub's any more (its sha256) is downloaded again beside it and replaces
    it once verified."""
    if _is_current(dest, f):
        return dest
    lock = _lock(dest)
    part = part_path(dest)
    try:
        if part.exists() and (part.stat().st_size > f.size_bytes or _stale_part(part, f)):
            part.unlink()  # not a part of this file: started again
            part.with_name(part.name + ".etag").unlink(missing_ok=True)
        _check_room(dest.parent, f.size_bytes - (part.stat().st_size if part.exists() else 0),
                    f.name)
        digest = [_hash_part(part)]  # a list: a restarted file gets a new hash
        failures = 0
        while True:
            before = part.stat().st_size if part.exists() else 0
            try:
                _fetch_rest(repo, f, part, digest, endpoint, token, on_progress, cancel,
                            failures + 1)
                break
            except (DownloadPaused, EbbError):
                raise
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise EbbError(f"the disk filled while downloading {f.name}",
                                   "free some space and download again: it goes on from "
                                   f"{part.stat().st_size / 2**20:.0f} MiB") from None
                failures = _retry_or_raise(exc, _in_a_row(failures, part, before), retries,
                                           backoff_s, f, endpoint, cancel, part, on_progress)
            except Exception as exc:  # noqa: BLE001 - the HTTP client's errors of many kinds
                status = getattr(getattr(exc, "response", None), "status_code", None) or 0
                if 400 <= status < 500:  # asking again would be answered the same
                    raise hub_error(exc, f"{repo}/{f.name}", endpoint or "the Hub") from None
                failures = _retry_or_raise(exc, _in_a_row(failures, part, before), retries,
                                           backoff_s, f, endpoint, cancel, part, on_progress)
        _verify(part, dest, f, digest[0].hexdigest())
        return dest
    finally:  # no lock left behind, nor an ETag without its part (#52)
        dest.with_name(dest.name + ".lock").unlink(missing_ok=True)  # while still held
        lock.close()
        if not part.exists():
            part.with_name(part.name + ".etag").unlink(missing_ok=True)


def _in_a_row(failures: int, part: Path, before: int) -> int:
    """Failures count in a row: an attempt that wrote bytes starts the count again."""
    return 0 if part.exists() and part.stat().st_size > before else failures


def _retry_or_raise(exc: Exception, failures: int, retries: int, backoff_s: float, f: HubFile,
                    endpoint: str | None, cancel: threading.Event | None, part: Path,
                    on_progress: Callable[[Progress], None] | None) -> int:
    failures += 1
    if failures > retries:
        raise EbbError(f"the download of {f.name} failed {failures} times in a row "
                       f"({type(exc).__name__}: {exc})",
                       "check the network and download again: it goes on from where it stopped") from None
    wait = min(backoff_s * 2 ** (failures - 1), 60.0)
    if on_progress is not None:  # the wait is said, not shown as a progress frozen for minutes
        have = part.stat().st_size if part.exists() else 0
        on_progress(Progress(f.name, have, f.size_bytes, 0.0, failures + 1, retry_in_s=wait))
    if cancel is not None and cancel.wait(wait):
        raise DownloadPaused(f.name)
    return failures


def _fetch_rest(repo: str, f: HubFile, part: Path, digest: list[Any], endpoint: str | None,
                token: str | None, on_progress: Callable[[Progress], None] | None,
                cancel: threading.Event | None, attempt: int) -> None:
    from huggingface_hub import get_session, hf_hub_url
    from huggingface_hub.utils import build_hf_headers  # type: ignore[attr-defined]

    have = part.stat().st_size if part.exists() else 0
    if have >= f.size_bytes:
        return
    url = hf_hub_url(repo, f.name, endpoint=endpoint)
    headers = build_hf_headers(token=token)
    etag_file = part.with_name(part.name + ".etag")
    if have:
        headers["Range"] = f"bytes={have}-"
        if etag_file.exists():
            headers["If-Range"] = etag_file.read_text()
    with get_session().stream("GET", url, headers=headers, follow_redirects=True,
                              timeout=STALL_S) as r:
        r.raise_for_status()
        if have and r.status_code != 206:  # the file changed (If-Range): start again
            part.unlink()
            digest[0] = hashlib.sha256()
            have = 0
        etag = r.headers.get("etag")
        if etag:
            etag_file.write_text(etag)
        window: list[tuple[float, int]] = [(time.monotonic(), have)]
        with open(part, "ab") as fh:
            for block in r.iter_bytes(CHUNK_BYTES):
                if cancel is not None and cancel.is_set():
                    raise DownloadPaused(f.name)
                fh.write(block)
                digest[0].update(block)
                have += len(block)
                _tell(on_progress, f, have, window, attempt)
        if have < f.size_bytes:
            raise ConnectionError(f"the connection ended at byte {have} of {f.size_bytes}")


def _tell(on_progress: Callable[[Progress], None] | None, f: HubFile, have: int,
          window: list[tuple[float, int]], attempt: int) -> None:
    now = time.monotonic()
    window.append((now, have))
    while len(window) > 2 and now - window[0][0] > 5.0:
        window.pop(0)
    span = now - window[0][0]
    rate = (have - window[0][1]) / span if span > 0 else 0.0
    if on_progress is not None:
        on_progress(Progress(f.name, have, f.size_bytes, rate, attempt))


def _verify(part: Path, dest: Path, f: HubFile, sha256: str) -> None:
    if f.name.endswith(".gguf"):  # a file that is not a GGUF is never called ready
        with open(part, "rb") as fh:
            head = fh.read(64)
        magic = head[:4]
        if magic != GGUF_MAGIC:
            aside = dest.with_name(dest.name + ".not-gguf")
            os.replace(part, aside)
            raise EbbError(f"{f.name} from the Hub is not a GGUF file ({not_gguf_words(head)}); "
                           f"it is kept aside as {aside.name}",
                           "pick another file, or check the mirror (HF_ENDPOINT)")
    if f.sha256 and sha256 != f.sha256:
        aside = dest.with_name(dest.name + ".sha256-mismatch")
        os.replace(part, aside)
        raise EbbError(f"{f.name} does not match the Hub's sha256 (got {sha256[:12]}…, expected "
                       f"{f.sha256[:12]}…); the file is kept aside as {aside.name}",
                       "download it again (it starts over); if it happens again, the mirror "
                       "may serve a damaged copy")
    os.replace(part, dest)
    part.with_name(part.name + ".etag").unlink(missing_ok=True)
    _sha_note(dest).write_text(sha256)
