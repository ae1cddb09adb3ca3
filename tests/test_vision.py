"""The vision turn against a real second device: ggml's RPC server on loopback."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import N_THREADS, agree_turn_by_turn, run_cli

MiB = 2**20
BUDGET = 300 * MiB  # holds SmolLM2 on the device (~234 MiB) but not beside the base projector


def _script(tmp_path, pictures, turns):
    path = tmp_path / "script.json"
    path.write_text(json.dumps(turns))
    for name, src in pictures.items():
        (tmp_path / name).write_bytes(src.read_bytes())
    return path


def _chat(server, projector, script, *extra):
    proc = run_cli("chat", "--rpc", server.endpoint, "--mmproj", str(projector), "--script",
                   str(script), "--temp", "0", "--max-tokens", "16", "--ctx", "2048",
                   "--threads", str(N_THREADS), "--json", "--top-logprobs", "2", *extra, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


THREE_TURNS = [{"text": "What is in this picture?", "images": ["a.png"]},
               {"text": "What is the capital of France?"},
               {"text": "And these? Compare them.", "images": ["b.jpg", "a.png"]}]


def test_swap_holds_the_budget_and_matches_resident_and_cpu(tmp_path, rpc_server, base_projector, pictures):
    script = _script(tmp_path, pictures, THREE_TURNS)
    rpc_server.reset_peak()  # the server's own high-water mark of resident memory
    base_rss = rpc_server.rss_bytes()
    swap = _chat(rpc_server, base_projector, script, "--vision", "swap", "--vram-budget", "300MiB",
                 "--mover", "reload", "--trace", str(tmp_path / "trace.json"))
    server_growth = rpc_server.peak_rss_bytes() - base_rss
    rpc_server.reset_peak()
    base_rss = rpc_server.rss_bytes()
    live = _chat(rpc_server, base_projector, script, "--vision", "swap", "--vram-budget", "300MiB",
                 "--mover", "live")
    live_growth = rpc_server.peak_rss_bytes() - base_rss
    cpu = _chat(rpc_server, base_projector, script, "--vision", "cpu", "--vram-budget", "300MiB")
    resident = _chat(rpc_server, base_projector, script, "--vision", "resident")  # ample budget
    assert [t["strategy"] for t in swap] == ["swap", "none", "swap"] == [t["strategy"] for t in live]
    assert swap[0]["mover"] == "reload" and live[0]["mover"] == "live"
    assert [t["strategy"] for t in cpu] == ["cpu", "none", "cpu"]
    assert [t["strategy"] for t in resident] == ["resident", "none", "resident"]
    # the picture encoded on the device or on the CPU, the layers moved or reloaded: the same
    # replies where decided (tests/helpers.py)
    for other in (resident, cpu, live):
        agree_turn_by_turn(other, swap)
    assert all(t["n_layers_on_accel"] == 30 for t in swap + cpu + resident + live)
    for turn in swap + live:
        assert "error" not in turn
        assert turn["device_peak_bytes"]["RPC0"] <= BUDGET
    print(f"\nserver memory growth during the swap script: reload {server_growth / MiB:.0f} MiB, "
          f"live {live_growth / MiB:.0f} MiB (budget {BUDGET / MiB:.0f} MiB); ledger peak "
          f"{max(t['device_peak_bytes']['RPC0'] for t in swap + live) / MiB:.0f} MiB")
    assert server_growth <= BUDGET and live_growth <= BUDGET
    assert [s["name"] for s in live[0]["spans"]] == [
        "plan", "evict", "load_projector", "encode", "free_projector", "restore", "prefill", "decode"]
    names = [s["name"] for s in swap[0]["spans"]]
    assert names == ["plan", "save_state", "evict", "load_projector", "encode", "free_projector",
                     "restore", "restore_state", "prefill", "decode"]
    for s in swap[0]["spans"]:
        assert s["end_s"] >= s["start_s"] >= 0 and s["device"] in ("CPU", "RPC0")
    trace = json.loads((tmp_path / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == sum(len(t["spans"]) for t in swap)
    assert all(e["dur"] >= 0 and "device" in e["args"] for e in spans)


def test_resident_exceeds_a_tight_budget_only_by_giving_up_layers(tmp_path, rpc_server, base_projector, pictures):
    script = _script(tmp_path, pictures, THREE_TURNS[:1])
    out = _chat(rpc_server, base_projector, script, "--vision", "resident", "--vram-budget", "300MiB")
    assert out[0]["strategy"] == "resident"
    assert out[0]["n_gpu_layers"] < 31  # the projector's room came from the model
    assert out[0]["device_peak_bytes"]["RPC0"] <= BUDGET


def test_cached_image_is_not_encoded_again(tmp_path, rpc_server, base_projector, pictures):
    script = _script(tmp_path, pictures, THREE_TURNS)
    out = _chat(rpc_server, base_projector, script, "--vision", "cpu")
    assert (out[0]["n_images_encoded"], out[0]["n_images_cached"]) == (1, 0)
    assert (out[2]["n_images_encoded"], out[2]["n_images_cached"]) == (1, 1)
    assert [s["name"] for s in out[2]["spans"]].count("encode") == 1


def test_auto_picks_what_fits_and_explains(tmp_path, rpc_server, base_projector, pictures):
    script = _script(tmp_path, pictures, THREE_TURNS[:1])
    tight = _chat(rpc_server, base_projector, script, "--vram-budget", "300MiB")[0]
    assert tight["strategy"] in ("swap", "cpu")
    assert tight["reason"].startswith("auto chose") and "resident impossible" in tight["reason"]
    tiny = _chat(rpc_server, base_projector, script, "--vram-budget", "50MiB")[0]
    assert tiny["strategy"] == "cpu"
    assert "swap impossible" in tiny["reason"] and "whole budget" in tiny["reason"]


def test_swap_that_cannot_fit_says_so(tmp_path, rpc_server, base_projector, pictures):
    proc = run_cli("chat", "--rpc", rpc_server.endpoint, "--mmproj", str(base_projector),
                   "--prompt", "hi", "--image", str(pictures["a.png"]), "--vision", "swap",
                   "--vram-budget", "50MiB", "--max-tokens", "4", "--threads", "2", timeout=120)
    assert proc.returncode == 2
    assert "swap is not possible" in proc.stderr and "Traceback" not in proc.stderr


def test_vision_off_on_off_never_reloads_the_model(rpc_server, base_projector, pictures):
    code = f"""
