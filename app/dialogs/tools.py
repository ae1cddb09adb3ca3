"""Tools… (Model → Tools…): the MCP servers the user added (the file other apps write), each
with its state, switched on for the open chat; add, edit, remove, restart, import another app's
servers. GUI thread only: the controller (app/mainwindow/tooling.py) does what it asks."""
from __future__ import annotations

import html
import shlex
from typing import Any, Callable

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine.errors import EbbError
from engine.tools.host import ServerState
from engine.tools.servers import DEFAULT_TIMEOUT_S, ServerDef, parse_server

FORMAT_WORDS = {"hermes": "its own format (Hermes <tool_call>, as Qwen's templates teach)",
                "llama3": "its own format (Llama 3.1's JSON calls)",
                "mistral": "its own format (Mistral's [TOOL_CALLS])"}


def format_line(model: str, fmt: str | None) -> str:
    """What the window says of the loaded model and tools."""
    if fmt is None:
        return "No model is loaded: tools are offered to the next one."
    if fmt:
        return f"{model} knows tools: they are offered in {FORMAT_WORDS.get(fmt, fmt)}."
    return (f"{model} has no tool format in its template that Ebb knows: the tools are "
            "described in the system prompt and each call is held to its schema (Ebb's generic "
            "format). Small models seldom call by themselves: “/tool NAME …” at the start of a "
            "message asks for that tool.")


class ServerDialog(QDialog):
    """One server: a program Ebb starts (stdio) or a URL (Streamable HTTP)."""

    def __init__(self, parent: QWidget | None, server: ServerDef | None, taken: set[str]) -> None:
        super().__init__(parent)
        self.setWindowTitle("Edit tool server" if server else "Add tool server")
        self.taken = taken
        self.result_def: ServerDef | None = None
        s = server or ServerDef("", command="")
        self.name = QLineEdit(s.name, placeholderText="e.g. files")
        self.kind = QComboBox()
        self.kind.addItems(["A program Ebb starts (stdio)", "A server at a URL (Streamable HTTP)"])
        self.kind.setCurrentIndex(0 if s.stdio or server is None else 1)
        self.command = QLineEdit(" ".join(shlex.quote(a) for a in (s.command, *s.args)) if s.stdio else "",
                                 placeholderText="npx -y @modelcontextprotocol/server-filesystem ~/Documents")
        self.env = QPlainTextEdit("\n".join(f"{k}={v}" for k, v in s.env))
        self.env.setPlaceholderText("NAME=value, one a line (it gets only these and PATH, HOME, "
                                    "USER, SHELL, TERM, LOGNAME)")
        self.env.setMaximumHeight(70)
        self.cwd = QLineEdit(s.cwd, placeholderText="(optional) the folder it runs in")
        self.url = QLineEdit(s.url, placeholderText="http://127.0.0.1:8000/mcp")
        self.headers = QPlainTextEdit("\n".join(f"{k}: {v}" for k, v in s.headers))
        self.headers.setPlaceholderText("Name: value, one a line (e.g. Authorization: Bearer …)")
        self.headers.setMaximumHeight(60)
        self.timeout = QDoubleSpinBox(minimum=1, maximum=3600, decimals=0, value=s.timeout_s,
                                      suffix=" s", toolTip="How long one call may take")
        self.error = QLabel(wordWrap=True, styleSheet="color:#c62828")
        self.error.hide()
        form = QFormLayout()
        form.addRow("Name", self.name)
        form.addRow("Kind", self.kind)
        form.addRow("Command", self.command)
        form.addRow("Environment", self.env)
        form.addRow("Folder", self.cwd)
        form.addRow("URL", self.url)
        form.addRow("Headers", self.headers)
        form.addRow("Call timeout", self.timeout)
        self._rows = form
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self._on_ok)
        buttons.rejected.connect(self.reject)
        lay = QVBoxLayout(self)
        lay.addLayout(form)
        lay.addWidget(self.error)
        lay.addWidget(buttons)
        self.kind.currentIndexChanged.connect(self._show_kind)
        self._show_kind()
        self.resize(560, self.sizeHint().height())

    def _show_kind(self) -> None:
        stdio = self.kind.currentIndex() == 0
        for w, on in ((self.command, stdio), (self.env, stdio), (self.cwd, stdio),
                      (self.url, not stdio), (self.headers, not stdio)):
            self._rows.setRowVisible(w, on)

    def _on_ok(self) -> None:
        try:
            self.result_def = self.server_def()
        except EbbError as exc:
            self.error.setText(str(exc))
            self.error.show()
            return
        self.accept()

    def server_def(self) -> ServerDef:
        name = self.name.text().strip()
        if name in self.taken:
            raise EbbError(f"there is a server named {name!r} already")
        spec: dict[str, Any] = {"timeout": self.timeout.value()}
        if self.kind.currentIndex() == 0:
            try:
                words = shlex.split(self.command.text())
            except ValueError as exc:
                raise EbbError(f"the command cannot be read ({exc})") from None
            if not words:
                raise EbbError("the command is empty: the program to run and its arguments")
            spec.update(command=words[0], args=words[1:], env=_pairs(self.env.toPlainText(), "="),
                        cwd=self.cwd.text().strip())
        else:
            spec.update(url=self.url.text().strip(), headers=_pairs(self.headers.toPlainText(), ":"))
        if spec.get("timeout") == DEFAULT_TIMEOUT_S:
            spec.pop("timeout")
        return parse_server(name, spec)


