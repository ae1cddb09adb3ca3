"""Files users bring, written by the tests themselves with PyAV (its wheels carry FFmpeg's
encoders): phone voice notes and browser recordings."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np

# container (PyAV's format name), codec, the rate the codec takes
SOUND_FORMATS = {".ogg": ("ogg", "libopus", 48000),
                 ".m4a": ("ipod", "aac", 44100), ".webm": ("webm", "libopus", 48000)}


class _Unseekable(io.RawIOBase):
    """A stream the muxer cannot seek back in, as a browser's MediaRecorder writes: a WebM
    with no length in its header."""

    def __init__(self, sink: io.BufferedWriter) -> None:
        self.sink = sink

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, b) -> int:  # type: ignore[no-untyped-def, override]
        return self.sink.write(b)


def write_encoded_tone(path: Path, hz: float, seconds: float, *, streamed: bool = False) -> Path:
    """A sine at `hz` for `seconds`, mono, in the container and codec `path`'s suffix names
    (SOUND_FORMATS); `streamed`: written as a live recorder writes it (no seeking back)."""
    import av

    fmt, codec, rate = SOUND_FORMATS[Path(path).suffix]
    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * hz * t) * 32767).astype("<i2")
    with open(path, "wb") as sink:
        target = _Unseekable(sink) if streamed else sink
        with av.open(target, "w", format=fmt) as out:
            stream = out.add_stream(codec, rate=rate)
            stream.layout = "mono"
            step = 960
            for i in range(0, len(pcm), step):
                frame = av.AudioFrame.from_ndarray(pcm[None, i:i + step], format="s16", layout="mono")
                frame.sample_rate = rate
                for packet in stream.encode(frame):
                    out.mux(packet)
            for packet in stream.encode(None):
                out.mux(packet)
    return Path(path)
