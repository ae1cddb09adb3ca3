"""The conversation's records and how it is fitted into the context: pure, no llama.cpp.

`fit_history` decides what leaves the model's memory when a conversation outgrows the context,
given only a token counter (`count(history) -> KV cells the prompt takes`); the session passes
one that formats the template and counts as llama.cpp and mtmd do. A test can pass any counter.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Callable, Sequence

from engine import stops
from engine.stops import StopReason
from engine.errors import EbbError

__all__ = ["Conversation", "Fitted", "History", "HistoryTurn", "ReplyState", "drop_oldest",
           "fit_history"]


@dataclass(frozen=True)
class HistoryTurn:
    role: str  # user | assistant | tool (a function's result, with a template that has tools)
    text: str
    image_keys: tuple[str, ...] = ()
    # more of the message for the chat template: an assistant's `tool_calls`, a result's
    # `tool_call_id` and `name` (the local server's function calling, engine/tools/calls.py)
    extra: dict[str, Any] | None = None
    # text around an image's marker where it is not a picture's plain one (nothing before, a
    # new line after): a video's frames ("Video:", timestamps), a PDF's pages, by image key
    labels: tuple[tuple[str, str, str], ...] = ()

    def label(self, key: str) -> tuple[str, str]:
        for k, before, after in self.labels:
            if k == key:
                return before, after
        return "", "\n"


class ReplyState(str, Enum):
    """Where the conversation's last reply is in its life: one value, as llama.cpp's server
    keeps a slot's (idle, processing the prompt, generating), not flags."""
    IDLE = "idle"  # nothing to go on with from the KV cache: a conversation set or replaced,
    # a reply that ended on its own or on a full context, or the cache has moved on since
    PROMPT = "prompt"  # a turn evaluates its prompt (its pictures encoded, the prefill)
    GENERATING = "generating"  # its reply is being decoded
    OPEN = "open"  # the last reply stopped on its cap or a Stop and the KV cache ends with it:
    # Continue decodes on from there, with no prefill

    def __str__(self) -> str:
        return str(self.value)


@dataclass(frozen=True)
class Conversation:
    """A session's conversation, to put back after answering someone else
    (Session.save_conversation / restore_conversation)."""
    history: tuple[HistoryTurn, ...]
    reply: ReplyState  # OPEN: the last reply can be continued from the KV cache
    last_stop: StopReason | None  # how its last reply ended (None: none yet)
    forgotten: int  # turns at the start no longer in the model's memory
    system: str | None
    tools: tuple[dict[str, Any], ...] | None
    template_kwargs: tuple[tuple[str, Any], ...] = ()  # the template's own switches
    tag: str = "x"  # what its saved states go by (Session.set_history)


class History:
    """The conversation a session holds (its turns, the system prompt aside), what the chat
    template is given with it, and the life of its last reply. The session changes it only
    through these steps; the session's thread."""

    def __init__(self) -> None:
        self.turns: list[HistoryTurn] = []
        self.forgotten = 0  # turns at the start no longer in the model's memory
        self.tools: list[dict[str, Any]] | None = None  # functions the template lists
        self.template_kwargs: dict[str, Any] = {}  # the template's own switches (enable_thinking)
        self.tag = "x"  # what the conversation's kept states go by (a chat's id)
        self.reply = ReplyState.IDLE
        self.last_stop: StopReason | None = None  # how the last reply ended (None: none yet)

    def reset(self, turns: list[HistoryTurn], tag: str) -> None:
        """Another conversation, or another branch of this one."""
        self.turns, self.forgotten, self.tag = turns, 0, tag or "x"
        self.reply, self.last_stop = ReplyState.IDLE, None

    def begin_prompt(self) -> None:
        self.reply = ReplyState.PROMPT

    def begin_reply(self) -> None:
        self.reply = ReplyState.GENERATING

    def reply_ended(self, reason: StopReason) -> None:
        """The reply stopped (`reason`: a StopReason): open when the cache ends with it."""
        self.reply = ReplyState.OPEN if stops.resumes_from_cache(reason) else ReplyState.IDLE
        self.last_stop = reason

    def interrupted(self) -> None:
        """A turn failed or was stopped part-way: nothing to go on with from the cache."""
        if self.reply in (ReplyState.PROMPT, ReplyState.GENERATING):
            self.reply = ReplyState.IDLE

    def moved_on(self) -> None:
        """Something else was evaluated (another turn, a completion, a swap): the last reply
        is continued by a prefill up to it, no longer from the cache."""
        if self.reply is ReplyState.OPEN:
            self.reply = ReplyState.IDLE

    @property
    def resumes_from_cache(self) -> bool:
        return (self.reply is ReplyState.OPEN and self.last_stop is not None
                and stops.resumes_from_cache(self.last_stop))

    def add_exchange(self, turn: HistoryTurn, reply: str) -> None:
        self.turns = self.turns + [turn, HistoryTurn("assistant", reply)]

    def stopped_before_reply(self, turn: HistoryTurn) -> None:
        """Stop before the reply began: the message stays, with an empty reply."""
        self.add_exchange(turn, "")
        self.reply, self.last_stop = ReplyState.IDLE, stops.CANCELLED

    def set_tools(self, tools: list[dict[str, Any]] | None) -> None:
        self.tools = tools or None

    def set_template_kwargs(self, kwargs: dict[str, Any]) -> None:
        self.template_kwargs = dict(kwargs)

    def hold_out_reply(self) -> HistoryTurn:
        """The last reply, taken out while the conversation before it is rendered (Continue
        prefills up to it); `put_back` returns it, whatever happens meanwhile."""
        before, self.turns = self.turns[-1], self.turns[:-1]
        return before

    def put_back(self, reply: HistoryTurn) -> None:
        self.turns = self.turns + [reply]

    def set_last_reply(self, text: str, extra: dict[str, Any] | None = None) -> None:
        """The last reply as it stays: its text, and (a tool call) its `tool_calls`."""
        self.turns = self.turns[:-1] + [HistoryTurn("assistant", text, extra=extra)]

    def take_back(self) -> None:
        """The last message and its reply leave (a tool loop asks again, without tools)."""
        self.turns = self.turns[:-2]
        self.reply = ReplyState.IDLE

    def undo_last_exchange(self) -> HistoryTurn | None:
        """Drop the last user turn and what follows it (Regenerate); returns that turn."""
        for i in range(len(self.turns) - 1, -1, -1):
            if self.turns[i].role == "user":
                turn = self.turns[i]
                self.turns = self.turns[:i]
                self.reply = ReplyState.IDLE
                return turn
        return None

    def fitted(self, fitted: "Fitted") -> None:
        """What `fit_history` kept: the turns it let go are forgotten."""
        self.turns = list(fitted.history)
        self.forgotten += fitted.n_turns_dropped

    def without_images(self, lost: set[str]) -> None:
        """Images that can no longer be read leave; their turns' text stays."""
        self.turns = [replace(t, image_keys=tuple(k for k in t.image_keys if k not in lost))
                      for t in self.turns]

    def saved(self, system: str | None) -> Conversation:
        return Conversation(tuple(self.turns), self.reply, self.last_stop, self.forgotten, system,
                            tuple(self.tools) if self.tools is not None else None,
                            tuple(self.template_kwargs.items()), self.tag)

    def restore(self, saved: Conversation) -> None:
        self.turns, self.reply, self.last_stop = list(saved.history), saved.reply, saved.last_stop
        self.forgotten, self.tag = saved.forgotten, saved.tag
        self.tools = list(saved.tools) if saved.tools is not None else None
        self.template_kwargs = dict(saved.template_kwargs)


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
