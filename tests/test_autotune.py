"""Autotune: the search (pure), and real runs on an RPC device against an exhaustive sweep."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from engine.gguf.info import model_info, read_gguf
from engine.tune_result import TuneResult
from engine.measure.autotune import (
    Measurer,
    Point,
    autotune,
    find_cliff,
    golden_max,
    max_layers,
    planned_runs,
)
from tests.helpers import run_cli

MiB = 2**20


def counted(f):
    seen: dict[int, float] = {}

    def g(k: int) -> float:
        if k not in seen:
            seen[k] = f(k)
        return seen[k]
    return g, seen


@pytest.mark.parametrize("peak", [1, 2, 7, 13, 20, 29, 30])
def test_golden_max_finds_the_peak_of_a_unimodal_curve_in_few_evaluations(peak):
    # a rise then a cliff-like fall, as throughput against layers
    f, seen = counted(lambda k: 100 - abs(k - peak) * (1 if k < peak else 9))
    assert golden_max(f, 1, 30) == peak
    assert len(seen) <= 12, sorted(seen)


def test_golden_max_checks_the_top_first():
    f, seen = counted(lambda k: float(k))  # still rising at the top
    assert golden_max(f, 1, 30) == 30
    assert sorted(seen) == [29, 30]
    f, seen = counted(lambda k: 100.0 + (k == 29))  # level within noise: the top is as good
    assert golden_max(f, 1, 30) == 30


class Curves:
    """A stand-in for `Measurer` for the search's logic: known curves, every run counted."""

    def __init__(self, info, gen, prompt):
        self.info, self.accel, self.n_ctx, self.n_batch = info, "RPC0", 1024, 512
        self.flash_attn, self.live, self.points = True, False, {}
        self.image_tokens = 0  # text only
        self.gen, self.prompt = gen, prompt

    def __call__(self, k):
        if k not in self.points:
            self.points[k] = Point(k, self.prompt(k), self.gen(k), 0.0, 0)
        return self.points[k]

    def load_beside(self):
        return 1.0  # as if one busy loop ran beside the search


@pytest.mark.parametrize("gen_peak,prompt_peak", [(18, 18), (9, 18), (18, 5), (9, 10), (12, 12), (3, 3)])
def test_autotune_searches_once_when_both_peak_below_the_top(model_path, gen_peak, prompt_peak):
    """Below the top, both metrics usually peak at the same place (the cliff where the device's
    memory spills): one search finds both. Peaks far apart are where the shared search stops
    short (see the next test)."""
    info = model_info(read_gguf(model_path))
    budget = 180 * MiB
    top = max_layers(info, "RPC0", budget, 1024, 512, True, 0, live=False)
    assert top == 18

    def peaked(peak, height):  # rises to the peak, falls steeply past it
        return lambda k: height - abs(k - peak) * (2 if k < peak else 9)

    c = Curves(info, peaked(gen_peak, 90), peaked(prompt_peak, 230))
    tuned = autotune(c, budget, 0)
    assert (tuned.best_gen_layers, tuned.best_prompt_layers) == (gen_peak, prompt_peak)
    # #71: the load it was measured under goes with the result, and is said
    assert tuned.busy_beside == 1.0 and "about 1 other busy task beside it" in tuned.load_words()
    assert TuneResult.from_dict(tuned.to_dict()).busy_beside == 1.0
    one_search = 1 + 2 + 7  # k=0, the top check, a golden search of 1..17
    assert len(tuned.points) <= (3 if gen_peak == prompt_peak == top else one_search), sorted(c.points)


def test_autotune_with_peaks_far_apart_below_the_top_answers_between_them(model_path):
    info = model_info(read_gguf(model_path))
    c = Curves(info, lambda k: 90 - abs(k - 4) * (2 if k < 4 else 9),
               lambda k: 230 - abs(k - 14) * (2 if k < 14 else 9))
    tuned = autotune(c, 180 * MiB, 0)
    assert len(tuned.points) <= 10
    assert 4 <= tuned.best_gen_layers <= tuned.best_prompt_layers <= 14  # the best of what ran
    assert tuned.best_gen_layers == 4 or tuned.best_prompt_layers == 14  # one of them exactly


