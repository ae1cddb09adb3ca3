"""/v1/completions (the legacy endpoint): a request checked into a `CompletionRequest`, and
the reply's shapes. Pure."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from engine.events import Logprob

from engine.server.errors import ApiError as ApiError  # where every rule below raises it
from engine.server.sampling import FIELDS as SAMPLING_FIELDS
from engine.server.sampling import Sampling, parse_sampling
from engine.server.api.common import check_fields, integer, number, prompts_of, stop_sequences, stream_flags


COMPLETION_FIELDS = frozenset({"model", "prompt", "stream", "stream_options", "stop", "max_tokens",
                               "seed", "user", "temperature", "top_p", "echo", "logprobs", "n",
                               "best_of"}) | SAMPLING_FIELDS
COMPLETION_NEUTRAL: dict[str, tuple[Any, ...]] = {"suffix": ("",)}
MAX_COMPLETION_LOGPROBS = 5  # as OpenAI's legacy endpoint
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class CompletionRequest:
    """A raw completion: the prompt as it is (no chat template), text out."""
    prompt: str | tuple[int, ...]  # text, or token ids (the first, when there are several)
    stream: bool = False
    include_usage: bool = False
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int = DEFAULT_COMPLETION_TOKENS
    stop: tuple[str, ...] = ()
    seed: int | None = None
    user: str = ""
    echo: bool = False
    top_logprobs: int = -1  # -1: none; else the legacy `logprobs` count
    sampling: Sampling = field(default_factory=Sampling)
    prompts: tuple[str | tuple[int, ...], ...] = ()  # every prompt, a choice each (() : `prompt`)

    @property
    def all_prompts(self) -> tuple[str | tuple[int, ...], ...]:
        return self.prompts or (self.prompt,)


def parse_completion_request(body: Any) -> CompletionRequest:
    """Check a /v1/completions body."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_fields(body, COMPLETION_FIELDS, COMPLETION_NEUTRAL)
    if "prompt" not in body or body["prompt"] is None:
        raise ApiError(400, "'prompt' is required", "prompt")
    prompts = prompts_of(body["prompt"], "prompt")
    for name in ("n", "best_of"):
        if integer(body, name, 1) not in (None, 1):
            raise ApiError(400, f"only {name}=1 is supported", name)
    stream, include_usage = stream_flags(body)
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise ApiError(400, "'echo' must be true or false", "echo")
    top_logprobs = integer(body, "logprobs", 0)
    if top_logprobs is not None:
        if top_logprobs > MAX_COMPLETION_LOGPROBS:
            raise ApiError(400, f"'logprobs' is at most {MAX_COMPLETION_LOGPROBS}", "logprobs")
        if echo:
            raise ApiError(400, "Ebb gives logprobs of the reply only, not of an echoed prompt: "
                                "ask without 'echo'", "logprobs")
        if stream:
            raise ApiError(400, "Ebb does not stream logprobs yet: ask without 'stream'", "logprobs")
    max_tokens = integer(body, "max_tokens", 0)
    user = body.get("user", "")
    return CompletionRequest(
        prompt=prompts[0], prompts=prompts if len(prompts) > 1 else (), stream=stream,
        include_usage=include_usage,
        temperature=number(body, "temperature", 0.0, 2.0), top_p=number(body, "top_p", 0.0, 1.0),
        max_tokens=DEFAULT_COMPLETION_TOKENS if max_tokens is None else max_tokens,
        stop=stop_sequences(body), seed=integer(body, "seed", -(2**63)),
        user=user if isinstance(user, str) else "", echo=echo,
        top_logprobs=-1 if top_logprobs is None else top_logprobs, sampling=parse_sampling(body))


def legacy_logprobs(entries: Sequence[Logprob] | None, start: int = 0) -> dict[str, Any] | None:
    """/v1/completions' logprobs shape from the chat shape's entries; `start`: the text's
    offset of the first token."""
    if entries is None:
        return None
    offsets, n = [], start
    for e in entries:
        offsets.append(n)
        n += len(e.token)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
            "text_offset": offsets}


def text_completion(cid: str, model: str, text: str, finish: str | None,
                    use: dict[str, Any] | None, logprobs: dict[str, Any] | None = None,
                    chunk: bool = False, choices: bool = True, index: int = 0,
                    more: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A completion (or a chunk of one); `more`: further choices, as `text_choice()` makes."""
    out: dict[str, Any] = {
        "id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [text_choice(index, text, finish, logprobs), *(more or [])] if choices else []}
    if use is not None or not chunk:
        out["usage"] = use
    return out


def text_choice(index: int, text: str, finish: str | None,
                logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}
