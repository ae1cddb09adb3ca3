"""Why a reply stopped, and what that allows: the one place that knows (the runtime, the
session, the window and the server ask here). A `StopReason` is a str: the JSON and the store
keep its value ("stop", "length", "cancelled", "context_full"), as llama.cpp's loop says them."""
from __future__ import annotations

from enum import Enum


class StopReason(str, Enum):  # enum.StrEnum from Python 3.11; Ebb runs on 3.10 too
    STOP = "stop"  # the model ended its turn
    LENGTH = "length"  # the reply cap
    CANCELLED = "cancelled"  # Stop, or a client that left
    CONTEXT_FULL = "context_full"  # no room left in the context

    def __str__(self) -> str:  # its value in f-strings and str() on every Python
        return str(self.value)


STOP, LENGTH, CANCELLED, CONTEXT_FULL = (StopReason.STOP, StopReason.LENGTH, StopReason.CANCELLED,
                                         StopReason.CONTEXT_FULL)


def resumes_from_cache(reason: str) -> bool:
    """The KV cache ends with this reply as it stopped: Continue decodes on from there."""
    return reason in (LENGTH, CANCELLED)


def can_continue(reason: str) -> bool:
    """Continue may go on with the reply (after a full context, older turns make room first)."""
    return reason in (LENGTH, CANCELLED, CONTEXT_FULL)


def openai_finish(reason: str) -> str:
    """OpenAI's finish_reason for a stop: the cap and a full context are both "length"."""
    return "length" if reason in (LENGTH, CONTEXT_FULL) else "stop"
