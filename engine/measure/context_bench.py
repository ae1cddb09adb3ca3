"""Prompt and generation speed at several context fills, flash attention on against off:
`ebb-engine bench context`.

For each fill (tokens already in the KV cache) and each setting, alternating which goes first:
a fresh context is filled to that many tokens (not timed), then a prompt of `prompt_tokens`
is evaluated at Ebb's batch size (timed: prompt tok/s) and `gen_tokens` are decoded greedily
one by one (timed: generation tok/s). Prints both speeds and their ratio (on ÷ off).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from engine.llama.loaded_model import LoadParams
from engine.llama.runtime import TextRuntime

FILLER = ("The quick brown fox jumps over the lazy dog while the river runs to the sea and "
          "the lighthouse keeper counts the ships that pass in the night. ")


def _tokens(rt: TextRuntime, n: int) -> list[int]:
    out: list[int] = []
    piece = rt.tokenize(FILLER * 20, add_special=False)
    while len(out) < n:
        out += piece
    return out[:n]


def _one(model: Path, flash_attn: bool, fill: int, threads: int, n_batch: int,
         prompt_tokens: int, gen_tokens: int) -> tuple[float, float]:
    rt = TextRuntime(LoadParams(model, n_ctx=fill + prompt_tokens + gen_tokens + 64,
                                n_threads=threads, flash_attn=flash_attn, n_batch=n_batch))
    try:
        tokens = _tokens(rt, fill + prompt_tokens)
        if fill:
            rt.prefill(tokens[:fill])
        t0 = time.perf_counter()
        rt.prefill(tokens)  # the cached `fill` is kept: only the prompt is evaluated
        prompt_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        for _ in range(gen_tokens):
            rt.decode_greedy()
        gen_s = time.perf_counter() - t1
    finally:
        rt.close()
    return prompt_tokens / prompt_s, gen_tokens / gen_s


def bench_context(model: Path, fills: tuple[int, ...], threads: int, rounds: int = 2,
                  n_batch: int = 512, prompt_tokens: int = 128, gen_tokens: int = 16) -> dict[str, Any]:
    from engine.gguf.info import model_info, read_gguf

    most = model_info(read_gguf(model)).max_context - prompt_tokens - gen_tokens - 64
    fills = tuple(dict.fromkeys(min(f, most) for f in fills))  # the model's context is the limit
    runs: dict[tuple[int, bool], list[tuple[float, float]]] = {}
    for r in range(rounds):
        for fill in fills:
            for fa in ((True, False) if r % 2 == 0 else (False, True)):
                runs.setdefault((fill, fa), []).append(
                    _one(model, fa, fill, threads, n_batch, prompt_tokens, gen_tokens))
    rows = []
    for fill in fills:
        on, off = runs[(fill, True)], runs[(fill, False)]
        p_on, p_off = statistics.median(x[0] for x in on), statistics.median(x[0] for x in off)
        g_on, g_off = statistics.median(x[1] for x in on), statistics.median(x[1] for x in off)
        rows.append({"fill": fill, "prompt_tps_fa_on": round(p_on, 1), "prompt_tps_fa_off": round(p_off, 1),
                     "prompt_ratio_on_off": round(p_on / p_off, 3), "gen_tps_fa_on": round(g_on, 1),
                     "gen_tps_fa_off": round(g_off, 1), "gen_ratio_on_off": round(g_on / g_off, 3)})
    return {"model": str(model), "threads": threads, "n_batch": n_batch, "rounds": rounds,
            "prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens, "rows": rows}
