"""The main window: conversations, the chat, images in, the vision switch, the memory panel.

GUI thread only. All engine work goes to the EngineWorker (its own QThread) through queued
signals; the streamed reply is redrawn on a 20 Hz timer, not per token.
"""
from __future__ import annotations

import html
from dataclasses import replace
from pathlib import Path
from typing import Any

from PySide6.QtCore import QMetaObject, Qt, QThread, QTimer, Signal, Slot
from PySide6.QtGui import QAction, QCloseEvent, QDragEnterEvent, QDropEvent, QGuiApplication, QKeySequence
from PySide6.QtWidgets import (QCheckBox, QDockWidget, QFileDialog, QHBoxLayout, QInputDialog,
                               QLabel, QLineEdit, QListWidget, QListWidgetItem, QMainWindow, QMenu,
                               QProgressBar, QPushButton, QSplitter, QTextBrowser, QVBoxLayout,
                               QWidget)

from app.composer import Composer
from app.dialogs import DEFAULTS, ModelPicker, SettingsDialog
from app.panel import MemoryPanel
from app.store import Store
from app.worker import EngineWorker
from engine import events
from engine.llama.runtime import GenParams
from engine.session import SessionConfig
from engine.telemetry import Telemetry

REDRAW_MS = 50
DEMO_LABEL = "demo projector: random weights — it exercises the memory pipeline; it does not see"


