"""Stop ends a prefill within about one batch (#26): between batches, and inside a long batch
through llama.cpp's abort callback (libc's strlen on a flag a watcher thread sets: no Python
per graph node), leaving the KV cache and its books consistent.

No timing: the stop is set by the runtime's own progress (the positions it has evaluated), and
for the in-batch case only the watcher thread is told, so only the abort callback can stop it.
"""
from __future__ import annotations

import threading

import pytest

from engine.errors import TurnCancelled


class StopOnceEvaluated(threading.Event):
    """Set once the runtime has `n_past` positions cached; `watcher_only`: as seen from any
    thread but the main one (the between-batch check never fires, the abort callback must)."""

    def __init__(self, rt, n_past: int, watcher_only: bool) -> None:
        super().__init__()
        self.rt, self.n_past, self.watcher_only = rt, n_past, watcher_only

    def is_set(self) -> bool:
        if self.watcher_only and threading.current_thread() is threading.main_thread():
            return False
        return self.rt.slot.n_past >= self.n_past


@pytest.fixture(scope="module")
def small_batches(model_path):
    """Batches of 32 tokens: a prompt is many batches, quick to evaluate again and again."""
    from engine.llama.loaded_model import LoadParams
    from engine.llama.runtime import TextRuntime
    from tests.helpers import N_THREADS

    rt = TextRuntime(LoadParams(model_path, n_ctx=1024, n_threads=N_THREADS, n_batch=32))
    yield rt
    rt.close()


def _prompt(rt, n_items: int) -> list[int]:
    text = " ".join(f"item {i} is a word" for i in range(n_items))
    tokens = rt.tokenize(text, add_special=True)
    assert len(tokens) > 2 * rt.params.n_batch
    return tokens


def _greedy(rt, n: int) -> list[int]:
    return [rt.decode_greedy() for _ in range(n)]


@pytest.mark.numerics
@pytest.mark.parametrize("inside", [False, True], ids=["between-batches", "inside-a-batch"])
def test_stop_ends_a_prefill_and_the_cache_goes_on_from_where_it_stopped(small_batches, inside):
    """SAME PATH: the prefill that goes on after a Stop reads the batches an unbroken one reads
    (a Stop between batches leaves whole batches, one inside the first leaves none)."""
    import llama_cpp as L

    rt = small_batches
    rt.slot.reset()
    tokens = _prompt(rt, 20)
    # inside: Stop is seen only by the watcher, at its first look, which comes before the
    # prompt starts; only the abort callback can then stop the first batch's graph
    stop = StopOnceEvaluated(rt, 0 if inside else rt.params.n_batch, watcher_only=inside)
    with pytest.raises(TurnCancelled, match="stopped during the prompt"):
        rt.prefill(tokens, stop)
    n = rt.slot.n_past
    if inside:  # the aborted batch left no cell
        assert n == 0
    else:  # at the check before the second batch
        assert n == rt.params.n_batch
    assert L.llama_memory_seq_pos_max(L.llama_get_memory(rt.ctx), 0) == n - 1
    # the next prefill reuses what was evaluated and the reply is the one of an unbroken run
    assert rt.prefill(tokens) == len(tokens) - n
    after_stop = _greedy(rt, 6)
    rt.slot.reset()
    rt.prefill(tokens)
    assert after_stop == _greedy(rt, 6)
    # and the abort callback is off again: a later prefill with an unset event runs to the end
    rt.slot.reset()
    assert rt.prefill(tokens, threading.Event()) == len(tokens)
    assert rt.slot.n_past == len(tokens)


def test_a_prompt_stopped_while_read_keeps_what_it_read_in_its_figures(small_batches):
    """#67: a reply stopped while its prompt was read was saved as "0 tokens · prompt 0.00s";
    its figures keep the tokens read and the time spent."""
    from engine.llama.sampling import GenParams
    from engine.stops import StopReason

    rt = small_batches
    rt.slot.reset()
    tokens = _prompt(rt, 20)
    stop = StopOnceEvaluated(rt, rt.params.n_batch, watcher_only=False)
    with pytest.raises(TurnCancelled) as caught:
        rt.generate_from(tokens, GenParams(max_tokens=2), cancel=stop)
    stats = caught.value.stats
    assert stats.stop_reason == StopReason.CANCELLED and stats.n_prompt_tokens == len(tokens)
    assert stats.n_prompt_tokens_evaluated == rt.params.n_batch == rt.slot.n_past
    assert stats.prompt_s > 0 and stats.n_gen_tokens == 0


