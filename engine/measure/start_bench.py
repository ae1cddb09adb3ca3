"""From launch to the first token, Ebb against the bare library (#31): `ebb-engine bench start`.

Each round starts two fresh processes, alternating which goes first: `ebb-engine chat --prompt
hi --max-tokens 1 --json` and a bare llama-cpp-python script that loads the same model with the
same context, threads and flash-attention setting and streams one token. Both report seconds
from their own process start (the interpreter's start-up included): to the model being ready
and to the first token. Prints the medians and their ratios (Ebb ÷ bare; the goal is ≤ 1.05).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
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
first = None
for _chunk in llm.create_chat_completion(messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=1, stream=True, temperature=0):
    first = age()
    break
print(json.dumps({"start_s": ready, "first_token_s": first}))
"""


def _env() -> dict[str, str]:
    """Both sides may cache their bytecode, as a user's machine does (a bundle carries it
    compiled): with PYTHONDONTWRITEBYTECODE every start compiles each module again, and Ebb
    has more of its own (this machine's shell sets it: 0.17 s of Ebb's start)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def _ebb(model: Path, n_ctx: int, threads: int, flash_attn: bool) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "engine", "chat", "--model", str(model),
                          "--prompt", "hi", "--max-tokens", "1", "--temp", "0", "--threads",
                          str(threads), "--ctx", str(n_ctx), "--json",
                          "--flash-attn", "on" if flash_attn else "off"],
                         capture_output=True, text=True, check=True, env=_env())
    d = json.loads(out.stdout.strip().splitlines()[-1])
    return {"start_s": float(d["start_s"]), "first_token_s": float(d["first_token_s"])}


def _bare(model: Path, n_ctx: int, threads: int, flash_attn: bool) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", BARE, str(model), str(n_ctx), str(threads),
                          "1" if flash_attn else "0"], capture_output=True, text=True, check=True,
                         env=_env())
    d: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return d


def bench_start(model: Path, n_ctx: int, threads: int, rounds: int,
                flash_attn: bool = False) -> dict[str, Any]:
    """`flash_attn` for both (off: Ebb's default on the CPU alone)."""
    runs: dict[str, list[dict[str, Any]]] = {"ebb": [], "bare": []}
    _ebb(model, n_ctx, threads, flash_attn)  # not timed: bytecode written, files in the page cache
    _bare(model, n_ctx, threads, flash_attn)
    for i in range(rounds):
        order = ("ebb", "bare") if i % 2 == 0 else ("bare", "ebb")
        for who in order:
            runs[who].append(_ebb(model, n_ctx, threads, flash_attn) if who == "ebb"
                             else _bare(model, n_ctx, threads, flash_attn))

    def med(who: str, key: str) -> float:
        return float(statistics.median(float(r[key]) for r in runs[who]))

    out: dict[str, Any] = {"rounds": rounds, "model": str(model), "n_ctx": n_ctx,
                           "threads": threads, "flash_attn": flash_attn, "runs": runs}
    for key in ("start_s", "first_token_s"):
        out[key] = {"ebb": round(med("ebb", key), 3), "bare": round(med("bare", key), 3),
                    "ratio": round(med("ebb", key) / max(med("bare", key), 1e-9), 3)}
    return out
