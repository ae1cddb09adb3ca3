"""Calibration on the RPC device: the fit, the store, and `plan`'s predictions from it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.gguf.info import model_info, read_gguf
from engine.placement.calibration import DeviceCal, fit, predict_text
from engine.placement.plan import placement_for
from tests.helpers import run_cli


def test_fit_recovers_known_costs(model_path):
    """Pure: runs made from known costs give those costs back."""
    info = model_info(read_gguf(model_path))
    cpu = DeviceCal("CPU", 4e-11, 2e-12)
    acc = DeviceCal("X", 1e-11, 5e-13, split_gen_s=3e-3, split_prompt_s=1e-4)
    runs = []
    for k in (0, 1, 25):
        p = placement_for(info, "X", k, 1024, 512, True, live=k > 0)
        t = predict_text(info, p, cpu, acc if k else None)
        runs.append((p, t.gen_s_per_token, t.prompt_s_per_token))
    c, a = fit(info, "CPU", "X", runs)
    for got, want in ((c.gen_s_per_byte, 4e-11), (a.gen_s_per_byte, 1e-11), (a.split_gen_s, 3e-3),
                      (c.prompt_s_per_byte, 2e-12), (a.prompt_s_per_byte, 5e-13),
                      (a.split_prompt_s, 1e-4)):
        assert got == pytest.approx(want, rel=1e-6)


@pytest.mark.slow  # a measurement: `make test-slow` (CI runs it after `make test`)
def test_calibration_is_stored_consistent_and_predicts_with_it(shared_rpc_server, base_projector,
                                                                model_path, tmp_path, monkeypatch):
    """What a loaded machine cannot break: the stored calibration round-trips, the fit agrees
    with its own runs where it must, and `plan` predicts positive, ordered numbers from it.
    How close the predictions come is `ebb-engine bench calibrate`'s to print (a ratio)."""
    from engine.placement import calibration

    cal_file = tmp_path / "calibration.json"
    monkeypatch.setenv("EBB_CALIBRATION", str(cal_file))  # others keep none
    ep = shared_rpc_server.endpoint
    r = run_cli("calibrate", "--rpc", ep, "--vram-budget", "300MiB", "--mmproj", str(base_projector),
                "--ctx", "1024", "--threads", "1", "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    cal = json.loads(r.stdout)
    assert Path(cal["file"]) == cal_file and cal["accelerator"]["key"] == f"RPC0 {ep}"
    assert [x["layers"] for x in cal["runs"]] == [0, 1, 10, 20, 31]
    # the store round-trips
    acc = calibration.load(f"RPC0 {ep}")
    cpu = calibration.load("CPU")
    assert acc == DeviceCal(**cal["accelerator"]) and cpu == DeviceCal(**cal["cpu"])
    assert acc.bus_Bps and acc.bus_Bps > 0 and acc.encode_s_per_token_per_byte
    assert cpu.encode_s_per_token_per_byte and acc.projector_overhead_s >= 0
    # consistent: the RAM side is fitted from the all-CPU run alone, so it predicts that run
    info = model_info(read_gguf(model_path))
    run0 = cal["runs"][0]
    pred0 = predict_text(info, placement_for(info, "RPC0", 0, 1024, 512, True), cpu, acc)
    assert pred0.gen_s_per_token == pytest.approx(run0["gen_s_per_token"], rel=1e-9)
    assert pred0.prompt_s_per_token == pytest.approx(run0["prompt_s_per_token"], rel=1e-9)
    assert min(acc.gen_s_per_byte, acc.prompt_s_per_byte, acc.split_gen_s, acc.split_prompt_s) >= 0

    # text, at a placement calibration never ran (the budget holds about 18 layers)
    r = run_cli("plan", "--rpc", ep, "--device", "RPC0", "--vram", "190MiB", "--ctx", "1024",
                "--threads", "1", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["calibrated"] == {"cpu": True, "accelerator": True} and plan["live_layout"]
    assert 5 < plan["n_gpu_layers"] < 31
    assert plan["gen_tokens_per_s"] > 0 and plan["prompt_tokens_per_s"] > 0
    # the model does not fit: the phases are compared; RPC cannot stream host weights
    o = plan["oversize"]
    assert o["choice"] == {"prompt": "static", "generation": "static"} and o["prompt_s"]["stream"] is None
    # vision: every strategy that fits has a positive prediction, the swap's steps add up
    r = run_cli("plan", "--rpc", ep, "--device", "RPC0", "--vram", "300MiB", "--ctx", "1024",
                "--threads", "1", "--mmproj", str(base_projector), "--json")
    assert r.returncode == 0, r.stderr
    vplan = json.loads(r.stdout)
    predicted = vplan["vision_predicted_s"]
    assert predicted["swap"] > 0 and predicted["cpu"] > 0
    steps = vplan["vision_steps"]
    if vplan["vision_auto"] == "swap":
        assert sum(s["predicted_s"] for s in steps) == pytest.approx(predicted["swap"])

    # the accuracy benchmark runs on this calibration and reports ratios (not asserted: a
    # busy machine moves the measured side)
    r = run_cli("bench", "calibrate", "--rpc", ep, "--mmproj", str(base_projector), "--threads",
                "1", "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    bench = json.loads(r.stdout)
    print("\npredicted / measured: " + ", ".join(
        f"{name} {bench[name]['ratio']}x" for name in ("gen_tokens_per_s", "prompt_tokens_per_s",
                                                       "vision_swap_s")))
    for name in ("gen_tokens_per_s", "prompt_tokens_per_s", "vision_swap_s"):
        assert bench[name]["measured"] > 0 and bench[name]["predicted"] > 0
