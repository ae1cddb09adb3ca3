"""`ebb-engine bench swap`: the same vision turn with the reload mover and the live mover.

Swap time is what the model spends giving VRAM up and taking it back (evict, restore, any
state carried); the projector's own load, encode and free are the same for both movers and
left out. After the live mover's restore llama.cpp plans its next graph when the prompt's
first batch comes, as it does for any batch of a new shape; the prefill step is given beside
the swap (`prefill_s`), so a cost moved from one to the other shows. `bytes_moved` is what
must be copied back to the device; `limit_s` is that over the device's measured copy
bandwidth: the least any mover can spend.

Each mover swaps `n_images` times. Noise only ever adds time, so each mover's swap is its
fastest. The limit is measured the same way, as an ideal mover that only copies: in every live
turn, once the projector is freed and right before the layers come back, one timed copy of as
many bytes as the mover freed (up to 256 MiB) into a warm device buffer of that size (the room
it leaves: the link is timed in the state the restore finds it, within the budget), in the
piece size that copied fastest when the bench started, sent as the live mover sends its pieces
(`ggml.Copier`: queued to a remote device). `limit_s` uses the fastest of those,
as many samples as swaps. `limit_best_s` is the strictest reading: the fastest copy of every
one taken, including the start's scan on an idle link. Medians are given beside them.
"""
from __future__ import annotations

import statistics
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from engine.config import SessionConfig
from engine.errors import EbbError
from engine.events import SWAP_STEPS
from engine.llama.bandwidth import COPY_PIECES, measure_bandwidth
from engine.llama.sampling import GenParams
from engine.placement.plan import placement_for, projector_need_bytes
from engine.session import Session
from engine.media.images import write_noise_picture

SAMPLE_MAX_BYTES = 256 * 2**20  # a rate, not a restore: enough bytes to time it well


