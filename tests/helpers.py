"""What the tests share beyond fixtures: the suite's thread count, the CLI as a user runs it,
a free loopback port, the stand-in accelerator in its own process, and the real window opened,
waited on and closed. Qt is imported only by the window helpers, so engine-only tests never
load it."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

def _suite_threads() -> int:
    """ggml spins: never more threads than the cores that are free as the suite starts (two at
    most, as on CI's 2 cores). With other work beside it (busy loops, a build: two tests timed
    out at load 9 with 2 threads each waiting on the other's core), one. The numerics-shaking
    run, `make test-numerics`, sets EBB_TEST_THREADS to run the output-comparing tests with
    others. Fixed for the whole run: a test's two sides always use the same count."""
    if os.environ.get("EBB_TEST_THREADS"):
        return int(os.environ["EBB_TEST_THREADS"])
    from engine.hw import physical_cores
    from engine.llama.thread_share import ProcSampler

    sampler = ProcSampler()
    try:
        running = sampler.running()
    finally:
        sampler.close()
    others = max(0, (running or 1) - 1)  # this process is one of them
    return max(1, min(2, physical_cores() - others))


N_THREADS = _suite_threads()


# ---------------------------------------------------------------- comparing model outputs
#
# llama.cpp's arithmetic depends on the evaluation path (one batch or token by token, a cached
# prefix and its last token or the whole prompt, flash attention, threads, batch size, the CPU
# variant): logits differ by up to ~0.9 between paths. A test that compares model outputs does
# one of two things, and its docstring says which:
# - SAME PATH: both sides evaluate the same tokens the same way (e.g. the reference is a fresh
#   session that evaluates the same history in one batch), so they agree to the bit;
# - DECIDED: the sides take different paths, and `agree_where_decided` compares what holds on
#   every CPU: the greedy tokens, up to the first step where either side's choice was close.
DECIDED_BY = 1.0  # logits between the best token and the next: more than paths differ by


def _entry(e: Any) -> dict[str, Any]:
    """A logprobs entry as JSON carries it: a turn's own (engine.events.Logprob) made so."""
    return e if isinstance(e, dict) else e.to_dict()


def margin(entry: Any) -> float:
    """How far the best token led the next one at a step (a logprobs entry with top 2)."""
    top = _entry(entry)["top_logprobs"]
    return float(top[0]["logprob"] - top[1]["logprob"]) if len(top) > 1 else float("inf")


def agree_where_decided(a: Sequence[Any], b: Sequence[Any],
                        by: float = DECIDED_BY, at_least: int = 1) -> int:
    """Two greedy replies' logprobs (GenParams(top_logprobs=2)) from different evaluation
    paths: the same token at every step until either side's choice was closer than `by`, after
    which they may part. Returns the number of steps compared, which must be `at_least` (a
    reply whose first step is already close proves nothing: the caller picks another prompt)."""
    n = _agreeing_steps(a, b, by)
    assert n >= at_least, f"only {n} decided steps compared (at least {at_least} wanted)"
    return n


def _agreeing_steps(a: Sequence[Any], b: Sequence[Any], by: float) -> int:
    for i, (x, y) in enumerate(zip(map(_entry, a), map(_entry, b))):
        if min(margin(x), margin(y)) < by:
            return i
        assert x["bytes"] == y["bytes"], (
            f"step {i}: {x['token']!r} (by {margin(x):.2f}) against {y['token']!r} "
            f"(by {margin(y):.2f}), both decided")
    return min(len(a), len(b))


def agree_turn_by_turn(these: list[dict[str, Any]], those: list[dict[str, Any]],
                       at_least: int = 1) -> int:
    """Two conversations' turns (`ebb-engine chat --json --top-logprobs 2` lines, or
    TurnResult.to_dict()s): each turn's reply agrees where decided. Returns the steps compared,
    `at_least` of them over all the turns."""
    assert len(these) == len(those), (len(these), len(those))
    for t in (*these, *those):
        assert "error" not in t and t.get("logprobs") is not None, t.get("error", "no logprobs")
    n = sum(_agreeing_steps(a["logprobs"], b["logprobs"], DECIDED_BY) for a, b in zip(these, those))
    assert n >= at_least, f"only {n} decided steps compared over the turns (at least {at_least} wanted)"
    return n


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `python -m engine ARGS` as a user would; returns the finished process."""
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True,
                          text=True, timeout=timeout)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RpcServer:
    """`ebb-engine rpc-serve` on loopback in its own process: the stand-in accelerator."""

    def __init__(self, *extra: str, host: str = "127.0.0.1", prefix: tuple[str, ...] = (),
                 ready_line: str | None = None) -> None:
        import socket
        import time

        self.port = free_port()
        self.endpoint = f"{host}:{self.port}"
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "engine", "rpc-serve", "--host", host, "--port",
             str(self.port), "--threads", str(N_THREADS), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output: list[str] = []
        if ready_line is not None:  # e.g. after warming its cache
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.output.append(line)
                if ready_line in line:
                    return
            raise RuntimeError("rpc-serve ended early:\n" + "".join(self.output))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection((host, self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("rpc-serve did not start")

    def _status(self, key: str) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    def rss_bytes(self) -> int:
        return self._status("VmRSS")

    def reset_peak(self) -> None:
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")

    def peak_rss_bytes(self) -> int:
        return self._status("VmHWM")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def wait_for_line(stream, needle: str, timeout: float = 120) -> None:
    """Wait for a line holding ``needle``; a thread keeps reading the pipe afterwards so the
    child never blocks on a full pipe. (select() on the buffered stream missed a line that
    arrived in the same read as the one before it: the CI failure of stop 22.)"""
    import threading

    done = threading.Event()
    found: list[str] = []
    before: list[str] = []  # what came before it, for the failure's message

    def read() -> None:
        for line in stream:
            if needle in line and not found:
                found.append(line)
                done.set()
            elif not found:
                before[:] = [*before[-30:], line]
        done.set()  # end of output: stop waiting

    threading.Thread(target=read, daemon=True).start()
    ended = not done.wait(timeout)
    if not found:
        raise AssertionError(f"never saw {needle!r} ({'timed out' if ended else 'the output ended'}); "
                             "the last lines:\n" + "".join(before))


# ------------------------------------------------------------------------------ the window

_open_windows: list[Any] = []


def wait_for(condition, timeout=120_000):
    """Spin the Qt event loop until `condition()` holds. Unlike QTest.qWait (which pytest-qt's
    waitUntil uses), QEventLoop.exec releases the GIL, so the engine thread's Python runs."""
    from PySide6.QtCore import QEventLoop, QTimer

    deadline = time.monotonic() + timeout / 1000
    # one loop and one timer of ours, freed here on this thread: QTimer.singleShot with a
    # delay makes a timer that deletes itself later, and one of those (thousands a test) once
    # had its Python wrapper freed before it, which crashed the suite
    loop = QEventLoop()
    tick = QTimer(singleShot=True, interval=10)
    tick.timeout.connect(loop.quit)
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} ms waiting for {condition}")
        tick.start()
        loop.exec()


