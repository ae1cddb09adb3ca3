"""A model larger than the accelerator's budget: the split stays inside the budget and the
replies equal a run with every layer in RAM."""
from __future__ import annotations

import json

import pytest

from tests.helpers import N_THREADS, agree_turn_by_turn, run_cli

MiB = 2**20
# the first reply's first steps are decided: the comparison of the placements compares something
SCRIPT = [{"text": "Repeat after me: the cat sat on the mat."}, {"text": "What is the capital of France?"}]


def _chat(tmp_path, *extra):
    script = tmp_path / "s.json"
    script.write_text(json.dumps(SCRIPT))
    # one flash-attention setting for both placements (auto would differ: off on the CPU alone,
    # on with layers on the device), so that only the placement differs
    r = run_cli("chat", "--script", str(script), "--temp", "0", "--max-tokens", "16", "--ctx", "1024",
                "--threads", str(N_THREADS), "--json", "--flash-attn", "on", "--top-logprobs", "2", *extra,
                timeout=300)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


# the live mover's run is the longest of the suite: make test-slow (CI runs it)
@pytest.mark.parametrize("mover", [pytest.param("live", marks=pytest.mark.slow), "reload"])
def test_oversize_split_holds_the_budget_and_matches_cpu(tmp_path, rpc_server, mover):
    budget = 160 * MiB  # SmolLM2 with its KV cache and compute buffer needs ~250 MiB there
    cpu = _chat(tmp_path)
    rpc_server.reset_peak()
    base = rpc_server.rss_bytes()
    split = _chat(tmp_path, "--rpc", rpc_server.endpoint, "--vram-budget", "160MiB", "--mover", mover)
    growth = rpc_server.peak_rss_bytes() - base
    print(f"\n{mover}: {split[0]['n_layers_on_accel']}/30 layers on RPC0, ledger peak "
          f"{max(t['device_peak_bytes'].get('RPC0', 0) for t in split) / MiB:.0f} MiB, server "
          f"growth {growth / MiB:.0f} MiB, budget {budget / MiB:.0f} MiB")
    assert 0 < split[0]["n_layers_on_accel"] < 30
    agree_turn_by_turn(split, cpu)  # split over devices against the CPU: DECIDED
    assert all(t["device_peak_bytes"].get("RPC0", 0) <= budget for t in split)
    assert growth <= budget