def test_find_cliff_marks_the_collapse_after_the_best():
    pts = [Point(k, 0, v, 0, 0) for k, v in [(0, 10), (4, 20), (8, 30), (9, 31), (10, 5), (12, 4)]]
    assert find_cliff(pts, lambda p: p.gen_tps) == 10
    assert find_cliff(pts[:4], lambda p: p.gen_tps) is None


@pytest.mark.slow  # real runs at several layer counts: `make test-slow` (CI runs it after `make test`)
def test_autotune_on_a_device_searches_with_fewer_runs_and_answers_what_it_measured(
        shared_rpc_server, model_path):
    """Real runs on an RPC device, llama.cpp's own split. Which layer count is fastest is a
    measurement (`ebb-engine bench autotune` prints the search's picks against an exhaustive
    sweep as ratios); here: the search stays within the budget and its planned runs (fewer
    than a sweep's), and its answer is the best of what it measured."""
    from engine.llama.devices import connect_rpc

    accel = connect_rpc(shared_rpc_server.endpoint)[0]
    info = model_info(read_gguf(model_path))
    budget = 180 * MiB  # holds 17 of SmolLM2's 30 layers (and the output) at a 1024 context
    top = max_layers(info, accel, budget, 1024, 512, True, 0, live=False)
    assert 8 <= top < info.n_layers
    m = Measurer(model_path, info, accel, 1024, 1, live=False, prompt_tokens=64, gen_tokens=16)
    tuned = autotune(m, budget, 0)
    print(f"\nautotune: {len(tuned.points)} runs, layers {sorted(p.layers for p in tuned.points)}; "
          f"gen {tuned.best_gen_layers}, prompt {tuned.best_prompt_layers}")
    layers = [p.layers for p in tuned.points]
    assert len(layers) == len(set(layers)) and {0, top} <= set(layers)  # the base and the top check
    assert len(tuned.points) <= planned_runs(top) < top + 1  # a sweep runs top + 1
    assert all(p.accel_bytes <= budget and p.gen_tps > 0 and p.prompt_tps > 0 for p in tuned.points)
    assert tuned.best_gen_layers == max(tuned.points, key=lambda p: p.gen_tps).layers
    assert tuned.best_prompt_layers == max(tuned.points, key=lambda p: p.prompt_tps).layers
    assert tuned.max_layers == top


@pytest.mark.slow  # 25 s of make test's 12 minutes (a fresh clone, 2 cores): the sweep's own tests stay
# 30-50 s idle on 2 cores; with two busy processes beside it (make test-loaded) its 2-thread runs
# slowed past the suite's 300 s: llama.cpp's threads wait for each other on a full machine
@pytest.mark.timeout(1800)
def test_autotune_cli_json_and_applying_the_result(shared_rpc_server, tiny_projector, tmp_path):
    """Without --threads, every layer count is measured at each thread count of the grid (on
    two cores: 1 and 2), and each phase gets its best layers and threads; `chat --tuning`
    runs with them. The budget holds 3 layers beside the projector's room: 0..3 are all
    measured (a search's run count would follow the machine's noise, and the suite's time
    with it); there flash attention off does not fit beside a layer, so on is the choice."""
    from engine.hw import physical_cores
    from engine.measure.autotune import thread_grid

    r = run_cli("autotune", "--rpc", shared_rpc_server.endpoint, "--vram-budget", "159MiB",
                "--mmproj", str(tiny_projector), "--ctx", "1024", "--flash-history", "256",
                "--prompt-tokens", "32", "--gen-tokens", "8", "--json",
                timeout=1500)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["headroom_bytes"] > 0
    assert {"best_gen_layers", "best_prompt_layers", "best_gen_threads", "best_prompt_threads",
            "points", "busy_beside"} <= set(out)
    assert {p["layers"] for p in out["points"]} == {0, 1, 2, 3} and out["max_layers"] == 3
    grid = thread_grid(physical_cores())
    assert out["threads_searched"] == grid
    for p in out["points"]:  # every point with its threads
        assert sorted(int(t) for t in p["gen_tps_by_threads"]) == grid
        assert sorted(int(t) for t in p["prompt_tps_by_threads"]) == grid
        assert p["gen_tps"] == p["gen_tps_by_threads"][str(p["gen_threads"])]
        assert p["prompt_tps"] == p["prompt_tps_by_threads"][str(p["prompt_threads"])]
    best_gen = next(p for p in out["points"] if p["layers"] == out["best_gen_layers"])
    assert out["best_gen_threads"] == best_gen["gen_threads"] in grid
    assert "layers:" in r.stderr and "threads)" in r.stderr  # progress, one line per run
    r_tune_stderr = r.stderr
    tuning = tmp_path / "tune.json"
    tuning.write_text(r.stdout)
    r = run_cli("chat", "--rpc", shared_rpc_server.endpoint, "--vram-budget", "159MiB",
                "--tuning", str(tuning), "--ctx", "1024", "--prompt", "Hi", "--max-tokens", "4",
                "--temp", "0", "--json")
    assert r.returncode == 0, r.stderr
    turn = json.loads(r.stdout.splitlines()[-1])
    assert turn["n_threads"] == out["best_gen_threads"]
    assert turn["phases"]["gen_threads"] == out["best_gen_threads"]
    assert turn["phases"]["prompt_threads"] == out["best_prompt_threads"]
    # flash attention chosen by real turns with history at the best layers, and used (#30)
    fa = out["flash_attn"]
    assert fa["layers"] == out["best_gen_layers"] and fa["fill"] == 256  # --flash-history
    assert fa["turn_s_on"] > 0 or fa["turn_s_off"] > 0
    assert "choosing flash attention" in r_tune_stderr
    assert turn["flash_attn"] is fa["on"]
    k = out["best_gen_layers"]
    r = run_cli("chat", "--rpc", shared_rpc_server.endpoint, "--vram-budget", "159MiB",
                "--gpu-layers", str(k), "--ctx", "1024", "--prompt", "Hi", "--max-tokens", "4",
                "--temp", "0", "--json")
    assert r.returncode == 0, r.stderr
    turn = json.loads(r.stdout.splitlines()[-1])
    assert turn["n_gpu_layers"] == k
    assert turn["flash_attn"] is (k != 0)  # auto: on where layers run on the device (#30)


