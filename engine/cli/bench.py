"""`ebb-engine bench …`: benchmarks that print ratios (never part of the test suite's asserts)."""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, TypedDict, cast

from engine.cli.common import Subcommands, flag_parser, flash_attn_arg
from engine.config import default_threads
from engine.errors import EbbError
from engine.paths import engine_argv
from engine.units import fmt_bytes


Command = Callable[[argparse.Namespace], int]


class ArgSpec(TypedDict, total=False):
    """What a bench's argument passes to argparse's add_argument (the keys the benches use)."""
    default: object
    type: Callable[[str], object]
    help: str
    metavar: str
    action: str
    choices: Sequence[str]
    required: bool


@dataclass(frozen=True)
class Bench:
    """One `ebb-engine bench NAME`: its help, the common flags it takes (cli/common.py), its
    own arguments and what runs it. Declared beside its command with `@bench`."""
    name: str
    help: str
    flags: tuple[str, ...]
    arguments: tuple[tuple[tuple[str, ...], ArgSpec], ...]
    run: Command


BENCHES: list[Bench] = []


def progress_log(args: argparse.Namespace) -> Callable[[str], None]:
    """A bench's running lines: on stderr, indented; none with --json."""
    import sys

    if args.json:
        return lambda m: None
    return lambda m: print(f"  {m}", file=sys.stderr, flush=True)


_UNSET = object()


def arg(*names: str, help: str | None = None, default: object = _UNSET,
        type: Callable[[str], object] | None = None, metavar: str | None = None,
        action: str | None = None, choices: Sequence[str] | None = None,
        required: bool = False) -> tuple[tuple[str, ...], ArgSpec]:
    """One argument of a bench, as argparse's add_argument takes it (only what is given: an
    action's own default stays)."""
    spec: dict[str, object] = {k: v for k, v in (("help", help), ("type", type), ("metavar", metavar),
                                                 ("action", action), ("choices", choices)) if v is not None}
    if default is not _UNSET:
        spec["default"] = default
    if required:
        spec["required"] = True
    return names, cast(ArgSpec, spec)


def bench(name: str, help: str, flags: tuple[str, ...],
          *arguments: tuple[tuple[str, ...], ArgSpec]) -> Callable[[Command], Command]:
    """Declare the command below as `ebb-engine bench NAME` (a new bench is one function here)."""
    def declare(run: Command) -> Command:
        BENCHES.append(Bench(name, help, flags, arguments, run))
        return run
    return declare


@bench("swap", "reload mover vs live mover on one vision turn",
       ("rpc", "model", "threads", "json"),
       arg("--mmproj", default=None, help="default: a generated base projector"),
       arg("--vram-budget", default=None, metavar="SIZE",
           help="default: chosen so the projector takes most of the model's layers"),
       arg("--ctx", type=int, default=2048))
def cmd_bench_swap(args: argparse.Namespace) -> int:
    from engine.config import SessionConfig
    from engine.models.default import existing_file, resolve_model_path
    from engine.synth.demo import default_projector_path
    from engine.measure.swap_bench import bench_swap
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
    pre = out["prefill_s"]
    print(f"prefill after it     reload {pre['reload'][0] * 1000:.1f} ms fastest, "
          f"{pre['reload'][1] * 1000:.1f} median; live {pre['live'][0] * 1000:.1f} ms fastest, "
          f"{pre['live'][1] * 1000:.1f} median")
    print(f"reload / live        {out['reload_vs_live']}x;  live / limit {out['live_vs_limit']}x "
          f"(median {out['live_vs_limit_median']}x, paired {out['live_vs_limit_paired']}x, "
          f"fastest of all {out['live_vs_limit_best']}x);  reload / limit {out['reload_vs_limit']}x;  "
          f"replies equal: {out['replies_equal']}")
    return 0


@bench("calibrate", "calibrated predictions against measured runs (ratios)",
       ("rpc", "model", "threads", "json"),
       arg("--mmproj", default=None, help="default: a generated base projector"),
       arg("--vram-budget", default="300MiB", metavar="SIZE",
           help="the session's budget, for the vision swap"),
       arg("--text-vram", default="190MiB", metavar="SIZE",
           help="a budget holding part of the model: text at a placement never calibrated"),
       arg("--ctx", type=int, default=1024),
       arg("--recalibrate", action="store_true", help="calibrate again first"))