class MainWindow(QMainWindow):
    request_load = Signal(object, object)
    request_send = Signal(int, str, object, object)
    request_history = Signal(object)
    request_vision = Signal(bool)
    request_undo = Signal()
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
        self.telemetry = Telemetry()
        self.gen_params = GenParams()
        self._request_id = 0
        self._busy = False
        self._reply_parts: list[str] = []
        self._live_text = ""
        self._pending: tuple[str, list[Path], int] | None = None  # text, images, message id
        self._loaded = False
        self.conv_id = 0
        self._build_ui()
        self._start_worker()
        self._redraw = QTimer(self, interval=REDRAW_MS)
        self._redraw.timeout.connect(self._render_live)
        self._open_first_conversation()
        self._last_cfg = load
        self._rpc = rpc or []
        if load is not None:
            self.request_load.emit(load, self._rpc)

    # ------------------------------------------------------------ building

    def _build_ui(self) -> None:
        self._build_menu()
        self.search = QLineEdit(placeholderText="Search chats")
        self.search.textChanged.connect(self._refresh_conversations)
        self.conversations = QListWidget()
        self.conversations.currentItemChanged.connect(self._on_conversation_selected)
        self.conversations.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.conversations.customContextMenuRequested.connect(self._on_conversation_menu)
        new = QPushButton("New chat", clicked=self._on_new_chat)
        side = QWidget()
        side.setMinimumWidth(170)
        sl = QVBoxLayout(side)
        sl.addWidget(new)
        sl.addWidget(self.search)
        sl.addWidget(self.conversations, 1)

        self.vision_switch = QCheckBox("Vision", toolTip="Turn vision on and off without reloading the model")
        self.vision_switch.toggled.connect(self._on_vision_toggled)
        self.vision_switch.setEnabled(False)
        self.projector_label = QLabel("")
        self.demo_label = QLabel("")
        self.demo_label.setStyleSheet("color: #b26a00;")
        top = QHBoxLayout()
        top.addWidget(self.vision_switch)
        top.addWidget(self.projector_label)
        top.addStretch(1)
        top.addWidget(self.demo_label)
        self.notice = QLabel("", wordWrap=True)  # what happened before a restart, until closed
        self.notice.setStyleSheet("background: #fff3cd; color: #5c4400; padding: 6px;")
        self.notice.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.notice.hide()
        self.transcript = QTextBrowser(openExternalLinks=True)
        self.transcript.setPlaceholderText("Loading the model…")
        # The reply being streamed is drawn here, on its own: redrawing the whole conversation
        # 20 times a second would cost more as the chat grows.
        self.live_reply = QTextBrowser()
        self.live_reply.setMaximumHeight(220)
        self.live_reply.hide()
        self.regen_button = QPushButton("Regenerate", clicked=self._on_regenerate, enabled=False)
        self.copy_button = QPushButton("Copy reply", clicked=self._on_copy, enabled=False)
        acts = QHBoxLayout()
        acts.addStretch(1)
        acts.addWidget(self.regen_button)
        acts.addWidget(self.copy_button)
        self.composer = Composer()
        self.composer.send_requested.connect(self._on_send)
        attach = QPushButton("Attach…", clicked=self._on_attach)
        self.send_button = QPushButton("Send", clicked=self._on_send, enabled=False)
        self.stop_button = QPushButton("Stop", clicked=self._on_stop, enabled=False)
        buttons = QVBoxLayout()
        for b in (self.send_button, self.stop_button, attach):
            buttons.addWidget(b)
        buttons.addStretch(1)
        row = QHBoxLayout()
        row.addWidget(self.composer, 1)
        row.addLayout(buttons)
        chat = QWidget()
        cl = QVBoxLayout(chat)
        cl.addLayout(top)
        cl.addWidget(self.notice)
        cl.addWidget(self.transcript, 1)
        cl.addWidget(self.live_reply)
        cl.addLayout(acts)
        cl.addLayout(row)
        split = QSplitter()
        split.addWidget(side)
        split.addWidget(chat)
        split.setSizes([200, 700])
        split.setStretchFactor(1, 1)
        self.setCentralWidget(split)

        self.panel = MemoryPanel(self.telemetry)
        self.panel_dock = QDockWidget("Memory", self)
        self.panel_dock.setObjectName("memory-panel")
        self.panel_dock.setWidget(self.panel)
        self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, self.panel_dock)
        self.resizeDocks([self.panel_dock], [int(self.width() * 0.42)], Qt.Orientation.Horizontal)
        self.view_menu.addAction(self.panel_dock.toggleViewAction())

        self.progress = QProgressBar(maximumWidth=160, textVisible=False)
        self.progress.setRange(0, 0)
        self.progress.hide()
        self.model_label = QLabel("no model")
        self.statusBar().addPermanentWidget(self.model_label)
        self.statusBar().addPermanentWidget(self.progress)

    def _build_menu(self) -> None:
        file = self.menuBar().addMenu("&File")
        for text, key, slot in (("New chat", "Ctrl+N", self._on_new_chat),
                                ("Open model…", "Ctrl+O", self._on_open_model),
                                ("Settings…", "Ctrl+,", self._on_settings),
                                ("Quit", "Ctrl+Q", self.close)):
            act = QAction(text, self, shortcut=QKeySequence(key))
            act.triggered.connect(slot)
            file.addAction(act)
        model = self.menuBar().addMenu("&Model")
        self.tune_action = QAction("Tune layers…", self, triggered=self._on_tune)
        self.tune_action.setStatusTip("Measure tokens/s against accelerator layers and pick the best")
        model.addAction(self.tune_action)
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
        self.worker.event.connect(self._on_event)
        self.request_load.connect(self.worker.load)
        self.request_send.connect(self.worker.send)
        self.request_history.connect(self.worker.set_history)
        self.request_vision.connect(self.worker.set_vision)
        self.request_undo.connect(self.worker.undo_last)
        self.request_tune.connect(self.worker.tune)
        self._thread.finished.connect(self.worker.deleteLater)
        self._thread.start()

    def show_notice(self, text: str) -> None:
        self.notice.setText(text)
        self.notice.show()

    # ------------------------------------------------------------ conversations

    def _open_first_conversation(self) -> None:
        convs = self.store.conversations()
        self.conv_id = convs[0].id if convs else self.store.create_conversation()
        self._refresh_conversations()

    def _refresh_conversations(self) -> None:
        self.conversations.blockSignals(True)
        self.conversations.clear()
        for c in self.store.conversations(self.search.text()):
            item = QListWidgetItem(c.title, self.conversations)
            item.setData(Qt.ItemDataRole.UserRole, c.id)
            if c.id == self.conv_id:
                self.conversations.setCurrentItem(item)
        self.conversations.blockSignals(False)
        self._render()

    def _on_conversation_selected(self, item: QListWidgetItem | None, _prev: Any) -> None:
        if item is None or self._busy:
            return
        self.conv_id = int(item.data(Qt.ItemDataRole.UserRole))
        self._send_history()
        self._render()

    def _send_history(self) -> None:
        turns = [(m.role, m.text, [str(p) for p in m.images]) for m in self.store.messages(self.conv_id)]
        self.request_history.emit(turns)

    @Slot()
    def _on_new_chat(self) -> None:
        if self._busy:
            return
        self.conv_id = self.store.create_conversation()
        self.request_history.emit([])
        self._refresh_conversations()

    def _on_conversation_menu(self, pos: Any) -> None:
        item = self.conversations.itemAt(pos)
        if item is None:
            return
        cid = int(item.data(Qt.ItemDataRole.UserRole))
        menu = QMenu(self)
        rename = menu.addAction("Rename…")
        delete = menu.addAction("Delete")
        chosen = menu.exec(self.conversations.mapToGlobal(pos))
        if chosen is rename:
            title, ok = QInputDialog.getText(self, "Rename chat", "Title", text=item.text())
            if ok:
                self.store.rename(cid, title)
        elif chosen is delete and not (self._busy and cid == self.conv_id):
            self.store.delete(cid)
            if cid == self.conv_id:
                self._open_first_conversation()
                self._send_history()
        self._refresh_conversations()

    # ------------------------------------------------------------ rendering

    def _render(self) -> None:
        parts = []
        msgs = self.store.messages(self.conv_id) if self.conv_id else []
        for m in msgs:
            who = "You" if m.role == "user" else "Ebb"
            parts.append(f"**{who}**\n\n" + "".join(f"![{p.name}]({thumb(p)}) " for p in m.images))
            parts.append(m.text + "\n")
            if m.stats:
                parts.append(f"<small>{html.escape(stats_line(m.stats))}</small>\n")
        bar = self.transcript.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 4
        self.transcript.setMarkdown("\n".join(parts))
        if at_bottom:
            bar.setValue(bar.maximum())
        has_reply = bool(msgs) and msgs[-1].role == "assistant"
        self.regen_button.setEnabled(has_reply and not self._busy and self._loaded)
        self.copy_button.setEnabled(has_reply)

    def _render_live(self) -> None:
        text = "".join(self._reply_parts)
        if text != self._live_text:
            self._live_text = text
            self.live_reply.setMarkdown("**Ebb**\n\n" + (text or "…"))
            bar = self.live_reply.verticalScrollBar()
            bar.setValue(bar.maximum())

    # ------------------------------------------------------------ user actions

    def dragEnterEvent(self, e: QDragEnterEvent) -> None:
        if e.mimeData().hasUrls() or e.mimeData().hasImage():
            e.acceptProposedAction()

    def dropEvent(self, e: QDropEvent) -> None:
        self.composer.edit.insertFromMimeData(e.mimeData())
        e.acceptProposedAction()

    @Slot()
    def _on_attach(self) -> None:
        paths, _ = QFileDialog.getOpenFileNames(self, "Attach images", "",
                                                "Images (*.png *.jpg *.jpeg *.webp *.gif *.bmp)")
        for p in paths:
            self.composer.add_image(Path(p))

    @Slot()
    def _on_send(self) -> None:
        text, images = self.composer.text(), list(self.composer.images)
        if (not text and not images) or self._busy or not self._loaded:
            return
        if images and not self.vision_switch.isChecked():
            self.composer.show_error("Turn vision on to send images (no reload needed).")
            return
        self.composer.clear()
        if not self.store.messages(self.conv_id) and text:
            self.store.rename(self.conv_id, text[:48])
        mid = self.store.add_message(self.conv_id, "user", text, images)
        stored = self.store.messages(self.conv_id)[-1].images
        self._dispatch(text, stored, (text, images, mid))
        self._refresh_conversations()

    def _dispatch(self, text: str, images: list[Path], pending: tuple[str, list[Path], int]) -> None:
        self._request_id += 1
        self._pending = pending
        self._reply_parts = []
        self._set_busy(True)
        self.request_send.emit(self._request_id, text, [str(p) for p in images], self.gen_params)
        self._render()

    @Slot()
    def _on_stop(self) -> None:
        self.worker.cancel()

    @Slot()
    def _on_regenerate(self) -> None:
        msgs = self.store.messages(self.conv_id)
        if self._busy or len(msgs) < 2 or msgs[-1].role != "assistant":
            return
        user = msgs[-2]
        self.store.delete_message(msgs[-1].id)
        self.request_undo.emit()
        self._dispatch(user.text, user.images, (user.text, user.images, user.id))

    @Slot()
    def _on_copy(self) -> None:
        msgs = self.store.messages(self.conv_id)
        if msgs and msgs[-1].role == "assistant":
            QGuiApplication.clipboard().setText(msgs[-1].text)

    def _on_vision_toggled(self, on: bool) -> None:
        self.projector_label.setText("switching…")
        self.request_vision.emit(on)

    def _set_busy(self, busy: bool) -> None:
        self._busy = busy
        self._live_text = None  # type: ignore[assignment]
        self.live_reply.setVisible(busy)
        if busy:
            self._render_live()
        self.send_button.setEnabled(not busy and self._loaded)
        self.stop_button.setEnabled(busy)
        (self._redraw.start if busy else self._redraw.stop)()

    def _settings(self) -> dict[str, Any]:
        return {k: self.store.setting(k, v) for k, v in DEFAULTS.items()}

    @Slot()
    def _on_settings(self) -> None:
        dlg = SettingsDialog(self._settings(), self)
        if dlg.exec():
            for k, v in dlg.values().items():
                self.store.set_setting(k, v)
            if self._last_cfg is not None and not self._busy:
                self._load(str(self._last_cfg.model_path), str(self._last_cfg.mmproj_path or ""))

    @Slot()
    def _on_open_model(self) -> None:
        dlg = ModelPicker(self._settings(), self)
        if dlg.exec() and not self._busy:
            self.store.set_setting("model_folders", dlg.settings.get("model_folders", []))
            model, mmproj = dlg.choice()
            if model:
                self._load(model, mmproj)

    @Slot()
    def _on_tune(self) -> None:
        from app.main import session_config
        from app.tune import TuneDialog

        if self._busy or self._last_cfg is None:
            self.statusBar().showMessage("Tuning needs a loaded model and no reply running", 8000)
            return
        cfg, rpc = session_config(self.store, str(self._last_cfg.model_path),
                                  str(self._last_cfg.mmproj_path or ""), rpc=self._rpc)
        cfg = replace(cfg, gpu_layers=None)  # measure every count the budget allows
        self.tune_dialog = TuneDialog(self)
        self.tune_dialog.stop.connect(self.worker.cancel)
        self.tune_dialog.apply_layers.connect(self._apply_gpu_layers)
        self.tune_dialog.finished.connect(self.worker.cancel)  # closing it stops the runs
        self._loaded = False
        self._set_busy(self._busy)
        self.request_tune.emit(cfg, rpc)
        self.tune_dialog.show()

    @Slot()
    def _on_what_if(self) -> None:
        from app.whatif_dialog import WhatIfDialog

        cfg = self._last_cfg
        self.whatif_dialog = WhatIfDialog(str(cfg.model_path) if cfg else "default",
                                          str(cfg.mmproj_path or "") if cfg else "",
                                          int(self._settings()["ctx"]), self)
        self.whatif_dialog.show()

    @Slot(int)
    def _apply_gpu_layers(self, n: int) -> None:
        self.store.set_setting("gpu_layers", n)
        if self._last_cfg is not None:
            self._load(str(self._last_cfg.model_path), str(self._last_cfg.mmproj_path or ""))
            self.statusBar().showMessage(f"Using {n} accelerator layers (Settings to change)", 15000)

    def _on_TunePoint(self, ev: events.TunePoint) -> None:
        if getattr(self, "tune_dialog", None) is not None:
            self.tune_dialog.add_point(ev.layers, ev.prompt_tps, ev.gen_tps)

    def _on_TuneFinished(self, ev: events.TuneFinished) -> None:
        if getattr(self, "tune_dialog", None) is not None:
            self.tune_dialog.finish(ev.result)

    def _load(self, model: str, mmproj: str) -> None:
        from app.main import session_config

        try:
            # servers given on the command line stay (Settings' list is added to them)
            cfg, rpc = session_config(self.store, model, mmproj, rpc=self._rpc)
        except Exception as exc:  # a bad path or setting: say so, keep what is loaded
            self.statusBar().showMessage(f"Error: {exc}")
            return
        self._last_cfg = cfg
        self._loaded = False
        self.request_load.emit(cfg, rpc)
        self._send_history()

    # ------------------------------------------------------------ engine events

    @Slot(object)
    def _on_event(self, ev: events.Event) -> None:
        self.telemetry.on_event(ev)
        handler = getattr(self, f"_on_{type(ev).__name__}", None)
        if handler is not None:
            handler(ev)

    def _on_ModelLoading(self, ev: events.ModelLoading) -> None:
        self.progress.show()
        self._loaded = False
        self.send_button.setEnabled(False)
        self.statusBar().showMessage(f"Loading {Path(ev.model_path).name}…")

    def _on_ModelLoaded(self, ev: events.ModelLoaded) -> None:
        d = ev.details
        self.progress.hide()
        self._loaded = True
        self.setWindowTitle(f"Ebb — {ev.model_name}")
        by_dev = {k: v for k, v in (d.get("layers_by_device") or {}).items() if k != "CPU"}
        if d.get("accelerator") and len(by_dev) > 1:  # spread over several devices
            where = (" + ".join(f"{n} on {dev}" for dev, n in by_dev.items()) + f" of {ev.n_layers} "
                     f"layers · {d.get('mover')} mover")
        elif d.get("accelerator"):
            mover = f"{d.get('mover')} mover" + (f" ({d['mover_note']})" if d.get("mover_note") else "")
            where = (f"{d.get('n_layers_on_accel', 0)}/{ev.n_layers} layers on {d['accelerator']} · "
                     f"{mover}")
        else:
            where = f"all {ev.n_layers} layers in RAM (no accelerator)"
        self.model_label.setText(f"{ev.model_name} · {where} · ctx {ev.n_ctx}")
        self.model_label.setToolTip(d.get("placement_reason") or "")
        sent = d.get("rpc_bytes_sent") or 0
        if sent:
            self.model_label.setText(self.model_label.text() + f" · sent {sent / 2**20:.1f} MiB "
                                     "to remote devices while loading")
        if not self._busy:
            self.statusBar().showMessage(f"Model loaded in {ev.load_s:.2f}s"
                                         + (f" — {d['mover_note']}" if d.get("mover_note") else ""),
                                         15000)
        self.transcript.setPlaceholderText("Say something. Drop or paste images to ask about them.")
        has_proj = bool(d.get("projector"))
        self.vision_switch.blockSignals(True)
        self.vision_switch.setChecked(bool(d.get("vision")))
        self.vision_switch.blockSignals(False)
        self.vision_switch.setEnabled(has_proj)
        self.projector_label.setText("projector in RAM" if has_proj else "no projector loaded")
        self.demo_label.setText(DEMO_LABEL if d.get("projector_synthetic") else "")
        self._set_busy(self._busy)
        self._send_history()
        self._render()

    def _on_VisionChanged(self, ev: events.VisionChanged) -> None:
        self.vision_switch.blockSignals(True)
        self.vision_switch.setChecked(ev.enabled)
        self.vision_switch.blockSignals(False)
        self.projector_label.setText("projector in RAM" if ev.enabled else "vision off")

    def _on_Residency(self, ev: events.Residency) -> None:
        where = {"RAM": "projector in RAM", "loading": "projector loading…", "": ""}
        if self.vision_switch.isChecked():
            self.projector_label.setText(where.get(ev.projector_device, f"projector on {ev.projector_device}"))

    def _on_TokenText(self, ev: events.TokenText) -> None:
        if ev.request_id == self._request_id:
            self._reply_parts.append(ev.text)

    def _on_TurnFinished(self, ev: events.TurnFinished) -> None:
        r: dict[str, Any] = ev.result
        pending, self._pending = self._pending, None
        if r.get("device_lost"):
            self.statusBar().showMessage(f"{r['device_lost']}: the conversation goes on with the "
                                         "devices that are left", 30000)
        if r.get("error") and pending is not None:
            self._undo_user_message(pending, r["error"])
        elif pending is not None:
            stats = {k: r.get(k) for k in ("n_gen_tokens", "gen_tokens_per_s", "prompt_s", "strategy",
                                           "stop_reason", "n_images")}
            spans = r.get("spans", [])
            stats["encode_s"] = sum(s["end_s"] - s["start_s"] for s in spans if s["name"] == "encode")
            stats["swap_s"] = sum(s["end_s"] - s["start_s"] for s in spans
                                  if s["name"] in ("evict", "restore", "save_state", "restore_state"))
            self.store.add_message(self.conv_id, "assistant", r.get("text", ""), stats=stats)
        self._set_busy(False)
        self._render()

    def _undo_user_message(self, pending: tuple[str, list[Path], int], error: str) -> None:
        text, images, mid = pending
        self.store.delete_message(mid)
        self.request_undo.emit()
        self.composer.restore(text, images)  # nothing the user wrote is lost
        self.composer.show_error(error)

    def _on_EngineFailed(self, ev: events.EngineFailed) -> None:
        self.progress.hide()
        if self._busy and self._pending is not None:
            self._undo_user_message(self._pending, ev.message)
            self._pending = None
            self._set_busy(False)
        self.statusBar().showMessage(f"Error: {ev.message}")
        if getattr(self, "tune_dialog", None) is not None and self.tune_dialog.stop_button.isEnabled():
            self.tune_dialog.fail(ev.message)
        self._render()

    # ------------------------------------------------------------ shutdown

    def closeEvent(self, event: QCloseEvent) -> None:
        self.worker.cancel()
        # Runs on the worker thread after the (now cancelled) current job: it frees llama.cpp.
        QMetaObject.invokeMethod(self.worker, "shutdown", Qt.ConnectionType.BlockingQueuedConnection)
        self._thread.quit()
        self._thread.wait(10_000)
        super().closeEvent(event)


def stats_line(s: dict[str, Any]) -> str:
    line = (f"{s.get('n_gen_tokens', 0)} tokens · {s.get('gen_tokens_per_s', 0):.1f} tok/s · "
            f"prompt {s.get('prompt_s', 0):.2f}s · {s.get('stop_reason', '')}")
    if s.get("n_images"):
        line += (f" · vision: {s.get('strategy')}, encode {s.get('encode_s', 0):.2f}s, "
                 f"swap {s.get('swap_s', 0):.3f}s")
    return line


def thumb(path: Path, size: int = 160) -> str:
    """A small copy of an image for the transcript (made once, kept beside the store)."""
    from PIL import Image

    out = path.parent.parent / "thumbs" / f"{path.stem}-{size}.png"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            with Image.open(path) as im:
                im.thumbnail((size, size))
                im.convert("RGB").save(out)
        except (OSError, ValueError):
            return ""
    return out.as_posix()
