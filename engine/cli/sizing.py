"""Commands that size a model for a machine: plan (what if), calibrate, autotune."""
from __future__ import annotations

import argparse
import json
import sys
import threading

from engine.cli.common import Subcommands, flag_parser, flash_attn_arg, install_sigint
from engine.errors import EbbError
from engine.units import fmt_bytes


def cmd_plan(args: argparse.Namespace) -> int:
    from engine.gguf.info import inspect_files
    from engine.models.default import existing_file, resolve_model_path
    from engine.config import default_threads
    from engine.placement import calibration as calibrate
    from engine.placement.whatif import parse_bus, what_if
    from engine.units import parse_size

    ins = inspect_files(resolve_model_path(args.model),
                        existing_file(args.mmproj, "projector") if args.mmproj else None)
    ctx = ins.model.fit_context(args.ctx)
    cpu_cal = None if args.uncalibrated else calibrate.load("CPU")
    accel_cal, accel, can_stream = None, "GPU", True
    if args.device:
        from engine.llama.devices import find_device

        dev = find_device(args.device)
        accel, key = dev.name, calibrate.device_key(dev.name, dev.description)
        can_stream = not dev.remote  # ggml-rpc cannot run ops on host weights (no offload_op)
        accel_cal = calibrate.load(key)
        if accel_cal is None or cpu_cal is None:
            raise EbbError(f"{key} is not calibrated on this machine",
                           "run: ebb-engine calibrate" + "".join(f" --rpc {r}" for r in args.rpc))
    w = what_if(ins.model, ins.projector, parse_size(args.vram), parse_bus(args.bus),
                args.ram_bw * 1e9, args.vram_bw * 1e9, ctx, default_threads(args.threads),
                cpu_cal, accel_cal, accel, args.prompt_tokens, can_stream)
    out = w.to_dict()
    if args.json:
        print(json.dumps(out))
        return 0
    m = ins.model
    cal = out["calibrated"]
    how = ("calibrated on this machine" if cal["cpu"] and cal["accelerator"] else
           "RAM side calibrated, accelerator from --vram-bw/--bus" if cal["cpu"] else
           "uncalibrated: run ebb-engine calibrate")
    print(f"{m.name}: {m.n_layers} layers on a {args.vram} {accel}, context {ctx} ({how})")
    print(f"  accelerator: {out['n_layers_on_accel']}/{m.n_layers} layers, "
          f"{fmt_bytes(out['accel_total_bytes'])} (" + ", ".join(
              f"{k} {fmt_bytes(v)}" for k, v in out["accel_bytes"].items()) + ")")
    print(f"  RAM: {fmt_bytes(out['ram_weight_bytes'])} of weights")
    print(f"  text: ~{out['gen_tokens_per_s']} tokens/s generated"
          + (f", ~{out['prompt_tokens_per_s']} tokens/s of prompt" if out["prompt_tokens_per_s"] else "")
          + ("" if cal["cpu"] else f" (weights read once per token at {args.vram_bw} GB/s on the "
             f"accelerator, {args.ram_bw} GB/s in RAM)"))
    for name, secs in out["vision_predicted_s"].items():
        print(f"  vision {name}: " + (f"{secs:.2f}s per image" if secs is not None else "does not fit"))
    if out["vision_auto"]:
        print(f"  auto would pick: {out['vision_auto']}")
    if out["phases"]:
        from engine.placement.whatif import phases_line

        print("  " + phases_line(out["phases"]))
    if out["oversize"]:
        o = out["oversize"]
        print(f"  larger than the accelerator: prompt → {o['choice']['prompt']}, generation → "
              f"{o['choice']['generation']}")
        print("  " + o["why"])
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from engine.gguf.info import model_info, read_gguf
    from engine.models.default import existing_file, resolve_model_path
    from engine.synth.demo import default_projector_path
    from engine.llama.loaded_model import check_context
    from engine.measure.calibrate import run_calibration
    from engine.units import parse_size

    model = resolve_model_path(args.model)
    if args.mmproj == "none":
        mmproj = None
    elif args.mmproj:
        mmproj = existing_file(args.mmproj, "projector")
    else:
        mmproj = default_projector_path(model)
    ctx = check_context(model_info(read_gguf(model)), args.ctx)
    out = run_calibration(model, mmproj, tuple(args.rpc),
                          parse_size(args.vram_budget) if args.vram_budget else None, ctx,
                          args.threads, flash_attn_arg(args) is not False,  # auto: the device's
                          log=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(out))
    else:
        a = out["accelerator"]
        print(f"stored in {out['file']}: CPU and {a['key']} (generation split cost "
              f"{a['split_gen_s'] * 1000:.2f} ms/token, bus {(a['bus_Bps'] or 0) / 1e9:.2f} GB/s)")
    return 0


