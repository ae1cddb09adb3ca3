"""Tokens/s on a shared CPU: `ebb-engine bench contention`.

With 0, 1 and 2 busy loops beside it (`while True: pass` in processes of their own), the same
greedy work is timed for:

- **Ebb, adaptive**: the threads nobody chose, fewer while the cores are shared
  (engine/llama/thread_share.py);
- **Ebb, fixed** at each count from 1 to the physical cores (what the best choice would be, if
  the load were known);
- **the peer**: llama.cpp's own `llama-server` with its default threads when one is found
  (`--peer PATH`, or EBB_LLAMA_SERVER), else llama-cpp-python's `Llama` with its defaults (the
  same llama.cpp, threads and all; said which).

Each is timed for reading a prompt (prompt tokens ÷ seconds) and generating (tokens after the
first ÷ their seconds). The configurations alternate, in a rotated order each round; a row
is the median of the rounds. Ratios: adaptive ÷ the best fixed count at that load (goal
≥ 0.9 at every load), adaptive ÷ the peer (goal ≥ 1.5 with one busy loop).
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

PROMPT = ("Here is a list of things to remember for the trip: " +
          ", ".join(f"item {i} is the {i}th thing" for i in range(60)) + ". Now say what is first.")


@contextlib.contextmanager
def busy_loops(n: int) -> Iterator[None]:
    """`n` processes that spin a core each, as a browser tab or a build would."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.3 if n else 0)  # measuring; the spinners get going before the clock starts
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _ebb_run(rt: Any, tokens: list[int], n_gen: int) -> tuple[float, float]:
    """(prompt tokens/s, generation tokens/s) of one greedy run from an empty cache."""
    rt.slot.reset()
    t0 = time.perf_counter()
    rt.prefill(tokens)
    t1 = time.perf_counter()
    rt.decode_greedy()  # the first token: its time is the prompt's side of a reply
    t2 = time.perf_counter()
    for _ in range(n_gen - 1):
        rt.decode_greedy()
    t3 = time.perf_counter()
    return len(tokens) / (t1 - t0), (n_gen - 1) / (t3 - t2)


class _LlamaPeer:
    """llama-cpp-python's Llama, its defaults (threads: its own choice)."""
    name = "llama-cpp-python (default threads)"

    def __init__(self, model: Path, n_ctx: int) -> None:
        import llama_cpp

        self.llm: Any = llama_cpp.Llama(str(model), n_ctx=n_ctx, verbose=False)

    def run(self, prompt: str, n_gen: int) -> tuple[float, float]:
        import numpy as np

        llm: Any = self.llm  # llama-cpp-python's Llama: untyped
        tokens = llm.tokenize(prompt.encode())
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(tokens)
        t1 = time.perf_counter()
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        llm.eval([tok])
        t2 = time.perf_counter()
        for _ in range(n_gen - 1):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            llm.eval([tok])
        t3 = time.perf_counter()
        return len(tokens) / (t1 - t0), (n_gen - 1) / (t3 - t2)

    def close(self) -> None:
        self.llm.close()


class ServerPeer:
    """llama.cpp's llama-server (default threads), asked over HTTP; its own timings."""

    def __init__(self, binary: Path, model: Path, n_ctx: int) -> None:
        from engine.measure.serve_bench import _free_port

        self.port = _free_port()
        self.name = f"llama-server {binary} (default threads)"
        self.proc = subprocess.Popen([str(binary), "-m", str(model), "-c", str(n_ctx), "--port",
                                      str(self.port), "-np", "1"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if json.loads(r.read()).get("status") == "ok":
                        return
            time.sleep(0.2)  # polling a starting server
        self.close()
        raise RuntimeError("llama-server did not start")

    def run(self, prompt: str, n_gen: int) -> tuple[float, float]:
        body = json.dumps({"prompt": prompt, "n_predict": n_gen, "temperature": 0,
                           "cache_prompt": False, "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            t = json.loads(r.read())["timings"]
        return float(t["prompt_per_second"]), float(t["predicted_per_second"])

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def find_peer(given: str | None) -> Path | None:
    """A llama-server binary: the one given, EBB_LLAMA_SERVER, or none."""
    for p in (given, os.environ.get("EBB_LLAMA_SERVER")):
        if p and Path(p).is_file() and os.access(p, os.X_OK):
            return Path(p)
    return None


def bench_contention(model: Path, loads: list[int], rounds: int, n_gen: int, peer_binary: Path | None,
                     log: Callable[[str], None]) -> dict[str, Any]:
    from engine.hw import physical_cores
    from engine.llama.loaded_model import LoadParams
    from engine.llama.runtime import TextRuntime

    cores = physical_cores()
    n_ctx = 1024
    runtimes: dict[str, Any] = {"adaptive": TextRuntime(LoadParams(model, n_ctx=n_ctx, share_threads=True))}
    for n in range(1, cores + 1):
        runtimes[f"fixed {n}"] = TextRuntime(LoadParams(model, n_ctx=n_ctx, n_threads=n))
    peer: Any = ServerPeer(peer_binary, model, n_ctx) if peer_binary else _LlamaPeer(model, n_ctx)
    tokens = runtimes["adaptive"].tokenize(PROMPT, add_special=True)
    names = [*runtimes, "peer"]
    seen: dict[tuple[int, str], list[tuple[float, float]]] = {}
    try:
        for r in range(rounds):
            for load in loads:
                with busy_loops(load):
                    order = names[r % len(names):] + names[:r % len(names)]
                    for name in order:
                        time.sleep(0.2)  # the last one's threads stop spinning: the load is the loops'
                        got = (peer.run(PROMPT, n_gen) if name == "peer"
                               else _ebb_run(runtimes[name], tokens, n_gen))
                        seen.setdefault((load, name), []).append(got)
                        log(f"round {r + 1}, {load} busy: {name}: prompt {got[0]:.1f} tok/s, "
                            f"generation {got[1]:.1f} tok/s")
    finally:
        peer.close()
        for rt in runtimes.values():
            rt.close()
    rows = []
    for load in loads:
        med = {name: (statistics.median(p for p, _ in seen[(load, name)]),
                      statistics.median(g for _, g in seen[(load, name)])) for name in names}
        fixed = [n for n in names if n.startswith("fixed")]
        row: dict[str, Any] = {"busy_loops": load, "tok_s": med}
        for i, phase in enumerate(("prompt", "gen")):
            best = max(fixed, key=lambda n: med[n][i])
            row[f"{phase}_best_fixed"] = best
            row[f"{phase}_adaptive_vs_best_fixed"] = med["adaptive"][i] / med[best][i]
            row[f"{phase}_adaptive_vs_peer"] = med["adaptive"][i] / med["peer"][i]
        rows.append(row)
    return {"model": model.name, "cores": cores, "rounds": rounds, "n_gen": n_gen,
            "prompt_tokens": len(tokens), "peer": peer.name, "rows": rows}
