"""The model's memory of conversations beyond the KV cache, one owner: the states kept in RAM
and on disk (engine/llama/snapshots.py, state_files.py) and the pictures' encodings on disk
(engine/media/embedding_files.py). It keeps the cache's state when its conversation leaves,
takes one back when its conversation is opened or asked for, writes the cache's down when the
window closes or idles, deletes a chat's, and follows the disk budget.

The session's thread, except `read_ahead` (any thread). A session whose remote device went
away (`abandoned`) touches none of it: its cache lives on a server that is gone.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

from engine.llama.snapshots import MIN_CELLS
from engine.media.embedding_files import EmbeddingFiles
from engine.media.encoder import MediaEncoder
from engine.placement.residency import ModelResidency


class KeptMemory:
    def __init__(self, model: ModelResidency, encoder: MediaEncoder, state_dir: Path | None,
                 abandoned: Callable[[], bool]) -> None:
        self.model = model
        self.encoder = encoder
        self.state_dir = state_dir
        self._abandoned = abandoned

    def keep_on_drop(self, tag: str) -> None:
        """The conversation was replaced (another branch or chat, now `tag`): the cache's state
        is kept if the next prompt drops it, to be taken back when it comes back, under the tag
        of the conversation it held."""
        self.model.snapshots.next_tag = tag
        self.model.keep_on_drop()

    def holds(self, tag: str) -> bool:
        """The cache holds cells of the conversation `tag` (a branch of it, maybe)."""
        rt = self.model.runtime
        return rt is not None and rt.slot.holds(tag)

    def take_up(self, cells: list[Any] | None, tag: str, cancel: threading.Event | None) -> int:
        """Take the conversation `tag`'s kept state back into the cache now (KvSlot.take_up):
        by its cells when they are known, else its longest state. Returns the cells taken."""
        rt = self.model.runtime
        if rt is None or self._abandoned():
            return 0
        return rt.slot.take_up(cells, tag, cancel)

    def read_ahead(self, tag: str) -> None:
        """Any thread: a turn of the conversation `tag` is coming (an endpoint request, still
        queued or not yet rendered): start reading its longest state kept on disk, unless the
        cache or RAM holds as much of it already. The turn's prefix match decides, as always,
        whether it is taken (StateFiles.read_ahead)."""
        snaps = self.model.snapshots
        disk = snaps.disk
        if disk is None or self._abandoned() or snaps.tag == tag:
            return
        entry = disk.longest(tag)
        in_ram = snaps.longest(tag)
        if entry is not None and (in_ram is None or len(entry.keys) >= len(in_ram.keys) + MIN_CELLS):
            disk.read_ahead(entry)

    def persist(self) -> bool:
        """Keep the cache's state of this conversation on disk now (the window closes or is
        idle). True when a write was started."""
        rt = self.model.runtime
        return not self._abandoned() and rt is not None and rt.slot.persist()

    def forget(self, tag: str) -> int:
        """Delete the kept states of the conversation `tag` (a deleted chat). Returns how many
        files went."""
        disk = self.model.snapshots.disk
        self.model.snapshots.drop_tag(tag)
        return disk.delete_tag(tag) if disk is not None else 0

    def set_budget(self, budget_bytes: int) -> None:
        """The disk's budget for kept states and pictures, from now on (0: keep none: what is
        kept goes). No reload."""
        snaps = self.model.snapshots
        if snaps.disk is not None:
            snaps.disk.set_budget(budget_bytes)
            if budget_bytes <= 0:
                snaps.disk.flush()
                snaps.disk, self.encoder.disk = None, None
        elif budget_bytes > 0 and self.state_dir is not None:
            snaps.disk = self.model.open_state_files()
            self.encoder.disk = EmbeddingFiles(self.state_dir / "pictures")
