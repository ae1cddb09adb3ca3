"""`inspect` on each family's projector: its family, mtmd's token count for a picture size (by
the family's own rule, worked out here independently), and a pair from different families or
widths refused before anything loads."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.synth.model_gen import ModelShape, write_model
from engine.synth.projector_gen import write_projector
from tests.helpers import run_cli

SHAPE = ModelShape(n_layers=1, n_embd=128, n_ff=256, n_head=2, n_head_kv=1)

# family: (family name shown, picture size, image tokens, chunks), from each family's rules:
# mlp a fixed (28/14)^2; gemma3 (64/8)^2 patches pooled 2x2; idefics3 a 2x2 grid of 32-pixel
# tiles of (32/8/2)^2 tokens plus the global view; qwen2.5vl one token per 16x16 pixels
# (8-pixel patches merged 2x2)
CASES = {
    "mlp": ("llava", (640, 480), 4, 1),
    "gemma3": ("gemma3", (640, 480), 16, 1),
    "idefics3": ("idefics3", (640, 640), 20, 5),
    "qwen2.5vl": ("qwen2.5-vl", (1024, 768), 3072, 1),
}


@pytest.fixture(scope="module")
def files(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    d = tmp_path_factory.mktemp("inspect-families")
    return {f: (write_model(d / f"lm-{f}.gguf", SHAPE, model_path, family=f),
                write_projector(d / f"mm-{f}.gguf", SHAPE.n_embd, family=f)) for f in CASES}


@pytest.mark.parametrize("family", CASES)
def test_inspect_reports_family_tokens_and_mtmd_reserve(files, family):
    lm, mm = files[family]
    name, (w, h), tokens, chunks = CASES[family]
    proc = run_cli("inspect", str(lm), "--mmproj", str(mm), "--image-size", f"{w}x{h}", "--json")
    assert proc.returncode == 0, proc.stderr
    p = json.loads(proc.stdout)["projector"]
    assert p["family"] == name
    assert (p["n_image_tokens"], p["n_image_chunks"]) == (tokens, chunks)
    assert p["compute_buffer_bytes"] == p["compute_buffer_bytes_measured"] > 0
    human = run_cli("inspect", str(lm), "--mmproj", str(mm), "--image-size", f"{w}x{h}").stdout
    assert f"family       {name}" in human and f"image tokens {tokens} for a {w}x{h} picture" in human


def test_a_pair_from_two_families_is_refused_naming_both(files, pictures):
    qwen_lm, _ = files["qwen2.5vl"]
    _, gemma_mm = files["gemma3"]
    proc = run_cli("chat", "--model", str(qwen_lm), "--mmproj", str(gemma_mm), "--prompt", "hi")
    assert proc.returncode == 2
    assert "mm-gemma3.gguf (gemma3)" in proc.stderr and "lm-qwen2.5vl.gguf (qwen2vl)" in proc.stderr
    # an M-RoPE model with a projector that does not place images in M-RoPE positions
    llava_lm, llava_mm = files["mlp"]
    proc = run_cli("inspect", str(qwen_lm), "--mmproj", str(llava_mm))
    assert proc.returncode == 2 and "M-RoPE" in proc.stderr
    # a model without the family's special tokens: llama.cpp would look them up and miss
    proc = run_cli("chat", "--model", str(llava_lm), "--mmproj", str(files["idefics3"][1]),
                   "--prompt", "hi", "--image", str(pictures["a.png"]))
    assert proc.returncode == 2 and "lacks the special tokens that idefics3 projectors" in proc.stderr
