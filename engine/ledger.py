"""The ledger: what the engine has put on each device, by kind, with peaks.

Bytes come from llama.cpp's own reports where it gives them (buffer sizes it logs) and from
the planner's estimates otherwise. Owned by the engine's thread.
"""
from __future__ import annotations

from collections import defaultdict


class Ledger:
    def __init__(self) -> None:
        self._bytes: dict[str, dict[str, int]] = defaultdict(dict)
        self._peak: dict[str, int] = defaultdict(int)

    def set(self, device: str, kind: str, n_bytes: int) -> None:
        self._bytes[device][kind] = n_bytes
        self._peak[device] = max(self._peak[device], self.total(device))

    def clear(self, device: str, *kinds: str) -> None:
        for kind in kinds or tuple(self._bytes[device]):
            self._bytes[device].pop(kind, None)

    def total(self, device: str) -> int:
        return sum(self._bytes[device].values())

    def reset_peaks(self) -> None:
        self._peak = defaultdict(int, {d: self.total(d) for d in self._bytes})

    def peaks(self) -> dict[str, int]:
        return dict(self._peak)

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {d: dict(k) for d, k in self._bytes.items() if k}
