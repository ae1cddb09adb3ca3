"""Events the engine emits (one module, frozen dataclasses). Each carries a monotonic
timestamp `t_s` and the id of the request it belongs to (0 for none)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


def _now() -> float:
    return time.monotonic()


@dataclass(frozen=True)
class Event:
    request_id: int
    t_s: float = field(default_factory=_now, kw_only=True)


@dataclass(frozen=True)
class ModelLoading(Event):
    model_path: str


@dataclass(frozen=True)
class ModelLoaded(Event):
    model_path: str
    model_name: str
    n_layers: int
    n_ctx: int
    n_threads: int
    load_s: float


@dataclass(frozen=True)
class TokenText(Event):
    text: str


@dataclass(frozen=True)
class TurnFinished(Event):
    result: dict[str, Any]


@dataclass(frozen=True)
class EngineFailed(Event):
    message: str
