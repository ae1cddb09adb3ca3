"""`ebb-engine`: the engine from a terminal (no display needed). One module per command group;
flags several commands share come from `engine.cli.common`.

Every problem a user can fix prints one line on stderr and exits with code 2.
"""
from __future__ import annotations

import argparse
import sys

from engine.cli.common import EXIT_INTERRUPTED, EXIT_USER_ERROR, exit_on_interrupt

exit_on_interrupt()  # Ctrl-C from the first import on: one line, exit 130, no traceback

from engine.cli import bench, chat, devices, files, serve, tuning  # noqa: E402
from engine.errors import EbbError  # noqa: E402

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ebb-engine", description="Ebb's engine, headless.")
    sub = ap.add_subparsers(dest="command", required=True)
    for group in (chat, serve, files, devices, tuning, bench):
        group.register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    exit_on_interrupt()  # a command that can stop gracefully installs its own handler
    import faulthandler

    faulthandler.enable()  # a native crash says where it happened on stderr, not nothing
    try:
        args = build_parser().parse_args(argv)
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
