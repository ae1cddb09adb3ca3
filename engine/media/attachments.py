"""An attachment as a message carries it: a file and what was taken from it, and what it
becomes in the prompt.

A reference is the file's path with what to take after a `#`, as in a URL's fragment:
    clip.mp4#every=4&from=10&to=70     frames every 4 s between 0:10 and 1:10
    clip.mp4#frames=0,4,8.5            exactly these frames (what a sent message keeps)
    report.pdf#pages=3-5               those pages (as pictures to a model that sees)
    report.pdf#pages=3-5&as=text       their text layer, whatever the model
A path without a fragment takes the defaults (frames chosen to fit, every page up to MAX_PAGES).
A sent message keeps the resolved reference (`Expanded.ref`: the frames and pages that went
in), so a chat reopened later puts back exactly what the model saw, each frame and page cached
by the file's content and its place in it.

`expand` turns one reference into pictures (with the text llama.cpp's video helper puts between
frames) and text (a document's, a text file's); pictures and clips go through as they are.
Engine thread (it decodes; the projector counts tokens).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable
from urllib.parse import parse_qsl, urlencode

from engine.errors import EbbError
from engine.media import documents, kinds, video
from engine.media.images import LoadedMedia, to_rgb

if TYPE_CHECKING:
    from PIL import Image

KEYS = {"every", "from", "to", "frames", "pages", "as"}
DEFAULT_SIDE = 896  # frames and pages for a projector whose input size is unknown
PICTURE_LABEL = ("", "\n")  # a picture's marker: nothing before, a new line after


@dataclass(frozen=True)
class Ref:
    path: Path
    every_s: float | None = None
    start: float = 0.0
    end: float | None = None
    frames: tuple[float, ...] = ()
    pages: str = ""
    as_text: bool = False

    def __str__(self) -> str:
        q: dict[str, str] = {}
        if self.frames:
            q["frames"] = ",".join(f"{t:g}" for t in self.frames)
        else:
            if self.every_s:
                q["every"] = f"{self.every_s:g}"
            if self.start:
                q["from"] = f"{self.start:g}"
            if self.end is not None:
                q["to"] = f"{self.end:g}"
        if self.pages:
            q["pages"] = self.pages
        if self.as_text:
            q["as"] = "text"
        return f"{self.path}#{urlencode(q, safe=',-')}" if q else str(self.path)


def names_a_file(text: str) -> bool:
    """Whether `text` as a whole is the path of an existing file or folder. A reference is not
    a path: one with 64 frames is longer than a file's name may be (the system then raises
    "File name too long"), and so is never one."""
    try:
        return Path(text).exists()
    except (OSError, ValueError):
        return False


def parse(ref: str | Path) -> Ref:
    """A reference (see the module's words); a `#` that is part of a file's name stays one."""
    text = str(ref)
    base, sep, frag = text.rpartition("#")
    if not sep or not frag or names_a_file(text):
        return Ref(Path(text))
    pairs = parse_qsl(frag, keep_blank_values=True)
    if not pairs or any(k not in KEYS for k, _ in pairs):
        return Ref(Path(text))
    q = dict(pairs)
    try:
        return Ref(Path(base), every_s=float(q["every"]) if q.get("every") else None,
                   start=float(q.get("from") or 0), end=float(q["to"]) if q.get("to") else None,
                   frames=tuple(float(t) for t in q["frames"].split(",") if t) if q.get("frames") else (),
                   pages=q.get("pages", ""), as_text=q.get("as") == "text")
    except ValueError:
        raise EbbError(f"{Path(base).name}: {frag!r} is not a frame or page choice",
                       "write it as every=4&from=10&to=70, frames=0,4,8 or pages=3-5") from None


def split(ref: str | Path) -> tuple[Path, str]:
    """(the file, what was taken from it: the fragment, "" for all of it)."""
    r = parse(ref)
    text = str(r)
    return r.path, text.partition("#")[2] if text != str(r.path) else ""


@dataclass
class Expanded:
    """What one attachment puts in the prompt."""
    media: list[LoadedMedia] = field(default_factory=list)
    labels: list[tuple[str, str]] = field(default_factory=list)  # (before, after) each medium
    text: str = ""  # a document's or a text file's text, before the message's own
    ref: str = ""  # the resolved reference, as a sent message keeps it
    line: str = ""  # "2:10 · 32 frames, one every 4 s · 2,048 tokens"
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Projector:
    """What expansion needs of the loaded projector."""
    sees: bool
    side: int  # the size frames and pages are made at (its input size)
    tokens_of: Callable[[int, int], int]  # image tokens of a w x h picture
    hears: bool = False  # an omni projector: a video's sound goes with its frames
    sample_rate: int = 0


def frame_key(file_sha: str, what: str, size: tuple[int, int]) -> str:
    """A frame's or a page's content key: the file's bytes, its place in it, the size it was
    made at (a frame's; a page's longer side, twice)."""
    return hashlib.sha256(f"{file_sha}#{what}@{size[0]}x{size[1]}".encode()).hexdigest()


def _media(image: Image.Image, ref: str, key: str) -> LoadedMedia:
    rgb = to_rgb(image)
    return LoadedMedia(ref, key, rgb.width, rgb.height, rgb.tobytes())


def expand(ref: str | Path, proj: Projector | None, room_tokens: int,
           load_single: Callable[[Path], LoadedMedia]) -> Expanded:
    """One attachment's pictures, labels and text. `room_tokens`: what the context has room
    for (a video's frames are chosen to fit it); `load_single`: a picture or a clip as today."""
    r = parse(ref)
    kind = kinds.kind_of(r.path)
    if kind == kinds.VIDEO:
        return _video(r, proj, room_tokens)
    if kind == kinds.PDF:
        return _pdf(r, proj)
    if kind == kinds.TEXT:
        return Expanded(text=documents.text_file(r.path), ref=str(r.path), line="text")
    one = load_single(r.path)
    return Expanded([one], [PICTURE_LABEL], ref=str(r.path))


def _need_eyes(r: Ref, proj: Projector | None, what: str) -> Projector:
    if proj is None or not proj.sees:
        raise EbbError(f"{r.path.name} is a {what}, and " + ("the loaded projector does not see"
                       if proj is not None else "no projector is loaded"),
                       "load a model with a vision projector, or remove it")
    return proj


def _video(r: Ref, proj: Projector | None, room_tokens: int) -> Expanded:
    p = _need_eyes(r, proj, "video")
    info = video.probe(r.path)
    size = video.frame_size(info, p.side)
    per_frame = p.tokens_of(*size)
    notes = []
    if r.frames:
        times = sorted(t for t in r.frames if 0 <= t <= info.seconds + 1e-3)
        sampling = video.Sampling(times[1] - times[0] if len(times) > 1 else info.seconds or 1.0,
                                  times[0] if times else 0.0, info.seconds)
    else:
        sampling = video.plan(info, per_frame, room_tokens, r.start, r.end, r.every_s)
        times = sampling.times()
    if r.every_s and sampling.every_s > r.every_s + 1e-3:
        notes.append(f"{r.path.name}: one frame every {r.every_s:g} s would not fit the context; "
                     f"one every {sampling.every_s:g} s does")
    frames = video.decode(r.path, times, size)
    dropped = 0
    if not r.frames:
        frames, dropped = video.drop_repeats(frames)
        if dropped:
            notes.append(f"{r.path.name}: {dropped} frame{'s' if dropped != 1 else ''} that "
                         "repeated the one before left out")
    sha = documents.file_digest(r.path)
    kept = [t for t, _ in frames]
    media = [_media(im, f"{r.path}#t={t:g}", frame_key(sha, f"t={t:g}", size)) for t, im in frames]
    line = video.describe(info, sampling, len(media), len(media) * per_frame, dropped)
    labels = video.layout(kept)
    labels[-1] = (labels[-1][0], labels[-1][1] + "\n")
    if info.has_sound and p.hears:  # an omni projector hears the video's sound after its frames
        media.append(_sound(r.path, sha, p.sample_rate))
        labels.append(PICTURE_LABEL)
        line += " · with its sound"
    elif info.has_sound:
        notes.append(f"{r.path.name}: its sound is not sent (this projector does not hear)")
    return Expanded(media, labels, ref=str(replace(r, frames=tuple(kept), every_s=None, start=0.0,
                                                   end=None)),
                    line=line, notes=notes)


def _sound(path: Path, sha: str, rate: int) -> LoadedMedia:
    """A video's sound track as a clip (float32 mono at the projector's rate)."""
    from engine.media import avfile
    from engine.media.audio import MAX_CLIP_SECONDS
    from engine.media.images import CLIP_HEIGHT

    samples = avfile.samples(path, rate)[: MAX_CLIP_SECONDS * rate * 4]
    if len(samples) < 4:
        raise EbbError(f"{path.name}'s sound track is empty", "send it without its sound")
    return LoadedMedia(f"{path}#sound={rate}", frame_key(sha, "sound", (rate, 0)), len(samples) // 4,
                       CLIP_HEIGHT, samples)


def _pdf(r: Ref, proj: Projector | None) -> Expanded:
    info = documents.pdf_info(r.path)
    first, last = documents.parse_pages(r.pages, info.pages)
    documents.check_range(r.path.name, first, last, info.pages)
    pages = f"{first}-{last}" if last > first else str(first)
    n = last - first + 1
    as_text = r.as_text or proj is None or not proj.sees
    ref = str(replace(r, pages=pages, as_text=as_text and r.as_text))
    if as_text:
        text = documents.pdf_as_text(r.path, first, last)
        return Expanded(text=text, ref=ref, line=f"{n} page{'s' if n != 1 else ''} as text")
    assert proj is not None
    sha = documents.file_digest(r.path)
    images = documents.render_pages(r.path, first, last, proj.side)
    media = [_media(im, f"{r.path}#page={first + i}", frame_key(sha, f"page={first + i}", (proj.side,) * 2))
             for i, im in enumerate(images)]
    tokens = sum(proj.tokens_of(m.width, m.height) for m in media)
    labels = [(f"[page {first + i}]\n", "\n") for i in range(n)]
    return Expanded(media, labels, ref=ref,
                    line=f"{n} page{'s' if n != 1 else ''} as pictures · {tokens:,} tokens")


def load_part(ref: str, side: int) -> LoadedMedia:
    """One frame ("clip.mp4#t=4") or page ("doc.pdf#page=3") again (a reopened chat's),
    as `expand` made it."""
    base, _, frag = ref.rpartition("#")
    path = Path(base)
    what, _, value = frag.partition("=")
    sha = documents.file_digest(path)
    if what == "t":
        info = video.probe(path)
        size = video.frame_size(info, side)
        [(t, im)] = video.decode(path, [float(value)], size)
        return _media(im, ref, frame_key(sha, f"t={float(value):g}", size))
    if what == "page":
        [im] = documents.render_pages(path, int(value), int(value), side)
        return _media(im, ref, frame_key(sha, f"page={int(value)}", (side, side)))
    if what == "sound":
        return _sound(path, sha, int(value))
    raise EbbError(f"{path.name}: {frag!r} is not a frame or a page", "attach the file again")


def is_part(ref: str) -> bool:
    """A frame's or a page's reference (not a whole file)."""
    base, sep, frag = str(ref).rpartition("#")
    return bool(sep) and frag.partition("=")[0] in ("t", "page", "sound") and not names_a_file(str(ref))


@dataclass
class Keys:
    """An attachment of a saved message, as keys (nothing decoded where the reference says
    exactly what went in): (image key, the file or part to load it from), labels, text."""
    keys: list[tuple[str, str]] = field(default_factory=list)
    labels: list[tuple[str, str]] = field(default_factory=list)
    text: str = ""


def saved_keys(ref: str, proj: Projector | None, key_of: Callable[[str], str],
               load_single: Callable[[Path], LoadedMedia]) -> Keys:
    """What `expand` made of a sent attachment, worked out again: a video's frames and a PDF's
    pages by their keys (headers and the file's hash only); anything unresolved is expanded.
    `key_of(content_key)`: the encoder's image key of a content key."""
    r = parse(ref)
    kind = kinds.kind_of(r.path)
    if kind == kinds.VIDEO and r.frames and proj is not None and proj.sees:
        info = video.probe(r.path)
        size = video.frame_size(info, proj.side)
        sha = documents.file_digest(r.path)
        times = sorted(r.frames)
        labels = video.layout(times)
        labels[-1] = (labels[-1][0], labels[-1][1] + "\n")
        keys = [(key_of(frame_key(sha, f"t={t:g}", size)), f"{r.path}#t={t:g}") for t in times]
        if info.has_sound and proj.hears:
            rate = proj.sample_rate
            keys.append((key_of(frame_key(sha, "sound", (rate, 0))), f"{r.path}#sound={rate}"))
            labels.append(PICTURE_LABEL)
        return Keys(keys, labels)
    if kind == kinds.PDF and r.pages and not r.as_text and proj is not None and proj.sees:
        n_pages = documents.pdf_info(r.path).pages
        first, last = documents.parse_pages(r.pages, n_pages)
        sha = documents.file_digest(r.path)
        return Keys([(key_of(frame_key(sha, f"page={n}", (proj.side,) * 2)), f"{r.path}#page={n}")
                     for n in range(first, last + 1)],
                    [(f"[page {n}]\n", "\n") for n in range(first, last + 1)])
    if kind in (kinds.VIDEO, kinds.PDF, kinds.TEXT):
        e = expand(ref, proj, 1 << 30, load_single)
        return Keys([(key_of(m.sha256), m.path) for m in e.media], e.labels, e.text)
    return Keys()  # a picture or a clip: the caller keys the file as it is


def shown_names(refs: list[str]) -> list[str]:
    """What the timeline calls each picture of a message: a file's name; a video's frame as
    "walk.mp4 frame 2 of 32", a PDF's page as "report.pdf page 3"."""
    bases = [str(r).rpartition("#")[0] if is_part(r) else "" for r in refs]
    totals = {b: bases.count(b) for b in bases if b}
    seen: dict[str, int] = {}
    out = []
    for r, base in zip(refs, bases):
        if not base:
            out.append(Path(r).name)
            continue
        seen[base] = seen.get(base, 0) + 1
        what, _, value = str(r).rpartition("#")[2].partition("=")
        out.append(f"{Path(base).name} page {value}" if what == "page"
                   else f"{Path(base).name} sound" if what == "sound"
                   else f"{Path(base).name} frame {seen[base]} of {totals[base] - bases_sound(refs, base)}")
    return out


def bases_sound(refs: list[str], base: str) -> int:
    """1 when the message carries `base`'s sound (an omni projector's), else 0."""
    return int(any(str(r).startswith(f"{base}#sound=") for r in refs))
