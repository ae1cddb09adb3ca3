"""The "What if…" dialog: a model on an accelerator you may not own, predicted by the planner
and drawn with the live panel's own widgets (residency map, memory, pipeline timeline)."""
from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any

from PySide6.QtCore import QTimer, Slot
from PySide6.QtWidgets import (
    QWidget,
    QComboBox,
    QDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QVBoxLayout,
)

from app.widgets.panel import MemoryPanel
from app.core.settings import DEMO
from engine import events
from engine.errors import EbbError
from engine.telemetry import Telemetry

_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="whatif")


def predict(model: str, mmproj: str, vram: str, bus: str, ctx: int) -> dict[str, Any]:
    """Any thread but llama.cpp's: reads headers only."""
    from engine.gguf.info import inspect_files
    from engine.models.default import existing_file, resolve_model_path
    from engine.synth.demo import default_projector_path
    from engine.config import default_threads
    from engine.placement import calibration as calibrate
    from engine.placement.whatif import parse_bus, what_if
    from engine.units import parse_size

    model_path = resolve_model_path(model)
    proj = (default_projector_path(model_path) if mmproj == DEMO
            else existing_file(mmproj, "projector") if mmproj else None)
    ins = inspect_files(model_path, proj)
    n_ctx = ins.model.fit_context(ctx)
    w = what_if(ins.model, ins.projector, parse_size(vram), parse_bus(bus), 40e9, 300e9, n_ctx,
                default_threads(None), calibrate.load("CPU"))
    return {"what_if": w, "out": w.to_dict(), "model": ins.model, "n_ctx": n_ctx}


def feed(telemetry: Telemetry, r: dict[str, Any], t0: float) -> None:
    """Turn a prediction into the events the live panel draws: where each part sits, the
    memory on the device through the vision turn, and each predicted step."""
    w, out = r["what_if"], r["out"]
    p = w.placement
    accel = p.accel or "GPU"
    kinds = dict(p.accel_bytes)
    ledger = {accel: kinds}
    proj = "RAM" if out["vision_auto"] else ""
    telemetry.on_event(events.Residency(0, layer_devices=p.layer_devices, output_device=p.output_device,
                                        embeddings_device=p.embeddings_device,
                                        projector_device=proj, ledger=ledger, t_s=t0))
    t = t0
    now = dict(kinds)
    for step in (w.vision_plan.steps if w.vision_plan else ()):
        if step.name == "evict":
            now["weights"] = now.get("weights", 0) - step.bytes
        elif step.name == "load_projector":
            now["projector"] = step.bytes
        telemetry.on_event(events.MemorySample(0, device=accel, ledger_bytes=sum(now.values()),
                                               reported_used_bytes=None, ledger_kinds=dict(now), t_s=t))
        telemetry.on_event(events.Span(0, name=step.name, start_s=t, end_s=t + step.predicted_s,
                                       device=step.device, bytes=step.bytes,
                                       predicted_s=step.predicted_s, t_s=t))
        t += step.predicted_s
        if step.name == "free_projector":
            now.pop("projector", None)
        elif step.name == "restore":
            now["weights"] = kinds.get("weights", 0)
        telemetry.on_event(events.MemorySample(0, device=accel, ledger_bytes=sum(now.values()),
                                               reported_used_bytes=None, ledger_kinds=dict(now), t_s=t))


class WhatIfDialog(QDialog):
    def __init__(self, model: str, mmproj: str, ctx: int, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("What if…")
        self.resize(820, 760)
        self.model, self.ctx = QLineEdit(model), ctx
        self.mmproj = QLineEdit(mmproj, placeholderText="none")
        self.vram = QLineEdit("8GiB")
        self.bus = QComboBox()
        self.bus.addItems(["pcie3", "pcie4", "pcie5"])
        self.bus.setCurrentText("pcie4")
        go = QPushButton("Predict", clicked=self.run, default=True)
        form = QFormLayout()
        form.addRow("Model (GGUF, header only)", self.model)
        form.addRow("Projector", self.mmproj)
        row = QHBoxLayout()
        row.addWidget(QLabel("Accelerator memory"))
        row.addWidget(self.vram)
        row.addWidget(QLabel("bus"))
        row.addWidget(self.bus)
        row.addWidget(go)
        self.summary = QLabel("Predicts placement, memory, tokens/s and the vision turn from the "
                              "model's header and this machine's calibration (ebb-engine calibrate).")
        self.summary.setWordWrap(True)
        self.summary.setMinimumHeight(self.summary.fontMetrics().lineSpacing() * 4)
        self.telemetry = Telemetry()
        self.panel = MemoryPanel(self.telemetry, predicted_only=True)
        lay = QVBoxLayout(self)
        lay.addLayout(form)
        lay.addLayout(row)
        lay.addWidget(self.summary)
        lay.addWidget(self.panel, 1)
        self._future: concurrent.futures.Future[dict[str, Any]] | None = None
        self._poll = QTimer(self, interval=30, timeout=self._check)
        self.prediction: dict[str, Any] | None = None

    @Slot()
    def run(self) -> None:
        if self._future is not None:
            return
        self.summary.setText("Reading the header…")
        self._future = _pool.submit(predict, self.model.text().strip(), self.mmproj.text().strip(),
                                    self.vram.text().strip(), self.bus.currentText(), self.ctx)
        self._poll.start()

    @Slot()
    def _check(self) -> None:
        f = self._future
        if f is None or not f.done():
            return
        self._poll.stop()
        self._future = None
        try:
            r = f.result()
        except (EbbError, OSError) as exc:  # a bad path, size or file: say so
            self.summary.setText(f"Cannot predict: {exc}")
            return
        self.prediction = r
        out, m = r["out"], r["model"]
        self.telemetry = Telemetry()
        self.panel.set_telemetry(self.telemetry)
        feed(self.telemetry, r, self.panel.t0)
        self.panel.poke()
        cal = out["calibrated"]
        lines = [
            f"{Path(m.path).name}: {out['n_layers_on_accel']}/{m.n_layers} layers on a "
            f"{self.vram.text()} accelerator ({out['accel_total_bytes'] / 2**30:.2f} GiB), "
            f"{out['ram_weight_bytes'] / 2**30:.2f} GiB of weights in RAM, context {r['n_ctx']}.",
            f"Text: ~{out['gen_tokens_per_s']} tokens/s generated "
            + ("(RAM side calibrated on this machine)" if cal["cpu"] else "(uncalibrated)") + ".",
        ]
        if out["vision_predicted_s"]:
            lines.append("Vision per image: " + ", ".join(
                f"{k} {v:.2f}s" if v is not None else f"{k} does not fit"
                for k, v in out["vision_predicted_s"].items()) + f"; auto picks {out['vision_auto']}.")
        if out.get("phases"):
            from engine.placement.whatif import phases_line

            line = phases_line(out["phases"])
            lines.append(line[0].upper() + line[1:] + ".")
        self.summary.setText("\n".join(lines))
