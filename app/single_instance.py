"""One window per data folder: two writers damage each other's conversations.

The first window holds an exclusive lock on `<data folder>/ebb.lock` (an OS file lock: a window
that crashed, or was killed, holds nothing) and listens on a local socket named after the
folder. A second start finds the lock taken, sends its file arguments to that socket and exits:
the running window comes to the front and opens them. If the running window does not answer,
the second start says that Ebb is already running with this folder and exits.
GUI thread only (the lock itself is plain Python).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

LOCK_NAME = "ebb.lock"


def server_name(data_dir: Path) -> str:
    digest = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:16]
    return f"ebb-{digest}"


class FolderLock:
    """An exclusive, non-blocking lock on the data folder; released when the process ends."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> bool:
        try:
            import fcntl
        except ImportError:  # Windows: no protection (Ebb ships for Linux)
            return True
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:  # a read-only folder: the store opens in memory and writes nothing
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        try:  # who holds it (for the message a later start gives): nice to have, not needed
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError:  # a full disk: the lock holds all the same
            pass
        self._fd = fd
        return True

    def holder_pid(self) -> int | None:
        try:
            return int(self.path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def send_to_running(data_dir: Path, paths: list[str], timeout_ms: int = 5000) -> bool:
    """Hand our file arguments to the window that owns the folder; True once it answered."""
    from PySide6.QtNetwork import QLocalSocket

    sock = QLocalSocket()
    sock.connectToServer(server_name(data_dir))
    if not sock.waitForConnected(timeout_ms):
        return False
    sock.write(json.dumps({"paths": [str(Path(p).resolve()) for p in paths]}).encode() + b"\n")
    if not sock.waitForBytesWritten(timeout_ms) or not sock.waitForReadyRead(timeout_ms):
        return False
    answered = bytes(sock.readAll().data()).startswith(b"ok")
    sock.disconnectFromServer()
    return answered


def listen(data_dir: Path, parent: Any, on_paths: Callable[[list[str]], None]) -> Any:
    """Answer later starts: each one's file paths go to `on_paths` (on the GUI thread)."""
    from PySide6.QtNetwork import QLocalServer

    name = server_name(data_dir)
    QLocalServer.removeServer(name)  # a crashed window's socket file: we hold the lock now
    server = QLocalServer(parent)
    if not server.listen(name):
        return None

    def on_connection() -> None:
        sock = server.nextPendingConnection()
        if sock is None:
            return

        def on_ready() -> None:
            if not sock.canReadLine():
                return
            try:
                paths = list(json.loads(bytes(sock.readLine().data()).decode()).get("paths", []))
            except (ValueError, AttributeError):
                paths = []
            sock.write(b"ok\n")
            sock.flush()
            sock.disconnectFromServer()
            on_paths([str(p) for p in paths])

        sock.readyRead.connect(on_ready)
        sock.disconnected.connect(sock.deleteLater)

    server.newConnection.connect(on_connection)
    return server
