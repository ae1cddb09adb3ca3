"""`ebb-engine`: the engine from a terminal (no display needed). One module per command group;
flags several commands share come from `engine.cli.common`.

Every problem a user can fix prints one line on stderr and exits with code 2.
"""
from __future__ import annotations

import argparse
import os
import sys

from engine.cli.common import EXIT_INTERRUPTED, EXIT_USER_ERROR, exit_on_interrupt

exit_on_interrupt()  # Ctrl-C from the first import on: one line, exit 130, no traceback

import importlib  # noqa: E402

from engine.errors import EbbError  # noqa: E402

__all__ = ["GROUPS", "build_parser", "main"]

# each module of engine/cli and the commands it registers (a test holds this to what they do)
GROUPS = {"chat": ("chat", "mcp-demo"), "serve": ("serve",),
          "files": ("inspect", "make-projector", "make-model", "fetch-model"),
          "devices": ("devices", "about", "rpc-serve", "native-check", "colour-check"),
          "sizing": ("plan", "calibrate", "autotune"), "bench": ("bench",), "models": ("models",)}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser; or, given the command typed, only its group's: importing and
    building all of them is ~10-20 ms of every start. An unknown command, or none,
    gets them all, so help and "invalid choice" list every command."""
    ap = argparse.ArgumentParser(prog="ebb-engine", description="Ebb's engine, headless.")
    sub = ap.add_subparsers(dest="command", required=True)
    groups = [g for g, commands in GROUPS.items() if command in commands] or list(GROUPS)
    for group in groups:
        importlib.import_module(f"engine.cli.{group}").register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    exit_on_interrupt()  # a command that can stop gracefully installs its own handler
    import faulthandler

    from engine import crashlog

    role = os.environ.get(crashlog.ROLE_ENV)
    if role:  # a process the window started (the stand-in): its crash file, for the next start
        crashlog.enable(role)
    else:
        faulthandler.enable()  # a native crash says where it happened on stderr, not nothing
    try:
        argv = sys.argv[1:] if argv is None else argv
        args = build_parser(argv[0] if argv else None).parse_args(argv)
        from engine.llama import fatal

        fatal.install(fatal.exit_with_message("ebb-engine"))
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
