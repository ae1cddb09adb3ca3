"""The llama.cpp side: load a model, keep a context, prefill text and image embeddings,
generate with streaming and cancel, save and restore the sequence state.

Thread rule: one thread owns these objects (the CLI's main thread, or the app's engine
worker). Only `cancel` (a threading.Event passed to `generate`) may be set from another thread.
"""
from __future__ import annotations

import codecs
import contextlib
import ctypes
import functools
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

from engine import stops, testhooks
from engine.stops import StopReason
from engine.errors import EbbError, TurnCancelled
from engine.events import GenStats, Logprob
from engine.gguf.info import ModelInfo, model_info, read_gguf
from engine.config import default_threads
from engine.hw import physical_cores
from engine.llama import log as llama_log
from engine.llama.chat_template import ChatTemplate
from engine.llama.lib import flash_attn_type, llama
from engine.llama.lookup import MAX_DRAFT, NgramIndex, Speculation, accepted_prefix
from engine.llama.embeddings import embed
from engine.llama.json_tail import JsonTail
from engine.llama.kv_slot import KvSlot
from engine.llama.lanes import Lanes
from engine.llama.prefill_stop import PrefillStop
from engine.llama.thread_share import ProcSampler, ThreadShare
from engine.llama.sampling import GenParams, logprob_entry, sampler_chain
from engine.llama.loaded_model import DEFAULT_BATCH, LoadedModel, LoadParams, check_context, state_identity
from engine.llama.buffer_log import buffers_from_log

if TYPE_CHECKING:
    import numpy as np  # imported where used: numpy is not needed before the first token

# `llama_graph_reserve(ctx, n_tokens, n_seqs, n_outputs)` is declared in llama.cpp's staging
# header (src/llama-ext.h) as C++, so it is exported under its mangled name.
_GRAPH_RESERVE_SYMBOL = "_Z19llama_graph_reserveP13llama_contextjjj"


@functools.lru_cache(maxsize=1)
def _graph_reserve_fn() -> Any:
    """llama_graph_reserve from the libllama llama-cpp-python loaded, or None."""
    import llama_cpp.llama_cpp as binding

    try:
        fn = getattr(binding._lib, _GRAPH_RESERVE_SYMBOL)
    except AttributeError:
        return None
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32]
    return fn


@dataclass(frozen=True)
class GenResult:
    text: str
    stats: GenStats

    @property
    def stop_reason(self) -> StopReason:
        assert self.stats.stop_reason is not None  # the decode loop always says why it stopped
        return self.stats.stop_reason


@dataclass(frozen=True)
class ImageSpan:
    """One image chunk's embeddings at its place in the prompt. `chunk` and `mtmd` are the
    mtmd_input_chunk and the mtmd context that made it: llama.cpp's helper takes from them the
    positions (M-RoPE: 4 per embedding, `n_pos` in all) and the attention (causal or not)."""
    key: str  # the image's content, the projector and the chunk's index
    embeddings: np.ndarray  # (n_tokens, n_embd_inp) float32
    chunk: Any
    mtmd: Any
    n_pos: int


PromptItem = int | ImageSpan


