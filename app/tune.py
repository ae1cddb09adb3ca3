"""The "Tune layers" dialog: autotune's runs as they come, tokens/s against accelerator layers
with the best and the cliff marked, and a button to use the result."""
from __future__ import annotations

from typing import Any

import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QDialog, QHBoxLayout, QLabel, QPushButton, QVBoxLayout

GEN, PROMPT = QColor("#1e88e5"), QColor("#e53935")


class TuneDialog(QDialog):
    apply_layers = Signal(int)
    stop = Signal()

    def __init__(self, parent: Any = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Tune accelerator layers")
        self.resize(720, 520)
        self.points: dict[int, tuple[float, float]] = {}
        self.result: dict[str, Any] | None = None
        self.status = QLabel("Measuring: each run loads the model with a different number of "
                             "layers on the accelerator and times a prompt and a reply.")
        self.status.setWordWrap(True)
        self.gen_plot = self._plot("Generation (tokens/s, one at a time)")
        self.prompt_plot = self._plot("Prompt (tokens/s, one batch)")
        self.prompt_plot.setLabel("bottom", "layers on the accelerator (0: all in RAM)")
        self.gen_curve = self.gen_plot.plot([], [], pen=pg.mkPen(GEN, width=2), symbol="o",
                                            symbolBrush=GEN, symbolSize=7)
        self.prompt_curve = self.prompt_plot.plot([], [], pen=pg.mkPen(PROMPT, width=2), symbol="o",
                                                  symbolBrush=PROMPT, symbolSize=7)
        self._marks: list[Any] = []
        self.summary = QLabel("")
        self.summary.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.stop_button = QPushButton("Stop", clicked=self.stop.emit)
        self.apply_button = QPushButton("Use best for generation", enabled=False,
                                        clicked=self._on_apply)
        close = QPushButton("Close", clicked=self.reject)
        buttons = QHBoxLayout()
        buttons.addWidget(self.summary, 1)
        for b in (self.stop_button, self.apply_button, close):
            buttons.addWidget(b)
        lay = QVBoxLayout(self)
        lay.addWidget(self.status)
        lay.addWidget(self.gen_plot, 1)
        lay.addWidget(self.prompt_plot, 1)
        lay.addLayout(buttons)

    @staticmethod
    def _plot(title: str) -> pg.PlotWidget:
        w = pg.PlotWidget(title=title)
        w.showGrid(x=True, y=True, alpha=0.25)
        w.setLabel("left", "tokens/s")
        return w

    def _redraw(self) -> None:
        xs = sorted(self.points)
        self.gen_curve.setData(xs, [self.points[x][1] for x in xs])
        self.prompt_curve.setData(xs, [self.points[x][0] for x in xs])

    def add_point(self, layers: int, prompt_tps: float, gen_tps: float) -> None:
        self.points[layers] = (prompt_tps, gen_tps)
        self._redraw()
        self.status.setText(f"Run {len(self.points)}: {layers} layers → prompt {prompt_tps:.0f} "
                            f"tok/s, generation {gen_tps:.1f} tok/s")

    def finish(self, result: dict[str, Any]) -> None:
        self.stop_button.setEnabled(False)
        if result.get("cancelled"):
            self.status.setText(f"Stopped after {len(self.points)} runs; nothing changed.")
            return
        self.result = result
        for p in result["points"]:
            self.points[p["layers"]] = (p["prompt_tps"], p["gen_tps"])
        self._redraw()
        for plot, best, cliff in ((self.gen_plot, result["best_gen_layers"], result["cliff_gen_layers"]),
                                  (self.prompt_plot, result["best_prompt_layers"],
                                   result["cliff_prompt_layers"])):
            self._mark(plot, best, "#43a047", f"best {best}")
            if cliff is not None:
                self._mark(plot, cliff, "#8e24aa", f"cliff {cliff}")
            self._mark(plot, result["max_layers"], "#757575", "budget", Qt.PenStyle.DashLine)
        n_all = result["max_layers"] + 1
        self.status.setText(
            f"Done: {result['n_runs']} runs instead of {n_all} (every count from 0 to "
            f"{result['max_layers']}, the most that fit the budget).")
        self.summary.setText(
            f"Best generation: {result['best_gen_layers']} layers ({result['best_gen_tps']} tok/s); "
            f"best prompt: {result['best_prompt_layers']} layers ({result['best_prompt_tps']} tok/s)")
        self.apply_button.setText(f"Use {result['best_gen_layers']} layers")
        self.apply_button.setEnabled(True)

    def _mark(self, plot: pg.PlotWidget, x: int, color: str, label: str,
              style: Qt.PenStyle = Qt.PenStyle.SolidLine) -> None:
        line = pg.InfiniteLine(x, angle=90, pen=pg.mkPen(color, width=1, style=style), label=label,
                               labelOpts={"position": 0.9, "color": color})
        plot.addItem(line)
        self._marks.append(line)

    def fail(self, message: str) -> None:
        self.stop_button.setEnabled(False)
        self.status.setText(f"Tuning failed: {message}")

    def _on_apply(self) -> None:
        assert self.result is not None
        self.apply_layers.emit(int(self.result["best_gen_layers"]))
        self.accept()
