"""OpenAI's chat-completions shape: a request checked into a `ChatRequest`, and the replies.

Pure: no HTTP and no llama.cpp here, so every rule about what a request may hold is tested
on its own. What is refused, and why, is said in OpenAI's error shape (`ApiError.body`).
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import json
import secrets
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_STOPS = 4


class ApiError(Exception):
    """A request the server refuses: HTTP status, message, and the field at fault."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 503: "server_busy",
             500: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ImageRef:
    """A picture a message carries: bytes from a data URL, or a local file."""
    data: bytes | None = None
    path: Path | None = None

    def key(self) -> str:
        return hashlib.sha256(self.data).hexdigest() if self.data is not None else str(self.path)


@dataclass(frozen=True)
class Turn:
    role: str  # "user" or "assistant"
    text: str
    images: tuple[ImageRef, ...] = ()


@dataclass(frozen=True)
class ChatRequest:
    system: str | None
    history: tuple[Turn, ...]  # every message before the last
    last: Turn  # the user's message the reply answers
    stream: bool = False
    include_usage: bool = False
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int = 0  # 0: no cap
    stop: tuple[str, ...] = ()
    seed: int | None = None
    user: str = ""
    top_logprobs: int = -1  # -1: no logprobs; else the sampled token's and this many best
    grammar: str = ""  # GBNF the reply must follow (response_format json_object / json_schema)
    extra: dict[str, Any] = field(default_factory=dict)


def _number(body: dict[str, Any], name: str, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"'{name}' must be a number", name)
    if not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be between {lo:g} and {hi:g}, got {value}", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, lo: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer", name)
    if value < lo:
        raise ApiError(400, f"'{name}' must be at least {lo}, got {value}", name)
    return value


def image_from_url(url: Any, param: str) -> ImageRef:
    """A data URL (base64) or a local file:// path. Ebb fetches nothing from the network."""
    if not isinstance(url, str) or not url:
        raise ApiError(400, "'image_url.url' must be a non-empty string", param)
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or ";base64" not in head:
            raise ApiError(400, "an image data URL must be base64: data:image/png;base64,...", param)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, "the image data URL's base64 is invalid", param) from None
        if not data:
            raise ApiError(400, "the image data URL is empty", param)
        return ImageRef(data=data)
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ApiError(400, f"a file:// URL must name a local file, not host {parsed.netloc!r}", param)
        path = Path(urllib.parse.unquote(parsed.path))
        if not path.is_file():
            raise ApiError(400, f"no such image file: {path}", param)
        return ImageRef(path=path)
    if parsed.scheme in ("http", "https"):
        raise ApiError(400, "Ebb does not fetch images from the network: send the picture as a "
                            "data URL (data:image/png;base64,...) or a local file:// path", param)
    raise ApiError(400, f"unsupported image URL scheme {parsed.scheme or url[:16]!r}: use a data "
                        "URL or a local file:// path", param)


def _content(content: Any, role: str, param: str) -> tuple[str, tuple[ImageRef, ...]]:
    if isinstance(content, str):
        return content, ()
    if content is None and role == "assistant":
        return "", ()
    if not isinstance(content, list):
        raise ApiError(400, "'content' must be a string or a list of content parts", param)
    texts: list[str] = []
    images: list[ImageRef] = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise ApiError(400, "a content part must be an object", where)
        kind = part.get("type")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ApiError(400, "a text part needs 'text' as a string", where)
            texts.append(part["text"])
        elif kind == "image_url":
            if role != "user":
                raise ApiError(400, f"images are read from user messages only, not {role}", where)
            spec = part.get("image_url")
            url = spec.get("url") if isinstance(spec, dict) else spec
            images.append(image_from_url(url, f"{where}.image_url"))
        else:
            raise ApiError(400, f"unsupported content part type {kind!r} (text and image_url are)",
                           where)
    return "\n".join(texts), tuple(images)


MAX_TOP_LOGPROBS = 20  # as OpenAI's
# What a chat request may carry. Ebb answers these:
HANDLED = frozenset({"messages", "model", "n", "stream", "stream_options", "stop", "max_tokens",
                     "max_completion_tokens", "seed", "user", "temperature", "top_p",
                     "response_format", "logprobs", "top_logprobs"})
# Ebb does nothing with these and the reply is the same as if it did: they are accepted.
SAFE_TO_IGNORE = frozenset({"metadata", "store", "service_tier", "prediction"})
# Accepted at the value that asks for nothing (what OpenAI's clients send by default); any
# other value is refused by name rather than silently ignored.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},),
    "tools": ([],), "tool_choice": ("none", "auto"), "parallel_tool_calls": (True, False),
    "functions": ([],), "function_call": ("none", "auto"), "modalities": (["text"],),
}


