"""The chat view: one transcript that streams the reply in place without re-rendering what is
shown, long conversations opened newest first, code blocks with Copy, links to the browser,
and Continue. The view's own tests run without a model (offscreen Qt); the Continue and no-cap
tests run the real window over the real engine (SmolLM2 on the CPU)."""
from __future__ import annotations

import random

import pytest
from PySide6.QtCore import QUrl
from PySide6.QtGui import QGuiApplication, QTextBlockFormat, QTextFormat
from PySide6.QtWidgets import QApplication

from app.core.markdown import split_all, split_finished
from app.core.reply_stats import ReplyStats
from app.core.store import Message, Store
from app.widgets.transcript import FIRST_MESSAGES, Transcript
from engine.llama.sampling import GenParams
from tests.helpers import open_window, send, shown_text, wait_for

REPLY = """Here is a plan:

1. First **bold** step
2. Second step with a [link](https://example.com)

```python
def double(x):

    return x * 2  # a blank line above, inside the fence
```

And `inline code` after.
~~~
plain fence
~~~
The end."""


def _feed_randomly(text: str, seed: int) -> list[str]:
    rnd = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rnd.randint(1, 7)
        out.append(text[i:i + n])
        i += n
    return out


@pytest.mark.parametrize("seed", range(5))
def test_blocks_found_while_streaming_are_the_blocks_of_the_whole_reply(seed):
    rest, found = "", []
    for piece in _feed_randomly(REPLY, seed):
        parts, rest = split_finished(rest + piece)
        found.extend(parts)
    found.extend(split_all(rest))
    assert found == split_all(REPLY)
    codes = [p for p in found if p.code is not None]
    assert [c.lang for c in codes] == ["python", ""]
    assert "\n\n    return" in codes[0].code  # a blank line inside a fence does not end it


@pytest.fixture
def view(qtbot):
    t = Transcript()
    qtbot.addWidget(t)
    t.resize(600, 400)
    t.show()
    return t


def _msg(i: int, role: str, text: str, images=(), stats=None) -> Message:
    return Message(i, role, text, list(images), ReplyStats(**(stats or {})))


def test_the_reply_streams_in_place_without_rendering_it_again(view):
    view.show_messages([_msg(1, "user", "Tell me a long story.")])
    view.begin_reply()
    paragraphs = [f"Paragraph {i}: " + "the keeper climbed the stairs again. " * 6 for i in range(60)]
    story = "\n\n".join(paragraphs)
    per_feed = []
    for piece in _feed_randomly(story, 1):
        before = view.work
        view.stream(piece)
        per_feed.append(view.work - before)
        assert view.streaming
    # each call lays out the new text, plus at most the one block it finished
    longest_block = max(len(p) for p in paragraphs)
    assert max(per_feed) <= longest_block + 8
    assert sum(per_feed) <= 2 * len(story) + 8
    shown = shown_text(view)
    assert shown.startswith("You\nTell me a long story.\nEbb\nParagraph 0:")
    assert "Paragraph 59:" in shown
    view.end_reply(_msg(2, "assistant", story, stats={"n_gen_tokens": 900, "stop_reason": "stop"}))
    final = shown_text(view)
    assert final.count("Ebb\n") == 1 and final.count("Paragraph 59:") == 1
    assert final.rstrip().endswith("· stop")


