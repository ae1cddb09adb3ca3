"""Documents a message carries: PDFs (pypdfium2, the PDF engine Chrome uses) and text files.

A PDF's pages go to a model that sees as pictures, rendered at the projector's own input size;
to a model that does not see, as the text on them (the PDF's text layer). A page range picks
the pages ("3-5"); a PDF longer than MAX_PAGES is not taken whole, and the message says how to
pick. An encrypted PDF asks for its password (PasswordNeeded); a damaged one and a scanned one
(pages with no text) for a model that reads text are refused by name.

A text file (text, Markdown, code, CSV, ...) is attached as its text, fenced and named, as a
user would paste it: UTF-8 (with or without a byte-order mark), UTF-16 with one, else Windows
-1252; a file with NUL bytes is not text. Any thread; no llama.cpp here.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import EbbError
from engine.media.files import checked_file, over_words

MAX_PAGES = 64  # a longer PDF is taken a range at a time (pages the message names)
MAX_DOCUMENT_BYTES = 500 * 1024 * 1024
MAX_TEXT_FILE_BYTES = 2 * 1024 * 1024  # a text file (the context takes far less anyway)


class PasswordNeeded(EbbError):
    """The PDF is encrypted: its password opens it (the window asks for it)."""


@dataclass(frozen=True)
class PdfInfo:
    pages: int
    title: str


def _open(path: Path, password: str | None = None) -> Any:
    import pypdfium2 as pdfium

    path = Path(path)
    checked_file(path, "document", MAX_DOCUMENT_BYTES, "a PDF")
    try:
        return pdfium.PdfDocument(str(path), password=password)
    except pdfium.PdfiumError as exc:
        text = str(exc)
        if "password" in text.lower():
            if password:
                raise PasswordNeeded(f"the password for {path.name} is not right",
                                     "type it again") from None
            raise PasswordNeeded(f"{path.name} is locked with a password",
                                 "enter its password to attach it") from None
        raise EbbError(f"{path.name} could not be read as a PDF: it is damaged ({text})",
                       "use another copy of the document") from None


def unlocked_copy(path: Path, password: str, folder: Path) -> Path:
    """A copy of the encrypted PDF without its lock, in `folder` (the user's own, private), named
    as the original: the password opens it once and is kept nowhere."""
    import pypdfium2.raw as raw

    doc = _open(path, password)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    dest = folder / Path(path).name
    try:
        doc.save(str(dest), flags=raw.FPDF_REMOVE_SECURITY)
    except OSError as exc:
        raise EbbError(f"{Path(path).name} could not be unlocked into {folder} ({exc})",
                       "free some disk space") from None
    finally:
        doc.close()
    dest.chmod(0o600)
    return dest


def pdf_info(path: Path, password: str | None = None) -> PdfInfo:
    doc = _open(path, password)
    try:
        n = len(doc)
        if n == 0:
            raise EbbError(f"{Path(path).name} has no pages", "choose another document")
        title = str(doc.get_metadata_dict().get("Title", "") or "")
        return PdfInfo(n, title)
    finally:
        doc.close()


def parse_pages(text: str, n_pages: int) -> tuple[int, int]:
    """"3-5", "7" or "" (all) as a 1-based inclusive (first, last) within the document."""
    text = text.strip().replace("–", "-")
    if not text:
        return 1, n_pages
    try:
        first_s, _, last_s = text.partition("-")
        first = int(first_s)
        last = int(last_s) if last_s.strip() else (n_pages if text.endswith("-") else first)
    except ValueError:
        raise EbbError(f"pages {text!r} is not a page range", "write it as 3-5, or 7") from None
    if not 1 <= first <= last <= n_pages:
        raise EbbError(f"pages {text} are outside the document's 1-{n_pages}",
                       f"choose pages between 1 and {n_pages}")
    return first, last


def check_range(name: str, first: int, last: int, n_pages: int) -> None:
    """A range longer than MAX_PAGES is refused with the numbers."""
    if last - first + 1 > MAX_PAGES:
        raise EbbError(f"{name} has {n_pages:,} pages; Ebb takes up to {MAX_PAGES} at a time "
                       f"(pages {first}-{last} are {last - first + 1:,})",
                       f"choose a range, e.g. pages {first}-{first + MAX_PAGES - 1}")


def _each_page(path: Path, first: int, last: int, password: str | None, read: Any) -> list[Any]:
    """`read(page)` of pages first..last (1-based), each page closed after."""
    doc = _open(path, password)
    try:
        out = []
        for i in range(first - 1, last):
            page = doc[i]
            try:
                out.append(read(page))
            finally:
                page.close()
        return out
    finally:
        doc.close()


def render_pages(path: Path, first: int, last: int, max_side: int,
                 password: str | None = None) -> list[Any]:
    """Pages first..last as RGB PIL images, the longer side `max_side` pixels."""
    def render(page: Any) -> Any:
        scale = max_side / max(*page.get_size(), 1.0)
        return page.render(scale=scale, may_draw_forms=True).to_pil().convert("RGB")

    return _each_page(path, first, last, password, render)


def page_texts(path: Path, first: int, last: int, password: str | None = None) -> list[str]:
    """The text layer of pages first..last (a scanned page has none: "")."""
    def text(page: Any) -> str:
        tp = page.get_textpage()
        try:
            return str(tp.get_text_bounded()).replace("\r\n", "\n").strip()
        finally:
            tp.close()

    return _each_page(path, first, last, password, text)


def pdf_as_text(path: Path, first: int, last: int, password: str | None = None) -> str:
    """The pages' text, each under its number, for a model that reads; a PDF whose pages have
    no text (scanned) is refused by name."""
    name = Path(path).name
    texts = page_texts(path, first, last, password)
    if not any(texts):
        raise EbbError(f"{name} (pages {first}-{last}) has no text in it: it is scanned pictures",
                       "load a model with a vision projector to read it as pictures")
    body = "\n\n".join(f"[page {first + i}]\n{t}" for i, t in enumerate(texts))
    return f"{name}:\n```\n{body}\n```"


def text_file(path: Path) -> str:
    """The file's text, fenced and named ("notes.md:\\n```markdown\\n…\\n```")."""
    path = Path(path)
    size = checked_file(path, "file", 0, "")
    if size > MAX_TEXT_FILE_BYTES:
        size_s, limit_s = over_words(size, MAX_TEXT_FILE_BYTES)
        raise EbbError(f"{path.name} is {size_s} of text, more than the {limit_s} a chat takes",
                       "attach the part the question is about")
    data = path.read_bytes()
    text = decode_text(data, path.name)
    fence = "````" if "```" in text else "```"
    return f"{path.name}:\n{fence}{_LANGS.get(path.suffix.lower(), '')}\n{text.rstrip()}\n{fence}"


def decode_text(data: bytes, name: str) -> str:
    if data.startswith(b"\xef\xbb\xbf"):
        return data[3:].decode("utf-8", errors="replace")
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return data.decode("utf-16", errors="replace")
    if b"\x00" in data[:65536]:
        raise EbbError(f"{name} is not text (it has binary bytes)",
                       "attach a text, Markdown, code or CSV file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("cp1252", errors="replace")


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


_LANGS = {".py": "python", ".js": "javascript", ".ts": "typescript", ".md": "markdown",
          ".markdown": "markdown", ".json": "json", ".csv": "csv", ".html": "html", ".css": "css",
          ".c": "c", ".h": "c", ".cpp": "cpp", ".cc": "cpp", ".hpp": "cpp", ".rs": "rust",
          ".go": "go", ".java": "java", ".sh": "bash", ".yaml": "yaml", ".yml": "yaml",
          ".toml": "toml", ".sql": "sql", ".xml": "xml", ".rb": "ruby", ".php": "php"}
