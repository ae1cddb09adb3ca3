"""`ebb-engine chat`: a conversation from the terminal, one line or a script of turns."""
from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path
from typing import Any

from engine.cli.common import (
    Subcommands,
    EXIT_INTERRUPTED,
    EXIT_USER_ERROR,
    flag_parser,
    flash_attn_arg,
    install_sigint,
)
from engine import testhooks
from engine.config import PhaseTuning, SessionConfig
from engine.hw import process_age_s
from engine.errors import EbbError
from engine.stops import StopReason
from engine.tune_result import TuneResult


def _read_script(path: str) -> list[dict[str, Any]]:
    from engine.models.default import existing_file

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


def read_tuning(path: str) -> PhaseTuning:
    """Autotune's JSON (`ebb-engine autotune --json > FILE`) as a per-phase choice."""
    return read_tuning_file(path)[0]


def read_tuning_file(path: str) -> tuple[PhaseTuning, bool | None]:
    """Autotune's JSON: the per-phase choice, and flash attention as it chose it (None: it
    did not measure it)."""
    try:
        result = TuneResult.from_dict(json.loads(Path(path).read_text()))
        fa = result.flash_attn
        return result.phase_tuning(), (fa.on if fa else None)
    except OSError as exc:
        raise EbbError(f"cannot read the tuning {path}: {exc.strerror or exc}") from exc
    except (ValueError, KeyError, TypeError, StopIteration) as exc:
        raise EbbError(f"{path} is not autotune's JSON ({exc!r})",
                       "write it with `ebb-engine autotune --json > FILE`") from exc


def session_config(args: argparse.Namespace) -> SessionConfig:
    from engine.models.default import existing_file, resolve_model_path
    from engine.paths import data_dir
    from engine.units import parse_size

    if args.max_tokens < 0:
        raise EbbError(f"--max-tokens must be 0 (no cap) or more, got {args.max_tokens}")
    if args.threads is not None and args.threads <= 0:
        raise EbbError(f"--threads must be positive, got {args.threads}")
    if args.gpu_layers is not None and args.gpu_layers < 0:
        raise EbbError(f"--gpu-layers must be 0 or more, got {args.gpu_layers}")
    if args.threads_batch is not None and args.threads_batch <= 0:
        raise EbbError(f"--threads-batch must be positive, got {args.threads_batch}")
    phases, tuned_fa = read_tuning_file(args.tuning) if args.tuning else (None, None)
    return SessionConfig(
        phases=phases,
        n_threads_batch=args.threads_batch,
        model_path=resolve_model_path(args.model),
        mmproj_path=existing_file(args.mmproj, "projector") if args.mmproj else None,
        n_ctx=args.ctx, n_threads=args.threads,
        vram_budget_bytes=parse_size(args.vram_budget) if args.vram_budget else None,
        # --flash-attn on|off wins; else what the tuning measured faster on this device; else
        # auto (the session decides by where the layers run: flash_attn_for)
        vision=args.vision,
        flash_attn=flash_attn_arg(args) if flash_attn_arg(args) is not None else tuned_fa,
        system=args.system,
        mover=args.mover, rpc=tuple(args.rpc), gpu_layers=args.gpu_layers, spread=args.spread,
        overflow=args.overflow, image_cache_bytes=parse_size(args.image_cache),
        state_dir=data_dir() / "states", state_disk_bytes=parse_size(args.memory_disk),
        draft_path=existing_file(args.draft, "draft model") if args.draft else None)