def _pairs(text: str, sep: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        key, found, value = line.partition(sep)
        if not found or not key.strip():
            raise EbbError(f"line {n} ({line.strip()[:40]!r}) is not NAME{sep}value")
        out[key.strip()] = value.strip()
    return out


class ToolsDialog(QDialog):
    """The servers, their states (kept up to date by `set_states`), and the open chat's
    switches. Every change is made by `act(what, name, value)` on the controller."""

    def __init__(self, parent: QWidget | None, chat_title: str, model_line: str,
                 act: Callable[[str, str, Any], None]) -> None:
        super().__init__(parent)
        self.setWindowTitle("Tools")
        self.act = act
        self._defs: list[ServerDef] = []
        self._on: set[str] = set()
        self._states: dict[str, ServerState] = {}
        self.model_line = QLabel(model_line, wordWrap=True)
        # other apps' servers found on this machine, offered once Ebb's own list is set
        self.found = QLabel(wordWrap=True, openExternalLinks=False)
        self.found.linkActivated.connect(lambda path: self.act("import_path", "", path))
        self.found.hide()
        self.table = QTableWidget(0, 4)
        self.table.setHorizontalHeaderLabels(["In this chat", "Server", "Runs", "State"])
        head = self.table.horizontalHeaderItem(0)
        if head is not None:
            head.setToolTip(f"Switched on for “{chat_title}”")
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().hide()
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.itemChanged.connect(self._on_item)
        self.table.itemSelectionChanged.connect(self._show_details)
        self.details = QPlainTextEdit(readOnly=True)
        self.details.setMaximumHeight(150)
        self.details.setPlaceholderText("Select a server: its tools, or why it failed")
        buttons = QHBoxLayout()
        for text, what in (("Add…", "add"), ("Edit…", "edit"), ("Remove", "remove"),
                           ("Restart", "restart"), ("Import…", "import")):
            b = QPushButton(text)
            b.clicked.connect(lambda _=False, w=what: self._on_button(w))
            buttons.addWidget(b)
            setattr(self, f"{what}_button", b)
        buttons.addStretch(1)
        close = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        close.rejected.connect(self.reject)
        lay = QVBoxLayout(self)
        lay.addWidget(self.model_line)
        lay.addWidget(self.found)
        lay.addWidget(self.table)
        lay.addLayout(buttons)
        lay.addWidget(self.details)
        lay.addWidget(close)
        self.resize(760, 460)

    def set_servers(self, defs: list[ServerDef], on: set[str], states: dict[str, ServerState]) -> None:
        keep = self.selected()
        self._defs, self._on, self._states = list(defs), set(on), dict(states)
        self.table.blockSignals(True)
        self.table.setRowCount(len(defs))
        for row, d in enumerate(defs):
            check = QTableWidgetItem()
            check.setFlags(Qt.ItemFlag.ItemIsUserCheckable | Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsSelectable)
            check.setCheckState(Qt.CheckState.Checked if d.name in on else Qt.CheckState.Unchecked)
            check.setData(Qt.ItemDataRole.UserRole, d.name)
            self.table.setItem(row, 0, check)
            self.table.setItem(row, 1, QTableWidgetItem(d.name))
            runs = " ".join((d.command, *d.args)) if d.stdio else d.url
            self.table.setItem(row, 2, QTableWidgetItem(runs))
            self.table.setItem(row, 3, QTableWidgetItem(self.state_words(d)))
            if keep == d.name:
                self.table.selectRow(row)
        self.table.resizeColumnsToContents()
        self.table.setColumnWidth(2, min(self.table.columnWidth(2), 260))  # the command: elided
        self.table.blockSignals(False)
        self._show_details()

    def offer_imports(self, found: list[tuple[str, str, int]]) -> None:
        """(app, its file, servers in it) found on this machine and not imported yet."""
        if not found:
            self.found.hide()
            return
        links = " · ".join(f'<a href="{html.escape(path)}">Import {n} from {html.escape(app)}</a>'
                           for app, path, n in found)
        self.found.setText(f"Other apps' MCP servers are on this computer: {links}")
        self.found.show()

    def state_words(self, d: ServerDef) -> str:
        if d.disabled:
            return "switched off in the file"
        st = self._states.get(d.name)
        if st is None or (st.phase == "off" and st.message != "stopped"):
            return "not started: it starts when you say yes to it"
        return st.words()

    def selected(self) -> str:
        rows = self.table.selectionModel().selectedRows() if self.table.selectionModel() else []
        if not rows:
            return ""
        item = self.table.item(rows[0].row(), 1)
        return item.text() if item is not None else ""

    def _on_item(self, item: QTableWidgetItem) -> None:
        if item.column() == 0:
            self.act("switch", str(item.data(Qt.ItemDataRole.UserRole)),
                     item.checkState() == Qt.CheckState.Checked)

    def _on_button(self, what: str) -> None:
        self.act(what, self.selected(), None)

    def _show_details(self) -> None:
        name = self.selected()
        st = self._states.get(name)
        d = next((x for x in self._defs if x.name == name), None)
        if d is None:
            self.details.setPlainText("")
            return
        lines = [f"{d.name}: {self.state_words(d)}", d.describe()]
        if st is not None and st.protocol:
            lines.append(f"MCP {st.protocol}")
        if st is not None and st.tools:
            lines.append("Tools: " + ", ".join(t.name for t in st.tools))
        if st is not None and st.skipped:
            lines += ["Left out (the model could not call them):", *st.skipped]
        if st is not None and st.stderr_tail and st.phase == "failed":
            lines += ["Its last lines on stderr:", st.stderr_tail]
        self.details.setPlainText("\n".join(lines))
