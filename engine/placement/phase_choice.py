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
from typing import Any, Iterable, Sequence

from engine.config import PhaseTuning
from engine.placement.plan import device_layers

# a move's cost beyond its bytes, per move: buffers allocated and freed, round trips, and a
# graph planned again for the next batch (1-3 ms on loopback RPC; a GPU's is of the same order)
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


@dataclass(frozen=True)
class PhaseMove:
    """The move to the prompt's placement, priced: which layers the prompt wants on the device,
    which the move copies there (or drops, when it wants fewer), its bytes, and whether it pays."""
    target: frozenset[int]
    copy: frozenset[int]
    n_bytes: int
    decision: Rebalance


def plan_phase_move(n_layers: int, on_device: Iterable[int], t: PhaseTuning, n_tokens: int,
                    layer_bytes: Sequence[int], copy_Bps: float, fixed_s: float = MOVE_FIXED_S,
                    room_bytes: int | None = None) -> PhaseMove:
    """The one rule for a per-phase move (the session's per turn, What if's prediction): from
    the repeating layers `on_device` now to the prompt's placement (llama.cpp's count
    `t.prompt_layers`); a move that adds layers must fit `room_bytes` (None: it does)."""
    now = frozenset(on_device)
    target = frozenset(device_layers(n_layers, t.prompt_layers))
    copy = target - now if len(target) > len(now) else now - target
    n_bytes = sum(layer_bytes[i] for i in copy)
    if min(t.gen_layers, t.prompt_layers) == 0:  # no device at all: a reload
        return PhaseMove(target, copy, n_bytes, Rebalance(
            False, 0.0, 0.0, None, "0 layers means no accelerator: one placement (a reload is "
                                   "never paid per turn)"))
    if len(target) > len(now) and room_bytes is not None and n_bytes > room_bytes:
        return PhaseMove(target, copy, n_bytes, Rebalance(
            False, 0.0, 0.0, None, f"the prompt placement needs {n_bytes / 2**20:.0f} MiB more "
                                   f"on the device, the budget has {max(room_bytes, 0) / 2**20:.0f} MiB"))
    return PhaseMove(target, copy, n_bytes, decide_rebalance(n_tokens, t, n_bytes, copy_Bps, fixed_s))
