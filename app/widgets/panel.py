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
from PySide6.QtCore import QEvent, QPointF, QRectF, QSize, Qt, QTimer, Slot
from PySide6.QtGui import QColor, QHelpEvent, QPainter, QPaintEvent, QPen, QResizeEvent, QShowEvent
from PySide6.QtWidgets import (
    QCheckBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSizePolicy,
    QToolTip,
    QVBoxLayout,
    QWidget,
)

from app.widgets.start_folder import start_file
from engine.events import Span
from engine.telemetry import Cell, Telemetry
from engine.trace import ROW_NAMES, row_names, row_of, write_chrome_trace

# the map and the steps follow the engine's events within this: a change starts a single
# shot (a timer that polled every 100 ms was a call into Python and a wake of the GUI thread
# ten times a second, taken from llama.cpp's threads while a reply streams: #54)
REFRESH_MS = 100
# while a reply runs and nothing else changes, the memory line reaches on to now this often (a
# redraw costs the GUI thread 5-8 ms, both plots when the view moves on: 0.3 % of a core; every
# 4 s left the view seconds behind the reply for a gain the stream bench could not see, #54)
LIVE_REDRAW_S = 2.0
LEGEND_HEADROOM = 1.6  # the memory plot's height over its highest value: the legend's room
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
    """One cell per layer plus embeddings/output, projector, KV cache and compute buffers.

    The named cells (embd, out, proj, KV, comp) are as wide as their names; the layers share
    the rest. Layer numbers are in the cells where every one fits, else on a scale below (every
    k-th layer), so every name is readable at any width; each cell has a tooltip."""

    CELL_TOP, CELL_H, SCALE_H = 6.0, 30.0, 12.0
    SCALE_STEPS = (1, 2, 5, 10, 20, 50, 100, 200, 500)

    def __init__(self, telemetry: Telemetry, names: dict[str, str] | None = None) -> None:
        super().__init__()
        self.telemetry = telemetry
        self.names = names if names is not None else {}  # device -> what the user calls it
        self.setMinimumHeight(int(self.CELL_TOP + self.CELL_H + self.SCALE_H + 24))
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def _rects(self) -> list[tuple[QRectF, Cell]]:
        cells = self.telemetry.cells() if self.telemetry.layer_devices else []
        if not cells:
            return []
        metrics = self.fontMetrics()
        avail = max(1.0, self.width() - 8.0)
        named = [c for c in cells if not c.key.startswith("layer ")]
        n_layers = len(cells) - len(named)
        uniform = max(3.0, avail / len(cells))
        named_w = {c.key: metrics.horizontalAdvance(c.label) + 8.0 for c in named}
        if all(w <= uniform for w in named_w.values()) or sum(named_w.values()) + n_layers * 3.0 > avail:
            layer_w, named_w = uniform, dict.fromkeys(named_w, uniform)  # all alike
        else:  # the named cells as wide as their names, the layers share the rest
            layer_w = (avail - sum(named_w.values())) / max(n_layers, 1)
        out, x = [], 4.0
        for c in cells:
            w = named_w.get(c.key, layer_w)
            out.append((QRectF(x, self.CELL_TOP, w - 2, self.CELL_H), c))
            x += w
        return out

    def layer_scale_step(self, rects: list[tuple[QRectF, Cell]]) -> int:
        """1: every layer's number fits in its cell; k: the scale below names every k-th."""
        layers = [r for r, c in rects if c.key.startswith("layer ")]
        if not layers:
            return 1
        widest = self.fontMetrics().horizontalAdvance(str(len(layers) - 1)) + 4
        cell = layers[0].width() + 2
        return next((k for k in self.SCALE_STEPS if k * cell >= widest), self.SCALE_STEPS[-1])

    def paintEvent(self, event: QPaintEvent) -> None:
        rects = self._rects()
        if not rects:
            return
        p = QPainter(self)
        metrics = p.fontMetrics()
        step = self.layer_scale_step(rects)
        text_pen = QPen(self.palette().text().color())
        for r, cell in rects:
            color = place_color(cell.where)
            if not cell.where:  # not there (no projector, a buffer since freed): an outline
                p.setPen(QPen(self.palette().mid().color()))
                p.drawRect(r)
            else:
                p.fillRect(r, color)
            is_layer = cell.key.startswith("layer ")
            if is_layer and step > 1:  # the number goes on the scale below
                i = int(cell.label)
                if i % step == 0:
                    p.setPen(text_pen)
                    p.drawLine(QPointF(r.left(), r.bottom() + 1), QPointF(r.left(), r.bottom() + 4))
                    p.drawText(QPointF(r.left(), r.bottom() + 3 + metrics.ascent()), cell.label)
                continue
            # dark on light, light on dark
            if metrics.horizontalAdvance(cell.label) <= r.width() - 2:
                light = cell.where and color.lightnessF() < 0.55
                p.setPen(QPen(QColor("#ffffff")) if light else text_pen)
                p.drawText(r, Qt.AlignmentFlag.AlignCenter, cell.label)
        x = 6.0
        y = self.CELL_TOP + self.CELL_H + self.SCALE_H + 4
        remote = next((n for d, n in self.names.items() if d.startswith("RPC")), "remote")
        for name, where in (("accelerator", "GPU"), ("RAM", "CPU"), (remote, "RPC"), ("moving", "moving")):
            p.fillRect(QRectF(x, y, 10, 10), place_color(where))
            p.setPen(text_pen)
            p.drawText(QPointF(x + 14, y + 10), name)
            x += 24 + metrics.horizontalAdvance(name)
        proj = self.telemetry.projector_device
        p.drawText(QPointF(x + 8, y + 10), f"projector: {self.names.get(proj, proj) if proj else 'none'}")
        p.end()

    def cell_at(self, pos: QPointF) -> Cell | None:
        return next((c for r, c in self._rects() if r.contains(pos)), None)

    def tooltip_for(self, cell: Cell) -> str:
        where = {"CPU": "RAM", "": "not loaded"}.get(cell.where, self.names.get(cell.where, cell.where))
        size = f", {cell.n_bytes / 2**20:.1f} MiB" if cell.n_bytes else ""
        since = ""
        if cell.since_s is not None and cell.where:
            since = f", there for {max(0.0, time.monotonic() - cell.since_s):.1f} s"
        return f"{cell.name}: {where}{size}{since}"

    def event(self, e: QEvent) -> bool:
        if isinstance(e, QHelpEvent) and e.type() == QEvent.Type.ToolTip:
            cell = self.cell_at(QPointF(e.pos()))
            if cell is not None:
                QToolTip.showText(e.globalPos(), self.tooltip_for(cell), self)
            else:
                QToolTip.hideText()
            return True
        return super().event(e)


