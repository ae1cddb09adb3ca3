"""Sequences beside the session's own (sequence 0) in its llama.cpp context, decoded in the same
`llama_decode` as it: llama.cpp's server's slots, for text replies.

A context made with lanes (`LoadParams.lanes`) has `n_seq_max` 1 + lanes and one unified KV
cache of the session's `n_ctx` cells plus a pool of `lane_cells` for the lanes. Sequence 0
keeps its `n_ctx` as before (its `KvSlot`, kept states, pictures, swaps); lane `k` is sequence
`k`. A request's room in the pool is reserved when it starts (its prompt and its cap, or a
share of the pool when it has none): one lane can never take another's cells, and a request
that does not fit waits in line. A lane that ends keeps its cells (its conversation's prefix,
found again by the next request that shares it, as llama-server's slots keep theirs) until
their room is needed.

Who steps: while sequence 0 prefills or generates, every batch it decodes carries the lanes'
work too (`TextRuntime._decode_run`): one token per generating lane and a piece of a waiting
prompt, lanes first and sequence 0's tokens last (its rows stay at the end, where -1 finds
them). While sequence 0 is idle, the owner of the runtime calls `step` (the serve worker).
A request may carry pictures and clips (`LaneRequest.items`: their chunks' embeddings, encoded
before it starts): each chunk is decoded into its lane by mtmd's own helper (positions, M-RoPE,
non-causal attention as llama.cpp has them) before the batch its next text goes in, the other
sequences waiting meanwhile. Sequence 0's pictures are decoded the same way, and a swap runs
for sequence 0 alone: the lanes pause and keep their cells. One thread, the runtime's.
"""
from __future__ import annotations

import codecs
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.errors import EbbError
from engine.events import GenStats
from engine.llama.lib import llama
from engine.llama.lookup import MAX_DRAFT, NgramIndex, Speculation
from engine.llama.sampling import GenParams, logprob_entry, sampler_chain
from engine.llama.snapshots import common_prefix
from engine.stops import StopReason

LANE_PIECE = 256  # prompt tokens the lanes put into one batch, all together
LOOKUP_WINDOW = 8192  # the prompt's last tokens a lane's drafts are looked up in (as runtime.py's)
MIN_REPLY = 16  # a request without a cap starts only with room for at least this many tokens


@dataclass(frozen=True)
class LaneResult:
    text: str
    stats: GenStats
    error: str | None = None  # the lane was cut (the model closed): what to tell the client
    seq: int = 0  # the lane's sequence
    started: float = 0.0  # time.monotonic() when it began, its first token, its end
    first: float = 0.0
    ended: float = 0.0