def test_scrolling_follows_the_stream_unless_the_user_scrolled_up(view, qtbot):
    view.show_messages([_msg(i, "user" if i % 2 else "assistant", f"message {i}\n\nmore") for i in range(1, 30)])
    bar = view.verticalScrollBar()
    assert bar.maximum() > 0 and bar.value() == bar.maximum()
    view.begin_reply()
    for i in range(40):
        view.stream(f"line {i}\n\n")
    assert bar.value() == bar.maximum()  # followed
    bar.setValue(bar.maximum() // 3)
    held = bar.value()
    for i in range(40):
        view.stream(f"more {i}\n\n")
    assert bar.value() == held < bar.maximum()  # left where the user put it
    bar.setValue(bar.maximum())
    view.resize(600, 300)  # shorter: a notice came above the chat while the reply streamed
    view.stream("after the notice\n\n")
    assert bar.value() == bar.maximum()  # still followed
    bar.setValue(bar.maximum() // 3)
    view.resize(600, 250)
    assert bar.value() < bar.maximum()  # a view the user scrolled up is not taken to the end


def test_a_long_conversation_opens_newest_first_and_fills_in_upwards(view, tmp_path):
    from app.bench import make_conversation

    store = Store(tmp_path / "data")
    cid = make_conversation(store, 500, 50, tmp_path)
    msgs = store.messages(cid)
    assert len(msgs) == 500 and sum(len(m.images) for m in msgs) == 50
    view.show_messages(msgs)
    assert view.n_shown() == FIRST_MESSAGES
    thumbs = tmp_path / "data" / "thumbs"
    made = set(p.name for p in thumbs.iterdir()) if thumbs.exists() else set()
    first_image = next(p for m in msgs for p in m.images)
    assert not any(n.startswith(first_image.stem) for n in made)  # not shown: not made
    bar = view.verticalScrollBar()
    for _ in range(200):
        if view.n_shown() == 500:
            break
        bar.setValue(0)
        QApplication.processEvents()
    assert view.n_shown() == 500
    text = shown_text(view)
    positions = [text.index(f"Question {i}:") for i in (0, 1, 100, 249)]
    assert positions == sorted(positions)  # in order, oldest first
    assert text.count("Question ") == 250
    store.close()


def test_code_blocks_copy_and_links_open_in_the_browser(view):
    opened: list[str] = []
    view.open_url = lambda url: opened.append(url.toString())  # the desktop's browser, recorded
    view.show_messages([_msg(1, "assistant", REPLY, stats={"stop_reason": "stop"})])
    view.anchorClicked.emit(QUrl("copy:0"))
    assert QGuiApplication.clipboard().text() == "def double(x):\n\n    return x * 2  # a blank line above, inside the fence"
    view.anchorClicked.emit(QUrl("copy:1"))
    assert QGuiApplication.clipboard().text() == "plain fence"
    view.anchorClicked.emit(QUrl("https://example.com"))
    view.anchorClicked.emit(QUrl("file:///etc/passwd"))  # not a web link: nothing opens
    assert opened == ["https://example.com"]
    # the code is shown in monospace, coloured
    doc = view.document()
    block = doc.findBlock(view.toPlainText().index("def double"))
    fmt = block.begin().fragment().charFormat()
    assert fmt.fontFixedPitch() or "mono" in ",".join(fmt.fontFamilies() or []).lower()


# ------------------------------------------------------------ with the real engine

STORY = "Write a long story about a lighthouse keeper and a storm."


def test_a_reply_runs_past_the_old_cap_and_continue_grows_it_in_place(qtbot, tmp_path):
    """The window's part of Continue: one reply grown in place, its counts summed, the button
    while it may go on. That a continued reply equals an uncapped one is the engine's, held in
    test_continue.py on one evaluation path (here two chats would prefill the same prompt by
    two paths, whole and from the cache, and a long greedy story may part on another CPU)."""
    store = Store(tmp_path / "data")
    store.settings.set("threads", 2)
    store.settings.set("ctx", 512)
    w = open_window(qtbot, store)
    # the default: no cap; a reply runs until the model stops or the context is full
    assert w.settings().max_tokens == 0
    w.gen_params = GenParams(temperature=0, max_tokens=40)
    send(qtbot, w, STORY)
    capped = store.messages(w.conv_id)[-1]
    assert capped.stats.stop_reason == "length" and capped.stats.n_gen_tokens == 40
    assert w.continue_button.isVisible()
    n, tokens, text = 0, 40, capped.text
    while store.messages(w.conv_id)[-1].stats.stop_reason == "length" and n < 30:
        w.continue_button.click()
        wait_for(lambda: not w.chat.busy)
        n += 1
        grown = store.messages(w.conv_id)[-1]
        assert grown.id == capped.id and grown.text.startswith(text) and len(grown.text) > len(text)
        assert grown.stats.n_gen_tokens > tokens
        tokens, text = grown.stats.n_gen_tokens, grown.text
    msgs = store.messages(w.conv_id)
    assert [m.role for m in msgs] == ["user", "assistant"]  # one reply, grown in place
    assert msgs[-1].stats.stop_reason in ("stop", "context_full"), msgs[-1].stats
    assert msgs[-1].stats.continued == n >= 1
    shown = shown_text(w.transcript)
    assert shown.count("Ebb\n") == 1 and shown.count("You\n") == 1
    # a reply that filled the context may go on (older turns would make room); one that ended
    # by itself may not
    assert w.continue_button.isVisible() == (msgs[-1].stats.stop_reason == "context_full")
    store.close()


def test_stop_then_continue(qtbot, store):
    w = open_window(qtbot, store)
    w.gen_params = GenParams(temperature=0, max_tokens=1500)  # seconds on any CPU: stopped
    w.composer.edit.setPlainText("List the numbers from 1 to 1000, separated by commas.")
    w.sending.send()
    wait_for(lambda: len(w.chat.reply_parts) > 3, timeout=60_000)
    w.stop_button.click()
    wait_for(lambda: not w.chat.busy, timeout=30_000)
    stopped = store.messages(w.conv_id)[-1]
    assert stopped.stats.stop_reason == "cancelled" and w.continue_button.isVisible()
    w.gen_params = GenParams(temperature=0, max_tokens=10)
    w.continue_button.click()
    wait_for(lambda: not w.chat.busy)
    went_on = store.messages(w.conv_id)[-1]
    assert went_on.id == stopped.id and went_on.text.startswith(stopped.text)
    assert len(went_on.text) > len(stopped.text)
    assert went_on.stats.n_gen_tokens == stopped.stats.n_gen_tokens + 10


def test_the_window_streams_into_its_one_transcript(qtbot, store):
    w = open_window(qtbot, store)
    assert not hasattr(w, "live_reply")
    w.gen_params = GenParams(temperature=0, max_tokens=200)
    w.composer.edit.setPlainText(STORY)
    w.sending.send()
    wait_for(lambda: len("".join(w.chat.reply_parts)) > 80, timeout=60_000)
    during = shown_text(w.transcript)
    assert during.startswith(f"You\n{STORY}\nEbb\n")
    first_word = "".join(w.chat.reply_parts).split()[0]
    assert first_word in during[len(f"You\n{STORY}\nEbb\n"):]
    assert w.transcript.streaming
    wait_for(lambda: not w.chat.busy)
    after = shown_text(w.transcript)
    assert after.count("Ebb\n") == 1 and "tok/s" in after


def test_continue_never_shown_for_a_finished_reply(qtbot, store):
    w = open_window(qtbot, store)
    send(qtbot, w, "What is the capital of France? Answer in one word.")
    assert store.messages(w.conv_id)[-1].stats.stop_reason == "stop"
    assert not w.continue_button.isVisible()
    assert w.chat.continue_last() is None


def test_text_can_be_selected_and_copied(view):
    view.show_messages([_msg(1, "user", "Copy me, please."),
                        _msg(2, "assistant", "Here you are:\n\n- one\n- two", stats={"stop_reason": "stop"})])
    view.selectAll()
    view.copy()
    copied = QGuiApplication.clipboard().text()
    assert "Copy me, please." in copied and "two" in copied


def test_older_messages_loaded_by_scrolling_are_spaced_as_the_others(view):
    """#26: the messages that come in above as the view is scrolled up are laid out block for
    block as if the conversation had been shown whole (they had extra empty paragraphs)."""
    from app.widgets import transcript as T

    msgs = []
    for i in range(60):
        msgs.append(_msg(2 * i + 1, "user", f"Question {i}"))
        msgs.append(_msg(2 * i + 2, "assistant", f"Answer {i}\n\nSecond paragraph {i}",
                         stats={"stop_reason": "stop", "n_gen_tokens": 5}))

    def blocks(v):
        return [(b.text(), b.blockFormat().topMargin(), b.userState()) for b in _blocks(v.document())]

    view.show_messages(msgs)
    while view.n_shown() < len(msgs):
        view._add_older()
    scrolled = blocks(view)
    first = T.FIRST_MESSAGES
    T.FIRST_MESSAGES = 10_000
    try:
        view.show_messages(msgs)
    finally:
        T.FIRST_MESSAGES = first
    assert scrolled == blocks(view)


def test_a_code_block_is_shown_as_code_while_it_streams(view):
    """#43: an open code block streamed as raw ``` text until it closed: its body is monospace
    on the code background from its first line, without the fence."""
    view.show_messages([_msg(1, "user", "Code?")])
    view.begin_reply()
    for piece in ("Here:\n\n```py", "thon\ndef f():\n", "    return 1\n"):
        view.stream(piece)
    text = view.toPlainText()
    assert "```" not in text and text.rstrip().endswith("def f():\n    return 1".rstrip())
    cur = view.textCursor()
    cur.movePosition(cur.MoveOperation.End)
    cur.movePosition(cur.MoveOperation.Left, n=3)
    fmt = cur.charFormat()
    assert "monospace" in fmt.fontFamilies() and fmt.background().color().name() == "#f3f4f6"
    view.stream("```\n\nDone.\n")
    assert "Done." in view.toPlainText() and "```" not in view.toPlainText()


def test_text_streamed_after_a_code_block_does_not_repaint_the_block(view, qtbot):
    """#54: each update of the text after a finished code block (a table) repainted the table
    from its top: the most of a window's paint while the usual "code, then a word on it" streamed."""
    from PySide6.QtCore import QEvent, QObject

    painted = []

    class Paints(QObject):
        def eventFilter(self, obj, ev):  # noqa: N802 - Qt's name
            if ev.type() == QEvent.Type.Paint:
                painted.append(ev.rect())
            return False

    paints = Paints()
    view.viewport().installEventFilter(paints)
    view.show_messages([_msg(1, "user", "Code?")])
    view.begin_reply()
    code = "".join(f"x{i} = {i}\n" for i in range(8))
    view.stream(f"```python\n{code}```\n\nThis ")
    layout = view.document().documentLayout()
    last_line = layout.blockBoundingRect(view.document().find("x7 = 7").block())
    bottom = last_line.bottom() - view.verticalScrollBar().value()  # the code's last line
    assert 0 < bottom < view.viewport().height()  # in sight
    for word in ("sets ", "eight ", "names."):
        QApplication.processEvents()
        painted.clear()
        view.stream(word)
        qtbot.waitUntil(lambda: bool(painted), timeout=5000)
        assert min(r.top() for r in painted) >= bottom, (painted, bottom)
    assert "This sets eight names." in view.toPlainText()

    def top_of(words: str) -> float:
        return layout.blockBoundingRect(view.document().find(words).block()).top()

    streamed = top_of("This sets")
    view.stream("\n\n---\n\nAfter a rule.")  # a rule's block is empty too: left as it is
    rule = QTextFormat.Property.BlockTrailingHorizontalRulerWidth
    rules = [b for b in _blocks(view.document()) if b.blockFormat().hasProperty(rule)]
    fixed = QTextBlockFormat.LineHeightTypes.FixedHeight.value
    assert rules and rules[0].blockFormat().lineHeightType() != fixed and not rules[0].text()
    view.end_reply(_msg(2, "assistant", f"```python\n{code}```\n\nThis sets eight names."))
    assert top_of("This sets") == streamed  # nothing moves when the reply is shown as saved


def test_a_languages_first_code_block_is_coloured_when_the_reply_ends(view):
    """#54: making a language's highlighter costs ~0.1 s the first time, on the GUI thread and
    holding the GIL the engine's thread needs at every token: a code block in a language not
    seen yet streams plain and is coloured when the reply ends; once made, a block in that
    language is coloured as it streams."""
    from PySide6.QtGui import QTextCursor

    from app.core import markdown

    markdown._LEXERS.pop("ocaml", None)  # a language no other test colours first
    line = "let rec fact n = if n = 0 then 1 else n * fact (n - 1)"
    reply = f"Here:\n\n```ocaml\n{line}\n```\n\nDone."

    def colours() -> set[str]:  # the text colours along the newest copy of the line
        start = view.toPlainText().rindex(line)
        cur = QTextCursor(view.document())
        found = set()
        for p in range(start + 1, start + len(line) + 1):
            cur.setPosition(p)
            found.add(cur.charFormat().foreground().color().name())
        return found

    def stream_reply() -> None:
        view.begin_reply()
        for piece in (reply[:20], reply[20:50], reply[50:]):
            view.stream(piece)
        assert "```" not in view.toPlainText() and "Done." in view.toPlainText()

    view.show_messages([_msg(1, "user", "Code?")])
    stream_reply()
    assert len(colours()) == 1  # plain while it streamed
    view.end_reply(_msg(2, "assistant", reply, stats={"stop_reason": "stop"}))
    assert len(colours()) > 1  # the saved reply: coloured
    stream_reply()
    assert len(colours()) > 1  # the next reply: coloured as it streams


def _blocks(doc):
    block = doc.begin()
    while block.isValid():
        yield block
        block = block.next()


def test_numbered_lists_are_tight(view):
    """#43: Qt left an empty paragraph above each list (and between a loose list's items)."""
    view.show_messages([_msg(1, "assistant", "Steps:\n\n1. Boil.\n2. Add pasta.\n\nLoose:\n\n"
                                             "1. First.\n\n2. Second.\n\nAfter.")])
    shown = shown_text(view)
    assert "Steps:\nBoil.\nAdd pasta.\nLoose:\nFirst.\nSecond.\nAfter." in shown, repr(shown)


def test_a_reply_says_no_rate_until_it_has_streamed_a_while(monkeypatch, tmp_path):
    """Pieces reach the window in batches: ten at once read "20704.7 tok/s". No rate is said
    until the reply has streamed RATE_AFTER_S; then pieces over the time since the first."""
    from app.core import chat_state
    from app.core.chat_state import RATE_AFTER_S, ChatState
    from app.core.store import Store
    from app.core.chat_state import Pending

    now = [100.0]
    monkeypatch.setattr(chat_state.time, "monotonic", lambda: now[0])
    store = Store(tmp_path / "data")
    chat = ChatState(store)
    chat.new_conversation()
    rid = chat.begin(Pending("hi", [], 0))
    for _ in range(10):
        chat.add_text(rid, "x")
    assert chat.live_rate() == (10, 0.0)
    now[0] += RATE_AFTER_S * 2
    assert chat.live_rate() == (10, 9 / (RATE_AFTER_S * 2))
    store.close()
