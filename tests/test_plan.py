"""The planner is pure: placements and vision plans from SmolLM2's real tensor table."""
from __future__ import annotations

import pytest

from engine.gguf.info import model_info, projector_info, read_gguf
from engine.placement.plan import (
    CPU,
    Costs,
    DoesNotFit,
    VisionPlan,
    accel_bytes,
    placement_for,
    plan_placement,
    plan_vision,
    projector_need_bytes,
)

MiB = 2**20


@pytest.fixture(scope="module")
def model(model_path):
    return model_info(read_gguf(model_path))


@pytest.fixture(scope="module")
def proj(tiny_projector):
    return projector_info(read_gguf(tiny_projector))


def test_llama_cpp_semantics_output_first_then_last_layers(model):
    p = placement_for(model, "RPC0", 10, 2048, 512, True)
    assert p.output_device == "RPC0" and p.embeddings_device == CPU
    assert p.layer_devices == (CPU,) * 21 + ("RPC0",) * 9
    # 9 layers + the (tied, duplicated) output matrix: what llama.cpp reported (47.71 MiB)
    assert abs(p.accel_bytes["weights"] / MiB - 47.71) < 0.01
    assert p.accel_bytes["kv"] == 9 * 768 * 2048  # llama.cpp: 13.50 MiB
    full = placement_for(model, "RPC0", 99, 2048, 512, True)
    assert full.n_gpu_layers == 31 and full.n_layers_on_accel == 30


def test_plan_placement_fits_the_budget_and_reserve(model):
    for budget in (50, 120, 200, 300, 10_000):
        p = plan_placement(model, "RPC0", budget * MiB, 2048, 512, True)
        assert p.accel_total_bytes <= budget * MiB
        bigger = placement_for(model, "RPC0", p.n_gpu_layers + 1, 2048, 512, True)
        assert p.n_gpu_layers == 31 or bigger.accel_total_bytes > budget * MiB
    with_room = plan_placement(model, "RPC0", 300 * MiB, 2048, 512, True, reserve_bytes=100 * MiB)
    assert with_room.accel_total_bytes + 100 * MiB <= 300 * MiB
    assert plan_placement(model, None, 300 * MiB, 2048, 512, True).n_gpu_layers == 0


def test_flash_attention_off_needs_the_score_matrix(model):
    on = accel_bytes(model, 31, 2048, 512, True)["compute"]
    off = accel_bytes(model, 31, 2048, 512, False)["compute"]
    assert off - on == model.n_head * 2048 * 512 * 4


def test_vision_strategies_and_reasons(model, proj):
    full = placement_for(model, "RPC0", 31, 2048, 512, True)
    need = projector_need_bytes(proj, True)
    ample = plan_vision("auto", full, proj, full.accel_total_bytes + need, 4, 0, True, Costs())
    assert isinstance(ample, VisionPlan) and ample.predicted_s["resident"] is not None
    tight = plan_vision("resident", full, proj, full.accel_total_bytes + need - 1, 4, 0, True, Costs())
    assert isinstance(tight, DoesNotFit) and "beside the model" in tight.reason
    swap = plan_vision("swap", full, proj, full.accel_total_bytes, 4, 10_000, True, Costs())
    assert isinstance(swap, VisionPlan)
    assert [s.name for s in swap.steps] == ["save_state", "evict", "load_projector", "encode",
                                            "free_projector", "restore", "restore_state"]
    nothing = plan_vision("swap", full, proj, need - 1, 4, 0, True, Costs())
    assert isinstance(nothing, DoesNotFit) and "whole budget" in nothing.reason
    auto = plan_vision("auto", full, proj, need - 1, 4, 0, True, Costs())
    assert isinstance(auto, VisionPlan) and auto.strategy == "cpu"
    assert "swap impossible" in auto.reason


def test_auto_follows_the_costs(model, proj):
    full = placement_for(model, "RPC0", 31, 2048, 512, True)
    budget = full.accel_total_bytes  # no room beside: swap or cpu
    fast_gpu = Costs(bus_Bps=20e9, cpu_encode_s_per_token=0.05, accel_encode_s_per_token=1e-4,
                     reload_overhead_s=0.01)
    slow_bus = Costs(bus_Bps=1e6, cpu_encode_s_per_token=1e-4, accel_encode_s_per_token=1e-5)
    assert plan_vision("auto", full, proj, budget, 576, 0, True, fast_gpu).strategy == "swap"
    assert plan_vision("auto", full, proj, budget, 576, 0, True, slow_bus).strategy == "cpu"