def span_key_html() -> str:
    """The timeline's colours, named."""
    return " ".join(f'<span style="color:{c}">■</span>&nbsp;{n.replace("_", " ")}'
                    for n, c in SPAN_COLORS.items()
                    if n not in ("restore_state",)) + " · dashed: predicted"


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

    def text(self) -> str:
        """The whole text (what is shown may be cut: `shown()`)."""
        return self._full

    def shown(self) -> str:
        return super().text()

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt's name
        """The whole text's width: a layout that can give it gets it all, else it is cut."""
        return QSize(self.fontMetrics().horizontalAdvance(self._full) + 8, super().sizeHint().height())

    def resizeEvent(self, e: QResizeEvent) -> None:  # noqa: N802 - Qt's name
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
        # short titles: a plot's title sets its minimum width (long ones pushed the panel past
        # the window's edge); the details are in the tooltips
        self._title = "Memory per device"
        self.memory_plot = pg.PlotWidget(title=self._title)
        self.memory_plot.setLabel("left", "MiB")
        self.memory_plot.setLabel("bottom", "s")
        legend = self.memory_plot.addLegend(offset=(-4, 4), colCount=3, labelTextSize="7pt")
        legend.setBrush(pg.mkBrush(pal.base().color()))
        self.timeline = pg.PlotWidget(title="Steps (predicted)" if predicted_only
                                      else "Steps: predicted ▭ measured ▬")
        self.memory_plot.setToolTip("What Ebb put on the device, stacked by kind (its ledger); "
                                    "a line: the device's own reading, where it has one")
        self.timeline.setToolTip("Each step of a request: dashed outline, predicted; filled, "
                                 "measured. Hover a step for its numbers; the wheel zooms time")
        self.timeline.setLabel("bottom", "s")
        for plot in (self.memory_plot, self.timeline):  # seconds, never "s (x0.001)"
            plot.getAxis("bottom").enableAutoSIPrefix(False)
        axis = self.timeline.getAxis("left")
        axis.setTicks([[(y, name) for y, name in ROW_NAMES.items()]])
        self.timeline.setYRange(0.4, 3.6)
        self._row_names = dict(ROW_NAMES)  # with a row per request beside the session's
        # the wheel and a drag zoom and pan time only (lanes stay), on both plots at once
        self.timeline.getPlotItem().vb.setMouseEnabled(x=True, y=False)
        self.memory_plot.getPlotItem().vb.setMouseEnabled(x=True, y=False)
        self.timeline.setXLink(self.memory_plot)
        self.memory_plot.getPlotItem().vb.sigRangeChangedManually.connect(self._on_user_zoom)
        self.timeline.getPlotItem().vb.sigRangeChangedManually.connect(self._on_user_zoom)
        self.timeline.scene().sigMouseMoved.connect(self._on_mouse_moved)
        self.span_info = ElidedLabel("Hover a span for its numbers.")
        self.key = QLabel(span_key_html(), wordWrap=True)  # which colour is which step
        self.key.setTextFormat(Qt.TextFormat.RichText)
        self.key.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Minimum)
        self.whole = QCheckBox("Whole session", toolTip="Show every request; unticked, the plots "
                               "follow the latest request")
        self.whole.toggled.connect(self._on_whole_toggled)
        save = QPushButton("Save trace…", clicked=self._on_save_trace)
        row = QHBoxLayout()
        row.addStretch(1)
        row.addWidget(self.whole)
        row.addWidget(save)
        lay = QVBoxLayout(self)
        lay.addWidget(QLabel("Residency"))
        lay.addWidget(self.residency)
        lay.addWidget(self.memory_plot, 1)
        lay.addWidget(self.timeline, 1)
        lay.addWidget(self.key)
        lay.addWidget(self.span_info)  # a line of its own: the buttons never squeeze it away
        self.memory_plot.setMinimumHeight(180)
        self.timeline.setMinimumHeight(180)
        lay.addLayout(row)
        self._followed: tuple[int, float, float] | None = None  # (request, start, end) shown
        self.live_since: float | None = None  # when the running request was sent (set_live)
        self._live_drawn_at = 0.0
        self._user_zoomed = False
        self._timer = QTimer(self, interval=REFRESH_MS, singleShot=True)  # started by poke()
        self._timer.timeout.connect(self._on_tick)
        self._live_timer = QTimer(self, interval=int(LIVE_REDRAW_S * 1000))  # while a reply runs
        self._live_timer.timeout.connect(self._on_tick)
        self.poke()

    def poke(self) -> None:
        """Something the panel shows may have changed (an engine event, a setting): drawn
        within REFRESH_MS, several changes meanwhile at once."""
        if self.telemetry.version != self._drawn_version and not self._timer.isActive():
            self._timer.start()

    def draw_now(self) -> None:
        """Draw what is pending at once rather than within REFRESH_MS: a model that finished
        loading is drawn before a message can be sent (the first draw makes the plots' curves
        and legend, ~15 ms; drawn in the first reply it took the GIL from its tokens, #54)."""
        if self._timer.isActive():
            self._timer.stop()
            self._on_tick()

    def showEvent(self, e: QShowEvent) -> None:
        super().showEvent(e)
        self.poke()  # what changed while hidden was not drawn

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
        self.poke()

    def _name(self, device: str) -> str:
        return self.device_names.get(device, device)

    def set_telemetry(self, telemetry: Telemetry) -> None:
        """Show another model (the What if… dialog's next prediction)."""
        self.telemetry = telemetry
        self.residency.telemetry = telemetry
        for curve in self._curves.values():
            curve.setData([], [])
        self._drawn_version = -1
        self.poke()

    # ------------------------------------------------------------ drawing

    @Slot()
    def _on_tick(self) -> None:
        if not self.isVisible():
            return
        # nothing new: nothing to draw, unless a reply runs (its memory line reaches to now,
        # at the live timer: every LIVE_REDRAW_S is enough for a line that holds still while a
        # reply is decoded, and the stream has the GUI thread meanwhile)
        now = time.monotonic()
        changed = self.telemetry.version != self._drawn_version
        if not changed and (self.live_since is None or now - self._live_drawn_at < LIVE_REDRAW_S / 2):
            return
        self._live_drawn_at = now
        if changed:  # the map and the steps moved; otherwise only the memory line reaches on
            self._drawn_version = self.telemetry.version
            self.residency.update()
            self._draw_timeline()
        self._draw_memory()
        self._follow()

    # ------------------------------------------------------------ what the plots show

    def latest_request_range(self) -> tuple[int, float, float] | None:
        """(request, start, end) of the newest request's steps, in the plots' seconds."""
        spans = self.telemetry.spans
        if not spans:
            return None
        rid = spans[-1].request_id
        # the trailing run of its steps only: a reloaded model counts requests from 1 again,
        # and every earlier "request 1" made the view 0–530 s after a stand-in's reload
        mine = []
        for sp in reversed(spans):
            if sp.request_id != rid:
                break
            mine.append(sp)
        return (rid, min(sp.start_s for sp in mine) - self._t0,
                max(sp.end_s for sp in mine) - self._t0)

    def _follow(self) -> None:
        """Unless "Whole session" is ticked, the plots show the latest request (a swap fills
        the view, not a sliver of the session). A zoom by hand holds until the next request."""
        if self.predicted_only:
            return
        vb = self.memory_plot.getPlotItem().vb
        latest = self.latest_request_range()
        if self.whole.isChecked() or latest is None:
            if self.whole.isChecked():
                vb.enableAutoRange(x=True)
            return
        rid, start, end = latest
        if self.live_since is not None:  # a reply is running: the view grows with it to now
            sent = self.live_since - self._t0
            if end < sent:  # the steps shown are an earlier request's: from when this one went
                start = sent
            end = max(end, time.monotonic() - self._t0)
        if self._followed is not None and self._followed[:2] != (rid, start):
            self._user_zoomed = False  # a new request: follow again
        if self._user_zoomed or self._followed == (rid, start, end):
            return
        pad = max(0.05, (end - start) * 0.08)
        if self.live_since is not None:
            # a running reply's view reaches ahead of it as far again as it has run, at least
            # two live redraws, and moves only when the reply gets there: a move lays out and
            # repaints both plots (7-8 ms of the GUI thread against 1 ms for the line alone),
            # and reaching half again moved it at every other redraw (#54)
            if self._followed is not None and self._followed[:2] == (rid, start) and end <= self._followed[2]:
                return
            self._followed = (rid, start, end + max(2 * LIVE_REDRAW_S, end - start))
            vb.setXRange(start - pad, self._followed[2], padding=0)
            return
        self._followed = (rid, start, end)
        vb.setXRange(start - pad, end + pad, padding=0)

    def set_live(self, live: bool) -> None:
        """The window sent a message (True) or its reply ended: while one runs, the plots follow
        it to now (the x axis stood still through a long reply)."""
        self.live_since = time.monotonic() if live else None
        self._drawn_version = -1
        (self._live_timer.start if live else self._live_timer.stop)()
        self.poke()

    def _on_user_zoom(self, *_: Any) -> None:
        self._user_zoomed = True

    def _on_whole_toggled(self, whole: bool) -> None:
        self._user_zoomed = False
        self._followed = None
        self._drawn_version = -1
        self.poke()

    def _draw_memory(self) -> None:
        """Stacked ledger by kind per device, and the device's own reading; curves are reused
        (setData), not rebuilt, so a redraw stays in the low milliseconds."""
        devices = [d for d, series in self.telemetry.memory.items() if series and d != "CPU"]
        if not devices and self.telemetry.memory.get("CPU"):
            devices = ["CPU"]  # no accelerator: show what sits in RAM
        if devices and not self.predicted_only:
            title = f"Memory on {', '.join(self._name(d) for d in devices)}"
            if title != self._title:
                self._title = title
                self.memory_plot.setTitle(title)
        top = 0.0
        for dev in devices:
            series = list(self.telemetry.memory[dev])
            if not self.predicted_only:
                series.append((time.monotonic(), series[-1][1], None))  # hold the last reading to now
            xs = np.fromiter((t - self._t0 for t, _, _ in series), float, len(series))
            if len(devices) > 1:  # several devices: one line each (stacks would hide each other)
                total = np.fromiter((sum(s.values()) for _, s, _ in series), float, len(series)) / 2**20
                line = self._curve(f"{self._name(dev)} total", place_color(dev), fill=False)
                line.setData(xs, total)
                top = max(top, float(total.max(initial=0.0)))
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
                words = kind.replace("_", " ")  # "projector compute", as a user reads it
                label = words if len(devices) == 1 else f"{self._name(dev)} {words}"
                curve = self._curve(label, QColor(KIND_COLORS[kind]), fill=True)
                curve.setZValue(len(order) - order.index(kind))
                curve.setData(xs, ys)
            top = max(top, float(cumulative.max(initial=0.0)))
            reported = [(t - self._t0, r / 2**20) for t, _, r in series if r is not None]
            if reported:
                line = self._curve(f"{self._name(dev)} reading", self.palette().text().color(), fill=False)
                line.setZValue(len(KIND_COLORS) + 1)
                line.setData([x for x, _ in reported], [y for _, y in reported])
                top = max(top, max(y for _, y in reported))
        if top > 0:  # room above the data for the legend: it never covers a curve
            self.memory_plot.setYRange(0, top * LEGEND_HEADROOM, padding=0)

    def _curve(self, label: str, color: QColor, fill: bool) -> pg.PlotDataItem:
        if label not in self._curves:
            kw = {"fillLevel": 0, "brush": color} if fill else {}
            # steps: a reading holds until the next one (straight lines drew a swap as a slow
            # wedge and a reload as memory falling for minutes)
            self._curves[label] = self.memory_plot.plot([], [], pen=pg.mkPen(color, width=1 if fill else 2),
                                                        name=label, stepMode="left", **kw)
        return self._curves[label]

    def _draw_timeline(self) -> None:
        """Two bar items per kind of step (measured, predicted), rebuilt from arrays."""
        for item in self._bars:
            self.timeline.removeItem(item)
        self._bars = []
        by_row: dict[tuple[str, int], list[Span]] = {}
        for sp in self.telemetry.spans:
            by_row.setdefault((sp.name, row_of(sp)), []).append(sp)
        names = row_names(self.telemetry.spans)  # a lane per request beside the session's
        if names != self._row_names:
            self._row_names = names
            self.timeline.getAxis("left").setTicks([[(y, n) for y, n in names.items()]])
            self.timeline.setYRange(0.4, max(names) + 0.6)
        for (name, row), spans in by_row.items():
            color = QColor(SPAN_COLORS.get(name, "#888888"))
            y = [row] * len(spans)
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
            if abs(row_of(sp) - y) < 0.4 and sp.start_s - self._t0 <= x <= sp.end_s - self._t0:
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
        path, _ = QFileDialog.getSaveFileName(self, "Save trace", start_file("ebb-trace.json"),
                                              "Chrome trace (*.json)")
        if path:
            write_chrome_trace(Path(path), list(self.telemetry.spans))
