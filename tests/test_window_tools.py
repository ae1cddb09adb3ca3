"""Tools in the real window: a server from the data folder's mcp.json (written with the SDK:
tests/tool_servers.py), switched on for the chat, the call's card asked and allowed, its result
kept in the conversation's tree and given back to the model when the chat is reopened."""
from __future__ import annotations

import sys
from pathlib import Path

from PySide6.QtCore import Qt

from app.core.tools import chat_tools
from tests.helpers import open_window, shown_text, wait_for

SERVERS = Path(__file__).parent / "tool_servers.py"


def _with_server(store, name="demo", consent=True):
    from app.core.tools import ChatTools, servers_path, set_chat_tools, set_consent
    from engine.tools.servers import ServerDef, write_config

    d = ServerDef(name, command=sys.executable, args=(str(SERVERS), "tools"))
    write_config(servers_path(store), [d])
    if consent:
        set_consent(store, d, True)
    conv = store.create_conversation()
    set_chat_tools(store, conv, ChatTools((name,)))
    return d, conv


def _deny_the_rest(w) -> None:
    """Wait for the turn's end; a call the model makes by itself after the forced one (what it
    calls may differ on another CPU) is denied on its card."""
    def ended() -> bool:
        live = w.tools.live
        if live is not None and live.get("state") == "asked":
            w.tools.answer(live["id"], "deny")
        return not w.chat.busy
    wait_for(ended)


def _one_turn_of_calls(msgs) -> None:
    """The user's message, its calls (the forced one first), the reply."""
    roles = [m.role for m in msgs]
    assert roles[0] == "user" and roles[-1] == "assistant" and set(roles[1:-1]) == {"tool"}, \
        [(m.role, m.text) for m in msgs]


def test_a_call_is_asked_on_its_card_and_kept_in_the_chat(qtbot, store, tmp_path, monkeypatch):
    d, conv = _with_server(store)
    # LM Studio's servers on this machine: offered for import in the Tools dialog
    home = tmp_path / "home"
    (home / ".lmstudio").mkdir(parents=True)
    (home / ".lmstudio" / "mcp.json").write_text(
        '{"mcpServers": {"demo": {"command": "uvx", "args": ["some-server"]}}}')
    monkeypatch.setenv("HOME", str(home))
    w = open_window(qtbot, store, max_tokens=48)
    wait_for(lambda: w.tools.host.state("demo") is not None and w.tools.host.state("demo").phase == "ready")
    assert w.conv_id == conv  # the only chat: opened first
    w.composer.edit.setPlainText("/tool add What is 2 plus 3?")
    w.sending.send()
    wait_for(lambda: w.tools.live is not None and w.tools.live.get("state") == "asked")
    assert "Allow once" in w.transcript.toPlainText() and "demo:add" in w.transcript.toPlainText()
    w.tools.answer(w.tools.live["id"], "once")
    _deny_the_rest(w)
    msgs = w.store.messages(conv)
    _one_turn_of_calls(msgs)
    tool = msgs[1].tool
    assert tool["label"] == "demo:add" and tool["state"] == "done" and msgs[1].text == "5"
    assert tool["arguments"] == {"a": 2, "b": 3}
    text = shown_text(w.transcript)
    assert "Tool" in text and "demo:add" in text and "Show the result" in text
    # reopened: the engine's history has the call and its result (as two messages)
    w.sending.send_history()
    wait_for(lambda: w.worker.session is not None and len(w.worker.session.history) == 2 * len(msgs) - 2)
    roles = [t.role for t in w.worker.session.history]
    assert roles[:2] == ["user", "assistant"] and roles[-1] == "assistant"
    # export keeps the call (Markdown and JSON), search finds its result
    from app.core.export import render

    md = render(w.store, conv, "md")
    assert "## Tool: demo:add (done)" in md and '{"a": 2, "b": 3}' in md
    assert '"tool": {' in render(w.store, conv, "json")
    assert any(c.id == conv for c in w.store.conversations("5"))
    # Regenerate asks again before the call runs; denied, the model is told and answers
    w.sending.regenerate()
    wait_for(lambda: w.tools.live is not None and w.tools.live.get("state") == "asked")
    w.tools.answer(w.tools.live["id"], "deny")
    _deny_the_rest(w)
    msgs = w.store.messages(conv)
    _one_turn_of_calls(msgs)
    assert msgs[1].tool["state"] == "denied" and len(msgs[1].siblings) == 2  # the old call is a version
    # the Tools dialog: the server ready, on in this chat, LM Studio's offered; imported, its
    # name taken, it becomes "demo 2" and waits for a yes before it starts
    w.tools.open_dialog()
    dlg = w.tools.dialog
    assert dlg.found.isVisible() and "Import 1 from LM Studio" in dlg.found.text()
    assert dlg.table.item(0, 1).text() == "demo" and "ready with" in dlg.table.item(0, 3).text()
    w.tools._act("import_path", "", str(home / ".lmstudio" / "mcp.json"))
    assert [x.name for x in w.tools.defs] == ["demo", "demo 2"] and not dlg.found.isVisible()
    assert "not started" in dlg.table.item(1, 3).text()
    asked = []
    w.tools.ask = lambda title, text: asked.append(text) or False  # the consent, said no to
    dlg.table.item(1, 0).setCheckState(Qt.CheckState.Checked)
    assert "uvx some-server" in asked[0] and "demo 2" not in chat_tools(store, conv).servers