def cmd_bench_calibrate(args: argparse.Namespace) -> int:
    import sys

    from engine.models.default import existing_file, resolve_model_path
    from engine.synth.demo import default_projector_path
    from engine.measure.accuracy import bench_calibrate
    from engine.units import parse_size

    model = resolve_model_path(args.model)
    mmproj = existing_file(args.mmproj, "projector") if args.mmproj else default_projector_path(model)
    out = bench_calibrate(model, mmproj, tuple(args.rpc), parse_size(args.vram_budget),
                          parse_size(args.text_vram), args.ctx, default_threads(args.threads),
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


@bench("soak", "a long session with images and swaps: memory, descriptors and the ledger before "
               "and after",
       ("rpc", "model", "threads", "json"),
       arg("--mmproj", default=None, help="default: the demo projector"),
       arg("--turns", type=int, default=200),
       arg("--image-every", type=int, default=3),
       arg("--n-pictures", type=int, default=24, help="distinct pictures, used in turn"),
       arg("--image-cache", default="256KiB", metavar="SIZE", help="small, so the cache works at its limit"),
       arg("--vram-budget", default="300MiB", metavar="SIZE"),
       arg("--ctx", type=int, default=1024))
def cmd_bench_soak(args: argparse.Namespace) -> int:
    import sys
    import tempfile

    from engine.config import SessionConfig
    from engine.models.default import existing_file, resolve_model_path
    from engine.synth.demo import default_projector_path
    from engine.measure.soak import soak
    from engine.units import parse_size

    model = resolve_model_path(args.model)
    mmproj = existing_file(args.mmproj, "projector") if args.mmproj else default_projector_path(model)
    with tempfile.TemporaryDirectory(prefix="ebb-soak-") as tmp:
        pictures = _soak_pictures(Path(tmp), args.n_pictures)
        server = None
        rpc = tuple(args.rpc)
        if not rpc:  # a stand-in accelerator of our own, so its memory can be read too
            server = _start_rpc_server(args.threads)
            rpc = (server[1],)
        from engine.llama.devices import connect_rpc

        for endpoint in rpc:
            connect_rpc(endpoint)
        cfg = SessionConfig(model_path=model, mmproj_path=mmproj, n_ctx=args.ctx,
                            n_threads=args.threads, vision="swap", rpc=rpc,
                            vram_budget_bytes=parse_size(args.vram_budget),
                            image_cache_bytes=parse_size(args.image_cache))
        try:
            res = soak(cfg, args.turns, pictures, args.image_every,
                       server_pid=server[0].pid if server else None,
                       log=lambda m: print(f"  {m}", file=sys.stderr, flush=True))
        finally:
            if server is not None:
                server[0].terminate()
                server[0].wait(30)
    out = res.to_dict()
    if args.json:
        print(json.dumps(out))
        return 0
    mib = 2**20
    print(f"{out['turns']} turns, {out['images']} images, {out['swaps']} swaps, "
          f"{out['cache_evictions']} image chunks left the cache, {out['turns_dropped']} turns "
          f"left the context, {len(res.errors)} errors")
    print(f"process RSS  {out['rss_after_warmup'] / mib:.1f} MiB after warm-up -> "
          f"{out['rss_end'] / mib:.1f} MiB at the end ({out['rss_growth_after_warmup'] / mib:+.1f} MiB)")
    if out["server_rss_end"]:
        print(f"server RSS   {out['server_rss_after_warmup'] / mib:.1f} MiB -> "
              f"{out['server_rss_end'] / mib:.1f} MiB")
    print(f"open fds     {out['fds_after_warmup']} after warm-up -> {out['fds_end']} at the end"
          + (f"; opened and kept: {out['fds_kept_after_warmup']}" if out["fds_kept_after_warmup"]
             else ""))
    print(f"ledger       {fmt_bytes(out['ledger_after_first_turn'])} -> {fmt_bytes(out['ledger_end'])}")
    return 0


def _soak_pictures(folder: Path, n: int) -> list[Path]:
    from PIL import Image

    out = []
    for i in range(n):
        p = folder / f"soak-{i}.png"
        Image.new("RGB", (320 + 16 * (i % 5), 240), ((i * 53) % 256, (i * 97) % 256, 140)).save(p)
        out.append(p)
    return out


def _start_rpc_server(threads: int | None) -> tuple[Any, str]:
    import socket
    import subprocess
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([*engine_argv(), "rpc-serve", "--port", str(port),
                             "--threads", str(default_threads(threads))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"127.0.0.1:{port}"
        time.sleep(0.1)
    proc.kill()
    raise EbbError("the stand-in RPC server did not start")


@bench("autotune", "autotune's search against an exhaustive sweep of every layer count (runs, and speed "
                   "ratios at the picks)",
       ("rpc", "model", "threads", "json"),
       arg("--vram-budget", default="180MiB", metavar="SIZE"),
       arg("--ctx", type=int, default=1024))
def cmd_bench_autotune(args: argparse.Namespace) -> int:
    """The search against an exhaustive sweep of every layer count: runs, and the speed at the
    search's picks as a share of the sweep's best (1.00: the search found the best)."""
    import sys

    from engine.gguf.info import model_info, read_gguf
    from engine.models.default import resolve_model_path
    from engine.llama.devices import connect_rpc
    from engine.measure.autotune import Measurer, Point, autotune, max_layers, sweep
    from engine.units import parse_size

    model = resolve_model_path(args.model)
    info = model_info(read_gguf(model))
    budget = parse_size(args.vram_budget)
    server = None
    rpc = tuple(args.rpc)
    if not rpc:  # a stand-in accelerator of our own, computing with 2 threads
        server = _start_rpc_server(2)
        rpc = (server[1],)
    try:
        accel = connect_rpc(rpc[0])[0]

        def log(p: Point) -> None:
            print(f"  {p.layers} layers: prompt {p.prompt_tps:.0f}, gen {p.gen_tps:.1f} tok/s",
                  file=sys.stderr, flush=True)

        def measurer() -> Measurer:
            return Measurer(model, info, accel, args.ctx, default_threads(args.threads), live=False, on_point=log)

        top = max_layers(info, accel, budget, args.ctx, 512, True, 0, live=False)
        print(f"sweep 0..{top}", file=sys.stderr, flush=True)
        full = sweep(measurer(), top)
        print("search", file=sys.stderr, flush=True)
        tuned = autotune(measurer(), budget, 0)
    finally:
        if server is not None:
            server[0].terminate()
            server[0].wait(30)
    gen_of = {p.layers: p.gen_tps for p in full}
    prompt_of = {p.layers: p.prompt_tps for p in full}
    best_gen = max(full, key=lambda p: p.gen_tps).layers
    best_prompt = max(full, key=lambda p: p.prompt_tps).layers
    out = {
        "device": accel, "budget_bytes": budget, "top": top,
        "sweep_runs": len(full), "search_runs": len(tuned.points),
        "sweep_best_gen_layers": best_gen, "sweep_best_prompt_layers": best_prompt,
        "search_gen_layers": tuned.best_gen_layers, "search_prompt_layers": tuned.best_prompt_layers,
        # the sweep's own speed at the search's pick over the sweep's best (noise included)
        "gen_ratio": round(gen_of[tuned.best_gen_layers] / gen_of[best_gen], 3),
        "prompt_ratio": round(prompt_of[tuned.best_prompt_layers] / prompt_of[best_prompt], 3),
        "sweep": [p.to_dict() for p in full], "search": [p.to_dict() for p in tuned.points],
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{accel}, budget {fmt_bytes(budget)}: {out['search_runs']} runs against {out['sweep_runs']}")
    print(f"generation  search {tuned.best_gen_layers} layers, sweep's best {best_gen}: "
          f"{out['gen_ratio']:.3f} of the best")
    print(f"prompt      search {tuned.best_prompt_layers} layers, sweep's best {best_prompt}: "
          f"{out['prompt_ratio']:.3f} of the best")
    return 0


@bench("conversation", "a long chat, Ebb against bare llama-cpp-python with flash attention on and off, turn"
                       " by turn (ratios)",
       ("model", "threads", "json"),
       arg("--turns", type=int, default=40),
       arg("--reply", type=int, default=24, help="tokens per reply"),
       arg("--ctx", type=int, default=8192))
def cmd_bench_conversation(args: argparse.Namespace) -> int:
    import sys

    from engine.models.default import resolve_model_path
    from engine.measure.conversation_bench import RUNNERS, bench_conversation

    out = bench_conversation(resolve_model_path(args.model), args.ctx, default_threads(args.threads),
                             args.turns, args.reply,
                             log=lambda m: print(f"  {m}", file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(out))
        return 0
    fa = out["flash_attn"]
    print(f"{out['turns']} turns, replies of {out['reply_tokens']} tokens, ctx {out['n_ctx']}, "
          f"{out['threads']} threads; Ebb ran with flash attention {'on' if fa['ebb'] else 'off'}")
    print(f"{'turns':>7}  " + "  ".join(f"{w:>11}" for w in RUNNERS) + "   Ebb ÷ faster bare")
    for r in out["rows"]:
        print(f"{r['turns']:>7}  " + "  ".join(f"{r[w]:>10.3f}s" for w in RUNNERS)
              + f"   {r['ebb_vs_faster_bare']:.3f}")
    print(f"last {out['last_turns']} turns: Ebb ÷ the faster bare setting {out['ebb_vs_faster_bare_last']:.3f} "
          f"(goal ≤ 1.02); the same greedy replies as bare with the same setting: "
          f"{out['same_replies_as_bare']}")
    return 0


@bench("phases", "each phase at its best against one placement (ratios)",
       ("rpc", "model", "threads", "json"),
       arg("--tuning", required=True, metavar="FILE.json",
           help="autotune's JSON (`ebb-engine autotune --json > FILE`)"),
       arg("--vram-budget", default=None, metavar="SIZE"),
       arg("--ctx", type=int, default=2048),
       arg("--repeats", type=int, default=2))
def cmd_bench_phases(args: argparse.Namespace) -> int:
    from engine.cli.chat import read_tuning
    from engine.config import SessionConfig
    from engine.models.default import resolve_model_path
    from engine.measure.phases_bench import bench_phases
    from engine.units import parse_size

    cfg = SessionConfig(model_path=resolve_model_path(args.model), n_ctx=args.ctx,
                        n_threads=args.threads, rpc=tuple(args.rpc),
                        vram_budget_bytes=parse_size(args.vram_budget) if args.vram_budget else None)
    out = bench_phases(cfg, read_tuning(args.tuning), args.repeats)
    if args.json:
        print(json.dumps(out))
        return 0
    t, one, both = out["tuning"], out["one_placement"], out["per_phase"]
    print(f"one placement: {t['gen_layers']} layers, {args.threads or 'default'} threads; "
          f"per phase: prompt {t['prompt_layers']} layers, {t['prompt_threads']} threads, "
          f"generation {t['gen_layers']} layers, {t['gen_threads']} threads")
    print(f"prompt      {one['prompt_tps']:8.1f} → {both['prompt_tps']:8.1f} tok/s   "
          f"{out['prompt_ratio']}x")
    print(f"generation  {one['gen_tps']:8.1f} → {both['gen_tps']:8.1f} tok/s   {out['gen_ratio']}x")
    print(f"whole turn  {out['turn_time_ratio']}x faster (moves {out['rebalance_s'] * 1e3:.1f} ms); "
          f"{out['phases'].get('reason', '')}; replies equal: {out['replies_equal']}")
    return 0


@bench("media", "a video's frames under one swap, against a swap per frame, a resident projector and a bare "
                "mtmd encode loop (ratios)",
       ("rpc", "model", "threads", "json"),
       arg("--mmproj", default=None, help="default: a generated base projector"),
       arg("--items", default="8,32", help="frame counts to run (default 8,32)"),
       arg("--vram-budget", default=None, metavar="SIZE"),
       arg("--ctx", type=int, default=8192, help="room for 32 frames and more (default 8192)"))
def cmd_bench_media(args: argparse.Namespace) -> int:
    from engine.config import SessionConfig
    from engine.models.default import existing_file, resolve_model_path
    from engine.synth.demo import default_projector_path
    from engine.measure.media_bench import bench_media
    from engine.units import parse_size

    model = resolve_model_path(args.model)
    mmproj = existing_file(args.mmproj, "projector") if args.mmproj else default_projector_path(model)
    try:
        items = [int(x) for x in args.items.split(",") if x.strip()]
    except ValueError:
        raise EbbError(f"--items {args.items!r} is not a list of counts", "write it as 8,32") from None
    cfg = SessionConfig(model_path=model, mmproj_path=mmproj, n_ctx=args.ctx, n_threads=args.threads,
                        rpc=tuple(args.rpc),
                        vram_budget_bytes=parse_size(args.vram_budget) if args.vram_budget else None)
    swap = bool(args.rpc) or _has_gpu()
    out = bench_media(cfg, items, swap)
    if args.json:
        print(json.dumps(out))
        return 0
    if not swap:
        print("no accelerator (no --rpc, no GPU): the swap rows need one; the CPU rows follow")
    for r in out["rows"]:
        print(f"{r['items']:3d} frames  Ebb's CPU encode {r['ebb_encode_s']:.2f} s, bare mtmd loop "
              f"{r['bare_mtmd_s']:.2f} s: Ebb ÷ bare {r['ebb_vs_bare']}x (goal ≤ 1.05)")
        if swap:
            print(f"            one swap for the batch {r['batch_s']:.2f} s ({r['strategy']}), one swap "
                  f"per item {r['per_item_s']:.2f} s, resident {r['resident_s']:.2f} s: batch ÷ per item "
                  f"{r['batch_vs_per_item']}x, batch ÷ resident {r['batch_vs_resident']}x")
    return 0


def _has_gpu() -> bool:
    from engine.llama.devices import list_devices

    return any(d.kind == "gpu" for d in list_devices(()))


@bench("start", "launch to first token, Ebb against bare llama-cpp-python, alternating (ratios)",
       ("model", "threads", "json", "no-flash-attn"),
       arg("--ctx", type=int, default=4096),
       arg("--rounds", type=int, default=5))
def cmd_bench_start(args: argparse.Namespace) -> int:
    from engine.models.default import resolve_model_path
    from engine.measure.start_bench import bench_start

    # the CPU alone: auto is off (flash_attn_for)
    out = bench_start(resolve_model_path(args.model), args.ctx, default_threads(args.threads), args.rounds,
                      flash_attn_arg(args) is True)
    if args.json:
        print(json.dumps(out))
        return 0
    for key, what in (("start_s", "to the model ready"), ("first_token_s", "to the first token")):
        r = out[key]
        print(f"process start {what:20s} Ebb {r['ebb']:.3f}s  bare {r['bare']:.3f}s  "
              f"ratio {r['ratio']:.3f}")
    return 0


@bench("context", "prompt and generation speed at context fills, flash attention on against off, alternating"
                  " (ratios)",
       ("model", "threads", "json"),
       arg("--fills", default="0,1024,4096,8192", help="tokens in the cache before timing"),
       arg("--rounds", type=int, default=2))
def cmd_bench_context(args: argparse.Namespace) -> int:
    from engine.models.default import resolve_model_path
    from engine.measure.context_bench import bench_context

    fills = tuple(int(x) for x in args.fills.split(","))
    out = bench_context(resolve_model_path(args.model), fills, default_threads(args.threads), args.rounds)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{'fill':>6}  {'prompt tok/s FA on / off':>26}  ratio  {'gen tok/s FA on / off':>22}  ratio")
    for r in out["rows"]:
        print(f"{r['fill']:>6}  {r['prompt_tps_fa_on']:>12.1f} / {r['prompt_tps_fa_off']:<11.1f}"
              f"  {r['prompt_ratio_on_off']:.3f}  {r['gen_tps_fa_on']:>10.1f} / {r['gen_tps_fa_off']:<9.1f}"
              f"  {r['gen_ratio_on_off']:.3f}")
    return 0


@bench("serve", "the local server against llama-cpp-python's own, same model and threads, alternating (speed"
                " ratios)",
       ("model", "threads", "json", "no-flash-attn"),
       arg("--ctx", type=int, default=4096),
       arg("--rounds", type=int, default=5),
       arg("--max-tokens", type=int, default=48))
def cmd_bench_serve(args: argparse.Namespace) -> int:
    from engine.models.default import resolve_model_path
    from engine.measure.serve_bench import bench_serve

    out = bench_serve(resolve_model_path(args.model), args.ctx, default_threads(args.threads), args.rounds,
                      # the CPU alone: auto is off there (flash_attn_for)
                      args.max_tokens, flash_attn_arg(args) is True,
                      log=(lambda s: None) if args.json else print)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"Ebb's server against llama_cpp.server, {out['rounds']} rounds, {out['threads']} "
          f"threads, ctx {out['n_ctx']}, flash attention {'on' if out['flash_attn'] else 'off'}; "
          f"the same greedy replies: {out['same_replies']}")
    for key, what, unit in (("ttft_s", "first token, new conversation", "s"),
                            ("gen_tps", "generation", " tok/s"),
                            ("follow_up_ttft_s", "first token, follow-up (history resent)", "s")):
        r = out[key]
        print(f"{what:42s} Ebb {r['ebb']:.3f}{unit}  peer {r['peer']:.3f}{unit}  "
              f"speed ratio {r['speed_ratio']:.3f}")
    return 0


@bench("reopen", "the first token after taking a conversation up again: never left, restored from disk, "
                 "opened and asked after a pause, evaluated again (ratios)",
       ("model", "threads", "json"),
       arg("--sizes", default="1k,4k,16k",
           help="tokens of history (sizes past the model's context are skipped, said)"),
       arg("--rounds", type=int, default=3),
       arg("--no-picture", action="store_true",
           help="leave out the conversation with a picture (a generated projector)"),
       arg("--pause", type=float, default=1.0, metavar="SECONDS",
           help="opened: the seconds between opening the chat and the question"))
def cmd_bench_reopen(args: argparse.Namespace) -> int:

    from engine.models.default import resolve_model_path
    from engine.measure.reopen_bench import bench_reopen, parse_sizes

    out = bench_reopen(resolve_model_path(args.model), parse_sizes(args.sizes), default_threads(args.threads),
                       args.rounds, picture=not args.no_picture, pause_s=args.pause,
                       log=progress_log(args))
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"first token after taking a conversation up again, {out['model']}, {out['threads']} "
          f"threads, median of {out['rounds']} rounds (alternating)")
    print(f"{'history':>16}  {'never left':>10}  {'restored':>9}  {'evaluated':>9}  "
          f"{'restored ÷ never left':>21}  {'evaluated ÷ restored':>20}  state")
    for r in out["rows"]:
        name = f"{r['tokens']:,} tokens" + (" + picture" if r["picture"] else "")
        print(f"{name:>16}  {r['never_left']:>9.3f}s  {r['restored']:>8.3f}s  {r['evaluated']:>8.3f}s  "
              f"{r['restored_vs_never_left']:>21.3f}  {r['evaluated_vs_restored']:>20.2f}  "
              f"{r['state_bytes'] / 2**20:.0f} MiB")
    print(f"asked {out['pause_s']:g} s after the chat was opened (the user reads and types):")
    print(f"{'history':>16}  {'never left':>10}  {'opened':>9}  opened ÷ never left")
    for r in out["rows"]:
        name = f"{r['tokens']:,} tokens" + (" + picture" if r["picture"] else "")
        print(f"{name:>16}  {r['never_left_paused']:>9.3f}s  {r['opened']:>8.3f}s  "
              f"{r['opened_vs_never_left_paused']:>19.3f}")
    for s in out["skipped"]:
        print(f"{s['tokens']:,} tokens: skipped ({s['why']})")
    print("goals: restored ÷ never left ≤ 1.2; opened ÷ never left ≤ 1.05; evaluated ÷ restored "
          "≥ 10 at 16k tokens on a CPU")
    return 0


@bench("contention", "tokens/s with 0, 1 and 2 busy loops beside: Ebb's adaptive threads ÷ the best "
                     "fixed count, and ÷ the peer with its default threads (ratios)",
       ("model", "json"),
       arg("--loads", default="0,1,2", help="busy loops beside, comma-separated"),
       arg("--rounds", type=int, default=3),
       arg("--max-tokens", type=int, default=64),
       arg("--peer", default=None, metavar="PATH",
           help="llama.cpp's llama-server (default: EBB_LLAMA_SERVER, else llama-cpp-python)"))
def cmd_bench_contention(args: argparse.Namespace) -> int:

    from engine.measure.contention_bench import bench_contention, find_peer
    from engine.models.default import resolve_model_path

    loads = [int(x) for x in args.loads.split(",") if x.strip()]
    out = bench_contention(resolve_model_path(args.model), loads, args.rounds, args.max_tokens,
                           find_peer(args.peer), log=progress_log(args))
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{out['model']} on {out['cores']} cores, median of {out['rounds']} rounds; the peer: "
          f"{out['peer']}")
    for phase, what in (("prompt", f"reading a {out['prompt_tokens']}-token prompt"),
                        ("gen", f"generating {out['n_gen']} tokens")):
        i = 0 if phase == "prompt" else 1
        print(f"{what} (tok/s)")
        print(f"{'busy loops':>10}  {'adaptive':>9}  {'best fixed':>14}  {'peer':>7}  "
              f"{'adaptive ÷ best fixed':>21}  {'adaptive ÷ peer':>15}")
        for r in out["rows"]:
            best = r[f"{phase}_best_fixed"]
            print(f"{r['busy_loops']:>10}  {r['tok_s']['adaptive'][i]:>9.1f}  "
                  f"{r['tok_s'][best][i]:>6.1f} ({best})  {r['tok_s']['peer'][i]:>7.1f}  "
                  f"{r[f'{phase}_adaptive_vs_best_fixed']:>21.3f}  {r[f'{phase}_adaptive_vs_peer']:>15.3f}")
    print("goals: adaptive ÷ best fixed ≥ 0.9 at every load; adaptive ÷ peer ≥ 1.5 with one busy loop")
    return 0


@bench("tools", "the tool loop: a result to the next round's first token ÷ a plain prefill of the "
                "same new tokens; a crashing server restarted N times",
       ("model", "threads", "json"),
       arg("--rounds", type=int, default=5),
       arg("--lines", type=int, default=30, help="lines of the demo server's result (its tokens)"),
       arg("--cycles", type=int, default=100, help="crash-and-restart cycles"))
def cmd_bench_tools(args: argparse.Namespace) -> int:
    from engine.measure.tools_bench import bench_tools
    from engine.models.default import resolve_model_path

    out = bench_tools(resolve_model_path(args.model), args.rounds, args.lines, args.cycles,
                      args.threads, progress_log(args))
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{out['model']}: a tool result of {out['result_lines']} lines, {out['new_tokens']:.0f} new "
          f"tokens in the next round (median of {out['rounds']})")
    print(f"  result → next round's first token  {out['after_result_ms']:8.1f} ms")
    print(f"  plain prefill of the same tokens     {out['plain_prefill_ms']:8.1f} ms")
    print(f"  ratio                                {out['ratio']:8.3f}  (goal ≤ 1.05: nothing evaluated again)")
    print(f"crash and restart: {out['crash_cycles']} cycles, {out['crash_hangs']} hangs, "
          f"{out['crash_failed_cleanly']} calls failed cleanly, {out['crash_cycle_s']:.2f} s a cycle")
    return 0


@bench("speculate", "greedy replies with n-gram drafts ÷ without, on a reply that quotes its "
                    "prompt and one that does not",
       ("model", "threads", "json"),
       arg("--rounds", type=int, default=3),
       arg("--max-tokens", type=int, default=128),
       arg("--peer", default=None, metavar="PATH",
           help="llama.cpp's llama-server, run beside (default: EBB_LLAMA_SERVER, else none)"))
def cmd_bench_speculate(args: argparse.Namespace) -> int:
    from engine.measure.contention_bench import find_peer
    from engine.measure.speculate_bench import bench_speculate
    from engine.models.default import resolve_model_path

    out = bench_speculate(resolve_model_path(args.model), args.rounds, args.max_tokens, args.threads,
                          progress_log(args), find_peer(args.peer))
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{out['model']}: greedy, {out['max_tokens']} tokens, median of {out['rounds']} (tok/s)")
    print(f"{'reply':>8}  {'drafts':>8}  {'none':>8}  {'ratio':>6}  {'peer':>8}  {'÷ peer':>7}  taken of drafted")
    for name, r in out["rows"].items():
        peer = f"{r['tok_s_peer']:>8.1f}  {r['vs_peer']:>7.2f}" if "tok_s_peer" in r else f"{'-':>8}  {'-':>7}"
        print(f"{name:>8}  {r['tok_s_auto']:>8.1f}  {r['tok_s_off']:>8.1f}  {r['ratio']:>6.2f}  {peer}  "
              f"{r['taken']} of {r['drafted']}")
    if out["peer"]:
        print(f"peer: {out['peer']}")
    return 0


@bench("draft", "a draft model (the model itself) guessing for its own larger copy (llama.cpp's quantize "
                 "makes it once) ÷ the copy alone (ratio)",
       ("model", "threads", "json"),
       arg("--copy", choices=["q8_0", "f16"], default="f16", help="the copy drafted for"),
       arg("--rounds", type=int, default=3),
       arg("--max-tokens", type=int, default=128))
def cmd_bench_draft(args: argparse.Namespace) -> int:
    from engine.measure.speculate_bench import bench_draft
    from engine.models.default import resolve_model_path

    out = bench_draft(resolve_model_path(args.model), args.copy, args.rounds, args.max_tokens,
                      args.threads, progress_log(args))
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{out['model']} drafting for {out['target']}, greedy, {out['max_tokens']} tokens, median "
          f"of {out['rounds']}: {out['tok_s_draft']:.1f} tok/s with drafts, {out['tok_s_alone']:.1f} "
          f"alone, ratio {out['ratio']:.2f} ({out['taken']} of {out['drafted']} guesses taken)")
    return 0


