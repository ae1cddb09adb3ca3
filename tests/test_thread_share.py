"""#71: the thread count that follows a shared CPU (engine/llama/thread_share.py), its logic
against a machine model with the figures measured on the 2-core EPYC (idle: 2 threads 100
tok/s, 1 thread 75; one busy loop beside: 2 threads 33, 1 thread 70), and the runtime that
changes its threads between decodes while a real busy loop shares its cores."""
from __future__ import annotations

import subprocess
import sys

from engine.llama.thread_share import PROBE_EVERY_STEPS, TRY_STEPS, ProcSampler, ThreadShare

TOK_S = {(0, 2): 100.0, (0, 1): 75.0, (1, 2): 33.0, (1, 1): 70.0, (2, 2): 25.0, (2, 1): 45.0}


def _step(share: ThreadShare, hogs: int) -> int:
    """One token on the model machine: its wall and CPU time as the threads got them."""
    n = share.current
    wall = 1.0 / TOK_S[(hogs, n)]
    got = min(1.0, 2 / (n + hogs))  # each runnable thread's part of the 2 cores
    return share.observe(wall, n * got * wall, 1, hogs)


def test_the_count_drops_when_a_busy_loop_comes_and_returns_when_it_goes():
    share = ThreadShare(most=2, cores=2)
    counts = [_step(share, 0) for _ in range(100)]
    assert counts == [2] * 100  # idle: all the cores
    busy = [_step(share, 1) for _ in range(200)]
    # within a few tokens: one thread (a probe of two, now and then, is short)
    assert busy[9] == 1 and busy[10:].count(2) <= TRY_STEPS
    # the machine is freed: back to two (the room beside it is seen)
    free = [_step(share, 0) for _ in range(50)]
    assert free[10:] == [2] * 40
    assert counts.count(2) + busy.count(2) + free.count(2) > 0


def test_a_try_that_does_not_pay_goes_back_and_waits_longer_each_time():
    """Two busy loops: the count stays one; the probes of two (every PROBE_EVERY_STEPS) are
    short, go back, and come less often."""
    share = ThreadShare(most=2, cores=2, current=1)
    counts = [_step(share, 2) for _ in range(PROBE_EVERY_STEPS * 6 + 10)]
    at_two = sum(1 for c in counts if c == 2)
    assert counts[-1] == 1 and at_two <= TRY_STEPS * 6
    assert share.changes <= 2 * 6


def test_signals_that_lie_are_overruled_by_the_times():
    """A step that reads a low share while the time says two threads are faster (a GUI thread
    or a device wait skews the CPU figure): the count tried is judged by its time and goes back."""
    share = ThreadShare(most=2, cores=2)
    # the CPU figure says a thread waited (share 0.5), the times say one thread is no faster
    counts = [share.observe(0.010, 0.010, 1, 0) for _ in range(300)]
    assert counts.count(2) > 0.8 * len(counts)  # each try of one went back, and waited longer
    assert share._back_off_len[1] > 32


def test_the_machine_sampler_reads_this_machine():
    sampler = ProcSampler()
    try:
        running = sampler.running()
        assert running is None or running >= 1  # this thread at least
        assert ProcSampler.cpu_s() > 0
    finally:
        sampler.close()


def test_the_runtime_uses_fewer_threads_while_a_busy_loop_shares_its_cores(model_path):
    """A real busy loop beside a real decode: a runtime whose threads nobody chose comes down
    to fewer than it started with, changing them between decodes (no timing is asserted: the
    count is). Skipped where there is one core (nothing to share)."""
    import pytest

    from engine.hw import physical_cores
    from engine.llama.loaded_model import LoadParams
    from engine.llama.runtime import TextRuntime
    from engine.llama.sampling import GenParams

    cores = physical_cores()
    if cores < 2:
        pytest.skip("one core: no thread to give back")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    rt = TextRuntime(LoadParams(model_path, n_ctx=512, share_threads=True))
    counts: list[tuple[int, int]] = []
    real = rt.set_threads

    def set_threads(n: int, n_batch: int) -> None:  # what the runtime asked llama.cpp for
        counts.append((n, n_batch))
        real(n, n_batch)

    rt.set_threads = set_threads  # type: ignore[method-assign]
    try:
        assert rt.n_threads == cores
        rt.generate([{"role": "user", "content": "Count from one to a hundred."}],
                    GenParams(max_tokens=96, temperature=0))
        assert any(n < cores for n, _ in counts), (counts, rt.shares)
    finally:
        for h in hogs:
            h.kill()
        rt.close()


def test_only_threads_nobody_chose_on_a_model_the_cpu_runs_are_shared(model_path):
    """The setting (Settings' threads, --threads, a tuning's per-phase choice) is kept exactly;
    with none, a model on the CPU shares (numerics-comparing tests fix their threads)."""
    from engine.session import Session, SessionConfig

    with Session(SessionConfig(model_path, None, n_ctx=256)) as s:
        assert s.model.runtime.shares is not None
    with Session(SessionConfig(model_path, None, n_ctx=256, n_threads=1)) as s:
        assert s.model.runtime.shares is None


def test_a_split_with_its_server_on_this_machine_leaves_the_server_half_the_cores(model_path, rpc_server):
    """#71, Ebb's own processes by plan: with some layers on an RPC server on this machine (the
    stand-in) and the rest on the CPU, the server computes its layers on the same cores between
    ours, so a token's decode takes half of them and a prompt's batches all; threads the user
    chose, or all layers on the server (the engine then only waits), stay as they are."""
    from engine.config import SessionConfig
    from engine.hw import physical_cores
    from engine.session import Session
    from engine.units import parse_size

    cores = physical_cores()
    for budget, threads, want in (("200MiB", None, (max(1, cores // 2), cores)),
                                  ("200MiB", 2, (2, 2)), ("380MiB", None, (cores, cores))):
        cfg = SessionConfig(model_path, rpc=(rpc_server.endpoint,), n_threads=threads,
                            vram_budget_bytes=parse_size(budget))
        with Session(cfg) as s:
            rt = s.model.runtime
            split = 0 < s.model.placement.n_layers_on_accel < s.info.n_layers
            assert split == (budget == "200MiB"), s.model.placement
            assert (rt.n_threads, rt.n_threads_batch) == want, (budget, threads)
