"""A conversation with one model and (optionally) its vision projector held in RAM.

The vision turn (shared/DESIGN.md §3): plan, then encode the request's new images with the
chosen strategy — resident (projector beside the model on the accelerator), swap (save state,
evict the model from the accelerator, load the projector there, encode, free it, bring the
model back, restore state) or cpu (the RAM instance) — then prefill and decode. Every step is
a Span event. Owned by one thread (the CLI's, or the app's engine worker).
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from engine import events

from engine.placement import calibration as calibrate

from engine.vision import swap
from engine.llama.devices import (check_rpc_servers, default_budget, find_device, pick_accelerator,
                            reported_used_bytes, rpc_bytes_sent, session_accelerators)
from engine.errors import DeviceLost, EbbError
from engine.gguf.info import check_projector_matches, model_info, projector_info, read_gguf
from engine.hw import physical_cores
from engine.vision.images import LoadedImage, load_image
from engine.ledger import Ledger
from engine.placement.live_mover import LiveMover, discover_layer_weights
from engine.placement.plan import (CPU, Costs, DeviceOffer, DoesNotFit, Placement, Spread, VisionPlan,
                         layers_to_evict, plan_placement, plan_spread, plan_vision,
                         projector_need_bytes)
from engine.placement.selftest import SelfTestReference
from engine.vision.projector import Encoded, ProjectorRuntime
from engine.llama.runtime import GenParams, ImageSpan, LoadedModel, LoadParams, TextRuntime, check_context

log = logging.getLogger("ebb.session")
_KIND = {"model": "weights", "kv": "kv", "compute": "compute", "output": "output"}


def live_overrides(accel: str, device_layers: Iterable[int]) -> tuple[tuple[str, str], ...]:
    """The live layout's tensor overrides: these layers' weights on `accel`, every other
    repeating layer's in RAM (output, KV cache and compute stay on `accel`)."""
    alt = "|".join(str(i) for i in sorted(device_layers))
    on_accel: tuple[tuple[str, str], ...] = ((rf"^blk\.({alt})\.", accel),) if alt else ()
    return on_accel + ((r"^blk\.\d+\.", CPU),)


@dataclass(frozen=True)
class SessionConfig:
    model_path: Path
    mmproj_path: Path | None = None
    n_ctx: int | None = None
    n_threads: int | None = None
    vram_budget_bytes: int | None = None  # None: the accelerator's free memory minus a margin
    vision: str = "auto"  # auto | resident | swap | cpu
    flash_attn: bool = True
    accel: str | None = None  # None: the first accelerator llama.cpp sees, if any
    n_batch: int = 512
    system: str | None = None
    mover: str = "auto"  # auto (live after its self-test, else reload) | live | reload
    image_max_tokens: int = 0  # 0: the projector's default
    rpc: tuple[str, ...] = ()  # RPC servers (HOST:PORT) whose devices this session may use
    gpu_layers: int | None = None  # at most this many on the accelerator (autotune's choice)
    # layers over every accelerator of this session (reload mover); without it, only when the
    # first device alone cannot hold the whole model
    spread: bool = False


@dataclass(frozen=True)
class HistoryTurn:
    role: str  # user | assistant
    text: str
    image_keys: tuple[str, ...] = ()


@dataclass
class TurnResult:
    request_id: int
    text: str = ""
    strategy: str = "none"
    reason: str = ""
    spans: list[events.Span] = field(default_factory=list)
    device_peak_bytes: dict[str, int] = field(default_factory=dict)
    n_images: int = 0
    n_images_encoded: int = 0
    n_images_cached: int = 0
    gen: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    device_lost: str | None = None  # a remote device went away before this turn
    swap_mover: str = ""  # the mover this turn's swap used (live | reload), "" without a swap
    mover_note: str = ""  # why this turn's swap did not use the session's mover

    def to_dict(self) -> dict[str, Any]:
        t0 = self.spans[0].start_s if self.spans else 0.0
        d: dict[str, Any] = {"text": self.text, "strategy": self.strategy, "reason": self.reason,
                             "spans": [s.to_dict(t0) for s in self.spans],
                             "device_peak_bytes": self.device_peak_bytes,
                             "n_images": self.n_images, "n_images_encoded": self.n_images_encoded,
                             "n_images_cached": self.n_images_cached,
                             "swap_mover": self.swap_mover, **self.gen}
        if self.error is not None:
            d["error"] = self.error
        if self.device_lost is not None:
            d["device_lost"] = self.device_lost
        return d