@dataclass
class LaneRequest:
    tokens: list[Any]  # the whole prompt's cells: token ids, and (picture key, i) per embedding
    gp: GenParams
    on_text: Callable[[str], None]
    on_end: Callable[[LaneResult], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    # a prompt with pictures or clips: its token ids and ImageSpans (runtime.py), and what
    # frees the chunks they point into once the request ends
    items: list[Any] | None = None
    close: Callable[[], None] | None = None


@dataclass
class Work:
    """A lane's part of a batch: its tokens, the last `n_out` of which want logits (a prompt's
    last piece: 1; a generating lane's token and its draft: all), from batch index `row` on."""
    lane: Lane
    tokens: list[int]
    n_out: int
    row: int = 0


class Lane:
    """One sequence of the pool: its cells (token ids, at positions 0..n-1) and the request it
    answers, if any."""

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.cells: list[Any] = []  # token ids, and (picture key, i) for a picture's cells
        self.n_past = 0  # the next position (past a picture's cells it is mtmd's, not len(cells))
        self.req: LaneRequest | None = None
        self.reserve = 0  # cells it may reach while answering (its prompt and its reply)
        self.todo: list[Any] = []  # prompt tokens (and ImageSpans) not decoded yet
        self.pending: int | None = None  # sampled, shown, not decoded yet
        self.chain: Any = None
        self.decoder: Any = None
        self.pieces: list[str] = []
        self.logprobs: list[Any] = []  # each sampled token's, when the request asks
        self.spec: Speculation | None = None  # drafting, for a greedy reply (lookup.py)
        self.index: NgramIndex | None = None
        self.indexed = False  # the pending token is in the index
        self.n_gen = 0
        self.n_eval = 0  # prompt tokens evaluated (the rest were in its cells already)
        self.t_start = self.t_first = 0.0
        self.used = 0.0  # when it last answered (the longest idle lane gives its cells first)


class Lanes:
    def __init__(self, rt: Any, n_lanes: int, pool: int) -> None:  # rt: the TextRuntime that
        # owns it (runtime.py imports this module: naming the type here would make a circle)
        self.rt = rt
        self.pool = pool
        self.lanes = [Lane(k + 1) for k in range(n_lanes)]
        # asked before each step for requests to start (the serve worker's queue)
        self.feed: Callable[[], None] | None = None
        self.steps = 0  # batches decoded with lane work in them
        self.decoded_alone = False  # a picture's chunk went in since the last batch (its own decodes)

    # ------------------------------------------------------------ requests

    @property
    def busy(self) -> bool:
        return any(lane.req is not None for lane in self.lanes)

    def n_busy(self) -> int:
        return sum(lane.req is not None for lane in self.lanes)

    def free_lane(self) -> bool:
        return any(lane.req is None for lane in self.lanes)

    def room(self) -> int:
        """Pool cells no running request has reserved (idle lanes' kept cells count as free:
        they go when a request needs their room)."""
        return self.pool - sum(lane.reserve for lane in self.lanes if lane.req is not None)

    def start(self, req: LaneRequest) -> bool:
        """Begin answering `req` on a free lane: the one whose kept cells share the longest
        prefix with its prompt. False when no lane is free or its room is not there (it waits)."""
        free = [lane for lane in self.lanes if lane.req is None]
        if not free or not req.tokens:
            return False
        n = len(req.tokens)
        room = self.room()
        want = n + req.gp.max_tokens if req.gp.max_tokens else n + max(MIN_REPLY, self.pool // len(self.lanes) - n)
        if req.gp.max_tokens and want > room:
            return False
        reserve = min(want, room)
        if reserve < n + min(MIN_REPLY, req.gp.max_tokens or MIN_REPLY):
            return False
        lane = max(free, key=lambda ln: (_kept(ln.cells, req.tokens), -ln.used))
        self._make_room(reserve, lane)
        L = llama()
        mem = L.llama_get_memory(self.rt.ctx)
        n_keep = min(_kept(lane.cells, req.tokens), n - 1)  # text cells: their positions are their places
        L.llama_memory_seq_rm(mem, lane.seq, n_keep, -1)
        del lane.cells[n_keep:]
        lane.n_past = n_keep
        try:
            lane.chain = sampler_chain(req.gp, self.rt.vocab, self.rt.info.n_vocab)
        except EbbError as exc:
            if req.close is not None:
                req.close()
            req.on_end(LaneResult("", GenStats(n_prompt_tokens=n), str(exc)))
            return True
        lane.req, lane.reserve = req, reserve
        # the kept cells are text (_kept), so the items before them are the same token ids
        lane.todo = list(req.items[n_keep:] if req.items is not None else req.tokens[n_keep:])
        lane.pending = None
        lane.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        lane.pieces, lane.logprobs, lane.n_gen, lane.n_eval = [], [], 0, 0
        drafts = req.gp.can_speculate and self.rt._tail_can_go()
        lane.spec = Speculation() if drafts else None
        lane.index = NgramIndex([t for t in req.tokens[-LOOKUP_WINDOW:] if isinstance(t, int)]) \
            if drafts else None
        lane.t_start, lane.t_first = time.perf_counter(), 0.0
        return True

    def _make_room(self, reserve: int, taker: Lane) -> None:
        """Idle lanes' kept cells go (the longest idle first) until `reserve` fits beside what
        the running requests reserved."""
        L = llama()
        mem = L.llama_get_memory(self.rt.ctx)
        idle = sorted((ln for ln in self.lanes if ln.req is None and ln is not taker and ln.cells),
                      key=lambda ln: ln.used)
        held = sum(len(ln.cells) for ln in idle)
        while idle and self.room() - held < reserve:
            ln = idle.pop(0)
            held -= len(ln.cells)
            L.llama_memory_seq_rm(mem, ln.seq, -1, -1)
            ln.cells.clear()
            ln.n_past = 0

    def _end(self, lane: Lane, stop: StopReason, error: str | None = None) -> None:
        req = lane.req
        assert req is not None
        if stop is not StopReason.CANCELLED or error is not None:
            tail = lane.decoder.decode(b"", final=True)
            if tail:
                lane.pieces.append(tail)
                req.on_text(tail)
        now = time.perf_counter()
        first = lane.t_first or now
        stats = GenStats(n_prompt_tokens=len(req.tokens), n_gen_tokens=lane.n_gen,
                         prompt_s=first - lane.t_start, gen_s=now - first, stop_reason=stop,
                         n_prompt_tokens_evaluated=lane.n_eval,
                         logprobs=tuple(lane.logprobs) if req.gp.top_logprobs >= 0 else None,
                         n_drafts=lane.spec.drafts if lane.spec else 0,
                         n_drafted=lane.spec.drafted if lane.spec else 0,
                         n_draft_accepted=lane.spec.accepted if lane.spec else 0)
        if lane.pending is not None:  # shown but never decoded: its cell is not there
            lane.pending = None
        llama().llama_sampler_free(lane.chain)
        lane.chain, lane.req, lane.reserve, lane.todo = None, None, 0, []
        if req.close is not None:  # the pictures' chunks
            req.close()
        lane.used = now
        mono = time.monotonic() - now  # the same moments on the spans' clock
        req.on_end(LaneResult("".join(lane.pieces), stats, error, lane.seq, lane.t_start + mono,
                              first + mono, now + mono))

    def cut(self, why: str) -> None:
        """The context goes (the model closes or reloads): every running request ends, told why."""
        for lane in self.lanes:
            if lane.req is not None:
                self._end(lane, StopReason.CANCELLED, why)
            lane.cells.clear()
            lane.n_past = 0

    # ------------------------------------------------------------ batches

    def work(self, room: int) -> list[Work]:
        """The lanes' part of the next batch, within `room` tokens: each generating lane's next
        token (and its draft, lookup.py), then pieces of prompts."""
        if self.feed is not None:
            self.feed()
        out: list[Work] = []
        for lane in self.lanes:
            req = lane.req
            if req is not None and req.cancel.is_set():
                self._end(lane, StopReason.CANCELLED)
            elif req is not None and lane.todo and not isinstance(lane.todo[0], int):
                self._decode_pictures(lane)
        for lane in self.lanes:
            req = lane.req
            if req is None or req.cancel.is_set():
                continue
            if req is not None and lane.pending is not None and room > 0:
                draft = self._draft(lane, room - 1)
                out.append(Work(lane, [lane.pending, *draft], 1 + len(draft)))
                room -= 1 + len(draft)
        piece = min(room, LANE_PIECE)
        for lane in self.lanes:
            if lane.req is not None and lane.todo and piece > 0:
                toks = _text_run(lane.todo, piece)
                if not toks:
                    continue
                out.append(Work(lane, toks, int(len(toks) == len(lane.todo))))
                piece -= len(toks)
        return out

    def _decode_pictures(self, lane: Lane) -> None:
        """The picture chunks at the head of the lane's prompt, each decoded into its sequence
        now by mtmd's helper (its own decodes: the last batch's logits are gone after it, and
        were read already). One that fails ends the request, said."""
        rt = self.rt
        req = lane.req
        assert req is not None
        while lane.todo and not isinstance(lane.todo[0], int):
            img = lane.todo[0]
            self.decoded_alone = True
            try:
                n_past = rt.decode_image_at(img, lane.n_past, lane.seq)
            except BaseException as exc:  # what the helper decoded of it goes: it is done again
                L = llama()
                L.llama_memory_seq_rm(L.llama_get_memory(rt.ctx), lane.seq, lane.n_past, -1)
                if not isinstance(exc, EbbError):
                    raise  # a Stop of the session's prompt (TurnCancelled): the lane goes on later
                self._end(lane, StopReason.CANCELLED, str(exc))
                return
            n = img.embeddings.shape[0]
            lane.cells.extend((img.key, i) for i in range(n))
            lane.n_past = n_past
            lane.n_eval += n
            del lane.todo[0]

    def _draft(self, lane: Lane, room: int) -> list[int]:
        """Tokens guessed after the lane's pending one (greedy replies: runtime.py's rule)."""
        spec, index, req = lane.spec, lane.index, lane.req
        if spec is None or index is None or req is None or not spec.on:
            return []
        if lane.pending is not None and not lane.indexed:
            index.add([lane.pending])
            lane.indexed = True
        left = (req.gp.max_tokens - lane.n_gen) if req.gp.max_tokens else MAX_DRAFT
        return index.draft(max(0, min(spec.length, left, room, lane.reserve - len(lane.cells) - 2)))

    def put(self, batch: Any, j: int, work: list[Work]) -> None:
        """Write `work` into `batch` from index `j`, each entry's outputs last."""
        for w in work:
            base = w.lane.n_past
            w.row = j + len(w.tokens) - w.n_out  # the batch index of its first output
            for k, tok in enumerate(w.tokens):
                batch.token[j] = tok
                batch.pos[j] = base + k
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = w.lane.seq
                batch.logits[j] = 1 if k >= len(w.tokens) - w.n_out else 0
                j += 1

    def undo(self, work: list[Work]) -> None:
        """A batch failed or stopped part-way: each lane's cells past its books go; its work is
        done again by a later batch."""
        L = llama()
        mem = L.llama_get_memory(self.rt.ctx)
        for w in work:
            L.llama_memory_seq_rm(mem, w.lane.seq, w.lane.n_past, -1)

    def after(self, work: list[Work]) -> None:
        """The batch was decoded: record the cells, sample each lane that had logits (a draft's
        tokens in turn while the model agrees with them; those it did not leave the cache)."""
        L = llama()
        rt = self.rt
        self.steps += 1
        for w in work:
            lane, req = w.lane, w.lane.req
            if req is None:  # ended meanwhile (cannot happen within one batch; kept safe)
                lane.cells.extend(w.tokens)
                lane.n_past += len(w.tokens)
                continue
            if lane.pending is not None and w.tokens[0] == lane.pending and w.n_out == len(w.tokens):
                lane.pending, lane.indexed = None, False
                draft = w.tokens[1:]
                lane.cells.append(w.tokens[0])
                lane.n_past += 1
            else:
                draft = []
                lane.cells.extend(w.tokens)
                lane.n_past += len(w.tokens)
                del lane.todo[:len(w.tokens)]
                lane.n_eval += len(w.tokens)
            if not w.n_out:
                continue
            taken = 0
            for k in range(1 + len(draft)):  # row k: the model's choice after the k-th token
                tok = self._sampled(lane, w.row + k)
                if tok is None or lane.req is None:
                    break
                if k < len(draft) and tok == draft[k]:
                    taken += 1
                    lane.cells.append(tok)
                    lane.n_past += 1
                    if lane.index is not None:
                        lane.index.add([tok])
                    continue
                lane.pending = tok
                break
            if draft:
                L.llama_memory_seq_rm(L.llama_get_memory(rt.ctx), lane.seq, lane.n_past, -1)
                if lane.spec is not None:
                    lane.spec.record(len(draft), taken)

    def _sampled(self, lane: Lane, row: int) -> int | None:
        """Sample the lane's next token from `row`, show it, and end the request where it ends:
        the token, or None when the request ended."""
        L = llama()
        rt, req = self.rt, lane.req
        assert req is not None
        tok = int(L.llama_sampler_sample(lane.chain, rt.ctx, row))
        if not lane.t_first:
            lane.t_first = time.perf_counter()
        if req.gp.top_logprobs >= 0:  # from the lane's own row, before any sampler
            lane.logprobs.append(logprob_entry(rt.ctx, rt.info.n_vocab, tok, req.gp.top_logprobs,
                                               rt._piece, row))
            if req.gp.on_logprob is not None:
                req.gp.on_logprob(lane.logprobs[-1])
        if L.llama_vocab_is_eog(rt.vocab, tok):
            self._end(lane, StopReason.STOP)
            return None
        lane.n_gen += 1
        piece = lane.decoder.decode(rt._piece(tok))
        if piece:
            lane.pieces.append(piece)
            req.on_text(piece)  # may set req.cancel (a stop sequence): seen next batch
        if req.gp.max_tokens and lane.n_gen >= req.gp.max_tokens:
            self._end(lane, StopReason.LENGTH)
            return None
        if len(lane.cells) + 1 >= lane.reserve:  # its room is used up (this token takes a cell)
            self._end(lane, StopReason.LENGTH if req.gp.max_tokens or lane.reserve < self.pool
                      else StopReason.CONTEXT_FULL)
            return None
        return tok

    def step(self) -> None:
        """One batch of lane work alone (sequence 0 is idle): what `TextRuntime._decode_run`
        adds to sequence 0's batches otherwise."""
        rt = self.rt
        self.decoded_alone = False
        work = self.work(rt.params.n_batch)
        if self.decoded_alone:  # a picture's own decodes: the last row is no longer sequence 0's
            rt.own_logits_lost()
        if not work:
            return
        L = llama()
        n = sum(len(w.tokens) for w in work)
        batch = L.llama_batch_init(n, 0, 1)
        try:
            batch.n_tokens = n
            self.put(batch, 0, work)
            try:
                rt._decode(batch)
            except BaseException as exc:
                self.undo(work)
                for w in work:  # a lane alone failed: its requests end, said
                    if w.lane.req is not None:
                        self._end(w.lane, StopReason.CANCELLED, str(exc) or type(exc).__name__)
                if not isinstance(exc, EbbError):
                    raise
                return
        finally:
            L.llama_batch_free(batch)
        rt.own_logits_lost()
        self.after(work)


def _kept(cells: list[Any], tokens: list[Any]) -> int:
    """How much of a lane's cells a request can keep: their common prefix, up to the first
    picture cell (past it, a cell's position is not its place)."""
    n = common_prefix(cells, tokens)
    return next((i for i, c in enumerate(cells[:n]) if not isinstance(c, int)), n)


def _text_run(todo: list[Any], most: int) -> list[int]:
    """The token ids at the head of `todo`, up to `most` and the next picture."""
    out: list[int] = []
    for t in todo[:most]:
        if not isinstance(t, int):
            break
        out.append(t)
    return out
