"""The memory panel: residency map, memory over time, pipeline timeline (pyqtgraph).

A view of the Qt-free `engine.telemetry.Telemetry` model, redrawn on a 20 Hz timer only when
the model changed. GUI thread only.
"""
from __future__ import annotations

import time
from pathlib import Path

import pyqtgraph as pg
from PySide6.QtCore import QPointF, QRectF, Qt, QTimer, Slot
from PySide6.QtGui import QColor, QPainter, QPaintEvent, QPen
from PySide6.QtWidgets import (QFileDialog, QHBoxLayout, QLabel, QPushButton, QSizePolicy,
                               QVBoxLayout, QWidget)

from engine.telemetry import Telemetry, TimelineSpan
from engine.trace import ROWS, ROW_NAMES, write_chrome_trace

REFRESH_MS = 50
KIND_COLORS = {"weights": "#4c78a8", "layers": "#72b7b2", "output": "#54a24b", "kv": "#f58518",
               "compute": "#b279a2", "projector": "#e45756", "projector_compute": "#ff9da6"}
SPAN_COLORS = {"evict": "#e45756", "restore": "#54a24b", "save_state": "#9d755d",
               "restore_state": "#9d755d", "load_projector": "#f58518", "encode": "#eeca3b",
               "free_projector": "#bab0ac", "plan": "#79706e", "prefill": "#4c78a8",
               "decode": "#72b7b2"}


def place_color(where: str) -> QColor:
    if where in ("CPU", "RAM"):
        return QColor("#9e9e9e")
    if where == "moving" or where == "loading":
        return QColor("#ffb300")
    if where.startswith("RPC"):
        return QColor("#8e44ad")
    if not where:
        return QColor(0, 0, 0, 0)
    return QColor("#2e7d32")  # a local accelerator


class ResidencyMap(QWidget):
    """One cell per layer plus embeddings/output, projector, KV cache and compute buffers."""

    def __init__(self, telemetry: Telemetry) -> None:
        super().__init__()
        self.telemetry = telemetry
        self.setMinimumHeight(64)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def paintEvent(self, event: QPaintEvent) -> None:
        cells = self.telemetry.cell_states()
        if not cells:
            return
        p = QPainter(self)
        w = max(4.0, (self.width() - 8) / len(cells))
        for i, (label, where) in enumerate(cells):
            r = QRectF(4 + i * w, 6, w - 2, 30)
            p.fillRect(r, place_color(where))
            if w > 18 or label in ("embd", "out", "proj", "kv", "compute"):
                p.setPen(QPen(QColor("#ffffff")))
                p.drawText(r, Qt.AlignmentFlag.AlignCenter, label if w > 18 else label[:1])
        p.setPen(QPen(self.palette().text().color()))
        legend = "  ".join(f"■ {k}" for k in ("accelerator", "RAM", "remote", "moving"))
        p.drawText(QPointF(6, 56), f"{legend}   (projector: {self.telemetry.projector_device or 'none'})")
        p.end()


