"""Each phase at its best (#15): threads and layers tuned per phase, and a turn whose prompt is
long enough prefilled at the prompt's placement and generated at generation's."""
from __future__ import annotations

import pytest

from engine.config import PhaseTuning, SessionConfig
from engine.llama.sampling import GenParams
from engine.placement.phase_choice import decide_rebalance
from engine.session import Session
from engine.tune_result import TuneResult
from tests.helpers import N_THREADS, agree_where_decided

# the replies of two placements are compared DECIDED (tests/helpers.py): layers on another
# device and other threads evaluate the prompt by another path
GP = GenParams(max_tokens=24, temperature=0, top_logprobs=2)


def _agree(these, those) -> None:
    for a, b in zip(these, those, strict=True):
        assert a.gen.logprobs and b.gen.logprobs
        agree_where_decided(a.gen.logprobs, b.gen.logprobs)
# measured on some machine: prompts run 4x faster with 20 layers on the device than with 5
TUNING = PhaseTuning(gen_layers=5, prompt_layers=20, gen_threads=1, prompt_threads=2,
                     prompt_tps_at_gen=100.0, prompt_tps_at_prompt=400.0)


# ------------------------------------------------------------ the decision (pure)

def test_the_move_pays_for_a_long_prompt_and_not_for_a_short_one():
    # 60 MiB at 1 GB/s plus two replans of 5 ms: ~73 ms; each token saves 7.5 ms
    cost = 60 * 2**20 / 1e9 + 2 * 0.005
    short = decide_rebalance(8, TUNING, 60 * 2**20, 1e9, 0.005)
    long = decide_rebalance(400, TUNING, 60 * 2**20, 1e9, 0.005)
    assert not short.move and long.move
    assert short.break_even_tokens == long.break_even_tokens == pytest.approx(cost / 0.0075, abs=1)
    assert f"pays from {long.break_even_tokens}" in long.reason
    assert f"pays from {short.break_even_tokens} tokens" in short.reason
    assert long.saved_s == pytest.approx(400 * 0.0075) and long.cost_s == pytest.approx(cost)
    # right at the break-even the move pays; one token short it does not
    n = long.break_even_tokens
    assert decide_rebalance(n, TUNING, 60 * 2**20, 1e9, 0.005).move
    assert not decide_rebalance(n - 1, TUNING, 60 * 2**20, 1e9, 0.005).move


def test_no_move_when_one_placement_is_best_or_the_prompt_placement_is_not_faster():
    same = PhaseTuning(12, 12, 2, 2, 300.0, 300.0)
    assert not decide_rebalance(10_000, same, 0, 1e9, 0.005).move
    slower = PhaseTuning(5, 20, 1, 2, 400.0, 100.0)
    r = decide_rebalance(10_000, slower, 60 * 2**20, 1e9, 0.005)
    assert not r.move and r.break_even_tokens is None and "not faster" in r.reason
    # a slow link: the same prompt no longer pays
    assert decide_rebalance(400, TUNING, 60 * 2**20, 1e9, 0.005).move
    assert not decide_rebalance(400, TUNING, 60 * 2**20, 20e6, 0.005).move


def test_a_tuning_reads_autotunes_json():
    result = {"best_gen_layers": 5, "best_prompt_layers": 20, "best_gen_threads": 1,
              "best_prompt_threads": 2,
              "points": [{"layers": 5, "prompt_tps": 150.0, "gen_tps": 30.0,
                          "prompt_tps_by_threads": {"1": 60.0, "2": 100.0}},
                         {"layers": 20, "prompt_tps": 400.0, "gen_tps": 20.0,
                          "prompt_tps_by_threads": {"1": 250.0, "2": 400.0}}]}
    t = TuneResult.from_dict(result).phase_tuning()
    assert t == TUNING
    assert PhaseTuning.from_dict(t.to_dict()) == t
    # with the projector's image batch measured too
    result["best_image_layers"] = 20
    result["points"][0]["image_tps_by_threads"] = {"1": 10.0, "2": 20.0}
    result["points"][1]["image_tps_by_threads"] = {"1": 80.0, "2": 90.0}
    t = TuneResult.from_dict(result).phase_tuning()
    assert (t.image_layers, t.image_tps_at_gen, t.image_tps_at_image) == (20, 20.0, 90.0)
    assert t.for_images() == PhaseTuning(5, 20, 1, 2, 20.0, 90.0)
    assert PhaseTuning.from_dict(t.to_dict()) == t


