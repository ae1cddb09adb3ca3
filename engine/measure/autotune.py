"""`ebb-engine autotune`: how many layers on the accelerator, found by measuring.

Each point is a real run: the model loaded with `k` layers on the accelerator (llama.cpp's
count: the output layer first, then the last repeating layers) in the layout a session runs
(the live mover's: KV cache and compute on the device; `live=False`: llama.cpp's own split),
a fixed prompt evaluated in one
batch (prompt tokens/s) and then tokens generated one at a time, each waiting for its logits
(generation tokens/s). The search assumes throughput over 1..max layers is unimodal (rises
while the accelerator is faster, collapses past a cliff), so:

- `k = 0` (no accelerator at all, no graph splits) is always measured: it is its own regime;
- on 1..max, the top is checked first (throughput still rising at `max`, or level within 3%:
  the best is `max`), then a golden-section search narrows the rest to three neighbours;
- prompt and generation share every run (one run measures both). A metric whose top check
  fails gets its own search; when both fail, one search steers by their sum (each as a
  speed-up over `k = 0`), so the count of runs stays that of one search.

The answer for each metric is the best run measured, whatever steered the search.

`max` is the most layers whose weights, KV cache and compute buffer fit the budget, keeping
the projector's room beside them when vision is resident.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from engine.errors import EbbError
from engine.gguf.info import ModelInfo
from engine.config import default_threads
from engine.placement.plan import DoesNotFit, device_layers, plan_placement
from engine.tune_result import FA_TIE, FlashChoice, Point, TuneResult

if TYPE_CHECKING:
    from engine.llama.runtime import TextRuntime

PROMPT_TEXT = ("Ebb keeps the vision projector in system memory and borrows the accelerator "
               "only while an image is encoded. ")
INV_PHI = (math.sqrt(5) - 1) / 2
# flash attention is chosen by the time of a chat turn a few turns in: FA_FILL tokens of
# history cached (at most the context less the turn), a message of FA_PROMPT tokens, a reply
# of FA_GEN; within FA_TIE (engine/tune_result.py) the setting asked for stays
FA_FILL, FA_PROMPT, FA_GEN = 2048, 128, 32
__all__ = ["FA_TIE", "FlashChoice", "Point", "TuneResult", "autotune", "choose_flash_attn"]


class Cancelled(EbbError):
    pass


class Measurer:
    """Loads the model at a layer count and times a prompt and a generation. Owned by one
    thread; results are memoised (a point is measured once)."""

    def __init__(self, model_path: Path, info: ModelInfo, accel: str, n_ctx: int,
                 n_threads: int | None, flash_attn: bool = True, n_batch: int = 512,
                 prompt_tokens: int = 256, gen_tokens: int = 48,
                 on_point: Callable[[Point], None] | None = None,
                 cancel: threading.Event | None = None, live: bool = True,
                 threads: Sequence[int] | None = None, image_tokens: int = 0) -> None:
        self.model_path, self.info, self.accel = model_path, info, accel
        # thread counts to search (prompt and generation each pick theirs); None: a coarse
        # grid over the physical cores and a local search around its best
        self.threads = tuple(threads) if threads else None
        # also time a prompt as long as an image's tokens (a larger batch, a larger compute
        # buffer: its sweet spot and cliff may sit elsewhere); 0: text only
        self.image_tokens = image_tokens
        self.n_ctx, self.n_threads, self.flash_attn, self.n_batch = n_ctx, n_threads, flash_attn, n_batch
        self.prompt_tokens, self.gen_tokens = prompt_tokens, gen_tokens
        self.on_point, self.cancel = on_point, cancel
        self.live = live  # measure the live mover's layout (what a session runs), else llama.cpp's
        self.points: dict[int, Point] = {}
        self.busy_beside: list[int] = []  # the machine's other runnable tasks, at each point

    def load_beside(self) -> float | None:
        """The median of the other work seen beside the measurement (None: not known)."""
        import statistics

        return statistics.median(self.busy_beside) if self.busy_beside else None

    def __call__(self, layers: int) -> Point:
        if layers not in self.points:
            if self.cancel is not None and self.cancel.is_set():
                raise Cancelled("autotune cancelled")
            self.points[layers] = self.measure(layers)
            self._note_load()
            if self.on_point is not None:
                self.on_point(self.points[layers])
        return self.points[layers]

    def _note_load(self) -> None:
        """What else runs on the machine now, besides this thread (ours spin only while a
        decode runs: between points the count is the others')."""
        from engine.llama.thread_share import ProcSampler

        sampler = ProcSampler()
        try:
            running = sampler.running()
        finally:
            sampler.close()
        if running is not None:
            self.busy_beside.append(max(0, running - 1))

    def _params(self, layers: int, flash_attn: bool) -> Any:
        """The load at `layers` on the accelerator, in the layout a session runs."""
        from engine.llama.loaded_model import LoadParams

        params = LoadParams(self.model_path, n_ctx=self.n_ctx, n_threads=self.n_threads,
                            n_gpu_layers=layers, devices=(self.accel,) if layers else (),
                            flash_attn=flash_attn, n_batch=self.n_batch)
        if self.live and layers:  # as the live mover leaves it with `layers` on the device
            from engine.placement.residency import live_overrides

            n = self.info.n_layers
            params = replace(params, n_gpu_layers=n + 1, repack=False,
                             buft_overrides=live_overrides(self.accel, device_layers(n, layers)))
        return params

    def turn_s(self, layers: int, flash_attn: bool, fill: int, threads: tuple[int, int]) -> float:
        """Seconds of a chat turn with `fill` tokens of history in the cache: a new message of
        FA_PROMPT tokens evaluated, then FA_GEN tokens generated (greedy, each waiting for its
        logits), with (prompt, generation) threads. The fill itself is not timed."""
        from engine.llama.runtime import TextRuntime

        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled("autotune cancelled")
        with TextRuntime(self._params(layers, flash_attn), self.info) as rt:
            piece = rt.tokenize(PROMPT_TEXT * 8, add_special=False)
            tokens = (piece * ((fill + FA_PROMPT) // len(piece) + 1))[:fill + FA_PROMPT]
            rt.set_threads(threads[1], threads[0])
            if fill:
                rt.prefill(tokens[:fill])
            t0 = time.perf_counter()
            rt.prefill(tokens)  # the fill is cached: only the message is evaluated
            for _ in range(FA_GEN):
                rt.decode_greedy()
            return time.perf_counter() - t0

    def measure(self, layers: int) -> Point:
        """One fresh run at `layers` (not remembered; calling the Measurer remembers)."""
        from engine.llama.runtime import TextRuntime

        params = self._params(layers, self.flash_attn)
        t0 = time.perf_counter()
        with TextRuntime(params, self.info) as rt:
            load_s = time.perf_counter() - t0
            accel_bytes = sum(n for (dev, _), n in rt.buffers.items() if dev == self.accel)
            tokens: list[int] = []
            while len(tokens) < self.prompt_tokens:
                tokens += rt.tokenize(PROMPT_TEXT, add_special=not tokens)
            tokens = tokens[:min(self.prompt_tokens, self.n_ctx - self.gen_tokens - 16)]
            rt.prefill(tokens[:8])  # warm-up: first-use costs stay out of the timings
            runs: dict[int, tuple[float, float, float]] = {}

            def at(t: int) -> tuple[float, float, float]:  # one thread count: no reload
                if t not in runs:
                    runs[t] = self._time_phases(rt, tokens, t)
                return runs[t]

            grid = self.threads or thread_grid(default_threads(self.n_threads))
            for t in grid:
                at(t)
            if self.threads is None:  # between the grid's neighbours of each phase's best
                for phase in (0, 1):
                    best = max(grid, key=lambda t: at(t)[phase])
                    i = grid.index(best)
                    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
                    if hi - lo > 2:
                        golden_max(lambda t: at(t)[phase], lo, hi)
        prompt_by = {t: v[0] for t, v in runs.items()}
        gen_by = {t: v[1] for t, v in runs.items()}
        image_by = {t: v[2] for t, v in runs.items() if v[2]}
        pt, gt = fewest_within_noise(prompt_by), fewest_within_noise(gen_by)
        return Point(layers, prompt_by[pt], gen_by[gt], load_s, accel_bytes, pt, gt,
                     prompt_by, gen_by, image_by.get(pt, 0.0), image_by)

    def _check(self) -> None:
        """Stop (or a closed window) ends a run between its timings, not only between runs."""
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled("autotune cancelled")

    def _time_phases(self, rt: TextRuntime, tokens: list[int], t: int) -> tuple[float, float, float]:
        """(prompt, generation, image-sized prompt) tokens/s with `t` threads; the last is 0
        without image tokens to time."""
        rt.set_threads(t, t)

        def prefill_tps(toks: list[int]) -> float:
            best = math.inf
            for _ in range(2):  # the faster of two: a busy box only ever adds time
                self._check()
                rt.slot.reset()
                t1 = time.perf_counter()
                rt.prefill(toks)  # waits for the device
                best = min(best, time.perf_counter() - t1)
            return len(toks) / best

        image_tps = 0.0
        if self.image_tokens:
            room = self.n_ctx - 16
            reps = self.image_tokens // max(len(tokens), 1) + 1
            image = (tokens * reps)[:min(self.image_tokens, room)]
            image_tps = prefill_tps(image)
        prompt_tps = prefill_tps(tokens)  # last: generation goes on from this prompt

        def token() -> float:  # greedy, as a reply is generated; waits for the logits
            t2 = time.perf_counter()
            rt.decode_greedy()
            return time.perf_counter() - t2

        for _ in range(4):  # right after a big batch the first tokens run slow on a busy box
            token()
        bursts = []
        for _ in range(3):
            self._check()
            bursts.append(float(np.percentile([token() for _ in range(self.gen_tokens // 3)], 20)))
            time.sleep(0.02)
        # waits on a busy machine (a sleeping thread woken late, another process) only ever add
        # time: the fastest burst's fast end is the device's own speed
        return prompt_tps, 1.0 / min(bursts), image_tps


def thread_grid(cores: int) -> list[int]:
    """1, 2, 4, … up to the physical cores, and the cores themselves."""
    grid, t = [], 1
    while t < cores:
        grid.append(t)
        t *= 2
    return grid + [cores]


def fewest_within_noise(tps_by_threads: dict[int, float], tie: float = 0.03) -> int:
    """The fewest threads whose speed is within measurement noise of the best (fewer threads
    leave cores to the rest of the machine)."""
    best = max(tps_by_threads.values())
    return min(t for t, v in tps_by_threads.items() if v * (1 + tie) >= best)


TIE = 0.03  # two runs this close are level: measurement noise


def top_wins(f: Callable[[int], float], hi: int, tie: float = TIE) -> bool:
    """The next lower count is not better than `hi` by more than `tie`."""
    return f(hi - 1) <= f(hi) * (1 + tie)


def golden_max(f: Callable[[int], float], lo: int, hi: int, tie: float = TIE) -> int:
    """The integer in [lo, hi] where a unimodal `f` is largest. Checks the top first: if the
    next lower count is not better by more than `tie` (measurement noise), the top wins (more
    on the accelerator, within one layer of the peak). Otherwise golden-section over the rest
    until three neighbours are left, all of them evaluated."""
    if hi - lo <= 2:
        return max(range(lo, hi + 1), key=f)
    if top_wins(f, hi, tie):  # still rising at the top: a unimodal f peaks there
        return hi
    a, b = lo, hi - 1  # the top is beaten by its neighbour
    c, d = b - round((b - a) * INV_PHI), a + round((b - a) * INV_PHI)
    if c >= d:
        c, d = d - 1, d
    while b - a > 2 and c < d:
        if f(c) >= f(d):  # the peak is in [a, d]; c becomes the upper probe
            b, d = d, c
            c = max(a, min(b - round((b - a) * INV_PHI), d - 1))
        else:  # the peak is in [c, b]; d becomes the lower probe
            a, c = c, d
            d = min(b, max(a + round((b - a) * INV_PHI), c + 1))
    return max(range(a, b + 1), key=f)


def find_cliff(points: list[Point], metric: Callable[[Point], float],
               drop: float = 0.25) -> int | None:
    """The layer count past the best where throughput first falls by more than `drop` from
    the run before: the cliff. None when the measured curve has none."""
    ps = sorted(points, key=lambda p: p.layers)
    best = max(range(len(ps)), key=lambda i: metric(ps[i]))
    for prev, cur in zip(ps[best:], ps[best + 1:]):
        if metric(cur) < (1 - drop) * metric(prev):
            return cur.layers
    return None


def max_layers(info: ModelInfo, accel: str, budget: int, n_ctx: int, n_batch: int,
               flash_attn: bool, headroom: int, live: bool = True) -> int:
    """The most layers (llama.cpp's count) that fit `budget` beside `headroom`; 0: none."""
    placement = plan_placement(info, accel, budget, n_ctx, n_batch, flash_attn, headroom, live)
    return 0 if isinstance(placement, DoesNotFit) else placement.n_gpu_layers


def planned_runs(top: int) -> int:
    """About how many runs autotune makes over 0..top layers: all of them up to 3, else the
    run at 0 and a golden-section search (about log_phi(top) + 2)."""
    import math

    if top <= 3:
        return top + 1
    return 1 + math.ceil(math.log(top) / math.log((1 + 5 ** 0.5) / 2)) + 2


def choose_flash_attn(measure: Measurer, layers: int, budget: int, headroom: int,
                      threads: tuple[int, int], rounds: int = 2, history: int = FA_FILL) -> FlashChoice:
    """Flash attention on or off at `layers`, by the time of a chat turn with history (see
    FA_FILL): each setting `rounds` times, alternating which goes first; each one's fastest
    run counts (a busy machine only adds time). A setting whose buffers do not fit the budget
    at `layers` is not run."""
    fill = max(0, min(history, measure.n_ctx - FA_PROMPT - FA_GEN - 64))
    fits = {fa: layers == 0 or max_layers(measure.info, measure.accel, budget, measure.n_ctx,
                                         measure.n_batch, fa, headroom, measure.live) >= layers
            for fa in (True, False)}
    times: dict[bool, float] = {True: 0.0, False: 0.0}
    for r in range(rounds):
        for fa in ((True, False) if r % 2 == 0 else (False, True)):
            if fits[fa]:
                t = measure.turn_s(layers, fa, fill, threads)
                times[fa] = min(times[fa], t) if times[fa] else t
    on = FlashChoice.decide(times[True], times[False], measure.flash_attn)
    if not all(fits.values()):
        reason = f"only {'on' if fits[True] else 'off'} fits the budget at {layers} layers"
    elif abs(times[True] - times[False]) <= FA_TIE * min(times.values()):
        reason = f"within {FA_TIE:.0%}: kept {'on' if on else 'off'}"
    else:
        reason = f"{'on' if on else 'off'} is {max(times.values()) / min(times.values()):.2f}x faster"
    return FlashChoice(on, layers, fill, times[True], times[False], reason)


def autotune(measure: Measurer, budget: int, headroom: int, flash_attn: bool = False,
             on_flash: Callable[[int], None] | None = None, flash_history: int = FA_FILL) -> TuneResult:
    """`flash_attn`: also choose flash attention at the best generation layers (choose_flash_attn,
    with `flash_history` tokens of history; `on_flash(runs)` is told before those runs start)."""
    info = measure.info
    top = max_layers(info, measure.accel, budget, measure.n_ctx, measure.n_batch,
                     measure.flash_attn, headroom, measure.live)

    def gen(k: int) -> float:
        return measure(k).gen_tps

    def prompt(k: int) -> float:
        return measure(k).prompt_tps

    base = measure(0)
    if 0 < top <= 3:  # the whole range is cheaper than a search
        for k in range(1, top + 1):
            measure(k)
    elif top:
        below = [f for f in (gen, prompt) if not top_wins(f, top)]
        if len(below) == 2:  # both peak below the top: one search, not two diverging on noise
            golden_max(lambda k: gen(k) / base.gen_tps + prompt(k) / base.prompt_tps, 1, top)
        elif below:
            golden_max(below[0], 1, top)
    # the searches steer by their assumption (one peak); the answer is what was measured
    pts = list(measure.points.values())
    best_gen = max(pts, key=lambda p: p.gen_tps).layers
    best_prompt = max(pts, key=lambda p: p.prompt_tps).layers
    best_image = cliff_image = None
    if measure.image_tokens:
        best_image = max(pts, key=lambda p: p.image_tps).layers
        cliff_image = find_cliff(pts, lambda p: p.image_tps)
    fa = None
    if flash_attn:
        if on_flash is not None:
            on_flash(4)
        best = measure(best_gen)
        fa = choose_flash_attn(measure, best_gen, budget, headroom,
                               (best.prompt_threads or default_threads(measure.n_threads),
                                best.gen_threads or default_threads(measure.n_threads)),
                               history=flash_history)
    return TuneResult(measure.accel, budget, headroom, top, best_gen, best_prompt, tuple(pts),
                      find_cliff(pts, lambda p: p.gen_tps), find_cliff(pts, lambda p: p.prompt_tps),
                      measure.image_tokens, best_image, cliff_image, fa, measure.load_beside())


def sweep(measure: Measurer, top: int) -> list[Point]:
    """Every layer count 0..top: what autotune avoids (tests compare against it)."""
    return [measure(k) for k in range(top + 1)]

