"""Each phase at its best, turn by turn: before a prompt, move to the prompt's placement when it
pays (the one rule: `plan_phase_move`, engine/placement/phase_choice.py), and back for generation
after the prefill. An owner of one job, held by the Session; one thread (the session's)."""
from __future__ import annotations

import time
from typing import Callable

from engine.config import PhaseTuning
from engine.events import PhasesUsed
from engine.placement.phase_choice import MOVE_FIXED_S, Rebalance, plan_phase_move
from engine.placement.plan import device_layers
from engine.placement.residency import ModelResidency
from engine.placement.timeline import Timeline

__all__ = ["PhaseMover"]

# told what a move cost (device, seconds, bytes copied): the vision costs learn the link from it
Learn = Callable[[str, float, int], None]


class PhaseMover:
    def __init__(self, model: ModelResidency, n_layers: int, phases: PhaseTuning | None) -> None:
        self.model = model
        self.n_layers = n_layers
        self.phases = phases  # autotune's per-phase choice (SessionConfig.phases), or None
        self.last: Rebalance | None = None  # the last prompt's decision
        self._target: PhaseTuning | None = None  # the choice it weighed (text or images)

    def decide(self, n_tokens: int, n_image_tokens: int, bus_Bps: float) -> Rebalance | None:
        """Whether this prompt runs at the prompt's placement (with images to evaluate: the
        image batch's, which keeps it off a cliff that a larger batch meets sooner): None
        without a per-phase choice or the live mover (the reload mover never moves per
        turn)."""
        ph = self.phases
        if ph is not None and n_image_tokens:
            ph = ph.for_images()
        self._target = ph
        mover, accel = self.model.mover, self.model.accel
        if ph is None or not ph.differs or mover is None or accel is None:
            return None
        n = self.n_layers
        room = self.model.budget_bytes - self.model.ledger.total(accel)
        return plan_phase_move(n, mover.on_device(), ph, n_tokens,
                               [mover.layer_bytes(i) for i in range(n)], bus_Bps, MOVE_FIXED_S,
                               room).decision

    def to_prompt_placement(self, n_tokens: int, n_image_tokens: int, bus_Bps: float,
                            tl: Timeline, learn: Learn) -> Callable[[], None] | None:
        """Move to the prompt's placement when it pays (a span `rebalance`); returns the move
        back, for after the prefill, or None."""
        decision = self.last = self.decide(n_tokens, n_image_tokens, bus_Bps)
        if decision is None or not decision.move:
            return None
        ph, mover = self._target, self.model.mover
        assert ph is not None and mover is not None
        gen_set = set(mover.on_device())
        self._move(set(device_layers(self.n_layers, ph.prompt_layers)), tl, decision.cost_s / 2,
                   f"to {ph.prompt_layers} layers for the prompt", learn)
        return lambda: self._move(gen_set, tl, decision.cost_s / 2,
                                  f"back to {ph.gen_layers} layers for generation", learn)

    def _move(self, target: set[int], tl: Timeline, predicted_s: float, detail: str,
              learn: Learn) -> None:
        accel = self.model.accel
        assert accel is not None
        t0 = time.monotonic()
        copied = self.model.move_to(target)
        t1 = time.monotonic()
        tl.add("rebalance", t0, t1, accel, copied, detail, predicted_s=predicted_s)
        if copied:
            learn(accel, t1 - t0, copied)

    def used(self, n_threads_batch: int, n_threads: int) -> PhasesUsed | None:
        """Where and with how many threads each phase ran in the last turn, and why (None
        without a per-phase choice)."""
        ph, d = self._target or self.phases, self.last
        if ph is None:
            return None
        gen = self.model.placement.n_gpu_layers
        moved = d is not None and d.move
        return PhasesUsed(prompt_layers=ph.prompt_layers if moved else gen, gen_layers=gen,
                          prompt_threads=n_threads_batch, gen_threads=n_threads, moved=moved,
                          reason=d.reason if d is not None else "the reload mover: one placement")
