"""The conversation as one transcript: saved messages, and the reply streaming in place as the
last of them.

Nothing here re-renders what is already shown. A message is rendered once when it is added; the
reply being streamed is rendered block by block (app/core/markdown.py): text that arrives is appended
as plain text, and when its block is finished (a blank line, a closing fence) that block alone
is rendered as Markdown in its place. When the reply ends, it alone is rendered whole with its
stats line. A long conversation opens with its newest messages; older ones are added above
them, a batch at a time, when the view is scrolled near the top (the view stays where it is:
each batch costs a new layout of what is shown, so it is done only when it is asked for). Thumbnails are made when
they are first drawn. Links open in the browser; a code block's Copy link copies its code.
"""
from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any, Callable, Sequence

from PySide6.QtCore import Qt, QTimer, QUrl, Signal
from PySide6.QtGui import (
    QResizeEvent,
    QColor,
    QDesktopServices,
    QFont,
    QGuiApplication,
    QImage,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
    QTextDocument,
)
from PySide6.QtWidgets import QTextBrowser, QTextEdit, QWidget

from app.sound.clips import ClipPlayer, describe
from app.core.markdown import Part, code_html, open_code_body, split_all, split_finished
from app.core.reply_stats import ReplyStats
from app.core.store import Message
from app.core.media_words import is_document_like, look
from engine.media.kinds import is_clip
from engine.stops import StopReason

FIRST_MESSAGES = 40  # shown at once when a conversation opens
BATCH = 20  # older messages added above them when scrolled near the top
THUMB = 120  # thumbnail box, pixels (a click shows the picture full size)
CODE_BG = "#f3f4f6"


FLAT_SCROLLBAR = """
QScrollBar:vertical { background: palette(base); width: 12px; margin: 0; border: none; }
QScrollBar::handle:vertical { background: palette(mid); min-height: 28px; margin: 2px;
                              border-radius: 4px; }
QScrollBar::handle:vertical:hover { background: palette(dark); }
QScrollBar::add-line:vertical, QScrollBar::sub-line:vertical { height: 0; border: none; }
QScrollBar::add-page:vertical, QScrollBar::sub-page:vertical { background: none; }
"""


