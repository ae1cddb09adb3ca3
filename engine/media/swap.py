"""Carrying out a vision plan, step by step as the planner wrote it (shared steps, one handler
each): the executor keeps no plan of its own.

- cpu: encode with the projector in RAM.
- resident: load the projector beside the model once, encode.
- swap, live mover: evict the plan's layers (the context, KV cache and compute stay), load the
  projector in the room they left, encode, free it, bring the layers back.
- swap, reload mover: save the sequence state, free the model, load the projector (bound to a
  host-only instance of the model), encode, free it, rebuild the model, restore the state.

If a step fails, the remaining cleanup steps (free_projector, restore, restore_state) still run
so the model always comes back, and the first error is raised after them. Stop (the cancel
event) is honoured between steps and between image chunks the same way: the work steps left
are skipped, the cleanup steps run, then TurnCancelled is raised. Each step is a span on the
timeline. Engine thread only.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Callable

from engine.errors import EbbError, TurnCancelled, is_allocation_failure
from engine.llama.devices import wait_until_done
from engine.llama.snapshots import State
from engine.placement.plan import CPU, PlannedStep, VisionPlan
from engine.placement.residency import ModelResidency
from engine.placement.timeline import Timeline
from engine.media.encoder import MediaEncoder
from engine.media.projector import MediaPiece, ProjectorRuntime

CLEANUP_STEPS = ("free_projector", "restore", "restore_state")


@dataclass(frozen=True)
class ChunkWork:
    """One image chunk to encode: mtmd's chunk, its cache key, the picture's name and size."""
    piece: MediaPiece
    key: str
    name: str
    n_bytes: int


class PlanRun:
    """One vision plan carried out over the request's new image chunks (all of a message's
    images, every tile). `notes` says what did not go as planned but did not fail the turn (a
    layer that could not come back)."""

    def __init__(self, plan: VisionPlan, todo: list[ChunkWork], model: ModelResidency,
                 encoder: MediaEncoder, timeline: Timeline,
                 before_restore: Callable[[int], None] | None = None,
                 cancel: threading.Event | None = None) -> None:
        self.plan = plan
        self.cancel = cancel
        self.todo = todo
        self.model = model
        self.encoder = encoder
        self.tl = timeline
        self.before_restore = before_restore  # bench swap times the link here (outside spans)
        self.notes: list[str] = []
        self._accel = model.accel or CPU
        self._projector: ProjectorRuntime | None = None
        self._state: State | None = None
        self._evicted: list[int] = []  # live: the layers out; reload: [] and _model_freed
        self._model_freed = False
        self._freed_bytes = 0
        self._failed = False
        self._on_cpu = False  # the device could not take the projector: encode in RAM

    def run(self) -> None:
        error: BaseException | None = None
        for step in self.plan.steps:
            if error is None and self._cancelled():
                error = TurnCancelled("stopped before the reply started")
            if error is not None and step.name not in CLEANUP_STEPS:
                continue
            try:
                getattr(self, f"_{step.name}")(step)
            except BaseException as exc:  # noqa: BLE001 - cleanup first, then the first error
                self._failed = True
                error = error or exc
        if error is not None:
            raise error

    def _cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    # ------------------------------------------------------------ steps

    def _encode(self, step: PlannedStep) -> None:
        if step.device == CPU or self._on_cpu:
            pr = self.encoder.ram
            step = replace(step, device=CPU)
        else:
            pr = self._projector or self.encoder.on_device
        assert pr is not None
        for w in self.todo:
            if self._cancelled():  # the chunks encoded so far stay cached
                raise TurnCancelled("stopped while encoding the images")
            label = w.name if w.piece.index == 0 else f"{w.name} [{w.piece.index + 1}]"
            with self.tl.step("encode", step.device, w.n_bytes, label):
                self.encoder.encode(pr, w.piece, w.key, step.device, w.name)

    def _load_projector(self, step: PlannedStep) -> None:
        model = self.model
        swapping = self.plan.strategy == "swap"
        bound_to = model.host_holder if self._model_freed else model.runtime
        assert bound_to is not None  # the holder is made before a swap frees the runtime
        self._set_projector("loading")
        try:
            with self.tl.step("load_projector", self._accel, step.bytes):
                self._projector = self.encoder.load_on_device(self._accel, bound_to)
                if not swapping:
                    model.reschedule()
        except EbbError as exc:
            if not is_allocation_failure(exc):
                raise
            self.encoder.free_on_device(self._accel)
            self._on_cpu = True  # the model comes back as planned; the images go to the CPU
            self.notes.append(f"{self._accel} could not take the projector ({exc}): encoded "
                              "on the CPU")
            self._set_projector("RAM")
            return
        self._set_projector(self._accel)
        if self._model_freed:
            model.emit(evicted=True)

    def _free_projector(self, step: PlannedStep) -> None:
        with self.tl.step("free_projector", self._accel, 0):
            self.encoder.free_on_device(self._accel)
            self._projector = None
            self.model.reschedule()  # a projector freed on the device: plan graphs afresh
            wait_until_done(self._accel)
        self._set_projector("RAM")

    def _save_state(self, step: PlannedStep) -> None:
        assert self.model.runtime is not None
        with self.tl.step("save_state", CPU, 0):
            self._state = self.model.save_state()
        self.tl.amend_last(len(self._state[0]))

    def _evict(self, step: PlannedStep) -> None:
        model = self.model
        if self.plan.mover == "live":
            with self.tl.step("evict", self._accel, 0):
                self._evicted, self._freed_bytes = model.evict_layers(step.layers)
            self.tl.amend_last(self._freed_bytes, f"{len(self._evicted)} layers")
            return
        with self.tl.step("evict", self._accel, model.placement.accel_total_bytes):
            self._model_freed = True
            self.encoder.free_on_device(self._accel)  # a resident one is bound to the model
            model.evict_all()
        model.emit(evicted=True)

    def _restore(self, step: PlannedStep) -> None:
        if self.plan.mover == "live":
            self._restore_layers()
        elif self._model_freed:
            self._restore_model()

    def _restore_layers(self) -> None:
        if not self._failed and self.before_restore is not None:
            self.before_restore(self._freed_bytes)
        evicted = self._evicted
        t0 = time.perf_counter()
        with self.tl.step("restore", self._accel, self._freed_bytes, f"{len(evicted)} layers"):
            try:
                copied = self.model.restore_layers(evicted)
            except EbbError as exc:  # the device filled up meanwhile: run with fewer layers
                copied = 0
                self.notes.append(f"could not bring every layer back ({exc})")
        self.encoder.learn("restore", self._accel, time.perf_counter() - t0, copied, mover="live")

    def _restore_model(self) -> None:
        model = self.model
        weights = model.placement.accel_bytes.get("weights", 0)
        t0 = time.perf_counter()
        with self.tl.step("restore", self._accel, weights):
            note = model.reload()
        if note:
            self.notes.append(note)
        weights = model.placement.accel_bytes.get("weights", 0)
        self.encoder.learn("restore", self._accel, time.perf_counter() - t0, weights, mover="reload")
        self._model_freed = False

    def _restore_state(self, step: PlannedStep) -> None:
        if self._state is None or self.model.runtime is None:
            return
        with self.tl.step("restore_state", self._accel, len(self._state[0])):
            self.model.restore_state(self._state)
        self.model.emit()

    def _set_projector(self, where: str) -> None:
        self.model.projector = where
        self.model.emit(evicted=self._model_freed)
