"""Calibration: this machine's measured costs, stored per device, for `plan` and the sessions.
The measuring runs are `engine.measure.calibrate`; this module is the model and the store.

A text token costs time on each device in proportion to the weight bytes it reads there, plus,
when any layer is on an accelerator, a fixed cost per graph split (round trips, syncs):

    s_per_token(k) = cpu_bytes(k) * cpu.s_per_byte + accel_bytes(k) * accel.s_per_byte
                     + (k > 0) * accel.split_s

separately for generation (one token at a time) and prompt (per token of one batch). Five
placements, each measured twice (the faster counts), fix it: k = 0 (CPU alone), then k = 1 (the output layer only: mostly the split
cost), a third, two thirds and all of the layers that fit, fitted by least squares. The vision
side stores the bus bandwidth (timed tensor copies), encode seconds per image token per
projector weight byte on the CPU and on the device, and the projector's load overhead beyond
its bytes over the bus.

Stored as JSON in the platformdirs cache (`calibration.json`), one entry per device identity
(name and description, e.g. `RPC0 127.0.0.1:50052`; `CPU` for the host).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from engine.gguf.info import ModelInfo
from engine.paths import cache_dir
from engine.json_file import read_object
from engine.placement.plan import CPU, Costs, Placement, output_bytes

FILE = "calibration.json"


@dataclass(frozen=True)
class DeviceCal:
    key: str
    gen_s_per_byte: float
    prompt_s_per_byte: float
    split_gen_s: float = 0.0
    split_prompt_s: float = 0.0
    bus_Bps: float | None = None
    encode_s_per_token_per_byte: float | None = None
    projector_overhead_s: float = 0.0
    model: str = ""
    measured_at: float = 0.0


def device_key(name: str, description: str = "") -> str:
    return name if name == CPU else f"{name} {description}".strip()


def path() -> Path:
    from engine import testhooks

    env = testhooks.value(testhooks.CALIBRATION)  # tests keep their own
    return Path(env) if env else cache_dir() / FILE


def load_all() -> dict[str, DeviceCal]:
    raw = read_object(path())
    names = {f.name for f in fields(DeviceCal)}
    out = {}
    for key, d in raw.get("devices", {}).items():
        if isinstance(d, dict) and names >= set(d) >= {"key", "gen_s_per_byte", "prompt_s_per_byte"}:
            out[key] = DeviceCal(**d)
    return out


def load(key: str) -> DeviceCal | None:
    return load_all().get(key)


def save(*cals: DeviceCal) -> Path:
    allc = load_all()
    for c in cals:
        allc[c.key] = c
    p = path()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps({"version": 1, "devices": {k: asdict(v) for k, v in allc.items()}},
                              indent=1))
    tmp.replace(p)
    return p


# ---------------------------------------------------------------- the model (pure)


def split_bytes(model: ModelInfo, placement: Placement) -> tuple[int, int]:
    """Weight bytes one token reads in RAM and on the accelerator under `placement`."""
    acc = sum(b for b, d in zip(model.layer_bytes, placement.layer_devices) if d != CPU)
    cpu = sum(model.layer_bytes) - acc
    out = output_bytes(model)
    if placement.output_device == CPU:
        cpu += out
    else:
        acc += out
    return cpu, acc


@dataclass(frozen=True)
class TextSpeed:
    """Predicted seconds per token under a placement, for generation (one token at a time)
    and a prompt (one batch)."""
    gen_s_per_token: float
    prompt_s_per_token: float

    @property
    def gen_tokens_per_s(self) -> float:
        return 1 / self.gen_s_per_token if self.gen_s_per_token else 0.0

    @property
    def prompt_tokens_per_s(self) -> float:
        return 1 / self.prompt_s_per_token if self.prompt_s_per_token else 0.0


def predict_text(model: ModelInfo, placement: Placement, cpu: DeviceCal,
                 accel: DeviceCal | None) -> TextSpeed:
    """Predicted seconds per token (generation, prompt) under `placement`."""
    wc, wa = split_bytes(model, placement)
    on_accel = placement.accel is not None and (wa > 0 or placement.live)
    if on_accel and accel is None:
        raise ValueError("an accelerator placement needs the accelerator's calibration")
    gen = wc * cpu.gen_s_per_byte
    prompt = wc * cpu.prompt_s_per_byte
    if on_accel and accel is not None:
        gen += wa * accel.gen_s_per_byte + accel.split_gen_s
        prompt += wa * accel.prompt_s_per_byte + accel.split_prompt_s
    return TextSpeed(gen, prompt)


def vision_costs(cpu: DeviceCal, accel: DeviceCal | None, projector_bytes: int,
                 base: Costs) -> Costs:
    """The vision plan's costs from calibrations (fields without a measurement keep `base`)."""
    c = base
    if cpu.encode_s_per_token_per_byte is not None:
        c = replace(c, cpu_encode_s_per_token=cpu.encode_s_per_token_per_byte * projector_bytes)
    if accel is not None:
        c = replace(c, bus_Bps=accel.bus_Bps or c.bus_Bps,
                    projector_overhead_s=accel.projector_overhead_s)
        if accel.encode_s_per_token_per_byte is not None:
            c = replace(c, accel_encode_s_per_token=accel.encode_s_per_token_per_byte * projector_bytes)
    return c


def fit(model: ModelInfo, cpu_key: str, accel_key: str,
        runs: list[tuple[Placement, float, float]]) -> tuple[DeviceCal, DeviceCal]:
    """CPU and accelerator text costs from runs (placement, generation s/token, prompt
    s/token): an all-CPU run and at least two with the accelerator (few to many layers)."""
    cpu_runs = [r for r in runs if r[0].n_gpu_layers == 0]
    acc_runs = sorted((r for r in runs if r[0].n_gpu_layers > 0), key=lambda r: r[0].n_gpu_layers)
    if not cpu_runs or len(acc_runs) < 2:
        raise ValueError("calibration needs an all-CPU run and two accelerator runs")
    p0, g0, q0 = cpu_runs[0]
    w0, _ = split_bytes(model, p0)
    cpu = DeviceCal(cpu_key, g0 / w0, q0 / w0, model=model.name, measured_at=time.time())

    def solve(col: int, per_cpu: float) -> tuple[float, float]:
        """Least squares over the accelerator runs of: time - RAM side = bytes * a + split
        (one slow run on a busy machine moves it less than a two-point fit)."""
        import numpy as np

        rows = []
        for p, gen_s, prompt_s in acc_runs:
            wc, wa = split_bytes(model, p)
            rows.append((wa, (gen_s if col == 1 else prompt_s) - wc * per_cpu))
        a = np.array([[wa, 1.0] for wa, _ in rows])
        y = np.array([t for _, t in rows])
        (per_byte, split), *_ = np.linalg.lstsq(a, y, rcond=None)
        per_byte = max(float(per_byte), 0.0)
        return per_byte, max(float(np.mean(y - a[:, 0] * per_byte)), 0.0)

    g_acc, g_split = solve(1, cpu.gen_s_per_byte)
    p_acc, p_split = solve(2, cpu.prompt_s_per_byte)
    accel = DeviceCal(accel_key, g_acc, p_acc, g_split, p_split, model=model.name,
                      measured_at=time.time())
    return cpu, accel


def to_json(c: DeviceCal) -> dict[str, Any]:
    return asdict(c)