class Transcript(QTextBrowser):
    copied = Signal(str)  # a code block was copied (its text)
    call_answer = Signal(str, str)  # a tool call's card: (call id, once | always | deny)
    # a message's link was clicked: (edit | regen | prev | next | delete, the message's id)
    action = Signal(str, int)
    problem = Signal(str)  # something the user asked for cannot be done (a clip cannot play)
    view_picture = Signal(str)  # a thumbnail was clicked: its picture's path, to show full size

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setOpenLinks(False)  # anchors are ours: copy:N, and http(s) to the browser
        self.anchorClicked.connect(self._on_anchor)
        self.player = ClipPlayer(self.problem.emit)  # a clip's ▶ link plays it
        self.document().setDocumentMargin(10)
        self.open_url: Callable[[QUrl], Any] = QDesktopServices.openUrl
        self._messages: list[Message] = []
        self.memory_from: int | None = None
        self._first = 0  # index of the first message in the document
        self._codes: list[str] = []  # what copy:N copies
        self._thumbs: dict[str, QImage] = {}
        self._last_start = 0  # where the last message begins (the separator before its header)
        self._starts: dict[int, int] = {}  # where each shown message begins
        self.marked: list[str] = []  # the search's words marked in the message found
        self.system_prompt = ""  # the chat's own: marked above its first message (set by the window)
        self._stream: _Stream | None = None
        self._live_call_at: int | None = None  # where the reply's live call card begins
        self.open_results: set[int] = set()  # kept calls whose result is shown
        self._filler = QTimer(self, singleShot=True, interval=0)
        self._filler.timeout.connect(self._add_older)
        self.verticalScrollBar().valueChanged.connect(self._near_top)
        # a flat bar: it is repainted at every streamed update (its handle shrinks as the reply
        # grows), and the Fusion style's gradients took half the GUI thread's time doing it (#54)
        self.verticalScrollBar().setStyleSheet(FLAT_SCROLLBAR)
        self.work = 0  # characters laid out by stream() calls (a benchmark's and a test's gauge)

    # ------------------------------------------------------------ whole conversation

    def show_messages(self, messages: list[Message], memory_from: int | None = None,
                      focus: int = 0, words: Sequence[str] = ()) -> None:
        """Open a conversation: its newest messages now, older ones as the view is scrolled up.
        `memory_from`: the first message the model still remembers (a line above it says so).
        `focus`: a message to show (from it on) instead of the end, with `words` marked in it."""
        self.memory_from = memory_from
        self._filler.stop()
        self._stream = None
        self._live_call_at = None
        self._messages = list(messages)
        self.setExtraSelections([])
        self.marked = []
        first = max(0, len(self._messages) - FIRST_MESSAGES)
        at = next((i for i, m in enumerate(self._messages) if m.id == focus), -1)
        self._render(min(first, at) if at >= 0 else first)
        if at >= 0:
            self._focus(focus, words)
        else:
            self.scroll_to_end()
        self._near_top()

    def _focus(self, message_id: int, words: Sequence[str]) -> None:
        """Scroll `message_id` to the top of the view and mark `words` in it."""
        doc = self.document()
        start = self._starts[message_id]
        later = [p for p in self._starts.values() if p > start]
        end = min(later) if later else doc.characterCount()
        marks = []
        fmt = QTextCharFormat()
        fmt.setBackground(QColor("#ffe066"))
        for w in words:
            cur = doc.find(w, start)
            while not cur.isNull() and cur.selectionEnd() <= end:
                sel = QTextEdit.ExtraSelection()
                sel.cursor, sel.format = cur, fmt
                marks.append(sel)
                self.marked.append(cur.selectedText())
                cur = doc.find(w, cur.selectionEnd())
        self.setExtraSelections(marks)

        def scroll() -> None:
            at = QTextCursor(doc)
            at.setPosition(min(start + 1, doc.characterCount() - 1))
            bar = self.verticalScrollBar()
            bar.setValue(bar.value() + self.cursorRect(at).top() - 8)

        scroll()
        QTimer.singleShot(0, scroll)  # again once the layout has caught up

    def _render(self, first: int) -> None:
        """Lay out the messages from `first` on, afresh (always appending at the end)."""
        self._codes = []
        self._starts = {}
        self.clear()
        self._first = first
        cur = self._end()
        if first == 0 and self._messages:
            self._insert_system_line(cur)
        for i in range(first, len(self._messages)):
            self._last_start = cur.position()
            self._insert_message(cur, self._messages[i], first=i == first and cur.position() == 0)

    def _near_top(self, *_: Any) -> None:
        """Scrolled near the top (or nothing to scroll yet): older messages, if any, soon."""
        if self._first and self.verticalScrollBar().value() < self.viewport().height() // 2:
            self._filler.start()

    def n_shown(self) -> int:
        return len(self._messages) - self._first

    def _add_older(self) -> None:
        """Put the next batch of older messages above those shown, keeping the view still.
        The shown range is laid out again from its new first message (inserted above other
        text, Qt's markdown left empty paragraphs: older messages were spaced apart more);
        not while a reply streams (the next scroll up brings them)."""
        if self._first == 0 or self._stream is not None:
            return
        bar = self.verticalScrollBar()
        from_bottom = bar.maximum() - bar.value()
        self._render(max(0, self._first - BATCH))
        bar.setValue(bar.maximum() - from_bottom)

    def _insert_system_line(self, cur: QTextCursor) -> None:
        """Above a chat's first message: its own system prompt, if it has one, with a link to
        change it (Chat settings)."""
        if not self.system_prompt.strip():
            return
        shown = " ".join(self.system_prompt.split())
        shown = shown if len(shown) <= 160 else shown[:160] + "…"
        cur.insertHtml(f'<span style="color:#6b6f75; font-size:small">System prompt: '
                       f'<i>{html.escape(shown)}</i> · <a href="msg:system/0" '
                       f'style="color:#5f6b7a">change</a></span>')
        cur.insertBlock(_block_format())

    def append_message(self, m: Message, scroll: bool = False) -> None:
        """`scroll`: the user's own message (sent now): shown whatever was scrolled to."""
        follow = scroll or self._at_bottom()
        self._messages.append(m)
        cur = self._end()
        if len(self._messages) == 1 and self.document().isEmpty():
            self._insert_system_line(cur)
        self._last_start = cur.position()
        self._insert_message(cur, m, first=self.document().isEmpty())
        if follow:
            self.scroll_to_end()

    def remove_last(self) -> None:
        """Take the last message off (a reply to regenerate)."""
        if not self._messages:
            return
        self._messages.pop()
        cur = self._end()
        cur.setPosition(self._last_start, QTextCursor.MoveMode.KeepAnchor)
        cur.removeSelectedText()
        self._last_start = self._start_of_last()

    # ------------------------------------------------------------ streaming

    def begin_reply(self, so_far: Message | None = None, scroll: bool = False) -> None:
        """A reply starts streaming as the last message (or `so_far`, the last message, goes
        on: Continue). `scroll`: asked by the user now, so it is shown and followed."""
        follow = scroll or self._at_bottom()
        if so_far is not None and self._messages:
            self.remove_last()
        cur = self._end()
        self._last_start = cur.position()
        _insert_header(cur, "Ebb", first=self.document().isEmpty())
        cur.insertBlock(_block_format(top=4), QTextCharFormat())
        self._stream = _Stream(self, cur.position())
        if so_far is not None:
            self._stream.feed(so_far.text)
        if follow:
            self.scroll_to_end()

    def stream(self, text: str) -> None:
        """More of the streaming reply: appended; a block that it finishes is rendered."""
        if self._stream is None or not text:
            return
        follow = self._at_bottom()
        self._stream.feed(text)
        if follow:  # text appended is laid out at once: no second scroll once the loop turns
            bar = self.verticalScrollBar()  # (that one was a call into Python per update, #54)
            bar.setValue(bar.maximum())

    def end_reply(self, m: Message | None) -> None:
        """The reply ended: shown whole as saved (`m`), or taken off (None: nothing saved)."""
        stream, self._stream = self._stream, None
        if stream is None:
            return
        follow = self._at_bottom()
        cur = self._end()
        cur.setPosition(self._last_start, QTextCursor.MoveMode.KeepAnchor)
        cur.removeSelectedText()
        self._last_start = self._start_of_last()
        if m is not None:
            if self._messages and self._messages[-1].id == m.id:
                self._messages.pop()  # a continued reply: its new text replaces it
            self.append_message(m)
        if follow:
            self.scroll_to_end()

    @property
    def streaming(self) -> bool:
        return self._stream is not None

    # ------------------------------------------------------------ tool calls

    def show_call(self, call: dict[str, Any]) -> None:
        """A call of the reply being written, as a live card at the end: asked (Allow once /
        Always for this tool in this chat / Deny), running (with its time). The reply's empty
        stream above it goes; `end_call` puts the kept call in its place."""
        follow = self._at_bottom()
        if self._stream is not None:
            self._stream = None
            self._drop_from(self._last_start)
        if self._live_call_at is not None:
            self._drop_from(self._live_call_at)
        cur = self._end()
        self._live_call_at = cur.position()
        _insert_header(cur, "Tool", first=self.document().isEmpty())
        record = {"label": call.get("tool", ""), "arguments": call.get("arguments", {}),
                  "state": call.get("state", ""), "id": call.get("id", ""),
                  "since": call.get("since", 0.0)}
        self._insert_card(cur, record, "", [], False, 0, live=True)
        if follow:
            self.scroll_to_end()

    def end_call(self, m: Message | None) -> None:
        """The live card's call ended: the kept call (`m`) in its place (None: not kept)."""
        if self._live_call_at is not None:
            self._drop_from(self._live_call_at)
            self._live_call_at = None
        if m is not None:
            self.append_message(m)

    @property
    def live_call(self) -> bool:
        return self._live_call_at is not None

    def _drop_from(self, position: int) -> None:
        cur = self._end()
        cur.setPosition(min(position, cur.position()), QTextCursor.MoveMode.KeepAnchor)
        cur.removeSelectedText()
        self._last_start = self._start_of_last()

    def _insert_card(self, cur: QTextCursor, tool: dict[str, Any], said: str, files: list[Path],
                     open_result: bool, message_id: int, live: bool = False) -> None:
        """A call as a card: the tool (server:tool), its arguments as JSON, its state, and
        (kept) its result: shown when asked for (pictures always, as thumbnails)."""
        cur.insertBlock(_block_format(top=4), QTextCharFormat())
        cur.insertHtml(card_html(tool, said, open_result, message_id, live,
                                 " ".join(self._image_html(p) for p in files)))
        table = cur.currentTable()
        if table is not None:
            cur.setPosition(table.lastPosition() + 1)

    # ------------------------------------------------------------ rendering

    def _end(self) -> QTextCursor:
        cur = QTextCursor(self.document())
        cur.movePosition(QTextCursor.MoveOperation.End)
        return cur

    def _start_of_last(self) -> int:
        """Where the last message (after a removal) begins, its block separator included:
        found again by its header block."""
        block = self.document().lastBlock()
        while block.isValid() and block.userState() != _HEADER:
            block = block.previous()
        return max(0, block.position() - 1) if block.isValid() else 0

    def _insert_message(self, cur: QTextCursor, m: Message, first: bool) -> None:
        self._starts[m.id] = cur.position()
        if m.id == self.memory_from and m is not self._messages[0]:
            fmt = QTextBlockFormat()
            fmt.setTopMargin(14)
            fmt.setAlignment(Qt.AlignmentFlag.AlignHCenter)
            if first:
                cur.setBlockFormat(fmt)
            else:
                cur.insertBlock(fmt)
            cur.insertHtml('<i style="color:#8a6d00">— earlier messages are outside the model\'s '
                           'memory (the context is full) —</i>')
            first = False
        if m.role == "tool":
            _insert_header(cur, "Tool", first)
            cur.insertHtml(_actions_html(m))
            self._insert_card(cur, m.tool or {}, m.text, m.images, m.id in self.open_results, m.id)
            return
        _insert_header(cur, "You" if m.role == "user" else "Ebb", first)
        cur.insertHtml(_actions_html(m))
        if m.images:
            cur.insertBlock(_block_format())
            cur.insertHtml(" ".join(self._image_html(p, m.shown_names.get(str(p), ""),
                                                     m.fragments.get(str(p), ""))
                                    for p in m.images))
        for part in split_all(shorten_long_runs(m.text)):
            self.insert_part(cur, part)
        if m.state == "interrupted":
            cur.insertBlock(_block_format(top=2))
            cur.insertHtml('<span style="color:#b26a00; font-size:small">interrupted: Ebb '
                           'stopped before this reply was finished (Regenerate, or Continue '
                           'to go on)</span>')
        elif not m.stats.empty:
            cur.insertBlock(_block_format(top=2))
            cur.insertHtml(f'<span style="color:#777777; font-size:small">'
                           f'{html.escape(stats_line(m.stats))}</span>')
        if m.stats.unsaved:
            cur.insertBlock(_block_format(top=2))
            cur.insertHtml(f'<span style="color:#c62828; font-size:small">not saved yet (kept '
                           f'here, written as soon as there is room): '
                           f'{html.escape(m.stats.unsaved)}</span>')

    def insert_part(self, cur: QTextCursor, part: Part, streaming: bool = False) -> None:
        """One block of a reply, in a block of its own after `cur`. `streaming`: a code block
        is coloured only if its language's highlighter is ready (the saved reply that replaces
        the stream is coloured in full)."""
        cur.insertBlock(_block_format(top=4), QTextCharFormat())
        if part.code is None:
            start = cur.block()
            cur.insertMarkdown(part.text, QTextDocument.MarkdownFeature.MarkdownDialectGitHub)
            if _LIST_ITEM.match(part.text) and not start.text() and start.next().textList() is not None:
                # Qt leaves the block it was given empty above a list: a blank line's gap
                # between "Steps:" and "1." (and between the items of a loose list)
                gap = QTextCursor(start)
                gap.movePosition(QTextCursor.MoveOperation.NextBlock, QTextCursor.MoveMode.KeepAnchor)
                gap.removeSelectedText()
            return
        n = len(self._codes)
        self._codes.append(part.code)
        lang = f'<span style="color:#777777">{html.escape(part.lang)}</span> ' if part.lang else ""
        cur.insertHtml(
            f'<table width="100%" cellspacing="0" cellpadding="6" bgcolor="{CODE_BG}">'
            f'<tr><td>{lang}<a href="copy:{n}">Copy</a>'
            f'<pre style="font-family:monospace">{code_html(part.code, part.lang, make=not streaming)}</pre>'
            f"</td></tr></table>")
        table = cur.currentTable()
        if table is not None:  # left in the last cell: go on after the table
            cur.setPosition(table.lastPosition() + 1)

    def _image_html(self, path: Path, shown_name: str = "", fragment: str = "") -> str:
        if is_document_like(path):  # a video, a PDF, a text file: what it is, and what was taken
            if not path.is_file():
                return f"<i>[{html.escape(shown_name or path.name)} missing]</i>"
            ref = f"{path}#{fragment}" if fragment else str(path)
            return f"<span>{html.escape(look(ref, shown_name, cost=False).words)}</span>"
        if is_clip(path):  # a sound clip: its chip, and a link that plays it
            if not path.is_file():
                return f"<i>[clip missing: {html.escape(path.name)}]</i>"
            url = QUrl.fromLocalFile(str(path))
            url.setScheme("play")
            return (f'<a href="{url.toString()}" style="text-decoration:none">▶ '
                    f"{html.escape(describe(path, shown_name)[0])}</a>")
        size = _thumb_size(path)
        if size is None:
            return f"<i>[image missing: {html.escape(path.name)}]</i>"
        url = QUrl.fromLocalFile(str(path))
        url.setScheme("thumb")
        full = QUrl.fromLocalFile(str(path))
        full.setScheme("view")  # a click opens it full size
        return (f'<a href="{full.toString()}"><img src="{url.toString()}" width="{size[0]}" '
                f'height="{size[1]}"></a>')

    def loadResource(self, kind: int, url: QUrl | str) -> Any:
        """Thumbnails are made when first drawn (never for messages scrolled past)."""
        if isinstance(url, QUrl) and url.scheme() == "thumb":
            path = url.path()
            if path not in self._thumbs:
                made = thumb(Path(path))
                self._thumbs[path] = QImage(made) if made else _thumb_in_memory(Path(path))
            return self._thumbs[path]
        return super().loadResource(kind, url)

    # ------------------------------------------------------------ scrolling, links

    def resizeEvent(self, e: QResizeEvent) -> None:
        """A view at its end stays there when it gets shorter (a notice came above it while a
        reply streamed: the reply stopped being followed)."""
        at_end = self._at_bottom()
        super().resizeEvent(e)
        if at_end and not self._at_bottom():
            self.scroll_to_end()

    def _at_bottom(self) -> bool:
        bar = self.verticalScrollBar()
        return bar.value() >= bar.maximum() - 4

    def scroll_to_end(self) -> None:
        """To the end now, and again once the document's layout has caught up (the scroll
        range grows only then: a send used to leave the new message below the view)."""
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())
        QTimer.singleShot(0, lambda: bar.setValue(bar.maximum()))

    def _on_anchor(self, url: QUrl) -> None:
        if url.scheme() == "msg":
            kind, _, mid = url.path().partition("/")
            if mid.isdigit():
                self.action.emit(kind, int(mid))
        elif url.scheme() == "tool":
            kind, _, ident = url.path().partition("/")
            if kind in ("once", "always", "deny"):
                self.call_answer.emit(ident, kind)
            elif kind == "result" and ident.isdigit() and self._stream is None \
                    and self._live_call_at is None:  # a kept call's result, shown or hidden
                self.open_results ^= {int(ident)}
                self.show_messages(list(self._messages), self.memory_from)
        elif url.scheme() == "view":
            self.view_picture.emit(url.path())
        elif url.scheme() == "play":
            self.player.toggle(Path(url.path()))
        elif url.scheme() == "copy":
            try:
                code = self._codes[int(url.path())]
            except (ValueError, IndexError):
                return
            QGuiApplication.clipboard().setText(code)
            self.copied.emit(code)
        elif url.scheme() in ("http", "https", "mailto"):
            self.open_url(url)


