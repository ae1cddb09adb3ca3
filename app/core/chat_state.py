"""The window's state without Qt: the open conversation and its saved messages, whether a
model is loaded, and the one request in flight (busy → finished or failed) with its streamed
text. The window changes it through these methods and draws it; observers hear of every change.
GUI thread only (engine events reach it through the window's queued slot).
"""
from __future__ import annotations

import contextlib
import re
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from app.core.reply_stats import ReplyStats
from app.core.store import Message, Store, StoreError
from engine import stops
from engine.stops import StopReason
from engine.config import SessionConfig
from engine.events import GenStats, TurnResult


@dataclass(frozen=True)
class Pending:
    """The user message a request answers: put back in the composer if the request fails.
    For Continue, `continues` is the reply that goes on (kept as it is if that fails); for a
    new version of a reply, `regenerates` (the user message stays if that fails); for an edit,
    `edits` is the message it is a new version of."""
    text: str
    images: list[Path]
    message_id: int
    continues: Message | None = None
    regenerates: bool = False
    edits: int = 0
    seed: int | None = None  # the seed the reply samples with (None: greedy)
    seed_fixed: bool = False  # the chat fixes it (else each reply draws its own)


COMMIT_EVERY_S = 1.0  # a streaming reply is committed at least this often
# stops after which a reply can go on (a full context: older turns make room, by the policy)


RATE_AFTER_S = 0.5  # a reply's rate is said once it has streamed this long (it read 20,704 tok/s)