def test_plan_prices_a_per_phase_split_for_an_8b_model_on_an_8gib_card(tmp_path):
    """A device that is fast on batches and slower than RAM on single tokens (a weak iGPU or a
    remote box, say):
    generation is best with the layers in RAM, prompts with all that fit; a 4k-token prompt
    pays for moving GiBs of layers over a PCIe 4 bus, a short one does not, and the numbers say so."""
    from engine.gguf.info import model_info, read_gguf
    from engine.synth.model_gen import write_sparse_model
    from engine.placement.calibration import DeviceCal
    from engine.placement.whatif import phases_line, what_if

    model = model_info(read_gguf(write_sparse_model(tmp_path / "llama-8b.gguf", "llama-8b")))
    cpu = DeviceCal("CPU", gen_s_per_byte=1 / 40e9, prompt_s_per_byte=1 / 40e9 / 64)
    # a token reads the device's weights at half RAM's speed; batches run 100x faster than RAM
    acc = DeviceCal("GPU", gen_s_per_byte=1 / 20e9, prompt_s_per_byte=1 / 40e9 / 6400,
                    split_gen_s=0.03, split_prompt_s=0.001, bus_Bps=24e9)
    long = what_if(model, None, 8 * 2**30, 24e9, 40e9, 300e9, 4096, 8, cpu, acc,
                   n_prompt=4096).phases
    short = what_if(model, None, 8 * 2**30, 24e9, 40e9, 300e9, 4096, 8, cpu, acc,
                    n_prompt=16).phases
    assert long is not None and short is not None
    assert long["gen_layers"] <= 1 and long["prompt_layers"] > 20  # 0 and 1: the output only
    assert long["move_bytes"] > 2 * 2**30
    assert long["move_s"] == pytest.approx(long["move_bytes"] / 24e9 + 0.01, rel=1e-3)
    assert long["pays"] and not short["pays"]
    assert long["break_even_tokens"] == short["break_even_tokens"]
    assert 16 < long["break_even_tokens"] < 4096
    assert "pays for it" in phases_line(long) and "does not pay" in phases_line(short)
    # the default costs (a GPU faster at both): one placement
    same = what_if(model, None, 8 * 2**30, 24e9, 40e9, 300e9, 4096, 8, n_prompt=4096).phases
    assert same is not None and not same["pays"]
    assert same["gen_layers"] == same["prompt_layers"] and "one placement" in phases_line(same)


# ------------------------------------------------------------ on the RPC device

LONG_PROMPT = " ".join(f"Item {i}: the keeper lit the lamp and watched the sea." for i in range(40))


# on the device: a small gain per token (0.2 ms), so a short prompt does not pay the move
# (break-even over 50 tokens at any link speed) and a 600-token one does on loopback
SMALL_GAIN = PhaseTuning(gen_layers=5, prompt_layers=20, gen_threads=1, prompt_threads=2,
                         prompt_tps_at_gen=100.0, prompt_tps_at_prompt=102.0)


def _turns(model_path, endpoint, phases):
    cfg = SessionConfig(model_path, None, n_ctx=2048, n_threads=N_THREADS, mover="live",
                        vram_budget_bytes=300 * 2**20, rpc=(endpoint,), phases=phases,
                        gpu_layers=None if phases else TUNING.gen_layers,
                        n_threads_batch=None if phases else TUNING.prompt_threads)
    with Session(cfg) as s:
        if phases is None:
            s.cfg = cfg  # no per-phase choice: one placement, the same threads
        out = []
        for text in ("Hi.", LONG_PROMPT + " Summarise the items in one sentence."):
            r = s.turn(text, gp=GP)
            assert r.error is None, r.error
            out.append(r)
        on_device = sorted(s.model.mover.on_device()) if s.model.mover else []
        return out, on_device, s.model.ledger.total(s.model.accel)


