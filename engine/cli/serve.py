"""`ebb-engine serve`: an OpenAI-compatible endpoint on this machine (engine/server)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from engine.cli.chat import SESSION_FLAGS, add_session_flags, session_config
from engine.server.limits import DEFAULT_MAX_BODY, DEFAULT_MAX_WAIT_S, DEFAULT_PORT
from engine.cli.common import Subcommands, flag_parser
from engine.errors import EbbError

if TYPE_CHECKING:
    import uvicorn


def cmd_serve(args: argparse.Namespace) -> int:
    from engine.server.http import is_loopback, serve
    from engine.server.jobs import Answer, Job
    from engine.server.worker import ServeWorker
    from engine.units import parse_size

    if not 0 < args.port < 65536:
        raise EbbError(f"--port must be 1–65535, got {args.port}")
    if args.queue < 1:
        raise EbbError(f"--queue must be at least 1, got {args.queue}")
    api_key = args.api_key or os.environ.get("EBB_API_KEY") or None
    if not is_loopback(args.host):
        print(f"ebb-engine: warning: serving on {args.host}, not only this machine: anyone who "
              f"can reach port {args.port} can use the model"
              + ("" if api_key else " (no --api-key set)"), file=sys.stderr, flush=True)
    image_folder = Path(args.allow_files).expanduser() if args.allow_files else None
    if image_folder is not None and not image_folder.is_dir():
        raise EbbError(f"--allow-files must name a folder: {image_folder} is not one")
    if args.parallel < 0:
        raise EbbError(f"--parallel must be 0 (auto) or more, got {args.parallel}")
    cfg = replace(session_config(args), parallel=args.parallel)
    image_dir = Path(tempfile.mkdtemp(prefix="ebb-serve-images-"))

    def log_turn(job: Job, a: Answer) -> None:
        t = a.turn
        line = {"client": job.client, "n_images": t.n_images if t else 0,
                "strategy": t.strategy if t else None, "prompt_tokens": a.prompt_tokens,
                "completion_tokens": a.completion_tokens, "finish_reason": a.finish_reason,
                "client_gone": a.client_gone,
                "gen_tokens_per_s": round(t.gen.gen_tokens_per_s, 2) if t else None}
        print(f"ebb-engine serve: {json.dumps(line)}", file=sys.stderr, flush=True)

    worker = ServeWorker(cfg, image_dir, max_queue=args.queue, on_turn=log_turn)

    def announce(server: uvicorn.Server) -> None:
        print(f"ebb-engine: serving {cfg.model_path.name} at http://{args.host}:{args.port}/v1 "
              f"(OpenAI-compatible; the model loads now)", file=sys.stderr, flush=True)

    # uvicorn stops gracefully on Ctrl-C and SIGTERM, then raises the signal again: with the
    # default handlers the process would die there, before the worker keeps the last
    # conversation's state and the images folder is emptied. These end it through `finally`.
    import signal

    def leave(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(130 if signum == signal.SIGINT else 0)

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, leave)
    try:
        serve(worker, args.host, args.port, api_key=api_key,
              max_body=parse_size(args.max_body), ready=announce, cors=tuple(args.cors),
              allow_hosts=tuple(args.allow_host), image_folder=image_folder,
              max_wait_s=args.max_wait)
    finally:
        worker.close()
        for f in image_dir.glob("*"):
            f.unlink(missing_ok=True)
        image_dir.rmdir()
    return 0


def register(sub: Subcommands) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP endpoint (/v1/chat/completions)",
                       parents=[flag_parser(*SESSION_FLAGS)])
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default loopback; any other address warns)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--cors", action="append", default=[], metavar="ORIGIN",
                   help="let browser pages from ORIGIN (e.g. http://localhost:3000) call the API; "
                        "off by default; repeat for more")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="also answer requests addressed to host NAME (a proxy's or a LAN name; "
                        "by default only the address listened on: names a web page could "
                        "rebind to this machine are refused); repeat for more")
    p.add_argument("--allow-files", default=None, metavar="FOLDER",
                   help="let file:// image URLs name pictures inside FOLDER (off by default: "
                        "pictures come as data URLs)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every request (or EBB_API_KEY)")
    p.add_argument("--parallel", type=int, default=0, metavar="N",
                   help="requests answered at once, decoded together (text requests beside the "
                        "one the session answers; default 0: 4 on the CPU alone, 1 with an "
                        "accelerator)")
    p.add_argument("--queue", type=int, default=8,
                   help="requests that may wait while one is answered (more: 503, Retry-After)")
    p.add_argument("--max-wait", type=float, default=DEFAULT_MAX_WAIT_S, metavar="SECONDS",
                   help="how long a request that is not streamed may wait in line before a 503 "
                        "with Retry-After (0: no limit; a stream sees its place every second)")
    p.add_argument("--max-body", default=f"{DEFAULT_MAX_BODY >> 20}MiB", metavar="SIZE",
                   help="largest request body (pictures as base64 count 4/3; more: 413)")
    add_session_flags(p)
    p.set_defaults(func=cmd_serve, max_tokens=0, memory_disk="4GiB")