@bench("peer", "Ebb's server beside llama.cpp's llama-server (built once into Ebb's cache): one client, "
                "several at once, a reply that copies its prompt (ratios)",
       ("model", "threads", "json"),
       arg("--ctx", type=int, default=4096, help="each conversation's context"),
       arg("--rounds", type=int, default=3),
       arg("--max-tokens", type=int, default=200),
       arg("--clients", type=int, default=4, help="clients at once (and each server's parallel sequences)"))
def cmd_bench_peer(args: argparse.Namespace) -> int:
    from engine.measure.peer_bench import bench_peer
    from engine.models.default import resolve_model_path

    out = bench_peer(resolve_model_path(args.model), args.ctx, default_threads(args.threads), args.rounds,
                     args.max_tokens, args.clients, progress_log(args))
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{out['model']}: Ebb ÷ llama-server, {out['threads']} threads, {out['max_tokens']} tokens, "
          f"{out['clients']} at once, median of {out['rounds']} rounds (ratio over 1: Ebb faster)")
    words = {"first_token_s": "one client: first token (s)", "gen_tok_s": "one client: generation tok/s",
             "many_tok_s": f"{out['clients']} at once: tok/s in all",
             "many_last_first_token_s": f"{out['clients']} at once: the last first token (s)",
             "copy_tok_s": "a reply that copies: tok/s"}
    for key, what in words.items():
        r = out["rows"][key]
        print(f"{what:42s} Ebb {r['ebb']:>8.3f}  llama-server {r['peer']:>8.3f}  ratio {r['ratio']:.3f}")
    print(f"{out['clients']} at once ÷ one client (Ebb, tok/s in all): {out['rows']['many_vs_one']['ebb']:.3f}")
    print(f"peer: {out['peer']}")
    return 0


def register(sub: Subcommands) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    benches = p.add_subparsers(dest="bench", required=True)
    for b in BENCHES:
        q = benches.add_parser(b.name, help=b.help, parents=[flag_parser(*b.flags)])
        for names, kw in b.arguments:
            q.add_argument(*names, **kw)
        q.set_defaults(func=b.run)
