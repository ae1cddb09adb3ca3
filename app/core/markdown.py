"""A reply's Markdown cut into blocks, so a streaming view renders each block once, when it is
finished, and never the whole reply again; code blocks coloured by Pygments. Qt-free.

A block is finished by a blank line outside a fence, or by its closing fence. Only whole lines
count: the text after the last newline may still grow.
"""
from __future__ import annotations

import html
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)")


@dataclass(frozen=True)
class Part:
    """Markdown text (`code` None) or a fenced code block (`code` its text, `lang` its tag)."""
    text: str = ""
    code: str | None = None
    lang: str = ""


def open_code_body(rest: str) -> str | None:
    """The body so far when the unfinished `rest` is a code block whose ``` line is complete
    (what a stream shows as code before the block closes); else None."""
    first, nl, body = rest.partition("\n")
    return body if nl and _FENCE.match(first) else None


def split_finished(text: str) -> tuple[list[Part], str]:
    """The finished blocks at the start of `text` and the unfinished rest (returned as is)."""
    parts: list[Part] = []
    start = 0  # where the unfinished rest begins
    pos = 0
    fence: tuple[str, str] | None = None  # (marker, lang) while inside a code block
    body_start = 0
    while True:
        nl = text.find("\n", pos)
        if nl < 0:
            break
        line = text[pos:nl]
        if fence is None:
            m = _FENCE.match(line)
            if m:
                if text[start:pos].strip():
                    parts.append(Part(text[start:pos]))
                fence = (m.group(1), m.group(2))
                body_start = nl + 1
                start = pos
            elif not line.strip() and text[start:pos].strip():
                parts.append(Part(text[start:pos]))
                start = nl + 1
            elif not line.strip():
                start = nl + 1
        else:
            marker = fence[0]
            if line.strip().startswith(marker[0] * len(marker)) and not line.strip().strip(marker[0]):
                parts.append(Part(code=text[body_start:pos].rstrip("\n"), lang=fence[1]))
                fence = None
                start = nl + 1
        pos = nl + 1
    return parts, text[start:]


def split_all(text: str) -> list[Part]:
    """Every block of a finished reply (an unclosed fence is code to the end)."""
    parts, rest = split_finished(text)
    if rest.strip():
        m = _FENCE.match(rest)
        if m:
            body = rest.split("\n", 1)[1] if "\n" in rest else ""
            parts.append(Part(code=body.rstrip("\n"), lang=m.group(2)))
        else:
            more, rest2 = split_finished(rest + "\n\n")
            parts.extend(more)
            if rest2.strip():
                parts.append(Part(rest2))
    return parts


_LEXERS: dict[str, Any] = {}  # a language's Pygments lexer (None: not known), once made


def _lexer(lang: str) -> Any:
    if lang not in _LEXERS:
        from pygments.lexers import get_lexer_by_name
        from pygments.util import ClassNotFound

        _formatter()
        try:
            _LEXERS[lang] = get_lexer_by_name(lang) if lang else None
        except ClassNotFound:
            _LEXERS[lang] = None
    return _LEXERS[lang]


@lru_cache(maxsize=1)
def _formatter() -> Any:
    from pygments.formatters import HtmlFormatter

    # inline styles: QTextDocument takes span colours, not a style sheet's classes
    return HtmlFormatter(noclasses=True, nowrap=True, style="default")


def code_html(code: str, lang: str, make: bool = True) -> str:
    """The code's HTML lines, coloured when Pygments knows the language (plain otherwise).
    `make=False`: plain unless the language's lexer was made before. Making one costs ~0.1 s
    the first time (its imports and some hundred regular expressions): a reply that streams
    leaves that for when it ends, as it holds the GIL the engine's thread needs at every token
    (#54)."""
    lang = lang.lower()
    if not make and lang not in _LEXERS:
        return html.escape(code)
    lexer = _lexer(lang)
    if lexer is None:
        return html.escape(code)
    from pygments import highlight

    return str(highlight(code, lexer, _formatter())).rstrip("\n")
