"""What kind of thing a file is, decided in one place and by its content: a picture, a sound
clip, a video, a PDF, or a text file (the window's Attach…, drop and paste, the transcript,
the engine and the endpoint all ask here).

The first bytes decide, and for a container that may hold sound alone or pictures too (MP4,
WebM, Matroska) its header's streams (a browser's .webm voice note is a clip, a screen
recording a video); a name's suffix only where the content cannot (a text file has no magic).
Any thread; reads the first bytes, or a container's or an animated GIF's header.
"""
from __future__ import annotations

from pathlib import Path

from engine.media.audio import AUDIO_SUFFIXES, AV_CONTAINER_KINDS, OTHER_SOUND_SUFFIXES, sniff

PICTURE, CLIP, VIDEO, PDF, TEXT = "picture", "clip", "video", "pdf", "text"

PICTURE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff")
VIDEO_SUFFIXES = (".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".gif")
PDF_SUFFIXES = (".pdf",)
TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".csv", ".tsv", ".json", ".jsonl", ".yaml", ".yml",
                 ".toml", ".ini", ".cfg", ".log", ".xml", ".html", ".htm", ".css", ".py", ".js",
                 ".ts", ".tsx", ".jsx", ".java", ".kt", ".c", ".h", ".cc", ".cpp", ".hpp", ".cs",
                 ".go", ".rs", ".rb", ".php", ".swift", ".sh", ".bash", ".zsh", ".ps1", ".sql",
                 ".r", ".m", ".lua", ".pl", ".tex", ".rst", ".diff", ".patch")
SOUND_SUFFIXES = AUDIO_SUFFIXES + OTHER_SOUND_SUFFIXES

_AVI = (b"RIFF", b"AVI ")


def kind_of(path: Path) -> str | None:
    """PICTURE, CLIP, VIDEO, PDF or TEXT, or None (nothing Ebb reads; a missing file is
    judged by its name)."""
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        with open(path, "rb") as f:
            sample = f.read(4096)  # once: the magic bytes and, for a text mark, what follows
    except OSError:
        return _by_name(suffix)
    head = sample[:16]
    if head[:5] == b"%PDF-":
        return PDF
    if head[:4] == _AVI[0] and head[8:12] == _AVI[1]:
        return VIDEO
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return VIDEO if _animated_gif(path) else PICTURE
    if _bom_text(sample):  # text first: UTF-16's byte-order mark is also MP3's frame sync
        return TEXT
    sound = sniff(head[:12])
    if sound in AV_CONTAINER_KINDS:  # MP4/MOV, WebM/Matroska, ASF: sound alone, or a video
        return VIDEO if _has_pictures(path) else CLIP
    if sound is not None and not _looks_like_picture(head):
        return CLIP
    if _looks_like_picture(head):
        return PICTURE
    if suffix in TEXT_SUFFIXES or (suffix == "" and _looks_like_text(path)):
        return TEXT
    return _by_name(suffix)


def is_clip(path: Path) -> bool:
    """The file is a sound clip (an MP4 or WebM with sound alone is one, by its streams)."""
    return kind_of(path) == CLIP


def kind_of_bytes(data: bytes) -> str | None:
    """The kind of a file sent as bytes (the endpoint's parts), by its first bytes alone: a
    container that may hold sound or pictures counts as a video here (its part said which)."""
    head = data[:16]
    if head[:5] == b"%PDF-":
        return PDF
    if (head[:4] == _AVI[0] and head[8:12] == _AVI[1]) or head[:6] in (b"GIF87a", b"GIF89a"):
        return VIDEO
    if _bom_text(data[:4096]):
        return TEXT
    sound = sniff(head[:12])
    if sound in AV_CONTAINER_KINDS:
        return VIDEO
    if _looks_like_picture(head):
        return PICTURE
    return CLIP if sound is not None else None


def _by_name(suffix: str) -> str | None:
    for kind, suffixes in ((PDF, PDF_SUFFIXES), (VIDEO, VIDEO_SUFFIXES), (CLIP, SOUND_SUFFIXES),
                           (PICTURE, PICTURE_SUFFIXES), (TEXT, TEXT_SUFFIXES)):
        if suffix in suffixes:
            return kind
    return None


def _has_pictures(path: Path) -> bool:
    """The container has a video stream (not only a cover picture): its header says (PyAV)."""
    try:
        import av

        with av.open(str(path), "r") as c:
            return any(not s.disposition & av.stream.Disposition.attached_pic for s in c.streams.video)
    except Exception:  # noqa: BLE001 - damaged: the name decides, and the loader says what is wrong
        return Path(path).suffix.lower() not in SOUND_SUFFIXES


def _looks_like_picture(head: bytes) -> bool:
    return (head[:8] == b"\x89PNG\r\n\x1a\n" or head[:3] == b"\xff\xd8\xff" or head[:2] == b"BM"
            or (head[:4] == b"RIFF" and head[8:12] == b"WEBP") or head[:4] in (b"II*\x00", b"MM\x00*"))


def _animated_gif(path: Path) -> bool:
    try:
        from PIL import Image

        with Image.open(path) as im:
            return bool(getattr(im, "is_animated", False))
    except Exception:  # noqa: BLE001 - a damaged GIF is a picture the loader refuses by name
        return False


def _sample(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(4096)
    except OSError:
        return b""


def _looks_like_text(path: Path) -> bool:
    sample = _sample(path)
    return bool(sample) and b"\x00" not in sample


_BOMS = ((b"\xef\xbb\xbf", "utf-8"), (b"\xff\xfe", "utf-16-le"), (b"\xfe\xff", "utf-16-be"))


def _bom_text(sample: bytes) -> bool:
    """The bytes start with a text byte-order mark and go on as text in that encoding (mostly
    printable characters): a UTF-16 or UTF-8 text file, whatever its name."""
    for bom, encoding in _BOMS:
        if sample.startswith(bom):
            body = sample[len(bom):]
            if encoding != "utf-8":
                body = body[:len(body) - len(body) % 2]
            text = body.decode(encoding, errors="ignore")  # the sample may end mid-character
            if not text:
                return len(body) < 4  # a mark alone: an empty text file
            shown = sum(c.isprintable() or c in "\t\r\n\f" for c in text)
            return shown >= 0.95 * len(text)
    return False


def attach_filter() -> str:
    """The Attach… dialog's name filters: everything, then each kind."""
    def globs(suffixes: tuple[str, ...]) -> str:
        return " ".join(f"*{s}" for s in dict.fromkeys(suffixes))

    groups = [("Pictures", PICTURE_SUFFIXES), ("Videos", VIDEO_SUFFIXES), ("Sound clips", SOUND_SUFFIXES),
              ("Documents", PDF_SUFFIXES), ("Text and code", TEXT_SUFFIXES)]
    every = globs(tuple(s for _, group in groups for s in group))
    return ";;".join([f"Everything Ebb reads ({every})"] + [f"{n} ({globs(g)})" for n, g in groups])
