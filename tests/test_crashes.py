"""A process of Ebb's that dies says why at the next start (#67): the window and the stand-in
keep a crash file that Python's fault handler writes to; the next window names what died, its
first lines and where the whole report is kept. The deaths here are real signals."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from engine import crashlog
from tests.helpers import N_THREADS, RpcServer, track_window, wait_for, wait_for_line


@pytest.fixture(autouse=True)
def no_core_files():
    """The deaths here are on purpose: the children they kill leave no core file (a developer
    with core dumps on found one in the checkout after each run)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_CORE, (soft, hard))


def test_a_window_that_dies_is_named_at_the_next_start_with_its_report(monkeypatch, qtbot, tmp_path):
    """The window, killed by SIGSEGV while it writes a reply (past its first decode, which has
    a guard of its own): the next start's notice says Ebb stopped unexpectedly, the fault
    handler's first line, and where the report is; the report is kept, and said once."""
    from app.core.settings import session_config
    from app.core.store import Store
    from app.main import open_window

    data = tmp_path / "data"
    monkeypatch.setenv("EBB_DATA_DIR", str(data))
    monkeypatch.setenv("EBB_NATIVE_DIR", str(tmp_path / "native"))
    first = Store(data)
    first.settings.set("ctx", 1024)
    first.close()
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", EBB_TEST_SEND="Hello")
    proc = subprocess.Popen([sys.executable, "-m", "app", "--threads", str(N_THREADS)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        wait_for_line(proc.stdout, "streaming")
        proc.send_signal(signal.SIGSEGV)
        proc.wait(60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGSEGV
    [report] = crashlog.unreported()
    assert report.role == "window" and report.fault() == "Segmentation fault"
    store = Store(data)
    cfg, rpc = session_config(store, "default", "")
    try:
        w = track_window(open_window(store, cfg, rpc))
        qtbot.addWidget(w)
        w.show()
        [text] = [n.text() for n in w.notices.area.notices() if "stopped unexpectedly" in n.text()]
        kept = next((data / "crashes").glob("crash-window-*.txt"))
        assert "Segmentation fault" in text and str(kept) in text
        assert "Fatal Python error: Segmentation fault" in kept.read_text()
        assert crashlog.unreported() == []  # said once; this window's own file is alive
        wait_for(lambda: w.chat.loaded)  # the model loads as at any start
        w.grab().save(str(tmp_path / "stopped-unexpectedly.png"))
        w.close()
    finally:
        store.close()
    left = {p.name for p in (data / "crashes").glob("window-*.log")}
    assert crashlog.unreported() == [] and left <= {f"window-{os.getpid()}.log"}  # this one's own


def test_the_stand_in_keeps_a_crash_file_and_one_stopped_on_purpose_leaves_none(monkeypatch, qtbot, tmp_path):
    """The stand-in's server (`ebb-engine rpc-serve` with the role the window gives it): a
    SIGSEGV is written to its crash file; the window's stop (SIGTERM) leaves nothing to report."""
    from app.core.standin import StandIn

    monkeypatch.setenv("EBB_DATA_DIR", str(tmp_path))
    monkeypatch.setenv(crashlog.ROLE_ENV, "stand-in")
    server = RpcServer()  # up: it accepts connections
    server.proc.send_signal(signal.SIGSEGV)
    server.proc.wait(60)
    [report] = crashlog.unreported()
    assert report.role == "stand-in" and report.fault() == "Segmentation fault", report.lines
    crashlog.mark_reported(report)
    monkeypatch.delenv(crashlog.ROLE_ENV)  # the window's StandIn sets it itself
    calm = StandIn(64 * 2**20)
    try:
        wait_for(calm.ready)
        assert list((tmp_path / "crashes").glob(f"stand-in-{calm.proc.pid}.log"))
    finally:
        calm.stop()
    assert crashlog.unreported() == []


def test_a_process_killed_from_outside_is_reported_without_a_traceback(monkeypatch, tmp_path):
    monkeypatch.setenv("EBB_DATA_DIR", str(tmp_path))
    code = "from engine import crashlog; crashlog.enable('window'); print('up', flush=True); input()"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        wait_for_line(proc.stdout, "up")
        proc.kill()
        proc.wait(60)
    finally:
        proc.kill()
    [report] = crashlog.unreported()
    assert report.lines == () and "ended from outside" in report.summary()
    done = subprocess.run([sys.executable, "-c", "from engine import crashlog; crashlog.enable('window')"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert [r.pid for r in crashlog.unreported()] == [report.pid]  # a normal exit leaves none