def test_plan_from_the_header_of_8b_and_70b_models_on_an_8_gib_card(tmp_path):
    import json

    from tests.helpers import run_cli

    out = {}
    for like in ("llama-8b", "llama-70b"):
        path = tmp_path / f"{like}.gguf"
        assert run_cli("make-model", "--like", like, "--out", str(path)).returncode == 0
        proc = run_cli("plan", "--model", str(path), "--vram", "8GiB", "--bus", "pcie4", "--json")
        assert proc.returncode == 0, proc.stderr
        out[like] = json.loads(proc.stdout)
    small, big = out["llama-8b"], out["llama-70b"]
    assert small["n_layers_on_accel"] == 32 and small["accel_total_bytes"] <= 8 * 2**30
    assert 0 < big["n_layers_on_accel"] < 80 and big["accel_total_bytes"] <= 8 * 2**30
    assert big["ram_weight_bytes"] > 25 * 2**30
    assert small["gen_tokens_per_s"] > big["gen_tokens_per_s"] > 0
    assert small["calibrated"] == {"cpu": False, "accelerator": False}  # tests keep none
    # larger than the card: per phase, generation stays split, a long prompt streams
    assert small["oversize"] is None
    o = big["oversize"]
    assert o["choice"] == {"prompt": "stream", "generation": "static"}
    assert o["generation_s_per_token"]["stream"] > o["generation_s_per_token"]["static"]
    assert o["prompt_s"]["stream"] < o["prompt_s"]["static"]
    assert "GiB of weights stay in RAM" in o["why"] and "ms/token" in o["why"]
    assert big["prompt_tokens_per_s"] == pytest.approx(2048 / o["prompt_s"]["stream"], rel=0.01)


def test_a_live_swap_short_of_room_takes_the_reload_mover_or_names_every_way_out(model, base_projector):
    proj = projector_info(read_gguf(base_projector))
    live = placement_for(model, "RPC0", 31, 2048, 512, True, live=True)
    floor = live.accel_total_bytes - live.movable_bytes
    need = projector_need_bytes(proj, True)
    fits_live = plan_vision("swap", live, proj, floor + need, 4, 10_000, True, Costs())
    assert isinstance(fits_live, VisionPlan) and fits_live.mover == "live"
    assert [s.name for s in fits_live.steps][0] == "evict" and fits_live.mover_note == ""
    budget = floor + need - 1  # the layers free too little; the whole budget is enough
    reload = plan_vision("swap", live, proj, budget, 4, 10_000, True, Costs())
    assert isinstance(reload, VisionPlan) and reload.mover == "reload"
    assert [s.name for s in reload.steps][0] == "save_state" and "reload mover" in reload.mover_note
    cheap_swap = Costs(bus_Bps=20e9, cpu_encode_s_per_token=0.05, accel_encode_s_per_token=1e-4,
                       reload_overhead_s=0.01)
    auto = plan_vision("auto", live, proj, budget, 576, 10_000, True, cheap_swap)
    assert isinstance(auto, VisionPlan) and auto.strategy == "swap" and auto.mover == "reload"
    assert "reload mover" in auto.reason
    forced_live = plan_vision("swap", live, proj, budget, 4, 0, True, Costs(), reload_ok=False)
    assert isinstance(forced_live, DoesNotFit)
    for way_out in ("--mover auto or reload", "--vision cpu", "--vram-budget"):
        assert way_out in forced_live.reason
    assert plan_vision("auto", live, proj, budget, 4, 0, True, cheap_swap, reload_ok=False).strategy == "cpu"
    too_small = plan_vision("swap", live, proj, need - 1, 4, 0, True, Costs())
    assert isinstance(too_small, DoesNotFit) and "--mover" not in too_small.reason
    assert "--vision cpu" in too_small.reason and f"--vram-budget {-(-need // MiB)}MiB" in too_small.reason


def test_the_live_layout_says_what_does_not_fit_with_numbers_that_add_up(model):
    import re

    floor = placement_for(model, "RPC0", 1, 2048, 512, True, live=True)
    reserve = 107 * MiB
    budget = floor.accel_total_bytes + reserve - MiB  # the floor fits; with the projector not
    res = plan_placement(model, "RPC0", budget, 2048, 512, True, reserve_bytes=reserve, live=True)
    assert isinstance(res, DoesNotFit)
    numbers = [float(x) for x in re.findall(r"([0-9.]+) MiB", res.reason)]
    *parts, total, budget_mib = numbers
    assert len(parts) == 4 and "resident projector" in res.reason
    assert abs(sum(parts) - total) < 0.25 and total > budget_mib == pytest.approx(budget / MiB, abs=0.05)


def test_one_context_limit_for_planning_and_for_a_session(model):
    """What planning clamps a setting to is what a session accepts, with the header's length
    and without it (4096 then)."""
    from dataclasses import replace

    from engine.errors import EbbError
    from engine.gguf.info import UNSTATED_CONTEXT
    from engine.llama.loaded_model import check_context

    for info in (model, replace(model, n_ctx_train=0)):
        most = info.fit_context(10**7)
        assert most == (info.n_ctx_train or UNSTATED_CONTEXT)
        assert check_context(info, most) == most
        with pytest.raises(EbbError, match="larger than this model allows"):
            check_context(info, most + 1)
