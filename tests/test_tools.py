"""Tools in the chat (engine/tools): the MCP servers' file, real servers written with the SDK
(tests/tool_servers.py) over stdio and Streamable HTTP with the faults users meet, and the
loop of calls on the real model (a grammar-forced call where the small model would not call
by itself)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine.errors import EbbError
from engine.tools.servers import ServerDef, merged, parse_config, read_config, write_config

SERVERS = Path(__file__).parent / "tool_servers.py"


def stdio(name: str, mode: str | None = None, **kw) -> ServerDef:
    return ServerDef(name, command=sys.executable, args=(str(SERVERS), mode or name), **kw)


def test_the_servers_file_is_the_one_people_have(tmp_path):
    data = {"mcpServers": {
        "files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "/tmp"],
                  "env": {"API_KEY": "secret"}, "autoApprove": ["read"]},
        "web": {"url": "https://example.com/mcp", "headers": {"Authorization": "Bearer x"},
                "timeout": 5}}}
    files, web = parse_config(data)
    assert files.stdio and files.args[-1] == "/tmp" and not web.stdio and web.timeout_s == 5
    # the consent shows the command and the variables' names, never their values
    assert "npx -y @modelcontextprotocol/server-filesystem /tmp" in files.describe()
    assert "API_KEY" in files.describe() and "secret" not in files.describe()
    # another definition, another consent
    assert stdio("a").fingerprint() == stdio("a").fingerprint() != stdio("a", "crash").fingerprint()
    # written again, keys Ebb does not read stay
    path = tmp_path / "mcp.json"
    write_config(path, [files, web])
    assert json.loads(path.read_text())["mcpServers"]["files"]["autoApprove"] == ["read"]
    assert read_config(path) == (files, web)
    # consent is to a definition: another command or argument is asked again
    from app.core.store import Store
    from app.core.tools import consented, set_consent

    store = Store(tmp_path / "data")
    try:
        set_consent(store, stdio("a"), True)
        assert consented(store, stdio("a")) and not consented(store, stdio("a", "crash"))
        assert consented(store, web)  # a URL runs nothing here
    finally:
        store.close()
    # an import: a name already taken gets a number
    assert [s.name for s in merged((files,), (files, web))] == ["files", "files 2", "web"]
    for bad, words in (({"mcpServers": {"x": {"command": "a", "url": "http://b"}}}, "both"),
                       ({"mcpServers": {"x": {"args": ["a"]}}}, "needs 'command'"),
                       ({"mcpServers": {"x": {"command": "a", "args": "b"}}}, "'args'"),
                       ({"mcpServers": {"x": {"url": "ftp://a"}}}, "http"),
                       ({"mcpServers": {"x": {"command": "a", "timeout": -1}}}, "timeout"),
                       ([1], "not an MCP servers file")):
        with pytest.raises(EbbError, match=words):
            parse_config(bad)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(EbbError, match="broken.json is not valid JSON"):
        read_config(tmp_path / "broken.json")


@pytest.fixture
def host(tmp_path):
    from engine.tools.host import ToolHost

    h = ToolHost(tmp_path / "files", start_timeout_s=120)  # a busy machine starts them slowly
    yield h
    h.close()


def test_servers_that_misbehave_are_said_and_the_others_work(host, tmp_path):
    """Started together: the good one, one that prints garbage first, one that never answers,
    one that exits, an invalid schema, a second `echo`, one that speaks only an old protocol
    and one from the future."""
    from engine.tools.host import FAILED, READY
    from engine.tools.loop import offer

    from engine.tools.host import ToolHost

    names = ["tools", "garbage", "exit", "badschema", "same", "old", "new"]
    host.set_servers([stdio(n) for n in names], lambda d: True)
    # the one that never answers, on a host of its own with a short start (seven servers starting
    # at once on a busy machine take longer than that: they have the default)
    hangs = ToolHost(tmp_path / "hang", start_timeout_s=2)
    try:
        hangs.set_servers([stdio("hang")], lambda d: True)
        assert hangs.settled(60) and hangs.state("hang").phase == FAILED
        assert "did not answer within 2 s" in hangs.state("hang").message
    finally:
        hangs.close()
    assert host.settled(120)
    state = {s.name: s for s in host.states()}
    assert {n for n, s in state.items() if s.phase == READY} == {"tools", "garbage", "badschema", "same", "old"}
    assert all(state[n].phase == FAILED for n in ("exit", "new"))
    assert "no API key given" in state["exit"].stderr_tail  # its last words on stderr
    assert "2099-01-01" in state["new"].message and "does not know" in state["new"].message
    assert state["old"].protocol == "2024-11-05"
    assert "not JSON-RPC" in host._tail(host._entries["garbage"])  # kept aside, not a failure
    assert state["badschema"].skipped and state["badschema"].skipped[0].startswith("broken:")
    for name in ("tools", "garbage", "badschema", "same", "old"):
        out = host.call(name, "echo", {"text": "hi"})
        assert (out.state, out.text) == ("done", "echo: hi"), (name, out)
    # two servers offer `echo`: each is offered under a name of its own
    offered, left = offer(host.tools())
    fns = [o.fn for o in offered]
    assert len(fns) == len(set(fns)) and "tools_echo" in fns and "same_echo" in fns and not left


def test_calls_end_as_they_should(host, tmp_path):
    """Text, a picture, a clip, an error, 50 MB, a Stop, a timeout, a crash mid-call and a
    restart, a server removed during a call, and quitting during one (its process group ends)."""
    from PIL import Image

    os.environ["EBB_TEST_SECRET"] = "not for servers"
    try:
        host.set_servers([stdio("tools", env=(("GIVEN", "1"),)), stdio("crash")], lambda d: True)
        assert host.settled(120) and {s.phase for s in host.states()} == {"ready"}
    finally:
        del os.environ["EBB_TEST_SECRET"]
    # a small environment (ours is not passed on) plus what the user set; a group of its own
    me = json.loads(host.call("tools", "whoami", {}).text)
    assert "GIVEN" in me["env"] and "EBB_TEST_SECRET" not in me["env"] and me["own_group"]
    red = host.call("tools", "picture", {})
    assert red.state == "done" and len(red.pictures) == 1
    assert Image.open(red.pictures[0]).convert("RGB").getpixel((3, 3)) == (255, 0, 0)
    assert host.call("tools", "tone", {}).clips[0].suffix == ".wav"
    failed = host.call("tools", "fail", {})
    assert failed.state == "done" and failed.is_error

    def slow_call(server: str, flag: Path, cancel=None, timeout_s=None) -> dict:
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(o=host.call(
            server, "slow", {"flag": str(flag)}, cancel, timeout_s)))
        t.start()
        out["thread"] = t
        return out

    # Stop: the call ends as stopped, and the server takes the next call
    cancel = threading.Event()
    call = slow_call("tools", tmp_path / "never1", cancel)
    _wait_file(Path(str(tmp_path / "never1") + ".started"))
    cancel.set()
    call["thread"].join(30)
    assert call["o"].state == "cancelled"
    assert host.call("tools", "echo", {"text": "still here"}).text == "echo: still here"
    # the server's own timeout
    assert host.call("tools", "slow", {"flag": str(tmp_path / "never2")}, timeout_s=0.5).state == "timeout"
    # a crash mid-call: failed, with the server's last words; the state says so; a restart works
    crashed = host.call("crash", "crash", {})
    assert crashed.state == "failed" and "about to crash" in crashed.text
    assert host.settled(30, until=lambda s: host.state("crash").phase == "failed")
    assert "about to crash" in host.state("crash").stderr_tail
    host.restart("crash")
    assert host.settled(120) and host.state("crash").phase == "ready"
    assert host.call("crash", "crash", {}).state == "failed"


@pytest.mark.slow
def test_fifty_megabytes_removal_and_quit_mid_call(host, tmp_path):
    """A 50 MB result (cut for the model, said), a server removed while its call runs, and
    quitting while one runs: the process group ends."""
    host.set_servers([stdio("tools"), stdio("crash")], lambda d: True)
    assert host.settled(120) and {s.phase for s in host.states()} == {"ready"}
    big = host.call("tools", "big", {"megabytes": 50})
    assert big.state == "done" and big.chars == 50 << 20 and "the result was cut here" in big.text

    def slow_call(server: str, flag: Path) -> dict:
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(o=host.call(server, "slow", {"flag": str(flag)})))
        t.start()
        out["thread"] = t
        return out

    # removed while a call runs: the call fails, the window's thread is not held
    call = slow_call("tools", tmp_path / "never3")
    pid = _wait_file(Path(str(tmp_path / "never3") + ".started"))
    host.set_servers([stdio("crash")], lambda d: False)  # returns at once: it ends on the loop
    call["thread"].join(30)
    assert call["o"].state == "failed"
    assert _gone(pid)
    # quit while a call runs: the process group ends
    host.set_servers([stdio("tools")], lambda d: True)
    assert host.settled(120)
    call = slow_call("tools", tmp_path / "never4")
    pid = _wait_file(Path(str(tmp_path / "never4") + ".started"))
    host.close()
    call["thread"].join(30)
    assert call["o"].state in ("failed", "cancelled") and not _alive(pid)


def _wait_file(path: Path) -> int:
    """The slow tool's marker (its pid), waited for as the event it is (the call's own thread
    cannot report it: the call is running)."""
    import time

    deadline = time.monotonic() + 60
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never came"
        threading.Event().wait(0.02)
    return int(path.read_text())


def _gone(pid: int) -> bool:
    """The process ends (the SDK closes its stdin, then TERM and KILL to its group), waited for
    as the event it is."""
    import time

    deadline = time.monotonic() + 60
    while _alive(pid) and time.monotonic() < deadline:
        threading.Event().wait(0.05)
    return not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) is not alive
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ")[1][:1] != "Z"


def test_a_streamable_http_server(host, tmp_path):
    from tests.helpers import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SERVERS), "http", str(port)],
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # uvicorn says when it listens
            if "Uvicorn running" in line:
                break
        host.set_servers([ServerDef("web", url=f"http://127.0.0.1:{port}/mcp")], lambda d: True)
        assert host.settled(60) and host.state("web").phase == "ready", host.state("web")
        assert len(host.call("web", "picture", {}).pictures) == 1
        assert host.call("web", "big", {"megabytes": 5}).chars == 5 << 20
    finally:
        proc.kill()
        proc.wait()
    # a URL where nothing listens: failed, said
    host.set_servers([ServerDef("gone", url=f"http://127.0.0.1:{free_port()}/mcp")], lambda d: True)
    assert host.settled(60) and host.state("gone").phase == "failed"


def test_the_model_calls_a_tool_and_sees_its_picture(model_path, colour_projector, tmp_path):
    """The demo through a tool: the model is made to call `picture` (a grammar-forced first
    round), the picture goes through the projector as an attached one does, and a colour the
    reply names is red. The second round evaluates only its new tokens: the KV cache holds the
    call and before."""
    from engine.config import SessionConfig
    from engine.llama.sampling import GenParams
    from engine.session import Session
    from engine.tools.host import ToolHost
    from engine.tools.loop import Decision, first_choice, offer, run_tool_turn
    from tests.helpers import N_THREADS, first_colour

    host = ToolHost(tmp_path / "files")
    try:
        host.set_servers([stdio("demo", "tools")], lambda d: True)
        assert host.settled(60)
        offered, _ = offer(host.tools())
        asked = []
        with Session(SessionConfig(model_path, colour_projector, n_ctx=2048, n_threads=N_THREADS)) as s:
            s, tt = run_tool_turn(
                s, "What colour is this picture? Answer with one word.", [],
                GenParams(max_tokens=24, temperature=0), offered,
                ask=lambda rec: asked.append(rec.label) or Decision.ONCE,
                call=lambda rec, c: host.call("demo", rec.fn, rec.arguments, c),
                choice=first_choice("picture", offered), max_rounds=1)
            assert asked == ["demo:picture"] and tt.calls[0].state == "done"
            second = tt.rounds[1]
            # the tool's picture went through the projector, as an attached one does
            assert second.n_images == 1 and second.n_images_encoded == 1, second
            assert second.gen.n_prompt_tokens_evaluated < second.gen.n_prompt_tokens / 2
            # a colour it names is the picture's (the tool's name says none). Whether it names
            # one here is not decided: the words before it were within 0.1 logit of others
            # (measured: "The function returned: \"picture\"." on the cached path, "...a solid
            # red picture." on the whole prompt, red then by 6 logits)
            assert first_colour(tt.text) in (None, "red"), tt.text
            roles = [t.role for t in s.history]
            assert roles == ["user", "assistant", "user", "assistant"] and s.history[2].image_keys
            # denied: the model is told, nothing runs
            s, tt = run_tool_turn(s, "Add 2 and 3.", [], GenParams(max_tokens=40, temperature=0), offered,
                                  ask=lambda rec: Decision.DENY,
                                  call=lambda rec, c: pytest.fail("a denied call ran"),
                                  choice=first_choice("add", offered), max_rounds=1)
            assert tt.calls[0].state == "denied" and "did not allow" in s.history[-2].text
    finally:
        host.close()


def test_the_loop_ends_a_repeat_and_keeps_to_its_rounds():
    """Pure logic of the loop (its turns stand in for the model's): a call made again with the
    same arguments is answered without tools, and after the limit of rounds no tool is offered."""
    from engine.events import TurnResult
    from engine.tools.host import CallOutcome, ServerTool
    from engine.tools.loop import Decision, offer, run_tool_turn

    class Chat:
        def __init__(self):
            self.history: list = []
            self.model = type("M", (), {"runtime": None})()
            self.encoder = type("E", (), {"ram": None, "enabled": False})()

        def set_tools(self, t):
            pass

        def set_system(self, s):
            self.system = s

        def reply_was_calls(self, text, calls):
            pass

        def take_back_last(self):
            self.taken_back = True

    def model(replies):
        def turn(s, text, images, gp, on_text, cancel, role, extra):
            reply = replies.pop(0)
            if gp.grammar.startswith("root ::= [^{"):  # no call may begin: it answers in words
                reply = "words"
            on_text(reply)
            return s, TurnResult(0, text=reply)
        return turn

    tool = ServerTool("calc", "add", "Add.", {"type": "object", "properties": {"a": {"type": "integer"}}})
    offered, _ = offer([tool])
    call = '{"name": "add", "arguments": {"a": 1}}'
    ran = []
    chat = Chat()
    _, tt = run_tool_turn(chat, "q", [], _gp(), offered, ask=lambda r: Decision.ALWAYS,
                          call=lambda r, c: ran.append(r) or CallOutcome("done", "2", clips=[Path("a.wav")]),
                          turn=model([call, call, "unused"]))
    # a clip in the result, and no projector that hears: the model is told in words
    assert "which you cannot hear: no projector that hears is loaded" in tt.calls[0].said_to_model
    assert len(ran) == 1 and tt.ended == "repeat" and tt.text == "words" and chat.taken_back
    assert "same arguments" in tt.message and "You can call these functions" in chat.system
    ran.clear()
    calls = [f'{{"name": "add", "arguments": {{"a": {i}}}}}' for i in range(10)]
    always: set[str] = set()
    _, tt = run_tool_turn(Chat(), "q", [], _gp(), offered, ask=lambda r: Decision.ALWAYS, always=always,
                          call=lambda r, c: ran.append(r) or CallOutcome("done", "ok"),
                          turn=model(calls), max_rounds=3)
    # asked once ("always"), three rounds, then words
    assert len(ran) == 3 and tt.ended == "rounds" and tt.text == "words" and always == {"calc:add"}
    assert [c.decision for c in tt.calls] == ["always", "allowed", "allowed"]


def _gp():
    from engine.llama.sampling import GenParams

    return GenParams(max_tokens=8)


@pytest.mark.slow  # a model loaded in a process of its own: 9 s of make test's 12 minutes
def test_chat_mcp_asks_on_the_terminal(model_path, tmp_path):
    """`ebb-engine chat --mcp FILE`: the server starts after a yes, the call runs after one,
    and --json lists it."""
    cfg = tmp_path / "mcp.json"
    write_config(cfg, [stdio("demo", "tools")])
    env = {**os.environ, "EBB_DATA_DIR": str(tmp_path / "data")}
    p = subprocess.run([sys.executable, "-m", "engine", "chat", "--model", str(model_path), "--mcp", str(cfg),
                        "--tool-choice", "add", "--prompt", "What is 2 plus 3?", "--max-tokens", "40",
                        "--temp", "0", "--threads", "1", "--max-tool-rounds", "1", "--json"],
                       input="y\ny\n", capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    assert "start the MCP server 'demo'" in p.stderr and "call demo:add" in p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    (c,) = out["tool_calls"]
    assert c["tool"] == "demo:add" and c["state"] == "done" and c["result"]["text"] == "5"
    assert out["tool_rounds"] == 2


def test_a_template_with_its_own_tool_format(model_path, tmp_path):
    """SmolLM2 with a Hermes template (as Qwen's): the tools are the template's, the call stays
    in the history as the template writes calls and the result as a `tool` message; the next
    round evaluates only what is new; a kept call, set back as history, is the same two."""
    from engine.config import SessionConfig
    from engine.llama.sampling import GenParams
    from engine.session import Session
    from engine.synth.model_gen import with_chat_template
    from engine.tools.host import ToolHost
    from engine.tools.loop import Decision, first_choice, history_turns, offer, run_tool_turn, stored_record
    from tests.helpers import N_THREADS

    template = (Path(__file__).parent / "templates" / "hermes-tools.jinja").read_text()
    hermes = with_chat_template(model_path, tmp_path / "smollm2-hermes.gguf", template)
    host = ToolHost(tmp_path / "files")
    try:
        host.set_servers([stdio("demo", "tools")], lambda d: True)
        assert host.settled(120)
        offered, _ = offer(host.tools())
        told = []
        with Session(SessionConfig(hermes, n_ctx=2048, n_threads=N_THREADS)) as s:
            s, tt = run_tool_turn(s, "What is 2 plus 3?", [], GenParams(max_tokens=40, temperature=0),
                                  offered, ask=lambda r: Decision.ONCE, on_call=lambda r: told.append(r.to_dict()),
                                  call=lambda r, c: host.call("demo", r.fn, r.arguments, c),
                                  choice=first_choice("add", offered), max_rounds=1)
            assert tt.calls[0].state == "done" and tt.calls[0].said_to_model == "5"
            roles = [(t.role, bool(t.extra)) for t in s.history]
            assert roles == [("user", False), ("assistant", True), ("tool", True), ("assistant", False)]
            assert s.history[1].extra["tool_calls"][0]["function"]["arguments"] == {"a": 2, "b": 3}
            assert "<tool_call>" not in tt.text  # the call is a card, not text
            second = tt.rounds[1].gen
            assert second.n_prompt_tokens_evaluated < second.n_prompt_tokens / 2, second
            # reopened: the kept call as the loop made it, and a turn after it
            kept = [("user", "What is 2 plus 3?", []), ("tool", "5", [], stored_record(told[-1])),
                    ("assistant", tt.text, [])]
            s.set_history(history_turns(kept, "hermes"))
            assert [t.role for t in s.history] == ["user", "assistant", "tool", "assistant"]
            assert s.history[1].extra["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
            assert s.history[2].extra == {"tool_call_id": tt.calls[0].id, "name": "add"}
            again = s.turn("Thanks.", gp=GenParams(max_tokens=4, temperature=0))
            assert again.error is None
    finally:
        host.close()