def _projector_identity(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


class Session:
    def __init__(self, cfg: SessionConfig, emit: Callable[[events.Event], None] | None = None) -> None:
        self.cfg = cfg
        self._emit = emit or (lambda ev: None)
        self.info = model_info(read_gguf(cfg.model_path))
        self.n_ctx = check_context(self.info, cfg.n_ctx)
        self.n_threads = cfg.n_threads or physical_cores()
        self.proj_info = projector_info(read_gguf(cfg.mmproj_path)) if cfg.mmproj_path else None
        if self.proj_info is not None:
            check_projector_matches(self.info, self.proj_info)
        self.accel = self._pick_accel()
        accel_info = find_device(self.accel) if self.accel else None
        self.accel_endpoint = accel_info.description if accel_info and accel_info.remote else None
        self.abandoned = False
        self.budget_bytes = self._budget()
        self.ledger = Ledger()
        self.costs = self._default_costs()
        self.vision_enabled = self.proj_info is not None
        self.history: list[HistoryTurn] = []  # the conversation so far (system prompt aside)
        self._image_paths: dict[str, str] = {}  # cache key -> file, to re-encode after a reload
        self._cache: dict[str, Encoded] = {}
        self._request_id = 0
        self.n_model_loads = 0
        self._stack = contextlib.ExitStack()
        self._accel_projector: ProjectorRuntime | None = None
        self.mover: LiveMover | None = None
        self.mover_name, self.mover_note = "reload", ""
        self.spread: Spread | None = None
        self.placement_reason = ""
        # called with the device bytes the live mover freed, once the projector is gone and
        # before those layers come back (outside every span): bench swap times the link there
        self.before_restore: Callable[[int], None] | None = None
        self.runtime: TextRuntime | None = None
        self._stack.callback(self._close_runtime)
        sent0, t0 = rpc_bytes_sent(), time.monotonic()
        try:
            self._setup_text()
            self._load_ram_projector()
        except BaseException:
            self._stack.close()
            raise
        self.load_s = time.monotonic() - t0
        sent1 = rpc_bytes_sent()
        # what crossed to remote devices while loading (the kernel's counters of our sockets)
        self.load_rpc_bytes_sent = (sent1 or 0) - (sent0 or 0)
        self._emit_residency()

    # ------------------------------------------------------------ setup

    def _pick_accel(self) -> str | None:
        return pick_accelerator(self.cfg.rpc, self.cfg.accel)

    def _budget(self) -> int:
        if self.accel is None:
            return 0
        if self.cfg.vram_budget_bytes is not None:
            return self.cfg.vram_budget_bytes
        return default_budget(self.accel)

    def _default_costs(self) -> Costs:
        flops_per_token = 2 * (self.proj_info.weight_bytes // 2) if self.proj_info else 1
        cpu_s = flops_per_token / (40e9 * self.n_threads)
        remote = self.accel_endpoint is not None
        accel_s = cpu_s if (self.accel is None or remote) else flops_per_token / 20e12
        costs = Costs(bus_Bps=1e9 if remote or self.accel is None else 12e9,
                      cpu_encode_s_per_token=cpu_s, accel_encode_s_per_token=accel_s)
        cpu_cal = calibrate.load(CPU)
        if cpu_cal is not None and self.proj_info is not None:  # this machine's measurements
            dev = find_device(self.accel) if self.accel else None
            acc_cal = calibrate.load(calibrate.device_key(dev.name, dev.description)) if dev else None
            costs = calibrate.vision_costs(cpu_cal, acc_cal, self.proj_info.weight_bytes, costs)
        return costs

    def _setup_text(self) -> None:
        reserve = (projector_need_bytes(self.proj_info, self.cfg.flash_attn)
                   if self.proj_info is not None and self.cfg.vision == "resident" else 0)
        if len(session_accelerators(self.cfg.rpc)) > 1 and self.cfg.gpu_layers is None:
            why = "" if self.cfg.spread else self._too_big_for_one()
            if self.cfg.spread or why:
                self._setup_spread(why)
                return
        # gpu_layers 0 (autotune's "all in RAM"): no layout to move, nothing on the device
        if self.accel is not None and self.cfg.mover in ("auto", "live") and self.cfg.gpu_layers != 0:
            try:
                self._setup_live(reserve)
                return
            except EbbError as exc:
                if self.cfg.mover == "live":
                    raise
                self.mover_note = f"live mover not used ({exc}); using the reload mover"
                log.warning("%s", self.mover_note)
                self._close_runtime()
                self.ledger = Ledger()
        placement = plan_placement(self.info, self.accel, self.budget_bytes, self.n_ctx,
                                   self.cfg.n_batch, self.cfg.flash_attn, reserve,
                                   max_gpu_layers=self.cfg.gpu_layers)
        assert isinstance(placement, Placement)
        self.placement = placement
        self.runtime = self._load_text()

    def _too_big_for_one(self) -> str:
        """Why one device is not enough (its budget holds only part of the model), or ""."""
        assert self.accel is not None
        one = plan_placement(self.info, self.accel, self.budget_bytes, self.n_ctx,
                             self.cfg.n_batch, self.cfg.flash_attn, live=True)
        if isinstance(one, DoesNotFit) or one.n_layers_on_accel < self.info.n_layers:
            held = 0 if isinstance(one, DoesNotFit) else one.n_layers_on_accel
            return (f"{self.accel} alone holds {held}/{self.info.n_layers} layers: spreading over "
                    f"the session's devices")
        return ""

    def _setup_spread(self, why: str = "") -> None:
        """Several accelerators: the planner deals layers out by each device's measured link
        (calibration's, else a quick timed copy) and budget; llama.cpp's tensor split places
        them. The reload mover swaps (the live mover moves layers on one device)."""
        from engine.llama.bandwidth import measure_bandwidth

        offers = []
        for dev in session_accelerators(self.cfg.rpc):
            cal = calibrate.load(calibrate.device_key(dev.name, dev.description))
            bw = cal.bus_Bps if cal is not None and cal.bus_Bps else \
                measure_bandwidth(dev.name, 16 * 2**20, repeats=1)
            budget = self.cfg.vram_budget_bytes if self.cfg.vram_budget_bytes is not None \
                else default_budget(dev.name)
            offers.append(DeviceOffer(dev.name, budget, bw))
        spread = plan_spread(self.info, offers, self.n_ctx, self.cfg.n_batch, self.cfg.flash_attn)
        if spread.placement.accel is None:
            raise EbbError("no accelerator can hold even the output layer: " + "; ".join(spread.reasons),
                           "raise --vram-budget")
        self.spread = spread
        self.accel = spread.placement.accel
        primary = find_device(self.accel)
        self.accel_endpoint = primary.description if primary.remote else None
        self.budget_bytes = next(o.budget_bytes for o in offers if o.name == self.accel)
        self.placement = spread.placement
        self.placement_reason = "; ".join(((why,) if why else ()) + spread.reasons)
        self.mover_note = "layers spread over several devices: the reload mover swaps"
        log.info("placement: %s", self.placement_reason)
        self.costs = self._default_costs()  # for the device the projector borrows
        self.runtime = self._load_text()

    def _setup_live(self, reserve: int) -> None:
        assert self.accel is not None
        placement = plan_placement(self.info, self.accel, self.budget_bytes, self.n_ctx,
                                   self.cfg.n_batch, self.cfg.flash_attn, reserve, live=True,
                                   max_gpu_layers=self.cfg.gpu_layers)
        if isinstance(placement, DoesNotFit):
            raise EbbError(placement.reason)
        self.placement = placement
        toggle = placement.accel_layers[-1] if placement.accel_layers else self.info.n_layers - 1
        before = set(placement.accel_layers)
        checker = SelfTestReference(self, before, toggle)
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
        assert self.accel is not None
        self.runtime = self._load_text()
        layers = discover_layer_weights(self.runtime.decode_once_with)
        dev = find_device(self.accel)
        self.mover = LiveMover(layers, dev.handle, self.runtime.reschedule, remote=dev.remote)
        self._layer_state = [CPU] * self.info.n_layers
        self._move(promote=self.placement.accel_layers)

    def reload_runtime(self) -> None:
        """Build the text model again for the current placement (after the reload mover freed
        it): the live layout with its layers promoted, or llama.cpp's own placement."""
        if self.placement.live and self.accel is not None:
            self._load_live()
        else:
            self.runtime = self._load_text()

    def text_params(self, placement: Placement, device_layers: set[int] | None = None) -> LoadParams:
        """Load parameters for a placement. The live layout assigns every layer to the
        accelerator and forces repeating-layer weights to host (`device_layers` excepted); a
        spread gives llama.cpp the devices and their layer counts."""
        if self.spread is not None and placement is self.spread.placement:
            return LoadParams(self.cfg.model_path, n_ctx=self.n_ctx, n_threads=self.n_threads,
                              n_gpu_layers=placement.n_gpu_layers,
                              devices=tuple(name for name, _ in self.spread.split),
                              tensor_split=tuple(float(n) for _, n in self.spread.split),
                              flash_attn=self.cfg.flash_attn, n_batch=self.cfg.n_batch)
        if placement.live and placement.accel:
            overrides = live_overrides(placement.accel, device_layers or ())
            return LoadParams(self.cfg.model_path, n_ctx=self.n_ctx, n_threads=self.n_threads,
                              n_gpu_layers=self.info.n_layers + 1, devices=(placement.accel,),
                              flash_attn=self.cfg.flash_attn, n_batch=self.cfg.n_batch,
                              repack=False, buft_overrides=overrides)
        return LoadParams(self.cfg.model_path, n_ctx=self.n_ctx, n_threads=self.n_threads,
                          n_gpu_layers=placement.n_gpu_layers,
                          devices=(placement.accel,) if placement.accel and placement.n_gpu_layers else (),
                          flash_attn=self.cfg.flash_attn, n_batch=self.cfg.n_batch)

    def _load_text(self) -> TextRuntime:
        rt = TextRuntime(self.text_params(self.placement), self.info)
        self.n_model_loads += 1
        for (dev, kind), n in rt.buffers.items():
            if kind in _KIND:
                self.ledger.set(dev, _KIND[kind], n)
        return rt

    def _move(self, promote: Sequence[int] = (), evict: Sequence[int] = (),
              group_bytes: int = 0) -> int:
        """Move layers with the live mover, showing them moving in the residency map.
        `group_bytes`: promote neighbouring layers into shared device buffers of up to that
        many bytes (they are then evicted together); 0: a buffer per layer. Returns the bytes
        copied to the device."""
        assert self.mover is not None and self.accel is not None
        copied = 0
        for layer in evict:
            self._layer_state[layer] = "moving"
        if evict:
            self._emit_residency()
        for layer in evict:
            self.mover.evict(layer)
            self._layer_state[layer] = CPU
        groups: list[list[int]] = []
        size = 0
        for layer in promote:
            n = self.mover.layer_bytes(layer)
            if not groups or not group_bytes or size + n > group_bytes:
                groups.append([])
                size = 0
            groups[-1].append(layer)
            size += n
        for group in groups:
            for layer in group:
                self._layer_state[layer] = "moving"
            self._emit_residency()
            try:
                copied += self.mover.promote_many(group)
            except EbbError:
                for layer in group:
                    self._layer_state[layer] = CPU
                self.mover.reschedule()
                raise
            for layer in group:
                self._layer_state[layer] = self.accel
        self.mover.reschedule()
        self.ledger.set(self.accel, "layers", self.mover.device_bytes())
        self._emit_residency()
        return copied

    def _load_ram_projector(self) -> None:
        if self.cfg.mmproj_path is None:
            self.ram_projector = None
            return
        assert self.runtime is not None
        if self.placement.n_gpu_layers == 0 and not self.placement.live:
            holder: Any = self.runtime  # all in RAM: the model never leaves
        else:  # a host-only instance of the model for the projector to bind to (mmapped): the
            # reload mover frees the text model (the live layout's too, when layers free too little)
            holder = LoadedModel(LoadParams(self.cfg.model_path, n_gpu_layers=0, devices=(),
                                            repack=False), self.info)
            self._stack.callback(holder.close)
        self._ram_model = holder
        self.ram_projector = ProjectorRuntime(self.cfg.mmproj_path, holder, self.n_threads,
                                              device=None, flash_attn=self.cfg.flash_attn,
                                              image_max_tokens=self.cfg.image_max_tokens,
                                              info=self.proj_info)
        self._stack.callback(self.ram_projector.close)
        self.ledger.set(CPU, "projector", self.ram_projector.info.weight_bytes)
        self._proj_id = _projector_identity(self.cfg.mmproj_path)

    def _close_runtime(self) -> None:
        """Free the projector on the device, the moved layers, then the model (in that order:
        the mover re-points tensors that belong to the model)."""
        self._free_accel_projector()
        if self.mover is not None:
            self.mover.close()
            self.mover = None
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None

    def close(self) -> None:
        if self.abandoned:  # its buffers live on a server that is gone: freeing would abort
            self._stack.pop_all()
            return
        self._stack.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ events

    def _emit_residency(self, projector: str | None = None, evicted: bool = False) -> None:
        """Tell the view where everything is. `evicted`: the reload mover freed the model."""
        p = self.placement
        if evicted:
            layers, output = tuple(CPU for _ in p.layer_devices), CPU
        elif self.mover is not None:
            layers, output = tuple(self._layer_state), p.output_device
        else:
            layers, output = p.layer_devices, p.output_device
        where = projector if projector is not None else (
            "" if self.proj_info is None else
            self._accel_projector.device_name if self._accel_projector else "RAM")
        self._emit(events.Residency(self._request_id, layer_devices=layers, output_device=output,
                                    embeddings_device=p.embeddings_device,
                                    projector_device=where, ledger=self.ledger.snapshot()))

    @contextlib.contextmanager
    def _span(self, spans: list[events.Span], name: str, device: str, n_bytes: int = 0,
              predicted: VisionPlan | None = None, detail: str = "") -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            pred = None
            if predicted is not None:
                pred = next((s.predicted_s for s in predicted.steps if s.name == name), None)
            span = events.Span(self._request_id, name=name, start_s=t0, end_s=time.monotonic(),
                               device=device, bytes=n_bytes, predicted_s=pred, detail=detail)
            spans.append(span)
            self._emit(span)
            if self.accel is not None:
                self._emit(events.MemorySample(self._request_id, device=self.accel,
                                               ledger_bytes=self.ledger.total(self.accel),
                                               reported_used_bytes=reported_used_bytes(self.accel),
                                               ledger_kinds=self.ledger.snapshot().get(self.accel, {})))

    # ------------------------------------------------------------ vision control

    def set_vision(self, enabled: bool) -> None:
        """Turn vision on or off. Never reloads the model; frees a resident projector."""
        if enabled and self.proj_info is None:
            raise EbbError("no projector is loaded", "start with --mmproj FILE.gguf")
        self.vision_enabled = enabled
        if not enabled:
            self._free_accel_projector()
            self._emit_residency()

    def _free_accel_projector(self) -> None:
        if self._accel_projector is None:
            return
        self._accel_projector.close()
        self._accel_projector = None
        if self.accel:
            self.ledger.clear(self.accel, "projector", "projector_compute")
        if self.runtime is not None:
            self.runtime.reschedule()  # freed device buffers: plan the next graph afresh

    def _load_accel_projector(self, bound_to: Any) -> ProjectorRuntime:
        assert self.cfg.mmproj_path is not None and self.accel is not None
        self._emit_residency(projector="loading")
        pr = ProjectorRuntime(self.cfg.mmproj_path, bound_to, self.n_threads, device=self.accel,
                              flash_attn=self.cfg.flash_attn,
                              image_max_tokens=self.cfg.image_max_tokens, info=self.proj_info)
        self.ledger.set(self.accel, "projector", pr.info.weight_bytes)
        self.ledger.set(self.accel, "projector_compute", pr.compute_buffer_bytes)
        return pr

    # ------------------------------------------------------------ the turn

    def turn(self, text: str, image_paths: Sequence[str | Path] = (), gp: GenParams | None = None,
             on_text: Callable[[str], None] | None = None,
             cancel: threading.Event | None = None) -> TurnResult:
        """One user turn. A bad input returns a result with `error`; the context is kept."""
        self._request_id += 1
        res = TurnResult(self._request_id, n_images=len(image_paths))
        self.ledger.reset_peaks()
        if self.accel_endpoint and self.accel_endpoint in check_rpc_servers():
            self.abandoned = True
            raise DeviceLost(f"the RPC server {self.accel_endpoint} ({self.accel}) went away",
                             "continuing on the devices that are left")
        try:
            images = [load_image(Path(p)) for p in image_paths]
            if images and (self.ram_projector is None or not self.vision_enabled):
                raise EbbError("this message has images but vision is off" if self.proj_info
                               else "this message has images but no projector is loaded",
                               "turn vision on" if self.proj_info else "start with --mmproj FILE.gguf")
            self._encode_new(self._pending_history_images() + images, res)
            self._generate(text, images, gp or GenParams(), on_text, cancel, res)
        except EbbError as exc:
            res.error = str(exc)
        res.device_peak_bytes = self.ledger.peaks()
        return res

    def encode_only(self, image_paths: Sequence[str | Path]) -> TurnResult:
        """Plan and encode images afresh (cache ignored), without adding them to the
        conversation: one full swap cycle when the plan says swap. For benchmarks and tests."""
        self._request_id += 1
        res = TurnResult(self._request_id, n_images=len(image_paths))
        self.ledger.reset_peaks()
        images = [load_image(Path(p)) for p in image_paths]
        for img in images:
            self._cache.pop(self._key(img), None)
        self._encode_new(images, res)
        res.device_peak_bytes = self.ledger.peaks()
        return res

    def _key(self, img: LoadedImage) -> str:
        return f"{self._proj_id}:{img.sha256}"

    def _encode_new(self, images: list[LoadedImage], res: TurnResult) -> None:
        todo = list({self._key(i): i for i in images if self._key(i) not in self._cache}.values())
        res.n_images_cached = len(images) - len(todo)
        if not images:
            return
        if not todo:
            res.reason = f"all {len(images)} images already encoded (cache)"
            return
        assert self.proj_info is not None and self.runtime is not None
        n_tokens = self.proj_info.n_image_tokens * len(todo)
        state_bytes = self.n_ctx * self.info.kv_bytes_per_token if self.runtime.n_positions() else 0
        with self._span(res.spans, "plan", CPU):
            plan = plan_vision(self.cfg.vision, self.placement, self.proj_info, self.budget_bytes,
                               n_tokens, state_bytes, self.cfg.flash_attn, self.costs,
                               resident_loaded=self._accel_projector is not None,
                               reload_ok=self.cfg.mover != "live")
        if isinstance(plan, DoesNotFit):
            raise EbbError(plan.reason)
        res.strategy, res.reason = plan.strategy, plan.reason
        res.swap_mover, res.mover_note = plan.mover, plan.mover_note
        if plan.strategy == "cpu":
            assert self.ram_projector is not None
            self._encode_all(self.ram_projector, todo, res, plan, CPU)
        elif plan.strategy == "resident":
            if self._accel_projector is None:
                with self._span(res.spans, "load_projector", self.accel or CPU,
                                projector_need_bytes(self.proj_info, self.cfg.flash_attn), plan):
                    self._accel_projector = self._load_accel_projector(self.runtime)
                    self.runtime.reschedule()
                self._emit_residency()
            self._encode_all(self._accel_projector, todo, res, plan, self.accel or CPU)
        elif self.mover is not None and plan.mover == "live":
            swap.swap_live(self, todo, res, plan)
        else:
            swap.swap_reload(self, todo, res, plan)
        res.n_images_encoded = len(todo)

    def _encode_all(self, pr: ProjectorRuntime, todo: list[LoadedImage], res: TurnResult,
                    plan: VisionPlan, device: str) -> None:
        for img in todo:
            with self._span(res.spans, "encode", device, len(img.rgb), plan, Path(img.path).name):
                enc = pr.encode(img)
            self._cache[self._key(img)] = enc
            per_token = enc.encode_s / max(enc.n_tokens, 1)
            if device == CPU:
                self.costs = replace(self.costs, cpu_encode_s_per_token=per_token)
            else:
                self.costs = replace(self.costs, accel_encode_s_per_token=per_token)

    def set_history(self, turns: Sequence[tuple[str, str, Sequence[str | Path]]]) -> None:
        """Replace the conversation with (role, text, image files) turns, e.g. a saved chat.
        Images are encoded lazily, with the next turn's plan."""
        history = []
        for role, text, paths in turns:
            keys = []
            for p in paths:
                if self.ram_projector is None:
                    continue
                try:
                    img = load_image(Path(p))
                except EbbError:
                    continue  # a saved image that went missing: leave it out
                keys.append(self._key(img))
                self._image_paths[keys[-1]] = str(p)
            history.append(HistoryTurn(role, text, tuple(keys)))
        self.history = history

    def undo_last_exchange(self) -> tuple[str, list[str]] | None:
        """Drop the last user turn and its reply (for Regenerate); returns its text and images."""
        for i in range(len(self.history) - 1, -1, -1):
            if self.history[i].role == "user":
                turn = self.history[i]
                self.history = self.history[:i]
                return turn.text, [self._image_paths[k] for k in turn.image_keys if k in self._image_paths]
        return None

    def _messages(self, extra: HistoryTurn | None = None) -> tuple[list[dict[str, str]], list[str]]:
        """Chat messages for the template, and the image keys in prompt order. With vision off,
        earlier images are left out of the prompt."""
        marker = self.ram_projector.marker if self.ram_projector else ""
        use_images = bool(marker) and self.vision_enabled
        msgs = [{"role": "system", "content": self.cfg.system}] if self.cfg.system else []
        keys: list[str] = []
        for t in self.history + ([extra] if extra else []):
            images = t.image_keys if use_images else ()
            msgs.append({"role": t.role, "content": "".join(f"{marker}\n" for _ in images) + t.text})
            keys.extend(images)
        return msgs, keys

    @property
    def messages(self) -> list[dict[str, str]]:
        return self._messages()[0]

    def _pending_history_images(self) -> list[LoadedImage]:
        if not self.vision_enabled:
            return []
        out = []
        for t in self.history:
            for k in t.image_keys:
                if k not in self._cache and k in self._image_paths:
                    out.append(load_image(Path(self._image_paths[k])))
        return out

    def _generate(self, text: str, images: list[LoadedImage], gp: GenParams,
                  on_text: Callable[[str], None] | None, cancel: threading.Event | None,
                  res: TurnResult) -> None:
        assert self.runtime is not None
        for img in images:
            self._image_paths[self._key(img)] = img.path
        turn = HistoryTurn("user", text, tuple(self._key(i) for i in images))
        messages, keys = self._messages(turn)
        marker = self.ram_projector.marker if self.ram_projector else ""
        spans = [ImageSpan(k, self._cache[k].embeddings) for k in keys]
        items = self.runtime.build_prompt(messages, marker or "\0no-images\0", spans)
        accel = self.placement.accel or CPU
        t_start = time.monotonic()
        result = self.runtime.generate_from(items, gp, on_text, cancel)
        t_pre = t_start + result.prompt_s
        for name, a, b in (("prefill", t_start, t_pre), ("decode", t_pre, t_pre + result.gen_s)):
            span = events.Span(self._request_id, name=name, start_s=a, end_s=b, device=accel)
            res.spans.append(span)
            self._emit(span)
        res.text = result.text
        res.gen = result.to_dict()
        del res.gen["text"]
        self.history = self.history + [turn, HistoryTurn("assistant", result.text)]


def turn_with_recovery(session: Session, text: str, image_paths: Sequence[str | Path] = (),
                       gp: GenParams | None = None, on_text: Callable[[str], None] | None = None,
                       cancel: threading.Event | None = None,
                       emit: Callable[[events.Event], None] | None = None) -> tuple[Session, TurnResult]:
    """A turn that survives its RPC server going away between turns: the session is rebuilt on
    the devices left, with the conversation, and the turn runs there. Returns the session to
    use from now on (the same one when nothing happened)."""
    try:
        return session, session.turn(text, image_paths, gp, on_text, cancel)
    except DeviceLost as exc:
        new = Session(replace(session.cfg, accel=None), emit=emit)
        new.history = list(session.history)
        new._image_paths = dict(session._image_paths)
        session.close()  # abandoned: drops its handles without touching the lost device
        res = new.turn(text, image_paths, gp, on_text, cancel)
        res.reason = f"{exc}; now on {new.accel or 'CPU'}" + (f"; {res.reason}" if res.reason else "")
        res.device_lost = str(exc)
        return new, res
