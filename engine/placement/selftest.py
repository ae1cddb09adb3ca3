"""The live mover's self-test: its logits must equal the reload mover's, exactly.

Before the live model loads, the reload mover builds the same layout twice — once with the
planned layers on the device, once with one layer toggled — and records the logits of a fixed
prompt (so two copies of the model are never on the device at once). After the live mover has
made the planned placement, the layer is moved and moved back; each state's logits must match.
Passing references are remembered (as hashes) per model, device and layout in the cache
folder, so later starts skip the reference loads. Engine thread only.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from engine import testhooks
from engine.gguf.info import ModelInfo
from engine.llama.loaded_model import LoadParams
from engine.llama.runtime import TextRuntime
from engine.paths import cache_dir
from engine.json_file import read_object

if TYPE_CHECKING:
    import numpy as np  # imported where used: numpy is not needed before the first token

    from engine.placement.live_mover import LiveMover

FAIL_ENV = testhooks.BREAK_LIVE_MOVER  # test-only hook: "1" makes the comparison fail
PROMPT = "Ebb self-test: the quick brown fox jumps over the lazy dog."


def _digest(a: np.ndarray) -> str:
    import numpy as np

    return hashlib.sha256(np.ascontiguousarray(a, dtype=np.float32).tobytes()).hexdigest()


@dataclass(frozen=True)
class Setup:
    """What makes two loads the same for the remembered references."""
    model_path: Path
    device: str
    device_description: str
    n_ctx: int
    n_batch: int
    flash_attn: bool
    n_threads: int


class SelfTestReference:
    """`params_for(layers)`: the reload mover's load parameters with `layers` on the device."""

    def __init__(self, params_for: Callable[[set[int]], LoadParams], info: ModelInfo,
                 setup: Setup, before: set[int], toggle: int) -> None:
        self.params_for = params_for
        self.info = info
        self.before = before
        self.after = before ^ {toggle}
        self.toggle = toggle
        self.tokens: list[int] = []
        self.refs: list[str] = []  # digests: before, after
        self.cached = False
        self._path = cache_dir() / "live-mover-selftest.json"
        self._key = self._make_key(setup)

    def _make_key(self, s: Setup) -> str:
        import llama_cpp

        st = s.model_path.stat()
        parts = [llama_cpp.__version__, str(s.model_path.resolve()), st.st_size, st.st_mtime_ns,
                 s.device, s.device_description, sorted(self.before), self.toggle, s.n_ctx,
                 s.n_batch, s.flash_attn, s.n_threads]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()

    def _load_cache(self) -> dict[str, Any]:
        return read_object(self._path)

    def prepare(self) -> None:
        """Reference logits from the reload mover (or the cache of earlier passes)."""
        hit = self._load_cache().get(self._key)
        if hit and not testhooks.live_mover_broken():
            self.tokens, self.refs, self.cached = list(hit["tokens"]), list(hit["refs"]), True
            return
        for layers in (self.before, self.after):
            rt = TextRuntime(self.params_for(layers), self.info)
            try:
                if not self.tokens:
                    self.tokens = rt.tokenize(PROMPT, add_special=True)
                self.refs.append(_digest(rt.logits_for(self.tokens)))
            finally:
                rt.close()

    def check(self, runtime: "TextRuntime", mover: "LiveMover") -> str | None:
        """Move the layer live and back; None when every state matches its reference. A layer
        on the device is pointed at its host copy and back with its device bytes kept (what an
        eviction and a promotion do to the model, without sending the layer a second time: over
        RPC that would be the layer's bytes again on every start)."""
        def state() -> str:
            mover.reschedule()
            return _digest(runtime.logits_for(self.tokens))

        states = [state()]
        if self.toggle in mover.on_device():
            device_fields = mover.detach(self.toggle)
            states.append(state())
            mover.reattach(device_fields)
        else:
            mover.promote(self.toggle)
            states.append(state())
            mover.evict(self.toggle)
        states.append(state())
        if testhooks.live_mover_broken():
            states[1] = "broken on purpose by " + FAIL_ENV
        expected = [self.refs[0], self.refs[1], self.refs[0]]
        names = ["as placed", f"with layer {self.toggle} moved", "after moving it back"]
        for name, got, want in zip(names, states, expected):
            if got != want:
                return f"logits {name} differ from the reload mover's"
        if not self.cached:
            data = self._load_cache()
            data[self._key] = {"tokens": self.tokens, "refs": self.refs}
            self._path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._path.with_name(f".{self._path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self._path)  # whole or not at all: a crash leaves the old file
        return None
