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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.paths import cache_dir

if TYPE_CHECKING:
    from engine.placement.live_mover import LiveMover
    from engine.llama.runtime import TextRuntime
    from engine.session import Session

FAIL_ENV = "EBB_TEST_BREAK_LIVE_MOVER"  # test-only hook: "1" makes the comparison fail
PROMPT = "Ebb self-test: the quick brown fox jumps over the lazy dog."


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, dtype=np.float32).tobytes()).hexdigest()


class SelfTestReference:
    def __init__(self, session: "Session", before: set[int], toggle: int) -> None:
        self.session = session
        self.before = before
        self.after = before ^ {toggle}
        self.toggle = toggle
        self.tokens: list[int] = []
        self.refs: list[str] = []  # digests: before, after
        self.cached = False
        self._path = cache_dir() / "live-mover-selftest.json"
        self._key = self._make_key()

    def _make_key(self) -> str:
        import llama_cpp

        from engine.llama.devices import find_device

        s = self.session
        st = Path(s.cfg.model_path).stat()
        dev = find_device(s.accel or "CPU")
        parts = [llama_cpp.__version__, str(Path(s.cfg.model_path).resolve()), st.st_size,
                 st.st_mtime_ns, dev.name, dev.description, sorted(self.before), self.toggle,
                 s.n_ctx, s.cfg.n_batch, s.cfg.flash_attn, s.n_threads]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()

    def _load_cache(self) -> dict[str, Any]:
        try:
            data = json.loads(self._path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def prepare(self) -> None:
        """Reference logits from the reload mover (or the cache of earlier passes)."""
        hit = self._load_cache().get(self._key)
        if hit and os.environ.get(FAIL_ENV) != "1":
            self.tokens, self.refs, self.cached = list(hit["tokens"]), list(hit["refs"]), True
            return
        from engine.llama.runtime import TextRuntime

        s = self.session
        for layers in (self.before, self.after):
            rt = TextRuntime(s.text_params(s.placement, device_layers=layers), s.info)
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
        if os.environ.get(FAIL_ENV) == "1":
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
            self._path.write_text(json.dumps(data))
        return None