def check_fields(body: dict[str, Any]) -> None:
    """A field Ebb does not support is a 400 that names it (never a reply that ignored it);
    a null value counts as absent."""
    for name, value in body.items():
        if value is None or name in HANDLED or name in SAFE_TO_IGNORE:
            continue
        if name in NEUTRAL:
            if value in NEUTRAL[name]:
                continue
            raise ApiError(400, f"Ebb does not support '{name}' (as {json.dumps(value)[:80]}) yet: "
                                "the reply could not honour it", name)
        raise ApiError(400, f"unknown or unsupported field '{name}'", name)


def parse_chat_request(body: Any) -> ChatRequest:
    """Check a /v1/chat/completions body; ApiError(400) says what is wrong and where."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_fields(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    system: list[str] = []
    turns: list[Turn] = []
    for i, msg in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ApiError(400, "a message must be an object", param)
        role = msg.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise ApiError(400, f"unsupported role {role!r} (system, developer, user and "
                                "assistant are)", f"{param}.role")
        text, images = _content(msg.get("content"), str(role), f"{param}.content")
        if role in ("system", "developer"):
            system.append(text)
        else:
            turns.append(Turn(str(role), text, images))
    if not turns or turns[-1].role != "user":
        raise ApiError(400, "the last message must be the user's", "messages")
    n = _integer(body, "n", 1)
    if n not in (None, 1):
        raise ApiError(400, "only n=1 is supported", "n")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", "stream")
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    stop = body.get("stop")
    stops: tuple[str, ...]
    if stop is None:
        stops = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(s for s in stop if s)
    else:
        raise ApiError(400, "'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"at most {MAX_STOPS} stop sequences", "stop")
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    seed = _integer(body, "seed", -(2**63))
    user = body.get("user", "")
    grammar = response_grammar(body.get("response_format"))
    top_logprobs = -1
    if body.get("logprobs") is not None and not isinstance(body.get("logprobs"), bool):
        raise ApiError(400, "'logprobs' must be true or false", "logprobs")
    if body.get("logprobs"):
        top_logprobs = _integer(body, "top_logprobs", 0) or 0
        if top_logprobs > MAX_TOP_LOGPROBS:
            raise ApiError(400, f"'top_logprobs' is at most {MAX_TOP_LOGPROBS}", "top_logprobs")
        if stream:
            raise ApiError(400, "Ebb does not stream logprobs yet: ask without 'stream'", "logprobs")
    elif body.get("top_logprobs"):
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return ChatRequest(
        system="\n\n".join(system) if system else None, history=tuple(turns[:-1]),
        last=turns[-1], stream=stream, include_usage=bool(options.get("include_usage")),
        temperature=_number(body, "temperature", 0.0, 2.0), top_p=_number(body, "top_p", 0.0, 1.0),
        max_tokens=max_tokens or 0, stop=stops, seed=seed,
        user=user if isinstance(user, str) else "", grammar=grammar, top_logprobs=top_logprobs)


def response_grammar(fmt: Any) -> str:
    """The grammar a `response_format` asks for: none for text, any JSON object for
    json_object, the schema's shape for json_schema (llama-cpp-python's converter)."""
    if fmt is None:
        return ""
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(400, "'response_format.type' must be text, json_object or json_schema",
                       "response_format")
    from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

    if fmt["type"] == "text":
        return ""
    if fmt["type"] == "json_object":
        return str(JSON_GBNF)
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise ApiError(400, "'response_format.json_schema.schema' must be a JSON schema object",
                       "response_format")
    try:
        return str(json_schema_to_gbnf(json.dumps(schema)))
    except Exception as exc:  # noqa: BLE001 - the converter raises many kinds
        raise ApiError(400, f"the JSON schema cannot be followed: {exc}", "response_format") from None


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
    if stopped_by_sequence or stop_reason == "stop":
        return "stop"
    if stop_reason in ("length", "context_full"):
        return "length"
    return "stop"


def new_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(cid: str, model: str, text: str, finish: str, use: dict[str, int],
               logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish,
                         "logprobs": {"content": logprobs} if logprobs is not None else None}],
            "usage": use}


def logprobs_within(entries: list[dict[str, Any]] | None, text: str) -> list[dict[str, Any]] | None:
    """The entries of the tokens that make up `text` (a stop sequence may have cut the reply)."""
    if entries is None:
        return None
    out, n = [], 0
    for e in entries:
        if n >= len(text):
            break
        out.append(e)
        n += len(e["token"])
    return out


def chunk(cid: str, model: str, delta: dict[str, Any], finish: str | None = None,
          use: dict[str, int] | None = None, choices: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
        if choices else []}
    if use is not None:
        out["usage"] = use
    return out
