"""The planner: pure functions, no I/O. Where each part of the model and the projector lives,
what it costs, and the vision strategy for a turn. "Does not fit" is a value with a reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.gguf.info import ModelInfo, ProjectorInfo

CPU = "CPU"
F32 = 4
Strategy = Literal["resident", "swap", "cpu"]
STRATEGIES: tuple[Strategy, ...] = ("resident", "swap", "cpu")


def _mib(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:.1f} MiB"


def _budget_flag(n_bytes: int) -> str:
    """A budget of at least `n_bytes`, as --vram-budget takes it (whole MiB, rounded up)."""
    return f"--vram-budget {-(-n_bytes // 2**20)}MiB"


@dataclass(frozen=True)
class DoesNotFit:
    reason: str


@dataclass(frozen=True)
class Placement:
    """Which device holds each part of the language model (llama.cpp semantics: n_gpu_layers
    offloads the output layer first, then the last repeating layers)."""
    accel: str | None
    n_gpu_layers: int
    layer_devices: tuple[str, ...]
    output_device: str
    embeddings_device: str = CPU  # llama.cpp keeps the input embeddings on the host
    accel_bytes: dict[str, int] = field(default_factory=dict)  # weights, kv, compute
    live: bool = False  # the live mover's layout: layers move, the rest stays on the device
    layer_bytes: tuple[int, ...] = ()

    @property
    def accel_total_bytes(self) -> int:
        return sum(self.accel_bytes.values())

    @property
    def n_layers_on_accel(self) -> int:
        return sum(1 for d in self.layer_devices if d != CPU)

    @property
    def layers_by_device(self) -> dict[str, int]:
        """How many repeating layers each device holds, in layer order."""
        return {d: self.layer_devices.count(d) for d in dict.fromkeys(self.layer_devices)}

    @property
    def accel_layers(self) -> list[int]:
        return [i for i, d in enumerate(self.layer_devices) if d != CPU]

    @property
    def movable_bytes(self) -> int:
        """Bytes a swap can free on the device: all of it (reload) or the layers' (live)."""
        if not self.live:
            return self.accel_total_bytes
        return sum(self.layer_bytes[i] for i in self.accel_layers)


def device_layers(n_layers: int, llama_layers: int) -> range:
    """The repeating layers llama.cpp's layer count puts on the device: the count's first is
    the output layer, then the last repeating layers. The one place this rule is written."""
    n_rep = max(0, min(llama_layers - 1, n_layers))
    return range(n_layers - n_rep, n_layers)


def layers_to_evict(placement: Placement, deficit_bytes: int) -> list[int]:
    """The fewest of the last accelerator layers whose weights free `deficit_bytes`."""
    out: list[int] = []
    freed = 0
    for i in reversed(placement.accel_layers):
        if freed >= deficit_bytes:
            break
        out.append(i)
        freed += placement.layer_bytes[i]
    return out


def output_bytes(model: ModelInfo) -> int:
    """Bytes of the output matrix on a device (a tied embedding is duplicated there)."""
    t = model.non_layer_tensors
    return t.get("output.weight", t.get("token_embd.weight", 0)) + t.get("output_norm.weight", 0)


def accel_bytes(model: ModelInfo, n_gpu_layers: int, n_ctx: int, n_ubatch: int,
                flash_attn: bool, live: bool = False) -> dict[str, int]:
    """Predicted device bytes for a placement, by kind. `live`: the live mover's layout, where
    the KV cache of every layer is on the device whichever layers' weights are."""
    if n_gpu_layers <= 0 and not live:
        return {"weights": 0, "kv": 0, "compute": 0}
    layers = device_layers(model.n_layers, n_gpu_layers)
    weights = output_bytes(model) + sum(model.layer_bytes[i] for i in layers)
    kv_layers = range(model.n_layers) if live else layers
    kv = sum(model.kv_bytes_per_token_per_layer[i] for i in kv_layers) * n_ctx
    return {"weights": weights, "kv": kv,
            "compute": compute_buffer_bytes(model, n_ctx, n_ubatch, flash_attn, with_output=True)}


