"""The colour projector: closed-form weights that map a picture's colour onto a phrase in the
model's own words. SmolLM2-135M names the colour of a solid picture from it, so the right
answer is a semantic check that a strategy delivered the right picture to the model (not just
the same bytes as another strategy)."""
from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from engine.measure.colour_check import QUESTION, SHADES, check_colours, named_and_gap
from engine.llama.sampling import GenParams
from engine.session import Session, SessionConfig
from tests.helpers import N_THREADS, first_colour

RGB = {colour: shades[0] for colour, shades in SHADES.items()}


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


def _named_every_shade(report) -> None:
    print(f"\n{report.n_threads} threads, batch {report.n_batch}: {len(report.answers)} pictures, "
          f"smallest logit gap {report.smallest_gap:.2f}")
    assert report.wrong == [], [(a.colour, a.rgb, a.text) for a in report.wrong]
    assert report.smallest_gap > 1.0  # a margin no CPU's rounding comes near


def test_the_demo_projector_names_every_shade_on_this_cpu(model_path):
    """The projector `make run` opens, every shade of each colour, with the suite's threads."""
    from engine.synth.demo import default_projector_path

    _named_every_shade(check_colours(model_path, default_projector_path(model_path), N_THREADS))


@pytest.mark.parametrize("n_threads,n_batch", [(1, 512), (3, 512), (N_THREADS, 7)])
def test_the_demo_names_colours_with_other_threads_and_batches(model_path, n_threads, n_batch):
    """Other thread counts and a batch smaller than a picture's tokens split the arithmetic
    differently; two shades of each colour (the pure one and a dark or light one)."""
    from engine.synth.demo import default_projector_path

    two = {colour: (shades[0], shades[2]) for colour, shades in SHADES.items()}
    _named_every_shade(check_colours(model_path, default_projector_path(model_path), n_threads,
                                     n_batch, shades=two))


def test_a_colour_is_named_by_the_first_token_that_can_only_begin_it():
    """The logit gap's arithmetic: "B" could begin black or blue, so the gap is read where the
    reply's word is decided; with no wrong colour among the candidates, the lowest one bounds
    the gap from below."""
    from engine.events import Logprob

    def entry(token, logprob, *others):
        return Logprob(token, logprob, tuple(token.encode()), (Logprob(token, logprob, ()), *(
            Logprob(t, lp, ()) for t, lp in others)))

    reply = [entry("This", -0.1, (" The", -2.0)), entry(" Bl", -0.2, (" B", -1.5)),
             entry("ue", -0.3, ("ack", -2.5), ("ossom", -4.0))]
    assert named_and_gap(reply, "blue") == ("blue", pytest.approx(2.2))  # decided at "ue"
    reply = [entry(" blue", -0.2, (" black", -3.0), (" red", -3.5))]
    assert named_and_gap(reply, "blue") == ("blue", pytest.approx(2.8))
    assert named_and_gap(reply, "black") == ("blue", pytest.approx(-2.8))
    reply = [entry(" white", -0.1, (" bright", -5.0))]
    assert named_and_gap(reply, "white") == ("white", pytest.approx(4.9))
    assert named_and_gap([entry("Hello", -0.1)], "red") == (None, 0.0)


@pytest.mark.parametrize("vision,mover", [("cpu", "auto"), ("resident", "auto"),
                                          ("swap", "live"), ("swap", "reload")])
def test_every_strategy_delivers_the_right_picture(model_path, colour_projector, solids,
                                                   shared_rpc_server, vision, mover):
    cfg = SessionConfig(model_path, colour_projector, n_ctx=1024, n_threads=N_THREADS,
                        vision=vision, mover=mover, rpc=(shared_rpc_server.endpoint,))
    answers = _answers(cfg, solids, ["red", "blue"])
    assert {n: first_colour(t) for n, t in answers.items()} == {"red": "red", "blue": "blue"}, answers
