"""The two ways a swap borrows the accelerator for the projector (shared/DESIGN.md §3).

- reload mover: save the sequence state, free the model, load the projector on the device
  (bound to the host-only model instance), encode, free it, rebuild the model from the page
  cache with its placement, restore the state. Always available.
- live mover: evict only as many of the last layers as the projector needs, load the projector
  beside the rest (the context, its KV cache and compute buffer stay), encode, free it, promote
  the layers back. No state to carry.

Both run on the session's thread and record one Span per step.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from engine.llama.devices import wait_until_done
from engine.errors import EbbError
from engine.vision.images import LoadedImage
from engine.placement.plan import (CPU, Placement, VisionPlan, layers_to_evict, plan_placement,
                         projector_need_bytes)

# Restored layers share device buffers of up to this size: fewer allocations and frees (each a
# round trip to a remote device), and small enough that the allocator reuses memory (glibc
# serves blocks under its 32 MiB mmap ceiling from the heap, with no fresh page faults).
RESTORE_GROUP_BYTES = 30 * 2**20

if TYPE_CHECKING:
    from engine.vision.projector import ProjectorRuntime
    from engine.session import Session, TurnResult


def _load_encode_free(s: "Session", bound_to: Any, todo: list[LoadedImage], res: "TurnResult",
                      plan: VisionPlan, evicted: bool) -> None:
    assert s.accel is not None and s.proj_info is not None
    accel = s.accel
    pr: ProjectorRuntime | None = None
    try:
        with s._span(res.spans, "load_projector", accel,
                     projector_need_bytes(s.proj_info, s.cfg.flash_attn), plan):
            pr = s._load_accel_projector(bound_to)
        s._emit_residency(projector=accel, evicted=evicted)
        s._encode_all(pr, todo, res, plan, accel)
    finally:
        with s._span(res.spans, "free_projector", accel, 0, plan):
            if pr is not None:
                pr.close()
            s.ledger.clear(accel, "projector", "projector_compute")
            if s.runtime is not None:
                s.runtime.reschedule()  # a projector freed on the device: plan graphs afresh
            wait_until_done(accel)


def swap_reload(s: "Session", todo: list[LoadedImage], res: "TurnResult", plan: VisionPlan) -> None:
    assert s.runtime is not None and s.accel is not None
    accel = s.accel
    with s._span(res.spans, "save_state", CPU, 0, plan):
        state = s.runtime.save_state()
    res.spans[-1] = replace(res.spans[-1], bytes=len(state[0]))
    with s._span(res.spans, "evict", accel, s.placement.accel_total_bytes, plan):
        s._close_runtime()
        s.ledger.clear(accel, "weights", "kv", "compute", "output", "layers")
        wait_until_done(accel)
    s._emit_residency(evicted=True)
    try:
        _load_encode_free(s, s._ram_model, todo, res, plan, evicted=True)
    finally:
        _restore_reload(s, state, res, plan)


def _restore_reload(s: "Session", state: tuple[bytes, list[Any]], res: "TurnResult",
                    plan: VisionPlan) -> None:
    accel = s.accel or CPU
    t0 = time.perf_counter()
    with s._span(res.spans, "restore", accel, s.placement.accel_bytes.get("weights", 0), plan):
        try:
            s.reload_runtime()
        except EbbError as exc:  # the device is full now: carry on from RAM, say so
            s._close_runtime()
            s.ledger.clear(accel, "weights", "kv", "compute", "output", "layers")
            placement = plan_placement(s.info, None, 0, s.n_ctx, s.cfg.n_batch, s.cfg.flash_attn)
            if not isinstance(placement, Placement):
                raise
            s.placement = placement
            s.runtime = s._load_text()
            res.reason += f"; could not bring the model back to {accel} ({exc}): running from RAM"
    weights = s.placement.accel_bytes.get("weights", 0)
    elapsed = time.perf_counter() - t0
    s.costs = replace(s.costs, reload_overhead_s=max(0.0, elapsed - weights / s.costs.bus_Bps))
    assert s.runtime is not None
    with s._span(res.spans, "restore_state", accel, len(state[0]), plan):
        s.runtime.restore_state(state)
    s._emit_residency()


def swap_live(s: "Session", todo: list[LoadedImage], res: "TurnResult", plan: VisionPlan) -> None:
    assert s.runtime is not None and s.accel is not None and s.mover is not None
    assert s.proj_info is not None
    accel = s.accel
    need = projector_need_bytes(s.proj_info, s.cfg.flash_attn)
    deficit = need - (s.budget_bytes - s.ledger.total(accel))
    chosen = [i for i in layers_to_evict(s.placement, deficit) if i in s.mover.on_device()]
    # layers that were promoted together share a buffer: they leave together
    evict = sorted({j for i in chosen for j in s.mover.group_of(i)}, reverse=True)
    before = s.mover.device_bytes()
    with s._span(res.spans, "evict", accel, 0, plan, f"{len(evict)} layers"):
        s._move(evict=evict)
        wait_until_done(accel)
    freed = before - s.mover.device_bytes()
    res.spans[-1] = replace(res.spans[-1], bytes=freed)
    try:
        _load_encode_free(s, s.runtime, todo, res, plan, evicted=False)
        if s.before_restore is not None:
            s.before_restore(freed)
    finally:
        t0 = time.perf_counter()
        with s._span(res.spans, "restore", accel, freed, plan, f"{len(evict)} layers"):
            try:
                copied = s._move(promote=sorted(evict), group_bytes=RESTORE_GROUP_BYTES)
                s.runtime.replan()  # the re-schedule is part of the swap: pay it here
                wait_until_done(accel)  # the last copy has landed, not only left
            except EbbError as exc:  # the device filled up meanwhile: run with fewer layers
                copied = 0
                res.reason += f"; could not bring every layer back ({exc})"
        elapsed = time.perf_counter() - t0
        if copied and elapsed > 0:
            s.costs = replace(s.costs, bus_Bps=copied / elapsed)
