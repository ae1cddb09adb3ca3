"""Sound clips in the window: what a clip's chip says, and playing one back.

Playback is miniaudio's (the decoder llama.cpp's mtmd embeds): it decodes and plays on its
own audio thread, so the GUI thread only starts and stops it. Clips miniaudio cannot read (Ogg,
M4A, WebM, ...) are decoded by PyAV on that same thread, piece by piece. A machine with no sound output
gets a message, never a crash. GUI thread only (the player's device runs its own thread).
"""
from __future__ import annotations

import atexit
import re
import threading
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator

from engine.errors import EbbError
from engine.media import avfile
from engine.media.audio import clip_info, fmt_seconds
from app.sound.recorder import device_words

PLAY_RATE = 44100  # what a clip plays at (16-bit stereo): every sound output takes it


def describe(path: Path, shown_name: str = "") -> tuple[str, str | None]:
    """(the chip's words: "♪ name · 0:07 · WAV", why it cannot be attached or None).
    `shown_name`: the name the user's file had (the store keeps clips by content hash); a
    stored clip without one is called "clip"."""
    path = Path(path)
    name = shown_name or ("clip" if re.fullmatch(r"[0-9a-f]{64}", path.stem) else path.name)
    try:
        info = clip_info(path)
    except EbbError as exc:
        return f"♪ {name}", exc.what
    return f"♪ {name} · {fmt_seconds(info.seconds)} · {info.format}", None


class ClipPlayer:
    """One clip at a time; playing another stops the first. `on_problem(text)` hears of a
    clip or a sound output that cannot play. The stream tells when it ends (`poll` closes the
    device then), so ▶ after a clip ended plays it again, and a device is never left open at
    exit: miniaudio's device keeps its thread, and the process waited on it for ever (#52)."""

    def __init__(self, on_problem: Callable[[str], None]) -> None:
        self.on_problem = on_problem
        self.device: Any = None
        self.playing: Path | None = None
        self._ended = threading.Event()
        _players.add(self)

    def toggle(self, path: Path) -> None:
        """Play `path`, or stop it when it is the one playing (a clip that ended plays again)."""
        self.poll()
        was = self.playing
        self.stop()
        if was != Path(path):
            self.play(Path(path))

    def play(self, path: Path) -> None:
        import miniaudio

        try:
            clip = clip_info(path)
            ended = threading.Event()
            if clip.by_mtmd:
                source = miniaudio.stream_file(str(path), nchannels=2, sample_rate=PLAY_RATE)
            else:  # Ogg, M4A, WebM, ...: PyAV decodes on the device's thread, as it plays
                source = _pcm_stream(avfile.pcm_chunks(path, PLAY_RATE, 2), frame_bytes=4)
            stream = _until_end(source, ended)
            device = miniaudio.PlaybackDevice(nchannels=2, sample_rate=PLAY_RATE)
            device.start(stream)
        except EbbError as exc:
            self.on_problem(f"Cannot play {path.name}: {exc.what}")
            return
        except (miniaudio.MiniaudioError, OSError) as exc:
            self.on_problem(f"Cannot play {path.name}: no sound output here ({device_words(exc)})")
            return
        self.device, self.playing, self._ended = device, path, ended

    def poll(self) -> bool:
        """Close the device of a clip that has ended; True when one did (the view's ■ goes
        back to ▶). The widgets call it on a timer while something plays."""
        if self.playing is not None and self._ended.is_set():
            self.stop()
            return True
        return False

    def stop(self) -> None:
        if self.device is not None:
            try:
                self.device.close()
            except Exception:  # noqa: BLE001 - a device that is already gone
                pass
        self.device, self.playing = None, None


def _pcm_stream(chunks: Iterator[bytes], frame_bytes: int) -> Any:
    """PCM pieces as a primed miniaudio stream: each answer the frames it was asked for. A
    clip that breaks off mid-way ends there (its decoder's EbbError stops the stream)."""
    def frames() -> Any:
        buf = bytearray()
        want = (yield b"") or 1024
        try:
            for chunk in chunks:
                buf += chunk
                while len(buf) >= want * frame_bytes:
                    piece = bytes(buf[:want * frame_bytes])
                    del buf[:len(piece)]
                    want = (yield piece) or want
        except EbbError:
            return
        while buf:
            piece = bytes(buf[:want * frame_bytes])
            del buf[:len(piece)]
            want = (yield piece) or want

    stream = frames()
    next(stream)
    return stream


def _until_end(stream: Any, ended: threading.Event) -> Any:
    """miniaudio's stream (primed, as stream_file returns it), telling `ended` when it has no
    more samples (the device then plays silence until it is closed); primed itself."""
    watched = _watch(stream, ended)
    next(watched)
    return watched


def _watch(stream: Any, ended: threading.Event) -> Any:
    required = yield b""
    while True:
        try:
            samples = stream.send(required)
        except StopIteration:
            ended.set()
            return
        required = yield samples


_players: weakref.WeakSet[ClipPlayer] = weakref.WeakSet()


@atexit.register
def _close_players() -> None:
    """At exit, every device still open is closed: an open one kept the process alive."""
    for player in list(_players):
        player.stop()
