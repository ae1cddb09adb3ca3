"""Calibration on the RPC device, then `plan`'s predictions against measured runs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.gguf.info import model_info, read_gguf
from engine.measure.autotune import Measurer
from engine.placement.calibration import DeviceCal, fit, predict_text
from engine.placement.plan import placement_for
from tests.conftest import run_cli

VISION_STEPS = ("evict", "load_projector", "encode", "free_projector", "restore")


def test_fit_recovers_known_costs(model_path):
    """Pure: runs made from known costs give those costs back."""
    info = model_info(read_gguf(model_path))
    cpu = DeviceCal("CPU", 4e-11, 2e-12)
    acc = DeviceCal("X", 1e-11, 5e-13, split_gen_s=3e-3, split_prompt_s=1e-4)
    runs = []
    for k in (0, 1, 25):
        p = placement_for(info, "X", k, 1024, 512, True, live=k > 0)
        t = predict_text(info, p, cpu, acc if k else None)
        runs.append((p, t["gen_s_per_token"], t["prompt_s_per_token"]))
    c, a = fit(info, "CPU", "X", runs)
    for got, want in ((c.gen_s_per_byte, 4e-11), (a.gen_s_per_byte, 1e-11), (a.split_gen_s, 3e-3),
                      (c.prompt_s_per_byte, 2e-12), (a.prompt_s_per_byte, 5e-13),
                      (a.split_prompt_s, 1e-4)):
        assert got == pytest.approx(want, rel=1e-6)


def within(pred: float, meas: float) -> bool:
    return abs(pred - meas) <= 0.25 * meas


def test_predictions_for_the_rpc_device_fall_within_25_percent(shared_rpc_server, base_projector,
                                                               model_path, pictures, tmp_path,
                                                               monkeypatch):
    monkeypatch.setenv("EBB_CALIBRATION", str(tmp_path / "calibration.json"))  # others keep none
    ep = shared_rpc_server.endpoint
    r = run_cli("calibrate", "--rpc", ep, "--vram-budget", "300MiB", "--mmproj", str(base_projector),
                "--ctx", "1024", "--threads", "1", "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    cal = json.loads(r.stdout)
    assert Path(cal["file"]).exists() and cal["accelerator"]["key"] == f"RPC0 {ep}"
    assert [x["layers"] for x in cal["runs"]] == [0, 1, 10, 20, 31]

    # text, at a placement calibration never ran (the budget holds about 18 layers)
    r = run_cli("plan", "--rpc", ep, "--device", "RPC0", "--vram", "190MiB", "--ctx", "1024",
                "--threads", "1", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["calibrated"] == {"cpu": True, "accelerator": True} and plan["live_layout"]
    k = plan["n_gpu_layers"]
    assert 5 < k < 31
    # the model does not fit: the phases are compared; RPC cannot stream host weights
    o = plan["oversize"]
    assert o["choice"] == {"prompt": "static", "generation": "static"} and o["prompt_s"]["stream"] is None
    from engine.llama.devices import connect_rpc

    connect_rpc(ep)
    info = model_info(read_gguf(model_path))
    # measured as calibration measures: the faster of two runs (a busy box only adds time)
    m = Measurer(model_path, info, "RPC0", 1024, 1, live=True)
    runs = [m.measure(k), m.measure(k)]
    gen_tps = max(r.gen_tps for r in runs)
    prompt_tps = max(r.prompt_tps for r in runs)

    # vision: the swap turn's steps, predicted and measured
    r = run_cli("plan", "--rpc", ep, "--device", "RPC0", "--vram", "300MiB", "--ctx", "1024",
                "--threads", "1", "--mmproj", str(base_projector), "--json")
    assert r.returncode == 0, r.stderr
    vplan = json.loads(r.stdout)
    (tmp_path / "a.png").write_bytes(pictures["a.png"].read_bytes())
    steps = []  # the faster of two turns, as calibration measures (a busy box only adds time)
    for _ in range(2):
        r = run_cli("chat", "--rpc", ep, "--vram-budget", "300MiB", "--ctx", "1024", "--threads",
                    "1", "--mmproj", str(base_projector), "--vision", "swap", "--image",
                    str(tmp_path / "a.png"), "--prompt", "What is this?", "--max-tokens", "4",
                    "--temp", "0", "--json", timeout=300)
        assert r.returncode == 0, r.stderr
        turn = json.loads(r.stdout.splitlines()[-1])
        steps.append({s["name"]: s["end_s"] - s["start_s"] for s in turn["spans"]
                      if s["name"] in VISION_STEPS})
    fastest = min(steps, key=lambda st: sum(st.values()))
    vision_s = sum(fastest.values())
    print("\nvision steps measured (ms): " + ", ".join(
        f"{name} {'/'.join(f'{st[name] * 1000:.0f}' for st in steps)}" for name in VISION_STEPS))
    print(f"\n{k} layers: generation predicted {plan['gen_tokens_per_s']} vs measured "
          f"{gen_tps:.1f} tok/s; prompt predicted {plan['prompt_tokens_per_s']} vs "
          f"measured {prompt_tps:.0f} tok/s; vision swap predicted "
          f"{vplan['vision_predicted_s']['swap']:.3f} s vs measured {vision_s:.3f} s")
    assert within(plan["gen_tokens_per_s"], gen_tps)
    assert within(plan["prompt_tokens_per_s"], prompt_tps)
    assert within(vplan["vision_predicted_s"]["swap"], vision_s)
