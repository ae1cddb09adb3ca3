"""The demo projector: made once for a model and kept in the cache beside it."""
from __future__ import annotations

from pathlib import Path

from engine.errors import EbbError
from engine.gguf.info import ModelInfo, model_info, read_gguf
from engine.models.default import sha256_file
from engine.paths import models_dir
from engine.synth.projector_gen import COLOUR_VERSION, write_colour_projector, write_projector


def default_projector_path(model: Path, size: str = "base", info: ModelInfo | None = None) -> Path:
    """The demo projector for `model` (`info`: its header, when read already), made once and
    kept in the cache: the colour projector (it names a picture's colour with the model's own
    words) when the model's vocabulary has the colour words, else one with random weights."""
    info = info or model_info(read_gguf(model))
    tag = sha256_file(model)[:12] if model.stat().st_size < 2**30 else f"{model.stat().st_size}"
    out = models_dir() / f"ebb-colour{COLOUR_VERSION}-mmproj-{size}-{info.n_embd}-{tag}.gguf"
    if out.exists():
        return out
    part = out.with_suffix(".part")
    try:
        write_colour_projector(part, model, size)
    except EbbError:  # no single-token colour words: a projector that exercises memory only
        out = models_dir() / f"ebb-synthetic-mmproj-{size}-{info.n_embd}.gguf"
        if out.exists():
            return out
        write_projector(part, info.n_embd, size=size, seed=0)
    part.replace(out)
    return out
