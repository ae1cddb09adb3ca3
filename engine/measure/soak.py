"""A long session on the stand-in accelerator: many turns, every few with a new image (swaps,
the embeddings cache at its limit, the context overflowing), and what the process holds along
the way: its resident memory, the RPC server's, its open file descriptors, the ledger.

`ebb-engine bench soak` prints the figures; the fault suite runs a short one and checks what
must not move (descriptors, the ledger)."""
from __future__ import annotations

import gc
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from engine.config import SessionConfig
from engine.llama.sampling import GenParams
from engine.session import Session


def rss_bytes(pid: int | None = None) -> int:
    """Resident memory of a process (this one by default), from /proc."""
    path = Path(f"/proc/{pid or 'self'}/status")
    for line in path.read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def open_fds() -> Counter[str]:
    """This process's open file descriptors by kind: "socket", "pipe", "anon_inode:[eventfd]",
    or the file's path (a socket's or pipe's inode number is left out: it says which one,
    not what kind)."""
    kinds: Counter[str] = Counter()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        kinds[re.sub(r":\[\d+\]$", "", target)] += 1
    return kinds


@dataclass
class Sample:
    turn: int
    rss: int
    server_rss: int
    fds: Counter[str]
    ledger: int
    cache_bytes: int


@dataclass
class SoakResult:
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    n_swaps: int = 0
    n_images: int = 0
    n_evicted: int = 0
    n_turns_dropped: int = 0

    def to_dict(self) -> dict[str, Any]:
        first, warm, last = self.samples[0], self.samples[min(len(self.samples) - 1, 1)], self.samples[-1]
        return {
            "turns": last.turn, "images": self.n_images, "swaps": self.n_swaps,
            "cache_evictions": self.n_evicted, "turns_dropped": self.n_turns_dropped,
            "errors": self.errors,
            "rss_after_first_turn": first.rss, "rss_after_warmup": warm.rss, "rss_end": last.rss,
            "rss_growth_after_warmup": last.rss - warm.rss,
            "server_rss_after_warmup": warm.server_rss, "server_rss_end": last.server_rss,
            "fds_after_first_turn": first.fds.total(), "fds_after_warmup": warm.fds.total(),
            "fds_end": last.fds.total(),
            # what the turns after the warm-up opened and kept, by kind ({} when nothing)
            "fds_kept_after_warmup": dict(last.fds - warm.fds),
            "ledger_after_first_turn": first.ledger, "ledger_end": last.ledger,
            "image_cache_bytes_end": last.cache_bytes,
        }


def soak(cfg: SessionConfig, n_turns: int, pictures: list[Path], image_every: int = 3,
         server_pid: int | None = None, warmup: int = 20,
         log: Callable[[str], None] = lambda s: None) -> SoakResult:
    """`n_turns` short greedy turns; every `image_every`-th carries the next of `pictures`.
    Samples after the first turn, after `warmup` turns and at the end (and every 50)."""
    out = SoakResult()
    gp = GenParams(max_tokens=8, temperature=0)
    with Session(cfg) as s:
        def sample(turn: int) -> None:
            gc.collect()  # garbage of others (a test's pipes) must not count as this session's
            out.samples.append(Sample(turn, rss_bytes(), rss_bytes(server_pid) if server_pid else 0,
                                      open_fds(), s.model.ledger.total(s.model.accel) if s.model.accel else 0,
                                      s.encoder.cache_bytes))
            log(f"turn {turn}: rss {out.samples[-1].rss / 2**20:.1f} MiB, fds {out.samples[-1].fds.total()}")

        for i in range(1, n_turns + 1):
            images = []
            if image_every and i % image_every == 0 and pictures:
                images = [pictures[out.n_images % len(pictures)]]
                out.n_images += 1
            res = s.turn(f"Turn {i}: say something short about the sea.", images, gp)
            if res.error:
                out.errors.append(f"turn {i}: {res.error}")
            out.n_swaps += int(res.strategy == "swap")
            out.n_turns_dropped += res.n_turns_dropped
            if i in (1, warmup, n_turns) or i % 50 == 0:
                sample(i)
        out.n_evicted = s.encoder.n_evicted
    return out
