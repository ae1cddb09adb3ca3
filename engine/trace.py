"""Timeline spans in the Chrome trace format (open the file in Perfetto or chrome://tracing)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Protocol


class Span(Protocol):
    """Anything shaped like engine.events.Span (the telemetry model's spans too); read only,
    so frozen dataclasses fit."""
    @property
    def name(self) -> str: ...
    @property
    def start_s(self) -> float: ...
    @property
    def end_s(self) -> float: ...
    @property
    def device(self) -> str: ...
    @property
    def bytes(self) -> int: ...
    @property
    def request_id(self) -> int: ...
    @property
    def predicted_s(self) -> float | None: ...
    @property
    def detail(self) -> str: ...
    @property
    def lane(self) -> int: ...

# One row (thread) per kind of work, as the window's timeline draws them.
ROWS = {"evict": 1, "restore": 1, "save_state": 1, "restore_state": 1,
        "load_projector": 2, "encode": 2, "free_projector": 2,
        "plan": 3, "prefill": 3, "decode": 3}
ROW_NAMES = {1: "transfers", 2: "projector", 3: "compute"}


def row_of(span: Span) -> int:
    """The Steps lane a span is drawn in: a lane's (several requests at once) below compute."""
    return 3 + span.lane if span.lane else ROWS.get(span.name, 3)


def row_names(spans: Iterable[Span]) -> dict[int, str]:
    """Every row's name: the three, and one per sequence beside the session's that ran."""
    lanes = sorted({s.lane for s in spans if s.lane})
    return {**ROW_NAMES, **{3 + k: f"request {k + 1}" for k in lanes}}


def chrome_trace(spans: Iterable[Span]) -> dict[str, object]:
    spans = list(spans)
    t0 = min((s.start_s for s in spans), default=0.0)
    out: list[dict[str, object]] = [
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}}
        for tid, name in row_names(spans).items()]
    for s in spans:
        args: dict[str, object] = {"device": s.device, "bytes": s.bytes, "request_id": s.request_id}
        if s.predicted_s is not None:
            args["predicted_s"] = s.predicted_s
        if s.detail:
            args["detail"] = s.detail
        out.append({"name": s.name, "cat": s.device, "ph": "X", "pid": 1,
                    "tid": row_of(s), "ts": round((s.start_s - t0) * 1e6, 1),
                    "dur": round((s.end_s - s.start_s) * 1e6, 1), "args": args})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(path: Path, spans: Iterable[Span]) -> None:
    Path(path).write_text(json.dumps(chrome_trace(spans)))
