"""The pictures and sound clips of a turn's prompt, between the session and the projector
(a clip goes everywhere a picture goes: its chunks, the cache, the plan; "image" in the names
below means either).

- `tokenize`: mtmd's chunks of a prompt, with an image's pixels only where one of its chunks
  is not encoded yet (else only its size, a placeholder);
- `encode_new`: every chunk of the prompt that is not cached, encoded in one plan (the pure
  planner's `plan_vision`, carried out step by step by `PlanRun`);
- `prompt_items`: the prompt as the runtime prefills it (tokens, and the cached embeddings);
- `switch`: vision on or off (a resident projector is freed).

The session (engine/session/session.py) decides which images a turn has; this module only turns them
into chunks and embeddings. Engine thread only.
"""
from __future__ import annotations

import collections
import threading
from pathlib import Path
from typing import Callable

from engine.config import SessionConfig
from engine.errors import EbbError
from engine.events import TurnResult
from engine.gguf.info import ModelInfo
from engine.llama.runtime import ImageSpan, PromptItem
from engine.placement.plan import CPU, DoesNotFit, plan_vision
from engine.placement.residency import ModelResidency
from engine.placement.timeline import Timeline
from engine.media.attachments import shown_names
from engine.media.encoder import MediaEncoder
from engine.media.images import LoadedMedia
from engine.media.projector import TextPiece, TokenizedPrompt
from engine.media.swap import ChunkWork, PlanRun


class TurnMedia:
    def __init__(self, cfg: SessionConfig, info: ModelInfo, n_ctx: int, model: ModelResidency,
                 encoder: MediaEncoder) -> None:
        self.cfg, self.info, self.n_ctx = cfg, info, n_ctx  # cfg: vision, flash, mover
        self.model, self.encoder = model, encoder

    def switch(self, enabled: bool) -> None:
        """The projector on or off (pictures and sound alike). Never reloads the model; frees a
        resident projector. Off, the residency map says "off" (it is kept in RAM, unused)."""
        self.encoder.enabled = enabled
        if not enabled:
            if self.encoder.free_on_device(self.model.accel):
                self.model.reschedule()  # freed device buffers: plan the next graph afresh
        self.model.projector = "RAM" if enabled else "off"
        self.model.emit()

    def tokenize(self, text: str, add_special: bool, keys: list[str],
                 pixels: list[LoadedMedia]) -> TokenizedPrompt:
        """mtmd's chunks of `text` (one marker per key): an image's pixels go in when one of its
        chunks is not encoded yet, else only its size (a placeholder)."""
        enc = self.encoder
        assert enc.ram is not None
        by_key = {enc.key(i): i for i in pixels}
        if missing := [k for k in keys if not enc.is_cached(k) and k not in by_key]:
            raise EbbError(f"{len(missing)} earlier image(s) of this conversation cannot be read",
                           "start a new conversation")
        bitmaps = [enc.bitmap(k, None if enc.is_cached(k) else by_key[k]) for k in keys]
        prompt = enc.ram.tokenize(text, bitmaps, add_special)
        counts = collections.Counter(p.image for p in prompt.images())
        for i, (k, b) in enumerate(zip(keys, bitmaps)):
            enc.note_layout(k, b, counts[i])
        return prompt

    def encode_new(self, prompt: TokenizedPrompt | list[int], keys: list[str], images: list[LoadedMedia],
                   res: TurnResult, tl: Timeline, cancel: threading.Event | None = None,
                   before_restore: Callable[[int], None] | None = None) -> None:
        """Encode every image chunk of the prompt that is not cached yet (the message's images
        and any earlier ones, e.g. after a conversation is reopened), in one plan. Every chunk
        of the prompt is pinned in the cache until the caller unpins (`encoder.pin(set())`)."""
        if not isinstance(prompt, TokenizedPrompt):
            return
        enc, model = self.encoder, self.model
        enc.pin({enc.chunk_key(keys[p.image], p.index) for p in prompt.images()})
        names = {enc.key(i): (shown, len(i.rgb))
                 for i, shown in zip(images, shown_names([i.path for i in images]))}
        todo: dict[str, ChunkWork] = {}
        for piece in prompt.images():
            key = keys[piece.image]
            ck = enc.chunk_key(key, piece.index)
            if piece.placeholder or ck in todo or enc.is_chunk_cached(ck):
                continue
            name, n_bytes = names.get(key) or (Path(enc.path_of(key) or key).name, 0)
            todo[ck] = ChunkWork(piece, ck, name, n_bytes)
        new_images = {w.key.rsplit("#", 1)[0] for w in todo.values()}
        message_keys = {enc.key(i) for i in images}
        res.n_images_encoded = len(message_keys & new_images)
        res.n_images_cached = len(images) - sum(1 for i in images if enc.key(i) in new_images)
        if not todo:
            if images:
                res.reason = f"all {len(images)} images already encoded (cache)"
            return
        assert enc.info is not None and model.runtime is not None
        n_tokens = sum(w.piece.n_tokens for w in todo.values())
        res.n_image_tokens_encoded, res.n_image_chunks_encoded = n_tokens, len(todo)
        state_bytes = self.n_ctx * self.info.kv_bytes_per_token if model.has_positions() else 0
        with tl.step("plan", CPU):
            plan = plan_vision(self.cfg.vision, model.placement, enc.info, model.budget_bytes,
                               n_tokens, state_bytes, self.cfg.flash, enc.costs,
                               resident_loaded=enc.on_device is not None,
                               reload_ok=self.cfg.mover != "live",
                               used_bytes=model.ledger.total(model.accel) if model.accel else None)
        if isinstance(plan, DoesNotFit):
            raise EbbError(plan.reason)
        res.strategy, res.reason = plan.strategy, plan.reason
        res.swap_mover, res.mover_note = plan.mover, plan.mover_note
        tl.plan = plan
        run = PlanRun(plan, list(todo.values()), model, enc, tl, before_restore, cancel)
        try:
            run.run()
        finally:
            res.reason += "".join(f"; {note}" for note in run.notes)
            res.device_notes = list(run.notes)
            # what was encoded, not what was planned: a Stop between two frames left the rest
            done = [w for w in todo.values() if enc.holds(w.key)]
            res.n_image_chunks_encoded = len(done)
            res.n_image_tokens_encoded = sum(w.piece.n_tokens for w in done)
            res.n_images_encoded = sum(1 for k in message_keys & new_images if enc.is_cached(k))

    def prompt_items(self, prompt: TokenizedPrompt | list[int], keys: list[str]) -> list[PromptItem]:
        """What the runtime prefills: tokens, and each image chunk's cached embeddings."""
        if not isinstance(prompt, TokenizedPrompt):
            return list(prompt)
        enc = self.encoder
        items: list[PromptItem] = []
        for piece in prompt.pieces:
            if isinstance(piece, TextPiece):
                items.extend(piece.tokens)
                continue
            ck = enc.chunk_key(keys[piece.image], piece.index)
            items.append(ImageSpan(ck, enc.embeddings(ck), piece.chunk, prompt.mctx, piece.n_pos))
        return items