def compute_buffer_bytes(model: ModelInfo, n_ctx: int, n_ubatch: int, flash_attn: bool,
                         with_output: bool) -> int:
    """A device's compute buffer, predicted: the widest activations alive at once (the FFN's
    hidden width and a few residual streams), the logits where the output layer is there, and
    the attention scores without flash attention. Measured 5.5 MiB on SmolLM2 at ubatch 512
    (with the output layer); this says 6.4. The one formula for one device and for a spread."""
    compute = n_ubatch * (3 * model.n_embd + model.n_ff) * F32
    if with_output:
        compute += model.n_vocab * n_ubatch * F32
    if not flash_attn:
        compute += model.n_head * n_ctx * n_ubatch * F32
    return compute


def placement_for(model: ModelInfo, accel: str | None, n_gpu_layers: int, n_ctx: int,
                  n_ubatch: int, flash_attn: bool, live: bool = False) -> Placement:
    k = max(0, min(n_gpu_layers, model.n_layers + 1)) if accel else 0
    # `accel` stays named even at k == 0: the device the projector may borrow
    on = device_layers(model.n_layers, k)
    layer_devices = tuple(accel if (accel and i in on) else CPU for i in range(model.n_layers))
    live = live and accel is not None
    return Placement(accel, k, layer_devices, accel if (accel and (k >= 1 or live)) else CPU,
                     accel_bytes=accel_bytes(model, k, n_ctx, n_ubatch, flash_attn, live),
                     live=live, layer_bytes=tuple(model.layer_bytes))


def plan_placement(model: ModelInfo, accel: str | None, budget_bytes: int, n_ctx: int,
                   n_ubatch: int, flash_attn: bool, reserve_bytes: int = 0,
                   live: bool = False, max_gpu_layers: int | None = None) -> Placement | DoesNotFit:
    """The most layers on `accel` (at most `max_gpu_layers`, llama.cpp's count, when given:
    autotune's choice) whose bytes (plus `reserve_bytes`) fit the budget."""
    best = placement_for(model, accel, 0, n_ctx, n_ubatch, flash_attn)  # all in RAM
    if accel is None:
        return best
    top = model.n_layers + 1 if max_gpu_layers is None else min(max_gpu_layers, model.n_layers + 1)
    if top <= 0 and not live:
        return best
    for k in range(top, 0, -1):
        p = placement_for(model, accel, k, n_ctx, n_ubatch, flash_attn, live)
        if p.accel_total_bytes + reserve_bytes <= budget_bytes:
            return p
    if live:
        b = placement_for(model, accel, 1, n_ctx, n_ubatch, flash_attn, live).accel_bytes
        parts = [f"the output layer ({_mib(b['weights'])})", f"every layer's KV cache "
                 f"({_mib(b['kv'])})", f"the compute buffer ({_mib(b['compute'])})"]
        if reserve_bytes:
            parts.append(f"room for the resident projector ({_mib(reserve_bytes)})")
        return DoesNotFit(f"the live layout needs {', '.join(parts[:-1])} and {parts[-1]} on "
                          f"{accel}: {_mib(sum(b.values()) + reserve_bytes)}, more than the "
                          f"budget of {_mib(budget_bytes)}")
    return best


# ---------------------------------------------------------------- the vision turn


@dataclass(frozen=True)
class Costs:
    """Measured (or default) costs the vision plan weighs. Seconds and bytes per second."""
    bus_Bps: float = 1.0e9
    cpu_encode_s_per_token: float = 2e-3
    accel_encode_s_per_token: float = 2e-3
    reload_overhead_s: float = 0.3
    projector_overhead_s: float = 0.0  # loading the projector beyond its bytes over the bus


@dataclass(frozen=True)
class PlannedStep:
    name: str
    device: str
    bytes: int
    predicted_s: float
    layers: tuple[int, ...] = ()  # the layers a live evict (and its restore) moves


@dataclass(frozen=True)
class VisionPlan:
    strategy: Strategy
    reason: str
    steps: tuple[PlannedStep, ...]
    predicted_s: dict[str, float | None]  # each strategy's cost; None where it does not fit
    # which mover a swap uses: "live" (layers only) or "reload" (the whole model and its
    # context); a live placement takes the reload mover when the layers alone free too little
    mover: str = ""
    mover_note: str = ""

    @property
    def total_s(self) -> float:
        return sum(s.predicted_s for s in self.steps)


