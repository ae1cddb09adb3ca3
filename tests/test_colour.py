"""The colour projector: closed-form weights that map a picture's mean colour onto the model's
own word for it. SmolLM2-135M names the colour of a solid picture from it, so the right
answer is a semantic check that a strategy delivered the right picture to the model (not just
the same bytes as another strategy)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from PIL import Image

from engine.gguf.projector_gen import COLOURS, write_colour_projector
from engine.llama.runtime import GenParams
from engine.session import Session, SessionConfig
from tests.conftest import N_THREADS

QUESTION = "What colour is this picture? Answer with one word."
RGB = {"red": (220, 20, 30), "green": (20, 200, 40), "blue": (20, 30, 220),
       "yellow": (240, 230, 20), "black": (5, 5, 5), "white": (250, 250, 250)}


def first_colour(text: str) -> str | None:
    return next((w for w in re.findall(r"[a-z]+", text.lower()) if w in COLOURS), None)


@pytest.fixture(scope="module")
def colour_projector(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_colour_projector(tmp_path_factory.mktemp("colour") / "colour.gguf", model_path)


@pytest.fixture(scope="module")
def solids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("solids")
    out = {}
    for name, rgb in RGB.items():
        out[name] = d / f"{name}.png"
        Image.new("RGB", (300, 200), rgb).save(out[name])
    return out


def _answers(cfg: SessionConfig, solids: dict[str, Path], names: list[str]) -> dict[str, str]:
    """One new conversation per picture; every turn must have encoded with `cfg.vision`."""
    out = {}
    with Session(cfg) as s:
        for name in names:
            s.set_history([])  # a new conversation per picture
            res = s.turn(QUESTION, [solids[name]], GenParams(max_tokens=12, temperature=0))
            assert res.error is None, res.error
            assert res.strategy == cfg.vision and res.n_images_encoded == 1
            if cfg.vision == "swap":
                assert res.swap_mover == cfg.mover
            out[name] = res.text
    return out


def test_colour_projector_names_the_colour_on_the_cpu(model_path, colour_projector, solids):
    answers = _answers(SessionConfig(model_path, colour_projector, n_ctx=1024,
                                     n_threads=N_THREADS, vision="cpu"), solids, list(RGB))
    named = {name: first_colour(text) for name, text in answers.items()}
    print("\n" + "\n".join(f"{n}: {a!r}" for n, a in answers.items()))
    assert named == {name: name for name in RGB}, answers


@pytest.mark.parametrize("vision,mover", [("cpu", "auto"), ("resident", "auto"),
                                          ("swap", "live"), ("swap", "reload")])
def test_every_strategy_delivers_the_right_picture(model_path, colour_projector, solids,
                                                   shared_rpc_server, vision, mover):
    cfg = SessionConfig(model_path, colour_projector, n_ctx=1024, n_threads=N_THREADS,
                        vision=vision, mover=mover, rpc=(shared_rpc_server.endpoint,))
    answers = _answers(cfg, solids, ["red", "blue"])
    assert {n: first_colour(t) for n, t in answers.items()} == {"red": "red", "blue": "blue"}, answers
