"""GGUF models found on this machine: the folders looked in, the models in them (a split
model once, by its first part; projectors left out) and the projectors beside a model, by
their names (the headers are read later, by whoever pairs them: engine/gguf/info.py)."""
from __future__ import annotations

import os
import re
from pathlib import Path


def model_folders(extra: list[str]) -> list[Path]:
    """Where models are looked for: Ebb's own cache (the default model), LM Studio's and
    Hugging Face's caches, and the folders the user added."""
    from engine.paths import models_dir

    home = Path.home()
    hf = Path(os.environ.get("HF_HOME", home / ".cache" / "huggingface")) / "hub"
    return [models_dir(), home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models",
            hf, *(Path(e) for e in extra)]


def find_models(folders: list[Path], limit: int = 500) -> list[Path]:
    out: list[Path] = []
    for folder in folders:
        if not folder.is_dir():
            continue
        for p in folder.rglob("*.gguf"):
            split = re.search(r"-(\d{5})-of-\d{5}\.gguf$", p.name)
            if not is_projector_name(p) and (split is None or int(split[1]) == 1):
                out.append(p)  # a split model once, by its first part (llama.cpp finds the rest)
            if len(out) >= limit:
                return out
    return out


_PARTS = re.compile(r"^(?P<stem>.+)-00001-of-(?P<count>\d{5})\.gguf$")


def model_bytes(model: Path) -> int:
    """A model's size on disk: a split model's parts together (those that are there), by their
    names; an OSError when the file itself is gone."""
    size = model.stat().st_size
    m = _PARTS.match(model.name)
    if m is None:
        return size
    for i in range(2, int(m["count"]) + 1):
        try:
            size += model.with_name(f"{m['stem']}-{i:05d}-of-{m['count']}.gguf").stat().st_size
        except OSError:
            continue
    return size


def is_projector_name(path: Path) -> bool:
    """mmproj-*.gguf, or a model's own name with mmproj in it (Qwen2.5-VL-7B-mmproj-f16.gguf)."""
    return "mmproj" in path.name.lower()


def projectors_beside(model: Path) -> list[Path]:
    return sorted(p for p in model.parent.glob("*.gguf") if is_projector_name(p))
