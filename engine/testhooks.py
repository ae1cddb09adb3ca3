"""Every test-only hook, in one place. Each is an environment variable a test sets for a child
process; unset (as for every user), each does nothing. Any thread.

| variable | where | what it does |
| --- | --- | --- |
| EBB_TEST_PAUSE_AT=NAME | engine steps (load, prefill, encode, evict, ...) | say so on stderr and wait there, so a test can kill the process inside that step |
| EBB_TEST_SAY_LOADING=1 | `ebb-engine chat` | say on stderr when the load starts |
| EBB_TEST_BREAK_LIVE_MOVER=1 | the live mover's self-test | its comparison fails |
| EBB_TEST_NATIVE_CRASH=1, =always | a model's first decode | the process dies by SIGSEGV, as a bad native build kills it (=1: not in safe mode) |
| EBB_TEST_SEND=TEXT, EBB_TEST_IMAGE=PATH | the window | send TEXT (with the picture) once the model is loaded; print "streaming" at the first reply token |
| EBB_TEST_PRINT_NOTICE=1 | the window | print the notice and quit |
| EBB_QUIT_WHEN_SHOWN=1 | the window | print "shown SECONDS VISIBLE" once it is painted, and quit (the start-up time test) |
| EBB_CALIBRATION=PATH | the calibration store | read and write this file instead of the cache's (each test run keeps its own) |
| EBB_TEST_N_BATCH=N | every text runtime | evaluate prompts in batches of N (the numerics-shaking run: `make test-numerics`) |
"""
from __future__ import annotations

import os
import sys
import time

PAUSE_AT = "EBB_TEST_PAUSE_AT"
SAY_LOADING = "EBB_TEST_SAY_LOADING"
BREAK_LIVE_MOVER = "EBB_TEST_BREAK_LIVE_MOVER"
NATIVE_CRASH = "EBB_TEST_NATIVE_CRASH"
SEND = "EBB_TEST_SEND"
IMAGE = "EBB_TEST_IMAGE"
PRINT_NOTICE = "EBB_TEST_PRINT_NOTICE"
QUIT_WHEN_SHOWN = "EBB_QUIT_WHEN_SHOWN"
CALIBRATION = "EBB_CALIBRATION"
N_BATCH = "EBB_TEST_N_BATCH"


def value(name: str) -> str:
    return os.environ.get(name, "")


def pause_point(name: str) -> None:
    """With EBB_TEST_PAUSE_AT=NAME: say so on stderr when step NAME starts and wait there."""
    if name and value(PAUSE_AT) == name:
        print(f"ebb-test: paused in {name}", file=sys.stderr, flush=True)
        time.sleep(600)


def say_loading() -> None:
    if value(SAY_LOADING):
        print("ebb-engine: loading", file=sys.stderr, flush=True)


def live_mover_broken() -> bool:
    return value(BREAK_LIVE_MOVER) == "1"


def crash_at_first_decode(safe_mode: bool) -> None:
    """Die by SIGSEGV (not in safe mode, unless =always)."""
    crash = value(NATIVE_CRASH)
    if crash == "always" or crash and not safe_mode:
        import signal

        os.kill(os.getpid(), signal.SIGSEGV)


def n_batch(default: int) -> int:
    """The prompt batch size: EBB_TEST_N_BATCH where set (a whole number from 1), else `default`."""
    raw = value(N_BATCH)
    return int(raw) if raw.isdigit() and int(raw) > 0 else default
