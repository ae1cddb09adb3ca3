"""Sequence 0 of a llama.cpp context, as llama.cpp's server keeps a `server_slot`: what each
KV cell holds (a token id, or an image's `(key, i)`), each cell's position and the next one,
and the states of conversations the cache let go (in RAM, `snapshots.py`; on disk,
`state_files.py`). The runtime decodes and records what it decoded here; the slot keeps the
books and moves cells: drop, K-shift, save, restore, take back a kept state."""
from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

from engine.errors import EbbError
from engine.kept_files import Mapped
from engine.llama.lib import llama
from engine.llama.snapshots import MIN_CELLS, Snapshots, State, common_prefix
from engine.llama.state_files import Entry, StateFiles

MIN_SHIFT_CELLS = 16  # a K-shift is worth it from this many cells kept


class KvSlot:
    def __init__(self, ctx: Any, shared: bool = False) -> None:
        self.ctx = ctx
        self.shared = shared  # other sequences live in the same cache (lanes.py): never clear it all
        self.cells: list[Any] = []  # one key per KV cell: token id or (image key, i)
        self.cell_pos: list[int] = []  # each cell's position (an image's cells: its first)
        self.n_past = 0  # the next position (under M-RoPE an image takes fewer than its cells)
        self.last_shift = (0, 0)  # the last prefill's K-shift: (cells dropped, cells moved)
        # states of conversations the cache let go; the next prefill keeps the cache's before
        # dropping cells when `keep_on_drop` is set (the conversation was replaced: another
        # branch or chat), and every prefill looks there
        self.snapshots = Snapshots()
        self.keep_on_drop = False
        self.last_restored = 0  # cells the last prefill took from a kept state
        self.last_restore_s = 0.0  # and the seconds that took (a disk read included)
        self.taken_up = 0  # cells taken back before the next prompt was known (take_up)
        self.taken_up_s = 0.0  # and the seconds that took
        self.restored_ahead = False  # the last prefill's restored cells were taken up

    def record_tokens(self, tokens: list[int]) -> None:
        """Text tokens were decoded at the next positions."""
        self.cells.extend(tokens)
        self.cell_pos.extend(range(self.n_past, self.n_past + len(tokens)))
        self.n_past += len(tokens)

    def record_image(self, key: str, n: int, n_past: int) -> None:
        """An image chunk of `n` cells was decoded; llama.cpp says where the next position is."""
        self.cells.extend((key, i) for i in range(n))
        self.cell_pos.extend([self.n_past] * n)
        self.n_past = n_past

    def drop_from(self, n_keep: int) -> None:
        """Forget every cell from the `n_keep`th on (by position)."""
        if n_keep >= len(self.cells):
            return
        L = llama()
        self.n_past = self.cell_pos[n_keep]
        L.llama_memory_seq_rm(L.llama_get_memory(self.ctx), 0, self.n_past, -1)
        del self.cells[n_keep:]
        del self.cell_pos[n_keep:]

    def drop_unrecorded(self) -> None:
        """A decode stopped part-way: cells past the books (earlier micro-batches of the same
        batch) go too."""
        L = llama()
        L.llama_memory_seq_rm(L.llama_get_memory(self.ctx), 0, self.n_past, -1)

    def prefix_for(self, keys: list[Any], cancel: threading.Event | None = None) -> int:
        """Before a prefill of `keys`: the cells kept (from the cache, a kept state or a
        K-shift), never all of them (the last position is always evaluated) and never ending
        inside an image; the cells after them are dropped."""
        n_keep = self.from_snapshot(keys, self.cached_prefix(keys), cancel)
        self.last_shift = (0, 0)
        n_keep = self.shift_to(keys, n_keep)
        if self.last_restored:  # the kept state's cells the shift lined up count as restored
            self.last_restored = n_keep
        n_keep = min(n_keep, len(keys) - 1)  # always evaluate at least the last position
        if isinstance(keys[n_keep], tuple):  # never start inside an image: redo all of it
            while n_keep > 0 and isinstance(keys[n_keep - 1], tuple) and keys[n_keep - 1][0] == keys[n_keep][0]:
                n_keep -= 1
        self.drop_from(n_keep)
        return n_keep

    def cached_prefix(self, keys: list[Any]) -> int:
        """How many of `keys` the KV cache already holds, from the start."""
        return common_prefix(self.cells, keys)

    def from_snapshot(self, keys: list[Any], n_keep: int,
                      cancel: threading.Event | None = None) -> int:
        """Before a prefill of `keys`: keep the cache's state if it is about to be dropped for
        another conversation, and take back a kept state (RAM, then disk) that shares more with
        `keys` than the cache does. Returns the prefix the cache now holds."""
        taken, self.taken_up = self.taken_up, 0
        self.last_restored, self.last_restore_s, self.restored_ahead = 0, 0.0, False
        self._keep_leaving(n_keep)
        t0 = time.perf_counter()
        snap, n = self.snapshots.best(keys, n_keep)
        state: State | None = snap.state if snap is not None else None
        if self.state_files is not None:
            entry, n_disk = self.state_files.best(keys, max(n, n_keep))
            if entry is not None and n_disk - max(n, n_keep) >= MIN_CELLS:
                loaded = self._load(entry, cancel)
                if loaded is not None:
                    state, n = loaded, n_disk
        if state is None:  # a state taken back before this prompt was known counts as restored
            self.last_restored = min(taken, n_keep)
            if self.last_restored:
                self.last_restore_s, self.restored_ahead = self.taken_up_s, True
            return n_keep
        return self._restore(state, n, t0)

    def take_up(self, keys: list[Any] | None, tag: str, cancel: threading.Event | None = None) -> int:
        """A conversation was opened (a chat, the window's start on it): take back its kept state
        now, while the user reads and types, so that the next prefill finds it in the cache and
        its first token comes as fast as if it had never left. `keys`: the conversation's
        cells when they are known (a text-only conversation), else the longest state kept under
        `tag` is taken. Returns the cells taken back: 0 when none is kept, the cache holds them
        already or `cancel` was set (the cache is then as it was)."""
        t0 = time.perf_counter()
        state: State | None = None
        n_keep = 0  # the cells of it the cache holds (taken back by an earlier call)
        if keys is not None:
            n_keep = self.cached_prefix(keys)
            snap, n = self.snapshots.best(keys, n_keep)
            state = snap.state if snap is not None else None
            entry, n_disk = (self.state_files.best(keys, max(n, n_keep))
                             if self.state_files is not None else (None, 0))
            if entry is not None and n_disk - max(n, n_keep) >= MIN_CELLS:
                loaded = self._load(entry, cancel)
                if loaded is not None:
                    state, n = loaded, n_disk
        elif not self.holds(tag):
            snap = self.snapshots.longest(tag)
            state = snap.state if snap is not None else None
            entry = self.state_files.longest(tag) if self.state_files is not None else None
            if entry is not None and (snap is None or len(entry.keys) >= len(snap.keys) + MIN_CELLS):
                state = self._load(entry, cancel) or state
            n = len(state[1]) if state is not None else 0
        else:
            n_keep = len(self.cells)
        if state is None or (cancel is not None and cancel.is_set()):
            self.taken_up = min(self.taken_up, n_keep)
            return 0
        self._keep_leaving(0)  # the whole cache is replaced
        self.taken_up = self._restore(state, n, t0)
        self.taken_up_s, self.last_restored = self.last_restore_s, 0  # said by the turn that uses them
        return self.taken_up

    def holds(self, tag: str) -> bool:
        """The cache holds cells of the conversation `tag` (a branch of it, maybe)."""
        return self.snapshots.tag == tag and bool(self.cells)

    def _keep_leaving(self, n_keep: int) -> None:
        """The cache is about to drop cells from `n_keep` on: keep its state when the
        conversation was replaced (`keep_on_drop`), under the tag of the one it held."""
        keep, self.keep_on_drop = self.keep_on_drop, False
        if keep and n_keep < len(self.cells) and self.snapshots.worth_keeping(len(self.cells)):
            kept = self.save_state()
            self.snapshots.add(kept, self.tag)
            if self.state_files is not None:
                self.state_files.save(kept, self.tag)
        self.snapshots.tag = self.snapshots.next_tag  # the cache is the new conversation's now

    def _load(self, entry: Entry, cancel: threading.Event | None) -> State | None:
        """A state from disk, kept in RAM from now on too when it was read into a buffer. One
        mapped from its file is not: mapping it again is as fast as RAM, and each mapping holds
        its file open (a thousand small states kept would run out of file descriptors)."""
        assert self.state_files is not None
        loaded = self.state_files.load(entry, cancel)
        if loaded is not None and not isinstance(loaded[0], Mapped):
            self.snapshots.add(loaded, entry.tag)
        return loaded

    def _restore(self, state: State, n: int, t0: float) -> int:
        try:
            self.restore_state(state)
        except EbbError:  # not taken: the cache is in no known state, so it starts afresh
            self.reset()
            self.snapshots.discard(state)  # and a damaged state is not tried again
            return 0
        self.last_restored, self.last_restore_s = n, time.perf_counter() - t0
        return n

    def persist(self) -> bool:
        """Keep the cache's state on disk now (the window closes, or is idle), unless it is
        kept there already or too short to be worth it. True when a write was started."""
        if (self.state_files is None or not self.snapshots.worth_keeping(len(self.cells))
                or self.state_files.has(self.cells)):
            return False
        self.state_files.save(self.save_state(), self.tag)
        return True

    @property
    def can_shift(self) -> bool:
        """Whether cached cells can move to other positions (llama.cpp's K-shift): not under
        M-RoPE, whose positions are not one number."""
        L = llama()
        return bool(L.llama_memory_can_shift(L.llama_get_memory(self.ctx)))

    def shift_to(self, keys: list[Any], n_keep: int) -> int:
        """The cache holds S + D + K (+ more) and the prompt is S + K + …: drop D's cells and
        move K's back to follow S (`llama_memory_seq_rm`, `llama_memory_seq_add`; llama.cpp
        rotates their keys at the next decode), so K is not evaluated again. Returns the
        prefix now kept. Used when the oldest turns of a conversation left the context."""
        cached = self.cells
        if n_keep >= len(cached) or n_keep >= len(keys) or not self.can_shift:
            return n_keep
        first = keys[n_keep]
        if isinstance(first, tuple) and first[1] != 0:  # never from inside an image
            return n_keep
        best_b, best_m = -1, 0
        for b in range(n_keep + 1, len(cached)):
            if cached[b] != first:
                continue
            m, lim = 0, min(len(cached) - b, len(keys) - n_keep)
            while m < lim and cached[b + m] == keys[n_keep + m]:
                m += 1
            if m > best_m:
                best_b, best_m = b, m
        if best_m < MIN_SHIFT_CELLS:
            return n_keep
        b, m = best_b, best_m
        if isinstance(keys[n_keep + m - 1], tuple) and n_keep + m < len(keys) and \
                isinstance(keys[n_keep + m], tuple) and keys[n_keep + m][0] == keys[n_keep + m - 1][0]:
            return n_keep  # the match would end inside an image
        L = llama()
        mem = L.llama_get_memory(self.ctx)
        p_keep, p_b = self.cell_pos[n_keep], self.cell_pos[b]
        p_end = self.cell_pos[b + m] if b + m < len(cached) else self.n_past
        delta = p_b - p_keep
        L.llama_memory_seq_rm(mem, 0, p_end, -1)
        L.llama_memory_seq_rm(mem, 0, p_keep, p_b)
        L.llama_memory_seq_add(mem, 0, p_b, p_end, -delta)
        self.cells = cached[:n_keep] + cached[b:b + m]
        self.cell_pos = self.cell_pos[:n_keep] + [p - delta for p in self.cell_pos[b:b + m]]
        self.n_past = p_end - delta
        self.last_shift = (b - n_keep, m)
        return n_keep + m

    def n_positions(self) -> int:
        """KV cells in use."""
        return len(self.cells)

    def reset(self) -> None:
        """Forget the conversation's KV cache."""
        L = llama()
        if self.shared:
            L.llama_memory_seq_rm(L.llama_get_memory(self.ctx), 0, -1, -1)
        else:
            L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        self.cells.clear()
        self.cell_pos.clear()
        self.n_past = 0

    def save_state(self) -> State:
        """Sequence 0's KV cache (its cells keep their M-RoPE positions) and our record of
        what it holds, as host bytes: written by llama.cpp straight into the bytearray kept
        (`bytes(buf[:n])` made a list of ints first: 0.48 s for a 23 MiB state, 0.012 s now, on
        the way of every Send that leaves a conversation and of every swap, #54)."""
        L = llama()
        size = L.llama_state_seq_get_size(self.ctx, 0)
        data = bytearray(size)
        n = L.llama_state_seq_get_data(self.ctx, (ctypes.c_uint8 * size).from_buffer(data), size, 0)
        if n != size:
            data = data[:n]
        return data, list(self.cells), list(self.cell_pos), self.n_past

    def restore_state(self, state: State) -> None:
        L = llama()
        data, cached, cell_pos, n_past = state
        if isinstance(data, Mapped):  # a kept file's bytes where they lie, populated again first
            if not data.populated():
                raise EbbError("the kept conversation state could not be read from disk",
                               "the conversation goes on without its earlier context")
            buf = data.as_ctypes()
        elif isinstance(data, bytearray):
            buf = (ctypes.c_uint8 * len(data)).from_buffer(data)
        else:
            buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        n = len(data)
        ok = L.llama_state_seq_set_data(self.ctx, buf, n, 0) == n
        del buf  # the mapping can go with the state
        if not ok:
            raise EbbError("llama.cpp could not restore the conversation state",
                           "the conversation goes on without its earlier context")
        # a kept file's hashes were checked on the pool while llama.cpp copied it (#54): one
        # that does not match leaves the cache to be filled again (the file is removed)
        if isinstance(data, Mapped) and not data.intact():
            raise EbbError("the kept conversation state was damaged on disk",
                           "the conversation goes on without its earlier context")
        self.cells, self.cell_pos, self.n_past = list(cached), list(cell_pos), n_past

    @property
    def state_files(self) -> StateFiles | None:
        return self.snapshots.disk

    @property
    def tag(self) -> str:
        return self.snapshots.tag
