"""A process that dies says why at the next start: each process Ebb starts (the window, with
the engine's thread in it, and the stand-in accelerator's server) keeps a crash file in the
data folder, `crashes/<role>-<pid>.log`, that Python's fault handler writes a fatal signal's
traceback to (every thread's). A normal exit removes it; one left behind by a process that is
gone is a process that died: `unreported()` finds it, the window says so with its first lines
and where it is, and `mark_reported` keeps it as `crash-<role>-<when>.txt` for the user to
read or send (the newest KEEP_REPORTS stay).

Qt-free; any thread. `enable` once per process, early (before llama.cpp is loaded).
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from engine import paths

ROLE_ENV = "EBB_CRASH_ROLE"  # a child process Ebb starts names its role here ("stand-in")
KEEP_REPORTS = 10
HEADER = "# Ebb crash file"
_enabled: Path | None = None


def crash_dir() -> Path:
    return paths.data_dir() / "crashes"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def enable(role: str) -> Path | None:
    """Python's fault handler writes this process's fatal signal to its crash file; removed at
    a normal exit. The file's path (None where the folder cannot be written: then stderr)."""
    import atexit
    import faulthandler

    global _enabled
    if _enabled is not None:
        return _enabled
    path = crash_dir() / f"{role}-{os.getpid()}.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(path, "w", encoding="utf-8")  # noqa: SIM115 - open for the life of the process
        fh.write(f"{HEADER}: {role}, process {os.getpid()}, started "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n# {' '.join(sys.argv)[:500]}\n")
        fh.flush()
    except OSError:
        faulthandler.enable()
        return None
    faulthandler.enable(file=fh, all_threads=True)
    _enabled = path

    def _remove() -> None:
        faulthandler.disable()
        fh.close()
        with contextlib.suppress(OSError):
            path.unlink()

    atexit.register(_remove)
    return path


def discard() -> None:
    """This process ends on purpose without running atexit (os._exit): no crash to report."""
    if _enabled is not None:
        with contextlib.suppress(OSError):
            _enabled.unlink()


def forget(pid: int, role: str) -> None:
    """A child process `pid` that was ended on purpose (terminated) leaves no crash to report."""
    with contextlib.suppress(OSError):
        (crash_dir() / f"{role}-{pid}.log").unlink()


@dataclass(frozen=True)
class Report:
    """A process of Ebb's that died: its role, when its file was last written, what it says."""
    role: str
    pid: int
    path: Path
    when: float
    lines: tuple[str, ...]  # the fault handler's, header left out; () when it wrote none

    def summary(self, n_lines: int = 4) -> str:
        """Its first lines, or why there are none."""
        if not self.lines:
            return ("no report was written: it was ended from outside (killed, or stopped by the "
                    "system, perhaps for lack of memory)")
        return "\n".join(self.lines[:n_lines])

    def fault(self) -> str:
        """The fault handler's one-line cause ("Segmentation fault"), or ""."""
        for line in self.lines:
            if line.startswith("Fatal Python error: "):
                return line.removeprefix("Fatal Python error: ").strip()
        return ""


def _read(path: Path) -> Report | None:
    role, _, pid_text = path.stem.rpartition("-")
    try:
        pid = int(pid_text)
        text = path.read_text(encoding="utf-8", errors="replace")
        when = path.stat().st_mtime
    except (OSError, ValueError):
        return None
    lines = tuple(ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#"))
    return Report(role or "ebb", pid, path, when, lines)


def unreported() -> list[Report]:
    """Crash files of processes that are gone, oldest first (not this process's)."""
    folder = crash_dir()
    out = []
    for path in folder.glob("*-*.log") if folder.is_dir() else []:
        report = _read(path)
        if report is not None and report.pid != os.getpid() and not _alive(report.pid):
            out.append(report)
    return sorted(out, key=lambda r: r.when)


def fault_of(pid: int) -> str:
    """The one-line cause a gone process `pid`'s crash file names, or ""."""
    return next((r.fault() for r in unreported() if r.pid == pid), "")


def mark_reported(report: Report) -> Path:
    """Keep the report as crash-<role>-<when>.txt (the newest KEEP_REPORTS stay); its path."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(report.when))
    kept = report.path.with_name(f"crash-{report.role}-{stamp}-{report.pid}.txt")
    try:
        report.path.replace(kept)
    except OSError:
        return report.path
    old = sorted(report.path.parent.glob("crash-*.txt"), key=lambda p: p.stat().st_mtime)
    for extra in old[:-KEEP_REPORTS]:
        with contextlib.suppress(OSError):
            extra.unlink()
    return kept
