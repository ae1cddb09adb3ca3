"""Sound clips in the window: what a clip's chip says, and playing one back.

Playback is miniaudio's (the decoder llama.cpp's mtmd embeds): it decodes and plays on its
own audio thread, so the GUI thread only starts and stops it. A machine with no sound output
gets a message, never a crash. GUI thread only (the player's device runs its own thread).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from engine.errors import EbbError
from engine.media.audio import clip_info, fmt_seconds


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
    clip or a sound output that cannot play."""

    def __init__(self, on_problem: Callable[[str], None]) -> None:
        self.on_problem = on_problem
        self.device: Any = None
        self.playing: Path | None = None

    def toggle(self, path: Path) -> None:
        """Play `path`, or stop it when it is the one playing."""
        was = self.playing
        self.stop()
        if was != Path(path):
            self.play(Path(path))

    def play(self, path: Path) -> None:
        import miniaudio

        try:
            clip_info(path)
            stream = miniaudio.stream_file(str(path))
            device = miniaudio.PlaybackDevice()
            device.start(stream)
        except EbbError as exc:
            self.on_problem(f"Cannot play {path.name}: {exc.what}")
            return
        except (miniaudio.MiniaudioError, OSError) as exc:
            self.on_problem(f"Cannot play {path.name}: no sound output here ({exc})")
            return
        self.device, self.playing = device, path

    def stop(self) -> None:
        if self.device is not None:
            try:
                self.device.close()
            except Exception:  # noqa: BLE001 - a device that is already gone
                pass
        self.device, self.playing = None, None
