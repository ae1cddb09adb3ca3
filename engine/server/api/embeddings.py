"""/v1/embeddings: a request checked into an `EmbeddingRequest`, and the list of vectors.
Pure."""
from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from engine.server.errors import ApiError as ApiError  # where every rule below raises it
from engine.server.api.common import check_fields, integer, one_prompt


EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "user", "dimensions"})
MAX_EMBEDDING_INPUTS = 256


@dataclass(frozen=True)
class EmbeddingRequest:
    inputs: tuple[str | tuple[int, ...], ...]
    base64: bool = False  # encoding_format: little-endian float32, base64
    dimensions: int | None = None
    user: str = ""


def parse_embedding_request(body: Any) -> EmbeddingRequest:
    """Check a /v1/embeddings body."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_fields(body, EMBEDDING_FIELDS, {})
    value = body.get("input")
    if value is None:
        raise ApiError(400, "'input' is required", "input")
    inputs: list[str | tuple[int, ...]]
    if isinstance(value, str) or (isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value)):
        inputs = [one_prompt(value, "input")]
    elif isinstance(value, list) and value:
        if len(value) > MAX_EMBEDDING_INPUTS:
            raise ApiError(400, f"at most {MAX_EMBEDDING_INPUTS} inputs per request", "input")
        inputs = [one_prompt(v, f"input[{i}]") for i, v in enumerate(value)]
    else:
        raise ApiError(400, "'input' must be a string, a list of strings, or token ids", "input")
    if any(v == "" for v in inputs):
        raise ApiError(400, "an input is empty", "input")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise ApiError(400, "'encoding_format' must be float or base64", "encoding_format")
    user = body.get("user", "")
    return EmbeddingRequest(tuple(inputs), fmt == "base64", integer(body, "dimensions", 1),
                            user if isinstance(user, str) else "")


def embedding_list(model: str, vectors: list[list[float]], n_tokens: int,
                   as_base64: bool) -> dict[str, Any]:
    import struct

    def encode(v: list[float]) -> Any:
        return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode() if as_base64 else v

    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}
