"""Why a reply stopped, and what that allows: the one place that knows (the session, the
window and the server ask here). Plain values, as llama.cpp's loop and the JSON say them."""
from __future__ import annotations

STOP = "stop"  # the model ended its turn
LENGTH = "length"  # the reply cap
CANCELLED = "cancelled"  # Stop, or a client that left
CONTEXT_FULL = "context_full"  # no room left in the context


def resumes_from_cache(reason: str) -> bool:
    """The KV cache ends with this reply as it stopped: Continue decodes on from there."""
    return reason in (LENGTH, CANCELLED)


def can_continue(reason: str) -> bool:
    """Continue may go on with the reply (after a full context, older turns make room first)."""
    return reason in (LENGTH, CANCELLED, CONTEXT_FULL)