def cmd_autotune(args: argparse.Namespace) -> int:
    from engine.config import SessionConfig
    from engine.models.default import existing_file, resolve_model_path
    from engine.llama.devices import default_budget, pick_accelerator
    from engine.measure.autotune import Point
    from engine.measure.tune_session import tune_for
    from engine.units import parse_size

    # --mmproj keeps the projector's room beside the layers: tuned as a resident projector
    cfg = SessionConfig(resolve_model_path(args.model),
                        existing_file(args.mmproj, "projector") if args.mmproj else None,
                        n_ctx=args.ctx, n_threads=args.threads, flash_attn=flash_attn_arg(args),
                        vision="resident" if args.mmproj else "auto", rpc=tuple(args.rpc))
    if args.flash_history < 0:
        raise EbbError(f"--flash-history must be 0 or more, got {args.flash_history}")
    if args.prompt_tokens < 8 or args.gen_tokens < 4:
        raise EbbError("--prompt-tokens must be 8 or more and --gen-tokens 4 or more")
    accel = pick_accelerator(tuple(args.rpc))
    if accel is None:
        raise EbbError("there is no accelerator to tune for", "use a GPU or pass --rpc HOST:PORT")
    budget = parse_size(args.vram_budget) if args.vram_budget else default_budget(accel)
    cancel = threading.Event()
    install_sigint(cancel)
    print(f"autotune on {accel}, budget {fmt_bytes(budget)}"
          + (" (keeping the projector's room)" if args.mmproj else ""), file=sys.stderr, flush=True)

    def progress(p: Point, top: int) -> None:
        print(f"  {p.layers:3d} layers: prompt {p.prompt_tps:8.1f} tok/s ({p.prompt_threads} "
              f"threads), generation {p.gen_tps:7.2f} tok/s ({p.gen_threads} threads)",
              file=sys.stderr, flush=True)

    # --threads fixes the count for both phases; without it each phase's best is searched
    tuned = tune_for(cfg, accel, budget, on_point=progress, cancel=cancel, on_flash=lambda n: print(
        f"  choosing flash attention: {n} runs with history in the cache", file=sys.stderr,
        flush=True), flash_history=args.flash_history, prompt_tokens=args.prompt_tokens,
        gen_tokens=args.gen_tokens)
    out = tuned.to_dict()
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{out['n_runs']} runs over 0..{out['max_layers']} layers (the most that fit)")
    print(f"best generation: {out['best_gen_layers']} layers, {out['best_gen_threads']} "
          f"threads, {out['best_gen_tps']} tok/s"
          + (f"; speed collapses at {out['cliff_gen_layers']}" if out["cliff_gen_layers"] else ""))
    print(f"best prompt:     {out['best_prompt_layers']} layers, {out['best_prompt_threads']} "
          f"threads, {out['best_prompt_tps']} tok/s"
          + (f"; speed collapses at {out['cliff_prompt_layers']}" if out["cliff_prompt_layers"] else ""))
    if out.get("best_image_layers") is not None:
        print(f"best image:     {out['best_image_layers']} layers, {out['best_image_tps']} tok/s "
              f"({out['image_tokens']} image tokens in one prompt)"
              + (f"; speed collapses at {out['cliff_image_layers']}"
                 if out["cliff_image_layers"] else ""))
    fa = out["flash_attn"]
    print(f"flash attention: {'on' if fa['on'] else 'off'} (a turn with {fa['fill']} tokens of "
          f"history: on {fa['turn_s_on']:.3f}s, off {fa['turn_s_off']:.3f}s; {fa['reason']})")
    if tuned.load_words():
        print(tuned.load_words())
    print("use both: ebb-engine autotune --json ... > tune.json; ebb-engine chat --tuning "
          "tune.json ...")
    return 0


def register(sub: Subcommands) -> None:
    p = sub.add_parser("plan", help="what if: placement, memory and speed on a given accelerator",
                       parents=[flag_parser("rpc", "model", "mmproj", "threads", "json")])
    p.add_argument("--vram", required=True, metavar="SIZE", help="the accelerator's memory, e.g. 8GiB")
    p.add_argument("--bus", default="pcie4", help="pcie3|pcie4|pcie5 or GB/s")
    p.add_argument("--ram-bw", type=float, default=40.0, metavar="GB/s")
    p.add_argument("--vram-bw", type=float, default=300.0, metavar="GB/s")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--device", default=None, metavar="NAME",
                   help="a device calibrated on this machine (e.g. RPC0 with --rpc): its costs")
    p.add_argument("--uncalibrated", action="store_true", help="ignore this machine's calibration")
    p.add_argument("--prompt-tokens", type=int, default=2048,
                   help="prompt length for comparing strategies when the model does not fit")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("calibrate", help="measure this machine and an accelerator for plan",
                       parents=[flag_parser("rpc", "model", "threads", "vram-budget",
                                            "no-flash-attn", "json")])
    p.add_argument("--mmproj", default=None, help="projector for the vision costs (default: "
                   "a generated base one; 'none' to skip)")
    p.add_argument("--ctx", type=int, default=None)
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("autotune", help="measure tokens/s against accelerator layers; find the best",
                       parents=[flag_parser("rpc", "model", "threads", "vram-budget",
                                            "no-flash-attn", "json")])
    p.add_argument("--mmproj", default=None, help="keep room for this projector beside the layers")
    p.add_argument("--ctx", type=int, default=None)
    p.add_argument("--flash-history", type=int, default=2048, metavar="TOKENS",
                   help="tokens of history in the cache when flash attention is chosen (the "
                        "conversations you have; at most the context less a turn)")
    p.add_argument("--prompt-tokens", type=int, default=256, metavar="N",
                   help="each run's timed prompt (fewer: quicker, noisier)")
    p.add_argument("--gen-tokens", type=int, default=48, metavar="N",
                   help="each run's timed generation (fewer: quicker, noisier)")
    p.set_defaults(func=cmd_autotune)
