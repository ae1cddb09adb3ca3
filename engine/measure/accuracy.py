"""`ebb-engine bench calibrate`: how close `plan`'s calibrated predictions come to measured runs.

Prediction accuracy is a measurement, not a test: a busy machine moves the measured side. This
benchmark prints each quantity predicted and measured with their ratio (predicted / measured):
text speed at a placement calibration never ran (a budget holding about half the layers), and
the vision swap's steps at the session's budget. Each measured side is the faster of two runs,
as calibration measures (a busy machine only ever adds time). Uses this machine's calibration
(`ebb-engine calibrate` first, or `--recalibrate`). Engine thread.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable

from engine.config import SessionConfig
from engine.errors import EbbError
from engine.gguf.info import inspect_files
from engine.llama.devices import find_device, pick_accelerator
from engine.measure.autotune import Measurer
from engine.measure.calibrate import run_calibration
from engine.placement import calibration
from engine.placement.plan import CPU
from engine.placement.whatif import what_if
from engine.session import Session
from engine.media.images import write_noise_picture

VISION_STEPS = ("evict", "load_projector", "encode", "free_projector", "restore")


def _ratio(predicted: float | None, measured: float) -> dict[str, Any]:
    return {"predicted": predicted, "measured": round(measured, 4),
            "ratio": round(predicted / measured, 3) if predicted and measured else None}


def bench_calibrate(model_path: Path, mmproj_path: Path, rpc: tuple[str, ...], budget: int,
                    text_budget: int, n_ctx: int, n_threads: int, recalibrate: bool = False,
                    log: Callable[[str], None] | None = None) -> dict[str, Any]:
    say = log or (lambda msg: None)
    accel = pick_accelerator(rpc)
    if accel is None:
        raise EbbError("bench calibrate needs an accelerator", "pass --rpc HOST:PORT or use a GPU")
    dev = find_device(accel)
    key = calibration.device_key(dev.name, dev.description)
    cpu_cal, acc_cal = calibration.load(CPU), calibration.load(key)
    if recalibrate or cpu_cal is None or acc_cal is None:
        say(f"calibrating {key} first")
        run_calibration(model_path, mmproj_path, rpc, budget, n_ctx, n_threads, log=say)
        cpu_cal, acc_cal = calibration.load(CPU), calibration.load(key)
    assert cpu_cal is not None and acc_cal is not None
    ins = inspect_files(model_path, mmproj_path)

    def predict(vram: int) -> dict[str, Any]:
        return what_if(ins.model, ins.projector, vram, acc_cal.bus_Bps or 1e9, 40e9, 300e9, n_ctx,
                       n_threads, cpu_cal, acc_cal, accel, can_stream=not dev.remote).to_dict()

    text = predict(text_budget)
    k = int(text["n_gpu_layers"])
    m = Measurer(model_path, ins.model, accel, n_ctx, n_threads, live=True,
                 threads=(n_threads,) if n_threads else None)
    runs = [m.measure(k), m.measure(k)]
    say(f"text at {k} layers: measured")
    vision = predict(budget)
    cfg = SessionConfig(model_path, mmproj_path, n_ctx=n_ctx, n_threads=n_threads,
                        vram_budget_bytes=budget, vision="swap", rpc=rpc)
    steps = []
    with tempfile.TemporaryDirectory() as tmp, Session(cfg) as s:
        pic = write_noise_picture(Path(tmp) / "bench.png", seed=7)
        s.encode_only([pic])  # first use: warms the projector's code paths
        for _ in range(2):
            res = s.encode_only([pic])
            steps.append({sp.name: sp.end_s - sp.start_s for sp in res.spans
                          if sp.name in VISION_STEPS})
    fastest = min(steps, key=lambda st: sum(st.values()))
    return {
        "device": key, "text_layers": k, "text_budget_bytes": text_budget,
        "gen_tokens_per_s": _ratio(text["gen_tokens_per_s"], max(r.gen_tps for r in runs)),
        "prompt_tokens_per_s": _ratio(text["prompt_tokens_per_s"], max(r.prompt_tps for r in runs)),
        "vision_swap_s": _ratio(vision["vision_predicted_s"]["swap"], sum(fastest.values())),
        "vision_steps_ms": {name: [round(st.get(name, 0.0) * 1000, 1) for st in steps]
                            for name in VISION_STEPS},
    }