import json
from pathlib import Path
from engine.llama.devices import connect_rpc
from engine.models.default import default_model_path
from engine.llama.sampling import GenParams
from engine.session import Session, SessionConfig
connect_rpc("{rpc_server.endpoint}")
cfg = SessionConfig(default_model_path(), Path("{base_projector}"), n_ctx=1024, n_threads=2,
                    vision="resident", rpc=("{rpc_server.endpoint}",))
gp = GenParams(max_tokens=4, temperature=0)
with Session(cfg) as s:
    loads = [s.model.n_model_loads]
    s.set_vision(False); r1 = s.turn("hello", [], gp)
    s.set_vision(True); r2 = s.turn("look", ["{pictures['a.png']}"], gp)
    s.set_vision(False); r3 = s.turn("bye", [], gp)
    refused = s.turn("look again", ["{pictures['a.png']}"], gp)
    loads.append(s.model.n_model_loads)
print(json.dumps({{"loads": loads, "strategies": [r1.strategy, r2.strategy, r3.strategy],
                  "errors": [r1.error, r2.error, r3.error], "refused": refused.error}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["loads"] == [1, 1]
    assert out["strategies"] == ["none", "resident", "none"]
    assert out["errors"] == [None, None, None]
    assert "the projector is off" in out["refused"]


def test_bad_images_never_end_the_conversation(tmp_path, rpc_server, base_projector, pictures):
    (tmp_path / "notes.png").write_text("not an image")
    (tmp_path / "empty.jpg").write_bytes(b"")
    (tmp_path / "cut.png").write_bytes(pictures["a.png"].read_bytes()[:300])
    from PIL import Image

    Image.new("L", (8000, 7000), 0).save(tmp_path / "huge.png")  # 56 megapixels, tiny file
    turns = [{"text": "Look.", "images": ["notes.png"]},
             {"text": "And this?", "images": ["huge.png"]},
             {"text": "What is the capital of France? Answer in one word."},
             {"text": "And this?", "images": ["empty.jpg"]},
             {"text": "And this?", "images": ["cut.png"]},
             {"text": "And this?", "images": ["a.png"]}]
    out = _chat(rpc_server, base_projector, _script(tmp_path, pictures, turns), "--vision", "cpu")
    assert "not an image" in out[0]["error"]
    assert "megapixels" in out[1]["error"]
    assert "error" not in out[2] and "Paris" in out[2]["text"]
    assert "not an image" in out[3]["error"] and "damaged" in out[4]["error"]
    assert "error" not in out[5] and out[5]["strategy"] == "cpu"


def test_mismatched_projector_is_a_clear_error(tmp_path, pictures):
    from engine.synth.projector_gen import write_projector

    wide = write_projector(tmp_path / "wide.gguf", 1024, size="tiny")
    proc = run_cli("chat", "--mmproj", str(wide), "--prompt", "hi", "--image",
                   str(pictures["a.png"]), "--threads", "2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "1024" in proc.stderr and "576" in proc.stderr
