"""Sound clips a message carries: which files are clips, and what their headers say.

A clip is told from a picture by its first bytes. WAV, MP3 and FLAC (what llama.cpp's mtmd
helper decodes) have their length, rate and channels read by miniaudio (the decoder mtmd
embeds), and the engine decodes their samples through mtmd itself
(ProjectorRuntime.decode_audio), as llama.cpp's own tools do. Phone voice notes and browser
recordings (Ogg/Opus, M4A/AAC, WebM, AIFF, AMR, WMA) are read and decoded by PyAV
(engine/media/avfile.py) to the same float32 mono samples. Either way a clip that is empty,
damaged or too long is refused by name before any sample is decoded. Any thread; no llama.cpp.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.errors import EbbError
from engine.media.files import checked_file
from engine.media.images import MAX_IMAGE_FILE_BYTES

AUDIO_SUFFIXES = (".wav", ".mp3", ".flac")  # what mtmd's helper decodes
# sound in containers mtmd does not read: decoded by PyAV (engine/media/avfile.py)
OTHER_SOUND_SUFFIXES = (".ogg", ".oga", ".opus", ".m4a", ".aac", ".wma", ".aiff", ".aif", ".amr", ".webm")
MTMD_FORMATS = ("WAV", "MP3", "FLAC")  # sniff's kinds that mtmd decodes
AV_SOUND_KINDS = ("Ogg", "M4A", "AAC", "AIFF", "AMR")  # sniff's kinds that hold sound alone
# sniff's kinds that may hold sound or pictures (a video): a clip when its name says sound
AV_CONTAINER_KINDS = ("MP4", "WebM", "ASF")
SOUND_NAMES = "WAV, MP3, FLAC, Ogg/Opus, M4A/AAC and WebM"
MAX_CLIP_SECONDS = 30 * 60  # longer is refused from the header: 30 minutes of chunks
# the sample rates a clip may have: telephone's 8 kHz to studio's 192 kHz (mtmd resamples any of
# them to the model's 16 kHz); a 1 Hz header would make 5 samples a 5-second clip of nothing
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 8_000, 192_000
# as a picture's: the store and the cache key read an attachment whole (image_digest checks it)
MAX_CLIP_FILE_BYTES = MAX_IMAGE_FILE_BYTES


@dataclass(frozen=True)
class ClipInfo:
    format: str  # "WAV", "MP3", "FLAC" (mtmd decodes them), "Ogg/Opus", "M4A/AAC", ... (PyAV)
    seconds: float
    sample_rate: int
    channels: int

    @property
    def by_mtmd(self) -> bool:
        """mtmd's own helper decodes it (else PyAV)."""
        return self.format in MTMD_FORMATS


_M4A_BRANDS = (b"M4A ", b"M4B ", b"F4A ", b"M4P ")
_ASF = bytes.fromhex("3026b2758e66cf11")


def sniff(head: bytes) -> str | None:
    """The sound format the first 12 bytes of a file say, or None (not one Ebb decodes): one of
    MTMD_FORMATS, AV_SOUND_KINDS or AV_CONTAINER_KINDS."""
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "WAV"
    if head[:4] == b"fLaC":
        return "FLAC"
    if head[:4] == b"OggS":
        return "Ogg"
    if head[4:8] == b"ftyp":
        return "M4A" if head[8:12] in _M4A_BRANDS else "MP4"
    if head[:4] == b"\x1a\x45\xdf\xa3":  # EBML: Matroska and WebM
        return "WebM"
    if head[:4] == b"FORM" and head[8:12] in (b"AIFF", b"AIFC"):
        return "AIFF"
    if head[:5] == b"#!AMR":
        return "AMR"
    if head[:8] == _ASF:
        return "ASF"
    if len(head) > 1 and head[0] == 0xFF and head[1] & 0xF6 == 0xF0:  # ADTS: MPEG's layer bits 0
        return "AAC"
    if head[:3] == b"ID3" or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0):
        return "MP3"
    return None


def fmt_seconds(seconds: float) -> str:
    """0:07, 2:05, 1:02:03."""
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def clip_info(path: Path) -> ClipInfo:
    """A clip's header, checked: an EbbError names the file and what is wrong with it (missing,
    too large, empty, damaged, a format the decoder does not know, too long)."""
    import miniaudio

    path = Path(path)
    checked_file(path, "sound clip", MAX_CLIP_FILE_BYTES, "a clip", "record or choose another clip")
    with open(path, "rb") as f:
        kind = sniff(f.read(12))
    if kind is None and path.suffix.lower() not in OTHER_SOUND_SUFFIXES:
        raise EbbError(f"{path.name} is not a sound format Ebb can decode ({SOUND_NAMES} are)",
                       "convert it to WAV, MP3 or FLAC")
    if kind in MTMD_FORMATS:
        try:
            info = miniaudio.get_file_info(str(path))
        except miniaudio.MiniaudioError as exc:
            raise EbbError(f"{path.name} looks like {kind} but its header is damaged ({exc})",
                           "use another copy of the clip") from None
        clip = ClipInfo(str(kind), info.num_frames / info.sample_rate if info.sample_rate > 0 else 0,
                        int(info.sample_rate), int(info.nchannels))
    else:
        from engine.media import avfile

        track = avfile.probe(path)
        clip = ClipInfo(track.format, track.seconds, track.sample_rate, track.channels)
    if clip.seconds <= 0 or clip.sample_rate <= 0:
        raise EbbError(f"{path.name} has no sound in it (0 samples)", "record or choose another clip")
    if not MIN_SAMPLE_RATE <= clip.sample_rate <= MAX_SAMPLE_RATE:
        raise EbbError(f"{path.name} says it has {clip.sample_rate:,} samples a second; sound "
                       f"clips have {MIN_SAMPLE_RATE:,} to {MAX_SAMPLE_RATE:,} (a header from a "
                       "broken recorder?)", "record or export the clip again")
    if clip.seconds > MAX_CLIP_SECONDS:
        raise EbbError(f"{path.name} is {fmt_seconds(clip.seconds)} long; Ebb takes clips up to "
                       f"{fmt_seconds(MAX_CLIP_SECONDS)}", "cut the part the question is about")
    return clip


def decode_for_projector(path: Path, data: bytes, clip: ClipInfo, rate: int,
                         by_mtmd: Callable[[bytes, str], bytes]) -> bytes:
    """The clip's float32 mono samples at `rate`: WAV, MP3 and FLAC by mtmd's own helper
    (`by_mtmd(data, name)`), the rest by PyAV."""
    if clip.by_mtmd:
        return by_mtmd(data, path.name)
    from engine.media import avfile

    return avfile.samples(path, rate)