class MemoryPanel(QWidget):
    def __init__(self, telemetry: Telemetry) -> None:
        super().__init__()
        self.telemetry = telemetry
        self._drawn_version = -1
        self._t0 = time.monotonic()
        self.residency = ResidencyMap(telemetry)
        self.memory_plot = pg.PlotWidget(title="Memory on each device (ledger, stacked) and the device's own reading")
        self.memory_plot.setLabel("left", "MiB")
        self.memory_plot.setLabel("bottom", "s")
        self.memory_plot.addLegend(offset=(5, 5))
        self.timeline = pg.PlotWidget(title="Pipeline: predicted (outline) beside measured (filled)")
        self.timeline.setLabel("bottom", "s")
        axis = self.timeline.getAxis("left")
        axis.setTicks([[(y, name) for y, name in ROW_NAMES.items()]])
        self.timeline.setYRange(0.4, 3.6)
        self.timeline.scene().sigMouseMoved.connect(self._on_mouse_moved)
        self.span_info = QLabel("Hover a span for its numbers.")
        self.span_info.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        save = QPushButton("Save trace…", clicked=self._on_save_trace)
        row = QHBoxLayout()
        row.addWidget(self.span_info, 1)
        row.addWidget(save)
        lay = QVBoxLayout(self)
        lay.addWidget(QLabel("Residency"))
        lay.addWidget(self.residency)
        lay.addWidget(self.memory_plot, 1)
        lay.addWidget(self.timeline, 1)
        lay.addLayout(row)
        self._timer = QTimer(self, interval=REFRESH_MS)
        self._timer.timeout.connect(self._on_tick)
        self._timer.start()

    # ------------------------------------------------------------ drawing

    @Slot()
    def _on_tick(self) -> None:
        if self.telemetry.version == self._drawn_version or not self.isVisible():
            return
        self._drawn_version = self.telemetry.version
        self.residency.update()
        self._draw_memory()
        self._draw_timeline()

    def _draw_memory(self) -> None:
        self.memory_plot.clear()
        for dev, series in self.telemetry.memory.items():
            if not series or dev == "CPU":
                continue
            xs = [t - self._t0 for t, _, _ in series]
            kinds = [k for k in KIND_COLORS if any(k in s for _, s, _ in series)]
            cumulative = [0.0] * len(xs)
            stacks = []
            for kind in kinds:
                cumulative = [c + s.get(kind, 0) / 2**20 for c, (_, s, _) in zip(cumulative, series)]
                stacks.append((kind, list(cumulative)))
            for kind, ys in reversed(stacks):  # tallest first, lower fills drawn over it
                color = QColor(KIND_COLORS[kind])
                self.memory_plot.plot(xs, ys, stepMode=None, fillLevel=0, brush=color,
                                      pen=pg.mkPen(color), name=f"{dev} {kind}")
            reported = [(t - self._t0, r / 2**20) for t, _, r in series if r is not None]
            if reported:
                self.memory_plot.plot([x for x, _ in reported], [y for _, y in reported],
                                      pen=pg.mkPen("#212121", width=2), name=f"{dev} reported")

    def _draw_timeline(self) -> None:
        self.timeline.clear()
        for sp in self.telemetry.spans:
            y = ROWS.get(sp.name, 3)
            x0 = sp.start_s - self._t0
            color = QColor(SPAN_COLORS.get(sp.name, "#888888"))
            if sp.predicted_s is not None:
                self.timeline.addItem(pg.BarGraphItem(x0=[x0], y=[y], width=[sp.predicted_s], height=0.7,
                                                      brush=None, pen=pg.mkPen(color, width=1, style=Qt.PenStyle.DashLine)))
            self.timeline.addItem(pg.BarGraphItem(x0=[x0], y=[y], width=[max(sp.end_s - sp.start_s, 1e-4)],
                                                  height=0.5, brush=color, pen=pg.mkPen(color)))

    # ------------------------------------------------------------ interaction

    def span_at(self, x: float, y: float) -> TimelineSpan | None:
        for sp in reversed(self.telemetry.spans):
            if abs(ROWS.get(sp.name, 3) - y) < 0.4 and sp.start_s - self._t0 <= x <= sp.end_s - self._t0:
                return sp
        return None

    def _on_mouse_moved(self, pos: QPointF) -> None:
        vb = self.timeline.getPlotItem().vb
        if not self.timeline.sceneBoundingRect().contains(pos):
            return
        p = vb.mapSceneToView(pos)
        sp = self.span_at(p.x(), p.y())
        if sp is not None:
            pred = f", predicted {sp.predicted_s * 1000:.1f} ms" if sp.predicted_s is not None else ""
            self.span_info.setText(f"{sp.name} on {sp.device}: {(sp.end_s - sp.start_s) * 1000:.1f} ms"
                                   f"{pred}, {sp.bytes / 2**20:.1f} MiB {sp.detail}")

    @Slot()
    def _on_save_trace(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Save trace", "ebb-trace.json", "Chrome trace (*.json)")
        if path:
            write_chrome_trace(Path(path), list(self.telemetry.spans))
