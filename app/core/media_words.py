"""What an attached video, PDF or text file is called in the window (its chip in the composer,
its line in the transcript), why one cannot be attached, and what it will cost the context
before Send. Qt-free; a header's look at most (nothing is decoded).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import EbbError
from engine.media import attachments, documents, kinds, video
from engine.units import fmt_bytes

# glyphs every desktop font has (an emoji's is missing from many: a box shows instead)
ICONS = {kinds.VIDEO: "▣", kinds.PDF: "▤", kinds.TEXT: "≡"}
TEXT_BYTES_PER_TOKEN = 4  # a text's tokens before Send, roughly (the engine counts exactly)


@dataclass(frozen=True)
class Look:
    words: str  # "▣ walk.mp4 · 2:10 · MP4 · up to 32 frames, one every 4 s · ≈2,048 tokens"
    problem: str | None  # why it cannot be attached, or None
    tokens: int = 0  # what it will take of the context, about (0: unknown)
    pages: int = 0  # a PDF's pages
    locked: bool = False  # an encrypted PDF: its password opens it


def look(ref: str | Path, shown_name: str = "", picture_tokens: int = 0,
         room_tokens: int = 0, cost: bool = True) -> Look:
    """A video's, a PDF's or a text file's words. `picture_tokens`: what a frame or a page
    takes with the loaded projector (0: it does not see); `room_tokens`: what the context has
    free (a video's frames are chosen to fit it); `cost`: False for a sent one (the transcript:
    what it is and what was taken, nothing read past the header)."""
    path = attachments.split(ref)[0]
    r = attachments.parse(ref)
    kind = kinds.kind_of(path)
    name = shown_name or path.name
    icon = ICONS.get(kind or "", "•")
    try:
        if kind == kinds.VIDEO:
            info = video.probe(path)
            head = f"{icon} {name} · {video.fmt_seconds(info.seconds)} · {info.format}"
            if r.frames or not cost:
                taken = f" · {len(r.frames)} frame{'s' if len(r.frames) != 1 else ''}" if r.frames else ""
                return Look(f"{head}{taken}", None, len(r.frames) * picture_tokens)
            if not picture_tokens:  # no model yet (it loads), or one that does not see: Send says
                return Look(head, None)
            s = video.plan(info, picture_tokens, max(room_tokens, picture_tokens), r.start, r.end, r.every_s)
            n = len(s.times())
            spacing = video.spacing_words(s.every_s)
            part = ("" if s.start <= 0 and s.end >= info.seconds - 1e-3 else
                    f" of {video.fmt_seconds(s.start)}-{video.fmt_seconds(s.end)}")
            return Look(f"{head} · up to {n} frames{part}, {spacing} · ≈{n * picture_tokens:,} tokens",
                        None, n * picture_tokens)
        if kind == kinds.PDF:
            info_pdf = documents.pdf_info(path)
            first, last = documents.parse_pages(r.pages, info_pdf.pages)
            n = last - first + 1
            pages = f" · pages {first}-{last}" if (first, last) != (1, info_pdf.pages) else ""
            head = f"{icon} {name} · {info_pdf.pages:,} page{'s' if info_pdf.pages != 1 else ''}{pages}"
            if not cost:
                return Look(head + (" · as text" if r.as_text else ""), None, pages=info_pdf.pages)
            if n > documents.MAX_PAGES:
                return Look(head, f"it has {info_pdf.pages:,} pages; Ebb takes up to "
                            f"{documents.MAX_PAGES} at a time: choose a range", pages=info_pdf.pages)
            if not room_tokens:  # no model yet: pictures or text is its projector's to say
                return Look(f"{head} · judged once the model is loaded", None, pages=info_pdf.pages)
            if picture_tokens and not r.as_text:
                return Look(f"{head} · as pictures · ≈{n * picture_tokens:,} tokens", None,
                            n * picture_tokens, info_pdf.pages)
            text = documents.pdf_as_text(path, first, last)
            tokens = len(text.encode()) // TEXT_BYTES_PER_TOKEN
            return Look(f"{head} · as text · ≈{tokens:,} tokens", None, tokens, info_pdf.pages)
        if kind == kinds.TEXT:
            if not cost:
                return Look(f"{icon} {name} · {fmt_bytes(path.stat().st_size)} of text", None)
            text = documents.text_file(path)
            tokens = len(text.encode()) // TEXT_BYTES_PER_TOKEN
            return Look(f"{icon} {name} · {fmt_bytes(path.stat().st_size)} of text · ≈{tokens:,} tokens",
                        None, tokens)
    except EbbError as exc:
        why = exc.what.replace(path.name, "it", 1) if exc.what.startswith(path.name) else exc.what
        return Look(f"{icon} {name}", why, locked=isinstance(exc, documents.PasswordNeeded))
    return Look(f"{icon} {name}", "not a file Ebb reads")


def is_document_like(ref: str | Path) -> bool:
    """A video, a PDF or a text file (not a picture or a clip)."""
    return kinds.kind_of(attachments.split(ref)[0]) in ICONS


def _seconds(text: str) -> float:
    """"1:10" → 70, "1:02:03" → 3723, "12.5" → 12.5."""
    total = 0.0
    for part in text.strip().split(":"):
        total = total * 60 + float(part)
    return total


def choose_frames(ref: str | Path, answer: str) -> Path:
    """The reference for what the user asked of a video: "4" (a frame every 4 s), "0:10-1:10"
    (that part), "4, 0:10-1:10" (both), "" (Ebb's choice). EbbError when it reads as none."""
    path = attachments.split(ref)[0]
    every: float | None = None
    start, end = 0.0, None
    try:
        for piece in filter(None, (p.strip() for p in answer.replace(";", ",").split(","))):
            if "-" in piece:
                a, _, b = piece.partition("-")
                start, end = _seconds(a or "0"), (_seconds(b) if b.strip() else None)
            else:
                every = float(piece.removesuffix("s").strip())
    except ValueError:
        raise EbbError(f"{answer!r} is not a choice of frames",
                       "write a spacing in seconds and/or a part: 4, 0:10-1:10") from None
    if every is not None and every <= 0 or end is not None and end <= start:
        raise EbbError(f"{answer!r} is not a choice of frames", "the spacing is over 0 s and a part ends after it starts")
    return Path(str(attachments.Ref(path, every_s=every, start=start, end=end)))


def choose_pages(ref: str | Path, answer: str) -> Path:
    """The reference for "3-5" (those pages), "3-5 text" (their text layer), "" (all)."""
    path = attachments.split(ref)[0]
    words = answer.replace(",", " ").split()
    as_text = "text" in words
    pages = " ".join(w for w in words if w != "text")
    documents.parse_pages(pages, documents.pdf_info(path).pages)  # refused here with the numbers
    return Path(str(attachments.Ref(path, pages=pages.replace(" ", ""), as_text=as_text)))


def preview(ref: str | Path, height: int = 30, n_frames: int = 3) -> Any:
    """A chip's picture (a PIL image), or None: a video's first frames side by side (a strip),
    a PDF's first page chosen."""
    from PIL import Image

    path = attachments.split(ref)[0]
    r = attachments.parse(ref)
    try:
        kind = kinds.kind_of(path)
        if kind == kinds.VIDEO:
            info = video.probe(path)
            w = max(1, round(info.width * height / max(info.height, 1)))
            start = r.frames[0] if r.frames else r.start
            end = min(r.end or info.seconds, info.seconds)
            times = [start + (end - start) * i / n_frames for i in range(n_frames)]
            frames = [im for _, im in video.decode(path, times, (w, height))]
            strip = Image.new("RGB", (w * len(frames) + 2 * (len(frames) - 1), height), (255, 255, 255))
            for i, im in enumerate(frames):
                strip.paste(im, (i * (w + 2), 0))
            return strip
        if kind == kinds.PDF:
            first, _ = documents.parse_pages(r.pages, documents.pdf_info(path).pages)
            [page] = documents.render_pages(path, first, first, height * 2)
            return page.resize((max(1, round(page.width * height / page.height)), height))
    except EbbError:
        return None
    return None