def projector_need_bytes(proj: ProjectorInfo, flash_attn: bool) -> int:
    if proj.compute_buffer_bytes_measured:  # mtmd's own reserve, once it has loaded
        return proj.weight_bytes + proj.compute_buffer_bytes_measured
    compute = (proj.compute_buffer_bytes_estimate_flash_attn if flash_attn
               else proj.compute_buffer_bytes_estimate)
    return proj.weight_bytes + compute


# Freeing the projector ends when the device has let its memory go: on loopback RPC about 5 ms
# for ~100 MB of weights and compute buffer (the server unmaps them).
FREE_FIXED_S = 0.001
FREE_BPS = 20e9


def _steps(strategy: Strategy, accel: str, placement: Placement, need: int, proj_bytes: int,
           n_tokens: int, state_bytes: int, resident_loaded: bool, c: Costs,
           budget: int, mover: str, used: int) -> list[PlannedStep]:
    encode_accel = PlannedStep("encode", accel, 0, n_tokens * c.accel_encode_s_per_token)
    if strategy == "cpu":
        return [PlannedStep("encode", CPU, 0, n_tokens * c.cpu_encode_s_per_token)]
    load = PlannedStep("load_projector", accel, need, proj_bytes / c.bus_Bps + c.projector_overhead_s)
    if strategy == "resident":
        return ([] if resident_loaded else [load]) + [encode_accel]
    if mover == "live":
        evict = tuple(layers_to_evict(placement, need - (budget - used)))
        moved = sum(placement.layer_bytes[i] for i in evict)
        # evicting only re-points tensors and frees buffers; restoring copies the layers back
        # (a few large copies) into a few new buffers (~1 ms of calls and round trips)
        return [PlannedStep("evict", accel, moved, 0.0005 + 0.00002 * len(evict), evict),
                load, encode_accel,
                PlannedStep("free_projector", accel, need, FREE_FIXED_S + need / FREE_BPS),
                PlannedStep("restore", accel, moved, moved / c.bus_Bps + 0.001, evict)]
    model_bytes = placement.accel_bytes.get("weights", 0)
    return [
        PlannedStep("save_state", CPU, state_bytes, state_bytes / c.bus_Bps),
        PlannedStep("evict", accel, placement.accel_total_bytes, 0.01),
        load, encode_accel,
        PlannedStep("free_projector", accel, need, FREE_FIXED_S + need / FREE_BPS),
        PlannedStep("restore", accel, placement.accel_total_bytes,
                    model_bytes / c.bus_Bps + c.reload_overhead_s),
        PlannedStep("restore_state", accel, state_bytes, state_bytes / c.bus_Bps),
    ]


def _swap_mover(placement: Placement, need: int, budget_bytes: int,
                reload_ok: bool) -> tuple[str, str, str]:
    """(mover, note, why not) for a swap: the live mover when evicting layers makes room, else
    the reload mover (it frees the KV cache, compute buffers and output layer too) if allowed;
    "why not" names every way out that exists when neither can."""
    floor = placement.accel_total_bytes - placement.movable_bytes
    live = placement.live
    if live and need + floor <= budget_bytes:
        return "live", "", ""
    live_short = (f"projector needs {_mib(need)}, more than what evicting every layer frees "
                  f"({_mib(max(budget_bytes - floor, 0))}: the output layer, KV cache and compute "
                  f"buffer keep {_mib(floor)} of the {_mib(budget_bytes)} budget)")
    if need <= budget_bytes and (reload_ok or not live):
        return "reload", (f"this swap used the reload mover: the live mover cannot make room "
                          f"({live_short})" if live else ""), ""
    ways = ["encode on the CPU (--vision cpu)",
            f"raise the budget ({_budget_flag(need + (floor if live and not reload_ok else 0))} or more)"]
    if need <= budget_bytes:  # a live session that may not use the reload mover
        ways.insert(0, f"let the reload mover swap (--mover auto or reload): it frees the whole "
                       f"{_mib(budget_bytes)} budget")
        short = live_short
    else:
        short = f"projector needs {_mib(need)}, more than the whole budget ({_mib(budget_bytes)})"
    return "", "", f"{short}; " + ", or ".join(ways)


