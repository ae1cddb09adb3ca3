"""A conversation with one model and (optionally) its vision projector held in RAM: the
turn's orchestration. Each job has its owner; the session calls them in order:
- `ModelResidency` (engine/placement/residency.py): the text model, where its layers live, the
  live mover, the ledger and the Residency events (`session.model`);
- `MediaEncoder` (engine/media/encoder.py): the projectors, the embeddings cache and the
  vision costs (`session.encoder`);
- `TurnMedia` (engine/media/turn.py): a prompt's image chunks, and encoding the new ones in
  one plan (the pure `plan_vision`, carried out step by step by `PlanRun`);
- `PhaseMover` (engine/placement/phase_mover.py): the prompt at its own placement, per phase;
- `History` (engine/conversation.py): the conversation, what its template is given and its
  last reply's life, one `ReplyState` (`session.chat`); with the pure fit of a conversation
  into the context;
- `ConversationPrompt` (prompt.py): the conversation as the model's prompt, what it takes of
  the context and a message's attachments read (`session.prompt`);
- `KeptMemory` (kept.py): the model's memory of conversations beyond the KV cache, in RAM
  and on disk (`session.kept`).
A new kind of attachment is read into pictures and text by engine/media (attachments.py's
`expand`, through `session.prompt.expand`): the turn takes what it gives.
Every step is a Span event. Owned by one thread (the CLI's, or the app's engine worker).
"""
from __future__ import annotations

import contextlib
import enum
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from engine import events
from engine.config import SessionConfig, flash_attn_for, thread_plan
from engine.conversation import Conversation, History, HistoryTurn, ReplyState
from engine.events import GenStats, TurnResult
from engine.errors import DeviceLost, EbbError, TurnCancelled
from engine.gguf.model_files import ModelFiles
from engine.hw import physical_cores
from engine.llama.devices import check_rpc_servers, pick_accelerator, rpc_bytes_sent
from engine.llama.loaded_model import check_context
from engine.llama.runtime import GenResult, PromptItem
from engine.llama.sampling import GenParams
from engine.placement.plan import CPU, projector_need_bytes
from engine.placement.phase_mover import PhaseMover
from engine.placement.residency import ModelResidency
from engine.placement.timeline import Timeline
from engine.media import kinds
from engine.media.attachments import PICTURE_LABEL
from engine.media.encoder import MediaEncoder
from engine.media.projector import TokenizedPrompt
from engine.media.turn import TurnMedia
from engine.session.kept import KeptMemory
from engine.session.prompt import ConversationPrompt

__all__ = ["Conversation", "HistoryTurn", "Session", "SessionConfig", "TurnResult",
           "turn_with_recovery"]


@dataclass
class LanePrompt:
    """A request's prompt for a lane (Session.lane_prompt): its token ids and ImageSpans, its
    cells' keys, what frees the chunks the spans point into, and the encode's steps."""
    items: list[PromptItem]
    keys: list[Any]
    close: Callable[[], None]
    spans: list[events.Span]
    n_images: int = 0  # the last message's pictures and clips
    strategy: str = "none"  # how they were encoded ("cpu"; "none": all cached)


class Life(enum.Enum):
    """A session's life: its model answers; its device went away (nothing may touch its
    buffers); closed."""
    LIVE = "live"
    ABANDONED = "abandoned"
    CLOSED = "closed"


