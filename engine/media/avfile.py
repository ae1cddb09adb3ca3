"""Sound in the files mtmd's decoder does not know (Ogg/Opus and Vorbis, M4A/AAC, WebM,
AIFF, AMR, WMA), read through PyAV: its wheels carry FFmpeg's libraries, so users need no
ffmpeg binary. What mtmd decodes (WAV, MP3, FLAC) stays with mtmd, as llama.cpp's tools do.

`probe` reads a file's header (its sound track, length, rate, channels) and refuses by name a
file with no sound track, a damaged one or one whose codec the library lacks; `samples`
decodes the track as float32 mono at the projector's rate (what mtmd's helper hands the
projector); `pcm_chunks` decodes it for playback, a piece at a time. Any thread; no llama.cpp.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from engine.errors import EbbError

# sniffed container → the name a chip shows
CONTAINERS = {"ogg": "Ogg", "mov,mp4,m4a,3gp,3g2,mj2": "M4A", "matroska,webm": "WebM",
              "aac": "AAC", "aiff": "AIFF", "amr": "AMR", "asf": "WMA"}
CODECS = {"opus": "Opus", "vorbis": "Vorbis", "aac": "AAC", "mp3": "MP3", "flac": "FLAC",
          "amrnb": "AMR", "amrwb": "AMR-WB", "wmav2": "WMA", "wmav1": "WMA", "alac": "ALAC"}


@dataclass(frozen=True)
class Track:
    format: str  # "Ogg/Opus", "M4A/AAC", "WebM/Opus"
    seconds: float
    sample_rate: int
    channels: int


def _errors() -> tuple[type[BaseException], ...]:
    import av

    return (av.error.FFmpegError, OSError, ValueError, StopIteration)


def _sound_track(container: Any, name: str) -> Any:
    tracks = list(container.streams.audio)
    if not tracks:
        raise EbbError(f"{name} has no sound track", "choose a clip with sound in it")
    return tracks[0]


def probe(path: Path) -> Track:
    """The header of `path`'s first sound track; an EbbError names what is wrong."""
    import av

    name = Path(path).name
    try:
        with av.open(str(path), "r") as c:
            track = _sound_track(c, name)
            ctx = track.codec_context
            codec = ctx.name if ctx is not None else ""
            if not codec:
                raise EbbError(f"{name}'s sound is in a codec Ebb's decoder lacks",
                               "convert it to WAV, MP3 or FLAC")
            seconds = stream_seconds(c, track)
            kind = CONTAINERS.get(c.format.name, c.format.name)
            label = CODECS.get(codec, codec.upper())
            return Track(kind if label == kind else f"{kind}/{label}", seconds,
                         int(ctx.sample_rate or 0), int(ctx.channels or 0))
    except EbbError:
        raise
    except _errors() as exc:
        raise EbbError(f"{name} could not be read as sound: it is damaged, or not a sound file "
                       f"({_why(exc)})", "use another copy of the clip") from None


def stream_seconds(container: Any, stream: Any) -> float:
    """A stream's length: its header's, the container's, or where neither says (a browser's
    MediaRecorder WebM, a live recording) its packets' times, read without decoding any."""
    import av

    seconds = 0.0
    if stream.duration is not None and stream.time_base is not None:
        seconds = float(stream.duration * stream.time_base)
    elif container.duration is not None:
        seconds = float(container.duration / av.time_base)
    if seconds > 0:
        return seconds
    end = 0
    for packet in container.demux(stream):
        if packet.pts is not None:
            end = max(end, packet.pts + (packet.duration or 0))
    return float(end * stream.time_base) if stream.time_base is not None else 0.0


def _why(exc: BaseException) -> str:
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return str(text).split(": '")[0]  # FFmpeg's errors end with the file's path


def _decoded(path: Path, fmt: str, layout: str, rate: int) -> Iterator[bytes]:
    """The first sound track of `path` as raw PCM pieces; an EbbError when it breaks off."""
    import av

    name = Path(path).name
    try:
        with av.open(str(path), "r") as c:
            track = _sound_track(c, name)
            resampler = av.AudioResampler(format=fmt, layout=layout, rate=rate)
            for frame in c.decode(track):
                for out in resampler.resample(frame):
                    yield bytes(out.planes[0])[: out.samples * out.format.bytes * out.layout.nb_channels]
            for out in resampler.resample(None):
                yield bytes(out.planes[0])[: out.samples * out.format.bytes * out.layout.nb_channels]
    except EbbError:
        raise
    except _errors() as exc:
        raise EbbError(f"{name} could not be decoded as sound: it is damaged ({_why(exc)})",
                       "use another copy of the clip") from None


def samples(path: Path, rate: int) -> bytes:
    """The sound track as float32 mono samples at `rate`: what mtmd's helper makes of a WAV."""
    return b"".join(_decoded(path, "flt", "mono", rate))


def pcm_chunks(path: Path, rate: int, channels: int) -> Iterator[bytes]:
    """The sound track as 16-bit PCM pieces at `rate` with `channels`, decoded as they are
    asked for (playback)."""
    return _decoded(path, "s16", "stereo" if channels == 2 else "mono", rate)


def sound_decoder() -> str:
    """PyAV's version and its FFmpeg's (About), or why it cannot load."""
    try:
        import av

        codec = av.library_versions.get("libavcodec", ())
        return f"PyAV {av.__version__} (libavcodec {'.'.join(map(str, codec))})"
    except ImportError as exc:
        return f"missing: {exc}"