@pytest.mark.slow  # 21 s of make test's 12 minutes (a fresh clone, 2 cores)
def test_a_long_prompt_runs_at_the_prompt_placement_and_replies_as_one_placement(model_path,
                                                                                shared_rpc_server):
    from engine.llama.devices import connect_rpc

    connect_rpc(shared_rpc_server.endpoint)
    one, one_layers, one_ledger = _turns(model_path, shared_rpc_server.endpoint, None)
    two, two_layers, two_ledger = _turns(model_path, shared_rpc_server.endpoint, SMALL_GAIN)
    short, long = two
    assert short.phases is not None and long.phases is not None
    assert not short.phases.moved and "pays from" in short.phases.reason
    assert long.phases.moved, long.phases
    assert long.phases.prompt_layers == 20 and long.phases.gen_layers == 5
    assert long.phases.gen_threads == 1 and long.phases.prompt_threads == 2
    names = [sp.name for sp in long.spans]
    assert names.count("rebalance") == 2
    assert names.index("rebalance") < names.index("prefill") < len(names) - 1 - names[::-1].index("rebalance") < names.index("decode")
    moves = [sp for sp in long.spans if sp.name == "rebalance"]
    assert moves[0].bytes > 0 and all(sp.predicted_s for sp in moves)
    assert "rebalance" not in [sp.name for sp in short.spans]
    # the same replies where the model decided them; back at generation's placement, the
    # ledger as before
    _agree(two, one)
    assert two_layers == one_layers and two_ledger == one_ledger


# ------------------------------------------------------------ in the window

RESULT = {"device": "RPC0", "vram_budget_bytes": 185 * 2**20, "headroom_bytes": 0,
          "max_layers": 20, "best_gen_layers": 5, "best_prompt_layers": 20,
          "best_gen_tps": 30.0, "best_prompt_tps": 400.0, "best_gen_threads": 1,
          "best_prompt_threads": 2, "threads_searched": [1, 2], "cliff_gen_layers": None,
          "cliff_prompt_layers": None, "n_runs": 2,
          "points": [{"layers": 5, "prompt_tps": 100.0, "gen_tps": 30.0, "prompt_threads": 2,
                      "gen_threads": 1, "prompt_tps_by_threads": {"1": 60.0, "2": 100.0},
                      "gen_tps_by_threads": {"1": 30.0, "2": 29.5}},
                     {"layers": 20, "prompt_tps": 400.0, "gen_tps": 20.0, "prompt_threads": 2,
                      "gen_threads": 1, "prompt_tps_by_threads": {"1": 250.0, "2": 400.0},
                      "gen_tps_by_threads": {"1": 20.0, "2": 19.0}}]}


def test_use_these_saves_each_phase_and_the_session_config_carries_it(tmp_path):
    from app.core.settings import load_settings, phase_settings, phase_tuning, session_config
    from app.core.store import Store

    store = Store(tmp_path / "data")
    for k, v in phase_settings(TuneResult.from_dict(RESULT)).items():
        store.settings.set(k, v)
    s = load_settings(store)
    assert (s.gpu_layers, s.prompt_layers, s.threads, s.threads_batch) == (5, 20, 1, 2)
    assert phase_tuning(s) == TUNING  # the prompt speeds measured at the prompt's threads
    cfg, _ = session_config(store, "default", "")
    assert cfg.phases == TUNING and cfg.n_threads == 1 and cfg.n_threads_batch == 2
    # a user override to a count Tune never measured: one placement (nothing prices a move)
    store.settings.set("prompt_layers", 12)
    assert session_config(store, "default", "")[0].phases is None
    store.close()


def test_the_tune_dialog_draws_a_curve_per_thread_count_and_uses_both_phases(qtbot):
    from app.dialogs.tune import TuneDialog

    d = TuneDialog()
    qtbot.addWidget(d)
    for p in RESULT["points"]:
        d.add_point(p["layers"], p["prompt_tps"], p["gen_tps"],
                    {int(t): v for t, v in p["prompt_tps_by_threads"].items()},
                    {int(t): v for t, v in p["gen_tps_by_threads"].items()})
    tuned = TuneResult.from_dict(RESULT)
    d.finish(tuned)
    assert sorted(d.curves) == [("gen", 1), ("gen", 2), ("prompt", 1), ("prompt", 2)]
    xs, ys = d.curves[("prompt", 2)].getData()
    assert list(xs) == [5, 20] and list(ys) == [100.0, 400.0]
    assert "20 layers, 2 threads" in d.summary.text() and "5 layers, 1 thread " in d.summary.text()
    with qtbot.waitSignal(d.apply_result) as got:
        d.apply_button.click()
    assert got.args[0] is tuned


