"""Commands on devices: devices (what llama.cpp sees), rpc-serve (serve ours over ggml RPC)."""
from __future__ import annotations

import argparse
import json

from engine.cli.common import Subcommands, flag_parser
from engine.units import fmt_bytes


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


def cmd_about(args: argparse.Namespace) -> int:
    """Versions, llama.cpp's build and backends, and the paths in use (for a bug report)."""
    import platform
    import sys

    from engine.models.default import default_model_path
    from engine.llama.about import runtime_info
    from engine.media.avfile import sound_decoder
    from engine.paths import cache_dir, data_dir

    try:
        from importlib.metadata import version

        ebb = version("ebb-chat")
    except Exception:  # noqa: BLE001 - a checkout that was never installed
        ebb = "unknown (not installed)"
    facts = {"ebb": ebb, "python": platform.python_version(), "executable": sys.executable,
             "frozen": bool(getattr(sys, "frozen", False)), **runtime_info(),
             "sound_decoder": sound_decoder(),
             "default_model": str(default_model_path()), "cache_dir": str(cache_dir()),
             "data_dir": str(data_dir())}
    if args.json:
        print(json.dumps(facts))
    else:
        for key, value in facts.items():
            print(f"{key:<18} {value}")
    return 0


def cmd_rpc_serve(args: argparse.Namespace) -> int:
    import os
    import sys

    from engine.llama import devcap
    from engine.llama.rpc_server import serve
    from engine.paths import engine_argv
    from engine.units import parse_size

    limit = parse_size(args.device_memory) if args.device_memory else 0
    if limit and not devcap.active():  # start again with the cap preloaded
        env = devcap.preload_env(limit)
        argv = [*engine_argv(), *sys.argv[1:]]  # this same command, from the bundle or not
        sys.stdout.flush()
        os.execve(argv[0], argv, env)
    serve(args.host, args.port, args.cache, args.threads, args.warm_from, limit)
    return 0


def register(sub: Subcommands) -> None:
    p = sub.add_parser("devices", help="the devices llama.cpp sees", parents=[flag_parser("rpc", "json")])
    p.set_defaults(func=cmd_devices)

    p = sub.add_parser("about", help="versions, llama.cpp's build and backends, paths",
                       parents=[flag_parser("json")])
    p.set_defaults(func=cmd_about)

    p = sub.add_parser("rpc-serve", help="serve this machine's devices over ggml RPC (no auth!)",
                       parents=[flag_parser("threads")])
    p.add_argument("--host", default="127.0.0.1", help="default loopback; other addresses warn")
    p.add_argument("--port", type=int, default=50052)
    p.add_argument("--cache", default=None, help="folder for ggml's RPC tensor cache")
    p.add_argument("--warm-from", action="append", default=[], metavar="MODEL.gguf",
                   help="fill the cache from this machine's copy of a model before serving")
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="serve a device with this much memory (e.g. 300MiB): it reports SIZE, and "
                        "allocations past it fail as on a full GPU (Linux; builds a small library "
                        "with the C compiler once)")
    p.set_defaults(func=cmd_rpc_serve)
    _register_native_check(sub)
    p = sub.add_parser("colour-check", help="the demo projector names six colours in shades across "
                       "their range on this machine's CPU; prints the smallest logit gap",
                       parents=[flag_parser("model", "threads", "json")])
    p.add_argument("--batch", type=int, default=512, help="the batch size (default 512)")
    p.set_defaults(func=cmd_colour_check)


def cmd_colour_check(args: argparse.Namespace) -> int:
    """Exit 0 when every shade is named right, 1 when one is not (each wrong one is listed)."""
    from engine.models.default import resolve_model_path
    from engine.synth.demo import default_projector_path
    from engine.config import default_threads
    from engine.llama.about import cpu_backend_file
    from engine.measure.colour_check import check_colours

    model = resolve_model_path(args.model)
    report = check_colours(model, default_projector_path(model), default_threads(args.threads),
                           args.batch)
    out = {**report.to_dict(), "cpu_backend": cpu_backend_file()}
    if args.json:
        print(json.dumps(out))
    else:
        for a in report.wrong:
            print(f"wrong: {a.colour} {a.rgb} was answered {a.text.strip()!r}")
        print(f"{len(report.answers) - len(report.wrong)} of {len(report.answers)} pictures named "
              f"right with {report.n_threads} threads, batch {report.n_batch}, on "
              f"{out['cpu_backend']}; smallest logit gap {report.smallest_gap:.2f}")
    return 0 if not report.wrong else 1


def cmd_native_check(args: argparse.Namespace) -> int:
    """Setup's smoke test (run in a child process: a native crash kills only it): load a model,
    decode one token, say how it went in one JSON line. With --safe, in safe mode; with
    --remember, a success in safe mode is kept as this build's and CPU's setting."""
    import time

    from engine.models.default import fetch_default_model
    from engine.llama import native

    if args.safe:
        native.set_safe_mode(True, args.remember or "--safe")
    t0 = time.perf_counter()
    from engine.llama.about import backend_notes, cpu_backend_file
    from engine.llama.loaded_model import LoadParams
    from engine.llama.runtime import TextRuntime

    model = args.model or fetch_default_model()
    rt = TextRuntime(LoadParams(model, n_ctx=256, n_threads=1))
    try:
        tokens = rt.tokenize("Hi", add_special=True)
        rt.prefill(tokens)
        token = rt.decode_greedy()
    finally:
        rt.close()
    if args.safe and args.remember:
        native.write_record(safe_mode=True, safe_mode_reason=args.remember)
    print(json.dumps({"ok": True, "token": token, "safe_mode": native.safe_mode(),
                      "cpu": native.cpu_name(), "cpu_backend": cpu_backend_file(),
                      "build": native.build_id(), "notes": backend_notes(),
                      "seconds": round(time.perf_counter() - t0, 2)}))
    return 0


def _register_native_check(sub: Subcommands) -> None:
    p = sub.add_parser("native-check", help="load a model and decode one token (setup's smoke "
                                            "test; run it in a child process)")
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--safe", action="store_true", help="in safe mode (CPU only, no extra buffers)")
    p.add_argument("--remember", default="", metavar="WHY",
                   help="with --safe: keep safe mode on for this build and CPU, for this reason")
    p.set_defaults(func=cmd_native_check)
