"""A Qt-free model of what the memory panel shows, fed by engine events.

The engine worker's events arrive on the GUI thread and go into `Telemetry.on_event`; the panel
reads the model on a timer (10–30 Hz). Pure bookkeeping: no Qt, no I/O.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

from engine import events

MAX_SPANS = 2000
MAX_SAMPLES = 3000


@dataclass
class Telemetry:
    layer_devices: tuple[str, ...] = ()
    output_device: str = ""
    embeddings_device: str = ""
    projector_device: str = ""
    ledger: dict[str, dict[str, int]] = field(default_factory=dict)
    spans: collections.deque[events.Span] = field(
        default_factory=lambda: collections.deque(maxlen=MAX_SPANS))
    # device -> [(t_s, ledger_bytes by kind, reported_used_bytes)]
    memory: dict[str, collections.deque[tuple[float, dict[str, int], int | None]]] = field(
        default_factory=dict)
    version: int = 0  # bumps on every change: the view redraws only when it moved
    # request_id -> who asked, for turns the local server answered (the window's own: absent)
    labels: dict[int, str] = field(default_factory=dict)

    def on_event(self, ev: events.Event) -> None:
        if isinstance(ev, events.Residency):
            self.layer_devices = ev.layer_devices
            self.output_device = ev.output_device
            self.embeddings_device = ev.embeddings_device
            self.projector_device = ev.projector_device
            self.ledger = ev.ledger
            for dev, kinds in ev.ledger.items():
                self._sample(dev, ev.t_s, kinds, None)
        elif isinstance(ev, events.Span):
            self.spans.append(ev)
        elif isinstance(ev, events.ServerTurn):
            self.labels[ev.request_id] = ev.client
            if len(self.labels) > MAX_SPANS:
                self.labels.pop(next(iter(self.labels)))
        elif isinstance(ev, events.MemorySample):
            self._sample(ev.device, ev.t_s, ev.ledger_kinds or self.ledger.get(ev.device, {}),
                         ev.reported_used_bytes)
        else:
            return
        self.version += 1

    def _sample(self, device: str, t_s: float, kinds: dict[str, int], reported: int | None) -> None:
        series = self.memory.setdefault(device, collections.deque(maxlen=MAX_SAMPLES))
        series.append((t_s, dict(kinds), reported))

    def spans_of(self, request_id: int) -> list[events.Span]:
        return [s for s in self.spans if s.request_id == request_id]

    def cell_states(self) -> list[tuple[str, str]]:
        """(label, where) for the residency map: embeddings, each layer, output, projector,
        KV cache and compute buffers."""
        cells = [("embd", self.embeddings_device)]
        cells += [(str(i), d) for i, d in enumerate(self.layer_devices)]
        cells.append(("out", self.output_device))
        if self.projector_device:
            cells.append(("proj", self.projector_device))
        for dev, kinds in self.ledger.items():
            for kind in ("kv", "compute"):
                if kinds.get(kind):
                    cells.append((f"{kind}", dev))
        return cells