_HEADER = 1  # a header block's user state: where a message starts
LONG_RUN = 2000  # characters without a space: Qt lays a longer run out in seconds (200,000: 8 s)


def shorten_long_runs(text: str) -> str:
    """The text as the transcript shows it: a run of over LONG_RUN characters with no space
    (a pasted blob, one huge word) is cut there with how much is left out (the message keeps
    it all: Copy reply, Edit and export have every character)."""
    import re

    def cut(m: "re.Match[str]") -> str:
        run = m.group(0)
        return f"{run[:LONG_RUN]}… [{len(run) - LONG_RUN:,} more characters not shown]"
    return re.sub(rf"\S{{{LONG_RUN + 1},}}", cut, text)


def _actions_html(m: Message) -> str:
    """After the header: the message's versions (‹ 2/3 ›) and what can be done with it."""
    link = 'style="color:#5f6b7a; text-decoration:none"'
    grey = 'style="color:#c0c6cc"'
    bits = []
    if len(m.siblings) > 1 and m.id in m.siblings:
        i, n = m.siblings.index(m.id) + 1, len(m.siblings)
        prev = (f'<a href="msg:prev/{m.id}" {link} title="Previous version">‹</a>' if i > 1
                else f"<span {grey}>‹</span>")
        nxt = (f'<a href="msg:next/{m.id}" {link} title="Next version">›</a>' if i < n
               else f"<span {grey}>›</span>")
        bits.append(f'<span style="font-size:medium; font-weight:bold">{prev}</span> {i}/{n} '
                    f'<span style="font-size:medium; font-weight:bold">{nxt}</span>')
    if m.role != "tool":  # a call is asked again by regenerating the reply after it
        bits.append(f'<a href="msg:edit/{m.id}" {link}>Edit</a>')
    if m.role == "assistant":
        bits.append(f'<a href="msg:regen/{m.id}" {link}>Regenerate</a>')
    bits.append(f'<a href="msg:delete/{m.id}" {link}>Delete</a>')
    return ('<span style="font-weight:normal; font-size:small; color:#5f6b7a">&nbsp;&nbsp;&nbsp;'
            + " · ".join(bits) + "</span>")


