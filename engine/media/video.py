"""Videos a message carries (MP4, MOV, MKV, WebM, AVI, animated GIF), read in-process by PyAV
(its wheels carry FFmpeg's libraries: no ffmpeg binary is needed).

A video becomes frames the projector sees as pictures, laid out in the prompt as llama.cpp's
video helper lays them (tools/mtmd/mtmd-helper.cpp, `mtmd_helper_video`): the text "Video:",
then each frame, with a timestamp such as "[0m5.00s]" after the first frame at or past every
5 seconds. Ebb chooses the frames: evenly spaced over the video (or the part asked for), never
more than llama.cpp's default 4 a second, and as many as the context has room for; a frame
that repeats the one before it (a still screen) is left out, and said. Frames larger than the
projector takes are scaled down to its input size first (mtmd hands them over whole and the
projector scales them then; a dynamic-resolution projector would spend thousands of tokens on
one full-HD frame).

`probe` reads the header and refuses by name a file with no pictures, a damaged one, a codec
the library lacks, or one longer than MAX_VIDEO_SECONDS. Any thread; no llama.cpp here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import EbbError
from engine.media.avfile import stream_seconds
from engine.media.files import checked_file

MAX_FPS = 4.0  # llama.cpp's default --video-fps
TIMESTAMP_EVERY_S = 5.0  # llama.cpp's default --video-timestamp-interval (5000 ms)
MAX_VIDEO_SECONDS = 3 * 3600  # longer is refused from the header: choose a part
MAX_FRAMES = 64  # frames one video gives a message, whatever the context's room
REPEAT_DIFF = 2.0  # mean |difference| (0-255) of 32x32 colour thumbnails under which a frame repeats
SEEK_GAP_S = 2.0  # frames further apart than this are reached by seeking, not decoding through
PROMPT_START = "Video:"


@dataclass(frozen=True)
class VideoInfo:
    seconds: float
    fps: float
    width: int
    height: int
    codec: str
    format: str  # the container, as the chip says it: "MP4", "WebM", "GIF", ...
    has_sound: bool
    rotation: int = 0  # degrees counter-clockwise the frames are turned to be shown (a phone's)


@dataclass(frozen=True)
class Sampling:
    """Frames at start, start + every_s, ... before end (seconds into the video)."""
    every_s: float
    start: float
    end: float

    def times(self) -> list[float]:
        n = max(1, math.ceil((self.end - self.start) / self.every_s - 1e-9))
        return [round(self.start + i * self.every_s, 3) for i in range(n)]


_CONTAINERS = {"mov,mp4,m4a,3gp,3g2,mj2": "MP4", "matroska,webm": "WebM", "avi": "AVI",
               "gif": "GIF", "asf": "ASF"}


def _errors() -> tuple[type[BaseException], ...]:
    import av

    return (av.error.FFmpegError, OSError, ValueError, StopIteration, IndexError)


def _why(exc: BaseException) -> str:
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return str(text).split(": '")[0]


def probe(path: Path) -> VideoInfo:
    """The header of `path`'s first video stream, checked; an EbbError names what is wrong."""
    import av

    path = Path(path)
    name = path.name
    checked_file(path, "video", 0, "")
    try:
        with av.open(str(path), "r") as c:
            streams = [s for s in c.streams.video
                       if not s.disposition & av.stream.Disposition.attached_pic]
            if not streams:
                raise EbbError(f"{name} has no pictures in it" + (" (only sound: attach it as a "
                               "clip to a model that hears)" if c.streams.audio else ""),
                               "choose a video")
            vs = streams[0]
            ctx = vs.codec_context
            if ctx is None or not ctx.name:
                raise EbbError(f"{name}'s pictures are in a codec Ebb's decoder lacks",
                               "convert it to MP4 (H.264) or WebM")
            seconds = stream_seconds(c, vs)
            fps = float(vs.average_rate or vs.guessed_rate or 0)
            kind = _CONTAINERS.get(c.format.name, c.format.name.split(",")[0].upper())
            width, height = int(ctx.width or 0), int(ctx.height or 0)
            turn = _first_rotation(c, vs)
            if turn in (90, 270):  # a phone's portrait video: stored landscape, shown upright
                width, height = height, width
            info = VideoInfo(seconds, fps, width, height, ctx.name, kind, bool(c.streams.audio), turn)
    except EbbError:
        raise
    except _errors() as exc:
        raise EbbError(f"{name} could not be read as a video: it is damaged, or not a video "
                       f"({_why(exc)})", "use another copy of the video") from None
    if info.width <= 0 or info.height <= 0:
        raise EbbError(f"{name} says its pictures are {info.width}x{info.height}",
                       "use another copy of the video")
    if info.seconds > MAX_VIDEO_SECONDS:
        raise EbbError(f"{name} is {fmt_seconds(info.seconds)} long; Ebb takes videos up to "
                       f"{fmt_seconds(MAX_VIDEO_SECONDS)}", "cut the part the question is about")
    return info


