"""What every endpoint of the OpenAI-compatible API shares: field checks, numbers, stop
sequences cut from a stream, ids, usage, finish reasons. Pure (no HTTP, no llama.cpp)."""
from __future__ import annotations

import json
import secrets
from typing import Any, Sequence

from engine.events import Logprob

from engine.server.errors import ApiError as ApiError  # where every rule below raises it
from engine.stops import openai_finish


MAX_STOPS = 4


def number(body: dict[str, Any], name: str, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"'{name}' must be a number", name)
    if not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be between {lo:g} and {hi:g}, got {value}", name)
    return float(value)


def integer(body: dict[str, Any], name: str, lo: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer", name)
    if value < lo:
        raise ApiError(400, f"'{name}' must be at least {lo}, got {value}", name)
    return value


MAX_CHOICES = 8  # n, and prompts in one /v1/completions request
# Ebb does nothing with these and the reply is the same as if it did: they are accepted.
SAFE_TO_IGNORE = frozenset({"metadata", "store", "service_tier", "prediction"})


def check_fields(body: dict[str, Any], handled: frozenset[str],
                 neutral: dict[str, tuple[Any, ...]]) -> None:
    """A field Ebb does not support is a 400 that names it (never a reply that ignored it);
    a null value counts as absent. `neutral`: fields accepted at the values that ask for
    nothing."""
    for name, value in body.items():
        if value is None or name in handled or name in SAFE_TO_IGNORE:
            continue
        if name in neutral:
            if value in neutral[name]:
                continue
            raise ApiError(400, f"Ebb does not support '{name}' (as {json.dumps(value)[:80]}) yet: "
                                "the reply could not honour it", name)
        raise ApiError(400, f"unknown or unsupported field '{name}'", name)


class StopWatcher:
    """Cuts a streamed reply at the first stop sequence. Text that could still be the start of
    one is held back until the next piece says whether it is."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.held = ""
        self.hit = False

    def feed(self, piece: str) -> str:
        """The text that may be shown now; after a hit, nothing more."""
        if self.hit:
            return ""
        if not self.stops:
            return piece
        text = self.held + piece
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit = True
            self.held = ""
            return text[:cut]
        keep = 0  # the longest end of the text that begins a stop sequence
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """At the end of the reply: what was held back (it was no stop sequence)."""
        out, self.held = ("" if self.hit else self.held), ""
        return out


def finish_reason(stop_reason: str, stopped_by_sequence: bool) -> str:
    """OpenAI's finish_reason: a stop sequence is "stop" whatever the loop said."""
    return "stop" if stopped_by_sequence else openai_finish(stop_reason)


def new_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; `cached_tokens`: the prompt's tokens the model's memory already held
    (the KV cache, or a kept state of this conversation), not evaluated again."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": max(0, cached_tokens)}
    return out


def logprobs_within(entries: Sequence[Logprob] | None, text: str) -> tuple[Logprob, ...] | None:
    """The entries of the tokens that make up `text` (a stop sequence may have cut the reply)."""
    if entries is None:
        return None
    out, n = [], 0
    for e in entries:
        if n >= len(text):
            break
        out.append(e)
        n += len(e.token)
    return tuple(out)


def stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", "stream")
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    return stream, bool(options.get("include_usage"))


def stop_sequences(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOPS:
            raise ApiError(400, f"at most {MAX_STOPS} stop sequences", "stop")
        return tuple(s for s in stop if s)
    raise ApiError(400, "'stop' must be a string or a list of strings", "stop")


def one_prompt(value: Any, name: str) -> str | tuple[int, ...]:
    """A string, or a list of token ids."""
    found = prompts_of(value, name)
    if len(found) != 1 or not (isinstance(value, str) or all(isinstance(t, int) for t in value)):
        raise ApiError(400, f"'{name}' must be a string or a list of token ids", name)
    return found[0]


def prompts_of(value: Any, name: str) -> tuple[str | tuple[int, ...], ...]:
    """A string, a list of token ids, or a list of those (a choice each, in order)."""
    def token_ids(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v)

    if isinstance(value, str):
        return (value,)
    if token_ids(value):
        return (tuple(value),)
    if isinstance(value, list) and value and all(isinstance(v, str) or token_ids(v) for v in value):
        if len(value) > MAX_CHOICES:
            raise ApiError(400, f"at most {MAX_CHOICES} prompts in one request", name)
        return tuple(v if isinstance(v, str) else tuple(v) for v in value)
    raise ApiError(400, f"'{name}' must be a string, a list of token ids, or a list of those", name)
