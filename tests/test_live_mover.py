"""The live mover against a real second device (ggml RPC on loopback)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import N_THREADS, agree_turn_by_turn, run_cli


# a reply whose first steps the model decides (the picture aside): a comparison of two paths
# then compares something (agree_turn_by_turn's floor); "What is this?" is close from its first
REPEAT = "Repeat after me: the cat sat on the mat."


def _one_image_turn(rpc_server, base_projector, pictures, *extra, env=None, prompt="What is this?"):
    cmd = [sys.executable, "-m", "engine", "chat", "--rpc", rpc_server.endpoint, "--mmproj",
           str(base_projector), "--prompt", prompt, "--image", str(pictures["a.png"]),
           "--vision", "swap", "--vram-budget", "300MiB", "--temp", "0", "--max-tokens", "8",
           "--ctx", "2048", "--threads", str(N_THREADS), "--json", "--top-logprobs", "2", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, **(env or {})))


def test_self_test_failure_falls_back_to_the_reload_mover(rpc_server, base_projector, pictures,
                                                           tmp_path):
    env = {"EBB_TEST_BREAK_LIVE_MOVER": "1", "EBB_CACHE_DIR": str(tmp_path)}
    proc = _one_image_turn(rpc_server, base_projector, pictures, env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["mover"] == "reload" and out["strategy"] == "swap"
    assert "self-test failed" in out["mover_note"] and "reload mover" in out["mover_note"]
    assert "save_state" in [s["name"] for s in out["spans"]]
    forced = _one_image_turn(rpc_server, base_projector, pictures, "--mover", "live", env=env)
    assert forced.returncode == 2 and "self-test failed" in forced.stderr
    assert "Traceback" not in forced.stderr


def test_live_mover_runs_when_the_self_test_passes(rpc_server, base_projector, pictures, tmp_path):
    proc = _one_image_turn(rpc_server, base_projector, pictures, "--mover", "live",
                           env={"EBB_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["mover"] == "live" and out["mover_note"] == ""
    evict = next(s for s in out["spans"] if s["name"] == "evict")
    restore = next(s for s in out["spans"] if s["name"] == "restore")
    assert 0 < evict["bytes"] == restore["bytes"] < 70 * 2**20  # only layers moved, not all
    assert (tmp_path / "live-mover-selftest.json").exists()  # remembered for the next start


CYCLES = """
import json, os, resource, sys
from pathlib import Path
from engine.llama.devices import connect_rpc
from engine.models.default import default_model_path
from engine.session import Session, SessionConfig
from engine.measure.swap_bench import auto_budget
connect_rpc(sys.argv[1])
cfg = SessionConfig(default_model_path(), Path(sys.argv[2]), n_ctx=1024, n_threads=2,
                    vision="swap", mover="live", rpc=(sys.argv[1],))
with Session(cfg) as probe:
    budget = auto_budget(probe)
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
samples = []
with Session(SessionConfig(**{**cfg.__dict__, "vram_budget_bytes": budget})) as s:
    assert s.model.mover_name == "live", s.model.mover_note
    for i in range(int(sys.argv[4])):
        res = s.encode_only([sys.argv[3]])
        assert res.strategy == "swap", res.reason
        if i in (4, int(sys.argv[4]) - 1):
            sys.stdout.write(json.dumps({"cycle": i, "ledger": s.model.ledger.total(s.model.accel),
                                         "rss": rss(), "peak": res.device_peak_bytes[s.model.accel],
                                         "budget": budget}) + "\\n")
            sys.stdout.flush()
            input()
    st = s.model.mover.stats
    print(json.dumps({"allocs": st.n_allocs, "frees": st.n_frees, "held": s.model.mover.n_buffers(),
                      "layers_on_device": len(s.model.mover.on_device()),
                      "evicted_layers": [sp.detail for sp in res.spans if sp.name == "evict"]}))