def _rotation(frame: Any) -> int:
    """The turn a frame's display matrix asks for (0, 90, 180 or 270 counter-clockwise): how a
    phone that was held upright stores its landscape pictures."""
    try:
        degrees = float(getattr(frame, "rotation", 0) or 0)
    except (TypeError, ValueError):
        return 0
    return int(round(degrees / 90.0)) % 4 * 90


def _first_rotation(container: Any, stream: Any) -> int:
    """The first frame's turn (the header of an MP4 carries it as the frames' side data)."""
    try:
        frame = next(container.decode(stream), None)
    except _errors():
        return 0
    return _rotation(frame) if frame is not None else 0


def upright(frame: Any) -> Any:
    """A decoded frame as an RGB PIL image, turned the way it is meant to be shown."""
    image = frame.to_image().convert("RGB")
    turn = _rotation(frame)
    return image.rotate(turn, expand=True) if turn else image


def fmt_seconds(seconds: float) -> str:
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def plan(info: VideoInfo, tokens_per_frame: int, room_tokens: int, start: float = 0.0,
         end: float | None = None, every_s: float | None = None) -> Sampling:
    """Evenly spaced frames over [start, end) that fit `room_tokens` at `tokens_per_frame`:
    at most MAX_FPS a second and MAX_FRAMES in all; `every_s` asks for a spacing (the user's),
    widened only if it would not fit. An EbbError when not even one frame fits."""
    end = info.seconds if end is None else min(end, info.seconds)
    start = max(0.0, min(start, max(0.0, end - 1e-3)))
    span = max(end - start, 1e-3)
    fit = room_tokens // max(tokens_per_frame, 1)
    if fit < 1:
        raise EbbError(f"one frame of this video takes {tokens_per_frame:,} tokens and the context "
                       f"has room for {max(room_tokens, 0):,}",
                       "start a new chat, or raise the context size in Settings")
    most = max(1, min(fit, MAX_FRAMES, int(span * MAX_FPS) or 1))
    spacing = max(span / most, 1.0 / MAX_FPS)
    if every_s is not None and every_s > 0:
        spacing = max(spacing, every_s)
    # to the millisecond, upwards: never one frame more than fits
    return Sampling(math.ceil(spacing * 1000 - 1e-6) / 1000, round(start, 3), round(end, 3))


def frame_size(info: VideoInfo, max_side: int) -> tuple[int, int]:
    """The size frames are handed to the projector at: the video's, scaled to fit `max_side`."""
    w, h = info.width, info.height
    if max_side <= 0 or max(w, h) <= max_side:
        return w, h
    scale = max_side / max(w, h)
    return max(1, round(w * scale)), max(1, round(h * scale))


