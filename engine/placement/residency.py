"""The loaded language model and where it lives: the placement, the text runtime, the live
mover, the ledger of device bytes, and the Residency events that show it all.

`ModelResidency` decides at load which device holds what (the pure planner chooses; this owner
carries it out): the live layout on one accelerator (every layer's weights kept in RAM, the
placement's layers promoted by the live mover after its self-test), llama.cpp's own placement
(the reload mover's), or layers spread over several devices. During a vision swap it gives the
accelerator up and takes it back through its public methods. Engine thread only.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from engine import events
from engine.config import SessionConfig
from engine.errors import EbbError, is_allocation_failure
from engine.gguf.info import ModelInfo
from engine.ledger import Ledger
from engine.llama.devices import (
    default_budget,
    find_device,
    pick_accelerator,
    session_accelerators,
    wait_until_done,
)
from engine.llama.loaded_model import HoldsModel, LoadedModel, LoadParams, state_identity
from engine.llama.runtime import TextRuntime
from engine.llama.snapshots import Snapshots
from engine.llama.state_files import State, StateFiles
from engine.placement import calibration
from engine.placement.plan import (
    CPU,
    DeviceOffer,
    DoesNotFit,
    Placement,
    Spread,
    plan_placement,
    plan_spread,
)
from engine.units import fmt_bytes

if TYPE_CHECKING:  # the live mover and its self-test are imported when an accelerator needs them
    from engine.placement.live_mover import LiveMover  # ~7 ms of every start, not paid at import

log = logging.getLogger("ebb.residency")
_KIND = {"model": "weights", "kv": "kv", "compute": "compute", "output": "output"}
MODEL_KINDS = ("weights", "kv", "compute", "output", "layers")  # ledger kinds of the text model
# Restored layers share device buffers of up to this size: fewer allocations and frees (each a
# round trip to a remote device), and small enough that the allocator reuses memory (glibc
# serves blocks under its 32 MiB mmap ceiling from the heap, with no fresh page faults).
RESTORE_GROUP_BYTES = 30 * 2**20


def live_overrides(accel: str, device_layers: Iterable[int]) -> tuple[tuple[str, str], ...]:
    """The live layout's tensor overrides: these layers' weights on `accel`, every other
    repeating layer's in RAM (output, KV cache and compute stay on `accel`)."""
    alt = "|".join(str(i) for i in sorted(device_layers))
    on_accel: tuple[tuple[str, str], ...] = ((rf"^blk\.({alt})\.", accel),) if alt else ()
    return on_accel + ((r"^blk\.\d+\.", CPU),)


AUTO_PARALLEL = 4  # sequences at once where the KV pool costs RAM alone


