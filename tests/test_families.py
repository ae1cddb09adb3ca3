"""Real vision-language families against llama.cpp's own multimodal pipeline.

For every family the generator makes (tiny random-weight pairs in llama.cpp's real layouts),
Ebb's greedy reply must be llama.cpp's (`mtmd_tokenize` on the whole prompt +
`mtmd_helper_eval_chunks`, tests/mtmd_reference.py) token for token wherever the model decided
it: one image, two images in one message, and a turn whose images are earlier in the
conversation (cached, reused from the KV cache). Ebb's later turns reuse the cache where the
reference evaluates the whole prompt, so the two are compared DECIDED (tests/helpers.py); each
conversation runs twice, and a reply that changes between the two runs (SAME PATH) is a
failure. On the RPC device, every strategy and mover gives the same replies where decided (the
picture is encoded on the CPU or on the device).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.gguf.families import GENERATED as FAMILIES
from engine.synth.model_gen import ModelShape, write_model
from engine.synth.projector_gen import write_projector
from engine.llama.sampling import GenParams
from engine.session import Session, SessionConfig
from engine.media.projector import probe_projector
from tests.helpers import N_THREADS, agree_turn_by_turn, margin, run_cli
from tests.mtmd_reference import reference_reply

SHAPE = ModelShape(n_layers=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_ctx_train=4096)
N_REPLY = 12
TURNS = [("What is in this picture?", ["a.png"]),
         ("And these two? Compare them.", ["b.jpg", "a.png"]),
         ("Which one did you like?", [])]


@pytest.fixture(scope="module")
def pairs(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    d = tmp_path_factory.mktemp("families")
    return {f: (write_model(d / f"lm-{f}.gguf", SHAPE, model_path, seed=2, family=f),
                write_projector(d / f"mm-{f}.gguf", SHAPE.n_embd, seed=3, family=f))
            for f in FAMILIES}


def _conversation(lm: Path, mm: Path, pictures: dict[str, Path]) -> list[tuple[str, str, list[Path], dict]]:
    """Ebb's replies to TURNS (greedy, CPU), with each turn's templated prompt and images."""
    out = []
    gp = GenParams(max_tokens=N_REPLY, temperature=0, top_logprobs=2)
    with Session(SessionConfig(lm, mm, n_ctx=2048, n_threads=N_THREADS, vision="cpu", flash_attn=True)) as s:
        seen: list[Path] = []
        for text, names in TURNS:
            images = [pictures[n] for n in names]
            res = s.turn(text, images, gp)
            assert res.error is None, res.error
            seen += images
            assert s.model.runtime is not None
            prompt, _ = s.model.runtime.format_chat(s.messages[:-1])  # up to this user turn
            out.append((res.text, prompt, list(seen), res.to_dict()))
    return out



@pytest.mark.numerics
@pytest.mark.parametrize("family", FAMILIES)
def test_family_equals_llama_cpp_and_repeats(family, pairs, pictures):
    """DECIDED against llama.cpp's own pipeline (another program and path); SAME PATH between
    two runs of the same conversation (their replies equal)."""
    lm, mm = pairs[family]
    first = _conversation(lm, mm, pictures)
    again = _conversation(lm, mm, pictures)
    assert [t[0] for t in again] == [t[0] for t in first], "a greedy reply changed between runs"
    margins = []
    refs = []
    for text, prompt, images, _ in first:
        ref, steps = reference_reply(lm, mm, prompt, images, N_REPLY, n_threads=N_THREADS)
        margins += [margin(e) for e in steps]
        refs.append(steps)
    compared = agree_turn_by_turn([t[3] for t in first], [{"logprobs": r} for r in refs])
    # the images reach the model: another picture, another reply
    with Session(SessionConfig(lm, mm, n_ctx=2048, n_threads=N_THREADS, vision="cpu", flash_attn=True)) as s:
        other = s.turn(TURNS[0][0], [pictures["b.jpg"]], GenParams(max_tokens=N_REPLY, temperature=0))
    assert other.text != first[0][0]
    # the turn encoded what mtmd counts for these pictures (every chunk of a sliced image)
    probe_a = probe_projector(mm, lm, _size(pictures["a.png"]), N_THREADS)
    probe_b = probe_projector(mm, lm, _size(pictures["b.jpg"]), N_THREADS)
    turn0, turn1 = first[0][3], first[1][3]
    assert turn0["n_image_tokens_encoded"] == probe_a.image_tokens
    assert turn1["n_image_tokens_encoded"] == probe_b.image_tokens  # a.png comes from the cache
    assert (turn1["n_images_encoded"], turn1["n_images_cached"]) == (1, 1)
    assert first[2][3]["n_images"] == 0 and first[2][3]["n_image_tokens_encoded"] == 0
    print(f"\n{family}: {len(margins)} greedy steps, {compared} decided and compared; "
          f"smallest top-1/top-2 logit margin {min(margins):.3f}, median "
          f"{sorted(margins)[len(margins) // 2]:.3f}")


def _size(path: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as im:
        return im.size


@pytest.mark.parametrize("family", FAMILIES)
def test_strategies_and_movers_agree_on_rpc(family, pairs, pictures, rpc_server, tmp_path):
    lm, mm = pairs[family]
    script = tmp_path / "script.json"
    script.write_text(json.dumps([{"text": t, "images": [str(pictures[n]) for n in names]}
                                  for t, names in TURNS]))
    runs = {}
    for label, extra in (("cpu", ["--vision", "cpu"]), ("resident", ["--vision", "resident"]),
                         ("swap-live", ["--vision", "swap", "--mover", "live"]),
                         ("swap-reload", ["--vision", "swap", "--mover", "reload"])):
        proc = run_cli("chat", "--model", str(lm), "--mmproj", str(mm), "--rpc",
                       rpc_server.endpoint, "--script", str(script), "--temp", "0",
                       "--max-tokens", str(N_REPLY), "--ctx", "2048", "--threads",
                       str(N_THREADS), "--json", "--top-logprobs", "2", *extra, timeout=300)
        assert proc.returncode == 0, proc.stderr
        turns = [json.loads(line) for line in proc.stdout.splitlines()]
        assert all("error" not in t for t in turns), turns
        runs[label] = turns
    assert [t["strategy"] for t in runs["swap-live"]] == ["swap", "swap", "none"]
    assert runs["swap-live"][0]["swap_mover"] == "live"
    assert runs["swap-reload"][0]["swap_mover"] == "reload"
    for label in ("resident", "swap-live", "swap-reload"):
        agree_turn_by_turn(runs[label], runs["cpu"])


def test_qwen_swap_keeps_the_budget(pairs, pictures, rpc_server, tmp_path):
    """A Qwen2.5-VL pair under a budget that cannot hold the model beside the projector (mtmd
    reserves ~416 MiB of compute for its window attention): the swap keeps the budget, with
    the mover that can make the room, and replies as the CPU does where decided."""
    lm, mm = pairs["qwen2.5vl"]
    budget = 450 * 2**20
    script = tmp_path / "script.json"
    script.write_text(json.dumps([{"text": t, "images": [str(pictures[n]) for n in names]}
                                  for t, names in TURNS]))
    runs = {}
    for vision in ("swap", "cpu"):
        proc = run_cli("chat", "--model", str(lm), "--mmproj", str(mm), "--rpc",
                       rpc_server.endpoint, "--script", str(script), "--temp", "0",
                       "--max-tokens", str(N_REPLY), "--ctx", "2048", "--threads", str(N_THREADS),
                       "--vram-budget", "450MiB", "--vision", vision, "--json",
                       "--top-logprobs", "2", timeout=300)
        assert proc.returncode == 0, proc.stderr
        runs[vision] = [json.loads(line) for line in proc.stdout.splitlines()]
    swap = runs["swap"]
    assert [t["strategy"] for t in swap] == ["swap", "swap", "none"]
    assert swap[0]["swap_mover"] == "reload" and "live mover cannot make room" in swap[0]["reason"]
    assert all(t["device_peak_bytes"]["RPC0"] <= budget for t in swap)
    agree_turn_by_turn(swap, runs["cpu"])
