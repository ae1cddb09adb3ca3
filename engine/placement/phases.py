"""Each phase at its best: a placement and a thread count for the prompt, others for generation.

The prompt (one big batch) and generation (one token at a time) want different things: a long
batch pays for more layers on the accelerator and many threads, a single token may run faster
with fewer layers there (less traffic per token over a slow link) and one thread. Autotune
measures both; a session runs generation at its best placement, and for a prompt long enough
moves to the prompt's best placement first and back before the first generated token, with the
live mover. Whether a move pays is decided here, per turn, from measured speeds and the move's
cost: pure arithmetic, no device.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from engine.config import PhaseTuning

# a move's cost beyond its bytes, per move: the graphs planned again (~3 ms on loopback RPC; a
# GPU's is of the same order)
MOVE_FIXED_S = 0.005


@dataclass(frozen=True)
class Rebalance:
    move: bool
    saved_s: float  # the prompt's time at the generation placement less at the prompt's
    cost_s: float  # both moves
    break_even_tokens: int | None  # the prompt length from which the moves pay; None: never
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decide_rebalance(n_tokens: int, t: PhaseTuning, move_bytes: int, copy_Bps: float,
                     fixed_s: float) -> Rebalance:
    """Move to the prompt placement for a prompt of `n_tokens` to evaluate (image tokens
    count), and back before the first generated token? Moving costs one copy of the layers
    that differ (`move_bytes` at `copy_Bps`; the other direction frees them) and `fixed_s` per
    move (the graphs planned again). It pays when the prompt's time saved is larger."""
    if not t.differs:
        return Rebalance(False, 0.0, 0.0, None, "one placement is best for both phases")
    per_token = 1.0 / t.prompt_tps_at_gen - 1.0 / t.prompt_tps_at_prompt
    cost = move_bytes / copy_Bps + 2 * fixed_s if copy_Bps > 0 else math.inf
    if per_token <= 0 or not math.isfinite(cost):
        return Rebalance(False, 0.0, cost, None,
                         f"the prompt placement ({t.prompt_layers} layers) is not faster for "
                         f"prompts than the generation placement ({t.gen_layers})")
    saved = n_tokens * per_token
    break_even = math.ceil(cost / per_token)
    where = f"prompt at {t.prompt_layers} layers, generation at {t.gen_layers}"
    if saved > cost:
        return Rebalance(True, saved, cost, break_even,
                         f"{where}: the move ({cost * 1e3:.0f} ms) saves {saved * 1e3:.0f} ms "
                         f"on {n_tokens} prompt tokens (pays from {break_even})")
    return Rebalance(False, saved, cost, break_even,
                     f"one placement: {n_tokens} prompt tokens save {saved * 1e3:.0f} ms, "
                     f"less than the move ({cost * 1e3:.0f} ms; pays from {break_even} tokens)")