class ModelResidency:
    """Owns the text model on its devices. `emit` receives Residency events; `projector` is
    where the vision projector is now ("RAM", a device, "loading", "" without one), set by the
    session so the events can show it."""

    def __init__(self, cfg: SessionConfig, info: ModelInfo, n_ctx: int, n_threads: int,
                 emit: Callable[[events.Event], None], request_id: Callable[[], int]) -> None:
        self.cfg = cfg
        self.info = info
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self._emit = emit
        self._request_id = request_id
        self.accel = pick_accelerator(cfg.rpc, cfg.accel)
        self.budget_bytes = self._budget(self.accel)
        self.ledger = Ledger()
        self.placement: Placement = Placement(None, 0, (CPU,) * info.n_layers, CPU)
        self.placement_reason = ""
        self.memory_note = ""  # the device held less than its budget said: what was done
        self._tried_layers: list[int] = []  # layer counts the device could not allocate
        self._free_seen: int | None = None  # what it reported free after a failure
        self.spread: Spread | None = None
        self.runtime: TextRuntime | None = None
        self.mover: LiveMover | None = None
        self.mover_name, self.mover_note = "reload", ""
        self.layer_state: list[str] = [CPU] * info.n_layers  # live layout: where each layer is
        self.n_model_loads = 0
        self.projector = ""
        self.host_holder: HoldsModel | None = None  # see host_model
        # what the runtime's lanes ask before each batch for requests to begin (lanes.py); kept
        # here so that a runtime loaded again (a reload swap) is fed as the one before
        self.lane_feed: Callable[[], None] | None = None
        self.drafter: Any = None  # the draft model (engine/llama/drafter.py), loaded once
        self.draft_refused = ""  # why the draft model asked for is not used
        self.accel_endpoint: str | None = None  # the RPC server behind the accelerator, if any
        self._stack = contextlib.ExitStack()
        # the KV states of conversations the cache let go, kept across the runtimes this
        # builds (engine/llama/snapshots.py), and on disk when the config names a folder
        self.snapshots = Snapshots()
        if cfg.state_dir is not None and cfg.state_disk_bytes > 0:
            self.snapshots.disk = self.open_state_files()
        self._stack.callback(self.close_runtime)

    def open_state_files(self) -> StateFiles:
        """The disk's states for this model and context (cfg.state_dir), closed with this."""
        cfg = self.cfg
        assert cfg.state_dir is not None
        files = StateFiles(cfg.state_dir, state_identity(cfg.model_path, self.n_ctx, cfg.flash_attn),
                           cfg.state_disk_bytes)
        self._stack.callback(files.close)  # after the runtime (callbacks run last first)
        return files

    def _budget(self, accel: str | None) -> int:
        if accel is None:
            return 0
        if self.cfg.vram_budget_bytes is not None:
            return self.cfg.vram_budget_bytes
        return default_budget(accel)

    # ------------------------------------------------------------ load

    def load(self, reserve_bytes: int) -> None:
        """Place and load the model, keeping `reserve_bytes` free for a resident projector."""
        promised, self._tried_layers, self._free_seen = self.budget_bytes, [], None
        self._load(reserve_bytes)
        if self.accel is not None and (self._tried_layers or self._free_seen is not None):
            where = (f"{self.placement.n_layers_on_accel} layers there"
                     if self.placement.n_gpu_layers else "running on the CPU")
            why = [f"tried {', '.join(str(n) for n in self._tried_layers)} layers"
                   if self._tried_layers else "",
                   f"it reports {fmt_bytes(self._free_seen)} free"
                   if self._free_seen is not None else ""]
            self.memory_note = (f"{self.accel} could not allocate the {fmt_bytes(promised)} its "
                                f"budget allowed ({'; '.join(w for w in why if w)}): {where}")
            self.placement_reason = "; ".join(r for r in (self.placement_reason,
                                                          self.memory_note) if r)
            log.warning("%s", self.memory_note)
        dev = find_device(self.accel) if self.accel else None
        self.accel_endpoint = dev.description if dev is not None and dev.remote else None

    def _load(self, reserve_bytes: int) -> None:
        cfg = self.cfg
        if len(session_accelerators(cfg.rpc)) > 1 and cfg.gpu_layers is None:
            why = "" if cfg.spread else self._too_big_for_one()
            if cfg.spread or why:
                self._load_spread(why)
                return
        # gpu_layers 0 (autotune's "all in RAM"): no layout to move, nothing on the device
        if self.accel is not None and cfg.mover in ("auto", "live") and cfg.gpu_layers != 0:
            try:
                try:
                    self._load_live_checked(reserve_bytes)
                except EbbError as exc:  # the device holds less than its budget said
                    if not self._shrink_budget_after(exc):
                        raise
                    self.close_runtime()
                    self.ledger.clear(self.accel, *MODEL_KINDS)
                    self._load_live_checked(reserve_bytes)
                return
            except EbbError as exc:
                if cfg.mover == "live":
                    raise
                self.mover_note = f"live mover not used ({exc}); using the reload mover"
                log.warning("%s", self.mover_note)
                self.close_runtime()
                self.ledger.clear(self.accel, *MODEL_KINDS)
        placement = plan_placement(self.info, self.accel, self.budget_bytes, self.n_ctx,
                                   cfg.n_batch, cfg.flash, reserve_bytes,
                                   max_gpu_layers=cfg.gpu_layers)
        assert isinstance(placement, Placement)
        self.placement = placement
        self._load_text_or_fewer(reserve_bytes)

    def _load_text_or_fewer(self, reserve_bytes: int) -> None:
        """Load the placement; when the device cannot allocate what its budget promised (a
        remote server short of memory, a GPU someone else filled), plan again within the memory
        the device now reports free, then with half the layers there, down to none, and at last
        on the CPU alone; the placement's reason says what was tried."""
        tried: list[int] = []
        while True:
            try:
                self.runtime = self._load_text()
                break
            except EbbError as exc:
                n = self.placement.n_layers_on_accel
                if self.accel is None or self.placement.accel is None \
                        or not is_allocation_failure(exc):
                    raise
                self.ledger.clear(self.accel, *MODEL_KINDS)
                tried.append(n)
                log.warning("%s could not allocate for %d layers: %s", self.accel, n, exc)
                placement: Placement | DoesNotFit = DoesNotFit("")
                if n > 0 and len(tried) == 1 and self._shrink_budget_after(exc):
                    placement = plan_placement(self.info, self.accel, self.budget_bytes,
                                               self.n_ctx, self.cfg.n_batch, self.cfg.flash,
                                               reserve_bytes, max_gpu_layers=n - 1)
                if isinstance(placement, DoesNotFit) and n > 0:
                    placement = plan_placement(self.info, self.accel, self.budget_bytes,
                                               self.n_ctx, self.cfg.n_batch, self.cfg.flash,
                                               reserve_bytes, max_gpu_layers=n // 2)
                if isinstance(placement, DoesNotFit) or n == 0:  # not even the context's buffers
                    placement = plan_placement(self.info, None, 0, self.n_ctx, self.cfg.n_batch,
                                               self.cfg.flash)
                assert isinstance(placement, Placement)
                self.placement = placement
        self._tried_layers += tried

    def _shrink_budget_after(self, exc: EbbError) -> bool:
        """After an allocation failure: hold the budget to what the device reports free now.
        False when that changes nothing (the failure was something else, or the budget was
        already within it)."""
        if self.accel is None or not is_allocation_failure(exc):
            return False
        free = find_device(self.accel).free_bytes or 0
        if free >= self.budget_bytes:
            return False
        self.budget_bytes = self._free_seen = free
        return True

    def _too_big_for_one(self) -> str:
        """Why one device is not enough (its budget holds only part of the model), or ""."""
        assert self.accel is not None
        one = plan_placement(self.info, self.accel, self.budget_bytes, self.n_ctx,
                             self.cfg.n_batch, self.cfg.flash, live=True)
        if isinstance(one, DoesNotFit) or one.n_layers_on_accel < self.info.n_layers:
            held = 0 if isinstance(one, DoesNotFit) else one.n_layers_on_accel
            return (f"{self.accel} alone holds {held}/{self.info.n_layers} layers: spreading over "
                    f"the session's devices")
        return ""

    def _load_spread(self, why: str = "") -> None:
        """Several accelerators: the planner deals layers out by each device's measured link
        (calibration's, else a quick timed copy) and budget; llama.cpp's tensor split places
        them. The reload mover swaps (the live mover moves layers on one device)."""
        from engine.llama.bandwidth import measure_bandwidth

        offers = []
        for dev in session_accelerators(self.cfg.rpc):
            cal = calibration.load(calibration.device_key(dev.name, dev.description))
            bw = cal.bus_Bps if cal is not None and cal.bus_Bps else \
                measure_bandwidth(dev.name, 16 * 2**20, repeats=1)
            offers.append(DeviceOffer(dev.name, self._budget(dev.name), bw))
        spread = plan_spread(self.info, offers, self.n_ctx, self.cfg.n_batch, self.cfg.flash)
        if spread.placement.accel is None:
            raise EbbError("no accelerator can hold even the output layer: " + "; ".join(spread.reasons),
                           "raise --vram-budget")
        self.spread = spread
        self.accel = spread.placement.accel
        self.budget_bytes = next(o.budget_bytes for o in offers if o.name == self.accel)
        self.placement = spread.placement
        self.placement_reason = "; ".join(((why,) if why else ()) + spread.reasons)
        self.mover_note = "layers spread over several devices: the reload mover swaps"
        log.info("placement: %s", self.placement_reason)
        self.runtime = self._load_text()

    def _load_live_checked(self, reserve_bytes: int) -> None:
        """The live layout, used only when its self-test matches the reload mover's logits."""
        from engine.placement.selftest import SelfTestReference, Setup

        assert self.accel is not None
        placement = plan_placement(self.info, self.accel, self.budget_bytes, self.n_ctx,
                                   self.cfg.n_batch, self.cfg.flash, reserve_bytes, live=True,
                                   max_gpu_layers=self.cfg.gpu_layers)
        if isinstance(placement, DoesNotFit):
            raise EbbError(placement.reason)
        self.placement = placement
        toggle = placement.accel_layers[-1] if placement.accel_layers else self.info.n_layers - 1
        dev = find_device(self.accel)
        setup = Setup(Path(self.cfg.model_path), dev.name.split("[")[0], dev.identity, self.n_ctx,
                      self.cfg.n_batch, self.cfg.flash, self.n_threads)
        checker = SelfTestReference(lambda layers: self.text_params(placement, layers), self.info,
                                    setup, set(placement.accel_layers), toggle)
        checker.prepare()  # reference loads first: never two copies on the device at once
        self._load_live()
        assert self.runtime is not None and self.mover is not None
        problem = checker.check(self.runtime, self.mover)
        if problem:
            raise EbbError(f"self-test failed: {problem}")
        self.mover_name = "live"

    def _load_live(self) -> None:
        """Load the live layout (every layer's weights in RAM), find the layers' weight
        tensors, and promote the placement's layers to the accelerator."""
        from engine.placement.live_mover import LiveMover, discover_layer_weights

        assert self.accel is not None
        self.runtime = self._load_text()
        layers = discover_layer_weights(self.runtime.decode_once_with)
        dev = find_device(self.accel)
        self.mover = LiveMover(layers, dev.handle, self.runtime.reschedule, remote=dev.remote)
        self.layer_state = [CPU] * self.info.n_layers
        self.move(promote=self.placement.accel_layers)

    def text_params(self, placement: Placement, device_layers: set[int] | None = None) -> LoadParams:
        """Load parameters for a placement. The live layout assigns every layer to the
        accelerator and forces repeating-layer weights to host (`device_layers` excepted); a
        spread gives llama.cpp the devices and their layer counts."""
        cfg = self.cfg
        # threads nobody chose, on a model the CPU runs: fewer while the cores are shared
        share = (cfg.n_threads is None and cfg.n_threads_batch is None and cfg.phases is None
                 and placement.n_layers_on_accel == 0)
        lanes = self.lanes_for(placement)
        n_threads, n_threads_batch = self.n_threads, cfg.n_threads_batch
        if (cfg.n_threads is None and cfg.phases is None and placement.accel
                and 0 < placement.n_layers_on_accel < self.info.n_layers and server_here(placement.accel)):
            # the accelerator's server (the stand-in, a local rpc-serve) computes its layers on
            # these cores between ours, its threads spinning as ours do: a token's few ops of ours
            # take half of them (2 cores, 13 of 30 layers on the stand-in: 55-70 tok/s with 2
            # threads, 77-90 with 1); a prompt's long batches keep them all (300 against 210)
            n_threads, n_threads_batch = max(1, self.n_threads // 2), n_threads_batch or self.n_threads
        common: dict[str, Any] = dict(n_ctx=self.n_ctx, n_threads=n_threads,
                                      n_threads_batch=n_threads_batch,
                                      flash_attn=cfg.flash, n_batch=cfg.n_batch, share_threads=share,
                                      lanes=lanes, lane_cells=self.n_ctx if lanes else 0)
        if self.spread is not None and placement is self.spread.placement:
            return LoadParams(cfg.model_path, n_gpu_layers=placement.n_gpu_layers,
                              devices=tuple(name for name, _ in self.spread.split),
                              tensor_split=tuple(float(n) for _, n in self.spread.split), **common)
        if placement.live and placement.accel:
            return LoadParams(cfg.model_path, n_gpu_layers=self.info.n_layers + 1,
                              devices=(placement.accel,), repack=False,
                              buft_overrides=live_overrides(placement.accel, device_layers or ()),
                              **common)
        devices = (placement.accel,) if placement.accel and placement.n_gpu_layers else ()
        return LoadParams(cfg.model_path, n_gpu_layers=placement.n_gpu_layers, devices=devices,
                          **common)

    def lanes_for(self, placement: Placement) -> int:
        """Sequences beside the session's (SessionConfig.parallel; auto: 3 on the CPU alone)."""
        n = self.cfg.parallel
        if n == 0:
            n = AUTO_PARALLEL if placement.n_layers_on_accel == 0 and not placement.live else 1
        return max(0, n - 1)

    def feed_lanes(self, feed: Callable[[], None]) -> None:
        """`feed` is asked before each batch for requests to begin on the lanes (lanes.py)."""
        self.lane_feed = feed
        if self.runtime is not None and self.runtime.lanes is not None:
            self.runtime.lanes.feed = feed

    def _load_text(self) -> TextRuntime:
        rt = TextRuntime(self.text_params(self.placement), self.info)
        rt.slot.snapshots = self.snapshots
        if rt.lanes is not None:
            rt.lanes.feed = self.lane_feed
        if self.cfg.draft_path is not None:
            if self.drafter is None:  # on the CPU, in RAM (a small model's few tokens a step)
                from engine.llama.drafter import Drafter

                try:
                    self.drafter = Drafter(self.cfg.draft_path, self.n_ctx, self.n_threads, rt)
                    self._stack.callback(self.drafter.close)
                except EbbError as exc:  # the model runs without it, and says why
                    self.draft_refused = f"the draft model is not used: {exc}"
                    self.cfg = replace(self.cfg, draft_path=None)
                except BaseException:
                    rt.close()
                    raise
            rt.drafter = self.drafter
        self.n_model_loads += 1
        for (dev, kind), n in rt.buffers.items():
            if kind in _KIND:
                self.ledger.set(dev, _KIND[kind], n)
        return rt

    def host_model(self) -> HoldsModel:
        """A model for projectors to bind to while the runtime may be freed, alive as long as
        this owner: the runtime itself when everything is in RAM for good (no accelerator: no
        swap ever frees it), else a host-only instance (mmapped, no copy), since a reload swap
        frees the runtime. With an accelerator and no layer on it, a swap still frees the
        runtime: a projector bound to it then read a freed model at the next message's
        tokenizing, and the process died (SIGSEGV). Made once."""
        assert self.runtime is not None
        if self.host_holder is None:
            if self.placement.n_gpu_layers == 0 and not self.placement.live and self.accel is None:
                self.host_holder = self.runtime
            else:
                holder = LoadedModel(LoadParams(self.cfg.model_path, n_gpu_layers=0, devices=(),
                                                repack=False), self.info)
                self._stack.callback(holder.close)
                self.host_holder = holder
        return self.host_holder

    # ------------------------------------------------------------ moving

    def move(self, promote: Sequence[int] = (), evict: Sequence[int] = (),
             group_bytes: int = 0) -> int:
        """Move layers with the live mover, showing them moving in the residency map.
        `group_bytes`: promote neighbouring layers into shared device buffers of up to that
        many bytes (they are then evicted together); 0: a buffer per layer. Returns the bytes
        copied to the device."""
        assert self.mover is not None and self.accel is not None
        copied = 0
        for layer in evict:
            self.layer_state[layer] = "moving"
        if evict:
            self.emit()
        self.mover.evict_many(list(evict))
        for layer in evict:
            self.layer_state[layer] = CPU
        for group in self._promote_groups(promote, group_bytes):
            for layer in group:
                self.layer_state[layer] = "moving"
            self.emit()
            try:
                copied += self.mover.promote_many(group)
            except EbbError:  # the device is full: the group stays in RAM, the rest is counted
                for layer in group:
                    self.layer_state[layer] = CPU
                self.mover.reschedule()
                self.ledger.set(self.accel, "layers", self.mover.device_bytes())
                self.emit()
                raise
            for layer in group:
                self.layer_state[layer] = self.accel
        self.mover.reschedule()
        self.ledger.set(self.accel, "layers", self.mover.device_bytes())
        self.emit()
        return copied

    def _promote_groups(self, layers: Sequence[int], group_bytes: int) -> list[list[int]]:
        assert self.mover is not None
        groups: list[list[int]] = []
        size = 0
        for layer in layers:
            n = self.mover.layer_bytes(layer)
            if not groups or not group_bytes or size + n > group_bytes:
                groups.append([])
                size = 0
            groups[-1].append(layer)
            size += n
        return groups

    def evict_layers(self, layers: Sequence[int]) -> tuple[list[int], int]:
        """Live mover: evict `layers` that are on the device, with the layers that share their
        buffers, until the device has let go. Returns (layers evicted, bytes freed)."""
        assert self.mover is not None and self.accel is not None
        on = set(self.mover.on_device())
        evict = sorted({j for i in layers if i in on for j in self.mover.group_of(i)}, reverse=True)
        before = self.mover.device_bytes()
        self.move(evict=evict)
        wait_until_done(self.accel)
        return evict, before - self.mover.device_bytes()

    def restore_layers(self, layers: Sequence[int]) -> int:
        """Live mover: bring `layers` back in shared buffers, until the last copy has landed
        (the next decode plans its graph afresh: `TextRuntime.reschedule`). Returns the bytes
        copied; EbbError when the device is full."""
        assert self.accel is not None
        try:
            return self.move(promote=sorted(layers), group_bytes=RESTORE_GROUP_BYTES)
        finally:
            wait_until_done(self.accel)

    def move_to(self, layers: set[int]) -> int:
        """Live mover: exactly `layers` on the device (each phase at its placement), until the
        device is done (the next decode plans its graph afresh). Returns the bytes copied."""
        assert self.mover is not None and self.accel is not None
        now = set(self.mover.on_device())
        try:
            return self.move(promote=sorted(layers - now), evict=sorted(now - layers, reverse=True))
        finally:
            wait_until_done(self.accel)

    def evict_all(self) -> None:
        """Reload mover: free the model, its KV cache and compute buffers from every device."""
        self.close_runtime()
        if self.accel:
            self.ledger.clear(self.accel, *MODEL_KINDS)
            wait_until_done(self.accel)

    def reload(self) -> str:
        """Reload mover: build the model again for the placement (the live layout with its
        layers promoted, or llama.cpp's own). If the device is full now, carry on from RAM;
        returns what happened then ("" when all came back)."""
        try:
            if self.placement.live and self.accel is not None:
                self._load_live()
            else:
                self.runtime = self._load_text()
            return ""
        except EbbError as exc:
            accel = self.accel or CPU
            self.close_runtime()
            self.ledger.clear(accel, *MODEL_KINDS)
            placement = plan_placement(self.info, None, 0, self.n_ctx, self.cfg.n_batch,
                                       self.cfg.flash)
            assert isinstance(placement, Placement)
            self.placement = placement
            self.runtime = self._load_text()
            return f"could not bring the model back to {accel} ({exc}): running from RAM"

    def reschedule(self) -> None:
        """Device buffers changed (a projector came or went): plan the next graph afresh."""
        if self.runtime is not None:
            self.runtime.reschedule()

    # ------------------------------------------------------------ the KV cache, asked here

    def shifted_cells(self) -> int:
        """Cells the last prefill kept by moving them (a K-shift), none re-evaluated."""
        return self.runtime.slot.last_shift[1] if self.runtime is not None else 0

    def has_positions(self) -> bool:
        """The KV cache holds something (a swap then saves its state)."""
        return self.runtime is not None and self.runtime.slot.n_positions() > 0

    def save_state(self) -> State:
        assert self.runtime is not None
        return self.runtime.slot.save_state()

    def restore_state(self, state: State) -> None:
        assert self.runtime is not None
        self.runtime.slot.restore_state(state)

    def keep_on_drop(self) -> None:
        """The cache's state is kept if the next prompt drops it (KeptMemory.keep_on_drop)."""
        if self.runtime is not None:
            self.runtime.slot.keep_on_drop = True

    # ------------------------------------------------------------ events and closing

    def emit(self, evicted: bool = False) -> None:
        """Tell the view where everything is. `evicted`: the reload mover freed the model."""
        p = self.placement
        if evicted:
            layers, output = tuple(CPU for _ in p.layer_devices), CPU
        elif self.mover is not None:
            layers, output = tuple(self.layer_state), p.output_device
        else:
            layers, output = p.layer_devices, p.output_device
        nl = self.info.non_layer_tensors
        self._emit(events.Residency(self._request_id(), layer_devices=layers, output_device=output,
                                    embeddings_device=p.embeddings_device,
                                    projector_device=self.projector, ledger=self.ledger.snapshot(),
                                    layer_bytes=tuple(self.info.layer_bytes),
                                    embeddings_bytes=nl.get("token_embd.weight", 0),
                                    output_bytes=sum(b for n, b in nl.items() if n.startswith("output"))))

    def close_runtime(self) -> None:
        """Free the moved layers, then the model (the mover re-points tensors of the model)."""
        if self.mover is not None:
            self.mover.close()
            self.mover = None
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None

    def close(self) -> None:
        self._stack.close()

    def abandon(self) -> None:
        """Drop every handle without freeing: the device they live on is gone (ggml would
        abort on a free). Requests on its lanes end, told why (nothing of the device is touched)."""
        if self.runtime is not None and self.runtime.lanes is not None:
            self.runtime.lanes.cut("the accelerator's server went away")
        self._stack.pop_all()


def server_here(accel: str) -> bool:
    """The accelerator is an RPC server on this machine (loopback): its compute shares our cores."""
    from engine.llama.rpc_server import is_loopback

    try:
        dev = find_device(accel)
    except EbbError:
        return False
    return bool(dev.remote) and is_loopback(dev.description.rsplit(":", 1)[0].strip("[]"))