class TextRuntime:
    """One loaded language model with one context (sequence 0). Close frees everything."""

    def __init__(self, params: LoadParams, info: ModelInfo | None = None) -> None:
        # the numerics-shaking run evaluates prompts in other batches (engine/testhooks.py);
        # a batch size chosen on purpose stays
        if params.n_batch == DEFAULT_BATCH:
            params = replace(params, n_batch=testhooks.n_batch(params.n_batch))
        self.params = params
        self.info = info or model_info(read_gguf(params.model_path))
        self.n_ctx = check_context(self.info, params.n_ctx)
        self.n_threads = default_threads(params.n_threads)
        self.n_threads_batch = params.n_threads_batch or self.n_threads
        self._stack = contextlib.ExitStack()
        self._replan = False  # device buffers changed since the last graph: see reschedule
        # the shape of the last batch decoded ("tokens", n) or ("embd", 0), whose graph
        # llama.cpp may reuse; None: none since the scheduler was last reset (see _before_decode)
        self._last_batch: tuple[str, int] | None = None
        self._utf8_state: tuple[bytes, int] = (b"", 0)  # see _decode_loop
        self._decoded = False  # the first decode is guarded (engine.llama.native)
        # fewer threads while the cores are shared (generation's and batches' own), or None
        self.shares: tuple[ThreadShare, ThreadShare] | None = None
        self._proc: ProcSampler | None = None
        if params.share_threads:
            cores = physical_cores()
            self.shares = (ThreadShare(self.n_threads, cores),
                           ThreadShare(self.n_threads_batch, cores, try_steps=2, watch_steps=1))
            self._proc = ProcSampler()
            self._stack.callback(self._proc.close)
        self.last_logprobs: list[Logprob] = []  # the last reply's, when asked for
        self.last_speculation: Speculation | None = None  # the last reply's drafting
        self._resume_token: int | None = None  # chosen by a draft's check, not yet decoded
        self._tail_ok: bool | None = None  # the memory can forget its last cells (_tail_can_go)
        try:
            self._load()
        except BaseException:
            self._stack.close()
            raise

    # ------------------------------------------------------------ loading

    def _load(self) -> None:
        L = llama()
        t0 = time.perf_counter()
        self.loaded = LoadedModel(self.params, self.info)
        self._stack.callback(self.loaded.close)
        self.model, self.vocab = self.loaded.model, self.loaded.vocab
        lanes = self.params.lanes
        ctx = self._new_context(self.n_ctx, lanes=lanes)
        self._stack.callback(L.llama_free, ctx)
        self.ctx = ctx
        self.slot = KvSlot(ctx, shared=lanes > 0)  # what the KV cache holds, and the states it let go
        # sequences beside sequence 0, decoded in its batches (lanes.py); cut before the context goes
        self.lanes = Lanes(self, lanes, self.params.lane_cells) if lanes else None
        if self.lanes is not None:
            self._stack.callback(self.lanes.cut, "the model was unloaded")
        self._own_logits = True  # the last decode's last row is sequence 0's (resume needs it)
        self.drafter: Any = None  # a draft model (drafter.py), set by the model's owner
        # layers on a device: a prompt batch there is timed and sized to end within stop_within_s
        self._off_cpu = self.params.n_gpu_layers > 0 and self.params.devices != ()
        self.stop_within_s = STOP_WITHIN_S
        self._batch_time: tuple[int, float] = (0, 0.0)  # the last timed batch: (tokens, seconds)
        self.prefill_stop = PrefillStop(ctx)  # Stop during a prompt: between batches and within one
        self.prefill_done = 0  # positions the running (or last) prefill has evaluated
        self.buffers = buffers_from_log()
        for key, n in self.loaded.buffers.items():
            self.buffers[key] = n
        self.load_s = time.perf_counter() - t0
        self.template = self._chat_template()

    def _new_context(self, n_ctx: int, cb_eval: Any = None, lanes: int = 0) -> Any:
        L = llama()
        cparams = L.llama_context_default_params()
        cparams.n_ctx = n_ctx
        if lanes:  # one KV cache for every sequence: sequence 0's cells and the lanes' pool
            cparams.n_ctx = n_ctx + self.params.lane_cells
            cparams.n_seq_max = 1 + lanes
            cparams.kv_unified = True
        cparams.n_batch = self.params.n_batch
        cparams.n_ubatch = self.params.n_batch
        cparams.n_threads = self.n_threads
        cparams.n_threads_batch = self.n_threads_batch
        if self.params.flash_attn is not None:
            cparams.flash_attn_type = flash_attn_type(self.params.flash_attn)
        if cb_eval is not None:
            cparams.cb_eval = cb_eval
        ctx = L.llama_init_from_model(self.model, cparams)
        if not ctx:
            raise EbbError(f"llama.cpp could not create a context of {n_ctx} tokens: "
                           f"{llama_log.last_error('out of memory?')}", "try a smaller --ctx")
        return ctx

    def set_threads(self, n_threads: int, n_threads_batch: int) -> None:
        """Threads for single tokens and for batches, from the next decode on (no reload)."""
        llama().llama_set_n_threads(self.ctx, n_threads, n_threads_batch)
        self.n_threads, self.n_threads_batch = n_threads, n_threads_batch

    def decode_once_with(self, cb_eval: Any) -> None:
        """Decode one token in a throwaway context that calls `cb_eval` for every node."""
        L = llama()
        ctx = self._new_context(256, cb_eval)
        try:
            tok = L.llama_vocab_bos(self.vocab)
            arr = (L.llama_token * 1)(tok if tok >= 0 else 0)
            self._check(L.llama_decode(ctx, L.llama_batch_get_one(arr, 1)))
        finally:
            L.llama_free(ctx)

    def embed(self, inputs: Sequence[list[int]]) -> list[list[float]]:
        """One vector per token list (engine/llama/embeddings.py), on the loaded weights in a
        context of its own: the conversation's KV cache is untouched."""
        if (longest := max(len(t) for t in inputs)) > self.n_ctx:
            raise EbbError(f"an input is {longest} tokens; the model's context holds {self.n_ctx}",
                           "send a shorter text")
        return embed(self.model, inputs, (self.n_threads, self.n_threads_batch), self.params.flash_attn)

    def logits_for(self, tokens: list[int]) -> np.ndarray:
        """Last-position logits of `tokens` from an empty context (the KV cache is cleared)."""
        import numpy as np

        L = llama()
        self.slot.reset()
        self._decode_tokens(tokens)
        n_vocab = L.llama_vocab_n_tokens(self.vocab)
        out: np.ndarray = np.array(
            np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, -1), shape=(n_vocab,)), copy=True)
        self.slot.reset()
        return out

    def _chat_template(self) -> ChatTemplate:
        L = llama()
        raw = L.llama_model_chat_template(self.model, None)
        template = raw.decode("utf-8") if raw else CHATML_TEMPLATE
        self.template_source = template
        bos = L.llama_vocab_bos(self.vocab)
        eos = L.llama_vocab_eos(self.vocab)

        def text(t: int) -> str:
            return str(L.llama_vocab_get_text(self.vocab, t).decode()) if t >= 0 else ""

        return ChatTemplate(template, eos_token=text(eos), bos_token=text(bos))

    def close(self) -> None:
        self._stack.close()

    def state_identity(self) -> dict[str, Any]:
        """What a saved state of this runtime's cache belongs to (state_files.py). Not the
        placement: llama.cpp's sequence state is host bytes wherever the cells lived."""
        return state_identity(self.params.model_path, self.n_ctx, self.params.flash_attn)

    def __enter__(self) -> "TextRuntime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ prompt

    def format_chat(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> tuple[str, bool]:
        """The model's chat template applied to messages, ready for the assistant's reply;
        `tools` (OpenAI's function specs) go to a template that lists them itself;
        `template_kwargs` are the template's own switches (enable_thinking, ...)."""
        # (prompt, add_special): BOS as the model's vocabulary says, as llama-cpp-python does
        return self.template(messages=messages, tools=tools or None, **(template_kwargs or {})), True

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        L = llama()
        data = text.encode("utf-8")
        n_max = len(data) + 16
        buf = (L.llama_token * n_max)()
        n = L.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, True)
        if n < 0:
            buf = (L.llama_token * -n)()
            n = L.llama_tokenize(self.vocab, data, len(data), buf, -n, add_special, True)
        return list(buf[:n])

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self._piece(t) for t in tokens).decode("utf-8", errors="replace")

    def _piece(self, token: int) -> bytes:
        L = llama()
        buf = ctypes.create_string_buffer(64)
        n = L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]

    # ------------------------------------------------------------ evaluation

    def _check(self, rc: int) -> None:
        if rc == 2 and self.prefill_stop.fired:  # our abort
            # llama.cpp removed the aborted micro-batch's cells; those of earlier micro-batches
            # of the same batch are not in our books: drop them too
            self.slot.drop_unrecorded()
            raise TurnCancelled(f"stopped during the prompt ({self.slot.n_past} positions in the "
                                "cache; Continue evaluates the rest)")
        if rc != 0:
            raise EbbError(f"llama.cpp decode failed (code {rc}): "
                           f"{llama_log.last_error('no detail')}", "start a new conversation")

    def _decode(self, batch: Any) -> None:
        self._before_decode("tokens", batch.n_tokens)
        if self._decoded:
            if self.shares is None:
                self._check(llama().llama_decode(self.ctx, batch))
                return
            if batch.n_tokens > 1:  # a prompt's batch: a core freed meanwhile is taken now
                self._before_batch()
            t0, c0 = time.perf_counter(), ProcSampler.cpu_s()
            self._check(llama().llama_decode(self.ctx, batch))
            self._shared_step(batch.n_tokens, time.perf_counter() - t0, ProcSampler.cpu_s() - c0)
            return
        from engine.llama import native

        # a native crash here leaves a sentinel the next start reads (engine.llama.native)
        with native.first_decode(self.params.model_path):
            self._check(llama().llama_decode(self.ctx, batch))
        self._decoded = True

    def _before_batch(self) -> None:
        assert self.shares is not None and self._proc is not None
        gen, batch = self.shares
        running = self._proc.running()
        before = batch.current
        # between decodes nothing of ours runs but this thread
        if batch.before_step(None if running is None else max(0, running - 1)) != before:
            self.set_threads(gen.current, batch.current)

    def _shared_step(self, n_tokens: int, wall_s: float, cpu_s: float) -> None:
        """After a decode on the CPU: its phase's share of the cores, and its thread count for
        the next one (thread_share.py)."""
        assert self.shares is not None and self._proc is not None
        gen, batch = self.shares
        share = batch if n_tokens > 1 else gen
        running = self._proc.running()
        others = None if running is None else max(0, running - share.current)
        before = share.current
        after = share.observe(wall_s, cpu_s, n_tokens, others, time.monotonic())
        if after != before:
            (batch if share is gen else gen).suggest(after)
            self.set_threads(gen.current, batch.current)

    def _decode_tokens(self, tokens: list[int],
                       on_batch: Callable[[int], None] | None = None) -> None:
        """Decode text tokens at the next positions (given explicitly: after an image under
        M-RoPE the next position is not the number of cells). `on_batch(n)` after each batch."""
        i = 0
        while i < len(tokens):
            if self.prefill_stop.asked:
                raise TurnCancelled(f"stopped during the prompt ({self.slot.n_past} positions in the "
                                    "cache; Continue evaluates the rest)")
            # room in each batch for the lanes' generating tokens (they keep flowing meanwhile)
            size = self._prompt_batch(len(tokens) - i) - (self.lanes.n_busy() if self.lanes is not None else 0)
            chunk = tokens[i:i + max(1, size)]
            t0 = time.perf_counter()
            self._decode_run(chunk)
            if self._off_cpu and len(chunk) > 1:  # its own time, and Stop seen when it ends
                llama().llama_synchronize(self.ctx)
                self._batch_time = (len(chunk), time.perf_counter() - t0)
            i += len(chunk)
            if on_batch is not None:
                on_batch(len(chunk))

    def _prompt_batch(self, left: int) -> int:
        """The next prompt batch's size. On the CPU, n_batch: Stop lands inside a batch there
        (llama.cpp's abort callback). Where a batch runs on a device it cannot be stopped
        midway (an RPC server computes it whole), so it is sized by the last one's time to end
        within `stop_within_s` (the stand-in took 1.6-4 s for 512 tokens on 2 cores)."""
        n = self.params.n_batch
        if not self._off_cpu or left <= 1:
            return n
        return prompt_batch_within(n, *self._batch_time, self.stop_within_s)

    def _decode_run(self, tokens: list[int], every_logit: bool = False) -> None:
        """Decode `tokens` (at most a batch) at the next positions in one batch and record them
        in the slot; logits for the last token, or (`every_logit`) for each. Running lanes'
        work goes into the same batch, before these tokens: sequence 0's rows are the last ones
        (index them from the end)."""
        L = llama()
        n = len(tokens)
        lanes = self.lanes if self.lanes is not None and (self.lanes.busy or self.lanes.feed) else None
        work = lanes.work(self.params.n_batch - n) if lanes is not None else []
        extra = sum(len(w.tokens) for w in work)
        batch = L.llama_batch_init(n + extra, 0, 1)
        try:
            batch.n_tokens = n + extra
            if lanes is not None:
                lanes.put(batch, 0, work)
            for j, tok in enumerate(tokens, extra):
                batch.token[j] = tok
                batch.pos[j] = self.slot.n_past + j - extra
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = 0
                batch.logits[j] = 1 if every_logit or j == extra + n - 1 else 0
            try:
                self._decode(batch)
            except BaseException:
                if lanes is not None:
                    lanes.undo(work)
                raise
        finally:
            L.llama_batch_free(batch)
        self.slot.record_tokens(tokens)
        self._own_logits = True
        if lanes is not None and work:
            lanes.after(work)

    def own_logits_lost(self) -> None:
        """The lanes decoded alone: the last row is no longer sequence 0's."""
        self._own_logits = False

    def decode_greedy(self) -> int:
        """Decode the most likely next token after what is cached and wait for the device: one
        step of greedy generation, as measurements time it. Returns the token."""
        import numpy as np

        L = llama()
        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, -1), shape=(self.info.n_vocab,))
        token = int(np.argmax(logits))
        self._decode_tokens([token])
        L.llama_synchronize(self.ctx)
        return token

    def _decode_image(self, img: ImageSpan) -> None:
        n_past = self.decode_image_at(img, self.slot.n_past, 0)
        self.slot.record_image(img.key, img.embeddings.shape[0], n_past)

    def decode_image_at(self, img: ImageSpan, n_past: int, seq: int) -> int:
        """Decode one image chunk's embeddings into sequence `seq` from position `n_past` with
        llama.cpp's own helper: its positions (M-RoPE's four per embedding), its attention
        (non-causal for Gemma 3) and its advance (`n_pos`) are llama.cpp's. Returns the next
        position."""
        import llama_cpp.mtmd_cpp as M
        import numpy as np

        emb = np.ascontiguousarray(img.embeddings, dtype=np.float32)
        n = emb.shape[0]
        n_batch = self.params.n_batch
        if M.mtmd_decode_use_non_causal(img.mtmd, img.chunk):
            if n > n_batch:  # its tokens attend to each other: one micro-batch
                raise EbbError(f"an image of {n} tokens needs a batch of at least {n} (this "
                               f"session's is {n_batch})", f"start with --batch {n}")
            n_batch = n
        self._before_decode("embd", 0)
        new_n_past = llama().llama_pos(0)
        rc = M.mtmd_helper_decode_image_chunk(
            img.mtmd, self.ctx, img.chunk, emb.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
            n_past, seq, n_batch, ctypes.byref(new_n_past),
            M.mtmd_helper_post_decode_callback(), None)  # a NULL callback
        self._check(rc)
        return int(new_n_past.value)

    @staticmethod
    def _keys(items: Sequence[PromptItem]) -> list[Any]:
        keys: list[Any] = []
        for it in items:
            if isinstance(it, ImageSpan):
                keys.extend((it.key, i) for i in range(it.embeddings.shape[0]))
            else:
                keys.append(it)
        return keys

    def n_to_evaluate(self, items: Sequence[PromptItem]) -> tuple[int, int]:
        """(positions, of them image positions) a prefill of `items` would evaluate past the
        cached prefix (a K-shift may save more): what a per-phase decision weighs."""
        keys = self._keys(items)
        rest = keys[min(self.slot.cached_prefix(keys), len(keys) - 1):]
        return len(rest), sum(1 for k in rest if isinstance(k, tuple))

    def prefill(self, items: Sequence[PromptItem], cancel: threading.Event | None = None,
                on_progress: Callable[[int, int], None] | None = None) -> int:
        """Evaluate items, reusing the longest prefix already in the KV cache. Returns the
        number of positions evaluated. A `cancel` set meanwhile stops it between batches, and
        within one through llama.cpp's abort callback: TurnCancelled, with the KV cache holding
        exactly the positions evaluated before (the next prefill reuses them).
        `on_progress(done, total)`: positions evaluated so far, after each batch and image."""
        with self.prefill_stop.armed(cancel):
            return self._prefill(items, cancel, on_progress)

    def _prefill(self, items: Sequence[PromptItem], cancel: threading.Event | None,
                 on_progress: Callable[[int, int], None] | None) -> int:
        L = llama()
        keys = self._keys(items)
        n_keep = self.slot.prefix_for(keys, cancel)
        total, done = len(keys) - n_keep, [0]
        self.prefill_done = 0  # positions evaluated by this prefill so far (a Stop keeps them)

        def advanced(n: int) -> None:
            done[0] += n
            self.prefill_done = done[0]
            if on_progress is not None:
                on_progress(done[0], total)

        pos, run = 0, list[int]()
        for it in items:
            width = it.embeddings.shape[0] if isinstance(it, ImageSpan) else 1
            if pos + width > n_keep:
                if isinstance(it, ImageSpan):
                    self._decode_tokens(run, advanced)
                    run = []
                    self._decode_image(it)
                    advanced(width)
                else:
                    run.append(it)
            pos += width
        self._decode_tokens(run, advanced)
        # llama_decode may return before a device finishes (the RPC backend is asynchronous):
        # wait, so the prompt's time is the prompt's and not the first token's
        L.llama_synchronize(self.ctx)
        return len(keys) - n_keep

    def reschedule(self) -> None:
        """Device buffers changed (a layer moved, a projector came or went): llama.cpp must not
        run the graph it made last again (its ops would run where the weights used to be, and
        ggml's RPC client would ask the server to run a graph it dropped when a buffer was
        freed). Marked here, dealt with before the next decode (`_before_decode`)."""
        self._replan = True

    def _before_decode(self, kind: str, n_tokens: int) -> None:
        """Before a decode of `n_tokens` tokens (`kind` "tokens") or of embeddings ("embd",
        any number), carry out a pending `reschedule`.

        llama.cpp reuses its last graph only for a batch of the same shape
        (`llm_graph_params::allow_reuse`: as many tokens, tokens or embeddings alike; the
        graph's tensors have the batch's shape). Any other batch gets a graph built and
        scheduled afresh, from where the weights are now: nothing to drop. That is nearly
        always so after a swap (the last graph is one generated token's, the prompt's next
        batch is longer or an image's). Our batches are one micro-batch each (`n_ubatch` is
        `n_batch` and prompts go in `n_batch` pieces), so a batch's shape is its graph's.

        Otherwise the last graph is dropped with llama.cpp's `llama_graph_reserve`
        (llama-ext.h): it resets the scheduler and the reusable graphs for the price of one
        token's graph (~0.8 ms for SmolLM2); where it is missing, `llama_set_adapter_cvec(NULL)`
        makes the next decode rebuild the whole scheduler and its compute buffers."""
        last = self._last_batch
        self._last_batch = (kind, n_tokens)  # before the decode: a failed one may leave a graph
        if not self._replan:
            return
        self._replan = False
        if last is None or last[0] != kind or (kind == "tokens" and last[1] != n_tokens):
            return
        L = llama()
        L.llama_synchronize(self.ctx)  # nothing of the last graph may still run
        fn = _graph_reserve_fn()
        if fn is None or not fn(self.ctx, 1, 1, 1):
            L.llama_set_adapter_cvec(self.ctx, None, 0, 0, 0, 0)

    # ------------------------------------------------------------ generation

    def generate(self, messages: list[dict[str, str]], gp: GenParams,
                 on_text: Callable[[str], None] | None = None,
                 cancel: threading.Event | None = None) -> GenResult:
        """Reply to text-only `messages` (OpenAI-style dicts), streaming pieces to `on_text`."""
        prompt, added_special = self.format_chat(messages)
        return self.generate_from(self.tokenize(prompt, add_special=not added_special), gp,
                                  on_text, cancel)

    def generate_from(self, items: Sequence[PromptItem], gp: GenParams,
                      on_text: Callable[[str], None] | None = None,
                      cancel: threading.Event | None = None,
                      after_prefill: Callable[[], None] | None = None,
                      on_progress: Callable[[int, int], None] | None = None) -> GenResult:
        """Prefill `items` and generate. `after_prefill` runs between the two (outside both
        times): a session moves layers to the generation placement there. `on_progress`: the
        prefill's (positions done, of total)."""
        n_prompt = len(self._keys(items))
        if n_prompt >= self.n_ctx:
            raise EbbError(f"the conversation is {n_prompt} tokens, the context holds "
                           f"{self.n_ctx}", "start a new conversation or raise --ctx")
        t0 = time.perf_counter()
        try:
            n_eval = self.prefill(items, cancel, on_progress)
        except TurnCancelled as exc:  # what was read stays said: its tokens and its time
            exc.stats = GenStats(n_prompt_tokens=n_prompt, prompt_s=time.perf_counter() - t0,
                                 stop_reason=StopReason.CANCELLED,
                                 n_prompt_tokens_evaluated=self.prefill_done)
            raise
        prompt_s = time.perf_counter() - t0
        if after_prefill is not None:
            after_prefill()
        t1 = time.perf_counter()
        self.last_logprobs = []
        text, n_gen, stop = self._decode_loop(gp, on_text, cancel)
        spec = self.last_speculation
        return GenResult(text, GenStats(
            n_prompt_tokens=n_prompt, n_gen_tokens=n_gen, prompt_s=prompt_s,
            gen_s=time.perf_counter() - t1, stop_reason=stop, n_prompt_tokens_evaluated=n_eval,
            n_drafts=spec.drafts if spec else 0, n_drafted=spec.drafted if spec else 0,
            n_draft_accepted=spec.accepted if spec else 0,
            n_prompt_tokens_restored=self.slot.last_restored, restore_s=self.slot.last_restore_s,
            restored_ahead=self.slot.restored_ahead,
            logprobs=tuple(self.last_logprobs) if gp.top_logprobs >= 0 else None))

    def resume(self, gp: GenParams, on_text: Callable[[str], None] | None = None,
               cancel: threading.Event | None = None) -> GenResult:
        """Go on with the reply the last `generate_from`/`resume` left open (it stopped on its
        cap or a cancel): its tokens are all in the KV cache and the last one's logits are
        still there, so nothing is prefilled and a greedy reply goes on exactly as if it had
        never stopped. The caller knows that nothing was decoded since."""
        n_cells = len(self.slot.cells)
        if n_cells >= self.n_ctx - 1:
            return GenResult("", GenStats(n_prompt_tokens=n_cells, stop_reason=StopReason.CONTEXT_FULL))
        t1 = time.perf_counter()
        if not self._own_logits and self._resume_token is None and n_cells and isinstance(self.slot.cells[-1], int):
            # lanes decoded since: the last token's logits are evaluated again
            last = self.slot.cells[-1]
            self.slot.drop_from(n_cells - 1)
            self._decode_tokens([last])
        text, n_gen, stop = self._decode_loop(gp, on_text, cancel, resume=True)
        return GenResult(text, GenStats(n_prompt_tokens=n_cells, n_gen_tokens=n_gen,
                                        gen_s=time.perf_counter() - t1, stop_reason=stop))

    def _decode_loop(self, gp: GenParams, on_text: Callable[[str], None] | None,
                     cancel: threading.Event | None, resume: bool = False) -> tuple[str, int, StopReason]:
        L = llama()
        chain = sampler_chain(gp, self.vocab, self.info.n_vocab)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        if resume:  # the bytes of a character the last stop cut in two
            decoder.setstate(self._utf8_state)
        pieces: list[str] = []
        n_gen, stop = 0, StopReason.LENGTH
        # a JSON reply with a cap ends in one complete value: when the cap is near, the text
        # that closes it is written instead of what the model would sample
        json_tail = JsonTail() if gp.json_reply and not resume else None
        # n-gram drafts where a greedy reply's choice is the logits' argmax alone (lookup.py)
        spec = Speculation() if gp.can_speculate and self._tail_can_go() else None
        index = NgramIndex([c for c in self.slot.cells[-LOOKUP_WINDOW:] if isinstance(c, int)]) \
            if spec else None
        self.last_speculation = spec
        # the next token, already chosen by a draft's check (Continue takes it up)
        pending: int | None = self._resume_token if resume else None
        try:
            while not gp.max_tokens or n_gen < gp.max_tokens:
                if cancel is not None and cancel.is_set():
                    stop = StopReason.CANCELLED
                    break
                room = gp.max_tokens - n_gen if gp.max_tokens else self.n_ctx - len(self.slot.cells)
                closed = (self._close_json(json_tail, room, pieces, on_text)
                          if json_tail is not None else None)
                if closed is not None:
                    n_gen += closed
                    if json_tail is not None and json_tail.closed_a_loop:
                        stop = StopReason.STOP  # closed because it went round: a whole value
                    break
                tok = pending if pending is not None else L.llama_sampler_sample(chain, self.ctx, -1)
                pending = None
                if gp.top_logprobs >= 0:  # from the model's own logits (before any sampler)
                    self.last_logprobs.append(logprob_entry(self.ctx, self.info.n_vocab, tok, gp.top_logprobs, self._piece))
                    if gp.on_logprob is not None:
                        gp.on_logprob(self.last_logprobs[-1])
                if L.llama_vocab_is_eog(self.vocab, tok):
                    stop = StopReason.STOP
                    break
                n_gen += 1
                piece = decoder.decode(self._piece(tok))
                if piece:
                    pieces.append(piece)
                    if json_tail is not None:
                        json_tail.feed(piece)
                    if on_text is not None:
                        on_text(piece)
                if len(self.slot.cells) >= self.n_ctx - 1:
                    stop = StopReason.CONTEXT_FULL
                    break
                if spec is None or index is None:
                    self._decode_tokens([tok])
                    continue
                index.add([tok])
                room_left = (gp.max_tokens - n_gen) if gp.max_tokens else MAX_DRAFT
                t0 = time.perf_counter()  # a draft model's guessing counts in the draft's cost
                # a draft model guesses every step: a step alone is timed first, so that its
                # drafts are weighed against it (Speculation switches off where they cost more)
                guess = spec.on and (bool(spec.single_s) or self.drafter is None)
                draft = self._guess(index, tok, min(spec.length, room_left, self.n_ctx - len(self.slot.cells) - 2)) \
                    if guess else []
                if not draft:
                    self._decode_tokens([tok])
                    L.llama_synchronize(self.ctx)
                    spec.stepped(time.perf_counter() - t0)
                    continue
                base = len(self.slot.cells) + 1  # the cells up to and with `tok`
                predicted = self._check_draft(tok, draft, chain)
                n_ok = accepted_prefix(draft, predicted)
                spec.record(len(draft), n_ok, time.perf_counter() - t0)
                kept, ended = 0, False
                for d in draft[:n_ok]:  # each taken token as if it had been sampled alone
                    if L.llama_vocab_is_eog(self.vocab, d):
                        stop, ended = StopReason.STOP, True
                        break
                    if gp.max_tokens and n_gen >= gp.max_tokens:
                        ended = True
                        break
                    n_gen += 1
                    kept += 1
                    piece = decoder.decode(self._piece(d))
                    if piece:
                        pieces.append(piece)
                        if on_text is not None:
                            on_text(piece)
                self.slot.drop_from(base + kept)  # the guesses not taken leave the KV cache
                index.add(draft[:kept])
                if stop is not StopReason.STOP:  # the model's own token after the last one taken
                    pending = predicted[kept]  # (the logits at -1 are the batch's last row's)
                if ended:
                    break
        finally:
            self._resume_token = pending
            L.llama_sampler_free(chain)
            # the last token's decode may still run on an asynchronous device (RPC): finish it
            # here, in this turn's time, not in whatever touches the device next (a swap)
            L.llama_synchronize(self.ctx)
        self._utf8_state = decoder.getstate()
        if stops.resumes_from_cache(stop):  # a reply that may go on keeps a cut character's bytes
            return "".join(pieces), n_gen, stop
        tail = decoder.decode(b"", final=True)
        if tail:
            pieces.append(tail)
            if on_text is not None:
                on_text(tail)
        return "".join(pieces), n_gen, stop


    def _guess(self, index: NgramIndex, tok: int, k: int) -> list[int]:
        """The next `k` tokens' guess after `tok`: the draft model's where one is loaded
        (drafter.py), else the n-gram lookup's."""
        if self.drafter is not None:
            guess: list[int] = self.drafter.draft([c for c in self.slot.cells if isinstance(c, int)] + [tok], k)
            return guess
        return index.draft(k)

    def _tail_can_go(self) -> bool:
        """Whether the memory can forget its last cells (a draft's guesses not taken): a
        recurrent or hybrid model's state (Mamba, RWKV, Jamba, LFM2…) cannot be cut back."""
        if self._tail_ok is None:
            L = llama()
            self._tail_ok = not (L.llama_model_is_recurrent(self.model) or L.llama_model_is_hybrid(self.model))
        return self._tail_ok

    def _check_draft(self, tok: int, draft: list[int], chain: Any) -> list[int]:
        """Decode `tok` and the drafted tokens after it in one batch (all into the KV cache) and
        return the model's choice after each, drawn by the reply's chain from each row in turn
        up to the first that is not the guess (GenParams.can_speculate): [after tok, after
        draft[0], ...]."""
        L = llama()
        n = 1 + len(draft)
        self._decode_run([tok, *draft], every_logit=True)
        out: list[int] = []
        for j in range(n):  # the last n rows: lanes' rows come first in a batch they share
            out.append(int(L.llama_sampler_sample(chain, self.ctx, j - n)))
            if j == len(draft) or out[-1] != draft[j]:
                break
        return out

    def _close_json(self, tail: JsonTail, room: int, pieces: list[str],
                    on_text: Callable[[str], None] | None) -> int | None:
        """When the text that closes the JSON reply needs about all the `room` tokens left (a
        margin for one token that opens more), write it (into the KV cache too): the number
        of its tokens; None while there is room."""
        if tail.done:
            return None
        closer = tail.closer()
        tokens = self.tokenize(closer, add_special=False) if closer else []
        tail.closed_a_loop = len(tokens) + JSON_CLOSE_MARGIN < room and tail.looping()
        if len(tokens) + JSON_CLOSE_MARGIN < room and not tail.closed_a_loop:
            return None
        if tokens:
            self._decode_tokens(tokens)
            pieces.append(closer)
            tail.feed(closer)
            if on_text is not None:
                on_text(closer)
        return len(tokens)


STOP_WITHIN_S = 0.5  # a prompt batch on a device ends within this, so Stop lands this soon
FIRST_DEVICE_BATCH = 128  # before any batch was timed
MIN_DEVICE_BATCH = 32


def prompt_batch_within(n_batch: int, last_tokens: int, last_s: float, within_s: float) -> int:
    """A prompt batch's size that should take at most `within_s` at the last batch's pace
    (multiples of 32, from 32 to n_batch); the first one before any was timed: 128."""
    if last_tokens <= 0 or last_s <= 0:
        return min(n_batch, FIRST_DEVICE_BATCH)
    size = int(within_s * last_tokens / last_s) // MIN_DEVICE_BATCH * MIN_DEVICE_BATCH
    return max(MIN_DEVICE_BATCH, min(n_batch, size))


LOOKUP_WINDOW = 8192  # the last tokens drafts are looked up in (a reply's index is built anew)

JSON_CLOSE_MARGIN = 8  # tokens kept for the closer beyond its length: one token may open several


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
