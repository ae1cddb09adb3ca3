"""A fair share of a busy machine: how many threads a phase (generation, or prompt batches)
decodes with, chosen again between decodes from what the threads got.

llama.cpp's threads meet at a barrier after every op and spin there (OpenMP in our build).
When another process holds one of their cores, the whole step waits for the thread that is not
running: on 2 cores with one busy loop beside, 2 threads ran at 0.3 of 1 thread's speed
(docs/performance.md). So each step is watched:

- **the share**: the CPU time the process got during the step against `threads x wall`. Threads
  that own their cores spin through every barrier, so it is about 1; below SHARE_LOW, a thread
  waited for a core. Then one thread fewer is tried.
- **the room**: the machine's runnable tasks (`/proc/stat` procs_running) beside ours. Fewer
  than the cores left free: one thread more is tried (the machine was freed).
- **the proof**: a count that was tried is kept only if its steps are faster per token than
  the count before (TRY_STEPS of each, the time per token over all of them: a median hides the
  stalls that make the cost, and the steps before are the latest, under the same load); else the old count comes back and that move is
  not tried again for a while (BACK_OFF_STEPS, doubled at each failure up to a limit). A count
  is also re-tried now and then (PROBE_EVERY_STEPS), so a change the signals miss is found.

`ThreadShare` is pure (the caller measures and reads /proc); `ProcSampler` does the reading.
The runtime's thread calls both, between decodes.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

SHARE_LOW = 0.85  # below this share of `threads x wall` a thread waited for its core
# steps a tried count runs before it is judged, against as many of the count before: long enough
# to hold the stalls (2 threads beside a busy loop ran 11-15 ms a token, and 130-180 ms every
# eighth or so, when the loop took a thread's core at a barrier)
TRY_STEPS = 8
WATCH_STEPS = 3  # steps in a row a signal must hold before a count is tried
BETTER_BY = 0.95  # a tried count is kept when its time per token is under this x the old's
BACK_OFF_STEPS = 32  # a move that did not pay is not tried again for this many steps (doubling)
BACK_OFF_MOST = 1024
PROBE_EVERY_STEPS = 256  # with no signal, the other count is tried now and then all the same
GAP_S = 1.0  # steps further apart than this may be under another load: a try is not judged across


@dataclass
class ThreadShare:
    """The thread count of one phase, between 1 and `most`, on a machine of `cores` cores."""
    most: int
    cores: int
    current: int = 0
    # steps a try runs and a signal must hold: generation's tokens are short and many; a
    # prompt's batches long and few (a 700-token prompt is two), each one telling alone
    try_steps: int = TRY_STEPS
    watch_steps: int = WATCH_STEPS
    # the count before a try, and the per-token times of the steps since the try began
    _before: int = 0
    _before_times: list[float] = field(default_factory=list)
    _trying: list[float] = field(default_factory=list)
    _recent: list[float] = field(default_factory=list)  # the current count's last step times
    _low_share: int = 0  # steps in a row with a low share
    _was_low: bool = False  # the last step's share was low
    _room: int = 0  # steps in a row with a free core beside us
    _steps: int = 0
    _last_s: float | None = None  # when the last step ended
    _back_off: dict[int, int] = field(default_factory=dict)  # count -> step before which not tried
    _back_off_len: dict[int, int] = field(default_factory=dict)
    changes: int = 0  # how often the count changed (benches and the panel say it)

    def __post_init__(self) -> None:
        self.most = max(1, self.most)
        self.current = min(max(1, self.current or self.most), self.most)

    def observe(self, wall_s: float, cpu_s: float, n_tokens: int, others_running: int | None,
                now_s: float | None = None) -> int:
        """One step's figures: its wall and process CPU seconds, the tokens it decoded, the
        runnable tasks beside ours (None: not read this step), and when it ended (monotonic
        seconds; None: steps come back to back). Returns the count for the next step."""
        self._steps += 1
        if now_s is not None:
            if self._last_s is not None and now_s - wall_s - self._last_s > GAP_S:
                self._new_regime()  # a pause (another prompt, the user): what came before is old
            self._last_s = now_s
        if wall_s <= 0 or n_tokens <= 0:
            return self.current
        per_token = wall_s / n_tokens
        share = cpu_s / (self.current * wall_s)
        if self._before:  # a try under way: judge it after TRY_STEPS
            self._trying.append(per_token)
            if len(self._trying) >= self.try_steps:
                self._judge()
            return self.current
        low = share < SHARE_LOW and self.current > 1
        if low != self._was_low:  # another regime: the times before it say nothing of this
            self._new_regime()  # one, nor do the tries it judged
            self._was_low = low
        self._recent = (self._recent + [per_token])[-self.try_steps:]
        self._low_share = self._low_share + 1 if low else 0
        free = others_running is not None and others_running + self.current < self.cores
        self._room = self._room + 1 if free and self.current < self.most else (
            self._room if others_running is None else 0)
        if self._low_share >= self.watch_steps:
            self._try(self.current - 1)
        elif self._room >= self.watch_steps:
            self._try(self.current + 1)
        elif self._steps % PROBE_EVERY_STEPS == 0 and len(self._recent) >= self.watch_steps:
            other = self.current + 1 if self.current < self.most else self.current - 1
            self._try(other)
        return self.current

    def before_step(self, others_running: int | None) -> int:
        """Before a long step (a prompt's batch): with a core free beside us and no try under
        way, take one thread more now (a prompt after a busy spell read its first batch on one
        thread); the step's own figures correct it. Returns the count for the step."""
        if (others_running is not None and not self._before and self.current < self.most
                and others_running + self.current < self.cores):
            self.suggest(self.current + 1)
        return self.current

    def suggest(self, n: int) -> None:
        """The other phase moved to `n` (what it saw holds here too): move there, and let this
        phase's own signals and tries take it on (this phase's times are of the load before:
        judging a move against them undid the right one)."""
        if not self._before and n != self.current and 1 <= n <= self.most:
            self.current, self._recent = n, []
            self._low_share = self._room = 0
            self._back_off.clear()
            self.changes += 1

    def _try(self, n: int) -> None:
        self._low_share = self._room = 0
        if not 1 <= n <= self.most or n == self.current or self._steps < self._back_off.get(n, 0):
            return
        if len(self._recent) < (self.try_steps if n < self.current else self.watch_steps):
            return  # the current count's own time is not known yet: fewer threads are judged
            # against as many steps as they run (the stalls come every few steps)
        self._before, self._before_times = self.current, list(self._recent)
        self._trying = []
        self.current = n
        self.changes += 1

    def _new_regime(self) -> None:
        """The load may have changed: a try under way goes back to the count it left (a probe
        cut short by a pause stayed, and the next reply ran on it under two busy loops), the
        times and back-offs of before go."""
        if self._before:
            self.current = self._before
            self.changes += 1
        self._before, self._trying, self._recent = 0, [], []
        self._low_share = self._room = 0
        self._back_off.clear()

    def _judge(self) -> None:
        tried, before = self.current, self._before
        if statistics.fmean(self._trying) < BETTER_BY * statistics.fmean(self._before_times):
            self._recent = self._trying[-TRY_STEPS:]
            self._back_off_len.pop(tried, None)
        else:  # no better: back, and not again for a while (longer each time)
            span = min(self._back_off_len.get(tried, BACK_OFF_STEPS // 2) * 2, BACK_OFF_MOST)
            self._back_off_len[tried] = span
            self._back_off[tried] = self._steps + span
            self.current = before
            self._recent = self._before_times
            self.changes += 1
        self._before, self._trying = 0, []


class ProcSampler:
    """What the process got and what else runs: process CPU seconds, and the runnable tasks
    of the machine (Linux's /proc/stat; None elsewhere)."""

    def __init__(self) -> None:
        self._stat: int | None = None
        try:
            self._stat = os.open("/proc/stat", os.O_RDONLY)
        except OSError:
            self._stat = None

    @staticmethod
    def cpu_s() -> float:
        return time.process_time()

    def running(self) -> int | None:
        """Runnable tasks on the machine now (ours among them)."""
        if self._stat is None:
            return None
        try:
            data = os.pread(self._stat, 65536, 0)
        except OSError:
            return None
        at = data.find(b"procs_running ")
        if at < 0:
            return None
        end = data.find(b"\n", at)
        try:
            return int(data[at + 14:end])
        except ValueError:
            return None

    def close(self) -> None:
        if self._stat is not None:
            os.close(self._stat)
            self._stat = None