def cmd_chat(args: argparse.Namespace) -> int:
    from engine.llama.sampling import GenParams
    from engine.session import Session, turn_with_recovery

    if args.script is None and args.prompt is None:
        raise EbbError("nothing to say", "pass --prompt TEXT or --script FILE.json")
    if args.script is not None:
        turns = _read_script(args.script)
    else:
        turns = [{"text": args.prompt, "images": args.image}]
    cfg = session_config(args)
    cancel = threading.Event()
    gp = GenParams(max_tokens=args.max_tokens, temperature=args.temp, seed=args.seed,
                   top_logprobs=args.top_logprobs, speculate=args.speculate)
    first_token: list[float] = []  # seconds from the process's start to the first token

    def on_text(piece: str) -> None:
        if not first_token:
            first_token.append(process_age_s())
        if not args.json:
            print(piece, end="", flush=True)
    all_spans: list[Any] = []
    failed = cancelled = False
    from engine.llama import native

    if args.safe_mode:
        native.set_safe_mode(True, "--safe-mode")
    crash = native.peek_crash()
    if crash is not None and not native.safe_mode():  # said here; the window shows it too
        print(f"ebb-engine: note: {crash.describe()} If this run dies the same way, add "
              "--safe-mode.", file=sys.stderr, flush=True)
    testhooks.say_loading()  # test hook: the moment the load starts
    session = Session(cfg)  # Ctrl-C meanwhile ends the process at once (exit_on_interrupt)
    start_s = process_age_s()  # process start to model ready: imports, header, load, context
    from engine.llama.about import backend_notes

    notes = backend_notes()  # a GPU backend built in but not loaded, safe mode: said once
    if session.projector_refused:
        notes.append(session.projector_refused)
    if session.model.draft_refused:
        notes.append(session.model.draft_refused)
    for note in notes:
        print(f"ebb-engine: note: {note}", file=sys.stderr, flush=True)
    install_sigint(cancel)  # from here on the first Ctrl-C stops between tokens
    tools = _ToolsForChat(args) if args.mcp else None
    try:
        for i, turn in enumerate(turns):
            if cancel.is_set():
                break
            if tools is not None:
                session, tt = tools.turn(session, turn["text"], turn["images"], gp, on_text, cancel,
                                         cfg.system, first=i == 0)
                res = tt.last
                for r in tt.rounds[:-1]:
                    all_spans.extend(r.spans)
            else:
                session, res = turn_with_recovery(session, turn["text"], turn["images"], gp,
                                                  on_text=on_text, cancel=cancel)
            all_spans.extend(res.spans)
            out = res.to_dict()
            if tools is not None:
                out.update(tools.turn_dict(tt))
            out.update(model=str(cfg.model_path), n_threads=session.n_threads,
                       n_ctx=session.n_ctx, accelerator=session.model.accel,
                       n_gpu_layers=session.model.placement.n_gpu_layers,
                       n_layers_on_accel=session.model.placement.n_layers_on_accel,
                       layers_by_device=session.model.placement.layers_by_device,
                       placement_reason=session.model.placement_reason,
                       mover=session.model.mover_name,
                       mover_note="; ".join(n for n in (session.model.mover_note, res.mover_note) if n),
                       rpc_bytes_sent=session.load_rpc_bytes_sent, load_s=round(session.load_s, 3),
                       notes=notes, start_s=round(start_s, 3),
                       first_token_s=round(first_token[0], 3) if first_token else None)
            cancelled = cancelled or out.get("stop_reason") == StopReason.CANCELLED
            failed = failed or res.error is not None
            _print_turn(out, args.json)
    finally:
        if tools is not None:
            tools.close()
        session.close()
    if args.trace:
        from engine.trace import write_chrome_trace

        write_chrome_trace(Path(args.trace), all_spans)
    if cancelled:
        return EXIT_INTERRUPTED
    return EXIT_USER_ERROR if failed and args.script is None else 0