def decode(path: Path, times: list[float], size: tuple[int, int]) -> list[tuple[float, Any]]:
    """The frame on screen at each of `times` (sorted), as RGB PIL images of `size`: decoded in
    order, seeking ahead past long gaps. A video that breaks off gives the frames before."""
    import av

    path = Path(path)
    out: list[tuple[float, Any]] = []
    try:
        with av.open(str(path), "r") as c:
            vs = next(s for s in c.streams.video if not s.disposition & av.stream.Disposition.attached_pic)
            vs.thread_type = "AUTO"
            tb = vs.time_base
            it: Any = None
            pending: Any = None  # decoded, and later than the target asked for so far
            shown: Any = None  # the last frame that started at or before the target
            last_t = 0.0
            for t in times:
                if it is None or t - last_t > SEEK_GAP_S:
                    if t > SEEK_GAP_S:
                        c.seek(int(t / tb), stream=vs, backward=True, any_frame=False)
                    it, pending, shown = c.decode(vs), None, None
                last_t = t
                while True:
                    if pending is None:
                        pending = next(it, None)
                        if pending is None:
                            break  # the end: the last frame stays on screen
                    if _time(pending, tb) <= t + 1e-3:
                        shown, pending = pending, None
                    else:
                        break
                pick = shown if shown is not None else pending  # before the first: the first
                if pick is None:
                    break
                image = upright(pick)
                out.append((t, image if image.size == size else image.resize(size)))
    except StopIteration:
        raise EbbError(f"{path.name} has no pictures in it", "choose a video") from None
    except _errors() as exc:
        if not out:
            raise EbbError(f"{path.name} could not be decoded: it is damaged ({_why(exc)})",
                           "use another copy of the video") from None
    if not out:
        raise EbbError(f"{path.name} has no frame to show", "use another copy of the video")
    return out


def _time(frame: Any, tb: Any) -> float:
    if frame.pts is not None and tb is not None:
        return float(frame.pts * tb)
    return float(frame.time or 0.0)


def drop_repeats(frames: list[tuple[float, Any]]) -> tuple[list[tuple[float, Any]], int]:
    """The frames without those that repeat the one kept before them (a still screen), compared
    in colour: red and green of one brightness are two scenes."""
    import numpy as np

    kept: list[tuple[float, Any]] = []
    last = None
    for t, im in frames:
        thumb = np.asarray(im.convert("RGB").resize((32, 32)), dtype=np.float32)
        if last is not None and float(np.abs(thumb - last).mean()) < REPEAT_DIFF:
            continue
        kept.append((t, im))
        last = thumb
    return kept, len(frames) - len(kept)


def layout(times: list[float]) -> list[tuple[str, str]]:
    """(text before, text after) each frame, as llama.cpp's video helper lays them out:
    "Video:" before the first, and after the first frame at or past each TIMESTAMP_EVERY_S
    its time, "[XmY.YYs]"."""
    out: list[tuple[str, str]] = []
    next_stamp = 0.0
    for i, t in enumerate(times):
        after = ""
        if t >= next_stamp - 1e-6:
            minutes = int(t // 60)
            after = f"[{minutes}m{t - minutes * 60:.2f}s]"
            next_stamp += TIMESTAMP_EVERY_S  # once, as the helper does: sparse frames all get one
        out.append((PROMPT_START if i == 0 else "", after))
    return out


def spacing_words(every_s: float) -> str:
    """"one every 4 s", "3.8 a second" (never "3.84615 a second")."""
    return f"one every {every_s:.3g} s" if every_s >= 1 else f"{1 / every_s:.2g} a second"


def describe(info: VideoInfo, sampling: Sampling, n_frames: int, n_tokens: int,
             n_repeats: int = 0) -> str:
    """"2:10 · 32 frames, one every 4 s · 2,048 tokens" (the attachment's line)."""
    spacing = spacing_words(sampling.every_s)
    part = ("" if sampling.start <= 0 and sampling.end >= info.seconds - 1e-3 else
            f" of {fmt_seconds(sampling.start)}-{fmt_seconds(sampling.end)}")
    repeats = f", {n_repeats} repeat{'s' if n_repeats != 1 else ''} left out" if n_repeats else ""
    return (f"{fmt_seconds(info.seconds)} · {n_frames} frame{'s' if n_frames != 1 else ''}{part}, "
            f"{spacing}{repeats} · {n_tokens:,} tokens")
