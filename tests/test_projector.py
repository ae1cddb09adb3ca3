"""Generated projectors are real mmproj files: mtmd loads them and encodes images."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from engine.gguf.info import projector_info, read_gguf
from engine.synth.projector_gen import write_projector
from engine.media.images import load_image
from engine.media.projector import ProjectorRuntime
from tests.helpers import N_THREADS, run_cli


@pytest.fixture(scope="module")
def photo(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "photo.png"
    rng = np.random.default_rng(3)
    Image.fromarray((rng.random((96, 128, 3)) * 255).astype(np.uint8)).save(path)
    return path


def test_make_projector_cli_tiny_is_kilobytes_and_marked_synthetic(tmp_path):
    out = tmp_path / "p.gguf"
    proc = run_cli("make-projector", "--for", "default", "--out", str(out), "--seed", "7")
    assert proc.returncode == 0, proc.stderr
    assert "random weights" in proc.stdout
    assert out.stat().st_size < 512 * 1024
    gf = read_gguf(out)
    assert gf.metadata["ebb.synthetic"] is True and gf.metadata["ebb.seed"] == 7
    assert "random weights" in gf.metadata["general.name"]


def test_same_seed_same_file_other_seed_other_weights(tmp_path):
    a = write_projector(tmp_path / "a.gguf", 576, seed=5)
    b = write_projector(tmp_path / "b.gguf", 576, seed=5)
    c = write_projector(tmp_path / "c.gguf", 576, seed=6)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_tiny_projector_encodes_an_image_to_model_width(text_runtime, tiny_projector, photo):
    with ProjectorRuntime(tiny_projector, text_runtime, n_threads=N_THREADS) as pr:
        [enc] = pr.encode(load_image(photo))  # an "mlp" image is one chunk
    assert enc.n_tokens == 4
    assert enc.embeddings.shape == (4, 576)
    assert np.isfinite(enc.embeddings).all() and enc.embeddings.std() > 0


# the large size: make test-slow (CI runs it); the base size stays in make test
@pytest.mark.parametrize("size,low_mb,high_mb", [("base", 80, 120),
                                                  pytest.param("large", 550, 650, marks=pytest.mark.slow)])
def test_base_and_large_sizes_and_compute_estimate(text_runtime, photo, tmp_path, size, low_mb, high_mb):
    path = write_projector(tmp_path / f"{size}.gguf", 576, size=size, seed=0)
    assert low_mb * 2**20 < path.stat().st_size < high_mb * 2**20
    info = projector_info(read_gguf(path))
    with ProjectorRuntime(path, text_runtime, n_threads=N_THREADS) as pr:
        [enc] = pr.encode(load_image(photo))
        measured = pr.compute_buffer_bytes
    assert enc.embeddings.shape == (info.n_image_tokens, 576)
    # mtmd on the CPU runs with flash attention on (auto): compare with that estimate.
    ratio = info.compute_buffer_bytes_estimate_flash_attn / measured
    print(f"\n{size}: encode {enc.encode_s:.2f}s on {N_THREADS} threads; compute buffer "
          f"measured {measured / 2**20:.2f} MiB, estimate/measured = {ratio:.3f}")
    assert 0.9 < ratio < 1.1
