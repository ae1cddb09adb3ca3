"""`ebb-engine bench phases`: each phase at its best against the single best placement.

The same turn (a long prompt, then a reply) runs in fresh sessions on the same device: once at
one placement (autotune's best generation layer count, one thread count for both phases, as
before per-phase tuning), once with the per-phase choice
(prompt threads, prompt placement when the move pays). Each is run `repeats` times, alternating,
and the faster run of each counts. Prints tokens/s per phase and the ratios; replies compared.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from engine.config import PhaseTuning, SessionConfig
from engine.llama.sampling import GenParams
from engine.session import Session

def long_prompt(n_ctx: int) -> str:
    """About half the context of notes (~19 tokens each), and a request to summarise them."""
    n = max(4, (n_ctx // 2) // 20)
    return " ".join(f"Note {i}: the keeper wrote the wind, the tide and the lamp's hours."
                    for i in range(n)) + " Summarise the notes in two sentences."


def _run(cfg: SessionConfig, gen_tokens: int) -> dict[str, Any]:
    gp = GenParams(max_tokens=gen_tokens, temperature=0)
    with Session(cfg) as s:
        r = s.turn(long_prompt(s.n_ctx), gp=gp)
        if r.error:
            raise RuntimeError(r.error)
        g = r.gen
        return {"prompt_tps": g.prompt_tokens_per_s, "gen_tps": g.gen_tokens_per_s, "text": r.text,
                "rebalance_s": sum(sp.end_s - sp.start_s for sp in r.spans
                                   if sp.name == "rebalance"),
                "total_s": sum(sp.end_s - sp.start_s for sp in r.spans),
                "phases": r.phases.to_dict() if r.phases is not None else {}}


def bench_phases(cfg: SessionConfig, tuning: PhaseTuning, repeats: int = 2,
                 gen_tokens: int = 64) -> dict[str, Any]:
    # before per-phase tuning: generation's best layers, one thread count (--threads, default
    # the physical cores) for both phases
    one = replace(cfg, phases=None, gpu_layers=tuning.gen_layers, n_threads_batch=None,
                  mover="live")
    both = replace(cfg, phases=tuning, mover="live")
    runs: dict[str, list[dict[str, Any]]] = {"one": [], "both": []}
    for _ in range(repeats):
        runs["one"].append(_run(one, gen_tokens))
        runs["both"].append(_run(both, gen_tokens))
    best = {k: {"prompt_tps": max(r["prompt_tps"] for r in v),
                "gen_tps": max(r["gen_tps"] for r in v),
                "total_s": min(r["total_s"] for r in v)} for k, v in runs.items()}
    return {"tuning": tuning.to_dict(), "one_placement": best["one"], "per_phase": best["both"],
            "prompt_ratio": round(best["both"]["prompt_tps"] / best["one"]["prompt_tps"], 3),
            "gen_ratio": round(best["both"]["gen_tps"] / best["one"]["gen_tps"], 3),
            "turn_time_ratio": round(best["one"]["total_s"] / best["both"]["total_s"], 3),
            "rebalance_s": round(min(r["rebalance_s"] for r in runs["both"]), 4),
            "phases": runs["both"][-1]["phases"],
            "replies_equal": all(a["text"] == b["text"]
                                 for a, b in zip(runs["one"], runs["both"]))}