class ChatState:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.conv_id = 0
        self.loaded = False
        self.busy = False
        self.request_id = 0
        self.pending: Pending | None = None
        self.reply_parts: list[str] = []  # the streamed reply so far
        self.saved: Message | None = None  # the reply the last request saved
        self.save_error: str | None = None  # why the last reply could not be saved
        self.unsaved: list[Unsaved] = []  # replies a full disk kept from the store, in order
        self.reply_id = 0  # the reply's row while it streams (committed about once a second)
        self._committed_at = 0.0
        self._begun_at = 0.0  # when the request in flight was sent
        self.last_cfg: SessionConfig | None = None  # what the engine was last asked to load
        self._observers: list[Callable[[], None]] = []

    def observe(self, callback: Callable[[], None]) -> None:
        self._observers.append(callback)

    def _changed(self) -> None:
        for cb in self._observers:
            cb()

    # ------------------------------------------------------------ conversations

    def messages(self) -> list[Message]:
        return self.store.messages(self.conv_id) if self.conv_id else []

    @staticmethod
    def memory_from(messages: list[Message]) -> int | None:
        """The first message still in the model's memory, as the newest reply that had to let
        older turns go said (None: all of them)."""
        for m in reversed(messages):
            if m.stats.memory_from:
                return m.stats.memory_from
        return None

    def open_first(self) -> None:
        convs = self.store.conversations()
        self.conv_id = convs[0].id if convs else self.store.create_conversation()

    def new_conversation(self) -> bool:
        if self.busy:
            return False
        self.conv_id = self.store.create_conversation()
        return True

    def select(self, conv_id: int) -> bool:
        if self.busy:
            return False
        self.conv_id = conv_id
        return True

    def delete(self, conv_id: int) -> bool:
        """Delete a conversation into the trash (`undo_delete` brings it back). The one a reply
        is being written into is stopped first by the window. True when the open one went and
        another was opened."""
        if self.busy and conv_id == self.conv_id:
            return False
        self.store.delete(conv_id)
        if conv_id == self.conv_id:
            self.open_first()
            return True
        return False

    def undo_delete(self, conv_id: int) -> bool:
        """The deleted chat is back, and open (False while a reply is written elsewhere)."""
        self.store.restore(conv_id)
        return self.select(conv_id)

    def history(self, before: int | None = None) -> list[tuple[Any, ...]]:
        """The open branch as the engine takes it: (role, text, image files[, a kept tool
        call's record]); with `before`,
        only the messages ahead of that one (what a new version of it follows)."""
        msgs = self.messages()
        if before is not None:
            ids = self.store.branch_to(before)[:-1]
            msgs = self.store.messages(self.conv_id, ids=ids)
        return [(m.role, m.text, [str(p) for p in m.refs()], m.tool) if m.tool is not None
                else (m.role, m.text, [str(p) for p in m.refs()]) for m in msgs]

    # ------------------------------------------------------------ versions and branches

    def switch_version(self, message_id: int, step: int) -> bool:
        """Show the version `step` places from this message (its branch below it too)."""
        m = self.store.message(message_id)
        if self.busy or m is None or message_id not in m.siblings:
            return False
        i = m.siblings.index(message_id) + step
        if not 0 <= i < len(m.siblings):
            return False
        self.store.open_branch(m.siblings[i])
        return True

    def edit(self, message_id: int, text: str, images: list[Path]) -> Pending | None:
        """A new version of a user message (its old one stays, with its replies): saved, and
        to be answered. None when it cannot be now."""
        m = self.store.message(message_id)
        if self.busy or m is None or m.role != "user":
            return None
        self.store.end_branch_at(m.parent_id, self.conv_id)
        try:
            return replace(self.add_user_message(text, images), edits=message_id)
        except StoreError:
            self.store.open_branch(message_id)  # not saved: the old version stays open
            raise

    def edit_reply(self, message_id: int, text: str) -> int:
        """A new version of a reply, as the user wrote it (nothing is generated)."""
        m = self.store.message(message_id)
        if self.busy or m is None or m.role != "assistant":
            return 0
        self.store.end_branch_at(m.parent_id, self.conv_id)
        return self.store.add_message(self.conv_id, "assistant", text,
                                      stats=ReplyStats(edited=True, model=m.stats.model))

    def delete_branch(self, message_id: int) -> list[int]:
        """This message and what follows it, into the trash; the ids, to undo it."""
        if self.busy:
            return []
        return self.store.trash_branch(message_id)

    def undo_delete_branch(self, ids: list[int]) -> bool:
        if self.busy or not ids or self.store.conversation_of(ids[0]) != self.conv_id:
            return False
        self.store.restore_branch(ids)
        return True

    # ------------------------------------------------------------ the model

    def set_loading(self, cfg: SessionConfig | None = None) -> None:
        if cfg is not None:
            self.last_cfg = cfg
        self.loaded = False
        self._changed()

    def set_loaded(self) -> None:
        self.loaded = True
        self._changed()

    # ------------------------------------------------------------ one request at a time

    def can_send(self) -> bool:
        return self.loaded and not self.busy

    def add_user_message(self, text: str, images: list[Path]) -> Pending:
        """Save the user's message (titling a new conversation by it); returns it as stored."""
        if not self.store.n_messages(self.conv_id) and (text.strip() or images):
            taken = {c.title for c in self.store.conversations() if c.id != self.conv_id}
            self.store.rename(self.conv_id, chat_title(text, images, taken))
        mid = self.store.add_message(self.conv_id, "user", text, images)
        saved = self.store.message(mid)
        return Pending(text, saved.refs() if saved else [], mid)

    def last_message(self) -> Message | None:
        msgs = self.store.messages(self.conv_id, self.store.last_message_id(self.conv_id))
        return msgs[0] if msgs else None

    def can_continue(self) -> bool:
        last = self.last_message()
        return (self.can_send() and last is not None and last.role == "assistant"
                and (stops.can_continue(last.stats.stop_reason)
                     or last.state == "interrupted"))

    def continue_last(self) -> Pending | None:
        """The last reply, to go on with (None when it cannot)."""
        if not self.can_continue():
            return None
        last = self.last_message()
        assert last is not None
        return Pending("", [], last.id, continues=last)

    def regenerate(self, reply_id: int = 0) -> Pending | None:
        """Another version of a reply (default the last): the old one stays, the open branch
        ends at the user message it answers, which is returned to send again (None if none)."""
        reply = self.store.message(reply_id) if reply_id else self.last_message()
        if self.busy or reply is None or reply.role != "assistant" or reply.parent_id is None:
            return None
        user = self.store.message(reply.parent_id)
        while user is not None and user.role == "tool" and user.parent_id is not None:
            user = self.store.message(user.parent_id)  # the calls go with the reply: asked again
        if user is None or user.role != "user":
            return None
        self.store.end_branch_at(user.id, self.conv_id)
        return Pending(user.text, user.refs(), user.id, regenerates=True)

    def begin(self, pending: Pending) -> int:
        """A request is on its way for `pending`; returns its id. The reply's row is made now
        (state `streaming`), so what streams is committed as it comes."""
        self.request_id += 1
        self.pending = pending
        self.reply_parts = []
        self._begun_at = time.monotonic()
        self._first_at: float | None = None  # when the first piece came (the rate counts from it)
        self.reply_id = 0
        self._committed_at = time.monotonic()
        if pending.continues is not None:
            self.reply_id = pending.continues.id
        else:
            with contextlib.suppress(StoreError):  # a full disk: tried again at the end
                self.reply_id = self.store.add_message(self.conv_id, "assistant", "",
                                                       state="streaming")
        self.busy = True
        self._changed()
        return self.request_id

    def tool_call_ended(self, call: dict[str, Any], files: list[Path]) -> Message | None:
        """A call of the reply in flight ended (engine/tools/loop.py CallRecord.to_dict): it is
        kept as a message of its own (role "tool": the result as the model read it, with its
        pictures and clips) after the ones before it, and the reply goes on below it. The
        stored message, or None when the disk refused it (the reply goes on)."""
        from engine.tools.loop import stored_record

        mid, said, record = self.reply_id, call.get("said", ""), stored_record(call)
        with contextlib.suppress(StoreError):
            if mid:  # the row the reply began in holds the call (its place in the tree)
                self.store.make_tool_message(mid, said, files, record)
            else:
                mid = self.store.add_message(self.conv_id, "tool", said, files, tool=record)
        self.reply_id = 0
        self.reply_parts = []
        with contextlib.suppress(StoreError):
            self.reply_id = self.store.add_message(self.conv_id, "assistant", "", state="streaming")
        return self.store.message(mid) if mid else None

    def add_text(self, request_id: int, text: str) -> None:
        if request_id != self.request_id:
            return
        self.reply_parts.append(text)
        if self._first_at is None:
            self._first_at = time.monotonic()
        if self.reply_id and time.monotonic() - self._committed_at >= COMMIT_EVERY_S:
            self.commit_reply()

    def live_rate(self) -> tuple[int, float]:
        """(pieces streamed so far, pieces a second since the first): the reply's tokens and
        tokens/s as it streams (a piece is a token, but for a character split over two)."""
        n = len(self.reply_parts)
        elapsed = time.monotonic() - self._first_at if self._first_at is not None else 0.0
        if n < 2 or elapsed < RATE_AFTER_S:  # pieces come in batches: 10 at once is no rate
            return n, 0.0
        return n, (n - 1) / elapsed

    def stopped_result(self) -> TurnResult:
        """The turn as it stood when the window closed mid-reply (SIGTERM, Ctrl+Q): its text,
        the counts streamed so far (they showed 0 tokens · 0.0 tok/s) and the prompt's time as
        the window saw it, from Send to the first piece (it showed "prompt 0.00s")."""
        n, rate = self.live_rate()
        prompt_s = (self._first_at - self._begun_at) if self._first_at is not None else (
            time.monotonic() - self._begun_at)
        gen = GenStats(n_gen_tokens=n, gen_s=n / rate if rate > 0 else 0.0,
                       prompt_s=round(prompt_s, 3), stop_reason=StopReason.CANCELLED)
        return TurnResult(0, text="".join(self.reply_parts), gen=gen)

    def commit_reply(self) -> None:
        """Commit the reply so far (a kill from here on loses nothing before this)."""
        self._committed_at = time.monotonic()
        before = self.pending.continues.text if self.pending and self.pending.continues else ""
        with contextlib.suppress(StoreError):  # tried again in a second, and at the end
            self.store.update_message(self.reply_id, before + "".join(self.reply_parts),
                                      state="streaming")

    def finish(self, result: TurnResult, model: str = "") -> Pending | None:
        """The request ended with `result` (the engine's turn; `model` the file that wrote it):
        the reply is saved, or on an error the user's message is taken back. Returns the
        pending message when it failed."""
        pending, self.pending = self.pending, None
        failed = None
        self.saved = None
        self.save_error = None
        try:
            if pending is not None and pending.continues is not None:
                old = pending.continues
                if result.error:
                    failed = pending
                    self.store.update_message(old.id, old.text, state=old.state)
                else:
                    stats = self._remembered(result, old.stats.continued_by(
                        reply_stats(result, model, pending)))
                    text = old.text + result.text
                    self.saved = Message(old.id, "assistant", text, [], stats)
                    self.store.update_message(old.id, text, stats)
                self.saved = self.store.message(old.id) or self.saved
            elif result.error and pending is not None:
                failed = pending
                self._take_back(pending)
            elif pending is not None:
                stats = self._remembered(result, reply_stats(result, model, pending))
                self.saved = Message(self.reply_id, "assistant", result.text, [], stats)
                if self.reply_id:
                    self.store.update_message(self.reply_id, self.saved.text, stats)
                else:
                    self.reply_id = self.store.add_message(self.conv_id, "assistant",
                                                           self.saved.text, stats=stats)
                self.saved = self.store.message(self.reply_id) or self.saved
        except StoreError as exc:  # shown with the reply; the window is never left busy
            self.save_error = str(exc)
            if self.saved is not None:
                # kept here and written as soon as a write succeeds (retry_unsaved)
                self.unsaved.append(Unsaved(self.conv_id, self.saved.id, self.saved.text,
                                            self.saved.stats))
                self.saved.stats = replace(self.saved.stats, unsaved=str(exc))
        finally:
            self.busy = False
            self._changed()
        return failed

    def retry_unsaved(self) -> int:
        """Write the replies a full disk kept from the store; returns how many were saved now
        (the rest wait for the next try)."""
        saved = 0
        for u in list(self.unsaved):
            try:
                if u.reply_id and self.store.message(u.reply_id) is not None:
                    self.store.update_message(u.reply_id, u.text, u.stats)
                else:
                    self.store.add_message(u.conv_id, "assistant", u.text, stats=u.stats)
            except StoreError:
                break
            self.unsaved.remove(u)
            saved += 1
        if saved and not self.unsaved:
            self.save_error = None
        if saved:
            self._changed()
        return saved

    def _remembered(self, result: TurnResult, stats: ReplyStats) -> ReplyStats:
        """`stats` with the first message the model still remembers (by id), when older turns
        had to leave the context."""
        start = result.memory_starts_at
        if start:
            ids = self.store.message_ids(self.conv_id)
            if start < len(ids):
                return replace(stats, memory_from=ids[start])
        return stats

    def _take_back(self, pending: Pending) -> None:
        """A message the engine did not answer leaves the store with its reply so far; a chat
        it had named is "New chat" again (the refused text names no chat)."""
        if self.reply_id:
            self.store.delete_message(self.reply_id)
        if not pending.regenerates:  # a new version of a reply: the question stays
            self.store.delete_message(pending.message_id)
        if not self.store.n_messages(self.conv_id):
            self.store.rename(self.conv_id, "New chat")

    def fail(self) -> Pending | None:
        """The engine failed outside a turn's result: take the user's message back."""
        if not self.busy or self.pending is None:
            return None
        pending, self.pending = self.pending, None
        try:
            if pending.continues is None:
                self._take_back(pending)
        except StoreError as exc:
            self.save_error = str(exc)
        finally:
            self.busy = False
        self._changed()
        return pending


