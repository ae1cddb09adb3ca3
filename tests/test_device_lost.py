"""An RPC server killed *during* a step: ggml-rpc aborts the process; we say why and leave
cleanly (CLI: exit code 3), or start again without it (window: conversation kept)."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers import RpcServer

LONG = "Write a long story about a lighthouse keeper, with many chapters."


def _kill_mid_step(proc: subprocess.Popen, server: RpcServer, started) -> tuple[str, str]:
    """Wait until `started(proc.stdout)` (a step is under way), kill the server, collect."""
    try:
        assert proc.stdout is not None
        started(proc.stdout)
        server.proc.kill()
        return proc.communicate(timeout=120)
    finally:
        server.stop()
        if proc.poll() is None:
            proc.kill()


def test_cli_says_which_server_died_mid_reply_and_exits_3():
    server = RpcServer()
    proc = subprocess.Popen([sys.executable, "-m", "engine", "chat", "--rpc", server.endpoint,
                             "--prompt", LONG, "--max-tokens", "2000", "--ctx", "4096",
                             "--threads", "2", "--mover", "reload"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = _kill_mid_step(proc, server, lambda f: f.read(40))  # the reply is streaming
    print(f"\nrc {proc.returncode}; stderr tail: {err.strip().splitlines()[-1]}")
    assert proc.returncode == 3
    assert f"the RPC server {server.endpoint} went away during a step" in err


def test_window_restarts_without_the_dead_server_and_keeps_the_conversation(tmp_path):
    from app.core.store import Store

    server = RpcServer()
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", EBB_DATA_DIR=str(tmp_path / "data"),
               EBB_TEST_SEND=LONG, EBB_TEST_PRINT_NOTICE="1")
    env.pop("EBB_NOTICE", None)
    env.pop("EBB_LOST_RPC", None)
    proc = subprocess.Popen([sys.executable, "-m", "app", "--model", "default", "--mmproj", "",
                             "--rpc", server.endpoint, "--ctx", "4096", "--threads", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out, err = _kill_mid_step(proc, server, lambda f: f.readline())  # prints "streaming"
    print(f"\n{out.strip()}")
    assert proc.returncode == 0, err[-2000:]
    assert f"the rpc server {server.endpoint} went away during a step" in out.lower()
    store = Store(tmp_path / "data")
    try:
        conv = store.conversations()[0]
        msgs = store.messages(conv.id)
        assert msgs and msgs[0].role == "user" and msgs[0].text == LONG
    finally:
        store.close()


def test_a_conversation_carried_to_a_new_session_keeps_all_its_owner_keeps(model_path):
    """#70: after a device is lost the conversation goes on in a new session; only its turns
    and tools went over, so its kept states were filed under another chat ("x"), thinking
    switched off came back on, and forgotten turns were counted again. All of it goes over."""
    from engine.session import Session, SessionConfig
    from tests.helpers import N_THREADS

    cfg = SessionConfig(model_path, None, n_ctx=512, n_threads=N_THREADS)
    with Session(cfg) as lost, Session(cfg) as new:
        lost.set_history([("user", "Hi", []), ("assistant", "Hello", []), ("user", "Bye", []),
                          ("assistant", "Goodbye", [])], tag="chat-7")
        lost.set_template_kwargs({"enable_thinking": False})
        lost.set_tools([{"type": "function", "function": {"name": "f", "parameters": {}}}])
        lost.chat.forgotten = 2  # two turns left the model's memory to fit the context
        new.adopt_conversation(lost)
        assert new.chat.tag == "chat-7" and new.chat.template_kwargs == {"enable_thinking": False}
        assert new.chat.forgotten == 2 and [t.text for t in new.history] == ["Hi", "Hello", "Bye", "Goodbye"]
        assert new.chat.tools == lost.chat.tools and not new.chat.resumes_from_cache
