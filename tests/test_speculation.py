"""Speculative decoding from n-gram lookup (engine/llama/lookup.py and the runtime's decode loop):
the drafts, the account that switches it off, and a greedy reply through real llama.cpp that
takes drafts and says what the token-by-token reply says wherever its choice was decided."""
from __future__ import annotations

import threading

from engine.llama.lookup import MIN_TRIES, NgramIndex, Speculation, accepted_prefix
from tests.helpers import DECIDED_BY, N_THREADS, margin

TEXT = ("The quick brown fox jumps over the lazy dog. " * 2 + "Ebb keeps the projector in system "
        "RAM and borrows memory from the language model only while a picture is encoded.")
QUESTION = f"Repeat this text exactly, word for word:\n\n{TEXT}"


def test_drafts_come_from_what_was_seen_and_stop_when_they_do_not_pay():
    ix = NgramIndex([5, 6, 7, 8, 9, 5, 6])
    assert ix.draft() == [7, 8, 9, 5, 6]  # after "5 6" came "7 8 9 5 6" before
    ix.add([7])
    assert ix.draft(2) == [8, 9]
    assert NgramIndex([1, 2, 3]).draft() == []  # nothing seen twice
    assert accepted_prefix([4, 5, 6], [4, 5, 9, 1]) == 2 and accepted_prefix([4], [3, 4]) == 0
    s = Speculation()
    for _ in range(MIN_TRIES):
        s.record(8, 0)
    assert not s.on  # twelve drafts, nothing taken: off for the rest of the reply
    s = Speculation()
    for _ in range(MIN_TRIES * 2):
        s.record(8, 3)
    assert s.on


def test_a_greedy_reply_takes_drafts_and_says_the_same(model_path):
    """SAME PATH for the choice, OTHER ARITHMETIC for the batch: the drafted reply's text begins
    with the token-by-token reply's text up to its first step decided by less than DECIDED_BY
    (a batch of drafts is evaluated with other arithmetic than one token)."""
    from engine.config import SessionConfig
    from engine.llama.sampling import GenParams
    from engine.session import Session

    with Session(SessionConfig(model_path, n_ctx=1024, n_threads=N_THREADS)) as s:
        alone = s.turn(QUESTION, gp=GenParams(max_tokens=48, temperature=0, top_logprobs=2))
        s.set_history([])
        drafted = s.turn(QUESTION, gp=GenParams(max_tokens=48, temperature=0))
        s.set_history([])
        # cut mid-draft, then Continue: it goes on from the token the check chose (the logits
        # at the end of the batch are a later guess's)
        stop, pieces = threading.Event(), []

        def stop_after(piece: str) -> None:  # Stop, between two tokens of a draft's batch
            pieces.append(piece)
            if len(pieces) == 10:
                stop.set()
        cut = s.turn(QUESTION, gp=GenParams(max_tokens=48, temperature=0), on_text=stop_after, cancel=stop)
        rt = s.model.runtime
        at_cut = list(rt.slot.cells)
        rest = s.continue_reply(GenParams(max_tokens=48 - cut.gen.n_gen_tokens, temperature=0))
        assert rest.reason.startswith("resumed from the KV cache"), rest.reason
        went_on_with = rt.slot.cells[len(at_cut)]
        # the model's choice after the cut, from the same tokens evaluated afresh: Continue went
        # on with it (where it was decided), not with a later guess's logits
        logits = rt.logits_for(at_cut)
        best, second = sorted(logits)[-1], sorted(logits)[-2]
        if best - second >= DECIDED_BY:
            assert went_on_with == int(logits.argmax()), (cut.text, rest.text)
        s.set_history([])
        sampled = s.turn(QUESTION, gp=GenParams(max_tokens=16, temperature=0.7, seed=3))
    assert alone.gen.n_drafts == 0  # logprobs asked for: every token its own step
    assert drafted.gen.n_draft_accepted > 0, drafted.gen  # the text repeats: drafts were taken
    assert sampled.gen.n_drafts > 0  # a sampled reply drafts too (taken by rejection)
    decided = b""
    for e in alone.gen.logprobs or ():
        if margin(e) < DECIDED_BY:
            break
        decided += bytes(e.to_dict()["bytes"])
    assert len(decided) > 20, "the reply was undecided from its start: nothing to compare"
    assert drafted.text.encode().startswith(decided), (drafted.text, decided.decode(errors="replace"))
    assert cut.gen.n_draft_accepted > 0
    assert drafted.gen.n_gen_tokens <= 48