@dataclass(frozen=True)
class ChatHistory:
    """What the engine needs of the open chat: its messages and its system prompt."""
    turns: list[tuple[Any, ...]]
    system: str | None
    tag: str = ""  # what the engine's saved states of this chat go by (chat_tag)
    # set when another history follows: the engine stops taking this one's state back
    superseded: threading.Event = field(default_factory=threading.Event)


def chat_tag(conversation_id: int) -> str:
    """The name the engine's saved states of a chat go by (deleted with the chat)."""
    return f"chat{conversation_id}"


@dataclass
class Unsaved:
    """A finished reply the store refused (a full disk): written by retry_unsaved."""
    conv_id: int
    reply_id: int  # its streaming row, if one was made (0: none)
    text: str
    stats: ReplyStats


def reply_stats(r: TurnResult, model: str, pending: Pending | None = None) -> ReplyStats:
    """What a saved reply shows under it: tokens, speed, the seed it sampled with, and for
    image turns the strategy, encode time and swap time."""
    seed = pending.seed if pending is not None else None
    return ReplyStats.from_turn(r, model, seed, bool(pending and seed is not None and pending.seed_fixed))


# no token of a GGUF vocabulary is longer than this many bytes (llama.cpp's longest are runs of
# spaces or symbols of a few dozen): a message over n_ctx × this cannot fit, whatever its tokens
MAX_BYTES_PER_TOKEN = 64


