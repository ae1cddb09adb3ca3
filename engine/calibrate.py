"""Calibration: this machine's measured costs, stored per device, for `plan` and the sessions.

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
import os
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from engine.gguf_info import ModelInfo
from engine.paths import cache_dir
from engine.plan import CPU, Costs, Placement, output_bytes

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
    env = os.environ.get("EBB_CALIBRATION")  # tests keep their own
    return Path(env) if env else cache_dir() / FILE


def load_all() -> dict[str, DeviceCal]:
    try:
        raw = json.loads(path().read_text())
    except (OSError, ValueError):
        return {}
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


def predict_text(model: ModelInfo, placement: Placement, cpu: DeviceCal,
                 accel: DeviceCal | None) -> dict[str, float]:
    """Predicted seconds per token (generation, prompt) and tokens/s under `placement`."""
    wc, wa = split_bytes(model, placement)
    on_accel = placement.accel is not None and (wa > 0 or placement.live)
    if on_accel and accel is None:
        raise ValueError("an accelerator placement needs the accelerator's calibration")
    gen = wc * cpu.gen_s_per_byte
    prompt = wc * cpu.prompt_s_per_byte
    if on_accel and accel is not None:
        gen += wa * accel.gen_s_per_byte + accel.split_gen_s
        prompt += wa * accel.prompt_s_per_byte + accel.split_prompt_s
    return {"gen_s_per_token": gen, "prompt_s_per_token": prompt,
            "gen_tokens_per_s": 1 / gen if gen else 0.0,
            "prompt_tokens_per_s": 1 / prompt if prompt else 0.0}


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


# ---------------------------------------------------------------- measuring (loads models)


def _picture(folder: Path) -> Path:
    import numpy as np
    from PIL import Image

    arr = (np.random.default_rng(7).random((224, 224, 3)) * 255).astype(np.uint8)
    out = folder / "calibration.png"
    Image.fromarray(arr).save(out)
    return out


def _span_s(res: Any, name: str) -> float:
    return float(sum(s.end_s - s.start_s for s in res.spans if s.name == name))


def run_calibration(model_path: Path, mmproj_path: Path | None, rpc: tuple[str, ...],
                    budget: int | None, n_ctx: int, n_threads: int | None,
                    flash_attn: bool = True, log: Any = None) -> dict[str, Any]:
    """Measure this machine and its accelerator; store and return the calibrations."""
    import tempfile

    from engine.autotune import Measurer, max_layers
    from engine.bench import measure_bandwidth
    from engine.devices import default_budget, find_device, pick_accelerator
    from engine.errors import EbbError
    from engine.gguf_info import model_info, projector_info, read_gguf
    from engine.plan import placement_for, projector_need_bytes
    from engine.session import Session, SessionConfig

    say = log or (lambda msg: None)
    accel = pick_accelerator(rpc)
    if accel is None:
        raise EbbError("there is no accelerator to calibrate", "use a GPU or pass --rpc HOST:PORT")
    dev = find_device(accel)
    akey = device_key(dev.name, dev.description)
    info = model_info(read_gguf(model_path))
    budget = budget or default_budget(accel)
    top = max_layers(info, accel, budget, n_ctx, 512, flash_attn, 0, live=True)
    if top < 3:
        raise EbbError(f"the budget holds only {top} layers on {accel}: too few to calibrate",
                       "raise --vram-budget")
    m = Measurer(model_path, info, accel, n_ctx, n_threads, flash_attn, live=True,
                 on_point=lambda p: say(f"text: {p.layers} layers → prompt {p.prompt_tps:.0f} "
                                        f"tok/s, generation {p.gen_tps:.1f} tok/s"))
    runs = []
    for k in sorted({0, 1, max(2, top // 3), max(2, 2 * top // 3), top}):
        # two runs each, the faster of each: a busy machine only ever adds time
        p, q = m(k), m._measure(k)
        runs.append((placement_for(info, accel, k, n_ctx, 512, flash_attn, live=k > 0),
                     1 / max(p.gen_tps, q.gen_tps), 1 / max(p.prompt_tps, q.prompt_tps)))
    cpu, acc = fit(info, CPU, akey, runs)
    bus = measure_bandwidth(accel, repeats=5, typical=True)  # what a restore will see
    say(f"bus: {bus / 1e9:.2f} GB/s host → {accel}")
    acc = replace(acc, bus_Bps=bus)
    if mmproj_path is not None:
        proj = projector_info(read_gguf(mmproj_path))
        cfg = SessionConfig(model_path, mmproj_path, n_ctx=n_ctx, n_threads=n_threads,
                            vram_budget_bytes=budget, flash_attn=flash_attn, rpc=rpc)
        with tempfile.TemporaryDirectory() as tmp:
            pic = _picture(Path(tmp))
            for vision in ("cpu", "swap"):
                with Session(replace(cfg, vision=vision)) as s:
                    s.encode_only([pic])  # first use: warms the projector's code paths
                    turns = [s.encode_only([pic]) for _ in range(3)]
                # the fastest of three: a busy machine only ever adds time (one slow projector
                # load once put a prediction 55% over)
                encode_s = min(_span_s(t, "encode") for t in turns)
                per = encode_s / proj.n_image_tokens / proj.weight_bytes
                if vision == "cpu":
                    cpu = replace(cpu, encode_s_per_token_per_byte=per)
                else:
                    load_s = min(_span_s(t, "load_projector") for t in turns)
                    over = max(load_s - proj.weight_bytes / bus, 0.0)
                    acc = replace(acc, encode_s_per_token_per_byte=per, projector_overhead_s=over)
                say(f"vision: encode on {'CPU' if vision == 'cpu' else accel} "
                    f"{encode_s * 1000:.0f} ms for {proj.n_image_tokens} tokens")
        need = projector_need_bytes(proj, flash_attn)
        say(f"projector: {need / 2**20:.0f} MiB on the device while encoding")
    where = save(cpu, acc)
    return {"file": str(where), "cpu": to_json(cpu), "accelerator": to_json(acc),
            "runs": [{"layers": r[0].n_gpu_layers, "gen_s_per_token": r[1],
                      "prompt_s_per_token": r[2]} for r in runs]}
