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


@dataclass(frozen=True)
class Cell:
    """One cell of the residency map."""
    key: str  # stable identity: "embd", "layer 3", "out", "proj", "kv CPU", "compute RPC0"
    label: str  # what is drawn in the cell when it fits
    name: str  # what it is, for its tooltip
    where: str  # the device (CPU: RAM), "moving", "loading", or "" (not there)
    n_bytes: int | None
    since_s: float | None  # monotonic time it came to where it is


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
    layer_bytes: tuple[int, ...] = ()
    embeddings_bytes: int = 0
    output_bytes: int = 0
    _buffers: list[tuple[str, str]] = field(default_factory=list)  # (kind, device), first seen first
    _where_since: dict[str, tuple[str, float]] = field(default_factory=dict)
    _now: float = 0.0  # the time of the last residency event
    _reading: events.Span | None = None  # the prompt being read: its span so far

    def on_event(self, ev: events.Event) -> None:
        if isinstance(ev, events.Residency):
            self.layer_devices = ev.layer_devices
            self.output_device = ev.output_device
            self.embeddings_device = ev.embeddings_device
            self.projector_device = ev.projector_device
            self.ledger = ev.ledger
            self.layer_bytes = ev.layer_bytes
            self.embeddings_bytes, self.output_bytes = ev.embeddings_bytes, ev.output_bytes
            self._now = ev.t_s
            for dev, kinds in ev.ledger.items():
                for kind in ("kv", "compute"):
                    if kinds.get(kind) and (kind, dev) not in self._buffers:
                        self._buffers.append((kind, dev))
            self.cells()  # note when each cell moved
            for dev, kinds in ev.ledger.items():
                self._sample(dev, ev.t_s, kinds, None)
        elif isinstance(ev, events.Span):
            if self._reading is not None and ev.name == "prefill" and self.spans \
                    and self.spans[-1] is self._reading:
                self.spans[-1] = ev  # the prompt's whole span takes its progress's place
            else:
                self.spans.append(ev)
            self._reading = None
        elif isinstance(ev, events.PrefillProgress):
            # the prompt so far, as a prefill span that grows (its detail: how far it got)
            span = events.Span(ev.request_id, name="prefill", start_s=ev.start_s,
                               end_s=ev.t_s, device=ev.device,
                               detail=f"{ev.n_done:,} of {ev.n_total:,} tokens so far")
            if self._reading is not None and self.spans and self.spans[-1] is self._reading:
                self.spans[-1] = span
            else:
                self.spans.append(span)
            self._reading = span
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

    def cells(self) -> list[Cell]:
        """The residency map's cells, always in the same order: embeddings, each layer, output,
        projector, then a KV cache and a compute buffer per device that ever held one (one
        that holds none now is drawn empty, never dropped: the cells must not shift)."""
        out = [Cell("embd", "embd", "input embeddings", self.embeddings_device,
                    self.embeddings_bytes or None, self._since("embd", self.embeddings_device))]
        for i, d in enumerate(self.layer_devices):
            size = self.layer_bytes[i] if i < len(self.layer_bytes) else None
            out.append(Cell(f"layer {i}", str(i), f"layer {i}", d, size, self._since(f"layer {i}", d)))
        out.append(Cell("out", "out", "output layer", self.output_device, self.output_bytes or None,
                        self._since("out", self.output_device)))
        proj = self.projector_device if self.projector_device != "off" else ""
        out.append(Cell("proj", "proj", "projector" + (" (off)" if self.projector_device == "off"
                                                       else ""), proj,
                        sum(k.get("projector", 0) for k in self.ledger.values()) or None,
                        self._since("proj", proj)))
        for kind, dev in self._buffers:
            n = self.ledger.get(dev, {}).get(kind, 0)
            key = f"{kind} {dev}"
            where = dev if n else ""
            out.append(Cell(key, "KV" if kind == "kv" else "comp",
                            f"{'KV cache' if kind == 'kv' else 'compute buffer'} on {dev}", where,
                            n or None, self._since(key, where)))
        return out

    def _since(self, key: str, where: str) -> float | None:
        """When this cell came to where it is now (the first time it is asked, if earlier)."""
        seen = self._where_since.get(key)
        if seen is None or seen[0] != where:
            self._where_since[key] = (where, self._now)
            return self._now
        return seen[1]