"""


@pytest.mark.slow  # a soak (the fault suite's short soak runs in make test): make test-slow
def test_fifty_swap_cycles_leak_nothing(rpc_server, base_projector, pictures):
    proc = subprocess.Popen([sys.executable, "-c", CYCLES, rpc_server.endpoint, str(base_projector),
                             str(pictures["a.png"]), "50"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    first = json.loads(proc.stdout.readline())
    server_first = rpc_server.rss_bytes()
    proc.stdin.write("\n")
    proc.stdin.flush()
    last = json.loads(proc.stdout.readline())
    server_last = rpc_server.rss_bytes()
    proc.stdin.write("\n")
    proc.stdin.flush()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    stats = json.loads(out.strip().splitlines()[-1])
    MiB = 2**20
    print(f"\nafter cycle 5 → 50: ledger {first['ledger'] / MiB:.1f} → {last['ledger'] / MiB:.1f} MiB, "
          f"process RSS {first['rss'] / MiB:.0f} → {last['rss'] / MiB:.0f} MiB, "
          f"server RSS {server_first / MiB:.0f} → {server_last / MiB:.0f} MiB; "
          f"{stats['allocs']} device buffers allocated, {stats['frees']} freed, "
          f"{stats['held']} held by the placement ({stats['layers_on_device']} layers); each swap moved {stats['evicted_layers']}")
    assert last["ledger"] == first["ledger"]
    assert last["peak"] <= last["budget"]
    assert last["rss"] - first["rss"] < 16 * MiB
    assert server_last - server_first < 16 * MiB
    assert stats["allocs"] == stats["frees"] + stats["held"]
    assert stats["allocs"] >= 50 * 2  # every cycle really moved layers (in shared buffers)
    assert stats["evicted_layers"] and int(stats["evicted_layers"][0].split()[0]) >= 10


def _entries(*specs):
    from engine.placement.live_mover import Entry

    return [Entry(ptr=i, host=h, n_bytes=n, alloc_bytes=a) for i, (h, n, a) in enumerate(specs)]


def test_layout_merges_neighbours_into_few_copies():
    from engine.placement.live_mover import layout_copies

    # three tensors back to back in host memory (a 32-byte gap before the last), listed out of order
    entries = _entries((1024 + 3008, 96, 96), (1024, 3008, 3008), (1024 + 3104 + 32, 64, 64))
    lay = layout_copies(entries, align=32, chunk_bytes=1024)
    assert lay.offsets == [3008, 0, 3136]  # host distances kept: one contiguous range
    assert lay.zero_pads == []
    assert lay.copies[0] == (1024, 0, 1024) and sum(n for _, _, n in lay.copies) == 3200
    assert all(n <= 1024 for _, _, n in lay.copies)
    assert [d for _, d, _ in lay.copies] == [0, 1024, 2048, 3072]
    assert lay.total_bytes == 3200


def test_layout_starts_a_new_copy_where_it_cannot_mirror_the_host():
    from engine.placement.live_mover import layout_copies

    # padded rows (device size > bytes), a misaligned neighbour, a distant tensor
    entries = _entries((0, 100, 128), (128, 64, 64), (208, 40, 40), (1 << 20, 32, 32))
    lay = layout_copies(entries, align=32, chunk_bytes=1 << 20)
    assert lay.zero_pads == [(100, 28)]  # the padding is zeroed, never filled from the host
    assert lay.offsets[1] == 128  # after the padded tensor: aligned, a copy of its own
    assert lay.offsets[2] == 192  # 208 - 128 = 80 is not a multiple of 32 from 128: own copy
    assert lay.offsets[3] == 256  # far away in host memory: packed, not mirrored
    assert [(h, d) for h, d, _ in lay.copies] == [(0, 0), (128, 128), (208, 192), (1 << 20, 256)]
    assert lay.total_bytes == 288
    # neighbours in two different host buffers are never copied as one range
    from engine.placement.live_mover import Entry

    split = layout_copies([Entry(0, 0, 64, 64, host_buffer=1), Entry(1, 64, 64, 64, host_buffer=2)],
                          align=32, chunk_bytes=1 << 20)
    assert len(split.copies) == 2
    # nothing overlaps on the device
    spans = sorted((o, o + e.alloc_bytes) for o, e in zip(lay.offsets, entries))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("one_by_one", [False, True])
def test_fields_point_every_tensor_and_back_and_touch_nothing_else(monkeypatch, one_by_one):
    import ctypes

    import numpy as np

    from engine.llama import ggml
    from engine.placement import live_mover

    if one_by_one:  # structs too far apart for one view: the fallback writes each
        monkeypatch.setattr(live_mover, "MAX_FIELDS_SPAN_BYTES", 0)
    structs = (ggml.Tensor * 7)()
    for i, t in enumerate(structs):
        t.buffer, t.data, t.extra, t.ne[0] = 0x1000 + i, 0x20000 + 64 * i, None, 100 + i
        t.name = b"blk.%d.w" % i
    picked = [structs[i] for i in (5, 1, 3)]  # a layer's tensors, not in memory order
    fields = live_mover._Fields([ctypes.addressof(t) for t in picked], picked)
    assert (fields.mem is None) == one_by_one

    fields.write(0xBEEF, np.array([0x500, 0x600, 0x700], dtype=np.uint64) + np.uint64(0x9000), 0)
    assert [(t.buffer, t.data, t.extra) for t in picked] == \
        [(0xBEEF, 0x9500, None), (0xBEEF, 0x9600, None), (0xBEEF, 0x9700, None)]
    here = fields.read()
    fields.to_host()
    assert [(t.buffer, t.data, t.extra) for t in picked] == \
        [(0x1005, 0x20000 + 320, None), (0x1001, 0x20040, None), (0x1003, 0x200C0, None)]
    fields.write(*here)  # what the self-test's detach and reattach do
    assert [t.data for t in picked] == [0x9500, 0x9600, 0x9700]
    # the other structs and every other field are as they were
    assert [(t.buffer, t.data) for i, t in enumerate(structs) if i not in (1, 3, 5)] == \
        [(0x1000 + i, 0x20000 + 64 * i) for i in (0, 2, 4, 6)]
    assert [t.ne[0] for t in structs] == [100 + i for i in range(7)]
    assert [t.name for t in structs] == [b"blk.%d.w" % i for i in range(7)]


@pytest.mark.parametrize("remote", [True, False])
def test_copies_to_a_remote_device_are_queued_a_few_at_a_time(monkeypatch, remote):
    from types import SimpleNamespace

    from engine.llama import ggml

    calls: list[str] = []

    class Base:  # records what the copier asks ggml to do
        def ggml_backend_dev_init(self, dev, params):
            return 0xB0
        def ggml_backend_tensor_set(self, *args):
            calls.append("wait")
        def ggml_backend_tensor_set_async(self, backend, *args):
            assert backend == 0xB0
            calls.append("queue")
        def ggml_backend_free(self, backend):
            calls.append("free")

    monkeypatch.setattr(ggml, "lib", lambda: SimpleNamespace(base=Base()))
    copier = ggml.Copier(1, remote)
    piece = copier.piece_bytes
    for i in range(10):
        copier.copy(0, 0, i * piece, piece)
    copier.copy(0, 0, 0, ggml.RPC_QUEUE_BYTES + 1)  # a tensor sent whole, over the bound
    copier.close()
    copier.close()
    if not remote:
        assert piece == 4 * 2**20 and calls == ["wait"] * 11
        return
    # a queued piece is a copy of its bytes: never more than RPC_QUEUE_BYTES wait in the queue
    runs = "".join("q" if c == "queue" else "w" for c in calls[:-1]).split("w")
    assert piece == ggml.RPC_COPY_PIECE_BYTES and calls.count("queue") > calls.count("wait")
    assert max(len(r) for r in runs) * piece == ggml.RPC_QUEUE_BYTES
    assert calls[-2:] == ["wait", "free"] and calls.count("free") == 1


@pytest.mark.slow  # a measurement: `make test-slow` (CI runs it after `make test`)
def test_bench_swap_reports_both_movers_against_the_limit(rpc_server, base_projector):
    proc = run_cli("bench", "swap", "--rpc", rpc_server.endpoint, "--mmproj", str(base_projector),
                   "--threads", "2", "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    print(f"\nbench swap: reload {out['reload_swap_s'] * 1000:.1f} ms, live {out['live_swap_s'] * 1000:.1f} ms "
          f"(median {out['live_swap_median_s'] * 1000:.1f}), limit {out['limit_s'] * 1000:.1f} ms; "
          f"reload/live {out['reload_vs_live']}x, live/limit {out['live_vs_limit']}x "
          f"(paired {out['live_vs_limit_paired']}x, median {out['live_vs_limit_median']}x, "
          f"against the fastest copy of all {out['live_vs_limit_best']}x)")
    # DECIDED: the reload mover's layers sit where llama.cpp's offload puts them, the live
    # mover's in its own layout (another path), so the turns agree where the model decided
    agree_turn_by_turn([{"logprobs": lp} for lp in out["logprobs"]["reload"]],
                       [{"logprobs": lp} for lp in out["logprobs"]["live"]])
    # the limit: one ideal copy in every live turn (right before its restore), in the piece
    # the scan found fastest
    assert out["n_swaps"] == len(out["live_swaps_s"]) == len(out["bandwidth_samples_Bps"])
    assert 0 < out["bytes_moved"] < out["reload_bytes_moved"]
    assert out["limit_s"] == round(out["bytes_moved"] / out["bandwidth_Bps"], 4)
    assert out["bandwidth_Bps"] == max(out["bandwidth_samples_Bps"])
    scan = out["bandwidth_scan_Bps"]
    from engine.llama.bandwidth import COPY_PIECES

    assert set(scan) == {str(p) if p else "whole" for p in COPY_PIECES}
    assert {str(2**20), "whole"} <= set(scan)
    best_piece = max(scan, key=scan.get)
    assert out["bandwidth_piece_bytes"] == (0 if best_piece == "whole" else int(best_piece))
    assert out["limit_best_s"] == round(out["bytes_moved"] / max(out["bandwidth_Bps"], *scan.values()), 4)
    assert out["limit_best_s"] <= out["limit_s"]
    assert out["live_swap_s"] == min(out["live_swaps_s"]) <= out["live_swap_median_s"]
    assert max(out["peak_bytes"].values()) <= out["vram_budget_bytes"]
    assert all(0 < fastest <= median for fastest, median in out["prefill_s"].values())


FALLBACK = """
import json, sys
from pathlib import Path
import engine.llama.runtime as rt
rt._graph_reserve_fn = lambda: None  # as on a llama.cpp without llama_graph_reserve
from engine.llama.devices import connect_rpc
from engine.models.default import default_model_path
from engine.llama.sampling import GenParams
from engine.session import Session, SessionConfig
connect_rpc(sys.argv[1])
cfg = SessionConfig(default_model_path(), Path(sys.argv[2]), n_ctx=1024, n_threads=2, vision="swap",
                    mover="live", rpc=(sys.argv[1],), vram_budget_bytes=300 * 2**20)