# ------------------------------------------------------------------ flash attention (#30)

def test_flash_attention_is_the_faster_turn_and_the_one_asked_for_within_noise():
    from engine.measure.autotune import FA_TIE, FlashChoice

    assert FlashChoice.decide(1.0, 1.5, asked=True) is True
    assert FlashChoice.decide(1.5, 1.0, asked=True) is False
    assert FlashChoice.decide(1.0, 1.0 + FA_TIE / 2, asked=False) is False  # a tie: as asked
    assert FlashChoice.decide(1.0 + FA_TIE / 2, 1.0, asked=True) is True
    assert FlashChoice.decide(2.0, 0.0, asked=False) is True  # off was not run (did not fit)
    assert FlashChoice.decide(0.0, 2.0, asked=True) is False


class TurnTimes(Curves):
    """Curves, and a chat turn's time per flash-attention setting; every run recorded."""

    def __init__(self, info, on_s, off_s):
        super().__init__(info, lambda k: 90.0 + k, lambda k: 200.0 + k)
        self.times, self.runs, self.n_threads, self.cancel = {True: on_s, False: off_s}, [], 1, None

    def turn_s(self, layers, flash_attn, fill, threads):
        self.runs.append((layers, flash_attn, fill))
        return self.times[flash_attn]


def test_autotune_chooses_flash_attention_at_the_best_generation_layers(model_path):
    from app.core.settings import phase_settings

    info = model_info(read_gguf(model_path))
    c = TurnTimes(info, on_s=2.0, off_s=1.5)
    tuned = autotune(c, 600 * MiB, 0, flash_attn=True)  # both settings fit every layer
    fa = tuned.flash_attn
    assert fa is not None and fa.on is False and fa.layers == tuned.best_gen_layers
    # each setting twice, alternating which goes first, with history in the cache
    assert [r[1] for r in c.runs] == [True, False, False, True]
    assert {r[0] for r in c.runs} == {tuned.best_gen_layers} and c.runs[0][2] == 1024 - 128 - 32 - 64
    out = tuned.to_dict()
    assert out["flash_attn"]["on"] is False and phase_settings(tuned)["flash_attn"] is False
    # the JSON read back is the result (the CLI's --tuning file)
    assert TuneResult.from_dict(json.loads(json.dumps(out))).to_dict() == out
    assert "flash_attn" not in autotune(TurnTimes(info, 1, 1), 600 * MiB, 0).to_dict()