class Session:
    def __init__(self, cfg: SessionConfig, emit: Callable[[events.Event], None] | None = None,
                 files: ModelFiles | None = None) -> None:
        """`files`: the model's and projector's headers when the caller has read them (the
        window's worker, once per load or Tune); else read here."""
        if cfg.phases is not None:  # autotune's per-phase choice, unless the user set a value
            ph = cfg.phases
            cfg = replace(cfg, gpu_layers=ph.gen_layers if cfg.gpu_layers is None else cfg.gpu_layers,
                          n_threads=ph.gen_threads or cfg.n_threads,
                          n_threads_batch=ph.prompt_threads or cfg.n_threads_batch)
        self._emit = emit or (lambda ev: None)
        self.files = files = ModelFiles.of(cfg.model_path, cfg.mmproj_path, files)
        self.info = files.info
        self.n_ctx = check_context(self.info, cfg.n_ctx)
        self.threads = thread_plan(cfg, physical_cores())  # every phase's, in one place
        self.n_threads = self.threads.gen
        # why the projector given is not used (sound this llama.cpp cannot encode): the model
        # then runs for text, and the window, the CLI and the endpoint say so
        self.projector_refused = files.projector_refused
        self.proj_info = files.proj
        if files.projector_refused:
            cfg = replace(cfg, mmproj_path=None)
        self.cfg = cfg
        # its life, in one place: LIVE, ABANDONED once its accelerator's server went away (its
        # buffers live there: nothing may touch them, a new session carries the chat on), CLOSED
        self.life = Life.LIVE
        # the conversation, what its template is given and its last reply's life (ReplyState:
        # an open one is continued from the KV cache, with no prefill)
        self.chat = History()
        self._request_id = 0
        # called with the device bytes the live mover freed, once the projector is gone and
        # before those layers come back (outside every span): bench swap times the link there
        self.before_restore: Callable[[int], None] | None = None
        events.pause_point("load")
        if cfg.flash_attn is None:  # auto: by where the layers will run
            cfg = self.cfg = replace(cfg, flash_attn=flash_attn_for(cfg, pick_accelerator(cfg.rpc, cfg.accel)))
        self.model = ModelResidency(cfg, self.info, self.n_ctx, self.n_threads, self._emit,
                                    lambda: self._request_id)
        self.phases = PhaseMover(self.model, self.info.n_layers, cfg.phases)
        self._stack = contextlib.ExitStack()
        self._stack.callback(self.model.close)
        sent0, t0 = rpc_bytes_sent(), time.monotonic()
        try:
            reserve = (projector_need_bytes(self.proj_info, cfg.flash)
                       if self.proj_info is not None and cfg.vision == "resident" else 0)
            self.model.load(reserve)
            self.encoder = MediaEncoder(cfg, self.proj_info, self.threads.encode, self.model.ledger,
                                        self.model.accel, self.model.accel_endpoint is not None)
            self.encoder.refused = self.projector_refused  # a clip's refusal names it
            self._stack.callback(self.encoder.close)  # before the models it is bound to
            if cfg.mmproj_path is not None:
                self.encoder.load_ram(self.model.host_model())
                self.model.projector = "RAM"
                # mtmd's own numbers (compute reserve, tokens per image) replace the header's
                assert self.encoder.ram is not None
                self.proj_info = self.encoder.info = self.encoder.ram.measured_info()
            self.media = TurnMedia(cfg, self.info, self.n_ctx, self.model, self.encoder)
            self.kept = KeptMemory(self.model, self.encoder, cfg.state_dir, lambda: self.abandoned)
            self.prompt = ConversationPrompt(self.chat, self.model, self.encoder, self.media,
                                             self.n_ctx, lambda: self.cfg)
        except BaseException:
            self._stack.close()
            raise
        self.load_s = time.monotonic() - t0
        sent1 = rpc_bytes_sent()
        # what crossed to remote devices while loading (the kernel's counters of our sockets)
        self.load_rpc_bytes_sent = (sent1 or 0) - (sent0 or 0)
        self.model.emit()

    @property
    def abandoned(self) -> bool:
        return self.life is Life.ABANDONED

    def close(self) -> None:
        if self.life is Life.CLOSED:
            return
        abandoned, self.life = self.abandoned, Life.CLOSED
        if abandoned:  # its buffers live on a server that is gone: freeing would abort
            self._stack.pop_all()
            self.model.abandon()
            return
        self._stack.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ vision control

    def set_vision(self, enabled: bool) -> None:
        """Turn vision on or off. Never reloads the model; frees a resident projector."""
        if enabled and self.proj_info is None:
            raise EbbError("no projector is loaded", "start with --mmproj FILE.gguf")
        self.media.switch(enabled)

    # ------------------------------------------------------------ the turn

    def turn(self, text: str, attachments: Sequence[str | Path] = (), gp: GenParams | None = None,
             on_text: Callable[[str], None] | None = None,
             cancel: threading.Event | None = None, role: str = "user",
             extra: dict[str, Any] | None = None) -> TurnResult:
        """One user turn (or a function's result: `role` "tool", `extra` its call's id) with its
        `attachments`: pictures, clips, videos, documents and text files, by path or reference
        (`clip.mp4#every=4`). A bad input returns a result with `error`; the context is kept."""
        tl = self._new_request()
        res = TurnResult(self._request_id, n_images=len(attachments), spans=tl.spans)
        self._check_device()
        try:
            parts = self.prompt.expand(attachments, role, text)
            images = [m for e in parts for m in e.media]
            res.attachments = [e.ref for e in parts]
            res.attachment_lines = [e.line for e in parts]
            res.notes = [n for e in parts for n in e.notes]
            res.attachment_notes = [list(e.notes) for e in parts]
            text = "\n\n".join([*(e.text for e in parts if e.text), text]) if any(e.text for e in parts) else text
            if images and self.projector_refused:
                raise EbbError(f"this message has pictures or clips, and the projector given was "
                               f"refused: {self.projector_refused}",
                               "load a model with a projector this llama.cpp runs")
            if images and (self.encoder.ram is None or not self.encoder.enabled):
                raise EbbError("this message has pictures or clips but the projector is off"
                               if self.proj_info else
                               "this message has pictures or clips but no projector is loaded",
                               "turn the projector on (the Vision or Hearing switch)" if self.proj_info
                               else "start with --mmproj FILE.gguf")
            pending = self.prompt.pending_images()  # may drop unreadable ones from history
            labels = tuple((k, *lab) for e in parts for k, lab in zip(
                (self.encoder.key(m) for m in e.media), e.labels) if lab != PICTURE_LABEL)
            turn = HistoryTurn(role, text, tuple(self.encoder.remember(i) for i in images), extra,
                               labels)
            self.prompt.fit(turn, pending + images, res)  # before any image is encoded
            kept = {k for t in self.history for k in t.image_keys}
            pending = [i for i in pending if self.encoder.key(i) in kept]
            messages, keys = self.prompt.messages(turn)
            with self.prompt.tokenize(messages, keys, pending + images) as prompt:
                self.chat.begin_prompt()
                self.media.encode_new(prompt, keys, images, res, tl, cancel, self.before_restore)
                self._generate(turn, prompt, keys, gp or GenParams(), on_text, cancel, res, tl)
        except EbbError as exc:
            res.error = str(exc)
        except TurnCancelled as exc:  # Stop before the reply: the message stays, no reply yet
            res.reason = (res.reason + "; " if res.reason else "") + str(exc)
            res.gen = exc.stats if isinstance(exc.stats, GenStats) else GenStats.cancelled()
            self.chat.stopped_before_reply(turn)
        finally:
            self.chat.interrupted()  # unless the reply ended: nothing to resume from the cache
            self.encoder.pin(set())  # the cache may keep to its limit again
        res.device_peak_bytes = self.model.ledger.peaks()
        return res

    def set_system(self, text: str | None) -> None:
        """The system prompt for the next turns (a chat's own): the KV cache is reused up to
        where the new prompt differs."""
        if (text or None) != self.cfg.system:
            self.cfg = replace(self.cfg, system=text or None)

    def continue_reply(self, gp: GenParams | None = None,
                       on_text: Callable[[str], None] | None = None,
                       cancel: threading.Event | None = None) -> TurnResult:
        """Go on with the last reply (it stopped on its cap or was stopped). When the KV cache
        still ends with it, decoding resumes there: no prefill, and a greedy reply comes out as
        if it had never stopped. Otherwise (a reopened conversation, another model) the
        conversation is prefilled up to the reply's text and generation goes on from there.
        The result's `text` is the new part; the history holds the whole reply."""
        tl = self._new_request(closes_reply=False)
        res = TurnResult(self._request_id, spans=tl.spans, continued=True)
        self._check_device()
        gp = gp or GenParams()
        try:
            if not self.history or self.history[-1].role != "assistant":
                raise EbbError("there is no reply to continue", "send a message")
            assert self.model.runtime is not None
            before = self.history[-1]
            accel = self.model.placement.accel or CPU
            if self.chat.resumes_from_cache:
                self.chat.begin_reply()
                t0 = time.monotonic()
                result = self.model.runtime.resume(gp, on_text, cancel)
                tl.add("decode", t0, t0 + result.stats.gen_s, accel)
                res.reason = "resumed from the KV cache (no prefill)"
            else:
                self.chat.hold_out_reply()
                try:  # a reply that filled the context: older turns leave to make room
                    self.prompt.fit(None, self.prompt.pending_images(), res, open_reply=before.text)
                except EbbError:
                    self.chat.put_back(before)
                    raise
                pending = self.prompt.pending_images()
                messages, keys = self.prompt.messages()
                text, added_special = self.prompt.format(messages)
                text += before.text  # the reply so far, left open: the model goes on with it
                prompt = (self.media.tokenize(text, not added_special, keys, pending) if keys
                          else contextlib.nullcontext(self.model.runtime.tokenize(text, not added_special)))
                self.chat.put_back(before)  # kept if anything below fails
                with prompt as p:
                    self.chat.begin_prompt()
                    self.media.encode_new(p, keys, [], res, tl, cancel, self.before_restore)
                    result = self._run_prompt(p, keys, gp, on_text, cancel, tl, chat=True)
                res.reason = "the conversation was prefilled up to the reply"
            res.text = result.text
            # the whole reply's length in tokens: a reply that was interrupted (a crash) has no
            # count saved, so adding the new tokens to it would count only those
            res.gen = replace(result.stats, flash_attn=self.cfg.flash_attn, n_reply_tokens=len(
                self.model.runtime.tokenize(before.text + result.text, False)))
            self.chat.set_last_reply(before.text + result.text)
            self.chat.reply_ended(result.stop_reason)
            res.shifted_cells = self.model.shifted_cells()
        except EbbError as exc:
            res.error = str(exc)
        except TurnCancelled as exc:  # the reply stays as it was
            res.reason = str(exc)
            res.gen = exc.stats if isinstance(exc.stats, GenStats) else GenStats.cancelled()
        finally:
            self.chat.interrupted()
            self.encoder.pin(set())
        res.device_peak_bytes = self.model.ledger.peaks()
        return res

    def complete(self, prompt: str | Sequence[int], gp: GenParams | None = None,
                 on_text: Callable[[str], None] | None = None,
                 cancel: threading.Event | None = None) -> TurnResult:
        """A raw completion (the local server's /v1/completions): `prompt` as it is, text or
        token ids, no chat template and no history. The conversation is untouched; the KV
        cache is reused up to where the prompts differ (the next turn does the same)."""
        tl = self._new_request()
        res = TurnResult(self._request_id, spans=tl.spans)
        self._check_device()
        try:
            assert self.model.runtime is not None
            tokens = (self.model.runtime.tokenize(prompt, add_special=True) if isinstance(prompt, str)
                      else list(prompt))
            if not tokens:
                raise EbbError("the prompt is empty")
            if any(t >= self.info.n_vocab for t in tokens):
                raise EbbError(f"a token id is outside the model's vocabulary of {self.info.n_vocab}")
            result = self._run_prompt(tokens, [], gp or GenParams(), on_text, cancel, tl)
            res.text = result.text
            res.gen = replace(result.stats, flash_attn=self.cfg.flash_attn)
            res.shifted_cells = self.model.shifted_cells()
        except EbbError as exc:
            res.error = str(exc)
        except TurnCancelled as exc:
            res.reason = str(exc)
            res.gen = exc.stats if isinstance(exc.stats, GenStats) else GenStats.cancelled()
        res.device_peak_bytes = self.model.ledger.peaks()
        return res

    def embed(self, inputs: Sequence[str | Sequence[int]]) -> tuple[list[list[float]], int]:
        """Embeddings of texts (or token ids) from the loaded model, and the tokens they took;
        the conversation and its KV cache are untouched."""
        assert self.model.runtime is not None
        self._check_device()
        tokens = [self.model.runtime.tokenize(x, add_special=True) if isinstance(x, str) else list(x)
                  for x in inputs]
        if any(not t for t in tokens):
            raise EbbError("an input has no tokens")
        if any(t >= self.info.n_vocab for ts in tokens for t in ts):
            raise EbbError(f"a token id is outside the model's vocabulary of {self.info.n_vocab}")
        return self.model.runtime.embed(tokens), sum(len(t) for t in tokens)

    # ------------------------------------------------------------ the context's limit

    @property
    def request_id(self) -> int:
        """The last request's number (its spans and turn carry it)."""
        return self._request_id

    def picture_tokens(self) -> tuple[int, int]:
        """(tokens a square picture at the side frames and pages are made at takes, that side);
        (0, 0) when the projector does not see."""
        pr = self.encoder.ram
        if pr is None or not pr.sees:
            return 0, 0
        side = self.encoder.side
        return pr.image_tokens(side, side)[0], side

    def clip_chunk_tokens(self) -> int:
        """Tokens a 30-second chunk of sound takes with this projector (0: it does not hear)."""
        from engine.media.projector import ONE_CHUNK_SECONDS

        pr = self.encoder.ram
        return pr.clip_tokens(ONE_CHUNK_SECONDS * pr.sample_rate)[0] if pr is not None and pr.hears else 0

    @property
    def reply_room(self) -> int:
        """Cells a turn keeps free for its reply when the conversation is fitted."""
        return self.prompt.reply_room

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The conversation as the chat template is given it."""
        return self.prompt.messages()[0]

    def _check_device(self) -> None:
        """DeviceLost when the accelerator's RPC server went away: now, or found before (each
        loss is reported once by check_rpc_servers; a take-up may have seen it first)."""
        endpoint = self.model.accel_endpoint
        if endpoint and (self.abandoned or endpoint in check_rpc_servers()):
            self.life = Life.ABANDONED
            raise DeviceLost(f"the RPC server {endpoint} ({self.model.accel}) went away",
                             "continuing on the devices that are left")

    def encode_only(self, pictures: Sequence[str | Path]) -> TurnResult:
        """Plan and encode images afresh (cache ignored), without adding them to the
        conversation: one full swap cycle when the plan says swap. For benchmarks and tests."""
        tl = self._new_request()
        res = TurnResult(self._request_id, n_images=len(pictures), spans=tl.spans)
        images = [self.encoder.load(Path(p)) for p in pictures]
        for img in images:
            self.encoder.forget(img)
        keys = [self.encoder.remember(i) for i in images]
        assert self.encoder.ram is not None
        text = "".join(f"{self.encoder.marker}\n" for _ in images)
        with self.media.tokenize(text, False, keys, images) as prompt:
            self.media.encode_new(prompt, keys, images, res, tl, None, self.before_restore)
        res.device_peak_bytes = self.model.ledger.peaks()
        return res

    def _new_request(self, closes_reply: bool = True) -> Timeline:
        # anything but Continue may decode or swap: the last reply can no longer be resumed
        # from the cache (its logits are gone; Continue then prefills up to it)
        if closes_reply:
            self.chat.moved_on()
        self._request_id += 1
        self.model.ledger.reset_peaks()
        return Timeline(self._request_id, self._emit, self.model.ledger, self.model.accel)

    # ------------------------------------------------------------ the conversation

    def set_history(self, turns: Sequence[tuple[Any, ...]], tag: str = "") -> None:
        """Replace the conversation with (role, text, image files[, extra]) turns, e.g. a saved
        chat. Images are hashed now and decoded only when the next turn's plan encodes them.
        `tag` names the conversation (a chat's id): its saved states go by it (`forget`)."""
        self.chat.reset(self._turns_of(turns), tag)
        self.kept.keep_on_drop(self.chat.tag)

    def _turns_of(self, turns: Sequence[tuple[Any, ...]]) -> list[HistoryTurn]:
        """(role, text, attachment files[, extra]) as the history keeps them: each attachment's
        keys (hashed now, decoded when encoded), labels and text."""
        history = []
        for role, text, paths, *more in turns:
            keys: list[str] = []
            labels: list[tuple[str, str, str]] = []
            texts: list[str] = []
            for p in paths:
                try:
                    got = self.encoder.keys_of(str(p), self.prompt.projector_view())
                except EbbError:
                    continue  # a saved attachment that went missing: leave it out
                keys += [k for k, _ in got.keys]
                labels += [(k, *lab) for (k, _), lab in zip(got.keys, got.labels) if lab != PICTURE_LABEL]
                if got.text:
                    texts.append(got.text)
            if texts:
                text = "\n\n".join([*texts, text])
            history.append(HistoryTurn(role, text, tuple(keys), more[0] if more else None,
                                       tuple(labels)))
        return history

    def lane_prompt(self, turns: Sequence[tuple[str, str, Sequence[Path]]], system: str | None,
                    template_kwargs: dict[str, Any] | None, request_id: int) -> LanePrompt | None:
        """A request's prompt with its pictures and clips for a lane (engine/llama/lanes.py),
        the conversation's own untouched: (role, text, files) turns templated as the session
        templates them, every picture chunk not cached encoded now on the CPU. None where a lane
        cannot take it and the session's turn should (an accelerator, whose swap is the
        session's; videos, PDFs and text files, which the session fits to the context; vision
        off; an attachment that cannot be read: the session's turn says why)."""
        rt = self.model.runtime
        if (rt is None or self.model.accel is not None or self.encoder.ram is None
                or not self.encoder.enabled or self.projector_refused):
            return None
        if any(kinds.kind_of(Path(p)) not in (kinds.PICTURE, kinds.CLIP) for _, _, files in turns for p in files):
            return None
        history = self._turns_of([(role, text, list(files)) for role, text, files in turns])
        if sum(len(t.image_keys) for t in history) != sum(len(files) for _, _, files in turns):
            return None  # one could not be read
        messages, keys = self.prompt.messages(None, history, system=system or None)
        text, added_special = rt.format_chat(messages, None, template_kwargs)
        pixels, lost = self.encoder.pending(keys)
        if lost:
            return None
        tl = Timeline(request_id, lambda _ev: None, self.model.ledger, None)  # its spans go with the lane's
        prompt = self.media.tokenize(text, not added_special, keys, pixels)
        try:
            res = TurnResult(request_id, spans=tl.spans)
            self.media.encode_new(prompt, keys, [], res, tl, None, None)
            items = self.media.prompt_items(prompt, keys)
        except BaseException:
            prompt.close()
            raise
        finally:
            self.encoder.pin(set())  # the lane holds the embeddings themselves
        return LanePrompt(items, rt._keys(items), prompt.close, list(tl.spans), len(turns[-1][2]),
                          res.strategy)

    @property
    def history(self) -> list[HistoryTurn]:
        """The conversation so far (the system prompt aside)."""
        return self.chat.turns

    def take_up(self, cancel: threading.Event | None = None) -> int:
        """The conversation was just set (a chat opened, the window started on it): take the
        model's memory of it back from RAM or disk now, while the user reads and types, so that
        the next turn starts as if it had never left (KeptMemory.take_up). Returns the cells
        taken back; a stop (`cancel`: the user went to another chat) leaves the cache as it was."""
        rt = self.model.runtime
        if rt is None or self.abandoned or not self.history:
            return 0
        if self.kept.holds(self.chat.tag):  # an edit, a regenerate, a branch of the chat
            return 0  # the cache is this chat's: the turn keeps what it shares (no render here)
        try:
            self._check_device()
        except DeviceLost:  # abandoned now: the next turn says so and recovers
            return 0
        messages, keys = self.prompt.messages()
        cells = None
        if not keys:  # text only: its cells are its tokens (with pictures: by the chat's tag)
            text, added_special = self.prompt.format(messages)
            cells = list(rt.tokenize(text, add_special=not added_special))
        return self.kept.take_up(cells, self.chat.tag, cancel)

    def read_ahead(self, tag: str) -> None:
        """Any thread: see KeptMemory.read_ahead."""
        self.kept.read_ahead(tag)

    def persist(self) -> bool:
        """Keep the model's memory of this conversation on disk now (the window closes or
        is idle). True when a write was started."""
        return self.kept.persist()

    def forget(self, tag: str) -> int:
        """Delete the saved states of the conversation `tag` (a deleted chat)."""
        return self.kept.forget(tag)

    def set_state_budget(self, budget_bytes: int) -> None:
        """The disk's budget for saved states and pictures, from now on (0: keep none: what
        is kept goes). No reload."""
        self.cfg = replace(self.cfg, state_disk_bytes=budget_bytes)
        self.kept.set_budget(budget_bytes)

    def save_conversation(self) -> Conversation:
        """The conversation and its system prompt and tools, to put back after answering
        someone else (the window's local server answers an HTTP client on the window's
        session)."""
        return self.chat.saved(self.cfg.system)

    def restore_conversation(self, saved: Conversation) -> None:
        self.set_system(saved.system)
        self.chat.restore(saved)
        self.kept.keep_on_drop(self.chat.tag)

    def set_tools(self, tools: list[dict[str, Any]] | None) -> None:
        """Functions (OpenAI's specs) the chat template lists for the next turns; None: none."""
        self.chat.set_tools(tools)

    def reply_was_calls(self, text: str, calls: list[dict[str, Any]] | None) -> None:
        """The last reply was function calls (engine/tools/loop.py): it stays as `text` with
        those `tool_calls` (the template's own form of them) for the results that follow."""
        if self.history and self.history[-1].role == "assistant":
            self.chat.set_last_reply(text, {"tool_calls": calls} if calls else None)

    def take_back_last(self) -> None:
        """The last message and its reply leave the conversation, to be sent again (the tool
        loop's repeated call: the same message, answered without tools)."""
        if len(self.history) >= 2 and self.history[-1].role == "assistant":
            self.chat.take_back()

    def set_template_kwargs(self, kwargs: dict[str, Any]) -> None:
        """The chat template's own switches for the next turns (`enable_thinking`: False asks a
        thinking model to answer at once); {}: the template's defaults."""
        self.chat.set_template_kwargs(kwargs)

    def adopt_conversation(self, other: "Session") -> None:
        """Carry on another session's conversation (e.g. after its device went away): all of
        it, as the owner keeps it (its tag, so its kept states stay filed under its chat; the
        template's switches; the turns the model had forgotten), with nothing to go on with
        from this session's empty cache."""
        saved = other.save_conversation()
        self.restore_conversation(replace(saved, reply=ReplyState.IDLE))
        self.encoder.adopt(other.encoder)

    def undo_last_exchange(self) -> tuple[str, list[str]] | None:
        """Drop the last user turn and its reply (for Regenerate); returns its text and images."""
        turn = self.chat.undo_last_exchange()
        if turn is None:
            return None
        paths = [self.encoder.path_of(k) for k in turn.image_keys]
        return turn.text, [p for p in paths if p is not None]

    def _generate(self, turn: HistoryTurn, prompt: TokenizedPrompt | list[int], keys: list[str],
                  gp: GenParams,
                  on_text: Callable[[str], None] | None, cancel: threading.Event | None,
                  res: TurnResult, tl: Timeline) -> None:
        result = self._run_prompt(prompt, keys, gp, on_text, cancel, tl, chat=True)
        assert self.model.runtime is not None
        res.phases = self.phases.used(self.model.runtime.n_threads_batch, self.model.runtime.n_threads)
        res.text = result.text
        res.gen = replace(result.stats, flash_attn=self.cfg.flash_attn)  # the turn says whether it was on
        assert self.model.runtime is not None
        res.shifted_cells = self.model.shifted_cells()
        self.chat.add_exchange(turn, result.text)
        self.chat.reply_ended(result.stop_reason)

    def _run_prompt(self, prompt: TokenizedPrompt | list[int], keys: list[str], gp: GenParams,
                    on_text: Callable[[str], None] | None, cancel: threading.Event | None,
                    tl: Timeline, chat: bool = False) -> GenResult:
        """Prefill `prompt` (tokens, or mtmd's chunks with the cached embeddings) and decode;
        `chat`: the conversation's reply (its life in `self.chat`), not a raw completion."""
        runtime = self.model.runtime
        assert runtime is not None
        items = self.media.prompt_items(prompt, keys)
        accel = self.model.placement.accel or CPU
        tl.plan = None
        enc = self.encoder
        back = self.phases.to_prompt_placement(
            *runtime.n_to_evaluate(items), enc.costs.bus_Bps, tl,
            lambda dev, s, n: enc.learn("restore", dev, s, n, mover="live"))
        events.pause_point("prefill")
        t_start = time.monotonic()

        pending = [back] if back is not None else []

        def after_prefill() -> None:  # the prefill's span, then back for generation
            tl.add("prefill", t_start, time.monotonic(), accel)
            if chat:
                self.chat.begin_reply()
            while pending:
                pending.pop()()

        def progress(done: int, total: int) -> None:  # the window's status line and Steps lane
            self._emit(events.PrefillProgress(self._request_id, start_s=t_start, n_done=done,
                                              n_total=total, device=accel))

        try:
            result = runtime.generate_from(items, gp, on_text, cancel, after_prefill, progress)
        except TurnCancelled:  # stopped while read: the Steps lane keeps the prefill as far as it got
            tl.add("prefill", t_start, time.monotonic(), accel)
            raise
        finally:
            while pending:  # the prefill failed: back to generation's placement all the same
                pending.pop()()
        t_end = time.monotonic()
        tl.add("decode", t_end - result.stats.gen_s, t_end, accel)
        return result

def turn_with_recovery(session: Session, text: str | Sequence[int],
                       attachments: Sequence[str | Path] = (),
                       gp: GenParams | None = None, on_text: Callable[[str], None] | None = None,
                       cancel: threading.Event | None = None,
                       emit: Callable[[events.Event], None] | None = None,
                       raw: bool = False, role: str = "user",
                       extra: dict[str, Any] | None = None) -> tuple[Session, TurnResult]:
    """A turn that survives its RPC server going away between turns: the session is rebuilt on
    the devices left, with the conversation, and the turn runs there. Returns the session to
    use from now on (the same one when nothing happened). `raw`: a completion of `text` as it
    is (Session.complete), not a chat turn."""
    def run(s: Session) -> TurnResult:
        if raw:
            return s.complete(text, gp, on_text, cancel)
        assert isinstance(text, str)
        return s.turn(text, attachments, gp, on_text, cancel, role, extra)

    try:
        return session, run(session)
    except DeviceLost as exc:
        new = Session(replace(session.cfg, accel=None), emit=emit, files=session.files)
        new.adopt_conversation(session)
        session.close()  # abandoned: drops its handles without touching the lost device
        res = run(new)
        res.reason = f"{exc}; now on {new.model.accel or 'CPU'}" + (f"; {res.reason}" if res.reason else "")
        res.device_lost = str(exc)
        return new, res