def test_a_prompt_on_the_stand_in_tells_its_progress_and_stops_between_batches(
        shared_rpc_server, model_path):
    """With every layer on the stand-in accelerator (an RPC device), a long prompt tells how
    far it got after each batch (the window's status line and Steps lane: "1,024 of 3,850
    tokens"), and Stop ends it at the next batch with the cache holding what was evaluated.
    No timing is asserted: where it stopped is."""
    from engine.llama.devices import connect_rpc, remote_device_names
    from engine.llama.loaded_model import LoadParams
    from engine.llama.runtime import TextRuntime
    from tests.helpers import N_THREADS

    connect_rpc(shared_rpc_server.endpoint)
    device = remote_device_names(shared_rpc_server.endpoint)[0]
    rt = TextRuntime(LoadParams(model_path, n_ctx=4096, n_threads=N_THREADS, n_gpu_layers=99,
                                devices=(device,)))
    try:
        tokens = rt.tokenize(" ".join(f"item {i} is a word" for i in range(330)), add_special=True)
        assert len(tokens) > 3 * rt.params.n_batch
        stop, seen = threading.Event(), []

        def progress(done: int, total: int) -> None:
            seen.append((done, total))
            if len(seen) == 2:
                stop.set()

        rt.stop_within_s = 1e-6  # a batch ends "at once" only at the smallest size: 32 tokens
        with pytest.raises(TurnCancelled):
            rt.prefill(tokens, stop, progress)
        # the first batch before any was timed, then batches sized to end within the target
        assert seen == [(128, len(tokens)), (128 + 32, len(tokens))]
        assert rt.slot.n_past == 160 < len(tokens)
    finally:
        rt.close()


def test_a_prompt_batch_on_a_device_is_sized_to_end_within_the_stop_target():
    """#67: on a device a batch cannot be stopped midway (the stand-in computes it whole: 1.6-4 s
    for 512 tokens on 2 cores): each is sized by the last one's pace to end within 0.5 s."""
    from engine.llama.runtime import prompt_batch_within

    assert prompt_batch_within(512, 0, 0.0, 0.5) == 128  # nothing timed yet
    assert prompt_batch_within(512, 128, 0.5, 0.5) == 128  # on target
    assert prompt_batch_within(512, 128, 0.1, 0.5) == 512  # a fast GPU: whole batches
    assert prompt_batch_within(512, 512, 2.0, 0.5) == 128  # the stand-in, idle
    assert prompt_batch_within(512, 128, 4.0, 0.5) == 32  # under load: never below 32
    assert prompt_batch_within(256, 32, 0.001, 0.5) == 256


def test_a_prompt_being_read_is_one_growing_step_in_the_panel():
    """The Steps lane draws the prompt while it is read (its span so far, how many tokens of
    how many), and its whole span takes that place at its end."""
    from engine import events
    from engine.telemetry import Telemetry

    tel = Telemetry()
    tel.on_event(events.Span(1, name="plan", start_s=9.0, end_s=9.5, device="CPU"))
    for done, t in ((64, 10.5), (512, 11.5)):
        tel.on_event(events.PrefillProgress(1, start_s=10.0, n_done=done, n_total=900,
                                            device="RPC0", t_s=t))
    assert [s.name for s in tel.spans] == ["plan", "prefill"]
    assert tel.spans[-1].detail == "512 of 900 tokens so far" and tel.spans[-1].end_s == 11.5
    tel.on_event(events.Span(1, name="prefill", start_s=10.0, end_s=12.0, device="RPC0"))
    tel.on_event(events.Span(1, name="decode", start_s=12.0, end_s=13.0, device="RPC0"))
    assert [(s.name, s.detail) for s in tel.spans] == [("plan", ""), ("prefill", ""), ("decode", "")]


def test_a_turn_stopped_while_its_prompt_is_read_keeps_its_prefill_step_and_figures(model_path):
    """#67: Stop during the prompt: the turn's figures keep the tokens read and the time (they
    were saved as "0 tokens · prompt 0.00s"), and its Steps lane keeps the prefill so far."""
    from engine import events
    from engine.llama.sampling import GenParams
    from engine.session import Session, SessionConfig
    from engine.stops import StopReason
    from tests.helpers import N_THREADS

    stop = threading.Event()

    def on_event(ev) -> None:
        if isinstance(ev, events.PrefillProgress):
            stop.set()  # at the first batch's end, as a click would land

    cfg = SessionConfig(model_path, None, n_ctx=1024, n_threads=N_THREADS, n_batch=32)
    with Session(cfg, emit=on_event) as s:
        text = " ".join(f"item {i} is a word" for i in range(40))
        res = s.turn(text, [], GenParams(max_tokens=4, temperature=0), cancel=stop)
    assert res.gen.stop_reason == StopReason.CANCELLED and res.error is None
    assert 0 < res.gen.n_prompt_tokens_evaluated < res.gen.n_prompt_tokens and res.gen.prompt_s > 0
    assert "prefill" in [sp.name for sp in res.spans]
