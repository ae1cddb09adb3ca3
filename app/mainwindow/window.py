"""The main window: conversations, the chat, images in, the vision switch, the memory panel.

GUI thread only. All engine work goes to the EngineWorker (its own QThread) through queued
signals. The streamed reply is taken from the worker in batches on a 30 Hz timer and appended
to the one transcript (app/widgets/transcript.py), never re-rendered from its start.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from PySide6.QtCore import QByteArray, QEventLoop, QMetaObject, Qt, QThread, QTimer, Signal, Slot
from PySide6.QtGui import (
    QAction,
    QCloseEvent,
    QDragEnterEvent,
    QDropEvent,
    QGuiApplication,
    QKeySequence,
)
from PySide6.QtWidgets import (
    QFrame,
    QScrollArea,
    QApplication,
    QDockWidget,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from app.core.chat_state import (
    MAX_BYTES_PER_TOKEN,
    ChatHistory,
    ChatState,
    Pending,
    chat_tag,
    oversized,
    users_names,
)
from app.widgets.composer import Composer
from app.dialogs.open_model import ModelPicker
from app.dialogs.settings import SettingsDialog
from app.widgets.notices import NoticeArea
from app.widgets.panel import ElidedLabel, MemoryPanel
from app.core.settings import (
    DEMO,
    Settings,
    chat_gen_params,
    chat_params,
    checked_settings,
    default_gen_params,
    load_settings,
    reload_changes,
    set_chat_params,
    readable_model_name,
    remember_model,
    session_config,
    states_dir,
)
from app.core.status import loaded_message, model_line, phases_line, restored_line
from app.core.store import Message, Store
from app.widgets.transcript import Transcript
from app.mainwindow.worker import EngineWorker
from engine import events
from engine.config import SessionConfig
from engine.errors import EbbError
from engine.llama.sampling import GenParams
from engine.telemetry import Telemetry
from engine.units import parse_size

REDRAW_MS = 33  # the streamed reply reaches the view about 30 times a second
CHAT_MIN_WIDTH = 380  # px: the chat column is never squeezed below this by the panel
FOLD_PANEL_BELOW = 1000  # px: a first start on a screen (or window) narrower folds the Memory panel
PANEL_FOLDED = ("The Memory panel is folded to give the chat room on this screen: View → Memory "
                "shows it.")
PANEL_MIN_WIDTH = 400  # px: narrower, the Memory panel scrolls instead of cutting its content off
RETRY_SAVE_MS = 3000  # how often a reply a full disk kept is offered to the store again
UNDO_S = 60  # an Undo notice stays this long (the trash keeps what went for days)
PERSIST_IDLE_MS = 20_000  # this long after a reply with nothing else: the chat's memory to disk


class MainWindow(QMainWindow):
    request_load = Signal(object, object)
    request_send = Signal(int, str, object, object)
    request_continue = Signal(int, object)
    request_history = Signal(object)
    request_persist = Signal()
    request_forget = Signal(str)
    request_state_budget = Signal(int)
    request_vision = Signal(bool)
    request_tune = Signal(object, object)

    def __init__(self, store: Store, load: SessionConfig | None, rpc: list[str] | None = None) -> None:
        super().__init__()
        self.setWindowTitle("Ebb")
        screen = QGuiApplication.primaryScreen()
        avail = screen.availableGeometry() if screen is not None else None
        self.resize(min(1400, avail.width() - 40) if avail else 1280,
                    min(880, avail.height() - 60) if avail else 820)
        self.setAcceptDrops(True)
        self.store = store
        self.chat = ChatState(store)  # the conversation and the request in flight, Qt-free
        self.chat.last_cfg = load
        self.telemetry = Telemetry()
        self.gen_params: GenParams = default_gen_params(self._settings())
        self._rpc = rpc or []  # servers from the command line: kept across reloads
        self._loaded: events.LoadDetails | None = None  # the last load's (About's diagnostics)
        self.last_error = ""
        self._copy_names: dict[str, str] = {}  # the store's copy → the user's file, per request
        self._has_accel: bool | None = None  # known once a model has loaded
        self._n_ctx = 0  # the loaded model's context (0: none loaded yet)
        self._load_reason = ""  # why the next load happens, for the status line
        self._said_start = False  # the start's time goes to the status line once
        self._looked: tuple[list[Path], int] | None = None  # the model folders and their models
        from app.mainwindow.tuning import TuneController

        self.tuning = TuneController(self)  # Model → Tune layers…: its dialog and runs
        self._build_ui()
        self._handlers: dict[type, Any] = {
            events.ModelLoading: self._on_model_loading, events.ModelLoaded: self._on_model_loaded,
            events.VisionChanged: self.vision.vision_changed, events.Residency: self.vision.residency,
            events.TurnFinished: self._on_turn_finished, events.ServerTurn: self._on_server_turn,
            events.EngineFailed: self._on_engine_failed}
        self._handlers.update(self.tuning.handlers())
        self._restore_layout()
        self._start_worker()
        # a reply a full disk kept from the store: tried again until it is written
        self._retry_saving = QTimer(self, interval=RETRY_SAVE_MS)
        self._retry_saving.timeout.connect(self._on_retry_saving)
        self._redraw = QTimer(self, interval=REDRAW_MS)
        self._redraw.timeout.connect(self._take_stream)
        self._persist_when_idle = QTimer(self, interval=PERSIST_IDLE_MS, singleShot=True)
        self._persist_when_idle.timeout.connect(self._on_idle)
        self.chat.observe(self._on_chat_changed)
        self.chat.open_first()
        self.chats.refresh()
        self.show_conversation()
        notes = [store.problem or ""]
        if store.recovered:
            notes.append(f"{store.recovered} repl{'y was' if store.recovered == 1 else 'ies were'} "
                         "being written when Ebb stopped: kept as far as they got, marked "
                         "interrupted (Regenerate or Continue).")
        if any(notes):
            self.show_notice(" ".join(n for n in notes if n))
        problems = checked_settings(store)[1]  # bad saved values: their defaults, said once
        if problems:
            self.show_notice("\n".join(problems))
        if load is not None:
            self.request_load.emit(load, self._rpc)

    # ------------------------------------------------------------ building

    def _build_ui(self) -> None:
        from app.widgets.conversation_list import ConversationList

        self.chats = ConversationList(self.store, self.chat, self.show_error,
                                      self.statusBar().showMessage)
        self.chats.opened.connect(self._on_chat_opened)
        self.chats.deleted.connect(self._on_chat_deleted)
        self._build_menu()

        from app.widgets.vision_bar import VisionBar

        self.vision = VisionBar()  # the Vision switch and where the projector is
        self.vision.requested.connect(self._on_vision_toggled)
        self.notice = NoticeArea()  # errors and what happened: each until its ✕ (app/widgets/notices.py)
        self.welcome = QLabel("", wordWrap=True, openExternalLinks=False)
        self.welcome.setTextFormat(Qt.TextFormat.RichText)
        self.welcome.setStyleSheet("background: #eef5fc; color: #1d2b36; padding: 10px; "
                                   "border: 1px solid #c5dcf0;")
        self.welcome.linkActivated.connect(self._on_welcome_link)
        self.welcome.hide()
        self.transcript = Transcript()
        self.transcript.setPlaceholderText("Loading the model…")
        self.transcript.action.connect(self._on_message_action)
        self.transcript.copied.connect(
            lambda code: self.statusBar().showMessage(f"Copied {len(code.splitlines())} lines of code", 4000))
        self.regen_button = QPushButton("Regenerate", clicked=self._on_regenerate, enabled=False)
        self.continue_button = QPushButton("Continue", clicked=self._on_continue, visible=False,
                                           toolTip="Go on with this reply where it stopped")
        self.copy_button = QPushButton("Copy reply", clicked=self._on_copy, enabled=False)
        acts = QHBoxLayout()
        acts.addStretch(1)
        acts.addWidget(self.continue_button)
        acts.addWidget(self.regen_button)
        acts.addWidget(self.copy_button)
        self.composer = Composer()
        self.transcript.problem.connect(self.composer.show_error)  # e.g. a clip that cannot play
        self.transcript.view_picture.connect(self._on_view_picture)
        self.composer.send_requested.connect(self.send_message)
        attach = QPushButton("Attach…", clicked=self._on_attach)
        self.send_button = QPushButton("Send", clicked=self.send_message, enabled=False)
        self.stop_button = QPushButton("Stop", clicked=self._on_stop, enabled=False)
        self.record_button = QPushButton("Record", clicked=self.composer.start_recording,
                                         visible=False,
                                         toolTip="Record a clip from the microphone")
        buttons = QVBoxLayout()
        for b in (self.send_button, self.stop_button, attach, self.record_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        row = QHBoxLayout()
        row.addWidget(self.composer, 1)
        row.addLayout(buttons)
        chat = QWidget()
        cl = QVBoxLayout(chat)
        self._chat_layout = cl
        cl.addWidget(self.vision)
        cl.addWidget(self.notice)
        cl.addWidget(self.welcome)
        cl.addWidget(self.transcript, 1)
        cl.addLayout(acts)
        cl.addLayout(row)
        # the chat keeps a readable width; on a narrow window the memory panel gives way
        chat.setMinimumWidth(CHAT_MIN_WIDTH)
        split = QSplitter()
        self.split = split
        split.addWidget(self.chats)
        split.addWidget(chat)
        split.setSizes([200, 700])
        split.setStretchFactor(1, 1)
        self.setCentralWidget(split)

        self.panel = MemoryPanel(self.telemetry)
        self.panel_dock = QDockWidget("Memory", self)
        self.panel_dock.setObjectName("memory-panel")
        # narrower than its content, the panel scrolls rather than cutting cells, legends and
        # titles off on the right (800 px wide); on a first start that narrow it starts folded
        self.panel.setMinimumWidth(PANEL_MIN_WIDTH)
        panel_scroll = QScrollArea(widgetResizable=True, frameShape=QFrame.Shape.NoFrame)
        panel_scroll.setWidget(self.panel)
        self.panel_dock.setWidget(panel_scroll)
        self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, self.panel_dock)
        self.resizeDocks([self.panel_dock], [int(self.width() * 0.42)], Qt.Orientation.Horizontal)
        self.view_menu.addAction(self.panel_dock.toggleViewAction())
        self._build_help_menu()

        self.progress = QProgressBar(maximumWidth=160, textVisible=False)
        self.progress.setRange(0, 0)
        self.progress.hide()
        self.model_label = ElidedLabel("no model")  # cut with "…" to its room, whole in its tooltip
        self.server_status = QLabel("")  # the local server's address, while it serves
        self.server_status.hide()
        # a long line (a stand-in's name, several devices) is cut rather than widening the
        # window past the screen (it squeezed the memory panel off it), and leaves the status
        # line's left part to its transient messages (it used to fill the bar and hide them all)
        self.model_label.setMinimumWidth(200)
        self.statusBar().addPermanentWidget(self.server_status)
        self.statusBar().addPermanentWidget(self.model_label, 0)
        self.statusBar().messageChanged.connect(lambda _m: self._fit_model_label())
        self.statusBar().addPermanentWidget(self.progress)

    def _fit_model_label(self) -> None:
        """The model's line at its own width, at most half the status line (the rest is for
        messages); cut with "…" beyond, whole in its tooltip."""
        label = self.model_label
        label.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Preferred)
        label.setMinimumWidth(min(200, self.width() // 3))
        label.setMaximumWidth(max(200, self.width() // 2))
        label.updateGeometry()

    def set_model_line(self, text: str, why: str = "") -> None:
        self.model_label.set_full_text(text)
        if why:
            self.model_label.setToolTip(f"{text}\n\n{why}")
        self._fit_model_label()

    def resizeEvent(self, e: Any) -> None:
        super().resizeEvent(e)
        self._fit_model_label()

    def _build_help_menu(self) -> None:
        help_menu = self.menuBar().addMenu("&Help")
        self.about_action = QAction("About Ebb", self, triggered=self._on_about)
        help_menu.addAction(self.about_action)

    @Slot()
    def _on_about(self) -> None:
        from app.dialogs.about import AboutDialog, about_facts, diagnostics_text

        from app.core.store import DB_NAME

        where = str(self.store.folder / DB_NAME)
        facts = about_facts(where + (" (not writable: kept in memory)" if self.store.in_memory
                                     else ""))
        if self.standin.standin is not None:
            facts.append(("Stand-in accelerator", self.standin.label))
        text = diagnostics_text(facts, self._loaded.devices if self._loaded else (), self._loaded,
                                self.last_error)
        self.about_dialog = AboutDialog(facts, text, self)
        self.about_dialog.show()

    def _build_menu(self) -> None:
        file = self.menuBar().addMenu("&File")
        for text, key, slot in (("New chat", "Ctrl+N", self.chats.new_chat),
                                ("Open model…", "Ctrl+O", self._on_open_model),
                                ("Export chat…", "Ctrl+E", lambda: self.chats.export_chat(self.conv_id)),
                                ("Settings…", "Ctrl+,", self._on_settings),
                                ("Quit", "Ctrl+Q", self.close)):
            act = QAction(text, self, shortcut=QKeySequence(key))
            act.triggered.connect(slot)
            file.addAction(act)
        model = self.menuBar().addMenu("&Model")
        self.get_models_action = QAction("Get models…", self, triggered=self._on_get_models)
        self.get_models_action.setStatusTip("Find GGUF models on the Hugging Face Hub, see how each "
                                            "would run here, download one with its projector")
        model.addAction(self.get_models_action)
        chat_settings = QAction("Chat settings…", self, shortcut=QKeySequence("Ctrl+Shift+,"))
        chat_settings.setStatusTip("This chat's system prompt, temperature, top-p, top-k, "
                                   "min-p, repeat penalty and seed")
        chat_settings.triggered.connect(self._on_chat_settings)
        model.addAction(chat_settings)
        self.tune_action = QAction("Tune layers…", self, triggered=self.tuning.start)
        self.tune_action.setStatusTip("Measure tokens/s against accelerator layers and pick the best")
        model.addAction(self.tune_action)
        from app.mainwindow.standin_control import StandInControl

        self.standin = StandInControl(self, None if self.store.in_memory else self.store.folder,
                                      self.statusBar().showMessage, self.show_error,
                                      self._on_standin_ready)
        model.addAction(self.standin.action)
        self.whatif_action = QAction("What if…", self, triggered=self._on_what_if)
        self.whatif_action.setStatusTip("Predict a model on an accelerator you may not own")
        model.addAction(self.whatif_action)
        self.view_menu = self.menuBar().addMenu("&View")
        stop = QAction("Stop", self, shortcut=QKeySequence("Esc"))
        stop.triggered.connect(self._on_stop)
        self.addAction(stop)

    def _start_worker(self) -> None:
        self._thread = QThread(self)
        self._thread.setObjectName("EngineWorker")
        self.worker = EngineWorker()
        self.worker.moveToThread(self._thread)
        self.worker.engine_event.connect(self._on_event)
        self.request_load.connect(self.worker.load)
        self.request_send.connect(self.worker.send)
        self.request_continue.connect(self.worker.continue_reply)
        self.request_history.connect(self.worker.set_history)
        self.request_persist.connect(self.worker.persist)
        self.request_forget.connect(self.worker.forget)
        self.request_state_budget.connect(self.worker.set_state_budget)
        self.request_vision.connect(self.worker.set_vision)
        self.request_tune.connect(self.worker.tune)
        self._thread.finished.connect(self.worker.deleteLater)
        self._thread.start()
        from app.mainwindow.serving import LocalServer

        self.local_server = LocalServer(self.worker, self.server_status, self.show_notice)
        self.local_server.apply(self._settings())

    def add_banner(self, banner: QWidget) -> None:
        """A message with buttons above the chat (app/safe_mode.py), under the notice."""
        self._chat_layout.insertWidget(self._chat_layout.indexOf(self.notice) + 1, banner)

    def show_notice(self, text: str, kind: str = "warning") -> None:
        """A message above the chat until its ✕ is pressed (what went wrong with the data
        folder, what happened before a restart, a device that came up short)."""
        self.notice.add(text, kind)

    def show_error(self, text: str) -> None:
        """An error, where the user looks (above the chat) and until read; stderr too."""
        self.last_error = text
        print(f"ebb: error: {text}", file=sys.stderr, flush=True)
        self.notice.add(text, "error")

    # ------------------------------------------------------------ conversations

    @property
    def conv_id(self) -> int:
        return self.chat.conv_id

    def _on_chat_opened(self) -> None:
        """Another conversation is open (the list, New chat, a delete): to the engine, and drawn
        (a search's result at the message found, its words marked)."""
        if self.composer.editing is not None:  # a message of the chat left behind
            self.composer.cancel_edit()
        self._send_history()
        found = self.chats.take_found()
        self.show_conversation(*(found or ()))

    def _on_idle(self) -> None:
        if not self.chat.busy:
            self.request_persist.emit()

    def _on_chat_deleted(self, cid: int) -> None:
        self.request_forget.emit(chat_tag(cid))  # the model's memory of it goes at once
        title = self.store.title(cid)
        self.notice.add(f"Deleted “{title}”.", "info", ("Undo", lambda: self.chats.undo_delete(cid)),
                        timeout_s=UNDO_S)

    def _send_history(self, before: int | None = None) -> None:
        """The open branch and the chat's system prompt, to the engine (with `before`, only
        the messages ahead of that one)."""
        system = chat_params(self.store, self.conv_id)["system_prompt"] or None
        self.request_history.emit(ChatHistory(self.chat.history(before), system,
                                              chat_tag(self.conv_id)))

    # ------------------------------------------------------------ versions and branches

    @Slot(str, int)
    def _on_message_action(self, kind: str, message_id: int) -> None:
        """A message's link: Edit, Regenerate, Delete, or its previous or next version; the
        system prompt's "change" (kind "system")."""
        if kind == "system":
            self._on_chat_settings()
            return
        if self.chat.busy:
            self.statusBar().showMessage("A reply is being written: wait for it, or Stop it", 8000)
            return
        m = self.store.message(message_id)
        if m is None:
            return
        try:
            if kind in ("prev", "next"):
                i = m.siblings.index(m.id) + (1 if kind == "next" else -1) if m.id in m.siblings else -1
                if self.chat.switch_version(m.id, 1 if kind == "next" else -1):
                    self._send_history()
                    self.show_conversation(m.siblings[i])
            elif kind == "edit":
                self.composer.start_edit(m)
            elif kind == "regen":
                self._regenerate(m.id)
            elif kind == "delete":
                self._delete_branch(m)
        except EbbError as exc:  # a full disk
            self.show_error(str(exc))

    def _regenerate(self, reply_id: int = 0) -> None:
        """Another version of a reply (the old one stays, ‹ › between them)."""
        pending = self.chat.regenerate(reply_id)
        if pending is None:
            return
        self.show_conversation()
        self._dispatch(pending, pending.images, history_before=pending.message_id)

    def _delete_branch(self, m: Message) -> None:
        ids = self.chat.delete_branch(m.id)
        if not ids:
            return
        self._send_history()
        self.show_conversation()
        n = len(ids)
        self.notice.add(f"Deleted {n} message{'' if n == 1 else 's'} from this chat.", "info",
                        ("Undo", lambda: self._undo_delete_branch(ids)), timeout_s=UNDO_S)

    def _undo_delete_branch(self, ids: list[int]) -> None:
        try:
            if not self.chat.undo_delete_branch(ids):
                self.statusBar().showMessage("Open that chat, with no reply being written, to "
                                             "bring its messages back", 8000)
                return
        except EbbError as exc:
            self.show_error(str(exc))
            return
        self._send_history()
        self.show_conversation(ids[0])

    def _send_edit(self, target: Message, text: str, images: list[Path]) -> None:
        """Send while editing: a new version of the message (answered, for the user's own)."""
        if target.role == "assistant":
            if not text:
                return
            self.chat.edit_reply(target.id, text)
            self.composer.clear()
            self._send_history()
            self.show_conversation()
            return
        pending = self.chat.edit(target.id, text, images)
        if pending is None:
            return
        self.composer.clear()
        self.show_conversation()
        self._dispatch(replace(pending, text=text, images=images), pending.images,
                       history_before=pending.message_id)

    def chat_gen_params(self) -> GenParams:
        return chat_gen_params(self.store, self.conv_id, self.gen_params)

    def _on_view_picture(self, path: str) -> None:
        from app.widgets.picture_viewer import PictureViewer

        self.picture_viewer = PictureViewer(Path(path), self)
        self.picture_viewer.show()

    def _on_chat_settings(self) -> None:
        from app.dialogs.chat_settings import ChatSettingsDialog

        def save_presets(presets: dict[str, dict[str, Any]]) -> None:
            try:
                self.store.set_setting("chat_presets", presets)
            except EbbError as exc:  # a full disk: said, the dialog goes on
                self.show_error(str(exc))

        dlg = ChatSettingsDialog(self.store.title(self.conv_id), chat_params(self.store, self.conv_id), self,
                                 presets=self._settings().chat_presets,
                                 save_presets=save_presets)
        if not dlg.exec():
            return
        try:
            set_chat_params(self.store, self.conv_id, dlg.values())
            if dlg.as_default.isChecked():
                for k, v in dlg.values().items():
                    self.store.set_setting(k, v)
                self.gen_params = replace(default_gen_params(self._settings()),
                                          max_tokens=self.gen_params.max_tokens)
        except EbbError as exc:
            self.show_error(str(exc))
            return
        self._send_history()
        if not self.chat.busy:  # the system prompt's line above the chat
            self.show_conversation()
        self.statusBar().showMessage("This chat's settings apply from the next reply", 8000)

    # ------------------------------------------------------------ rendering

    @property
    def rpc_servers(self) -> list[str]:
        """The RPC servers this window connects (the command line's, a stand-in's)."""
        return list(self._rpc)

    def show_conversation(self, focus: int = 0, words: list[str] | None = None) -> None:
        """The open conversation, drawn afresh (opened, switched to, or a request failed);
        `focus`: a message to scroll to, with `words` marked in it."""
        msgs = self.chat.messages()
        self.transcript.system_prompt = str(chat_params(self.store, self.conv_id)["system_prompt"] or "")
        self.transcript.show_messages(msgs, self.chat.memory_from(msgs), focus, words or ())
        self._update_welcome()
        self._update_actions()

    def _update_welcome(self) -> None:
        """The first start's welcome: while no conversation has a message."""
        from engine.models.local import find_models, model_folders
        from app.core.welcome import welcome_html

        if self.chat.busy or self.store.has_messages():
            self.welcome.hide()
            return
        if self._looked is None:  # once: a walk of the model folders
            folders = model_folders(self._settings().model_folders)
            self._looked = (folders, len(find_models(folders, limit=50)))
        folders, n = self._looked
        self.welcome.setText(welcome_html(folders, n, self._has_accel,
                                          self.standin.label))
        self.welcome.show()

    @Slot(str)
    def _on_welcome_link(self, link: str) -> None:
        from app.core.welcome import OPEN_LINK, STANDIN_LINK

        if link == STANDIN_LINK:
            self.standin.start()
        elif link == OPEN_LINK:
            self._on_open_model()

    # ------------------------------------------------------------ the stand-in accelerator

    def _on_standin_ready(self, endpoint: str) -> None:
        """The stand-in serves: load the model again with it first (and the demo projector if
        none was chosen)."""
        self._rpc = [endpoint] + [r for r in self._rpc if r != endpoint]
        cfg = self.chat.last_cfg
        model = str(cfg.model_path) if cfg is not None else "default"
        mmproj = str(cfg.mmproj_path) if cfg is not None and cfg.mmproj_path else DEMO
        self.load_model(model, mmproj)
        self._update_welcome()

    def _update_actions(self) -> None:
        last = self.chat.last_message()
        has_reply = last is not None and last.role == "assistant"
        self.regen_button.setEnabled(has_reply and self.chat.can_send())
        self.copy_button.setEnabled(has_reply and not self.chat.busy)
        self.continue_button.setVisible(self.chat.can_continue())

    def _take_stream(self) -> None:
        """Timer: what the engine streamed since the last tick, into the transcript at once."""
        new = [text for rid, text in self.worker.stream.take() if rid == self.chat.request_id]
        if new:
            for t in new:
                self.chat.add_text(self.chat.request_id, t)
            self.transcript.stream("".join(new))
            n, rate = self.chat.live_rate()
            if rate:
                self.statusBar().showMessage(f"Writing: {n} tokens · {rate:.1f} tok/s", 2000)

    # ------------------------------------------------------------ user actions

    def dragEnterEvent(self, e: QDragEnterEvent) -> None:
        if e.mimeData().hasUrls() or e.mimeData().hasImage():
            e.acceptProposedAction()

    def dropEvent(self, e: QDropEvent) -> None:
        self.composer.edit.insertFromMimeData(e.mimeData())
        e.acceptProposedAction()

    @Slot()
    def _on_attach(self) -> None:
        from PySide6.QtCore import QStandardPaths

        start = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.PicturesLocation)
        pictures = "*.png *.jpg *.jpeg *.webp *.gif *.bmp"
        sound = "*.wav *.mp3 *.flac"
        paths, _ = QFileDialog.getOpenFileNames(
            self, "Attach pictures or sound clips", start or str(Path.home()),
            f"Pictures and sound ({pictures} {sound});;Pictures ({pictures});;Sound clips ({sound})")
        self.composer.attach_all([Path(p) for p in paths])

    @Slot()
    def send_message(self) -> None:
        """Send what the composer holds (Enter, the Send button)."""
        text, images = self.composer.text(), list(self.composer.attachments)
        if (not text and not images) or not self.chat.can_send():
            return
        gone = [p for p in images if not Path(p).is_file()]
        if gone:  # deleted or moved since attached: taken off, the rest kept, said by name
            for p in gone:
                self.composer.detach(p)
            self.composer.show_error(
                f"{', '.join(Path(p).name for p in gone)} "
                f"{'is' if len(gone) == 1 else 'are'} gone (deleted or moved since attached) and "
                "taken off; your text and the other attachments are kept. Send again to send "
                "without it, or attach it again.")
            return
        if images and not self.vision.on:
            self.composer.show_error(f"Turn {self.vision.switch.text().lower()} on to send pictures "
                                     "or clips (no reload needed).")
            return
        too_big = oversized(text, self._n_ctx)
        if too_big:  # refused from its size at once: not stored, not titled, not tokenized
            self.composer.show_error(too_big)
            return
        if self.composer.editing is not None:
            try:
                self._send_edit(self.composer.editing, text, images)
            except EbbError as exc:  # not saved (a full disk): the composer keeps it all
                self.composer.show_error(str(exc))
            return
        try:
            pending = self.chat.add_user_message(text, images)
        except EbbError as exc:  # not saved (a full disk): the composer keeps it all
            self.composer.show_error(str(exc))
            return
        self.composer.clear()
        saved = self.store.message(pending.message_id)
        if saved is not None:
            self.transcript.append_message(saved, scroll=True)
        titled = self.store.n_messages(self.conv_id) == 1  # the chat is named by this message
        # the composer gets back what the user gave, the engine the stored copies
        self._dispatch(Pending(text, images, pending.message_id), pending.images)
        if titled:  # the list shows the new title
            self.chats.refresh()

    def _dispatch(self, pending: Pending, images: list[Path], history_before: int = 0) -> None:
        """Ask the engine for the reply. `history_before`: a new version of that message (an
        edit, a regeneration): the engine's history is first set to the messages ahead of it
        (its KV cache is kept up to where they differ)."""
        # the engine reads the store's copies; an error about one names the user's file
        self._copy_names = {Path(c).name: Path(u).name for c, u in zip(images, pending.images)}
        if history_before:
            self._send_history(before=history_before)
        request_id = self.chat.begin(pending)
        self.panel.set_live(True)  # the plots follow the reply to now
        self.welcome.hide()
        self.worker.stream.take()  # nothing left over from an earlier request
        self.transcript.begin_reply(pending.continues, scroll=True)
        if pending.continues is not None:
            self.request_continue.emit(request_id, self.chat_gen_params())
        else:
            self.request_send.emit(request_id, pending.text, [str(p) for p in images],
                                   self.chat_gen_params())
        self._update_actions()

    @Slot()
    def _on_stop(self) -> None:
        if not self.chat.busy and self.composer.editing is not None:  # Esc leaves an edit
            self.composer.cancel_edit()
            return
        self.worker.cancel()

    @Slot()
    def _on_regenerate(self) -> None:
        self._regenerate()

    @Slot()
    def _on_continue(self) -> None:
        """Go on with the last reply where it stopped (its cap, or Stop)."""
        pending = self.chat.continue_last()
        if pending is not None:
            self._dispatch(pending, [])

    @Slot()
    def _on_copy(self) -> None:
        last = self.chat.last_message()
        if last is not None and last.role == "assistant":
            QGuiApplication.clipboard().setText(last.text)

    def _on_vision_toggled(self, on: bool) -> None:
        if on and "Turn vision on" in self.composer.error.text():  # no longer true
            self.composer.error.hide()
        self.request_vision.emit(on)

    def _on_chat_changed(self) -> None:
        """ChatState changed (loaded, busy, idle): the controls follow it."""
        busy = self.chat.busy
        self.send_button.setEnabled(not busy and self.chat.loaded)
        self.stop_button.setEnabled(busy)
        (self._redraw.start if busy else self._redraw.stop)()
        self._update_actions()

    def _settings(self) -> Settings:
        return load_settings(self.store)

    @Slot()
    def _on_settings(self) -> None:
        from engine.llama.state_files import folder_usage

        before = self._settings()
        dlg = SettingsDialog(before, self, folder_usage(states_dir(self.store)))
        if dlg.exec():
            try:
                for k, v in dlg.values().items():
                    self.store.set_setting(k, v)
            except EbbError as exc:
                self.show_error(str(exc))
                return
            after = self._settings()
            self.gen_params = replace(self.gen_params, max_tokens=after.max_tokens)
            if after.memory_disk != before.memory_disk:
                self.request_state_budget.emit(parse_size(after.memory_disk))
            self.local_server.apply(self._settings())
            changed = reload_changes(before, after)
            cfg = self.chat.last_cfg
            if not changed:  # the reply cap, the local server: nothing to load again
                self.statusBar().showMessage("Settings saved: no reload needed", 8000)
            elif cfg is not None and not self.chat.busy:
                self._load_reason = f"settings changed: {changed}"
                self.load_model(str(cfg.model_path), str(cfg.mmproj_path or ""))
            elif cfg is not None:
                self.statusBar().showMessage(f"Saved; the model reloads with the next model you "
                                             f"open ({changed})", 15000)

    @Slot()
    def _on_open_model(self) -> None:
        dlg = ModelPicker(self._settings(), self)
        if dlg.exec() and not self.chat.busy:
            self.store.set_setting("model_folders", dlg.folders)
            model, mmproj = dlg.choice()
            if model:
                self.load_model(model, mmproj)

    @Slot()
    def _on_get_models(self) -> None:
        from app.dialogs.hub import HubDialog
        from engine.hub.verdict import machine_from_devices

        settings = self._settings()
        from engine.hw import physical_cores

        threads = settings.threads or physical_cores()
        devices = list(self._loaded.devices) if self._loaded else []
        self.hub_dialog = HubDialog(settings, machine_from_devices(devices, threads),
                                    self.store.set_setting, self)
        self.hub_dialog.open_pair.connect(self._on_open_pair)
        self.hub_dialog.show()

    @Slot(str, str)
    def _on_open_pair(self, model: str, mmproj: str) -> None:
        if self.chat.busy:
            self.show_error("A reply is under way: open the downloaded model from File → Open "
                            "model once it has finished")
            return
        self.load_model(model, mmproj)

    @Slot()
    def _on_what_if(self) -> None:
        from app.dialogs.whatif import WhatIfDialog

        cfg = self.chat.last_cfg
        self.whatif_dialog = WhatIfDialog(str(cfg.model_path) if cfg else "default",
                                          str(cfg.mmproj_path or "") if cfg else "",
                                          self._settings().ctx, self)
        self.whatif_dialog.show()

    @property
    def tune_dialog(self) -> Any:
        return self.tuning.dialog

    def load_model(self, model: str, mmproj: str) -> None:
        try:
            # servers given on the command line stay (Settings' list is added to them)
            cfg, rpc = session_config(self.store, model, mmproj, rpc=self._rpc)
        except EbbError as exc:  # a bad setting (a budget that is not a size): keep what is loaded
            self.show_error(str(exc))
            return
        self.start_load(cfg, rpc)

    def start_load(self, cfg: SessionConfig, rpc: list[str]) -> None:
        """Ask the engine to load `cfg` (File → Open model, a restart, safe mode's banner)."""
        cfg = self.standin.adjust(cfg)
        self.chat.set_loading(cfg)
        self.request_load.emit(cfg, rpc)
        self._send_history()

    # ------------------------------------------------------------ engine events

    @Slot(object)
    def _on_event(self, ev: events.Event) -> None:
        self.telemetry.on_event(ev)
        handler = self._handlers.get(type(ev))
        if handler is not None:
            handler(ev)

    def _on_model_loading(self, ev: events.ModelLoading) -> None:
        self.progress.show()
        self.chat.set_loading()
        reason, self._load_reason = self._load_reason, ""
        self.statusBar().showMessage(f"Loading {Path(ev.model_path).name}…"
                                     + (f" ({reason})" if reason else ""))

    def _on_server_turn(self, ev: events.ServerTurn) -> None:
        self.local_server.update_status()
        images = f", {ev.n_images} image{'s' if ev.n_images != 1 else ''} ({ev.strategy})" if ev.n_images else ""
        gone = " — the client left" if ev.client_gone else ""
        self.statusBar().showMessage(f"Local server answered {ev.client}: {ev.n_gen_tokens} tokens"
                                     f"{images}{gone}", 8000)

    def _on_model_loaded(self, ev: events.ModelLoaded) -> None:
        d0 = ev.details
        self.local_server.backend.set_model(ev.model_path, vision=bool(d0.projector) and d0.projector_sees,
                                            hearing=bool(d0.projector) and d0.projector_hears)
        d = ev.details
        self._loaded = d
        self.progress.hide()
        self.chat.set_loaded()
        name = readable_model_name(ev.model_path, ev.model_name)
        self.setWindowTitle(f"Ebb — {name}")
        self._n_ctx = ev.n_ctx
        self.composer.edit.max_paste_bytes = ev.n_ctx * MAX_BYTES_PER_TOKEN
        self.set_model_line(model_line(name, ev.n_layers, ev.n_ctx, d, self.standin.accel_name(d)),
                            d.placement_reason)
        if d.requested:
            remember_model(self.store, *d.requested)
        self._has_accel = bool(d.accelerator)
        self.record_button.setVisible(bool(d.projector) and d.projector_hears)
        self._set_record_limit(0)
        self.panel.set_device_names({str(d.accelerator): f"stand-in {d.accelerator}"}
                                    if self.standin.is_standin(d) else {})
        self._update_welcome()
        if d.memory_note:
            self.show_notice(d.memory_note + ".")
        for note in d.backend_notes:
            if not d.safe_mode and note not in self.notice.text():  # safe mode: its banner
                self.show_notice(note[0].upper() + note[1:] + ".")
        if not self.chat.busy:
            started = None
            if not self._said_start:  # the first load: the whole start, once
                from engine.hw import process_age_s

                self._said_start = True
                started = process_age_s()
            self.statusBar().showMessage(
                loaded_message(ev.load_s, d.mover_note, started), 15000)
        self.transcript.setPlaceholderText("Say something. Drop or paste images to ask about them.")
        self.vision.model_loaded(d)
        self._send_history()
        self._update_actions()

    def _set_record_limit(self, used: int) -> None:
        """How long a recording may run: the 30-second chunks the context has room for after
        `used` cells and the reply's room (at least one chunk when one fits the context), less
        a second (a clip of exactly k x 30 s takes k + 1 chunks)."""
        from engine.conversation import reply_room
        from engine.media.audio import MAX_CLIP_SECONDS

        per = self._loaded.clip_chunk_tokens if self._loaded is not None else 0
        if per <= 0:
            self.composer.record_limit_s = 0
            return
        room = self._n_ctx - reply_room(self._n_ctx)
        chunks = max((room - used) // per, 1 if room >= per else 0)  # older turns make room
        self.composer.record_limit_s = float(min(MAX_CLIP_SECONDS, 30 * chunks - 1) if chunks else 0)

    def _on_turn_finished(self, ev: events.TurnFinished) -> None:
        res = ev.result
        self.panel.set_live(False)
        self._set_record_limit(res.gen.n_prompt_tokens + res.gen.n_gen_tokens)
        if res.device_lost:
            self.show_notice(f"{res.device_lost}: the conversation goes on with the devices "
                             "that are left.")
        self._take_stream()  # the last pieces, before the reply is shown as saved
        if res.phases is not None and res.error is None:
            self.statusBar().showMessage(phases_line(res.phases), 60000)
        if res.error is None and (said := restored_line(res.gen)):
            self.statusBar().showMessage(said, 60000)
        self._persist_when_idle.start()  # the chat's memory to disk, once nothing happens
        turn = res.to_dict()  # the store's edge: the turn's JSON
        if self.chat.last_cfg is not None:  # which model wrote it (an export says)
            turn["model"] = Path(str(self.chat.last_cfg.model_path)).name
        failed = self.chat.finish(turn)
        if self.chat.save_error:
            self.show_error(f"Could not save the reply: {self.chat.save_error}. It is kept "
                            "here and written as soon as a write succeeds.")
            self._retry_saving.start()
        if failed is not None:
            self._give_back(failed, res.error or "")
        else:
            self.transcript.end_reply(self.chat.saved)
            saved = self.chat.saved
            if saved is not None and saved.stats.get("memory_from") not in (None, self.transcript.memory_from):
                self.show_conversation()  # the line "outside the model's memory" moves
        self._update_actions()

    def _on_retry_saving(self) -> None:
        if not self.chat.unsaved:
            self._retry_saving.stop()
            return
        if self.chat.busy or not self.chat.retry_unsaved():
            return
        if not self.chat.unsaved:
            self._retry_saving.stop()
            self.notice.remove_matching("Could not save the reply")
            self.statusBar().showMessage("The reply that could not be saved is saved now", 10000)
        self.show_conversation()

    def _give_back(self, pending: Pending, error: str) -> None:
        """A message the engine could not answer: out of the engine's history, back in the
        composer (nothing the user wrote is lost), with the reason. A Continue that failed
        leaves the reply as it was."""
        error = users_names(error, self._copy_names)
        self.last_error = error
        if pending.continues is not None:
            self.transcript.end_reply(pending.continues)
            self.show_error(f"Could not continue: {error}")
            return
        self._send_history()  # the branch as it stands now (the message taken back)
        if pending.regenerates:  # the earlier versions of the reply stay
            self.show_conversation()
            self.show_error(f"Could not regenerate the reply: {error}")
            return
        edited = self.store.message(pending.edits) if pending.edits else None
        if edited is not None:  # still an edit of that message
            self.composer.start_edit(edited, pending.text, pending.images)
        else:
            self.composer.restore(pending.text, pending.images)
        self.composer.show_error(error)
        self.show_conversation()
        self.chats.refresh()  # a chat this message had named is "New chat" again

    def _on_engine_failed(self, ev: events.EngineFailed) -> None:
        self.last_error = ev.message
        self.panel.set_live(False)
        self.progress.hide()
        failed = self.chat.fail()
        if failed is not None:
            self._give_back(failed, ev.message)
        self.show_error(ev.message)
        if not self.chat.loaded:  # a load that failed: no "Loading…" left standing
            self.statusBar().clearMessage()
            self.transcript.setPlaceholderText("No model is loaded: File → Open model… (what went "
                                               "wrong is said above)")
        self.tuning.failed(ev.message)
        self._update_actions()

    # ------------------------------------------------------------ shutdown

    def _restore_layout(self) -> None:
        """The window's size, the splitter and the docks as they were left (saved on close).
        With nothing saved and a window too narrow for the chat and the panel side by side,
        the panel starts folded (View → Memory), as peers fold their side panels."""
        import base64

        if not isinstance(self.store.setting("window_state"), str):
            screen = QApplication.primaryScreen()
            width = screen.availableGeometry().width() if screen is not None else self.width()
            if min(width, self.width()) < FOLD_PANEL_BELOW:
                self.panel_dock.hide()
                self.show_notice(PANEL_FOLDED, "info")
                self.panel_dock.visibilityChanged.connect(self._on_panel_shown)

        for key, restore in (("window_geometry", self.restoreGeometry),
                             ("window_state", self.restoreState),
                             ("window_split", self.split.restoreState)):
            saved = self.store.setting(key)
            if isinstance(saved, str):
                try:
                    restore(QByteArray(base64.b64decode(saved)))
                except (ValueError, TypeError):
                    continue

    def _on_panel_shown(self, shown: bool) -> None:
        if shown:  # the folded panel's notice has said its part
            self.notice.remove_matching(PANEL_FOLDED)

    def _save_layout(self) -> None:
        import base64

        from app.core.store import StoreError

        for key, state in (("window_geometry", self.saveGeometry()),
                           ("window_state", self.saveState()), ("window_split", self.split.saveState())):
            try:
                self.store.set_setting(key, base64.b64encode(bytes(state.data())).decode())
            except StoreError:  # a full disk: the layout is not worth an error
                return

    def closeEvent(self, event: QCloseEvent) -> None:
        self._save_layout()
        self.local_server.close()
        self.worker.closing()
        # A load in progress is not cut short (llama.cpp finishes it first): the window goes
        # at once rather than standing frozen until then; the process ends after it.
        self.hide()
        QApplication.processEvents(QEventLoop.ProcessEventsFlag.ExcludeUserInputEvents)
        # Runs on the worker thread after the (now cancelled) current job: it frees llama.cpp.
        QMetaObject.invokeMethod(self.worker, "shutdown", Qt.ConnectionType.BlockingQueuedConnection)
        self._thread.quit()
        self._thread.wait(10_000)
        if self.chat.busy:  # closed during a reply: it is kept as far as it got, as stopped
            self._take_stream()
            self.chat.finish(self.chat.stopped_result())
        self.standin.stop()  # after the session let go of its memory (shutdown above)
        super().closeEvent(event)
