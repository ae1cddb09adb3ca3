"""`ebb-engine bench …`: benchmarks that print ratios (never part of the test suite's asserts)."""
from __future__ import annotations

import argparse
import json
from typing import Any

from engine.cli.common import flag_parser
from engine.units import fmt_bytes


def cmd_bench_swap(args: argparse.Namespace) -> int:
    from engine.config import SessionConfig
    from engine.gguf.models import (
        default_projector_path,
        existing_file,
        resolve_model_path,
    )
    from engine.measure.bench import bench_swap
    from engine.units import parse_size

    model = resolve_model_path(args.model)
    mmproj = existing_file(args.mmproj, "projector") if args.mmproj else default_projector_path(model)
    cfg = SessionConfig(model_path=model, mmproj_path=mmproj, n_ctx=args.ctx, n_threads=args.threads,
                        vram_budget_bytes=parse_size(args.vram_budget) if args.vram_budget else None,
                        rpc=tuple(args.rpc))
    out = bench_swap(cfg)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"device {out['device']}, budget {fmt_bytes(out['vram_budget_bytes'])}, "
          f"{out['n_layers_on_accel']} layers on the device, {out['n_swaps']} swaps each")
    print(f"copy bandwidth       {out['bandwidth_Bps'] / 1e9:.2f} GB/s")
    print(f"reload mover swap    {out['reload_swap_s'] * 1000:.1f} ms fastest, "
          f"{out['reload_swap_median_s'] * 1000:.1f} median "
          f"({fmt_bytes(out['reload_bytes_moved'])} copied back)")
    print(f"live mover swap      {out['live_swap_s'] * 1000:.1f} ms fastest, "
          f"{out['live_swap_median_s'] * 1000:.1f} median "
          f"({fmt_bytes(out['bytes_moved'])} copied back)")
    print(f"physical limit       {out['limit_s'] * 1000:.1f} ms (the fastest of {out['n_swaps']} copies, "
          f"one in each live turn right before its restore, "
          f"{fmt_bytes(out['bandwidth_piece_bytes']) + ' pieces' if out['bandwidth_piece_bytes'] else 'whole'}); "
          f"{out['limit_best_s'] * 1000:.1f} ms at the fastest copy of all")
    print(f"reload / live        {out['reload_vs_live']}x;  live / limit {out['live_vs_limit']}x "
          f"(median {out['live_vs_limit_median']}x, paired {out['live_vs_limit_paired']}x, "
          f"fastest of all {out['live_vs_limit_best']}x);  reload / limit {out['reload_vs_limit']}x;  "
          f"replies equal: {out['replies_equal']}")
    return 0


def cmd_bench_calibrate(args: argparse.Namespace) -> int:
    import sys

    from engine.gguf.models import default_projector_path, existing_file, resolve_model_path
    from engine.hw import physical_cores
    from engine.measure.accuracy import bench_calibrate
    from engine.units import parse_size

    model = resolve_model_path(args.model)
    mmproj = existing_file(args.mmproj, "projector") if args.mmproj else default_projector_path(model)
    out = bench_calibrate(model, mmproj, tuple(args.rpc), parse_size(args.vram_budget),
                          parse_size(args.text_vram), args.ctx, args.threads or physical_cores(),
                          recalibrate=args.recalibrate,
                          log=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{out['device']}: predicted / measured (1.00 is exact)")
    for name in ("gen_tokens_per_s", "prompt_tokens_per_s", "vision_swap_s"):
        r = out[name]
        where = f" at {out['text_layers']} layers" if name != "vision_swap_s" else ""
        print(f"  {name:<20} {r['predicted']} vs {r['measured']}{where}: {r['ratio']}x")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bench = p.add_subparsers(dest="bench", required=True)
    p = bench.add_parser("swap", help="reload mover vs live mover on one vision turn",
                         parents=[flag_parser("rpc", "model", "threads", "json")])
    p.add_argument("--mmproj", default=None, help="default: a generated base projector")
    p.add_argument("--vram-budget", default=None, metavar="SIZE",
                   help="default: chosen so the projector takes most of the model's layers")
    p.add_argument("--ctx", type=int, default=2048)
    p.set_defaults(func=cmd_bench_swap)

    p = bench.add_parser("calibrate", help="calibrated predictions against measured runs (ratios)",
                         parents=[flag_parser("rpc", "model", "threads", "json")])
    p.add_argument("--mmproj", default=None, help="default: a generated base projector")
    p.add_argument("--vram-budget", default="300MiB", metavar="SIZE",
                   help="the session's budget, for the vision swap")
    p.add_argument("--text-vram", default="190MiB", metavar="SIZE",
                   help="a budget holding part of the model: text at a placement never calibrated")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--recalibrate", action="store_true", help="calibrate again first")
    p.set_defaults(func=cmd_bench_calibrate)
