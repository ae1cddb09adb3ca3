"""llama.cpp's sampler knobs that clients tuned for local servers send (llama-server and
llama-cpp-python's server honour them): `top_k`, `min_p`, `repeat_penalty`,
`presence_penalty`, `frequency_penalty`, `logit_bias` and `grammar` (GBNF). Pure: a request
body in, a `Sampling` out, or an ApiError that names the field.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine.server.errors import ApiError

FIELDS = frozenset({"top_k", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty",
                    "logit_bias", "grammar"})
MAX_LOGIT_BIAS = 300  # entries; OpenAI's limit


@dataclass(frozen=True)
class Sampling:
    """None: the engine's default."""
    top_k: int | None = None  # 0: off
    min_p: float | None = None
    repeat_penalty: float | None = None  # 1: none
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    grammar: str = ""  # GBNF, root rule "root"

    def gen_overrides(self) -> dict[str, Any]:
        """The GenParams fields this request sets (engine.llama.sampling.GenParams)."""
        out: dict[str, Any] = {"presence_penalty": self.presence_penalty,
                               "frequency_penalty": self.frequency_penalty,
                               "logit_bias": self.logit_bias}
        for name in ("top_k", "min_p", "repeat_penalty"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


def _number(body: dict[str, Any], name: str, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be a number", name)
    if not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be between {lo:g} and {hi:g}, got {value}", name)
    return float(value)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's shape ({"token id": bias}, ids as strings) or llama-server's list of pairs."""
    if value is None:
        return ()
    pairs = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(pairs, list) or len(pairs) > MAX_LOGIT_BIAS:
        raise ApiError(400, "'logit_bias' must map token ids to numbers ({\"15043\": -100}), at "
                            f"most {MAX_LOGIT_BIAS} of them", "logit_bias")
    out = []
    for pair in pairs:
        token, bias = pair if isinstance(pair, (list, tuple)) and len(pair) == 2 else (None, None)
        token_id = int(token) if isinstance(token, int) or (
            isinstance(token, str) and token.isdigit()) else -1
        if token_id < 0 or isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not -100 <= bias <= 100:
            raise ApiError(400, f"'logit_bias' entry {pair!r} is not a token id with a bias "
                                "from -100 to 100", "logit_bias")
        out.append((token_id, float(bias)))
    return tuple(out)


def parse_sampling(body: dict[str, Any]) -> Sampling:
    top_k = body.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ApiError(400, "'top_k' must be a whole number, 0 or more (0: off)", "top_k")
    grammar = body.get("grammar")
    if grammar is not None and not isinstance(grammar, str):
        raise ApiError(400, "'grammar' must be GBNF text (its root rule named root)", "grammar")
    repeat = _number(body, "repeat_penalty", 0.0, 10.0)
    if repeat is not None and repeat <= 0:
        raise ApiError(400, "'repeat_penalty' must be over 0 (1: none)", "repeat_penalty")
    return Sampling(
        top_k=top_k, min_p=_number(body, "min_p", 0.0, 1.0), repeat_penalty=repeat,
        presence_penalty=_number(body, "presence_penalty", -2.0, 2.0) or 0.0,
        frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0) or 0.0,
        logit_bias=_logit_bias(body.get("logit_bias")), grammar=grammar or "")
