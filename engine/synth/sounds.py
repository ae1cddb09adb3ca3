"""Sounds Ebb writes for tests, benchmarks and the demo."""
from __future__ import annotations

from pathlib import Path


def write_tone(path: Path, hz: float, seconds: float, rate: int = 16000, channels: int = 1,
               noise: float = 0.0, seed: int = 0) -> Path:
    """A 16-bit WAV of a sine at `hz` (plus white `noise`, 0..1), for tests, benchmarks and
    the demo."""
    import wave

    import numpy as np

    t = np.arange(int(seconds * rate)) / rate
    x = 0.3 * np.sin(2 * np.pi * hz * t)
    if noise:
        x = x + noise * np.random.default_rng(seed).standard_normal(len(t))
    pcm = (np.clip(x, -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.repeat(pcm, channels).tobytes())
    return Path(path)