def track_window(w: Any) -> Any:
    """Close `w` after the test, pass or fail (conftest's autouse fixture)."""
    _open_windows.append(w)
    return w


def close_open_windows() -> None:
    """Close every window a test opened."""
    while _open_windows:
        w = _open_windows.pop()
        if w.isVisible() or not w._thread.isFinished():
            w.close()


def fresh_store(tmp_path: Path) -> Any:
    """A store in a fresh data folder, with a small context and the suite's thread count."""
    from app.core.store import Store

    s = Store(tmp_path / "data")
    s.settings.set("ctx", 1024)
    s.settings.set("threads", N_THREADS)
    return s


def open_window(qtbot, store, model="default", mmproj="", rpc=None, max_tokens=24, wait="loaded",
                **settings):
    """The real window over `store` (settings written first), shown; waits until the model is
    loaded (`wait="loaded"`), loaded or refused with an error (`"settled"`), or not at all."""
    from app.core.settings import session_config
    from app.mainwindow.window import MainWindow
    from engine.llama.sampling import GenParams

    for k, v in settings.items():
        store.settings.set(k, v)
    cfg, rpc = session_config(store, model, mmproj, rpc=rpc or [])
    w = track_window(MainWindow(store, cfg, rpc))
    qtbot.addWidget(w)
    # the offscreen screen is 800 px wide, where a first start folds the Memory panel
    # (tests/test_panel_layout.py checks that); the suite's windows show it, as a wide screen does
    w.panel_dock.show()
    w.show()
    w.gen_params = GenParams(temperature=0, max_tokens=max_tokens)
    if wait == "loaded":
        wait_for(lambda: w.chat.loaded, timeout=120_000)
    elif wait == "settled":
        wait_for(lambda: w.chat.loaded or bool(w.notices.last_error))
    return w


def send(qtbot, w, text, timeout=120_000):
    """Type `text` into the composer, send it and wait until the reply has finished."""
    w.composer.edit.setPlainText(text)
    w.sending.send()
    wait_for(lambda: not w.chat.busy, timeout=timeout)


def shown_text(view: Any) -> str:
    """A transcript's text with each message's header as its name alone (its links — the
    versions, Edit, Regenerate, Delete — left out)."""
    import re

    return re.sub(r"(?m)^(You|Ebb)[ \xa0]{2,}.*$", r"\1", view.toPlainText())


def first_colour(text: str) -> str | None:
    """The first colour word of a reply (the demo colour projector's answer), or None."""
    import re

    from engine.synth.projector_gen import COLOURS

    return next((w for w in re.findall(r"[a-z]+", text.lower()) if w in COLOURS), None)
