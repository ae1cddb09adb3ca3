"""`ebb-engine plan`: what a model would do on a device you may not own, from its header.

Pure arithmetic over the GGUF's tensor table and the planner. Costs come from this machine's
calibration (`ebb-engine calibrate`, engine/calibrate.py) where there is one: the CPU side
always (RAM is this machine's), the accelerator side when `--device` names a calibrated one.
Otherwise they are defaults the user can override (bus, memory bandwidths, encode speed), and
the output says which parts are calibrated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.calibrate import DeviceCal, predict_text, vision_costs
from engine.errors import EbbError
from engine.gguf_info import ModelInfo, ProjectorInfo
from engine.plan import Costs, DoesNotFit, Placement, VisionPlan, plan_placement, plan_vision

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
        }


def what_if(model: ModelInfo, proj: ProjectorInfo | None, vram_bytes: int, bus_Bps: float,
            ram_Bps: float, vram_Bps: float, n_ctx: int, n_threads: int,
            cpu_cal: DeviceCal | None = None, accel_cal: DeviceCal | None = None,
            accel: str = "GPU") -> WhatIf:
    # the live mover's layout (what a session runs); llama.cpp's own split if that cannot fit
    placement = plan_placement(model, accel, vram_bytes, n_ctx, 512, True, live=True)
    if isinstance(placement, DoesNotFit):
        placement = plan_placement(model, accel, vram_bytes, n_ctx, 512, True)
    assert not isinstance(placement, DoesNotFit)
    accel_w = placement.accel_bytes.get("weights", 0)
    t = model.non_layer_tensors
    output_w = t.get("output.weight", 0) + t.get("output_norm.weight", 0)
    cpu_layers = sum(b for b, d in zip(model.layer_bytes, placement.layer_devices) if d == "CPU")
    output_in_ram = output_w if placement.output_device == "CPU" else 0
    # llama.cpp keeps the input embeddings in RAM (one row is read per token)
    ram_w = cpu_layers + t.get("token_embd.weight", 0) + output_in_ram
    prompt_tps: float | None = None
    if cpu_cal is not None and accel_cal is not None:
        pred = predict_text(model, placement, cpu_cal, accel_cal)
        gen_tps, prompt_tps = pred["gen_tokens_per_s"], pred["prompt_tokens_per_s"]
    else:
        # Batch-1 decoding reads every weight it uses once per token: the slower memory bounds it.
        cpu_s = ((cpu_layers + output_in_ram) * cpu_cal.gen_s_per_byte if cpu_cal is not None
                 else (cpu_layers + output_in_ram) / ram_Bps)
        per_token_s = accel_w / vram_Bps + cpu_s
        gen_tps = 1.0 / per_token_s if per_token_s else 0.0
    vision: dict[str, float | None] = {}
    vplan: VisionPlan | None = None
    if proj is not None:
        flops_per_token = proj.weight_bytes  # f16 weights: 2 flops per 2 bytes
        costs = Costs(bus_Bps=bus_Bps, cpu_encode_s_per_token=flops_per_token / (40e9 * n_threads),
                      accel_encode_s_per_token=flops_per_token / 20e12)
        if cpu_cal is not None:
            costs = vision_costs(cpu_cal, accel_cal, proj.weight_bytes, costs)
        result = plan_vision("auto", placement, proj, vram_bytes, proj.n_image_tokens,
                             model.kv_bytes_per_token * n_ctx, True, costs)
        if isinstance(result, VisionPlan):
            vplan = result
            vision = dict(result.predicted_s)
    return WhatIf(placement, ram_w, gen_tps, vision, vplan, prompt_tps,
                  {"cpu": cpu_cal is not None, "accelerator": accel_cal is not None})
