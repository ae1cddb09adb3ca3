"""Files users bring, written by the tests themselves with PyAV (its wheels carry FFmpeg's
encoders): phone voice notes and browser recordings."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np

# container (PyAV's format name), codec, the rate the codec takes
SOUND_FORMATS = {".ogg": ("ogg", "libopus", 48000),
                 ".m4a": ("ipod", "aac", 44100), ".webm": ("webm", "libopus", 48000),
                 ".mp4": ("mp4", "aac", 44100)}  # an MP4 with sound alone (brand isom, as a video's)


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


# container suffix → PyAV's codec for its pictures
VIDEO_CODECS = {".mp4": "libx264", ".mov": "mpeg4", ".mkv": "libvpx-vp9", ".webm": "libvpx",
                ".avi": "mjpeg", ".gif": "gif"}


def write_video(path: Path, scenes: list[tuple[tuple[int, int, int], float]], fps: int = 10,
                size: tuple[int, int] = (96, 64), sound_hz: float = 0.0, rotation: int = 0,
                left: tuple[int, int, int] | None = None) -> Path:
    """A video of flat colours: each (rgb, seconds) scene in turn, in the container and codec
    `path`'s suffix names (VIDEO_CODECS); `sound_hz`: with a tone as its sound track;
    `rotation`: the display matrix a phone writes (degrees counter-clockwise to show it);
    `left`: the left half of every frame in this colour (which way up it is shown)."""
    import av

    suffix = Path(path).suffix
    codec = VIDEO_CODECS[suffix]
    w, h = size
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height = w, h
        stream.pix_fmt = "rgb8" if codec == "gif" else ("yuvj420p" if codec == "mjpeg" else "yuv420p")
        if rotation:
            stream.set_display_rotation(rotation)
        audio = None
        if sound_hz:
            audio = out.add_stream("aac" if suffix in (".mp4", ".mov") else "libopus", rate=48000)
            audio.layout = "mono"
        n = 0
        for rgb, seconds in scenes:
            for _ in range(int(round(seconds * fps))):
                pixels = np.full((h, w, 3), rgb, np.uint8)
                if left is not None:
                    pixels[:, : w // 2] = left
                frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
                frame.pts = n
                n += 1
                for packet in stream.encode(frame):
                    out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
        if audio is not None:
            total = n / fps
            t = np.arange(int(total * 48000)) / 48000
            pcm = (0.3 * np.sin(2 * np.pi * sound_hz * t) * 32767).astype("<i2")
            for i in range(0, len(pcm), 960):
                af = av.AudioFrame.from_ndarray(pcm[None, i:i + 960], format="s16", layout="mono")
                af.sample_rate = 48000
                for packet in audio.encode(af):
                    out.mux(packet)
            for packet in audio.encode(None):
                out.mux(packet)
    return Path(path)


def write_picture_pdf(path: Path, colours: list[tuple[int, int, int]], size: tuple[int, int] = (400, 300)) -> Path:
    """A PDF of pictures alone, a page each (as a scanner writes it: no text layer)."""
    from PIL import Image

    pages = [Image.new("RGB", size, rgb) for rgb in colours]
    pages[0].save(path, save_all=True, append_images=pages[1:], resolution=72.0)
    return Path(path)


def write_text_pdf(path: Path, pages: list[str]) -> Path:
    """A PDF with a text layer: each string a page, set in Helvetica (written by hand: the
    objects, then the cross-reference table that points at them)."""
    objects: list[bytes] = [b"<< /Type /Catalog /Pages 2 0 R >>", b"", b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    kids = []
    for text in pages:
        lines = [line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)") for line in text.splitlines()]
        ops = "BT /F1 14 Tf 72 720 Td 18 TL " + " ".join(f"({line}) Tj T*" for line in lines) + " ET"
        stream = ops.encode("latin-1")
        objects.append(b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream")
        content = len(objects)
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents %d 0 R "
                       b"/Resources << /Font << /F1 3 0 R >> >> >>" % content)
        kids.append(len(objects))
    objects[1] = b"<< /Type /Pages /Kids [%s] /Count %d >>" % (
        b" ".join(b"%d 0 R" % k for k in kids), len(kids))
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    Path(path).write_bytes(bytes(out))
    return Path(path)


def encrypt_pdf(src: Path, dst: Path, password: str) -> Path:
    """`src` locked with a user password (AES-256), as a bank statement comes."""
    import pikepdf

    with pikepdf.open(src) as pdf:
        pdf.save(dst, encryption=pikepdf.Encryption(user=password, owner=password + "-owner", R=6))
    return Path(dst)