def plan_vision(requested: str, placement: Placement, proj: ProjectorInfo, budget_bytes: int,
                n_tokens: int, state_bytes: int, flash_attn: bool, costs: Costs,
                resident_loaded: bool = False, reload_ok: bool = True,
                used_bytes: int | None = None) -> VisionPlan | DoesNotFit:
    """Choose how to encode `n_tokens` image tokens. `requested`: auto|resident|swap|cpu.
    `reload_ok`: a live placement may swap with the reload mover when its layers free too
    little (not when the user asked for the live mover). `used_bytes`: what the accelerator
    holds now (the ledger), if known; the layers a live swap evicts make room from there."""
    accel = placement.accel
    need = projector_need_bytes(proj, flash_attn)
    free_beside = budget_bytes - placement.accel_total_bytes
    why_not: dict[str, str] = {}
    mover = note = ""
    if accel is None:
        why_not["resident"] = why_not["swap"] = "there is no accelerator"
    else:
        if not resident_loaded and need > free_beside:
            why_not["resident"] = (f"projector needs {need / 2**20:.0f} MiB, the budget leaves "
                                   f"{max(free_beside, 0) / 2**20:.0f} MiB beside the model")
        mover, note, why = _swap_mover(placement, need, budget_bytes, reload_ok)
        if why:
            why_not["swap"] = why
    predicted: dict[str, float | None] = {}
    steps: dict[Strategy, list[PlannedStep]] = {}
    for s in STRATEGIES:
        if s in why_not:
            predicted[s] = None
            continue
        steps[s] = _steps(s, accel or CPU, placement, need, proj.weight_bytes, n_tokens,
                          state_bytes, resident_loaded, costs, budget_bytes, mover,
                          placement.accel_total_bytes if used_bytes is None else used_bytes)
        predicted[s] = sum(p.predicted_s for p in steps[s])
    if requested != "auto":
        if requested not in STRATEGIES:
            return DoesNotFit(f"unknown vision strategy '{requested}'")
        if requested in why_not:
            return DoesNotFit(f"{requested} is not possible: {why_not[requested]}")
        chosen = next(s for s in STRATEGIES if s == requested)
        reason = f"{chosen} as requested" + (f" ({note})" if chosen == "swap" and note else "")
    else:
        # auto: cheapest; on a tie prefer the one that touches the accelerator least
        order = {"cpu": 0, "resident": 1, "swap": 2}
        chosen = min(steps, key=lambda s: (round(predicted[s] or 0.0, 3), order[s]))
        others = ", ".join(f"{s} {predicted[s]:.2f}s" if predicted[s] is not None
                           else f"{s} impossible ({why_not[s]})" for s in STRATEGIES if s != chosen)
        reason = f"auto chose {chosen}: predicted {predicted[chosen]:.2f}s; {others}"
        if chosen == "swap" and note:
            reason += f"; {note}"
    swapping = chosen == "swap"
    return VisionPlan(chosen, reason, tuple(steps[chosen]), predicted,
                      mover=mover if swapping else "", mover_note=note if swapping else "")


# ---------------------------------------------------------------- several devices


SCHED_COPIES = 4  # ggml's GGML_SCHED_MAX_COPIES: compute buffers under pipeline parallelism


@dataclass(frozen=True)
class DeviceOffer:
    """An accelerator the planner may use: its budget and how fast weights reach it (the
    measured host→device copy bandwidth; a remote device's is its network's)."""
    name: str
    budget_bytes: int
    bandwidth_Bps: float


@dataclass(frozen=True)
class Spread:
    placement: Placement
    split: tuple[tuple[str, int], ...]  # (device, layers incl. the output on the last), load order
    device_bytes: dict[str, dict[str, int]]
    reasons: tuple[str, ...]


def spread_bytes(model: ModelInfo, layers: list[int], with_output: bool, n_ctx: int,
                 n_ubatch: int, flash_attn: bool) -> dict[str, int]:
    """Predicted bytes on one device holding `layers` (and the output layer if asked)."""
    weights = sum(model.layer_bytes[i] for i in layers) + (output_bytes(model) if with_output else 0)
    kv = sum(model.kv_bytes_per_token_per_layer[i] for i in layers) * n_ctx
    return {"weights": weights, "kv": kv,
            "compute": compute_buffer_bytes(model, n_ctx, n_ubatch, flash_attn, with_output)}


