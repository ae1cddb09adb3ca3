"""GPU check for a lent NVIDIA machine (run by packaging/gpu-check.sh after a CUDA build).

Generates a model-sized pair (a ~3.9 GB llama with random weights and the large ~600 MB
projector), runs the live mover's self-test, `bench swap`, and compares NVML's reading of this
process with the engine's ledger at every span of a few swap cycles. Prints one JSON summary.
`--rpc HOST:PORT --shape tiny` runs the same steps against an RPC device (a dry run).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from engine import events
from engine.synth.model_gen import SHAPES, write_model
from engine.models.default import default_model_path
from engine.synth.projector_gen import write_projector
from engine.llama.devices import connect_rpc, list_devices, nvml_readings
from engine.measure.swap_bench import auto_budget, bench_swap
from engine.session import Session, SessionConfig

MiB = 2**20


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default="/tmp/ebb-gpu-check")
    ap.add_argument("--shape", default="3b", choices=sorted(SHAPES))
    ap.add_argument("--rpc", action="append", default=[])
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--tokenizer-from", default=None,
                    help="a GGUF whose tokenizer the generated model takes (default: the default "
                         "model; packaging/gpu-pack.py packs a tokenizer-only one)")
    args = ap.parse_args()
    for ep in args.rpc:
        connect_rpc(ep)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    model = out / f"llama-{args.shape}.gguf"
    shape = SHAPES[args.shape]
    if not model.exists():
        write_model(model, shape, Path(args.tokenizer_from) if args.tokenizer_from
                    else default_model_path())
    proj = out / f"mmproj-large-{shape.n_embd}.gguf"
    if not proj.exists():
        write_projector(proj, shape.n_embd, size="large")
    summary: dict[str, object] = {"generate_s": round(time.monotonic() - t0, 1),
                                  "model_bytes": model.stat().st_size,
                                  "projector_bytes": proj.stat().st_size,
                                  "devices": [d.to_dict() for d in list_devices()],
                                  "nvml": [r.__dict__ for r in nvml_readings() or []]}
    cfg = SessionConfig(model, proj, n_ctx=4096, vision="swap", mover="live", rpc=tuple(args.rpc))
    with Session(replace(cfg, mover="reload", vision="cpu")) as probe:
        budget = auto_budget(probe)
    cfg = replace(cfg, vram_budget_bytes=budget)
    samples: list[dict[str, object]] = []

    def on_event(ev: events.Event) -> None:
        if isinstance(ev, events.MemorySample):
            samples.append({"ledger_MiB": round(ev.ledger_bytes / MiB, 1),
                            "device_used_MiB": None if ev.reported_used_bytes is None
                            else round(ev.reported_used_bytes / MiB, 1)})

    picture = out / "picture.png"
    import numpy as np
    from PIL import Image

    Image.fromarray((np.random.default_rng(0).random((336, 336, 3)) * 255).astype(np.uint8)).save(picture)
    t1 = time.monotonic()
    with Session(cfg, emit=on_event) as s:
        summary["self_test"] = {"mover": s.model.mover_name, "note": s.model.mover_note,
                                "start_s": round(time.monotonic() - t1, 2)}
        baseline = nvml_readings()
        cycles = []
        for _ in range(args.cycles):
            res = s.encode_only([picture])
            cycles.append({sp.name: round(sp.end_s - sp.start_s, 4) for sp in res.spans})
        summary["cycles"] = cycles
        summary["ledger_vs_device"] = samples
        summary["nvml_before_after"] = [[r.__dict__ for r in x] for x in (baseline, nvml_readings()) if x]
    summary["bench_swap"] = bench_swap(cfg)
    summary["total_s"] = round(time.monotonic() - t0, 1)
    json.dump(summary, sys.stdout, indent=1)
    print()
    b = summary["bench_swap"]
    assert isinstance(b, dict)
    print(f"reload/live {b['reload_vs_live']}x, live/limit {b['live_vs_limit']}x "
          f"(paired {b['live_vs_limit_paired']}x, median {b['live_vs_limit_median']}x), "
          f"replies equal {b['replies_equal']}, self-test: {s.model.mover_name} {s.model.mover_note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
