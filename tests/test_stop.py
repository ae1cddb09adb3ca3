"""Stop ends a prefill within about one batch (#26): between batches, and inside a long batch
through llama.cpp's abort callback, leaving the KV cache and its books consistent.

No timing: the stop is set by the runtime's own progress (the positions it has evaluated) and
counted by how often llama.cpp asks, so a busy machine changes nothing."""
from __future__ import annotations

import threading

import pytest

from engine.errors import TurnCancelled


class StopAfter(threading.Event):
    """Set once the runtime has `n_past` positions cached and has been asked `polls` more times
    (0: at the check between two batches; more: inside the next batch's graph)."""

    def __init__(self, rt, n_past: int, polls: int) -> None:
        super().__init__()
        self.rt, self.n_past, self.polls, self.asked = rt, n_past, polls, 0

    def is_set(self) -> bool:
        if self.rt._n_past >= self.n_past:
            self.asked += 1
        return self.asked > self.polls


@pytest.fixture(scope="module")
def small_batches(model_path):
    """Batches of 32 tokens: a prompt of a few batches is quick to evaluate again and again."""
    from engine.llama.runtime import LoadParams, TextRuntime
    from tests.conftest import N_THREADS

    rt = TextRuntime(LoadParams(model_path, n_ctx=512, n_threads=N_THREADS, n_batch=32))
    yield rt
    rt.close()


def _prompt(rt) -> list[int]:
    text = " ".join(f"item {i} is a word" for i in range(20))
    tokens = rt.tokenize(text, add_special=True)
    assert len(tokens) > 2 * rt.params.n_batch
    return tokens


def _greedy(rt, n: int) -> list[int]:
    return [rt.decode_greedy() for _ in range(n)]


@pytest.mark.parametrize("polls", [0, 40], ids=["between-batches", "inside-a-batch"])
def test_stop_ends_a_prefill_and_the_cache_goes_on_from_where_it_stopped(small_batches, polls):
    rt = small_batches
    rt.reset()
    tokens = _prompt(rt)
    stop = StopAfter(rt, rt.params.n_batch, polls)
    with pytest.raises(TurnCancelled, match="stopped during the prompt"):
        rt.prefill(tokens, stop)
    assert rt._n_past == rt.params.n_batch  # the first batch stays; the second left no cell
    L = __import__("llama_cpp")
    assert L.llama_memory_seq_pos_max(L.llama_get_memory(rt.ctx), 0) == rt._n_past - 1
    if polls:
        assert stop.asked > polls  # the callback asked inside the batch: that is what stopped it
    # the next prefill reuses what was evaluated and the reply is the one of an unbroken run
    assert rt.prefill(tokens) == len(tokens) - rt.params.n_batch
    after_stop = _greedy(rt, 6)
    rt.reset()
    rt.prefill(tokens)
    assert after_stop == _greedy(rt, 6)
    # and the abort callback is off again: a later prefill with an unset event runs to the end
    rt.reset()
    assert rt.prefill(tokens, threading.Event()) == len(tokens)
    assert rt._n_past == len(tokens)