def test_a_setting_that_does_not_fit_at_those_layers_is_not_run(model_path):
    """Flash attention off needs a larger compute buffer: at the most layers that fit with it
    on, off may not fit; then only on runs, and on it is."""
    info = model_info(read_gguf(model_path))
    budget = next(b * MiB for b in range(120, 400, 2)
                  if max_layers(info, "RPC0", b * MiB, 1024, 512, True, 0, live=False)
                  > max_layers(info, "RPC0", b * MiB, 1024, 512, False, 0, live=False))
    top = max_layers(info, "RPC0", budget, 1024, 512, True, 0, live=False)
    c = TurnTimes(info, on_s=9.0, off_s=1.0)
    c.gen = lambda k: 90.0 + k  # rising: the best is the top
    tuned = autotune(c, budget, 0, flash_attn=True)
    assert tuned.best_gen_layers == top
    assert tuned.flash_attn.on is True and {r[1] for r in c.runs} == {True}
    assert "fits" in tuned.flash_attn.reason


@pytest.mark.slow  # real loads with history: `make test-slow`
def test_choosing_flash_attention_times_real_turns(model_path):
    from engine.measure.autotune import FlashChoice, choose_flash_attn

    info = model_info(read_gguf(model_path))
    from tests.helpers import N_THREADS

    m = Measurer(model_path, info, "RPC0", 512, N_THREADS, live=False)
    fa = choose_flash_attn(m, 0, 180 * MiB, 0, (N_THREADS, N_THREADS))
    print(f"\nflash attention: {fa.to_dict()}")
    assert fa.turn_s_on > 0 and fa.turn_s_off > 0 and fa.fill == 512 - 128 - 32 - 64
    assert fa.on == FlashChoice.decide(fa.turn_s_on, fa.turn_s_off, True)


def test_chat_takes_flash_attention_from_the_tuning_unless_told(tmp_path, model_path):
    from engine.cli import build_parser
    from engine.cli.chat import session_config

    result = {"best_gen_layers": 0, "best_prompt_layers": 0, "best_gen_threads": 1,
              "best_prompt_threads": 1, "points": [{"layers": 0, "prompt_tps": 100.0, "gen_tps": 10.0}],
              "flash_attn": {"on": False}}
    f = tmp_path / "tune.json"
    f.write_text(json.dumps(result))
    parse = build_parser().parse_args
    assert session_config(parse(["chat", "--model", str(model_path), "--tuning", str(f)])).flash_attn is False
    result["flash_attn"]["on"] = True
    f.write_text(json.dumps(result))
    assert session_config(parse(["chat", "--model", str(model_path), "--tuning", str(f)])).flash_attn is True
    assert session_config(parse(["chat", "--model", str(model_path), "--tuning", str(f),
                                 "--no-flash-attn"])).flash_attn is False
    assert session_config(parse(["chat", "--model", str(model_path), "--tuning", str(f),
                                 "--flash-attn", "off"])).flash_attn is False
    del result["flash_attn"]
    f.write_text(json.dumps(result))
    # no measurement: auto, which the session settles by where the layers run
    assert session_config(parse(["chat", "--model", str(model_path), "--tuning", str(f)])).flash_attn is None
    assert session_config(parse(["chat", "--model", str(model_path), "--flash-attn", "on"])).flash_attn is True


def test_flash_attention_auto_is_on_with_an_accelerator_and_off_on_the_cpu_alone(model_path):
    from engine.config import SessionConfig, flash_attn_for

    auto = SessionConfig(model_path)
    assert auto.flash_attn is None
    assert flash_attn_for(auto, "RPC0") is True
    assert flash_attn_for(auto, None) is False
    assert flash_attn_for(auto, "CPU") is False  # the CPU named as the accelerator is the CPU alone
    assert flash_attn_for(auto, "CUDA0") is True
    assert flash_attn_for(replace(auto, gpu_layers=0), "RPC0") is False  # every layer in RAM
    assert flash_attn_for(replace(auto, flash_attn=True), None) is True  # as set
    assert flash_attn_for(replace(auto, flash_attn=False), "RPC0") is False