def test_stop_ends_a_running_call_and_the_window_goes_on(qtbot, store, tmp_path):
    """Always allowed for the chat (asked once), the slow tool runs; Stop ends it (the server
    is told) and the turn; the card says stopped; the next message is answered."""
    from app.core.tools import chat_tools, servers_path, set_consent
    from engine.tools.servers import ServerDef, write_config

    d, conv = _with_server(store)
    d = ServerDef("demo", command=sys.executable, args=(str(SERVERS), "tools"), cwd=str(tmp_path))
    write_config(servers_path(store), [d])
    set_consent(store, d, True)
    w = open_window(qtbot, store, max_tokens=48)
    wait_for(lambda: w.tools.host.state("demo") is not None and w.tools.host.state("demo").phase == "ready")
    w.composer.edit.setPlainText("/tool wait Wait, please.")
    w.sending.send()
    wait_for(lambda: w.tools.live is not None and w.tools.live.get("state") == "asked")
    w.tools.answer(w.tools.live["id"], "always")
    assert chat_tools(store, conv).always == {"demo:wait"}
    wait_for(lambda: w.tools.live is not None and w.tools.live.get("state") == "running")
    wait_for(lambda: (tmp_path / "wait.started").exists())  # it runs
    w.sending.stop()
    wait_for(lambda: not w.chat.busy)
    msgs = w.store.messages(conv)
    assert msgs[1].role == "tool" and msgs[1].tool["state"] == "cancelled", [(m.role, m.tool) for m in msgs]
    assert "stopped" in shown_text(w.transcript)
    w.composer.edit.setPlainText("Say hello.")
    w.sending.send()
    _deny_the_rest(w)  # the model may call a tool by itself now: each is denied
    assert w.store.messages(conv)[-1].role == "assistant" and w.store.messages(conv)[-1].text


def test_a_tool_asked_for_with_no_server_ready_keeps_the_message(qtbot, store):
    """/tool NAME with the chat's server failed: nothing is sent, the composer says why and
    keeps the text; the failure itself is said in a notice with the server's last words."""
    from app.core.tools import ChatTools, servers_path, set_chat_tools, set_consent
    from engine.tools.servers import ServerDef, write_config

    d = ServerDef("files", command=sys.executable, args=(str(SERVERS), "exit"))
    write_config(servers_path(store), [d])
    set_consent(store, d, True)
    conv = store.create_conversation()
    set_chat_tools(store, conv, ChatTools(("files",)))
    w = open_window(qtbot, store)
    wait_for(lambda: w.tools.host.state("files") is not None and w.tools.host.state("files").phase == "failed")
    wait_for(lambda: "no API key given" in (w.notices.last_error or ""))
    w.composer.edit.setPlainText("/tool read What is in my notes?")
    w.sending.send()
    assert not w.chat.busy and not store.messages(conv)
    assert w.composer.edit.toPlainText() == "/tool read What is in my notes?"
    assert "needs a tool server that is ready" in w.composer.error.text()
