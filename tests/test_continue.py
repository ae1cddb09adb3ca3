"""No cut at a length cap: a reply runs until the model stops by default, and Continue goes on
with a capped (or stopped) reply, equal to a reply that never stopped (greedy, token for token).
Real SmolLM2 on the CPU, through the session as the window and the CLI use it.

Every reference starts from an empty KV cache, as the run it is compared with does: the prompt
is evaluated in one batch on both sides (tests/helpers.py, SAME PATH)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from engine.config import SessionConfig
from engine.llama.sampling import GenParams
from engine.session import Session
from tests.helpers import N_THREADS, agree_where_decided

STORY = "Write a long story about a lighthouse keeper and a storm."


@pytest.fixture(scope="module")
def session(model_path):
    with Session(SessionConfig(model_path, n_ctx=1024, n_threads=N_THREADS, accel="CPU")) as s:
        yield s


def test_the_default_is_no_cap():
    assert GenParams().max_tokens == 0


def _afresh(session: Session) -> None:
    """A new conversation with nothing in the KV cache: its prompt is evaluated whole."""
    session.set_history([])
    session.model.runtime.slot.reset()


@pytest.mark.numerics
def test_continue_resumes_from_the_cache_and_equals_an_uncapped_reply(session):
    """SAME PATH: the uncapped reply and the capped one evaluate the prompt in one batch from an
    empty cache, and Continue decodes on from the cache token by token, as the uncapped one
    does."""
    _afresh(session)
    whole = session.turn(STORY, gp=GenParams(max_tokens=90, temperature=0))
    assert whole.error is None and whole.gen.n_gen_tokens == 90
    _afresh(session)

    first = session.turn(STORY, gp=GenParams(max_tokens=25, temperature=0))
    assert first.gen.stop_reason == "length"
    n_cells = session.model.runtime.slot.n_positions()
    second = session.continue_reply(GenParams(max_tokens=40, temperature=0))
    assert second.error is None and second.continued
    assert second.gen.n_prompt_tokens_evaluated == 0  # nothing prefilled
    assert [s.name for s in second.spans] == ["decode"]
    assert second.gen.n_prompt_tokens == n_cells
    third = session.continue_reply(GenParams(max_tokens=25, temperature=0))
    assert first.text + second.text + third.text == whole.text
    # the whole reply's length comes with each continuation: 25 + 40 + 25
    assert third.gen.n_reply_tokens == 90
    assert session.history[-1].text == whole.text
    assert len(session.history) == 2  # still one exchange


def test_continuing_an_interrupted_reply_counts_the_whole_reply():
    """A reply cut by a crash is saved with no counts: its stats after Continue count all of it,
    not only the new tokens (#26)."""
    from app.core.reply_stats import ReplyStats

    stats = ReplyStats().continued_by(ReplyStats(n_gen_tokens=12, n_reply_tokens=57, stop_reason="stop"))
    assert stats.n_gen_tokens == 57 and stats.continued == 1
    stats = ReplyStats(n_gen_tokens=40).continued_by(ReplyStats(n_gen_tokens=12, n_reply_tokens=52))
    assert stats.n_gen_tokens == 52


@pytest.mark.numerics
def test_continue_after_a_reopen_prefills_up_to_the_reply(session):
    """The capped reply is SAME PATH as the uncapped one (both from an empty cache); the
    continuation prefills the reply so far instead of having generated it, so it is DECIDED:
    its tokens are the uncapped reply's until either side's choice was close."""
    from tests.test_speculation import QUESTION  # a copy: decided past the cut, so compared

    gp = GenParams(max_tokens=60, temperature=0, top_logprobs=2)
    _afresh(session)
    whole = session.turn(QUESTION, gp=gp)
    _afresh(session)
    first = session.turn(QUESTION, gp=replace(gp, max_tokens=30))
    assert whole.text.startswith(first.text)
    # the conversation is reopened (as when the window starts again): the cache is not trusted
    session.set_history([(t.role, t.text, []) for t in session.history])
    more = session.continue_reply(replace(gp, max_tokens=30))
    assert more.error is None and "prefilled" in more.reason
    assert more.gen.n_prompt_tokens_evaluated > 0
    assert session.history[-1].text == first.text + more.text  # one reply, grown
    assert more.gen.logprobs and whole.gen.logprobs
    agree_where_decided(more.gen.logprobs, whole.gen.logprobs[first.gen.n_gen_tokens:])


def test_continue_with_nothing_to_continue_says_so(session):
    session.set_history([])
    res = session.continue_reply(GenParams(max_tokens=5, temperature=0))
    assert res.error.startswith("there is no reply to continue")
