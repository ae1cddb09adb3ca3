"""The main window: conversations, the chat, images in, the vision switch, the memory panel.

GUI thread only. All engine work goes to the EngineWorker (its own QThread) through queued
signals. The streamed reply is taken from the worker in batches on a 30 Hz timer and appended
to the one transcript (app/widgets/transcript.py), never re-rendered from its start.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, TypeVar

from PySide6.QtCore import QEventLoop, QMetaObject, Qt, QThread, Signal, Slot
from PySide6.QtGui import (
    QAction,
    QCloseEvent,
    QDragEnterEvent,
    QDropEvent,
    QGuiApplication,
    QKeySequence,
    QResizeEvent,
)
from PySide6.QtWidgets import (
    QFrame,
    QScrollArea,
    QApplication,
    QDockWidget,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMenu,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from app.core.chat_state import (
    ChatState,
    chat_tag,
)
from app.widgets.composer import Composer
from app.sound.recorder import clear_recordings
from app.widgets.panel import ElidedLabel, MemoryPanel
from app.core.settings import (
    DEMO,
    DEMO_GREEDY_NOTE,
    Settings,
    chat_params,
    checked_settings,
    default_gen_params,
    load_settings,
    set_chat_params,
)
from app.core.store import Store
from app.widgets.transcript import Transcript
from app.mainwindow.models import Models
from app.widgets.downloads import Downloads
from app.mainwindow.sending import UNDO_S, Sending
from app.mainwindow.tooling import Tools
from app.mainwindow.tuning import TuneController
from app.mainwindow.worker import EngineWorker
from engine import events
from engine.config import SessionConfig
from engine.errors import EbbError
from engine.llama.sampling import GenParams
from engine.telemetry import Telemetry

from app.mainwindow.attaching import Attaching
from app.mainwindow.layout import WindowLayout
from app.mainwindow.notices import Notices
from app.mainwindow.standin_control import StandInControl
from app.widgets.conversation_list import ConversationList

CHAT_MIN_WIDTH = 380  # px: the chat column is never squeezed below this by the panel
PANEL_MIN_WIDTH = 400  # px: narrower, the Memory panel scrolls instead of cutting its content off

E = TypeVar("E", bound=events.Event)  # an engine event's kind


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
    # made by _build_ui and _build_menu, read by the controllers (app/mainwindow/parts.py)
    chats: ConversationList
    view_menu: QMenu
    standin: StandInControl

    def __init__(self, store: Store, load: SessionConfig | None, rpc: list[str] | None = None) -> None:
        super().__init__()
        self.setWindowTitle("Ebb")
        screen = QGuiApplication.primaryScreen()
        avail = screen.availableGeometry() if screen is not None else None
        self.resize(min(1400, avail.width() - 40) if avail else 1280,
                    min(880, avail.height() - 60) if avail else 820)
        self.store = store
        self.chat = ChatState(store)  # the conversation and the request in flight, Qt-free
        self.chat.last_cfg = load
        self.telemetry = Telemetry()
        self.gen_params: GenParams = default_gen_params(self.settings())
        self.rpc = rpc or []  # servers from the command line: kept across reloads
        self._looked: tuple[list[Path], int] | None = None  # the model folders and their models
        # the controllers, each with one job; they reach the window's parts through it
        self.sending = Sending(self)  # a message to its reply: send, edit, regenerate, continue
        self.models = Models(self)  # what is loaded: open, get, settings that reload
        self.downloads = Downloads(self)  # the Hub's, under way whether the dialog is open or not
        self.downloads.changed.connect(self._on_download_news)
        self.notices = Notices(self.downloads, lambda model, proj: self.models.open_pair(model, proj),
                               lambda: self.models.hub_dialog is not None and self.models.hub_dialog.isVisible())
        self.tuning = TuneController(self)  # Model → Tune layers…: its dialog and runs
        self._build_ui()
        self._handlers: dict[type, Any] = {
            events.VisionChanged: self.vision.vision_changed, events.Residency: self.vision.residency,
            events.ServerTurn: self._on_server_turn, events.EngineFailed: self._on_engine_failed,
            **self.sending.handlers(), **self.models.handlers(), **self.tuning.handlers()}
        self.layout_keeper = WindowLayout(self)  # the size, splitter and docks as they were left
        self.layout_keeper.restore()
        self._start_worker()
        self.tools = Tools(self)  # MCP servers, a chat's switches, a turn's calls as cards
        self._handlers.update(self.tools.handlers())
        self.transcript.call_answer.connect(self.tools.answer)
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
            self.notices.say(" ".join(n for n in notes if n))
        problems = checked_settings(store)[1]  # bad saved values: their defaults, said once
        if problems:
            self.notices.say("\n".join(problems))
        self.tools.start()
        if load is not None:
            self.request_load.emit(load, self.rpc)

    # ------------------------------------------------------------ building

    def _build_ui(self) -> None:
        self.chats = ConversationList(self.store, self.chat, self.notices.error,
                                      self.statusBar().showMessage)
        self.chats.opened.connect(self._on_chat_opened)
        self.chats.deleted.connect(self._on_chat_deleted)
        self._build_menu()
        self.split = QSplitter()
        self.split.addWidget(self.chats)
        self.split.addWidget(self._build_chat_column())
        self.split.setSizes([200, 700])
        self.split.setStretchFactor(1, 1)
        self.setCentralWidget(self.split)
        self._build_panel_dock()
        self._build_help_menu()
        self._build_status_line()

    def _build_chat_column(self) -> QWidget:
        """The Vision switch, the notices, the welcome, the transcript, the reply's buttons and
        the composer with its own."""
        from app.widgets.vision_bar import VisionBar

        self.vision = VisionBar()  # the Vision switch and where the projector is
        self.vision.requested.connect(self._on_vision_toggled)
        self.welcome = QLabel("", wordWrap=True, openExternalLinks=False)
        self.welcome.setTextFormat(Qt.TextFormat.RichText)
        self.welcome.setStyleSheet("background: #eef5fc; color: #1d2b36; padding: 10px; "
                                   "border: 1px solid #c5dcf0;")
        self.welcome.linkActivated.connect(self._on_welcome_link)
        self.welcome.hide()
        self.transcript = Transcript()
        self.transcript.setPlaceholderText("Loading the model…")
        self.transcript.action.connect(self.sending.on_message_action)
        self.transcript.copied.connect(
            lambda code: self.statusBar().showMessage(f"Copied {len(code.splitlines())} lines of code", 4000))
        self.regen_button = QPushButton("Regenerate", clicked=self.sending.on_regenerate, enabled=False)
        self.continue_button = QPushButton("Continue", clicked=self.sending.continue_last, visible=False,
                                           toolTip="Go on with this reply where it stopped")
        self.copy_button = QPushButton("Copy reply", clicked=self.sending.copy_reply, enabled=False)
        acts = QHBoxLayout()
        acts.addStretch(1)
        acts.addWidget(self.continue_button)
        acts.addWidget(self.regen_button)
        acts.addWidget(self.copy_button)
        self.composer = Composer()
        self.composer.recordings_dir = self.store.folder / "recordings"  # the user's alone
        self.composer.switch_draft(self.conv_id)  # its draft is this chat's until another opens
        self.attaching = Attaching(self, self.composer)  # dropped anywhere on the window, Attach…
        self.transcript.problem.connect(self.composer.show_error)  # e.g. a clip that cannot play
        self.transcript.view_picture.connect(self._on_view_picture)
        self.composer.send_requested.connect(self.sending.send)
        self.composer.fits_changed.connect(self._on_chat_changed)  # Send is off while it is over
        attach = QPushButton("Attach…", clicked=self.attaching.choose)
        self.send_button = QPushButton("Send", clicked=self.sending.send, enabled=False)
        self.stop_button = QPushButton("Stop", clicked=self.sending.stop, enabled=False)
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
        cl.addWidget(self.vision)
        cl.addWidget(self.notices.area)  # errors and what happened: each until its ✕
        cl.addWidget(self.welcome)
        cl.addWidget(self.transcript, 1)
        cl.addLayout(acts)
        cl.addLayout(row)
        # the chat keeps a readable width; on a narrow window the memory panel gives way
        chat.setMinimumWidth(CHAT_MIN_WIDTH)
        return chat

    def _build_panel_dock(self) -> None:
        """The Memory panel, docked on the right; View → Memory folds and shows it."""
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

    def _build_status_line(self) -> None:
        """Passing messages on the left; the local server's address, the model's line and a
        busy bar on the right."""
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
        bar = self.statusBar()
        message = bar.currentMessage()
        # a message gets the room it needs first (it was cut at 1,400 px): the model's line
        # gives way down to its minimum, and the whole message is the bar's tooltip too
        need = bar.fontMetrics().horizontalAdvance(message) + 48 if message else 0
        others = sum(w.width() for w in (self.server_status, self.progress) if w.isVisible())
        room = self.width() - need - others
        label.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Preferred)
        label.setMinimumWidth(min(200, self.width() // 3))
        label.setMaximumWidth(max(200, min(self.width() // 2, room)))
        label.updateGeometry()
        bar.setToolTip(message)

    def set_model_line(self, text: str, why: str = "") -> None:
        self.model_label.set_full_text(text)
        if why:
            self.model_label.setToolTip(f"{text}\n\n{why}")
        self._fit_model_label()

    def resizeEvent(self, e: QResizeEvent) -> None:
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
        text = diagnostics_text(facts, self.models.loaded.devices if self.models.loaded else (), self.models.loaded,
                                self.notices.last_error)
        self.about_dialog = AboutDialog(facts, text, self)
        self.about_dialog.show()

    def _build_menu(self) -> None:
        file = self.menuBar().addMenu("&File")
        for text, key, slot in (("New chat", "Ctrl+N", self.chats.new_chat),
                                ("Open model…", "Ctrl+O", self.models.open_model),
                                ("Export chat…", "Ctrl+E", lambda: self.chats.export_chat(self.conv_id)),
                                ("Settings…", "Ctrl+,", self.models.edit_settings),
                                ("Quit", "Ctrl+Q", self.close)):
            act = QAction(text, self, shortcut=QKeySequence(key))
            act.triggered.connect(slot)
            file.addAction(act)
        model = self.menuBar().addMenu("&Model")
        self.get_models_action = QAction("Get models…", self, triggered=self.models.get_models)
        self.get_models_action.setStatusTip("Find GGUF models on the Hugging Face Hub, see how each "
                                            "would run here, download one with its projector")
        model.addAction(self.get_models_action)
        chat_settings = QAction("Chat settings…", self, shortcut=QKeySequence("Ctrl+Shift+,"))
        chat_settings.setStatusTip("This chat's system prompt, temperature, top-p, top-k, "
                                   "min-p, repeat penalty and seed")
        chat_settings.triggered.connect(self.edit_chat_settings)
        model.addAction(chat_settings)
        tools = QAction("Tools…", self, triggered=self.open_tools)
        tools.setStatusTip("MCP servers whose tools the model may call in this chat: add, "
                           "switch on, restart; each call is shown and asked")
        model.addAction(tools)
        self.tune_action = QAction("Tune layers…", self, triggered=self.tuning.start)
        self.tune_action.setStatusTip("Measure tokens/s against accelerator layers and pick the best")
        model.addAction(self.tune_action)
        self.standin = StandInControl(self, None if self.store.in_memory else self.store.folder,
                                      self.statusBar().showMessage, self.notices.error,
                                      self._on_standin_ready)
        model.addAction(self.standin.action)
        self.whatif_action = QAction("What if…", self, triggered=self.models.what_if)
        self.whatif_action.setStatusTip("Predict a model on an accelerator you may not own")
        model.addAction(self.whatif_action)
        self.view_menu = self.menuBar().addMenu("&View")
        stop = QAction("Stop", self, shortcut=QKeySequence("Esc"))
        stop.triggered.connect(self.sending.stop)
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

        self.local_server = LocalServer(self.worker, self.server_status, self.notices.say)
        self.local_server.apply(self.settings())

    def _on_download_news(self, _number: int) -> None:
        n = len(self.downloads.running())
        self.get_models_action.setText(f"Get models… ({n} downloading)" if n else "Get models…")

    # ------------------------------------------------------------ conversations

    @property
    def conv_id(self) -> int:
        return self.chat.conv_id

    def _on_chat_opened(self) -> None:
        """Another conversation is open (the list, New chat, a delete): to the engine, and drawn
        (a search's result at the message found, its words marked)."""
        if self.composer.editing is not None:  # a message of the chat left behind
            self.composer.cancel_edit()
        self.composer.switch_draft(self.conv_id)  # the text being written stays with its chat
        self.notices.area.remove_matching(DEMO_GREEDY_NOTE)  # said of the chat left behind
        self.sending.send_history()
        found = self.chats.take_found()
        self.show_conversation(*(found or ()))

    def _on_chat_deleted(self, cid: int) -> None:
        self.request_forget.emit(chat_tag(cid))  # the model's memory of it goes at once
        title = self.store.title(cid)
        self.notices.say(f"Deleted “{title}”.", "info", ("Undo", lambda: self.chats.undo_delete(cid)),
                         timeout_s=UNDO_S)

    # ------------------------------------------------------------ versions and branches

    def _on_view_picture(self, path: str) -> None:
        from app.widgets.picture_viewer import PictureViewer

        self.picture_viewer = PictureViewer(Path(path), self)
        self.picture_viewer.show()

    def edit_chat_settings(self) -> None:
        from app.dialogs.chat_settings import ChatSettingsDialog

        def save_presets(presets: dict[str, dict[str, Any]]) -> None:
            try:
                self.store.settings.set("chat_presets", presets)
            except EbbError as exc:  # a full disk: said, the dialog goes on
                self.notices.error(str(exc))

        dlg = ChatSettingsDialog(self.store.title(self.conv_id), chat_params(self.store, self.conv_id), self,
                                 presets=self.settings().chat_presets,
                                 save_presets=save_presets)
        if not dlg.exec():
            return
        try:
            set_chat_params(self.store, self.conv_id, dlg.values())
            if dlg.as_default.isChecked():
                for k, v in dlg.values().to_dict().items():
                    self.store.settings.set(k, v)
                self.gen_params = replace(default_gen_params(self.settings()),
                                          max_tokens=self.gen_params.max_tokens)
        except EbbError as exc:
            self.notices.error(str(exc))
            return
        self.sending.send_history()
        if not self.chat.busy:  # the system prompt's line above the chat
            self.show_conversation()
        self.statusBar().showMessage("This chat's settings apply from the next reply", 8000)

    # ------------------------------------------------------------ rendering

    @property
    def rpc_servers(self) -> list[str]:
        """The RPC servers this window connects (the command line's, a stand-in's)."""
        return list(self.rpc)

    def show_conversation(self, focus: int = 0, words: list[str] | None = None) -> None:
        """The open conversation, drawn afresh (opened, switched to, or a request failed);
        `focus`: a message to scroll to, with `words` marked in it."""
        msgs = self.chat.messages()
        self.transcript.system_prompt = chat_params(self.store, self.conv_id).system_prompt
        self.transcript.show_messages(msgs, self.chat.memory_from(msgs), focus, words or ())
        self.update_welcome()
        self.update_actions()

    def update_welcome(self) -> None:
        """The first start's welcome: while no conversation has a message."""
        from engine.models.local import find_models, model_folders
        from app.core.welcome import welcome_html

        if self.chat.busy or self.store.has_messages():
            self.welcome.hide()
            return
        if self._looked is None:  # once: a walk of the model folders
            folders = model_folders(self.settings().model_folders)
            self._looked = (folders, len(find_models(folders, limit=50)))
        folders, n = self._looked
        self.welcome.setText(welcome_html(folders, n, self.models.has_accel,
                                          self.standin.label))
        self.welcome.show()

    @Slot(str)
    def _on_welcome_link(self, link: str) -> None:
        from app.core.welcome import OPEN_LINK, STANDIN_LINK

        if link == STANDIN_LINK:
            self.standin.start()
        elif link == OPEN_LINK:
            self.models.open_model()

    # ------------------------------------------------------------ the stand-in accelerator

    def _on_standin_ready(self, endpoint: str) -> None:
        """The stand-in serves: load the model again with it first (and the demo projector if
        none was chosen)."""
        self.rpc = [endpoint] + [r for r in self.rpc if r != endpoint]
        cfg = self.chat.last_cfg
        model = str(cfg.model_path) if cfg is not None else "default"
        mmproj = str(cfg.mmproj_path) if cfg is not None and cfg.mmproj_path else DEMO
        self.models.load(model, mmproj)
        self.update_welcome()

    def update_actions(self) -> None:
        last = self.chat.last_message()
        has_reply = last is not None and last.role == "assistant"
        self.regen_button.setEnabled(has_reply and self.chat.can_send())
        self.copy_button.setEnabled(has_reply and not self.chat.busy)
        self.continue_button.setVisible(self.chat.can_continue())

    # ------------------------------------------------------------ user actions

    def dragEnterEvent(self, e: QDragEnterEvent) -> None:
        self.attaching.drag_enter(e)

    def dropEvent(self, e: QDropEvent) -> None:
        self.attaching.drop(e)

    def _on_vision_toggled(self, on: bool) -> None:
        if on and "Turn vision on" in self.composer.error.text():  # no longer true
            self.composer.error.hide()
        self.request_vision.emit(on)

    def _on_chat_changed(self) -> None:
        """ChatState changed (loaded, busy, idle): the controls follow it."""
        busy = self.chat.busy
        if busy:  # the local server counts the window's reply ahead of its waiting requests
            self.worker.turn_running.set()
        else:
            self.worker.turn_running.clear()
        self.send_button.setEnabled(not busy and self.chat.loaded and not self.composer.over_budget)
        self.send_button.setToolTip("This message is more than the context has free: remove "
                                    "something, or start a new chat" if self.composer.over_budget else "")
        self.stop_button.setEnabled(busy)
        (self.sending.redraw.start if busy else self.sending.redraw.stop)()
        self.update_actions()

    def settings(self) -> Settings:
        return load_settings(self.store)

    # ------------------------------------------------------------ engine events

    def wrap_handler(self, kind: type[E], wrap: Callable[[Callable[[E], None]], Callable[[E], None]]) -> None:
        """Replace the handler of an engine event `kind` with `wrap(handler)` (a bench that
        times what the window does with it)."""
        self._handlers[kind] = wrap(self._handlers[kind])

    @Slot(object)
    def _on_event(self, ev: events.Event) -> None:
        self.telemetry.on_event(ev)
        self.panel.poke()  # drawn within a tenth of a second, several events at once
        handler = self._handlers.get(type(ev))
        if handler is not None:
            handler(ev)

    def _on_server_turn(self, ev: events.ServerTurn) -> None:
        self.local_server.update_status()
        images = f", {ev.n_images} image{'s' if ev.n_images != 1 else ''} ({ev.strategy})" if ev.n_images else ""
        gone = " — the client left" if ev.client_gone else ""
        self.statusBar().showMessage(f"Local server answered {ev.client}: {ev.n_gen_tokens} tokens"
                                     f"{images}{gone}", 8000)

    def _on_engine_failed(self, ev: events.EngineFailed) -> None:
        self.panel.set_live(False)
        self.progress.hide()
        failed = self.chat.fail()
        if failed is not None:
            self.sending.give_back(failed, ev.message)
        self.notices.error(ev.message)
        if not self.chat.loaded:  # a load that failed: no "Loading…" left standing
            self.statusBar().clearMessage()
            self.transcript.setPlaceholderText("No model is loaded: File → Open model… (what went "
                                               "wrong is said above)")
        self.tuning.failed(ev.message)
        self.update_actions()

    # ------------------------------------------------------------ shutdown

    def open_tools(self) -> None:
        """Model → Tools… (and Settings' Tool servers button): the MCP servers' dialog."""
        self.tools.open_dialog()

    def closeEvent(self, event: QCloseEvent) -> None:
        self.layout_keeper.save()
        self.transcript.player.stop()  # an open sound device kept the process alive (#52)
        self.composer.player.stop()
        self.local_server.close()
        self.downloads.pause_all()  # their parts are kept: the next Download goes on from there
        self.worker.closing()
        # A load in progress is not cut short (llama.cpp finishes it first): the window goes
        # at once rather than standing frozen until then; the process ends after it.
        self.hide()
        QApplication.processEvents(QEventLoop.ProcessEventsFlag.ExcludeUserInputEvents)
        # Runs on the worker thread after the (now cancelled) current job: it frees llama.cpp.
        QMetaObject.invokeMethod(self.worker, "shutdown", Qt.ConnectionType.BlockingQueuedConnection)
        self._thread.quit()
        self._thread.wait(10_000)
        self.tools.close()  # every tool server ends (a program's whole process group)
        if self.chat.busy:  # closed during a reply: it is kept as far as it got, as stopped
            self.sending.take_stream()
            self.chat.finish(self.chat.stopped_result())
        self.standin.stop()  # after the session let go of its memory (shutdown above)
        clear_recordings(self.composer.recordings_dir)  # the sent ones are the store's now
        super().closeEvent(event)
