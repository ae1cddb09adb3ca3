"""The main window: a transcript, a composer, Send/Stop, and a status bar with load progress.

GUI thread only. Engine work goes to the EngineWorker through queued signals; the streamed
reply is redrawn on a 20 Hz timer, not per token.
"""
from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from PySide6.QtCore import QMetaObject, Qt, QThread, QTimer, Signal, Slot
from PySide6.QtGui import QCloseEvent, QKeySequence, QShortcut
from PySide6.QtWidgets import (QHBoxLayout, QLabel, QMainWindow, QPlainTextEdit, QProgressBar,
                               QPushButton, QTextBrowser, QVBoxLayout, QWidget)

from app.worker import EngineWorker
from engine import events
from engine.runtime import GenParams, LoadParams

REDRAW_MS = 50


class MainWindow(QMainWindow):
    request_load = Signal(object)
    request_generate = Signal(int, object, object)

    def __init__(self, load_params: LoadParams | None) -> None:
        super().__init__()
        self.setWindowTitle("Ebb")
        self.resize(900, 680)
        self._messages: list[dict[str, str]] = []
        self._reply_parts: list[str] = []
        self._request_id = 0
        self._busy = False
        self.gen_params = GenParams()
        self._build_ui()
        self._thread = QThread(self)
        self._thread.setObjectName("EngineWorker")
        self._worker = EngineWorker()
        self._worker.moveToThread(self._thread)
        self._worker.event.connect(self._on_event)
        self.request_load.connect(self._worker.load)
        self.request_generate.connect(self._worker.generate)
        self._thread.finished.connect(self._worker.deleteLater)
        self._thread.start()
        self._redraw = QTimer(self, interval=REDRAW_MS)
        self._redraw.timeout.connect(self._render)
        if load_params is not None:
            self.request_load.emit(load_params)

    # ------------------------------------------------------------ UI

    def _build_ui(self) -> None:
        self.transcript = QTextBrowser(openExternalLinks=True)
        self.transcript.setPlaceholderText("Loading the model…")
        self.composer = QPlainTextEdit(placeholderText="Message Ebb  (Ctrl+Enter to send)")
        self.composer.setMaximumHeight(110)
        self.send_button = QPushButton("Send", enabled=False, clicked=self._on_send)
        self.stop_button = QPushButton("Stop", enabled=False, clicked=self._on_stop)
        QShortcut(QKeySequence("Ctrl+Return"), self, activated=self._on_send)
        buttons = QVBoxLayout()
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.stop_button)
        buttons.addStretch(1)
        row = QHBoxLayout()
        row.addWidget(self.composer, 1)
        row.addLayout(buttons)
        body = QVBoxLayout()
        body.addWidget(self.transcript, 1)
        body.addLayout(row)
        central = QWidget()
        central.setLayout(body)
        self.setCentralWidget(central)
        self.progress = QProgressBar(maximumWidth=160, textVisible=False)
        self.progress.setRange(0, 0)
        self.progress.hide()
        self.model_label = QLabel("no model")
        self.statusBar().addPermanentWidget(self.model_label)
        self.statusBar().addPermanentWidget(self.progress)

    def _render(self) -> None:
        parts = []
        for m in self._messages:
            who = "You" if m["role"] == "user" else "Ebb"
            parts.append(f"**{who}**\n\n{m['content']}\n")
            if m.get("stats"):
                parts.append(f"<small>{html.escape(m['stats'])}</small>\n")
        if self._busy:
            parts.append("**Ebb**\n\n" + ("".join(self._reply_parts) or "…") + "\n")
        bar = self.transcript.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 4
        self.transcript.setMarkdown("\n".join(parts))
        if at_bottom:
            bar.setValue(bar.maximum())

    # ------------------------------------------------------------ user actions

    @Slot()
    def _on_send(self) -> None:
        text = self.composer.toPlainText().strip()
        if not text or self._busy or not self.send_button.isEnabled():
            return
        self.composer.clear()
        self._messages.append({"role": "user", "content": text})
        self._request_id += 1
        self._reply_parts = []
        self._set_busy(True)
        history = [{"role": m["role"], "content": m["content"]} for m in self._messages]
        self.request_generate.emit(self._request_id, history, self.gen_params)
        self._render()

    @Slot()
    def _on_stop(self) -> None:
        self._worker.cancel()

    def _set_busy(self, busy: bool) -> None:
        self._busy = busy
        self.send_button.setEnabled(not busy)
        self.stop_button.setEnabled(busy)
        if busy:
            self._redraw.start()
        else:
            self._redraw.stop()

    # ------------------------------------------------------------ engine events

    @Slot(object)
    def _on_event(self, ev: events.Event) -> None:
        handler = getattr(self, f"_on_{type(ev).__name__}", None)
        if handler is not None:
            handler(ev)

    def _on_ModelLoading(self, ev: events.ModelLoading) -> None:
        self.progress.show()
        self.send_button.setEnabled(False)
        self.statusBar().showMessage(f"Loading {Path(ev.model_path).name}…")

    def _on_ModelLoaded(self, ev: events.ModelLoaded) -> None:
        self.progress.hide()
        self.setWindowTitle(f"Ebb — {ev.model_name}")
        self.model_label.setText(f"{ev.model_name} · {ev.n_layers} layers · ctx {ev.n_ctx} · "
                                 f"{ev.n_threads} threads")
        self.statusBar().showMessage(f"Model loaded in {ev.load_s:.2f}s", 5000)
        self.transcript.setPlaceholderText("Say something.")
        self.send_button.setEnabled(True)

    def _on_TokenText(self, ev: events.TokenText) -> None:
        if ev.request_id == self._request_id:
            self._reply_parts.append(ev.text)

    def _on_TurnFinished(self, ev: events.TurnFinished) -> None:
        r: dict[str, Any] = ev.result
        stats = (f"{r['n_gen_tokens']} tokens · {r['gen_tokens_per_s']:.1f} tok/s · "
                 f"prompt {r['prompt_s']:.2f}s · {r['stop_reason']}")
        self._messages.append({"role": "assistant", "content": r["text"], "stats": stats})
        self._set_busy(False)
        self._render()

    def _on_EngineFailed(self, ev: events.EngineFailed) -> None:
        self.progress.hide()
        if self._busy:
            self._set_busy(False)
            if self._messages and self._messages[-1]["role"] == "user":
                self.composer.setPlainText(self._messages.pop()["content"])  # nothing lost
        self.statusBar().showMessage(f"Error: {ev.message}")
        self._render()

    # ------------------------------------------------------------ shutdown

    def closeEvent(self, event: QCloseEvent) -> None:
        self._worker.cancel()
        # Runs on the worker thread after the (now cancelled) current job: it frees llama.cpp.
        QMetaObject.invokeMethod(self._worker, "shutdown", Qt.ConnectionType.BlockingQueuedConnection)
        self._thread.quit()
        self._thread.wait(10_000)
        super().closeEvent(event)