_LIST_ITEM = re.compile(r"^\s{0,3}(?:\d{1,9}[.)]|[-*+])\s")


def _block_format(top: int = 0) -> QTextBlockFormat:
    f = QTextBlockFormat()
    f.setTopMargin(top)
    return f


def _insert_header(cur: QTextCursor, who: str, first: bool) -> None:
    fmt = QTextCharFormat()
    fmt.setFontWeight(QFont.Weight.Bold)
    if not first:
        cur.insertBlock(_block_format(top=14), fmt)
    else:
        cur.setBlockFormat(_block_format())
        cur.setCharFormat(fmt)
    cur.block().setUserState(_HEADER)
    cur.insertText(who, fmt)


ZERO_WIDTH_SPACE = "\u200b"


class _Stream:
    """The reply being streamed: rendered blocks, then the unfinished rest as plain text."""

    def __init__(self, view: Transcript, start: int) -> None:
        self.view = view
        self.tail_start = start  # where the plain-text rest begins
        self.rest = ""  # the unfinished block's text so far
        self.cur = view._end()  # stays at the end (a cursor follows edits above it)
        # inside a code block that is still being written: its text in monospace on the code
        # background, without the ``` line (it showed raw until the block closed)
        self.fmt: QTextCharFormat | None = None

    def shift(self, n: int) -> None:
        self.tail_start += n

    def feed(self, text: str) -> None:
        self.rest += text
        parts, rest = split_finished(self.rest)
        if not parts:
            body = open_code_body(self.rest) if self.fmt is None else None
            if body is not None:  # a code block began: its body so far, as code from now on
                self._retail(body)
                return
            self.cur.insertText(text, self.fmt or QTextCharFormat())
            self.view.work += len(text)
            return
        cur = self.cur
        cur.setPosition(self.tail_start - 1, QTextCursor.MoveMode.KeepAnchor)  # with its block
        cur.removeSelectedText()
        for part in parts:
            self.view.insert_part(cur, part, streaming=True)
            self.view.work += len(part.text) + len(part.code or "")
        prev = cur.block().previous()
        if not cur.block().text() and prev.isValid() and QTextCursor(prev).currentTable() is not None:
            # the empty block a code block (a table) leaves after it: with no text between
            # them, Qt repaints from the table's top at every insert into the tail (0.85 ms
            # against 0.14 per update here, #54). A zero-width space in a line of no height
            # stops that and moves nothing (an empty block after a table takes no room); the
            # streamed text is taken off when the reply is shown as saved.
            cur.insertText(ZERO_WIDTH_SPACE)
            fmt = cur.blockFormat()
            fmt.setLineHeight(0, QTextBlockFormat.LineHeightTypes.FixedHeight.value)
            cur.setBlockFormat(fmt)
        cur.insertBlock(_block_format(top=4), QTextCharFormat())
        self.tail_start = cur.position()
        self.fmt = None
        self.rest = rest
        body = open_code_body(rest)
        if body is not None:
            self._retail(body)
            return
        cur.insertText(rest, QTextCharFormat())
        self.view.work += len(rest)

    def _retail(self, body: str) -> None:
        """The unfinished tail again, as the body of an open code block."""
        cur = self.cur
        cur.setPosition(self.tail_start)
        cur.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
        cur.removeSelectedText()
        self.fmt = code_format()
        cur.insertText(body, self.fmt)
        self.view.work += len(body)


