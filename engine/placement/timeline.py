"""One request's timeline: every step a Span event, measured beside the plan's prediction, each
followed by a memory sample of the accelerator. Engine thread."""
from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from typing import Callable, Iterator

from engine import events
from engine.ledger import Ledger
from engine.llama.devices import reported_used_bytes
from engine.placement.plan import VisionPlan


class Timeline:
    def __init__(self, request_id: int, emit: Callable[[events.Event], None], ledger: Ledger,
                 accel: str | None) -> None:
        self.request_id = request_id
        self.spans: list[events.Span] = []
        self.plan: VisionPlan | None = None  # its steps' predictions go beside the measures
        self._emit = emit
        self._ledger = ledger
        self._accel = accel

    @contextlib.contextmanager
    def step(self, name: str, device: str, n_bytes: int = 0, detail: str = "") -> Iterator[None]:
        """Time the block as step `name` (also when it raises)."""
        events.pause_point(name)
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.add(name, t0, time.monotonic(), device, n_bytes, detail)

    def add(self, name: str, start_s: float, end_s: float, device: str, n_bytes: int = 0,
            detail: str = "", predicted_s: float | None = None) -> None:
        pred = predicted_s
        if pred is None and self.plan is not None:
            pred = next((s.predicted_s for s in self.plan.steps if s.name == name), None)
        span = events.Span(self.request_id, name=name, start_s=start_s, end_s=end_s,
                           device=device, bytes=n_bytes, predicted_s=pred, detail=detail)
        self.spans.append(span)
        self._emit(span)
        if self._accel is not None:
            self._emit(events.MemorySample(
                self.request_id, device=self._accel,
                ledger_bytes=self._ledger.total(self._accel),
                reported_used_bytes=reported_used_bytes(self._accel),
                ledger_kinds=self._ledger.snapshot().get(self._accel, {})))

    def amend_last(self, n_bytes: int, detail: str | None = None) -> None:
        """The last step's bytes (and detail), known only once it ended (what an eviction
        freed, and how many layers that took)."""
        last = self.spans[-1]
        self.spans[-1] = replace(last, bytes=n_bytes, detail=last.detail if detail is None else detail)
