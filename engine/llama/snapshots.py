"""Saved KV states of conversations the cache let go, to take up again exactly.

When the window moves to another branch of a chat (an edit, a regenerated reply, an older
version) or to another chat, the next prompt shares only a prefix with what the KV cache holds,
and the rest of the cache is dropped. Evaluating it again when the user comes back costs time,
and gives a reply that can differ from the one the untouched cache gives (a prompt evaluated in
one batch is not bit-for-bit the tokens generated one by one). So before such a drop the runtime
keeps the sequence's state (llama.cpp's `llama_state_seq_get_data`: host bytes, whatever device
held the cells), and a later prompt that shares more with a kept state than with the cache gets
that state back first. Kept newest last, within a byte budget (the oldest go first); a state
whose cells are a prefix of a newer one's is of no more use and goes. Pure bookkeeping: the
runtime saves and restores. One per loaded model (`ModelResidency`), shared by the runtimes
it builds one after another (a reload keeps them: the states are host bytes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from engine.llama.state_files import State, StateFiles, common_prefix

__all__ = ["BUDGET_BYTES", "MIN_CELLS", "Snapshot", "Snapshots", "State", "common_prefix"]

BUDGET_BYTES = 1 << 30  # the states kept in RAM, together
MIN_CELLS = 16  # a shorter state is evaluated again about as fast as it is copied


@dataclass
class Snapshot:
    state: State
    tag: str = "x"  # the conversation it belongs to

    @property
    def keys(self) -> list[Any]:
        return self.state[1]

    @property
    def nbytes(self) -> int:
        return len(self.state[0])


class Snapshots:
    def __init__(self, budget_bytes: int = BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self._kept: list[Snapshot] = []  # newest last
        self.disk: StateFiles | None = None  # the states kept on disk too (None: RAM only)
        self.tag = "x"  # the conversation the cache holds (its files are named by it)
        self.next_tag = "x"  # the one the session holds now: the cache's once it is prefilled

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._kept)

    def best(self, keys: Sequence[Any], than: int) -> tuple[Snapshot | None, int]:
        """The kept state sharing the longest prefix with `keys`, if it shares at least
        MIN_CELLS more than `than` (what the cache itself shares), and how much it shares."""
        best, best_n = None, than
        for snap in self._kept:
            n = common_prefix(snap.keys, keys)
            if n > best_n:
                best, best_n = snap, n
        if best is None or best_n - than < MIN_CELLS:
            return None, than
        self._kept.remove(best)  # used: the newest now
        self._kept.append(best)
        return best, best_n

    def longest(self, tag: str) -> Snapshot | None:
        """The longest kept state of the conversation `tag`."""
        kept = list(self._kept)  # a copy: read_ahead asks from another thread
        return max((s for s in kept if s.tag == tag), key=lambda s: len(s.keys), default=None)

    def worth_keeping(self, n_cells: int, nbytes: int | None = None) -> bool:
        return n_cells >= MIN_CELLS and (nbytes is None or nbytes <= self.budget_bytes)

    def drop_tag(self, tag: str) -> None:
        """Forget the states of the conversation `tag` (a deleted chat)."""
        self._kept = [s for s in self._kept if s.tag != tag]
        if self.tag == tag:
            self.tag = "x"

    def add(self, state: State, tag: str = "x") -> None:
        snap = Snapshot(state, tag)
        if not self.worth_keeping(len(snap.keys), snap.nbytes):
            return
        keys = snap.keys
        self._kept = [s for s in self._kept
                      if not (len(s.keys) <= len(keys) and common_prefix(s.keys, keys) == len(s.keys))]
        self._kept.append(snap)
        while self.nbytes > self.budget_bytes and len(self._kept) > 1:
            self._kept.pop(0)

    def discard(self, state: State) -> None:
        """Forget `state` (one that could not be restored)."""
        self._kept = [s for s in self._kept if s.state is not state]

    def clear(self) -> None:
        self._kept.clear()