def code_format() -> QTextCharFormat:
    fmt = QTextCharFormat()
    fmt.setFontFamilies(["monospace"])
    fmt.setBackground(QColor(CODE_BG))
    return fmt


def stats_line(s: ReplyStats) -> str:
    n = s.n_gen_tokens
    line = (f"{n} token{'' if n == 1 else 's'} · {s.gen_tokens_per_s:.1f} tok/s · "
            f"prompt {s.prompt_s:.2f}s · {s.stop_reason}")
    if s.flash_attn is not None:
        line += f" · flash attention {'on' if s.flash_attn else 'off'}"
    if s.seed is not None:  # sampled: which draw, and whether Regenerate repeats it
        line += (f" · seed {s.seed} "
                 + ("(fixed in Chat settings)" if s.seed_fixed else "(new each reply)"))
    if s.n_images:
        if s.strategy in ("", "none"):
            line += (f" · {'the attachment was' if s.n_images == 1 else f'all {s.n_images} attachments were'} "
                     "already encoded (cache)")
        else:
            line += f" · encoded: {s.strategy}, {s.encode_s:.2f}s, swap {s.swap_s:.3f}s"
    if s.stop_reason == StopReason.LENGTH:
        line += " · stopped at the reply cap: Continue goes on"
    elif s.stop_reason == StopReason.CONTEXT_FULL:
        line += " · the context is full: Continue lets older turns go"
    if s.n_turns_dropped or s.n_images_dropped:
        gone = [f"{s.n_turns_dropped} older messages" if s.n_turns_dropped else "",
                f"{s.n_images_dropped} older images" if s.n_images_dropped else ""]
        line += f" · to fit, {' and '.join(g for g in gone if g)} left the model's memory"
    for note in s.device_notes:  # the device was short of memory: what ran where
        line += f" · {note}"
    return line


