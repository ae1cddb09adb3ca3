"""Tune: autotune's runs drawn as they come (tokens/s against layers, a curve per thread
count), and the choice it made."""
from __future__ import annotations

import time
from typing import Any

import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QDialog, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from engine.tune_result import FlashChoice, TuneResult

BEST, CLIFF, BUDGET = "#43a047", "#8e24aa", "#757575"
# one colour per thread count (cycled)
THREAD_COLOURS = ["#42a5f5", "#ff7043", "#66bb6a", "#ab47bc", "#ffca28", "#8d6e63"]


class TuneDialog(QDialog):
    apply_result = Signal(object)  # autotune's result: the window saves each phase's choice
    stop = Signal()
    start = Signal()  # the user asked for the runs (they do not begin when the dialog opens)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Tune layers and threads per phase")
        self.resize(760, 580)
        # layers -> (prompt tok/s by threads, generation tok/s by threads)
        self.points: dict[int, tuple[dict[int, float], dict[int, float]]] = {}
        self._started = time.monotonic()
        self.tuned: TuneResult | None = None
        self.status = QLabel(
            "Tuning loads the model again for each run (usually 10–20 runs), each with another "
            "number of layers on the accelerator, and times a prompt and a reply at several "
            "thread counts. It takes minutes: about ten with a small model on a 2-core machine, "
            "more with a large one. Chat waits until it ends; Stop ends it within seconds and "
            "the model loads again as it was. Start when you are ready.")
        self.status.setWordWrap(True)
        self.gen_plot = self._plot("Generation (tokens/s, one at a time)")
        self.prompt_plot = self._plot("Prompt (tokens/s, one batch)")
        self.prompt_plot.setLabel("bottom", "layers on the accelerator (0: all in RAM)")
        self.curves: dict[tuple[str, int], Any] = {}
        self._marks: list[Any] = []
        self.summary = QLabel("")
        self.summary.setWordWrap(True)
        self.summary.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.start_button = QPushButton("Start")
        self.start_button.clicked.connect(self._on_start)
        self.stop_button = QPushButton("Stop", enabled=False)
        # clicked(bool) would hand `checked` to stop(), which takes nothing: a TypeError per click
        self.stop_button.clicked.connect(lambda _checked=False: self.stop.emit())
        self.apply_button = QPushButton("Use these", enabled=False, clicked=self._on_apply)
        close = QPushButton("Close", clicked=self.reject)
        buttons = QHBoxLayout()
        buttons.addWidget(self.summary, 1)
        for b in (self.start_button, self.stop_button, self.apply_button, close):
            buttons.addWidget(b)
        lay = QVBoxLayout(self)
        lay.addWidget(self.status)
        lay.addWidget(self.gen_plot, 1)
        lay.addWidget(self.prompt_plot, 1)
        lay.addLayout(buttons)

    def _on_start(self) -> None:
        self.start_button.setEnabled(False)
        self.stop_button.setEnabled(True)
        self._started = time.monotonic()
        self.status.setText("Measuring: the first run loads the model…")
        self.start.emit()

    @property
    def running(self) -> bool:
        return bool(self.stop_button.isEnabled())

    @staticmethod
    def _plot(title: str) -> pg.PlotWidget:
        w = pg.PlotWidget(title=title)
        w.showGrid(x=True, y=True, alpha=0.25)
        w.setLabel("left", "tokens/s")
        for axis in ("left", "bottom"):  # plain numbers: no "(x0.001)" beside the axis
            w.getAxis(axis).enableAutoSIPrefix(False)
        w.addLegend(offset=(-10, 10))
        return w

    def _curve(self, phase: str, threads: int) -> Any:
        key = (phase, threads)
        if key not in self.curves:
            n = len({t for _, t in self.curves if _ == phase})
            colour = QColor(THREAD_COLOURS[n % len(THREAD_COLOURS)])
            plot = self.gen_plot if phase == "gen" else self.prompt_plot
            self.curves[key] = plot.plot([], [], pen=pg.mkPen(colour, width=2), symbol="o",
                                         symbolBrush=colour, symbolSize=6,
                                         name=f"{threads} thread{'s' if threads != 1 else ''}")
        return self.curves[key]

    def _redraw(self) -> None:
        xs = sorted(self.points)
        threads = sorted({t for x in xs for by in self.points[x] for t in by})
        for phase, i in (("prompt", 0), ("gen", 1)):
            for t in threads:
                have = [x for x in xs if t in self.points[x][i]]
                self._curve(phase, t).setData(have, [self.points[x][i][t] for x in have])

    def add_point(self, layers: int, prompt_tps: float, gen_tps: float,
                  prompt_by: dict[int, float] | None = None,
                  gen_by: dict[int, float] | None = None, max_layers: int = -1) -> None:
        self.points[layers] = (dict(prompt_by or {0: prompt_tps}), dict(gen_by or {0: gen_tps}))
        self._redraw()
        done = len(self.points)
        elapsed = time.monotonic() - self._started
        progress = f"Run {done}"
        if max_layers >= 0:
            from engine.measure.autotune import planned_runs

            planned = max(planned_runs(max_layers), done)
            left = elapsed / done * (planned - done)
            progress += (f" of about {planned} (a search over 0–{max_layers} layers) · "
                         f"{elapsed:.0f} s so far, about {left:.0f} s left")
        self.status.setText(f"{progress}: {layers} layers → prompt {prompt_tps:.0f} tok/s, "
                            f"generation {gen_tps:.1f} tok/s (each at its best thread count)")

    def note(self, text: str) -> None:
        self.status.setText(text)

    def finish(self, result: TuneResult | None) -> None:
        self.stop_button.setEnabled(False)
        if result is None:
            self.status.setText(f"Stopped after {len(self.points)} runs; nothing changed.")
            return
        self.tuned = result
        for p in result.points:
            self.points[p.layers] = (dict(p.prompt_tps_by_threads) or {0: p.prompt_tps},
                                     dict(p.gen_tps_by_threads) or {0: p.gen_tps})
        self._redraw()
        for plot, best, cliff, threads in (
                (self.gen_plot, result.best_gen_layers, result.cliff_gen_layers, result.best_gen_threads),
                (self.prompt_plot, result.best_prompt_layers, result.cliff_prompt_layers,
                 result.best_prompt_threads)):
            # labels at different heights: best, cliff and budget often share a layer count
            self._mark(plot, best, BEST, f"best {best}" + (f" · {threads} thr" if threads else ""), 0.92)
            if cliff is not None:
                self._mark(plot, cliff, CLIFF, f"cliff {cliff}", 0.72)
            self._mark(plot, result.max_layers, BUDGET, "budget", 0.52, Qt.PenStyle.DashLine)
        n_all = result.max_layers + 1
        searched = sorted({t for p in result.points for t in p.gen_tps_by_threads})
        self.status.setText(
            f"Done: {len(result.points)} runs instead of {n_all} (every count from 0 to "
            f"{result.max_layers}, the most that fit the budget), each at thread counts "
            f"{', '.join(str(t) for t in searched)}.")
        def n_threads(n: int) -> str:
            return f"{n} thread{'' if n == 1 else 's'}"

        gen, prompt = result.point(result.best_gen_layers), result.point(result.best_prompt_layers)
        self.summary.setText(
            f"Generation: {gen.layers} layers, {n_threads(gen.gen_threads)} "
            f"({gen.gen_tps:.2f} tok/s) · prompt: {prompt.layers} layers, "
            f"{n_threads(prompt.prompt_threads)} ({prompt.prompt_tps:.1f} tok/s)"
            + ("" if gen.layers == prompt.layers else
               " · a long prompt moves to its layers when the move pays")
            + (flash_summary(result.flash_attn) if result.flash_attn else "")
            + (f" · {result.load_words()}" if result.load_words() else ""))
        self.apply_button.setEnabled(True)

    def _mark(self, plot: pg.PlotWidget, x: int, color: str, label: str, height: float,
              style: Qt.PenStyle = Qt.PenStyle.SolidLine) -> None:
        line = pg.InfiniteLine(x, angle=90, pen=pg.mkPen(color, width=1, style=style), label=label,
                               labelOpts={"position": height, "color": color})
        plot.addItem(line)
        self._marks.append(line)

    def fail(self, message: str) -> None:
        self.stop_button.setEnabled(False)
        self.status.setText(f"Tuning failed: {message}")

    def _on_apply(self) -> None:
        assert self.tuned is not None
        self.apply_result.emit(self.tuned)
        self.accept()


def flash_summary(fa: FlashChoice) -> str:
    """Tune's line on flash attention: the choice and the turn times it rests on."""
    times = " / ".join(f"{label} {s:.2f} s" for label, s in (("on", fa.turn_s_on),
                                                             ("off", fa.turn_s_off)) if s)
    return (f" · flash attention {'on' if fa.on else 'off'} (a turn with {fa.fill} tokens "
            f"of history: {times}; {fa.reason})")
