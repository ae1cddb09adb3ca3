"""The conversation's records and how it is fitted into the context: pure, no llama.cpp.

`fit_history` decides what leaves the model's memory when a conversation outgrows the context,
given only a token counter (`count(history) -> KV cells the prompt takes`); the session passes
one that formats the template and counts as llama.cpp and mtmd do. A test can pass any counter.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from engine.errors import EbbError

__all__ = ["Conversation", "Fitted", "HistoryTurn", "drop_oldest", "fit_history"]


@dataclass(frozen=True)
class HistoryTurn:
    role: str  # user | assistant | tool (a function's result, with a template that has tools)
    text: str
    image_keys: tuple[str, ...] = ()
    # more of the message for the chat template: an assistant's `tool_calls`, a result's
    # `tool_call_id` and `name` (the local server's function calling, engine/server/tools.py)
    extra: dict[str, Any] | None = None
    # text around an image's marker where it is not a picture's plain one (nothing before, a
    # new line after): a video's frames ("Video:", timestamps), a PDF's pages, by image key
    labels: tuple[tuple[str, str, str], ...] = ()

    def label(self, key: str) -> tuple[str, str]:
        for k, before, after in self.labels:
            if k == key:
                return before, after
        return "", "\n"


@dataclass(frozen=True)
class Conversation:
    """A session's conversation, to put back after answering someone else
    (Session.save_conversation / restore_conversation)."""
    history: tuple[HistoryTurn, ...]
    reply_open: bool  # the last reply can be continued from the KV cache
    last_stop: str
    forgotten: int  # turns at the start no longer in the model's memory
    system: str | None
    tools: tuple[dict[str, Any], ...] | None
    template_kwargs: tuple[tuple[str, Any], ...] = ()  # the template's own switches
    tag: str = "x"  # what its saved states go by (Session.set_history)


@dataclass(frozen=True)
class Fitted:
    """What `fit_history` kept, and what it let go."""
    history: tuple[HistoryTurn, ...]
    n_turns_dropped: int = 0  # whole turns from the start (they add to the session's `forgotten`)
    n_images_dropped: int = 0  # images of older turns (their text stays)
    n_tokens_dropped: int = 0


def drop_oldest(history: Sequence[HistoryTurn], keep: int) -> tuple[tuple[HistoryTurn, ...], int, int]:
    """One step of drop-oldest: the images of the oldest turn before the last exchange that
    still has some, else the oldest exchange (a user turn and its replies). `keep`: turns at the
    end that must stay. Returns (history, turns dropped, images dropped)."""
    h = list(history)
    older = max(0, len(h) - 2 - keep)
    for i in range(older):
        if h[i].image_keys:
            n = len(h[i].image_keys)
            h[i] = replace(h[i], image_keys=())
            return tuple(h), 0, n
    end = 1
    while end < len(h) - keep and h[end].role != "user":
        end += 1
    end = min(end, len(h) - keep)
    if end <= 0:
        raise ValueError("nothing left to drop")
    return tuple(h[end:]), end, 0


def reply_room(n_ctx: int) -> int:
    """Cells a turn keeps free for its reply when the conversation is fitted (the window's
    recording limit counts with it too)."""
    return min(1024, n_ctx // 4)


def fit_history(history: Sequence[HistoryTurn], count: Callable[[Sequence[HistoryTurn]], int],
                n_ctx: int, reply_room: int, overflow: str, continuing: bool) -> Fitted:
    """Make `history` fit `n_ctx` with `reply_room` cells left for the reply.

    `count(h)`: the cells the prompt takes with history `h` (the new message included by the
    counter; `continuing`: Continue of the last reply, whose question must stay). A message
    that cannot fit even alone is refused with the numbers; else under `drop-oldest` older turns
    leave: first the images of turns before the last exchange, then the oldest exchanges.
    Under `stop` the turn is refused. The history passed in is never changed."""
    h = tuple(history)
    n = count(h)
    limit = n_ctx - reply_room
    if n <= limit:
        return Fitted(h)
    keep = 1 if continuing else 0
    alone = count(h[len(h) - keep:] if keep else ())
    what = "this reply with its question" if continuing else "this message"
    if alone > limit:
        raise EbbError(f"{what} is {alone} tokens; the context holds {n_ctx} and "
                       f"keeps {reply_room} for the reply",
                       "raise the context length to go on" if continuing
                       else "shorten it, send fewer or smaller pictures or shorter clips, or raise the "
                       "context length")
    if overflow == "stop":
        raise EbbError(f"the conversation is {n} tokens, the context holds {n_ctx} "
                       f"(with {reply_room} kept for the reply)",
                       "start a new conversation, raise the context length, or let the "
                       "oldest turns go (--overflow drop-oldest)")
    before, turns, images = n, 0, 0
    while n > limit:
        h, dt, di = drop_oldest(h, keep)
        turns, images = turns + dt, images + di
        n = count(h)
    return Fitted(h, turns, images, before - n)
