"""`ebb-engine calibrate`: measure this machine and an accelerator, fit the cost model of
`engine.placement.calibration`, and store it there. Loads models; engine thread."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from engine.placement.calibration import device_key, fit, save, to_json
from engine.placement.plan import CPU

if TYPE_CHECKING:
    from engine.events import TurnResult

# ---------------------------------------------------------------- measuring (loads models)


def _span_s(res: TurnResult, name: str) -> float:
    return float(sum(s.end_s - s.start_s for s in res.spans if s.name == name))


def run_calibration(model_path: Path, mmproj_path: Path | None, rpc: tuple[str, ...],
                    budget: int | None, n_ctx: int, n_threads: int | None,
                    flash_attn: bool = True, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure this machine and its accelerator; store and return the calibrations."""
    import tempfile

    from engine.config import SessionConfig
    from engine.errors import EbbError
    from engine.gguf.info import model_info, projector_info, read_gguf
    from engine.llama.bandwidth import measure_bandwidth
    from engine.llama.devices import default_budget, find_device, pick_accelerator
    from engine.measure.autotune import Measurer, max_layers
    from engine.placement.plan import placement_for, projector_need_bytes
    from engine.session import Session
    from engine.media.images import write_noise_picture

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
                 threads=(n_threads,) if n_threads else None,
                 on_point=lambda p: say(f"text: {p.layers} layers → prompt {p.prompt_tps:.0f} "
                                        f"tok/s, generation {p.gen_tps:.1f} tok/s"))
    runs = []
    for k in sorted({0, 1, max(2, top // 3), max(2, 2 * top // 3), top}):
        # two runs each, the faster of each: a busy machine only ever adds time
        p, q = m(k), m.measure(k)
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
            pic = write_noise_picture(Path(tmp) / "calibration.png", seed=7)
            for vision in ("cpu", "swap"):
                with Session(replace(cfg, vision=vision)) as s:
                    s.encode_only([pic])  # first use: warms the projector's code paths
                    turns = [s.encode_only([pic]) for _ in range(3)]
                # the fastest of three: a busy machine only ever adds time (one slow projector
                # load once put a prediction 55% over)
                encode_s = min(_span_s(t, "encode") for t in turns)
                n_tok = turns[0].n_image_tokens_encoded
                per = encode_s / n_tok / proj.weight_bytes
                if vision == "cpu":
                    cpu = replace(cpu, encode_s_per_token_per_byte=per)
                else:
                    load_s = min(_span_s(t, "load_projector") for t in turns)
                    over = max(load_s - proj.weight_bytes / bus, 0.0)
                    acc = replace(acc, encode_s_per_token_per_byte=per, projector_overhead_s=over)
                say(f"vision: encode on {'CPU' if vision == 'cpu' else accel} "
                    f"{encode_s * 1000:.0f} ms for {n_tok} tokens")
            proj = s.proj_info or proj  # with mtmd's measured compute buffer
        need = projector_need_bytes(proj, flash_attn)
        say(f"projector: {need / 2**20:.0f} MiB on the device while encoding")
    where = save(cpu, acc)
    return {"file": str(where), "cpu": to_json(cpu), "accelerator": to_json(acc),
            "runs": [{"layers": r[0].n_gpu_layers, "gen_s_per_token": r[1],
                      "prompt_s_per_token": r[2]} for r in runs]}