with Session(cfg) as s:
    res = s.turn("What is this?", [sys.argv[3]], GenParams(max_tokens=6, temperature=0))
    print(json.dumps({"mover": s.model.mover_name, "note": s.model.mover_note, "text": res.text,
                      "error": res.error, "spans": [sp.name for sp in res.spans]}))
"""


def test_reschedule_without_graph_reserve_still_passes_the_self_test(rpc_server, base_projector,
                                                                      pictures):
    """Where llama.cpp lacks llama_graph_reserve, the control-vector reset re-plans instead."""
    proc = subprocess.run([sys.executable, "-c", FALLBACK, rpc_server.endpoint, str(base_projector),
                           str(pictures["a.png"])], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["mover"] == "live", out["note"]
    assert not out["error"] and out["text"]
    assert {"evict", "restore", "prefill"} <= set(out["spans"])


def _budget_only_the_reload_mover_meets(model_path, projector):
    """A budget over the projector's need but under it plus what the live layout keeps on the
    device whatever layers move (output layer, every layer's KV cache, compute buffer)."""
    from engine.gguf.info import model_info, projector_info, read_gguf
    from engine.placement.plan import placement_for, projector_need_bytes

    info = model_info(read_gguf(model_path))
    floor = placement_for(info, "RPC0", 1, 2048, 512, True, live=True).accel_total_bytes
    need = projector_need_bytes(projector_info(read_gguf(projector)), True)
    budget = max(need, floor) + min(need, floor) // 2
    assert need <= budget < need + floor
    return budget


@pytest.mark.slow  # a long run (make test's budget): make test-slow, which CI runs
def test_a_swap_the_live_mover_cannot_make_room_for_takes_the_reload_mover(
        rpc_server, base_projector, pictures, model_path):
    budget = _budget_only_the_reload_mover_meets(model_path, base_projector)
    swap = _one_image_turn(rpc_server, base_projector, pictures, "--vram-budget", f"{budget}B",
                           prompt=REPEAT)
    assert swap.returncode == 0, swap.stderr
    out = json.loads(swap.stdout)
    cpu = json.loads(_one_image_turn(rpc_server, base_projector, pictures, "--vram-budget",
                                     f"{budget}B", "--vision", "cpu", prompt=REPEAT).stdout)
    assert out["mover"] == "live" and out["strategy"] == "swap" and out["swap_mover"] == "reload"
    assert "reload mover" in out["mover_note"] and "evicting every layer" in out["mover_note"]
    assert "save_state" in [s["name"] for s in out["spans"]]
    assert out["device_peak_bytes"]["RPC0"] <= budget
    agree_turn_by_turn([out], [cpu])  # encoded on the device or the CPU: DECIDED
    forced = _one_image_turn(rpc_server, base_projector, pictures, "--vram-budget", f"{budget}B",
                             "--mover", "live")
    assert forced.returncode == 2 and "Traceback" not in forced.stderr
    error = json.loads(forced.stdout)["error"]
    print(f"\n--mover live at {budget / 2**20:.1f} MiB: {error}")
    for way_out in ("--mover auto or reload", "--vision cpu", "--vram-budget"):
        assert way_out in error



AFTER_A_MOVE = """
import json, sys
import numpy as np
from engine.config import SessionConfig
from engine.llama import runtime as runtime_mod
from engine.llama.binding import binding
from engine.llama.devices import connect_rpc
from engine.models.default import default_model_path
from engine.session import Session
connect_rpc(sys.argv[1])
reserve = runtime_mod._graph_reserve_fn()
assert reserve is not None  # the llama.cpp we build has it
dropped = []
def counting(*args):
    dropped.append(args[1:])
    return reserve(*args)
runtime_mod._graph_reserve_fn = lambda: counting
cfg = SessionConfig(default_model_path(), None, n_ctx=512, n_threads=int(sys.argv[2]),
                    mover="live", vram_budget_bytes=300 * 2**20, rpc=(sys.argv[1],))
L = binding()
with Session(cfg) as s:
    rt, model = s.model.runtime, s.model
    layers = model.mover.on_device()[-6:]
    prompt = rt.tokenize("The keeper lit the lamp and", add_special=True)
    def run(move):
        rt.slot.reset()
        rt._decode_tokens(prompt)
        rt._decode_tokens([prompt[-1]])  # one token: the graph llama.cpp would reuse
        out, drops = [], []
        for batch in ([prompt[1]], [prompt[2], prompt[3], prompt[4]]):
            if move:
                model.evict_layers(layers)
                model.restore_layers(layers)
            n = len(dropped)
            rt._decode_tokens(batch)
            drops.append(len(dropped) - n)
            out.append(np.ctypeslib.as_array(L.llama_get_logits_ith(rt.ctx, -1),
                                             shape=(s.info.n_vocab,)).copy())
        return out, drops
    still, _ = run(False)
    moved, drops = run(True)
    print(json.dumps({"layers": len(layers), "back": model.mover.on_device()[-6:] == layers,
                      "drops": drops, "equal": [bool(np.array_equal(a, b))
                                                for a, b in zip(still, moved)]}))
"""


def test_after_a_move_the_next_graph_is_planned_afresh_and_dropped_only_when_reusable(
        rpc_server):
    """After layers leave the device and come back, llama.cpp must not run its last graph
    again (over RPC the server dropped it with the freed buffers: asked to run it, the
    process aborts). A batch of another shape gets a new graph anyway; before one of the
    same shape the old graph is dropped. Either way the logits are those of the same
    decodes with nothing moved (same placement, same batches: the same arithmetic)."""
    proc = subprocess.run([sys.executable, "-c", AFTER_A_MOVE, rpc_server.endpoint, str(N_THREADS)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["layers"] == 6 and out["back"]
    assert out["drops"] == [1, 0]  # before the one-token batch (the last one's shape) only
    assert out["equal"] == [True, True]
