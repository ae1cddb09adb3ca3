"""`ebb-engine`: the engine from a terminal (no display needed).

Every problem a user can fix prints one line on stderr and exits with code 2.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from engine.errors import EbbError
from engine.units import fmt_bytes

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


# ---------------------------------------------------------------- commands


def cmd_fetch_model(args: argparse.Namespace) -> int:
    from engine.gguf.models import fetch_default_model

    path = fetch_default_model()
    print(path)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from engine.gguf.info import inspect_files
    from engine.gguf.models import existing_file, resolve_model_path

    model = resolve_model_path(args.model)
    mmproj = existing_file(args.mmproj, "projector") if args.mmproj else None
    result = inspect_files(model, mmproj)
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
        return 0
    m = result.model
    print(f"model        {m.path}")
    print(f"architecture {m.architecture} ({m.name})")
    print(f"layers       {m.n_layers}   n_embd {m.n_embd}   heads {m.n_head}   "
          f"context {m.n_ctx_train}")
    print(f"tensor bytes {fmt_bytes(m.tensor_bytes)} (file {fmt_bytes(m.file_bytes)})")
    print(f"layers       {fmt_bytes(sum(m.layer_bytes))} in all, "
          f"{fmt_bytes(min(m.layer_bytes, default=0))}–{fmt_bytes(max(m.layer_bytes, default=0))} each")
    print(f"outside      {fmt_bytes(m.non_layer_bytes)}: " + ", ".join(
        f"{k} {fmt_bytes(v)}" for k, v in m.non_layer_tensors.items()))
    print(f"KV cache     {m.kv_bytes_per_token} B/token "
          f"({m.kv_bytes_per_token_per_layer[0] if m.kv_bytes_per_token_per_layer else 0} B/token/layer, f16)")
    p = result.projector
    if p:
        print(f"projector    {p.path}{'  [synthetic: random weights]' if p.synthetic else ''}")
        print(f"             type {p.projector_type}, {p.n_layers} blocks, width {p.n_embd}, "
              f"image {p.image_size}px → {p.n_image_tokens} tokens of width {p.output_width}")
        print(f"             weights {fmt_bytes(p.weight_bytes)}; compute buffer ≈ "
              f"{fmt_bytes(p.compute_buffer_bytes_estimate)} "
              f"({fmt_bytes(p.compute_buffer_bytes_estimate_flash_attn)} with flash attention)")
    return 0


def cmd_make_projector(args: argparse.Namespace) -> int:
    from engine.gguf.info import model_info, read_gguf
    from engine.gguf.models import resolve_model_path
    from engine.gguf.projector_gen import write_projector

    model = model_info(read_gguf(resolve_model_path(args.for_model)))
    out = write_projector(Path(args.out), model.n_embd, size=args.size, seed=args.seed)
    print(f"wrote {out} ({fmt_bytes(out.stat().st_size)}, {args.size}, seed {args.seed}, "
          f"output width {model.n_embd}; synthetic: random weights)")
    return 0


def cmd_devices(args: argparse.Namespace) -> int:
    from engine.llama.devices import list_devices, nvml_readings

    devs = list_devices()
    nvml = nvml_readings()
    if args.json:
        print(json.dumps({"devices": [d.to_dict() for d in devs],
                          "nvml": [r.__dict__ for r in nvml] if nvml is not None else None}))
        return 0
    for d in devs:
        mem = (f"{fmt_bytes(d.free_bytes)} free of {fmt_bytes(d.total_bytes)}"
               if d.free_bytes is not None and d.total_bytes is not None else "memory n/a")
        print(f"{d.name:<28} {d.kind:<6} {'remote ' if d.remote else ''}{mem}  {d.description}")
    if nvml is None:
        print("NVML: not available (no NVIDIA driver)")
    else:
        for r in nvml:
            print(f"NVML GPU{r.index} {r.name}: {fmt_bytes(r.used_bytes)} used of "
                  f"{fmt_bytes(r.total_bytes)}")
    return 0


def cmd_rpc_serve(args: argparse.Namespace) -> int:
    from engine.llama.rpc_server import serve

    serve(args.host, args.port, args.cache, args.threads, args.warm_from)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from engine.placement import calibration as calibrate
    from engine.gguf.info import inspect_files
    from engine.hw import physical_cores
    from engine.gguf.models import existing_file, resolve_model_path
    from engine.units import parse_size
    from engine.placement.whatif import parse_bus, what_if

    ins = inspect_files(resolve_model_path(args.model),
                        existing_file(args.mmproj, "projector") if args.mmproj else None)
    ctx = min(args.ctx, ins.model.n_ctx_train or args.ctx)
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
                args.ram_bw * 1e9, args.vram_bw * 1e9, ctx, args.threads or physical_cores(),
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
    if out["oversize"]:
        o = out["oversize"]
        print(f"  larger than the accelerator: prompt → {o['choice']['prompt']}, generation → "
              f"{o['choice']['generation']}")
        print("  " + o["why"])
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from engine.measure.calibrate import run_calibration
    from engine.gguf.models import default_projector_path, existing_file, resolve_model_path
    from engine.llama.runtime import check_context
    from engine.gguf.info import model_info, read_gguf
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
                          args.threads, not args.no_flash_attn,
                          log=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(out))
    else:
        a = out["accelerator"]
        print(f"stored in {out['file']}: CPU and {a['key']} (generation split cost "
              f"{a['split_gen_s'] * 1000:.2f} ms/token, bus {(a['bus_Bps'] or 0) / 1e9:.2f} GB/s)")
    return 0


def cmd_make_model(args: argparse.Namespace) -> int:
    from engine.gguf.model_gen import write_sparse_model

    out = write_sparse_model(Path(args.out), args.like)
    st = out.stat()
    print(f"wrote {out}: {fmt_bytes(st.st_size)} of real shapes ({args.like}, Q4_0), "
          f"{fmt_bytes(st.st_blocks * 512)} on disk (the weights are a hole)")
    return 0


def cmd_bench_swap(args: argparse.Namespace) -> int:
    from engine.measure.bench import bench_swap
    from engine.gguf.models import default_projector_path, existing_file, resolve_model_path
    from engine.session import SessionConfig
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


def cmd_autotune(args: argparse.Namespace) -> int:
    from engine.measure.autotune import Measurer, Point, autotune
    from engine.llama.devices import default_budget, pick_accelerator
    from engine.gguf.info import check_projector_matches, model_info, projector_info, read_gguf
    from engine.gguf.models import existing_file, resolve_model_path
    from engine.placement.plan import projector_need_bytes
    from engine.llama.runtime import check_context
    from engine.units import parse_size

    model = resolve_model_path(args.model)
    info = model_info(read_gguf(model))
    headroom = 0
    if args.mmproj:
        proj = projector_info(read_gguf(existing_file(args.mmproj, "projector")))
        check_projector_matches(info, proj)
        headroom = projector_need_bytes(proj, not args.no_flash_attn)
    accel = pick_accelerator(tuple(args.rpc))
    if accel is None:
        raise EbbError("there is no accelerator to tune for", "use a GPU or pass --rpc HOST:PORT")
    budget = parse_size(args.vram_budget) if args.vram_budget else default_budget(accel)
    cancel = threading.Event()
    _install_sigint(cancel)

    def progress(p: Point) -> None:
        print(f"  {p.layers:3d} layers: prompt {p.prompt_tps:8.1f} tok/s, generation "
              f"{p.gen_tps:7.2f} tok/s", file=sys.stderr, flush=True)

    m = Measurer(model, info, accel, check_context(info, args.ctx), args.threads,
                 flash_attn=not args.no_flash_attn, on_point=progress, cancel=cancel)
    print(f"autotune on {accel}, budget {fmt_bytes(budget)}"
          + (f", keeping {fmt_bytes(headroom)} for the projector" if headroom else ""),
          file=sys.stderr, flush=True)
    out = autotune(m, budget, headroom).to_dict()
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{out['n_runs']} runs over 0..{out['max_layers']} layers (the most that fit)")
    print(f"best generation: {out['best_gen_layers']} layers, {out['best_gen_tps']} tok/s"
          + (f"; speed collapses at {out['cliff_gen_layers']}" if out["cliff_gen_layers"] else ""))
    print(f"best prompt:     {out['best_prompt_layers']} layers, {out['best_prompt_tps']} tok/s"
          + (f"; speed collapses at {out['cliff_prompt_layers']}" if out["cliff_prompt_layers"] else ""))
    print(f"use it: ebb-engine chat --gpu-layers {out['best_gen_layers']} ...")
    return 0


def _install_sigint(cancel: threading.Event) -> None:
    """First Ctrl-C asks the generation to stop between tokens; a second one aborts."""
    def handler(signum: int, frame: Any) -> None:
        if cancel.is_set():
            raise KeyboardInterrupt
        cancel.set()
    signal.signal(signal.SIGINT, handler)


def _read_script(path: str) -> list[dict[str, Any]]:
    from engine.gguf.models import existing_file

    p = existing_file(path, "script")
    try:
        turns = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EbbError(f"script {p.name} is not valid JSON ({exc})") from None
    if not isinstance(turns, list) or not all(
            isinstance(t, dict) and isinstance(t.get("text", ""), str)
            and isinstance(t.get("images", []), list) for t in turns):
        raise EbbError(f"script {p.name} must be a JSON list of "
                       '{"text": "...", "images": ["path", ...]} objects')
    base = p.parent
    return [{"text": t.get("text", ""),
             "images": [str((base / i) if not Path(i).is_absolute() else i) for i in t.get("images", [])]}
            for t in turns]


def _session_config(args: argparse.Namespace) -> Any:
    from engine.gguf.models import existing_file, resolve_model_path
    from engine.session import SessionConfig
    from engine.units import parse_size

    if args.max_tokens <= 0:
        raise EbbError(f"--max-tokens must be positive, got {args.max_tokens}")
    if args.threads is not None and args.threads <= 0:
        raise EbbError(f"--threads must be positive, got {args.threads}")
    if args.gpu_layers is not None and args.gpu_layers < 0:
        raise EbbError(f"--gpu-layers must be 0 or more, got {args.gpu_layers}")
    return SessionConfig(
        model_path=resolve_model_path(args.model),
        mmproj_path=existing_file(args.mmproj, "projector") if args.mmproj else None,
        n_ctx=args.ctx, n_threads=args.threads,
        vram_budget_bytes=parse_size(args.vram_budget) if args.vram_budget else None,
        vision=args.vision, flash_attn=not args.no_flash_attn, system=args.system,
        mover=args.mover, rpc=tuple(args.rpc), gpu_layers=args.gpu_layers, spread=args.spread)


def cmd_chat(args: argparse.Namespace) -> int:
    from engine.llama.runtime import GenParams
    from engine.session import Session, turn_with_recovery

    if args.script is None and args.prompt is None:
        raise EbbError("nothing to say", "pass --prompt TEXT or --script FILE.json")
    if args.script is not None:
        turns = _read_script(args.script)
    else:
        turns = [{"text": args.prompt, "images": args.image}]
    cfg = _session_config(args)
    cancel = threading.Event()
    _install_sigint(cancel)
    gp = GenParams(max_tokens=args.max_tokens, temperature=args.temp, seed=args.seed)
    on_text: Callable[[str], None] | None = None
    if not args.json:
        on_text = lambda s: print(s, end="", flush=True)  # noqa: E731
    all_spans: list[Any] = []
    failed = cancelled = False
    session = Session(cfg)
    try:
        for turn in turns:
            if cancel.is_set():
                break
            session, res = turn_with_recovery(session, turn["text"], turn["images"], gp,
                                              on_text=on_text, cancel=cancel)
            all_spans.extend(res.spans)
            out = res.to_dict()
            out.update(model=str(cfg.model_path), n_threads=session.n_threads,
                       n_ctx=session.n_ctx, accelerator=session.accel,
                       n_gpu_layers=session.placement.n_gpu_layers,
                       n_layers_on_accel=session.placement.n_layers_on_accel,
                       layers_by_device={d: session.placement.layer_devices.count(d)
                                         for d in dict.fromkeys(session.placement.layer_devices)},
                       placement_reason=session.placement_reason,
                       mover=session.mover_name,
                       mover_note="; ".join(n for n in (session.mover_note, res.mover_note) if n),
                       rpc_bytes_sent=session.load_rpc_bytes_sent, load_s=round(session.load_s, 3))
            cancelled = cancelled or out.get("stop_reason") == "cancelled"
            failed = failed or res.error is not None
            _print_turn(out, args.json)
    finally:
        session.close()
    if args.trace:
        from engine.trace import write_chrome_trace

        write_chrome_trace(Path(args.trace), all_spans)
    if cancelled:
        return EXIT_INTERRUPTED
    return EXIT_USER_ERROR if failed and args.script is None else 0


def _print_turn(out: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(out), flush=True)
        return
    if "device_lost" in out:
        print(f"ebb-engine: {out['device_lost']}: continuing on {out['accelerator'] or 'CPU'}",
              file=sys.stderr, flush=True)
    if "error" in out:
        print(f"ebb-engine: error: {out['error']}", file=sys.stderr, flush=True)
        return
    print()
    vision = f"vision: {out['strategy']} ({out['reason']}); " if out["n_images"] else ""
    print(f"[{vision}{out['n_gen_tokens']} tokens, {out['gen_tokens_per_s']:.1f} tok/s, "
          f"prompt {out['n_prompt_tokens']} tokens in {out['prompt_s']:.2f}s, "
          f"stop: {out['stop_reason']}]", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ebb-engine", description="Ebb's engine, headless.")
    sub = ap.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--rpc", action="append", default=[], metavar="HOST:PORT",
                        help="add a ggml RPC server's devices (repeatable)")

    p = sub.add_parser("chat", help="chat with a model from the terminal", parents=[common])
    p.add_argument("--model", default="default", help="GGUF path, or 'default' (SmolLM2-135M)")
    p.add_argument("--mmproj", default=None, help="vision projector GGUF (held in RAM)")
    p.add_argument("--prompt", default=None)
    p.add_argument("--image", action="append", default=[], help="image file (repeatable)")
    p.add_argument("--script", default=None, help='JSON list of {"text", "images"} user turns')
    p.add_argument("--vision", choices=["auto", "resident", "swap", "cpu"], default="auto")
    p.add_argument("--vram-budget", default=None, metavar="SIZE",
                   help="cap on every accelerator, e.g. 150MiB, 6GiB (default: free - margin)")
    p.add_argument("--mover", choices=["auto", "live", "reload"], default="auto",
                   help="how a swap moves the model: live layers (after a self-test) or reload")
    p.add_argument("--spread", action="store_true",
                   help="deal layers over every accelerator (local and --rpc) by measured link "
                        "(default: only when the first cannot hold the model)")
    p.add_argument("--gpu-layers", type=int, default=None, metavar="N",
                   help="at most N layers on the accelerator (see autotune; default: all that fit)")
    p.add_argument("--no-flash-attn", action="store_true")
    p.add_argument("--trace", default=None, metavar="FILE.json", help="write Chrome trace JSON")
    p.add_argument("--system", default=None)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.7, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ctx", type=int, default=None, help="context length (default: min(4096, model's))")
    p.add_argument("--threads", type=int, default=None, help="default: physical cores")
    p.add_argument("--json", action="store_true", help="print one JSON object per turn")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("inspect", help="what a model (and projector) holds, from its tensor table",
                       parents=[common])
    p.add_argument("model", help="GGUF path, or 'default'")
    p.add_argument("--mmproj", default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("make-projector", help="write a synthetic vision projector (random weights)",
                       parents=[common])
    p.add_argument("--for", dest="for_model", required=True, help="the model it should fit")
    p.add_argument("--out", required=True)
    p.add_argument("--size", choices=["tiny", "base", "large"], default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_projector)

    p = sub.add_parser("devices", help="the devices llama.cpp sees", parents=[common])
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_devices)

    p = sub.add_parser("rpc-serve", help="serve this machine's devices over ggml RPC (no auth!)")
    p.add_argument("--host", default="127.0.0.1", help="default loopback; other addresses warn")
    p.add_argument("--port", type=int, default=50052)
    p.add_argument("--cache", default=None, help="folder for ggml's RPC tensor cache")
    p.add_argument("--warm-from", action="append", default=[], metavar="MODEL.gguf",
                   help="fill the cache from this machine's copy of a model before serving")
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=cmd_rpc_serve)

    p = sub.add_parser("plan", help="what if: placement, memory and speed on a given accelerator",
                       parents=[common])
    p.add_argument("--model", default="default")
    p.add_argument("--mmproj", default=None)
    p.add_argument("--vram", required=True, metavar="SIZE", help="the accelerator's memory, e.g. 8GiB")
    p.add_argument("--bus", default="pcie4", help="pcie3|pcie4|pcie5 or GB/s")
    p.add_argument("--ram-bw", type=float, default=40.0, metavar="GB/s")
    p.add_argument("--vram-bw", type=float, default=300.0, metavar="GB/s")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default=None, metavar="NAME",
                   help="a device calibrated on this machine (e.g. RPC0 with --rpc): its costs")
    p.add_argument("--uncalibrated", action="store_true", help="ignore this machine's calibration")
    p.add_argument("--prompt-tokens", type=int, default=2048,
                   help="prompt length for comparing strategies when the model does not fit")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("calibrate", help="measure this machine and an accelerator for plan",
                       parents=[common])
    p.add_argument("--model", default="default")
    p.add_argument("--mmproj", default=None, help="projector for the vision costs (default: "
                   "a generated base one; 'none' to skip)")
    p.add_argument("--vram-budget", default=None, metavar="SIZE")
    p.add_argument("--ctx", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-flash-attn", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("make-model", help="write a header-only GGUF with a real model's shapes")
    p.add_argument("--like", required=True, choices=["llama-8b", "llama-70b"])
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_make_model)

    p = sub.add_parser("bench", help="benchmarks")
    bench = p.add_subparsers(dest="bench", required=True)
    p = bench.add_parser("swap", help="reload mover vs live mover on one vision turn", parents=[common])
    p.add_argument("--model", default="default")
    p.add_argument("--mmproj", default=None, help="default: a generated base projector")
    p.add_argument("--vram-budget", default=None, metavar="SIZE",
                   help="default: chosen so the projector takes most of the model's layers")
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench_swap)

    p = sub.add_parser("autotune", help="measure tokens/s against accelerator layers; find the best",
                       parents=[common])
    p.add_argument("--model", default="default")
    p.add_argument("--mmproj", default=None, help="keep room for this projector beside the layers")
    p.add_argument("--vram-budget", default=None, metavar="SIZE", help="default: free - margin")
    p.add_argument("--ctx", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-flash-attn", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_autotune)

    p = sub.add_parser("fetch-model", help="fetch the default model into the cache (once)",
                       parents=[common])
    p.set_defaults(func=cmd_fetch_model)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from engine.llama import fatal

    fatal.install(fatal.exit_with_message("ebb-engine"))
    try:
        if getattr(args, "rpc", None):
            from engine.llama.devices import connect_rpc

            for endpoint in args.rpc:
                connect_rpc(endpoint)
        return int(args.func(args))
    except EbbError as exc:
        print(f"ebb-engine: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("ebb-engine: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
