"""Layers dealt over two RPC devices (and RAM) by the planner, run by llama.cpp's split."""
from __future__ import annotations

import pytest

import json

from engine.gguf.info import model_info, read_gguf
from engine.placement.plan import DeviceOffer, plan_spread
from tests.helpers import N_THREADS, RpcServer, agree_turn_by_turn, run_cli

MiB = 2**20
# the first reply is decided from its first step: the placements' comparison compares something
SCRIPT = [{"text": "Repeat after me: the cat sat on the mat."},
          {"text": "What is in this picture?", "images": ["a.png"]}]


def test_plan_spread_ranks_by_link_and_explains(model_path):
    info = model_info(read_gguf(model_path))
    s = plan_spread(info, [DeviceOffer("SLOW", 170 * MiB, 0.1e9), DeviceOffer("FAST", 170 * MiB, 3e9)],
                    1024, 512, True)
    assert s.placement.output_device == "FAST" and s.placement.layer_devices[-1] == "FAST"
    assert s.split[-1][0] == "FAST"  # llama.cpp deals the last layers to the last device
    assert sum(n for _, n in s.split) == s.placement.n_gpu_layers
    assert set(s.placement.layer_devices) <= {"FAST", "SLOW", "CPU"} and "SLOW" in s.placement.layer_devices
    assert "FAST 3.00 GB/s" in s.reasons[0] and any("output" in r for r in s.reasons)
    for dev, kinds in s.device_bytes.items():
        assert sum(kinds.values()) <= 170 * MiB
    tight = plan_spread(info, [DeviceOffer("A", 60 * MiB, 1e9)], 1024, 512, True)
    assert tight.placement.accel is None and "not even the output layer" in tight.reasons[1]


@pytest.mark.numerics
def test_spread_over_two_rpc_devices_matches_cpu(tmp_path, pictures, tiny_projector):
    (tmp_path / "a.png").write_bytes(pictures["a.png"].read_bytes())
    script = tmp_path / "s.json"
    script.write_text(json.dumps(SCRIPT))
    args = ("chat", "--script", str(script), "--mmproj", str(tiny_projector), "--temp", "0",
            "--max-tokens", "12", "--ctx", "1024", "--threads", str(N_THREADS), "--json",
            "--flash-attn", "on",  # one setting for every placement (auto differs on the CPU)
            "--top-logprobs", "2")  # split over devices against the CPU: compared DECIDED
    cpu = run_cli(*args, "--vision", "cpu", timeout=300)
    assert cpu.returncode == 0, cpu.stderr
    a, b = RpcServer(), RpcServer()
    try:
        # no --spread: one device's 170 MiB cannot hold the model, so the session spreads
        r = run_cli(*args, "--rpc", a.endpoint, "--rpc", b.endpoint,
                    "--vram-budget", "170MiB", "--vision", "swap", timeout=300)
        # room enough on the first: one device, the live mover
        one = run_cli(*args, "--rpc", a.endpoint, "--rpc", b.endpoint, "--vram-budget", "400MiB",
                      "--vision", "swap", timeout=300)
    finally:
        a.stop()
        b.stop()
    assert r.returncode == 0, r.stderr
    turns = [json.loads(line) for line in r.stdout.splitlines()]
    by_dev = turns[0]["layers_by_device"]
    print(f"\nlayers by device: {by_dev}\n{turns[0]['placement_reason']}")
    assert "alone holds" in turns[0]["placement_reason"]
    assert by_dev.get("RPC0", 0) > 0 and by_dev.get("RPC1", 0) > 0
    assert turns[1]["strategy"] == "swap"
    assert one.returncode == 0, one.stderr
    single = json.loads(one.stdout.splitlines()[0])
    assert single["layers_by_device"] == {"RPC0": 30} and single["mover"] == "live"
    # the same tokens where decided (tests/helpers.py)
    agree_turn_by_turn(turns, [json.loads(x) for x in cpu.stdout.splitlines()])
    for t in turns:
        assert all(v <= 170 * MiB for v in t["device_peak_bytes"].values()), t["device_peak_bytes"]