def users_names(text: str, copies: dict[str, str]) -> str:
    """`text` (an engine's error) with each image copy's name in the store (its content hash)
    replaced by the name of the user's file it was copied from."""
    for copy, user in copies.items():
        text = text.replace(copy, user)
    return text


TITLE_CHARS = 48


def chat_title(text: str, attachments: list[Path], taken: set[str]) -> str:
    """A new chat's title from its first message: its first line, cut at a word within
    TITLE_CHARS; the attachments' names when it has no text; and a number after it when
    another chat has the same title (a list of "What colour is this picture?" told nothing)."""
    text = re.sub(r"^/tool\s+\S+\s*", "", text)  # "/tool NAME" asks for a tool: not the topic
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    words = " ".join(line.split())
    if len(words) > TITLE_CHARS:
        cut = words[:TITLE_CHARS].rsplit(" ", 1)[0]
        words = (cut if len(cut) >= TITLE_CHARS // 2 else words[:TITLE_CHARS]).rstrip(",.;:") + "…"
    if not words:
        words = ", ".join(Path(p).name for p in attachments)[:TITLE_CHARS] or "New chat"
    title, n = words, 1
    while title in taken:
        n += 1
        title = f"{words} ({n})"
    return title


def oversized(text: str, n_ctx: int) -> str:
    """Why a message is too long to send, judged from its size alone (a 5 MB paste is refused
    at once, before anything counts its tokens); "" when it may fit."""
    n_bytes = len(text.encode("utf-8", errors="replace"))
    if not n_ctx or n_bytes <= n_ctx * MAX_BYTES_PER_TOKEN:
        return ""
    return (f"This message is {n_bytes / 2**20:.1f} MiB: far more than this model's context "
            f"({n_ctx} tokens) can hold. Shorten it, or raise the context in Settings. "
            "Nothing was sent; the text stays here.")
