"""What Ebb survives, in one place: a conversation that outgrows the context (drop-oldest with
the KV cache shifted, or a clear refusal), a message larger than the whole context. Real SmolLM2
through real llama.cpp, the real session; images through a generated projector on the CPU."""
from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from engine.config import SessionConfig
from engine.llama.runtime import GenParams
from engine.session import Session
from tests.conftest import N_THREADS

GP = GenParams(max_tokens=16, temperature=0)


def _turn_text(i: int) -> str:
    return (f"Turn {i}: tell me one short fact about the number {i} and about lighthouses, "
            "boats, storms and the sea, in about forty words please.")


def _session(model_path: Path, projector: Path | None = None, **kw) -> Session:
    return Session(SessionConfig(model_path, projector, n_ctx=512, n_threads=N_THREADS,
                                 accel="CPU", vision="cpu", **kw))


def test_forty_turns_at_a_small_context_run_to_the_end_dropping_the_oldest(model_path):
    with _session(model_path) as s:
        results = [s.turn(_turn_text(i), gp=GP) for i in range(40)]
    assert [r.error for r in results] == [None] * 40
    dropped = [r for r in results if r.n_turns_dropped]
    assert dropped, "a 512-token context cannot hold 40 turns"
    first = dropped[0]
    assert first.n_tokens_dropped > 0 and first.memory_starts_at == first.n_turns_dropped
    # the kept turns were moved in the cache, not evaluated again
    assert all(r.shifted_cells > 0 for r in dropped)
    assert all(r.gen["n_prompt_tokens_evaluated"] < 80 for r in dropped)
    assert results[-1].memory_starts_at > 40  # messages: user and assistant, oldest first
    assert all(r.gen["n_prompt_tokens"] <= 512 - s.reply_room for r in results)


def test_the_reply_after_a_shift_equals_a_fresh_session_on_the_kept_turns(model_path):
    with _session(model_path) as a:
        i = 0
        while True:
            kept_before = list(a.history)
            res = a.turn(_turn_text(i), gp=GP)
            assert res.error is None
            if res.n_turns_dropped:
                break
            i += 1
        assert res.shifted_cells > 0
        kept = kept_before[res.n_turns_dropped:]
        assert a.history[:-2] == kept
    with _session(model_path) as b:
        b.set_history([(t.role, t.text, []) for t in kept])
        fresh = b.turn(_turn_text(i), gp=GP)
    assert fresh.text == res.text


def test_the_image_conversation_runs_to_the_end_dropping_older_images_first(model_path, tiny_projector,
                                                                          tmp_path):
    pictures = []
    for j in range(4):
        p = tmp_path / f"p{j}.png"
        Image.new("RGB", (336, 336), (60 * j, 200 - 40 * j, 90)).save(p)
        pictures.append(p)
    with _session(model_path, tiny_projector) as s:
        results = []
        for i in range(40):
            images = [pictures[i % 4]] if i % 3 == 0 else []
            results.append(s.turn(_turn_text(i), images, GP))
    assert [r.error for r in results] == [None] * 40
    with_images_dropped = [k for k, r in enumerate(results) if r.n_images_dropped]
    with_turns_dropped = [k for k, r in enumerate(results) if r.n_turns_dropped]
    assert with_images_dropped and with_turns_dropped
    # an older turn gives up its image before any whole turn goes
    assert min(with_images_dropped) <= min(with_turns_dropped)


def test_a_message_larger_than_the_context_is_refused_before_anything_runs(model_path, tiny_projector,
                                                                        tmp_path):
    picture = tmp_path / "big.png"
    Image.new("RGB", (336, 336), (200, 30, 30)).save(picture)
    with _session(model_path, tiny_projector) as s:
        s.turn("Hello.", gp=GP)
        history = list(s.history)
        n_cells = s.runtime.n_positions()
        res = s.turn("word " * 600, [picture], GP)
        assert res.error and "this message is" in res.error and "the context holds 512" in res.error
        assert s.history == history and s.runtime.n_positions() == n_cells
        assert res.n_images_encoded == 0 and not [sp for sp in res.spans if sp.name == "encode"]


def test_overflow_stop_refuses_with_the_numbers(model_path):
    with _session(model_path, overflow="stop") as s:
        results = [s.turn(_turn_text(i), gp=GP) for i in range(8)]
        refused = [r for r in results if r.error]
        assert refused and "the context holds 512" in refused[0].error
        assert "drop-oldest" in refused[0].error
        assert all(r.n_turns_dropped == 0 for r in results)


def test_continue_after_a_full_context_lets_older_turns_go(model_path):
    background = " ".join(f"Note {k}: the keeper logs wind, rain and ships." for k in range(12))
    with _session(model_path) as s:
        s.turn(f"Remember these notes. {background}", gp=GP)
        s.turn(f"And these as well. {background}", gp=GP)
        long = s.turn("Write a very long story about a lighthouse keeper and a storm.",
                      gp=GenParams(temperature=0))  # no cap: runs into the context's end
        assert long.gen["stop_reason"] == "context_full"
        more = s.continue_reply(GenParams(max_tokens=16, temperature=0))
        assert more.error is None, more.error
        assert more.n_turns_dropped >= 2 and more.gen["n_gen_tokens"] > 0
        assert s.history[-1].text == long.text + more.text
        assert s.history[-2].text.startswith("Write a very long story")
        assert len(s.history) == 2


def test_a_reply_that_fills_the_context_alone_cannot_go_on_and_is_kept(model_path):
    with _session(model_path) as s:
        long = s.turn("Write a very long story about a lighthouse keeper and a storm.",
                      gp=GenParams(temperature=0))
        assert long.gen["stop_reason"] == "context_full"
        history = list(s.history)
        more = s.continue_reply(GenParams(max_tokens=16, temperature=0))
        assert more.error and "raise the context length" in more.error
        assert s.history == history


def test_the_window_says_where_the_models_memory_begins(qtbot, tmp_path):
    from app.store import Store
    from tests.test_app import _send, _window

    store = Store(tmp_path / "data")
    store.set_setting("threads", N_THREADS)
    store.set_setting("ctx", 512)
    w = _window(qtbot, store)
    w.gen_params = GP
    for i in range(7):
        _send(qtbot, w, _turn_text(i))
    msgs = store.messages(w.conv_id)
    assert [m.role for m in msgs] == ["user", "assistant"] * 7  # nothing refused, nothing lost
    first_kept = w.chat.memory_from(msgs)
    assert first_kept is not None and first_kept != msgs[0].id
    shown = w.transcript.toPlainText()
    line = "earlier messages are outside the model's memory"
    assert shown.count(line) == 1
    kept_text = next(m.text for m in msgs if m.id == first_kept)
    assert shown.index(line) < shown.index(kept_text)
    assert "left the model's memory" in shown
    # reopened: the same line in the same place
    w._show_conversation()
    assert w.transcript.toPlainText() == shown
    store.close()
