"""`ebb-engine plan`: what a model would do on a device you may not own, from its header.

Pure arithmetic over the GGUF's tensor table and the planner. Costs come from this machine's
calibration (`ebb-engine calibrate`, engine/placement/calibration.py) where there is one: the CPU side
always (RAM is this machine's), the accelerator side when `--device` names a calibrated one.
Otherwise they are defaults the user can override (bus, memory bandwidths, encode speed), and
the output says which parts are calibrated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import EbbError
from engine.gguf.info import ModelInfo, ProjectorInfo
from engine.placement.calibration import (
    DeviceCal,
    predict_text,
    split_bytes,
    vision_costs,
)
from engine.config import PhaseTuning
from engine.placement.phase_choice import MOVE_FIXED_S, plan_phase_move
from engine.placement.plan import (
    Costs,
    DoesNotFit,
    Placement,
    VisionPlan,
    device_layers,
    placement_for,
    plan_placement,
    plan_vision,
)

BUS_GBPS = {"pcie3": 12.0, "pcie4": 24.0, "pcie5": 48.0}  # host→device, pinned, GB/s


def parse_bus(text: str) -> float:
    """Bytes per second for pcie3|pcie4|pcie5 or a number of GB/s."""
    if text.lower() in BUS_GBPS:
        return BUS_GBPS[text.lower()] * 1e9
    try:
        value = float(text)
    except ValueError:
        raise EbbError(f"'{text}' is not a bus", "use pcie3, pcie4, pcie5 or GB/s like 16") from None
    if value <= 0:
        raise EbbError(f"bus speed must be positive, got {text}")
    return value * 1e9


@dataclass(frozen=True)
class WhatIf:
    placement: Placement
    ram_weight_bytes: int
    gen_tokens_per_s: float
    vision: dict[str, float | None]
    vision_plan: VisionPlan | None
    prompt_tokens_per_s: float | None = None
    calibrated: dict[str, bool] | None = None
    oversize: dict[str, Any] | None = None
    phases: dict[str, Any] | None = None  # each phase at its best: see price_phases

    def to_dict(self) -> dict[str, Any]:
        p = self.placement
        return {
            "n_layers_on_accel": p.n_layers_on_accel, "n_gpu_layers": p.n_gpu_layers,
            "accel_bytes": p.accel_bytes, "accel_total_bytes": p.accel_total_bytes,
            "ram_weight_bytes": self.ram_weight_bytes,
            "gen_tokens_per_s": round(self.gen_tokens_per_s, 1),
            "prompt_tokens_per_s": (round(self.prompt_tokens_per_s, 1)
                                    if self.prompt_tokens_per_s is not None else None),
            "live_layout": p.live,
            "vision_predicted_s": self.vision,
            "vision_auto": self.vision_plan.strategy if self.vision_plan else None,
            "vision_steps": [s.__dict__ for s in self.vision_plan.steps] if self.vision_plan else [],
            "calibrated": self.calibrated or {"cpu": False, "accelerator": False},
            "oversize": self.oversize,
            "phases": self.phases,
        }


FLOPS_PER_BYTE = 4.0
CPU_FLOPS_PER_THREAD = 50e9
GPU_FLOPS = 30e12
UBATCH = 512


def default_cals(ram_Bps: float, vram_Bps: float, n_threads: int) -> tuple[DeviceCal, DeviceCal]:
    """Uncalibrated costs: batch-1 decoding reads every weight once per token (memory bound);
    a prompt token costs ~4 flops per weight byte (quantized weights, compute bound)."""
    cpu = DeviceCal("CPU", 1 / ram_Bps, FLOPS_PER_BYTE / (CPU_FLOPS_PER_THREAD * n_threads))
    acc = DeviceCal("GPU", 1 / vram_Bps, FLOPS_PER_BYTE / GPU_FLOPS)
    return cpu, acc


def compare_oversize(model: ModelInfo, placement: Placement, cpu: DeviceCal, acc: DeviceCal,
                     bus_Bps: float, n_prompt: int, can_stream: bool) -> dict[str, Any]:
    """For a model that does not fit: each phase's cost under a static split, streaming the
    RAM-resident layers' weights through the accelerator per batch (llama.cpp's op offload for
    batches over 32 tokens, where the backend supports it) and a layer window (groups paged
    in once per prompt). Picks per phase and says why, in numbers."""
    wc, wa = split_bytes(model, placement)
    n_ub = -(-n_prompt // UBATCH)
    all_w = wc + wa
    on_acc_prompt = all_w * acc.prompt_s_per_byte + acc.split_prompt_s
    prompt: dict[str, float | None] = {
        "static": n_prompt * (wc * cpu.prompt_s_per_byte + wa * acc.prompt_s_per_byte
                              + acc.split_prompt_s),
        "stream": n_ub * wc / bus_Bps + n_prompt * on_acc_prompt if can_stream else None,
        "window": None,
    }
    gen: dict[str, float | None] = {
        "static": wc * cpu.gen_s_per_byte + wa * acc.gen_s_per_byte + acc.split_gen_s,
        "stream": (wc / bus_Bps + all_w * acc.gen_s_per_byte + acc.split_gen_s
                   if can_stream else None),
        "window": None,
    }
    window_s = wc / bus_Bps + n_prompt * on_acc_prompt  # what it would cost: one pass per prompt
    choice = {ph: min((k for k, v in d.items() if v is not None), key=lambda k: d[k] or 0.0)
              for ph, d in (("prompt", prompt), ("generation", gen))}
    gib = wc / 2**30
    gen_static = gen["static"] or 0.0
    why = [f"{gib:.2f} GiB of weights stay in RAM."]
    if gen["stream"] is not None:
        why.append(f"Generation: static split {gen_static * 1000:.1f} ms/token (RAM side read "
                   f"in place) vs streaming {gen['stream'] * 1000:.1f} ms/token ({gib:.2f} GiB over "
                   f"the {bus_Bps / 1e9:.0f} GB/s bus for every token): {choice['generation']}.")
    else:
        why.append(f"Generation: static split {gen_static * 1000:.1f} ms/token.")
    if prompt["stream"] is not None:
        why.append(f"Prompt of {n_prompt} tokens: static {prompt['static']:.2f} s vs streaming "
                   f"{prompt['stream']:.2f} s (RAM weights cross the bus once per {UBATCH}-token "
                   f"batch, then run at the accelerator's speed): {choice['prompt']}.")
    else:
        why.append(f"Prompt of {n_prompt} tokens: static {prompt['static']:.2f} s; streaming is not "
                   "possible on this device (its backend cannot run host-weight ops).")
    why.append(f"A layer window would take ~{window_s:.2f} s for the prompt, but Ebb cannot yet "
               "run a graph over one group of layers at a time, so it is not offered.")
    return {"n_prompt": n_prompt, "prompt_s": prompt, "generation_s_per_token": gen,
            "window_prompt_s": window_s, "choice": choice, "why": " ".join(why)}


def what_if(model: ModelInfo, proj: ProjectorInfo | None, vram_bytes: int, bus_Bps: float,
            ram_Bps: float, vram_Bps: float, n_ctx: int, n_threads: int,
            cpu_cal: DeviceCal | None = None, accel_cal: DeviceCal | None = None,
            accel: str = "GPU", n_prompt: int = 2048, can_stream: bool = True) -> WhatIf:
    # the live mover's layout (what a session runs); llama.cpp's own split if that cannot fit
    placement = plan_placement(model, accel, vram_bytes, n_ctx, 512, True, live=True)
    if isinstance(placement, DoesNotFit):
        placement = plan_placement(model, accel, vram_bytes, n_ctx, 512, True)
    assert not isinstance(placement, DoesNotFit)
    t = model.non_layer_tensors
    wc, _ = split_bytes(model, placement)
    ram_w = wc + t.get("token_embd.weight", 0)  # the input embeddings stay in RAM too
    d_cpu, d_acc = default_cals(ram_Bps, vram_Bps, n_threads)
    cpu = cpu_cal or d_cpu
    acc = accel_cal or d_acc
    pred = predict_text(model, placement, cpu, acc)
    oversize = None
    prompt_tps = pred.prompt_tokens_per_s
    if placement.n_layers_on_accel < model.n_layers:
        oversize = compare_oversize(model, placement, cpu, acc, acc.bus_Bps or bus_Bps,
                                    min(n_prompt, n_ctx), can_stream)
        chosen = oversize["prompt_s"][oversize["choice"]["prompt"]]
        prompt_tps = oversize["n_prompt"] / chosen if chosen else prompt_tps
    vision: dict[str, float | None] = {}
    vplan: VisionPlan | None = None
    if proj is not None:
        flops_per_token = proj.weight_bytes  # f16 weights: 2 flops per 2 bytes
        costs = Costs(bus_Bps=bus_Bps, cpu_encode_s_per_token=flops_per_token / (40e9 * n_threads),
                      accel_encode_s_per_token=flops_per_token / 20e12)
        if cpu_cal is not None:
            costs = vision_costs(cpu_cal, accel_cal, proj.weight_bytes, costs)
        result = plan_vision("auto", placement, proj, vram_bytes, proj.image_tokens,
                             model.kv_bytes_per_token * n_ctx, True, costs)
        if isinstance(result, VisionPlan):
            vplan = result
            vision = dict(result.predicted_s)
    phases = (price_phases(model, placement, cpu, acc, acc.bus_Bps or bus_Bps, n_ctx,
                           min(n_prompt, n_ctx)) if placement.live else None)
    return WhatIf(placement, ram_w, pred.gen_tokens_per_s, vision, vplan, prompt_tps,
                  {"cpu": cpu_cal is not None, "accelerator": accel_cal is not None}, oversize,
                  phases)


def price_phases(model: ModelInfo, fits: Placement, cpu: DeviceCal, acc: DeviceCal,
                 bus_Bps: float, n_ctx: int, n_prompt: int) -> dict[str, Any]:
    """Each phase's best layer count among those that fit (0 .. the live placement's), as the
    cost model predicts them, and whether a prompt of `n_prompt` tokens pays for moving to the
    prompt's best and back (the live mover's move: one copy of the layers that differ over the
    bus, and two re-plans)."""
    assert fits.accel is not None
    by_k = {}
    for k in range(fits.n_gpu_layers + 1):
        p = placement_for(model, fits.accel, k, n_ctx, 512, True, live=True)
        by_k[k] = predict_text(model, p, cpu, acc)
    gen_k = max(by_k, key=lambda k: (by_k[k].gen_tokens_per_s, k))
    prompt_k = max(by_k, key=lambda k: (by_k[k].prompt_tokens_per_s, k))
    t = PhaseTuning(gen_k, prompt_k, 0, 0, by_k[gen_k].prompt_tokens_per_s,
                    by_k[prompt_k].prompt_tokens_per_s)
    # the session's rule (plan_phase_move), from generation's placement; every count up to
    # `fits` fits the budget, so the room is what `fits` holds beyond generation's
    at_gen = placement_for(model, fits.accel, gen_k, n_ctx, 512, True, live=True)
    move = plan_phase_move(model.n_layers, device_layers(model.n_layers, gen_k), t, n_prompt,
                           model.layer_bytes, bus_Bps, MOVE_FIXED_S,
                           fits.accel_total_bytes - at_gen.accel_total_bytes)
    decision, move_bytes = move.decision, move.n_bytes
    return {"gen_layers": gen_k, "prompt_layers": prompt_k,
            "gen_tokens_per_s": round(by_k[gen_k].gen_tokens_per_s, 1),
            "prompt_tokens_per_s": round(by_k[prompt_k].prompt_tokens_per_s, 1),
            "prompt_tokens_per_s_at_gen_layers": round(t.prompt_tps_at_gen, 1),
            "move_bytes": move_bytes, "move_s": round(decision.cost_s, 4),
            "n_prompt": n_prompt, "pays": decision.move,
            "break_even_tokens": decision.break_even_tokens, "reason": decision.reason}


def phases_line(ph: dict[str, Any]) -> str:
    """One line for `plan` and What if…: each phase's best, and whether the move pays."""
    if ph["gen_layers"] == ph["prompt_layers"]:
        return f"each phase: one placement ({ph['gen_layers']} layers) is best for both"
    head = (f"each phase: generation best at {ph['gen_layers']} layers "
            f"(~{ph['gen_tokens_per_s']} tok/s), prompt at {ph['prompt_layers']} "
            f"(~{ph['prompt_tokens_per_s']} tok/s against ~{ph['prompt_tokens_per_s_at_gen_layers']}"
            f" at {ph['gen_layers']}); moving {ph['move_bytes'] / 2**20:.0f} MiB costs "
            f"~{ph['move_s'] * 1e3:.0f} ms")
    if ph["break_even_tokens"] is None:
        return head + ": it never pays"
    return (head + f": a {ph['n_prompt']}-token prompt "
            + ("pays for it" if ph["pays"] else "does not pay for it")
            + f" (pays from {ph['break_even_tokens']} tokens)")