def test_stop_after_a_rejected_draft_continues_with_the_models_token(model_path, monkeypatch):
    """Drafts that are always wrong (a stand-in for the lookup: the check under test is the
    runtime's): every step's batch is rejected after its first token, the model's own token is
    taken from the batch's first row; a Stop there and Continue go on with that token, not
    with the batch's last row (a wrong guess's)."""
    from engine.config import SessionConfig
    from engine.llama import runtime
    from engine.llama.sampling import GenParams
    from engine.session import Session

    with Session(SessionConfig(model_path, n_ctx=1024, n_threads=N_THREADS)) as s:
        rt = s.model.runtime
        wrong = rt.tokenize(" zebra zebra zebra zebra", add_special=False)
        monkeypatch.setattr(runtime.NgramIndex, "draft", lambda self, k=8: wrong[:k])
        checked = 0
        for n in (4, 8):
            s.set_history([])
            stop, pieces = threading.Event(), []

            def stop_after(piece: str) -> None:
                pieces.append(piece)
                if len(pieces) == n:
                    stop.set()
            cut = s.turn(QUESTION, gp=GenParams(max_tokens=40, temperature=0), on_text=stop_after,
                         cancel=stop)
            assert cut.gen.n_drafts > 0 and cut.gen.n_draft_accepted == 0
            at_cut = list(rt.slot.cells)
            s.continue_reply(GenParams(max_tokens=2, temperature=0))
            went_on_with = rt.slot.cells[len(at_cut)]
            logits = rt.logits_for(at_cut)
            top = sorted(logits)
            if top[-1] - top[-2] >= DECIDED_BY:
                assert went_on_with == int(logits.argmax()), (n, cut.text)
                checked += 1
        assert checked, "no decided step to check"


def test_a_draft_model_guesses_and_a_stranger_is_refused(model_path, tmp_path):
    """A draft model of the same vocabulary (here the model itself: its guesses are its own
    greedy choices) has most of its guesses taken, and the reply begins with the one decoded
    without drafts up to that reply's first undecided step; one of another vocabulary (a
    generated model with three more tokens) is refused before anything is guessed."""
    import pytest

    from engine.errors import EbbError
    from engine.llama.drafter import Drafter
    from engine.llama.loaded_model import LoadParams
    from engine.llama.runtime import TextRuntime
    from engine.llama.sampling import GenParams
    from engine.synth.model_gen import ModelShape, write_model

    story = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    with TextRuntime(LoadParams(model_path, n_ctx=1024, n_threads=N_THREADS)) as rt:
        alone = rt.generate(story, GenParams(max_tokens=32, temperature=0, top_logprobs=2))
        rt.drafter = Drafter(model_path, 1024, N_THREADS, rt)
        try:
            rt.slot.reset()
            drafted = rt.generate(story, GenParams(max_tokens=32, temperature=0))
        finally:
            rt.drafter.close()
        stranger = write_model(tmp_path / "qwen.gguf", ModelShape(n_layers=1, n_embd=64, n_ff=128, n_head=2,
                                                                   n_head_kv=1, n_ctx_train=512),
                               model_path, family="qwen2.5vl")
        with pytest.raises(EbbError, match="vocabulary of"):
            Drafter(stranger, 512, N_THREADS, rt)
    assert drafted.stats.n_drafted > 0 and drafted.stats.n_draft_accepted >= drafted.stats.n_drafted // 2
    decided = b""
    for e in alone.stats.logprobs or ():
        if margin(e) < DECIDED_BY:
            break
        decided += bytes(e.to_dict()["bytes"])
    assert drafted.text.encode().startswith(decided), (drafted.text, decided.decode(errors="replace"))
