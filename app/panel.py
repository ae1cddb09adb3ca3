"""The memory panel: residency map, memory over time, pipeline timeline (pyqtgraph).

A view of the Qt-free `engine.telemetry.Telemetry` model, redrawn on a 20 Hz timer only when
the model changed. GUI thread only.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, QRectF, Qt, QTimer, Slot
from PySide6.QtGui import QColor, QPainter, QPaintEvent, QPen
from PySide6.QtWidgets import (
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSizePolicy,
    QToolTip,
    QVBoxLayout,
    QWidget,
)

from engine.events import Span
from engine.telemetry import Telemetry
from engine.trace import ROW_NAMES, ROWS, write_chrome_trace

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
    if where.startswith("RPC"):  # each remote device its own shade of purple
        n = int(where[3:]) if where[3:].isdigit() else 0
        return QColor(["#8e44ad", "#5e3c99", "#c51b7d", "#7b3294"][n % 4])
    if not where:
        return QColor(0, 0, 0, 0)
    return QColor("#2e7d32")  # a local accelerator


class ResidencyMap(QWidget):
    """One cell per layer plus embeddings/output, projector, KV cache and compute buffers."""

    def __init__(self, telemetry: Telemetry, names: dict[str, str] | None = None) -> None:
        super().__init__()
        self.telemetry = telemetry
        self.names = names if names is not None else {}  # device -> what the user calls it
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
        x = 6.0
        remote = next((n for d, n in self.names.items() if d.startswith("RPC")), "remote")
        for name, where in (("accelerator", "GPU"), ("RAM", "CPU"), (remote, "RPC"), ("moving", "moving")):
            p.fillRect(QRectF(x, 46, 10, 10), place_color(where))
            p.setPen(QPen(self.palette().text().color()))
            p.drawText(QPointF(x + 14, 56), name)
            x += 24 + p.fontMetrics().horizontalAdvance(name)
        proj = self.telemetry.projector_device
        p.drawText(QPointF(x + 8, 56), f"projector: {self.names.get(proj, proj) if proj else 'none'}")
        p.end()


class ElidedLabel(QLabel):
    """One line that never asks for more width than it is given: cut with "…" to fit, whole in
    its tooltip."""

    def __init__(self, text: str = "") -> None:
        super().__init__()
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
        self.setMinimumWidth(10)
        self._full = ""
        self.set_full_text(text)

    def set_full_text(self, text: str) -> None:
        self._full = text
        self.setToolTip(text)
        self._elide()

    def full_text(self) -> str:
        return self._full

    def resizeEvent(self, e: Any) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(e)
        self._elide()

    def _elide(self) -> None:
        self.setText(self.fontMetrics().elidedText(self._full, Qt.TextElideMode.ElideRight,
                                                   max(self.width(), 10)))


class MemoryPanel(QWidget):
    """`predicted_only`: a prediction (the What if… dialog): steps drawn as predicted outlines,
    memory not held on to the present."""

    def __init__(self, telemetry: Telemetry, predicted_only: bool = False) -> None:
        super().__init__()
        self.predicted_only = predicted_only
        pal = self.palette()
        pg.setConfigOptions(background=pal.base().color(), foreground=pal.text().color(),
                            antialias=False)
        self.telemetry = telemetry
        self._drawn_version = -1
        self._curves: dict[str, pg.PlotDataItem] = {}
        self._bars: list[pg.BarGraphItem] = []
        self._t0 = time.monotonic()
        self.device_names: dict[str, str] = {}  # e.g. RPC0 -> "stand-in RPC0" (set_device_names)
        self.residency = ResidencyMap(telemetry, self.device_names)
        self._title = "Memory per device: ledger by kind, device reading as a line"
        self.memory_plot = pg.PlotWidget(title=self._title)
        self.memory_plot.setLabel("left", "MiB")
        self.memory_plot.setLabel("bottom", "s")
        legend = self.memory_plot.addLegend(offset=(-4, 4), colCount=2, labelTextSize="7pt")
        legend.setBrush(pg.mkBrush(pal.base().color()))
        self.timeline = pg.PlotWidget(title="Pipeline: predicted steps (dashed)" if predicted_only
                                      else "Pipeline: predicted (dashed) beside measured (filled)")
        self.timeline.setLabel("bottom", "s")
        axis = self.timeline.getAxis("left")
        axis.setTicks([[(y, name) for y, name in ROW_NAMES.items()]])
        self.timeline.setYRange(0.4, 3.6)
        self.timeline.scene().sigMouseMoved.connect(self._on_mouse_moved)
        self.span_info = ElidedLabel("Hover a span for its numbers.")
        save = QPushButton("Save trace…", clicked=self._on_save_trace)
        row = QHBoxLayout()
        row.addWidget(self.span_info, 1)
        row.addWidget(save)
        lay = QVBoxLayout(self)
        lay.addWidget(QLabel("Residency"))
        lay.addWidget(self.residency)
        lay.addWidget(self.memory_plot, 1)
        lay.addWidget(self.timeline, 1)
        self.memory_plot.setMinimumHeight(180)
        self.timeline.setMinimumHeight(180)
        lay.addLayout(row)
        self._timer = QTimer(self, interval=REFRESH_MS)
        self._timer.timeout.connect(self._on_tick)
        self._timer.start()

    @property
    def t0(self) -> float:
        return self._t0

    def set_device_names(self, names: dict[str, str]) -> None:
        """What the user calls a device where the panel names it (legend, curves, steps): the
        stand-in accelerator is named as one, not as the RPC device it is."""
        if names == self.device_names:
            return
        self.device_names.clear()
        self.device_names.update(names)
        for curve in self._curves.values():
            self.memory_plot.removeItem(curve)
        self._curves.clear()
        self._drawn_version = -1

    def _name(self, device: str) -> str:
        return self.device_names.get(device, device)

    def set_telemetry(self, telemetry: Telemetry) -> None:
        """Show another model (the What if… dialog's next prediction)."""
        self.telemetry = telemetry
        self.residency.telemetry = telemetry
        for curve in self._curves.values():
            curve.setData([], [])
        self._drawn_version = -1

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
        """Stacked ledger by kind per device, and the device's own reading; curves are reused
        (setData), not rebuilt, so a redraw stays in the low milliseconds."""
        devices = [d for d, series in self.telemetry.memory.items() if series and d != "CPU"]
        if not devices and self.telemetry.memory.get("CPU"):
            devices = ["CPU"]  # no accelerator: show what sits in RAM
        if devices and not self.predicted_only:
            title = (f"Memory on {', '.join(self._name(d) for d in devices)}: ledger by kind, "
                     "device reading as a line")
            if title != self._title:
                self._title = title
                self.memory_plot.setTitle(title)
        for dev in devices:
            series = list(self.telemetry.memory[dev])
            if not self.predicted_only:
                series.append((time.monotonic(), series[-1][1], None))  # hold the last reading to now
            xs = np.fromiter((t - self._t0 for t, _, _ in series), float, len(series))
            if len(devices) > 1:  # several devices: one line each (stacks would hide each other)
                total = np.fromiter((sum(s.values()) for _, s, _ in series), float, len(series)) / 2**20
                line = self._curve(f"{self._name(dev)} total", place_color(dev), fill=False)
                line.setData(xs, total)
                continue
            cumulative = np.zeros(len(series))
            stacks = []
            for kind in KIND_COLORS:
                ys = np.fromiter((s.get(kind, 0) for _, s, _ in series), float, len(series)) / 2**20
                if ys.any():
                    cumulative = cumulative + ys
                    stacks.append((kind, cumulative))
            order = list(KIND_COLORS)
            for kind, ys in stacks:  # each fill reaches down to 0: lower kinds drawn on top
                label = kind if len(devices) == 1 else f"{self._name(dev)} {kind}"
                curve = self._curve(label, QColor(KIND_COLORS[kind]), fill=True)
                curve.setZValue(len(order) - order.index(kind))
                curve.setData(xs, ys)
            reported = [(t - self._t0, r / 2**20) for t, _, r in series if r is not None]
            if reported:
                line = self._curve(f"{self._name(dev)} reading", self.palette().text().color(), fill=False)
                line.setZValue(len(KIND_COLORS) + 1)
                line.setData([x for x, _ in reported], [y for _, y in reported])

    def _curve(self, label: str, color: QColor, fill: bool) -> pg.PlotDataItem:
        if label not in self._curves:
            kw = {"fillLevel": 0, "brush": color} if fill else {}
            self._curves[label] = self.memory_plot.plot([], [], pen=pg.mkPen(color, width=1 if fill else 2),
                                                        name=label, **kw)
        return self._curves[label]

    def _draw_timeline(self) -> None:
        """Two bar items per kind of step (measured, predicted), rebuilt from arrays."""
        for item in self._bars:
            self.timeline.removeItem(item)
        self._bars = []
        by_name: dict[str, list[Span]] = {}
        for sp in self.telemetry.spans:
            by_name.setdefault(sp.name, []).append(sp)
        for name, spans in by_name.items():
            color = QColor(SPAN_COLORS.get(name, "#888888"))
            y = [ROWS.get(name, 3)] * len(spans)
            x0 = [sp.start_s - self._t0 for sp in spans]
            width = [max(sp.end_s - sp.start_s, 1e-4) for sp in spans]
            pred = [(x, sp.predicted_s) for x, sp in zip(x0, spans) if sp.predicted_s is not None]
            if pred:
                self._bars.append(pg.BarGraphItem(
                    x0=[x for x, _ in pred], y=[y[0]] * len(pred), width=[w for _, w in pred],
                    height=0.7, brush=None, pen=pg.mkPen(color, style=Qt.PenStyle.DashLine)))
            if not self.predicted_only:
                self._bars.append(pg.BarGraphItem(x0=x0, y=y, width=width, height=0.5, brush=color,
                                                  pen=pg.mkPen(color)))
        for item in self._bars:
            self.timeline.addItem(item)

    # ------------------------------------------------------------ interaction

    def span_at(self, x: float, y: float) -> Span | None:
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
            who = self.telemetry.labels.get(sp.request_id)
            text = (f"{sp.name}{f' for {who}' if who else ''} on {self._name(sp.device)}: "
                    f"{(sp.end_s - sp.start_s) * 1000:.1f} ms{pred}, {sp.bytes / 2**20:.1f} MiB "
                    f"{sp.detail}").strip()
            # the whole text in a tooltip at the pointer; the line under the plot is cut to its
            # width (a long text used to widen the panel and squeeze the chat to ~150 px)
            self.span_info.set_full_text(text)
            view = self.timeline.mapFromScene(pos)
            QToolTip.showText(self.timeline.mapToGlobal(view), text, self.timeline)

    @Slot()
    def _on_save_trace(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Save trace", "ebb-trace.json", "Chrome trace (*.json)")
        if path:
            write_chrome_trace(Path(path), list(self.telemetry.spans))