def auto_budget(session: Session) -> int:
    """A budget that holds the whole model but makes the projector take most of its layers:
    room beside the non-movable parts for the projector and a fifth of the layers."""
    s = session
    assert s.proj_info is not None and s.model.accel is not None
    full = placement_for(s.info, s.model.accel, s.info.n_layers + 1, s.n_ctx, s.cfg.n_batch,
                         s.cfg.flash, live=True)
    layers = sum(s.info.layer_bytes)
    floor = full.accel_total_bytes - layers
    need = projector_need_bytes(s.proj_info, s.cfg.flash)
    return max(full.accel_total_bytes, floor + need + layers // 5)


def _pictures(folder: Path, n: int) -> list[Path]:
    return [write_noise_picture(folder / f"bench-{i}.png", seed=100 + i) for i in range(n)]


def _logprobs(entries: Any) -> list[dict[str, Any]]:
    return [e.to_dict() for e in entries or ()]


def _run(cfg: SessionConfig, mover: str, pictures: list[Path],
         before_restore: Callable[[int], None] | None = None) -> dict[str, Any]:
    gp = GenParams(max_tokens=8, temperature=0, top_logprobs=2)  # logprobs: compared where decided
    with Session(replace(cfg, mover=mover, vision="swap")) as s:
        if s.model.mover_name != mover:
            raise EbbError(f"the {mover} mover is not available: {s.model.mover_note}")
        s.before_restore = before_restore
        first = s.turn("Say hello.", [], gp)
        texts, logprobs = [first.text], [_logprobs(first.gen.logprobs)]
        swaps, prefills, moved, peak = [], [], [], 0
        for pic in pictures:
            res = s.turn("What is in this picture?", [pic], gp)
            if res.error:
                raise EbbError(f"the {mover} mover's vision turn failed: {res.error}")
            texts.append(res.text)
            logprobs.append(_logprobs(res.gen.logprobs))
            s.undo_last_exchange()  # every swap from the same conversation, within the context
            steps = [sp for sp in res.spans if sp.name in SWAP_STEPS]
            swaps.append(sum(sp.end_s - sp.start_s for sp in steps))
            prefills.append(sum(sp.end_s - sp.start_s for sp in res.spans if sp.name == "prefill"))
            moved.append(sum(sp.bytes for sp in res.spans if sp.name in ("restore", "restore_state")))
            peak = res.device_peak_bytes.get(s.model.accel or "", 0)
        return {"swaps_s": swaps, "prefills_s": prefills, "bytes_moved": int(statistics.median(moved)) if moved else 0,
                "texts": texts, "logprobs": logprobs, "peak_bytes": peak, "n_layers_on_accel": s.model.placement.n_layers_on_accel}


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b else None


def bench_swap(cfg: SessionConfig, n_images: int = 10) -> dict[str, Any]:
    with Session(replace(cfg, mover="reload", vision="cpu")) as probe:
        if probe.model.accel is None:
            raise EbbError("bench swap needs an accelerator", "pass --rpc HOST:PORT or use a GPU")
        if probe.proj_info is None:
            raise EbbError("bench swap needs a projector", "pass --mmproj FILE.gguf")
        budget = cfg.vram_budget_bytes or auto_budget(probe)
        accel = probe.model.accel
    cfg = replace(cfg, vram_budget_bytes=budget)
    # the piece size the link copies fastest in: what an ideal mover would send
    scan = {p: measure_bandwidth(accel, pieces=(p,)) for p in COPY_PIECES}
    piece = max(scan, key=lambda p: scan[p])
    rates: list[float] = []  # one ideal copy right before every live restore

    def sample(freed: int) -> None:
        if freed:
            rates.append(measure_bandwidth(accel, min(freed, SAMPLE_MAX_BYTES), repeats=1, pieces=(piece,)))

    with tempfile.TemporaryDirectory() as tmp:
        pictures = _pictures(Path(tmp), n_images)
        reload = _run(cfg, "reload", pictures)
        live = _run(cfg, "live", pictures, sample)
    bandwidth = max(rates) if rates else max(scan.values())  # no rates: nothing had to move
    limit_s = live["bytes_moved"] / bandwidth
    limit_best_s = live["bytes_moved"] / max(bandwidth, *scan.values())
    # each live swap against its own turn's sample
    paired = [sw * r / live["bytes_moved"] for sw, r in zip(live["swaps_s"], rates)] \
        if live["bytes_moved"] else []
    reload_s, live_s = min(reload["swaps_s"]), min(live["swaps_s"])
    reload_med, live_med = statistics.median(reload["swaps_s"]), statistics.median(live["swaps_s"])
    return {
        "device": accel, "vram_budget_bytes": budget, "n_swaps": n_images,
        "reload_swap_s": round(reload_s, 4), "live_swap_s": round(live_s, 4),
        "reload_swap_median_s": round(reload_med, 4), "live_swap_median_s": round(live_med, 4),
        "live_swaps_s": [round(x, 4) for x in live["swaps_s"]],
        # the step after the swap, which plans llama.cpp's first graph after it (fastest, median)
        "prefill_s": {m: [round(min(r["prefills_s"]), 4), round(statistics.median(r["prefills_s"]), 4)]
                      for m, r in (("reload", reload), ("live", live))},
        "bytes_moved": live["bytes_moved"], "reload_bytes_moved": reload["bytes_moved"],
        "bandwidth_Bps": round(bandwidth), "bandwidth_samples_Bps": [round(r) for r in rates],
        "bandwidth_piece_bytes": piece,  # 0: the whole buffer in one copy
        "bandwidth_scan_Bps": {str(p or "whole"): round(r) for p, r in scan.items()},
        "limit_s": round(limit_s, 4), "limit_best_s": round(limit_best_s, 4),
        "reload_vs_live": _ratio(reload_s, live_s), "live_vs_limit": _ratio(live_s, limit_s),
        "reload_vs_limit": _ratio(reload_s, limit_s),
        "reload_vs_live_median": _ratio(reload_med, live_med),
        "live_vs_limit_median": _ratio(live_med, limit_s),
        "live_vs_limit_paired": round(statistics.median(paired), 2) if paired else None,
        "live_vs_limit_best": _ratio(live_s, limit_best_s),
        # the movers lay the layers out differently (llama.cpp's offload against the live
        # layout), so their arithmetic may differ: equal texts are likely, not owed; each turn's
        # logprobs are given for a comparison where the choice was decided (the suite's)
        "replies_equal": reload["texts"] == live["texts"],
        "logprobs": {"reload": reload["logprobs"], "live": live["logprobs"]},
        "peak_bytes": {"reload": reload["peak_bytes"], "live": live["peak_bytes"]},
        "n_layers_on_accel": live["n_layers_on_accel"],
    }
