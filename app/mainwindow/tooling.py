"""Tools in the window: the MCP servers (engine/tools/host.py, on a thread of its own), the
user's consent before a program starts, each chat's switches, the Tools… dialog, and a turn's
calls as cards in the transcript (asked, running, kept). GUI thread; the host tells its states
through a queued signal."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from PySide6.QtCore import QObject, QTimer, Signal
from PySide6.QtWidgets import QFileDialog, QMessageBox

from app.core.tools import ChatTools, chat_tools, consented, servers_path, set_chat_tools, set_consent
from app.dialogs.tools import ServerDialog, ToolsDialog, format_line
from app.mainwindow.parts import WindowParts
from engine import events
from engine.errors import EbbError
from engine.tools.host import FAILED, READY, ServerState, ToolHost
from engine.tools.servers import ServerDef, merged, other_apps_files, read_config, write_config


class _Relay(QObject):
    state = Signal(object)  # a ServerState, from the host's thread


class Tools:
    def __init__(self, window: WindowParts) -> None:
        self.w = window
        self._relay = _Relay()
        self._relay.state.connect(self._on_state)
        folder = window.store.folder
        self.host = ToolHost(folder / "tool-files", on_state=self._relay.state.emit)
        window.worker.tool_host = self.host
        self.defs: list[ServerDef] = []
        self.states: dict[str, ServerState] = {}
        self.dialog: ToolsDialog | None = None
        self.live: dict[str, Any] | None = None  # the reply's call that has a live card
        self._tick = QTimer(window.window(), interval=1000)  # a running call's seconds
        self._tick.timeout.connect(self._on_tick)
        self.ask: Callable[[str, str], bool] = self._ask_box  # (title, text) -> yes; a test's own

    def handlers(self) -> dict[type, Callable[[Any], None]]:
        return {events.ToolCallChanged: self.on_call}

    # ------------------------------------------------------------ servers

    def start(self) -> None:
        """The servers of the file; the ones the user said yes to start (in the background)."""
        if self.w.store.in_memory:
            return
        try:
            self.defs = list(read_config(servers_path(self.w.store)))
        except EbbError as exc:
            self.w.notices.error(f"Tools: {exc}. Fix the file, or remove it to start again.")
            self.defs = []
        self._apply()

    def _apply(self) -> None:
        self.host.set_servers(self.defs, lambda d: consented(self.w.store, d))
        self._refresh_dialog()

    def _save(self) -> None:
        try:
            write_config(servers_path(self.w.store), self.defs)
        except OSError as exc:
            self.w.notices.error(f"Could not save the tool servers: {exc.strerror or exc} "
                                 f"({servers_path(self.w.store)})")

    def _consent(self, d: ServerDef) -> bool:
        """Asked before a program first starts, and again when its definition changed."""
        if consented(self.w.store, d):
            return True
        yes = self.ask(f"Start the tool server “{d.name}”?",
                       "Ebb will run this program on your computer, with your permissions:\n\n"
                       f"{d.describe()}\n\nIt gets only the environment variables named above and "
                       "PATH, HOME, USER, SHELL, TERM, LOGNAME. Start it?")
        if yes:
            set_consent(self.w.store, d, True)
        return yes

    def _ask_box(self, title: str, text: str) -> bool:
        box = QMessageBox(QMessageBox.Icon.Question, title, text,
                          QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
                          self.w.window())
        box.setDefaultButton(QMessageBox.StandardButton.No)
        return box.exec() == QMessageBox.StandardButton.Yes

    def _on_state(self, state: ServerState) -> None:
        before = self.states.get(state.name)
        self.states[state.name] = state
        if state.phase == FAILED and (before is None or before.phase != FAILED) \
                and state.name in chat_tools(self.w.store, self.w.conv_id).servers:
            last = state.stderr_tail.splitlines()[-1] if state.stderr_tail else ""
            self.w.notices.error(f"The tool server “{state.name}” {state.words()}"
                                 + (f" (its last words: {last[:200]})" if last else "")
                                 + ". Model → Tools… shows more and restarts it.")
        self._refresh_dialog()

    def close(self) -> None:
        """The window goes: every server ends (a program's whole process group)."""
        self._tick.stop()
        self.host.close()

    # ------------------------------------------------------------ a chat's tools

    def for_send(self, conv_id: int, tell: bool = True) -> tuple[tuple[str, ...], set[str]] | None:
        """The chat's servers that are ready and the tools it always allows, for the next Send;
        None: no tools in this chat."""
        ct = chat_tools(self.w.store, conv_id)
        ready = tuple(n for n in ct.servers
                      if (st := self.host.state(n)) is not None and st.phase == READY)
        missing = [n for n in ct.servers if n not in ready and any(d.name == n for d in self.defs)]
        if missing and tell:
            said = [f"{n} ({st.words() if (st := self.host.state(n)) is not None else 'not started'})"
                    for n in missing]
            self.w.statusBar().showMessage(
                "Not ready, so this message goes without their tools: " + ", ".join(said), 10000)
        return (ready, set(ct.always)) if ready else None

    def switch(self, name: str, on: bool) -> None:
        ct = chat_tools(self.w.store, self.w.conv_id)
        d = next((x for x in self.defs if x.name == name), None)
        if on and d is not None and not self._consent(d):
            self._refresh_dialog()
            return
        servers = tuple(s for s in ct.servers if s != name) + ((name,) if on else ())
        set_chat_tools(self.w.store, self.w.conv_id, ChatTools(servers, ct.always))
        if on and d is not None:
            st = self.host.state(name)
            if st is None or st.phase not in ("ready", "starting"):
                self.host.restart(name)
        self._refresh_dialog()

    # ------------------------------------------------------------ the dialog

    def open_dialog(self) -> None:
        if self.dialog is None:
            self.dialog = ToolsDialog(self.w.window(), self.w.store.title(self.w.conv_id) if self.w.conv_id else "this chat",
                                      self._model_line(), self._act)
            self.dialog.finished.connect(lambda _r: setattr(self, "dialog", None))
        self._refresh_dialog()
        self.dialog.show()
        self.dialog.raise_()

    def _model_line(self) -> str:
        loaded = self.w.models.loaded
        if loaded is None:
            return format_line("", None)
        return format_line("The loaded model", loaded.tool_format)

    def _refresh_dialog(self) -> None:
        if self.dialog is None:
            return
        on = set(chat_tools(self.w.store, self.w.conv_id).servers)
        self.dialog.model_line.setText(self._model_line())
        self.dialog.offer_imports(self._importable())
        self.dialog.set_servers(self.defs, on, {**self.states, **{s.name: s for s in self.host.states()}})

    def _importable(self) -> list[tuple[str, str, int]]:
        """Other apps' files on this machine with servers Ebb does not have (by definition)."""
        out = []
        ours = {(d.command, d.args, d.url) for d in self.defs}
        for app, path in other_apps_files():
            try:
                theirs = read_config(path)
            except EbbError:
                continue
            new = [d for d in theirs if (d.command, d.args, d.url) not in ours]
            if new:
                out.append((app, str(path), len(new)))
        return out

    def _act(self, what: str, name: str, value: Any) -> None:
        d = next((x for x in self.defs if x.name == name), None)
        if what == "switch":
            self.switch(name, bool(value))
        elif what == "add":
            self._edit(None)
        elif what == "edit" and d is not None:
            self._edit(d)
        elif what == "remove" and d is not None:
            self.defs = [x for x in self.defs if x.name != name]
            set_consent(self.w.store, d, False)
            self._save()
            self._apply()  # a call it runs ends as failed; the chat goes on
        elif what == "restart" and d is not None:
            if self._consent(d):
                self.host.restart(name)
        elif what == "import":
            self._import()
        elif what == "import_path":
            self._import(Path(str(value)))
        self._refresh_dialog()

    def _edit(self, d: ServerDef | None) -> None:
        dlg = ServerDialog(self.dialog or self.w.window(), d,
                           {x.name for x in self.defs if d is None or x.name != d.name})
        if not dlg.exec() or dlg.result_def is None:
            return
        new = dlg.result_def
        self.defs = [new if d is not None and x.name == d.name else x for x in self.defs]
        if d is None:
            self.defs.append(new)
        self._save()
        if self._consent(new):
            self._apply()
            ct = chat_tools(self.w.store, self.w.conv_id)
            if new.name not in ct.servers:  # added from this chat: on in it
                set_chat_tools(self.w.store, self.w.conv_id, ChatTools((*ct.servers, new.name), ct.always))
        else:
            self._apply()

    def _import(self, path: Path | None = None) -> None:
        if path is None:
            found = other_apps_files()
            start = str(found[0][1]) if found else str(Path.home())
            names = "; ".join(f"{app}: {p}" for app, p in found)
            chosen, _ = QFileDialog.getOpenFileName(
                self.dialog or self.w.window(),
                "Import MCP servers" + (f" (found {names})" if names else ""), start, "JSON (*.json)")
            if not chosen:
                return
            path = Path(chosen)
        try:
            theirs = read_config(Path(path))
        except EbbError as exc:
            self.w.notices.error(f"Could not import: {exc}")
            return
        before = len(self.defs)
        ours = {(d.command, d.args, d.url) for d in self.defs}
        theirs = tuple(d for d in theirs if (d.command, d.args, d.url) not in ours)  # not twice
        self.defs = list(merged(tuple(self.defs), theirs))
        self._save()
        self._apply()  # each asks for its consent when it is first switched on
        self.w.statusBar().showMessage(f"Imported {len(self.defs) - before} tool servers from {path}", 8000)

    # ------------------------------------------------------------ a turn's calls

    def on_call(self, ev: events.ToolCallChanged) -> None:
        call = dict(ev.call)
        if ev.request_id != self.w.chat.request_id or not self.w.chat.busy:
            return
        if call.get("state") == "repeat":  # not run: the model answers without tools (a note says)
            return
        self.w.sending.take_stream()  # text before the call, where it belongs
        if call.get("state") != "asked" and self.w.statusBar().currentMessage().startswith(
                "The model asks to call"):
            self.w.statusBar().clearMessage()  # answered: the card says the rest
        if call.get("state") in ("asked", "running"):
            if call.get("state") == "running":
                call["since"] = time.monotonic()
                self._tick.start()
            self.live = call
            self.w.transcript.show_call(call)
            if call.get("state") == "asked":
                self.w.statusBar().showMessage(f"The model asks to call {call.get('tool')}: "
                                               "allow or deny it on its card", 10000)
            return
        self._tick.stop()
        self.live = None
        result = call.get("result") or {}
        files = [Path(p) for p in (*result.get("pictures", ()), *result.get("clips", ())) if Path(p).is_file()]
        kept = self.w.chat.tool_call_ended(call, files)
        self.w.transcript.end_call(kept)
        self.w.transcript.begin_reply(scroll=False)

    def answer(self, call_id: str, kind: str) -> None:
        """A card's Allow once / Always for this tool in this chat / Deny."""
        live = self.live
        if live is None or live.get("id") != call_id or live.get("state") != "asked":
            return
        if kind == "always":
            ct = chat_tools(self.w.store, self.w.conv_id)
            set_chat_tools(self.w.store, self.w.conv_id,
                           ChatTools(ct.servers, ct.always | {str(live.get("tool"))}))
        live["state"] = "answered"
        self.w.worker.answer_call(call_id, kind)

    def _on_tick(self) -> None:
        if self.live is not None and self.live.get("state") == "running" and self.w.transcript.live_call:
            self.w.transcript.show_call(self.live)
        else:
            self._tick.stop()