@pytest.mark.slow  # 25 s of make test's 12 minutes (a fresh clone, 2 cores)
def test_a_prompt_with_an_image_moves_to_the_image_batchs_placement(model_path, tiny_projector,
                                                                   pictures, shared_rpc_server):
    """Text prompts stay where generation is; the image's batch, measured slower there (past
    its cliff), moves to the image's best layers and back; the replies are one placement's
    where the model decided them."""
    from engine.llama.devices import connect_rpc

    connect_rpc(shared_rpc_server.endpoint)
    images_only = PhaseTuning(gen_layers=5, prompt_layers=5, gen_threads=0, prompt_threads=0,
                              prompt_tps_at_gen=100.0, prompt_tps_at_prompt=100.0,
                              image_layers=20, image_tps_at_gen=20.0, image_tps_at_image=100.0)
    assert images_only.for_images().prompt_layers == 20 and not images_only.differs

    def run(phases):
        cfg = SessionConfig(model_path, tiny_projector, n_ctx=2048, n_threads=N_THREADS,
                            mover="live", vision="cpu", vram_budget_bytes=300 * 2**20,
                            rpc=(shared_rpc_server.endpoint,), phases=phases, gpu_layers=5)
        with Session(cfg) as s:
            a = s.turn("Hi.", gp=GP)
            # a reply decided from its first steps: the placements' comparison compares something
            b = s.turn("Repeat after me: the cat sat on the mat.", [pictures["a.png"]], gp=GP)
            assert a.error is None and b.error is None, (a.error, b.error)
            return a, b

    a1, b1 = run(None)
    a2, b2 = run(images_only)
    assert "rebalance" not in [sp.name for sp in a2.spans]
    assert b2.phases is not None and b2.phases.moved and b2.phases.prompt_layers == 20, b2.phases
    assert [sp.name for sp in b2.spans].count("rebalance") == 2
    _agree((a2, b2), (a1, b1))


def test_one_rule_for_which_layers_a_count_puts_on_the_device():
    """#28: llama.cpp's count is the output layer first, then the last repeating layers."""
    from engine.placement.plan import device_layers

    assert list(device_layers(30, 0)) == [] and list(device_layers(30, 1)) == []
    assert list(device_layers(30, 3)) == [28, 29] and list(device_layers(30, 99)) == list(range(30))


def test_a_phase_move_is_priced_the_same_for_the_session_and_what_if():
    """#28: one pure plan_phase_move: the layers that differ, their bytes, the budget's room."""
    from engine.placement.phase_choice import plan_phase_move

    t = PhaseTuning(gen_layers=5, prompt_layers=11, gen_threads=1, prompt_threads=2,
                    prompt_tps_at_gen=100.0, prompt_tps_at_prompt=400.0)
    sizes = [10 << 20] * 30
    move = plan_phase_move(30, range(26, 30), t, 2000, sizes, 1e9)
    assert move.target == frozenset(range(20, 30)) and move.copy == frozenset(range(20, 26))
    assert move.n_bytes == 6 * (10 << 20) and move.decision.move  # 2000 tokens pay for 60 MiB
    assert not plan_phase_move(30, range(26, 30), t, 2, sizes, 1e9).decision.move  # too short
    tight = plan_phase_move(30, range(26, 30), t, 2000, sizes, 1e9, room_bytes=50 << 20)
    assert not tight.decision.move and "budget" in tight.decision.reason
    # back from more layers to fewer frees memory: no room needed
    back = PhaseTuning(11, 5, 1, 2, 400.0, 100.0)
    assert plan_phase_move(30, range(20, 30), back, 2000, sizes, 1e9, room_bytes=0).copy == frozenset(range(20, 26))
    none = PhaseTuning(0, 11, 1, 2, 100.0, 400.0)
    assert "no accelerator" in plan_phase_move(30, [], none, 2000, sizes, 1e9).decision.reason