class _ToolsForChat:
    """`chat --mcp FILE`: the file's servers (each stdio one started after a yes on the terminal,
    or --allow-tools), and each turn through the tool loop (engine/tools/loop.py)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from engine.paths import data_dir
        from engine.tools.host import READY, ToolHost
        from engine.tools.servers import read_config

        self.args = args
        defs = read_config(Path(args.mcp).expanduser())
        if not defs and not Path(args.mcp).expanduser().is_file():
            raise EbbError(f"{args.mcp} does not exist", "pass an MCP servers file: "
                           '{"mcpServers": {NAME: {"command": ..., "args": [...]}}}')
        self.host = ToolHost(data_dir() / "tool-files")
        self.always: set[str] = set()
        self.host.set_servers(defs, self._consent)
        self.host.settled(self.host.start_timeout_s + 5)  # each is ready or failed by then
        for s in self.host.states():
            if s.phase != READY:
                tail = f" (its last words: {s.stderr_tail.splitlines()[-1]})" if s.stderr_tail else ""
                print(f"ebb-engine: tools: {s.name}: {s.words()}{tail}", file=sys.stderr, flush=True)
            elif s.skipped:
                print(f"ebb-engine: tools: {s.name}: left out: {'; '.join(s.skipped)}", file=sys.stderr,
                      flush=True)

    def _ask(self, question: str) -> str:
        if self.args.allow_tools:
            return "y"
        print(question, end=" ", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        return line.strip().lower()[:1]

    def _consent(self, d: Any) -> bool:
        if not d.stdio:
            return True
        return self._ask(f"ebb-engine: start the MCP server {d.name!r}: {d.describe()} ? [y/N]") == "y"

    def _decide(self, rec: Any) -> Any:
        from engine.tools.loop import Decision

        answer = self._ask(f"\nebb-engine: call {rec.label} with {json.dumps(rec.arguments)} ? "
                           "[y]es once, [a]lways for this tool, [N]o")
        return {"y": Decision.ONCE, "a": Decision.ALWAYS}.get(answer, Decision.DENY)

    def turn(self, session: Any, text: str, images: list[str], gp: Any, on_text: Any,
             cancel: threading.Event, system: str | None, first: bool) -> Any:
        from engine.tools.loop import first_choice, offer, run_tool_turn

        offered, left = offer(self.host.tools())
        for why in left:
            print(f"ebb-engine: tools: left out {why}", file=sys.stderr, flush=True)
        choice = first_choice(self.args.tool_choice, offered) if first else None
        return run_tool_turn(
            session, text, images, gp, offered, ask=self._decide, always=self.always,
            call=lambda rec, c: self.host.call(rec.label.split(":", 1)[0], _tool_name(offered, rec),
                                               rec.arguments, c),
            on_text=on_text, on_call=self._said if not self.args.json else None, cancel=cancel,
            choice=choice, system=system, max_rounds=self.args.max_tool_rounds)

    def _said(self, rec: Any) -> None:
        if rec.state in ("done", "failed", "denied", "cancelled", "timeout", "repeat"):
            head = (rec.outcome.text if rec.outcome else "").splitlines()[:1]
            print(f"\n[{rec.label} {rec.state}{': ' + head[0][:200] if head else ''}]",
                  file=sys.stderr, flush=True)

    @staticmethod
    def turn_dict(tt: Any) -> dict[str, Any]:
        return {"text": tt.text,
                "tool_calls": [c.to_dict() for c in tt.calls], "tool_rounds": len(tt.rounds),
                "tool_turn_ended": tt.ended, "tool_turn_message": tt.message}

    def close(self) -> None:
        self.host.close()


def _tool_name(offered: list[Any], rec: Any) -> str:
    return str(next(o.tool.name for o in offered if o.fn == rec.fn))


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


def add_session_flags(p: argparse.ArgumentParser) -> None:
    """The flags that shape the session (model placement, vision, context): chat and serve."""
    p.add_argument("--vision", choices=["auto", "resident", "swap", "cpu"], default="auto")
    p.add_argument("--mover", choices=["auto", "live", "reload"], default="auto",
                   help="how a swap moves the model: live layers (after a self-test) or reload")
    p.add_argument("--spread", action="store_true",
                   help="deal layers over every accelerator (local and --rpc) by measured link "
                        "(default: only when the first cannot hold the model)")
    p.add_argument("--gpu-layers", type=int, default=None, metavar="N",
                   help="at most N layers on the accelerator (see autotune; default: all that fit)")
    p.add_argument("--threads-batch", type=int, default=None, metavar="N",
                   help="threads for prompt batches (default: --threads)")
    p.add_argument("--tuning", default=None, metavar="FILE.json",
                   help="autotune's JSON: generation at its best layers and threads, prompts "
                        "with theirs, and a long prompt at its best layers (live mover)")
    p.add_argument("--system", default=None)
    p.add_argument("--image-cache", default="1GiB", metavar="SIZE",
                   help="most image embeddings kept in RAM (least recently used leave first and "
                        "are encoded again when needed; default 1GiB)")
    p.add_argument("--draft", default=None, metavar="MODEL.gguf",
                   help="a small model of the same vocabulary that guesses the reply's next tokens "
                        "(speculative decoding; the reply is the loaded model's)")
    p.add_argument("--memory-disk", default="0", metavar="SIZE",
                   help="the model's memory of conversations (KV states) and encoded pictures "
                        "kept in the data folder's states/, so a conversation taken up again is "
                        "not evaluated again (least recently used leave first; 0: keep none; "
                        "default: 0 for chat, whose runs measure, 4GiB for serve)")
    p.add_argument("--overflow", choices=["drop-oldest", "stop"], default="drop-oldest",
                   help="when a turn does not fit the context: let the oldest turns go (images "
                        "of older turns first; default) or refuse the turn")
    p.add_argument("--ctx", type=int, default=None, help="context length (default: min(4096, model's))")


SESSION_FLAGS = ("rpc", "model", "mmproj", "threads", "vram-budget", "no-flash-attn")


def cmd_mcp_demo(args: argparse.Namespace) -> int:
    from engine.tools.demo_server import build

    build().run()  # stdio: a client starts it and talks over its stdin and stdout
    return 0


def register(sub: Subcommands) -> None:
    d = sub.add_parser("mcp-demo", help="Ebb's own small MCP server over stdio (echo, lines, "
                                        "colour): to try tools (`chat --mcp`, the window's Tools)")
    d.set_defaults(func=cmd_mcp_demo)
    p = sub.add_parser("chat", help="chat with a model from the terminal",
                       parents=[flag_parser(*SESSION_FLAGS)])
    p.add_argument("--prompt", default=None)
    p.add_argument("--attach", "--image", dest="image", action="append", default=[], metavar="FILE",
                   help="a picture, clip, video (clip.mp4#every=4), PDF (doc.pdf#pages=3-5) or text "
                        "file the message carries (repeatable; --image is its older name)")
    p.add_argument("--script", default=None, help='JSON list of {"text", "images"} user turns')
    add_session_flags(p)
    p.add_argument("--trace", default=None, metavar="FILE.json", help="write Chrome trace JSON")
    p.add_argument("--safe-mode", action="store_true",
                   help="llama.cpp on the CPU only, without extra weight layouts (after a crash)")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="cap on each reply's tokens (default 0: until the model stops or the "
                        "context is full)")
    p.add_argument("--temp", type=float, default=0.7, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object per turn")
    p.add_argument("--speculate", choices=["auto", "off"], default="auto",
                   help="draft tokens from what the conversation already holds (n-gram lookup) "
                        "and check them in one batch: greedy replies (--temp 0) only; auto "
                        "stops where it does not pay")
    p.add_argument("--mcp", default=None, metavar="FILE.json",
                   help='tools from the MCP servers of this file ({"mcpServers": {...}}, as '
                        "Claude Desktop and LM Studio write it): the model may call them, each "
                        "call asked on the terminal")
    p.add_argument("--allow-tools", action="store_true",
                   help="with --mcp: start the file's servers and allow every call without asking")
    p.add_argument("--tool-choice", default="auto", metavar="auto|required|none|NAME",
                   help="with --mcp: what the first round may do (NAME: call that tool)")
    p.add_argument("--max-tool-rounds", type=int, default=8, metavar="N",
                   help="with --mcp: rounds of calls in one turn before the model answers "
                        "without tools (default 8)")
    p.add_argument("--top-logprobs", type=int, default=-1, metavar="N",
                   help="with --json: each reply token's logprob and the N most likely "
                        "(OpenAI's shape, under \"logprobs\")")
    p.set_defaults(func=cmd_chat)