def _thumb_size(path: Path) -> tuple[int, int] | None:
    """The thumbnail's size from the image's header (the pixels are not decoded)."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            w, h = im.size
    except (OSError, ValueError):
        return None
    scale = min(1.0, THUMB / max(w, h, 1))
    return max(1, round(w * scale)), max(1, round(h * scale))


def _thumb_in_memory(path: Path) -> QImage:
    """A thumbnail made without writing it (the thumbnail folder cannot be written)."""
    img = QImage(str(path))
    if img.isNull():
        return img
    return img.scaled(THUMB, THUMB, Qt.AspectRatioMode.KeepAspectRatio,
                      Qt.TransformationMode.SmoothTransformation)


def thumb(path: Path, size: int = THUMB) -> str:
    """A small copy of an image for the transcript (made once, kept beside the store)."""
    from PIL import Image

    out = path.parent.parent / "thumbs" / f"{path.stem}-{size}.png"
    if not out.exists():
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            with Image.open(path) as im:
                im.thumbnail((size, size))
                tmp = out.with_suffix(".tmp")
                im.convert("RGB").save(tmp, "PNG")
                tmp.replace(out)
        except (OSError, ValueError):
            out.with_suffix(".tmp").unlink(missing_ok=True)
            return ""
    return out.as_posix()


CALL_STATES = {"asked": ("#8a6d00", "waiting for your answer"), "running": ("#1565c0", "running"),
               "done": ("#2e7d32", "done"), "failed": ("#c62828", "failed"),
               "denied": ("#6b6b6b", "denied"), "cancelled": ("#6b6b6b", "stopped"),
               "timeout": ("#c62828", "no answer in time"), "repeat": ("#8a6d00", "made again")}


def card_html(tool: dict[str, Any], said: str, open_result: bool, message_id: int, live: bool,
              pictures: str = "") -> str:
    """A tool call's card (a table the transcript's HTML can draw): `live` is the reply's call
    that waits for an answer or runs; else the kept one, its result behind a link."""
    import json
    import time as _time

    label = html.escape(str(tool.get("label") or tool.get("tool") or "tool"))
    state = str(tool.get("state", ""))
    colour, words = CALL_STATES.get(state, ("#6b6b6b", state))
    if state == "running" and tool.get("since"):
        words += f" · {max(0.0, _time.monotonic() - float(tool['since'])):.0f} s"
    elif tool.get("seconds") and state not in ("asked", "denied"):
        words += f" · {float(tool['seconds']):.1f} s"
    if tool.get("is_error") and state == "failed":
        words += " (the tool said it failed)"
    args = json.dumps(tool.get("arguments", {}), indent=1, ensure_ascii=False)
    if len(args) > 2000:
        args = args[:2000] + " …"
    rows = [f'<tr><td><b>{label}</b> &nbsp;<span style="color:{colour}">{html.escape(words)}</span>'
            "</td></tr>",
            f'<tr><td><pre style="font-family:monospace; margin:0">{html.escape(args)}</pre></td></tr>']
    link = 'style="text-decoration:none; font-weight:bold"'
    if live and state == "asked":
        ident = html.escape(str(tool.get("id", "")))
        rows.append(f'<tr><td><a href="tool:once/{ident}" {link}>Allow once</a> &nbsp;·&nbsp; '
                    f'<a href="tool:always/{ident}" {link}>Always for this tool in this chat</a> '
                    f'&nbsp;·&nbsp; <a href="tool:deny/{ident}" {link} >Deny</a></td></tr>')
    elif not live:
        if pictures:
            rows.append(f"<tr><td>{pictures}</td></tr>")
        result = said or str(tool.get("result", ""))
        if result:
            if open_result:
                shown = result if len(result) <= 4000 else result[:4000] + " …"
                rows.append(f'<tr><td><a href="tool:result/{message_id}" style="text-decoration:none">'
                            f'▾ Hide the result</a><pre style="font-family:monospace; margin:0; '
                            f'white-space:pre-wrap">{html.escape(shown)}</pre></td></tr>')
            else:
                first = result.strip().splitlines()[0] if result.strip() else ""
                rows.append(f'<tr><td><a href="tool:result/{message_id}" style="text-decoration:none">'
                            f'▸ Show the result</a> <span style="color:#6b6b6b">'
                            f'{html.escape(first[:120])}{" …" if len(first) > 120 else ""}</span></td></tr>')
    return (f'<table width="100%" cellspacing="0" cellpadding="5" bgcolor="#f4f6fa" '
            f'style="border: 1px solid #c9d3e0">{"".join(rows)}</table>')
