"""From launch to the first token, Ebb against the bare library: `ebb-engine bench start`.

Each round starts fresh processes, alternating which side goes first: `ebb-engine chat --prompt
hi --max-tokens 1` and a bare llama-cpp-python script that loads the same model with the same
context, threads and flash-attention setting and streams one token.
- first token: timed here, from just before the process is started to the first byte of the
  streamed token on its standard output (a monotonic clock: well under a millisecond);
- model ready: each process's own age when its model is ready (`start_s` in `--json`), which
  the kernel keeps in clock ticks (10 ms).
Prints the medians and their ratios (Ebb ÷ bare; the goal is ≤ 1.05).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

AGE = """
def age():
    import os
    with open("/proc/self/stat") as fh:
        ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as fh:
        return float(fh.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
"""

BARE = AGE + """
import json, sys
import llama_cpp
model, n_ctx, threads, fa = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
llm = llama_cpp.Llama(model, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                      flash_attn=fa, verbose=False)
ready = age()
for chunk in llm.create_chat_completion(messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=1, stream=True, temperature=0):
    piece = chunk["choices"][0]["delta"].get("content")
    if piece:
        if sys.argv[5] == "stream":
            print(piece, end="", flush=True)
        break
if sys.argv[5] == "json":
    print(json.dumps({"start_s": ready}))
"""


def _env() -> dict[str, str]:
    """Both sides may cache their bytecode, as a user's machine does (a bundle carries it
    compiled): with PYTHONDONTWRITEBYTECODE every start compiles each module again, and Ebb
    has more of its own (this machine's shell sets it: 0.17 s of Ebb's start)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def _ebb_cmd(model: Path, n_ctx: int, threads: int, flash_attn: bool, json_out: bool) -> list[str]:
    return [sys.executable, "-m", "engine", "chat", "--model", str(model), "--prompt", "hi",
            "--max-tokens", "1", "--temp", "0", "--threads", str(threads), "--ctx", str(n_ctx),
            "--flash-attn", "on" if flash_attn else "off", *(["--json"] if json_out else [])]


def _bare_cmd(model: Path, n_ctx: int, threads: int, flash_attn: bool, json_out: bool) -> list[str]:
    return [sys.executable, "-c", BARE, str(model), str(n_ctx), str(threads),
            "1" if flash_attn else "0", "json" if json_out else "stream"]


def _ready_s(cmd: list[str]) -> float:
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=_env())
    return float(json.loads(out.stdout.strip().splitlines()[-1])["start_s"])


def _first_token_s(who: str, cmd: list[str]) -> float:
    """Seconds from starting `cmd` to the first byte it streams on stdout (the token). Its
    stderr goes to a file: a pipe nobody reads could fill and stall it before that byte."""
    with tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=_env())
        assert proc.stdout is not None
        first = proc.stdout.read(1)
        t = time.monotonic() - t0
        proc.communicate()
        if proc.returncode != 0 or not first:
            err.seek(0)
            raise RuntimeError(f"{who} exited {proc.returncode} before a token: "
                               f"{err.read().decode(errors='replace').strip()[-500:]}")
    return t


def bench_start(model: Path, n_ctx: int, threads: int, rounds: int,
                flash_attn: bool = False) -> dict[str, Any]:
    """`flash_attn` for both (off: Ebb's default on the CPU alone)."""
    runs: dict[str, list[dict[str, Any]]] = {"ebb": [], "bare": []}
    cmds = {"ebb": _ebb_cmd, "bare": _bare_cmd}
    for who in ("ebb", "bare"):  # not timed: bytecode written, files in the page cache
        _first_token_s(who, cmds[who](model, n_ctx, threads, flash_attn, False))
    for i in range(rounds):
        order = ("ebb", "bare") if i % 2 == 0 else ("bare", "ebb")
        for who in order:
            runs[who].append({"start_s": _ready_s(cmds[who](model, n_ctx, threads, flash_attn, True))})
        for who in order[::-1]:
            runs[who][-1]["first_token_s"] = _first_token_s(
                who, cmds[who](model, n_ctx, threads, flash_attn, False))

    def med(who: str, key: str) -> float:
        return float(statistics.median(float(r[key]) for r in runs[who]))

    out: dict[str, Any] = {"rounds": rounds, "model": str(model), "n_ctx": n_ctx,
                           "threads": threads, "flash_attn": flash_attn, "runs": runs}
    for key in ("start_s", "first_token_s"):
        out[key] = {"ebb": round(med("ebb", key), 3), "bare": round(med("bare", key), 3),
                    "ratio": round(med("ebb", key) / max(med("bare", key), 1e-9), 3)}
    return out
