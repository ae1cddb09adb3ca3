"""A conversation as the model's prompt, one owner (`session.prompt`): the chat template's
messages with a marker per picture, the prompt tokenized as llama.cpp's own tools tokenize it
(mtmd's chunks where there are pictures), what it takes of the context, the conversation fitted
into it (engine/conversation.py decides what leaves), and a message's attachments read into
pictures and text: a video takes the frames the context has room for.

A new kind of attachment comes in through `expand` (engine/media/attachments.py makes its
pictures, labels and text); nothing here knows one kind from another but a video's share of
the room. The session's thread.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from engine.config import SessionConfig
from engine.conversation import History, HistoryTurn, fit_history, reply_room
from engine.events import TurnResult
from engine.media import kinds
from engine.media.attachments import Expanded, Projector, expand
from engine.media.attachments import parse as parse_ref
from engine.media.encoder import MediaEncoder
from engine.media.images import LoadedMedia
from engine.media.projector import TextPiece
from engine.media.turn import TurnMedia
from engine.placement.residency import ModelResidency


class ConversationPrompt:
    def __init__(self, chat: History, model: ModelResidency, encoder: MediaEncoder,
                 media: TurnMedia, n_ctx: int, cfg: Callable[[], SessionConfig]) -> None:
        self.chat = chat
        self.model = model
        self.encoder = encoder
        self.media = media
        self.n_ctx = n_ctx
        self._cfg = cfg  # the session's, as it stands (its system prompt changes with the chat)

    @property
    def reply_room(self) -> int:
        """Cells a turn keeps free for its reply when the conversation is fitted."""
        return reply_room(self.n_ctx)

    def messages(self, extra: HistoryTurn | None = None,
                 history: Sequence[HistoryTurn] | None = None,
                 system: str | None | Literal[False] = False) -> tuple[list[dict[str, Any]], list[str]]:
        """Chat messages for the template (`history`, default the conversation's, then `extra`),
        and the image keys in prompt order. With vision off, earlier images are left out.
        `system`: the system text (None: none), by default the session's."""
        marker = self.encoder.marker
        use_images = bool(marker) and self.encoder.enabled
        if system is False:
            system = self._cfg().system
        msgs = [{"role": "system", "content": system}] if system else []
        keys: list[str] = []
        for t in [*(self.chat.turns if history is None else history), *([extra] if extra else [])]:
            images = t.image_keys if use_images else ()
            media = "".join(f"{before}{marker}{after}" for before, after in map(t.label, images))
            msgs.append({"role": t.role, "content": media + t.text, **(t.extra or {})})
            keys.extend(images)
        return msgs, keys

    def format(self, messages: list[dict[str, Any]]) -> tuple[str, bool]:
        """The template rendered, and whether it wrote the BOS itself."""
        assert self.model.runtime is not None
        return self.model.runtime.format_chat(messages, self.chat.tools, self.chat.template_kwargs)

    def tokenize(self, messages: list[dict[str, Any]], keys: list[str],
                 pixels: list[LoadedMedia]) -> Any:
        """The prompt of `messages` as llama.cpp's own tools tokenize it: mtmd's chunks when it
        has images (one marker per key), else the model's tokens. A context manager."""
        assert self.model.runtime is not None
        text, added_special = self.format(messages)
        if not keys:
            return contextlib.nullcontext(self.model.runtime.tokenize(text, add_special=not added_special))
        return self.media.tokenize(text, not added_special, keys, pixels)

    def count(self, history: Sequence[HistoryTurn], extra: HistoryTurn | None,
              pixels: list[LoadedMedia], open_reply: str = "") -> int:
        """KV cells the conversation (with `extra`) takes as a prompt: the template's tokens and
        every image chunk's, as mtmd counts them (nothing is encoded)."""
        assert self.model.runtime is not None
        messages, keys = self.messages(extra, history)
        text, added_special = self.format(messages)
        text += open_reply
        if not keys:
            return len(self.model.runtime.tokenize(text, not added_special))
        with self.media.tokenize(text, not added_special, keys, pixels) as prompt:
            return sum(len(p.tokens) if isinstance(p, TextPiece) else p.n_tokens
                       for p in prompt.pieces)

    def fit(self, turn: HistoryTurn | None, pixels: list[LoadedMedia], res: TurnResult,
            open_reply: str = "") -> None:
        """Make the conversation plus `turn` (None: Continue of the last reply) fit the context
        with room for the reply; `res` says what left."""
        def count(history: Sequence[HistoryTurn]) -> int:
            return self.count(history, turn, pixels, open_reply)

        fitted = fit_history(self.chat.turns, count, self.n_ctx, self.reply_room,
                             self._cfg().overflow, continuing=turn is None)
        self.chat.fitted(fitted)
        res.n_turns_dropped += fitted.n_turns_dropped
        res.n_images_dropped += fitted.n_images_dropped
        res.n_tokens_dropped = fitted.n_tokens_dropped
        res.memory_starts_at = self.chat.forgotten

    def projector_view(self) -> Projector | None:
        """What attachments need of the loaded projector: whether it sees, the size frames and
        pages are made at, and its token count for a picture."""
        ram = self.encoder.ram
        if ram is None or not self.encoder.enabled:
            return None
        return Projector(ram.sees, self.encoder.side, lambda w, h: ram.image_tokens(w, h)[0],
                         ram.hears, ram.sample_rate)

    def expand(self, refs: Sequence[str | Path], role: str, text: str) -> list[Expanded]:
        """Each attachment's pictures, labels and text. A video takes the frames the context
        has room for: what is free after the conversation and this message, or half the
        context where less is free (older turns then leave, as for any long message)."""
        proj = self.projector_view()
        names = [str(r) for r in refs]
        n_videos = sum(kinds.kind_of(parse_ref(r).path) == kinds.VIDEO for r in names)
        room = 0
        if n_videos:
            usable = self.n_ctx - self.reply_room
            used = self.count(self.chat.turns, HistoryTurn(role, text), self.pending_images())
            room = max(usable - used, usable // 2) // n_videos
        return [expand(r, proj, room, self.encoder.load) for r in names]

    def pending_images(self) -> list[LoadedMedia]:
        """Earlier images not encoded yet (a saved conversation, reopened). One that can no
        longer be read leaves the conversation: its place in the prompt goes with it."""
        if not self.encoder.enabled:
            return []
        images, lost = self.encoder.pending([k for t in self.chat.turns for k in t.image_keys])
        if lost:
            self.chat.without_images(set(lost))
        return images
