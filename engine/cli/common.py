"""Flags several commands share (argparse parent parsers) and small helpers of the commands.
Every problem a user can fix is an EbbError: `main` prints it as one line and exits with 2."""
from __future__ import annotations

import argparse
import os
import signal
import threading
from types import FrameType
from typing import Callable, TypeAlias

# what `add_subparsers()` gives, where each command registers itself
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


def flag_parser(*flags: str) -> argparse.ArgumentParser:
    """A parent parser with the named shared flags (see FLAGS)."""
    p = argparse.ArgumentParser(add_help=False)
    for name in flags:
        FLAGS[name](p)
    return p


FLAGS: dict[str, Callable[[argparse.ArgumentParser], object]] = {
    "rpc": lambda p: p.add_argument("--rpc", action="append", default=[], metavar="HOST:PORT",
                                    help="add a ggml RPC server's devices (repeatable)"),
    "json": lambda p: p.add_argument("--json", action="store_true", help="print JSON"),
    "model": lambda p: p.add_argument("--model", default="default",
                                      help="GGUF path, or 'default' (SmolLM2-135M)"),
    "mmproj": lambda p: p.add_argument("--mmproj", default=None,
                                       help="vision projector GGUF (held in RAM)"),
    "threads": lambda p: p.add_argument("--threads", type=int, default=None,
                                        help="default: physical cores"),
    "vram-budget": lambda p: p.add_argument("--vram-budget", default=None, metavar="SIZE",
                                            help="cap on the accelerator, e.g. 150MiB, 6GiB "
                                                 "(default: free - margin)"),
    "no-flash-attn": lambda p: (
        p.add_argument("--flash-attn", choices=["auto", "on", "off"], default="auto",
                       help="auto (default): on when layers run on an accelerator, off on the "
                            "CPU alone"),
        p.add_argument("--no-flash-attn", dest="flash_attn", action="store_const", const="off",
                       help="the same as --flash-attn off")),
}


def flash_attn_arg(args: argparse.Namespace) -> bool | None:
    """--flash-attn as SessionConfig.flash_attn: None for auto."""
    from engine.config import flash_choice

    return flash_choice(args.flash_attn)


def exit_on_interrupt() -> None:
    """Until a command can stop gracefully, Ctrl-C ends the process at once: one line, exit 130
    (nothing is half-written then: the engine writes its files atomically). A model load is one
    long call into llama.cpp; its progress callback lets this handler run during it."""
    def handler(signum: int, frame: FrameType | None) -> None:
        os.write(2, b"ebb-engine: interrupted\n")
        from engine import crashlog

        crashlog.discard()  # ended on purpose: nothing to report at the window's next start
        os._exit(EXIT_INTERRUPTED)
    signal.signal(signal.SIGINT, handler)


def install_sigint(cancel: threading.Event) -> None:
    """First Ctrl-C asks the generation to stop between tokens; a second one aborts."""
    def handler(signum: int, frame: FrameType | None) -> None:
        if cancel.is_set():
            raise KeyboardInterrupt
        cancel.set()
    signal.signal(signal.SIGINT, handler)
