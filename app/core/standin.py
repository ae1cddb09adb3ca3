"""The stand-in accelerator: `ebb-engine rpc-serve --device-memory SIZE` as a child process on
loopback, for a machine without a GPU. It serves this machine's RAM as a device of SIZE bytes
(it reports SIZE; an allocation past it fails as on a full GPU), so the memory panel shows layers
on a "device", the projector borrowing their room, and the swap in the timeline. Qt-free: the
window polls `ready()` on a timer and stops it when it closes. Never listens beyond 127.0.0.1.
"""
from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from engine import crashlog
from engine.errors import EbbError
from engine.paths import engine_argv
from engine.units import fmt_bytes

# larger than the demo model's live layout alone at its default context, smaller than the model
# and the demo projector together: the projector must borrow the layers' room
DEFAULT_BYTES = 300 * 2**20
HOST = "127.0.0.1"
START_TIMEOUT_S = 60.0  # the first start builds the cap's small library with the C compiler


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class StandIn:
    def __init__(self, memory_bytes: int = DEFAULT_BYTES, log_dir: Path | None = None) -> None:
        self.memory_bytes = memory_bytes
        self.port = _free_port()
        self.endpoint = f"{HOST}:{self.port}"
        self._log_path = (log_dir / "stand-in.log") if log_dir is not None else None
        log = open(self._log_path, "w") if self._log_path is not None else subprocess.DEVNULL
        self._started = time.monotonic()
        self.proc = subprocess.Popen([*engine_argv(), "rpc-serve", "--host", HOST, "--port", str(self.port),
                                      "--device-memory", str(memory_bytes)],
                                     stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL,
                                     env={**os.environ, crashlog.ROLE_ENV: "stand-in"})
        if not isinstance(log, int):  # a file of ours, not subprocess.DEVNULL
            log.close()

    @property
    def label(self) -> str:
        return f"stand-in accelerator ({fmt_bytes(self.memory_bytes)}, {self.endpoint})"

    def ready(self) -> bool:
        """True once it accepts connections; EbbError when it ended or never came up."""
        if self.proc.poll() is not None:
            raise EbbError(f"the stand-in accelerator stopped (exit {self.proc.returncode}): "
                           f"{self._tail()}")
        try:
            socket.create_connection((HOST, self.port), timeout=0.05).close()
            return True
        except OSError:
            if time.monotonic() - self._started > START_TIMEOUT_S:
                self.stop()
                raise EbbError("the stand-in accelerator did not start in "
                               f"{START_TIMEOUT_S:.0f} s: {self._tail()}") from None
            return False

    def _tail(self) -> str:
        if self._log_path is None or not self._log_path.exists():
            return "no log"
        lines = self._log_path.read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else "no output"

    def stop(self) -> None:
        """Ended on purpose: its crash file goes too (a crash before this stays reported)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            crashlog.forget(self.proc.pid, "stand-in")
