"""Fitting a conversation into the context (engine/conversation.py) as the pure function it is:
a counter of our own stands in for the template and tokenizer (the session's real one is
tested end to end in test_faults: a shifted conversation answers as a fresh one)."""
from __future__ import annotations

import pytest

from engine.conversation import HistoryTurn, drop_oldest, fit_history
from engine.errors import EbbError

IMAGE = 50  # cells an image takes in this counter


def counter(new: HistoryTurn | None = None):
    """Cells: 10 per turn, plus 1 per word, plus IMAGE per image; `new`: the message to send."""
    def count(history) -> int:
        turns = list(history) + ([new] if new else [])
        return sum(10 + len(t.text.split()) + IMAGE * len(t.image_keys) for t in turns)
    return count


def chat(n: int, images_every: int = 0) -> tuple[HistoryTurn, ...]:
    h = []
    for i in range(n):
        keys = (f"img{i}",) if images_every and i % images_every == 0 else ()
        h += [HistoryTurn("user", f"question {i} " + "word " * 20, keys),
              HistoryTurn("assistant", f"answer {i} " + "word " * 30)]
    return tuple(h)


def test_a_conversation_that_fits_is_kept_whole():
    h = chat(3)
    fitted = fit_history(h, counter(HistoryTurn("user", "hi")), 4096, 1024, "drop-oldest", False)
    assert fitted.history == h and fitted.n_turns_dropped == fitted.n_tokens_dropped == 0


def test_images_of_older_turns_go_first_then_the_oldest_exchanges():
    h = chat(6, images_every=1)
    new = HistoryTurn("user", "and now?")
    count = counter(new)
    n = count(h)
    # room for all the text but not every image: only images go, oldest first
    text_only = count(tuple(HistoryTurn(t.role, t.text) for t in h))
    fitted = fit_history(h, count, text_only + 2 * IMAGE + 100, 100, "drop-oldest", False)
    assert len(fitted.history) == len(h) and fitted.n_turns_dropped == 0
    assert fitted.n_images_dropped == 4
    assert [bool(t.image_keys) for t in fitted.history if t.role == "user"] == [False] * 4 + [True] * 2
    assert fitted.n_tokens_dropped == n - count(fitted.history) == 4 * IMAGE
    # less room: whole exchanges go from the start, a user turn with its reply
    src = list(h)
    fitted = fit_history(src, count, text_only // 2 + 100, 100, "drop-oldest", False)
    assert fitted.n_turns_dropped > 0 and fitted.n_turns_dropped % 2 == 0
    assert fitted.history[0].role == "user"
    assert count(fitted.history) <= text_only // 2
    assert src == list(h)  # the caller's list is not changed


def test_a_message_too_long_alone_is_refused_with_the_numbers():
    huge = HistoryTurn("user", "word " * 5000)
    with pytest.raises(EbbError, match=r"this message is 5010 tokens; the context holds 4096 and keeps 1024"):
        fit_history(chat(2), counter(huge), 4096, 1024, "drop-oldest", False)


def test_overflow_stop_refuses_instead_of_dropping():
    with pytest.raises(EbbError, match="the conversation is .* tokens, the context holds 300"):
        fit_history(chat(6), counter(HistoryTurn("user", "hi")), 300, 50, "stop", False)


def test_continue_keeps_the_question_of_the_reply():
    h = chat(6)
    fitted = fit_history(h, counter(), 200, 50, "drop-oldest", continuing=True)
    assert fitted.history[-1] == h[-1] and fitted.n_turns_dropped > 0
    # even when the reply alone is all that fits, it stays
    with pytest.raises(EbbError, match="this reply with its question"):
        fit_history(h, counter(), 60, 30, "drop-oldest", continuing=True)


def test_drop_oldest_steps():
    h = chat(3, images_every=2)  # images on exchanges 0 and 2; the last exchange's stay
    h2, turns, images = drop_oldest(h, keep=0)
    assert (turns, images) == (0, 1) and not h2[0].image_keys
    h3, turns, images = drop_oldest(h2, keep=0)
    assert (turns, images) == (2, 0) and h3 == h2[2:]
    with pytest.raises(ValueError):
        drop_oldest((HistoryTurn("user", "x"),), keep=1)


def test_a_replys_life_is_one_state_and_only_an_open_one_resumes_from_the_cache():
    """#55: the turn's life as one ReplyState. A reply that stopped on its cap or a Stop is
    open (Continue decodes on, no prefill) until anything else is evaluated; one that ended on
    its own, or failed part-way, is not; a conversation set or put back starts as it was."""
    from engine.conversation import History, ReplyState
    from engine.stops import CANCELLED, LENGTH, STOP

    h = History()
    assert h.reply is ReplyState.IDLE and not h.resumes_from_cache
    q = HistoryTurn("user", "hi")
    h.begin_prompt()
    h.begin_reply()
    assert h.reply is ReplyState.GENERATING
    h.add_exchange(q, "hel")
    h.reply_ended(LENGTH)
    h.interrupted()  # the turn's own end: no change
    assert h.reply is ReplyState.OPEN and h.resumes_from_cache
    saved = h.saved("sys")
    h.moved_on()  # another request decoded
    assert h.reply is ReplyState.IDLE and not h.resumes_from_cache
    h.restore(saved)
    assert h.resumes_from_cache and h.turns == [q, HistoryTurn("assistant", "hel")]
    h.reply_ended(STOP)
    assert h.reply is ReplyState.IDLE and h.last_stop == STOP
    h.begin_prompt()
    h.interrupted()  # a prefill that failed
    assert h.reply is ReplyState.IDLE
    h.stopped_before_reply(HistoryTurn("user", "again"))
    assert h.turns[-1] == HistoryTurn("assistant", "") and h.last_stop == CANCELLED
    assert h.undo_last_exchange() == HistoryTurn("user", "again") and len(h.turns) == 2
    h.reset([q], "7")
    assert (h.turns, h.tag, h.reply, h.last_stop, h.forgotten) == ([q], "7", ReplyState.IDLE, None, 0)