def plan_spread(model: ModelInfo, offers: list[DeviceOffer], n_ctx: int, n_ubatch: int,
                flash_attn: bool) -> Spread:
    """Layers across several accelerators and RAM. The device with the fastest measured link
    takes the output and the last layers, up to its budget (those are the layers a vision swap
    moves, and the projector borrows that device); the next fastest the layers before those;
    what is left stays in RAM. Each choice is explained in numbers."""
    ranked = sorted(offers, key=lambda o: o.bandwidth_Bps, reverse=True)
    reasons = ["by measured link: " + ", ".join(
        f"{o.name} {o.bandwidth_Bps / 1e9:.2f} GB/s ({o.budget_bytes / 2**20:.0f} MiB budget)"
        for o in ranked)]
    next_layer = model.n_layers - 1
    taken: list[tuple[str, list[int], bool, dict[str, int]]] = []
    for o in ranked:
        out = not taken
        layers: list[int] = []
        while next_layer >= 0:
            trial = [next_layer] + layers
            if sum(spread_bytes(model, trial, out, n_ctx, n_ubatch, flash_attn).values()) > o.budget_bytes:
                break
            layers = trial
            next_layer -= 1
        b = spread_bytes(model, layers, out, n_ctx, n_ubatch, flash_attn)
        if out and sum(b.values()) > o.budget_bytes:
            reasons.append(f"{o.name}: none (not even the output layer fits "
                           f"{o.budget_bytes / 2**20:.0f} MiB)")
            continue
        if not layers and not out:
            reasons.append(f"{o.name}: none (no layer fits {o.budget_bytes / 2**20:.0f} MiB)")
            continue
        taken.append((o.name, layers, out, b))
        what = (f"layers {layers[0]}–{layers[-1]}" if layers else "no layers") + \
            (" and the output" if out else "")
        role = (" — the fastest link with room for the output: the layers a swap moves, and the "
                "projector's device") if out else ""
        reasons.append(f"{o.name}: {what} ({sum(b.values()) / 2**20:.0f} of "
                       f"{o.budget_bytes / 2**20:.0f} MiB){role}")
        if next_layer < 0:
            break
    if next_layer < 0 and len(taken) > 1:
        # every layer offloaded over several devices turns on llama.cpp's pipeline parallelism:
        # GGML_SCHED_MAX_COPIES (4) copies of each device's compute buffer
        grown = {name: b["compute"] * (SCHED_COPIES - 1) for name, _, _, b in taken}
        budget = {o.name: o.budget_bytes for o in ranked}
        if any(sum(b.values()) + grown[name] > budget[name] for name, _, _, b in taken):
            name, layers, out, _ = taken[-1]
            taken[-1] = (name, layers[1:], out,
                         spread_bytes(model, layers[1:], out, n_ctx, n_ubatch, flash_attn))
            next_layer = 0
            reasons.append(f"layer 0 stays in RAM: with every layer offloaded over several devices "
                           f"llama.cpp keeps {SCHED_COPIES} copies of each compute buffer "
                           f"(+{max(grown.values()) / 2**20:.0f} MiB on a device), over budget")
        else:
            taken = [(n, la, out, {**b, "compute": b["compute"] * SCHED_COPIES})
                     for n, la, out, b in taken]
    if next_layer >= 0:
        reasons.append(f"RAM: layers 0–{next_layer}")
    layer_devices = [CPU] * model.n_layers
    for name, layers, _, _ in taken:
        for i in layers:
            layer_devices[i] = name
    primary = taken[0] if taken else None
    # llama.cpp deals offloaded layers to devices in list order, the output last: load order is
    # the reverse of the ranking
    split = tuple((name, len(layers) + (1 if out else 0)) for name, layers, out, _ in reversed(taken))
    placement = Placement(primary[0] if primary else None, sum(n for _, n in split),
                          tuple(layer_devices), primary[0] if primary else CPU,
                          accel_bytes=primary[3] if primary else {}, layer_bytes=tuple(model.layer_bytes))
    return Spread(placement, split, {name: b for name, _, _, b in taken}, tuple(reasons))
