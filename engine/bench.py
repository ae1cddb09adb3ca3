"""`ebb-engine bench swap`: the same vision turn with the reload mover and the live mover.

Swap time is what the model spends giving VRAM up and taking it back (evict, restore, any
state carried, the re-schedule); the projector's own load, encode and free are the same for
both movers and left out. `bytes_moved` is what must be copied back to the device; `limit_s`
is that over the device's measured copy bandwidth: the least any mover can spend.
"""
from __future__ import annotations

import ctypes
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from engine import ggml
from engine.devices import find_device
from engine.errors import EbbError
from engine.plan import placement_for, projector_need_bytes
from engine.runtime import GenParams
from engine.session import Session, SessionConfig

SWAP_STEPS = {"reload": ("save_state", "evict", "restore", "restore_state"),
              "live": ("evict", "restore")}


def _timed_sets(g: Any, buft: int, src: np.ndarray, piece: int) -> float:
    """Seconds to copy `src` into newly allocated device buffers of `piece` bytes each (as a
    restore does), counting only the copies."""
    bufs = []
    elapsed = 0.0
    try:
        for off in range(0, src.size, piece):
            n = min(piece, src.size - off)
            buf = g.base.ggml_backend_buft_alloc_buffer(buft, n)
            if not buf:
                raise EbbError(f"could not allocate {n >> 20} MiB to measure bandwidth")
            bufs.append(buf)
            t = ggml.Tensor()
            t.type, t.buffer, t.data = ggml.GGML_TYPE_I8, buf, g.base.ggml_backend_buffer_get_base(buf)
            t.ne[:] = [n, 1, 1, 1]
            t.nb[:] = [1, n, n, n]
            t0 = time.perf_counter()
            g.base.ggml_backend_tensor_set(ctypes.addressof(t), src.ctypes.data + off, 0, n)
            elapsed += time.perf_counter() - t0
    finally:
        for buf in bufs:
            g.base.ggml_backend_buffer_free(buf)
    return elapsed


def measure_bandwidth(device: str, n_bytes: int = 64 * 2**20, repeats: int = 3) -> float:
    """Host→device copy speed: timed ggml_backend_tensor_set into newly allocated buffers, one
    large and layer-sized (4 MiB) pieces; the best rate of `repeats` tries of each."""
    g = ggml.lib()
    buft = g.base.ggml_backend_dev_buffer_type(find_device(device).handle)
    src = np.random.default_rng(0).integers(0, 255, n_bytes, dtype=np.uint8)
    best = min(_timed_sets(g, buft, src, piece) for piece in (n_bytes, 4 * 2**20)
               for _ in range(repeats))
    return n_bytes / best


def auto_budget(session: Session) -> int:
    """A budget that holds the whole model but makes the projector take most of its layers:
    room beside the non-movable parts for the projector and a fifth of the layers."""
    s = session
    assert s.proj_info is not None and s.accel is not None
    full = placement_for(s.info, s.accel, s.info.n_layers + 1, s.n_ctx, s.cfg.n_batch,
                         s.cfg.flash_attn, live=True)
    layers = sum(s.info.layer_bytes)
    floor = full.accel_total_bytes - layers
    need = projector_need_bytes(s.proj_info, s.cfg.flash_attn)
    return max(full.accel_total_bytes, floor + need + layers // 5)


def _pictures(folder: Path, n: int) -> list[Path]:
    from PIL import Image

    out = []
    for i in range(n):
        arr = (np.random.default_rng(100 + i).random((224, 224, 3)) * 255).astype(np.uint8)
        Image.fromarray(arr).save(folder / f"bench-{i}.png")
        out.append(folder / f"bench-{i}.png")
    return out


def _run(cfg: SessionConfig, mover: str, pictures: list[Path]) -> dict[str, Any]:
    gp = GenParams(max_tokens=8, temperature=0)
    with Session(replace(cfg, mover=mover, vision="swap")) as s:
        if s.mover_name != mover:
            raise EbbError(f"the {mover} mover is not available: {s.mover_note}")
        texts = [s.turn("Say hello.", [], gp).text]
        swaps, moved = [], []
        for pic in pictures:
            res = s.turn("What is in this picture?", [pic], gp)
            if res.error:
                raise EbbError(f"the {mover} mover's vision turn failed: {res.error}")
            texts.append(res.text)
            steps = [sp for sp in res.spans if sp.name in SWAP_STEPS[mover]]
            swaps.append(sum(sp.end_s - sp.start_s for sp in steps))
            moved.append(sum(sp.bytes for sp in res.spans if sp.name in ("restore", "restore_state")))
            peak = res.device_peak_bytes.get(s.accel or "", 0)
        return {"swap_s": statistics.median(swaps), "bytes_moved": int(statistics.median(moved)),
                "texts": texts, "peak_bytes": peak, "n_layers_on_accel": s.placement.n_layers_on_accel}


def bench_swap(cfg: SessionConfig, n_images: int = 5) -> dict[str, Any]:
    with Session(replace(cfg, mover="reload", vision="cpu")) as probe:
        if probe.accel is None:
            raise EbbError("bench swap needs an accelerator", "pass --rpc HOST:PORT or use a GPU")
        if probe.proj_info is None:
            raise EbbError("bench swap needs a projector", "pass --mmproj FILE.gguf")
        budget = cfg.vram_budget_bytes or auto_budget(probe)
        accel = probe.accel
    cfg = replace(cfg, vram_budget_bytes=budget)
    bandwidth = measure_bandwidth(accel)
    with tempfile.TemporaryDirectory() as tmp:
        pictures = _pictures(Path(tmp), n_images)
        reload = _run(cfg, "reload", pictures)
        live = _run(cfg, "live", pictures)
    limit_s = live["bytes_moved"] / bandwidth
    return {
        "device": accel, "vram_budget_bytes": budget, "n_swaps": n_images,
        "reload_swap_s": round(reload["swap_s"], 4), "live_swap_s": round(live["swap_s"], 4),
        "bytes_moved": live["bytes_moved"], "reload_bytes_moved": reload["bytes_moved"],
        "bandwidth_Bps": round(bandwidth), "limit_s": round(limit_s, 4),
        "reload_vs_live": round(reload["swap_s"] / live["swap_s"], 2) if live["swap_s"] else None,
        "live_vs_limit": round(live["swap_s"] / limit_s, 2) if limit_s else None,
        "reload_vs_limit": round(reload["swap_s"] / limit_s, 2) if limit_s else None,
        "replies_equal": reload["texts"] == live["texts"],
        "peak_bytes": {"reload": reload["peak_bytes"], "live": live["peak_bytes"]},
        "n_layers_on_accel": live["n_layers_on_accel"],
    }
