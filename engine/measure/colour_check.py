"""The demo's own check (`ebb-engine colour-check`): the colour projector names each of its six
colours, in shades across each colour's range, with this machine's arithmetic (its CPU, its
ggml CPU variant, the thread count and batch size given), and the margin it names them by.

The margin is a logit gap: where the reply names its first colour, the logprob of the right
colour's word less that of the best wrong colour's among the top candidates (when no wrong
colour is among them, less the lowest candidate's: the real gap is wider still). Logprobs share
one normaliser, so their difference is the logits' difference. The engine's worker thread or
a command's main thread calls it; it owns its Session.
"""
from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import EbbError
from engine.events import Logprob
from engine.synth.projector_gen import COLOURS

QUESTION = "What colour is this picture? Answer with one word."
TOP_CANDIDATES = 20
RGB = tuple[int, int, int]
# shades a user would call each colour, from the pure one to dark, light and muted ones
SHADES: dict[str, tuple[RGB, ...]] = {
    "red": ((220, 20, 30), (255, 0, 0), (150, 10, 10), (240, 80, 60), (180, 40, 50)),
    "green": ((20, 200, 40), (0, 128, 0), (34, 139, 34), (90, 210, 90), (0, 255, 0)),
    "blue": ((20, 30, 220), (0, 0, 139), (65, 105, 225), (0, 0, 255), (30, 80, 200)),
    "yellow": ((240, 230, 20), (255, 215, 0), (200, 190, 0), (250, 240, 80), (255, 255, 0)),
    "black": ((5, 5, 5), (0, 0, 0), (40, 35, 30), (60, 60, 60), (20, 20, 25)),
    "white": ((250, 250, 250), (245, 245, 240), (235, 235, 235), (255, 255, 255), (200, 200, 200)),
}


@dataclass(frozen=True)
class ShadeAnswer:
    colour: str  # the colour the picture is
    rgb: RGB
    text: str  # the reply
    named: str | None  # the first colour the reply names
    gap: float  # the logit gap where it names it (0 when it names none, negative when wrong)


@dataclass(frozen=True)
class ColourReport:
    answers: tuple[ShadeAnswer, ...]
    n_threads: int
    n_batch: int

    @property
    def wrong(self) -> list[ShadeAnswer]:
        return [a for a in self.answers if a.named != a.colour]

    @property
    def smallest_gap(self) -> float:
        return min(a.gap for a in self.answers)

    def to_dict(self) -> dict[str, Any]:
        return {"n_threads": self.n_threads, "n_batch": self.n_batch,
                "n_pictures": len(self.answers), "n_wrong": len(self.wrong),
                "smallest_gap": round(self.smallest_gap, 3),
                "answers": [{"colour": a.colour, "rgb": list(a.rgb), "named": a.named,
                             "gap": round(a.gap, 3), "text": a.text} for a in self.answers]}


def _side(text: str, colour: str) -> str:
    """"right" when the reply's word so far can only be `colour`, "wrong" when it can only be
    another colour, "open" when it begins more than one ("Bl": black or blue), "" otherwise."""
    word = text.strip().lower()
    starts = {c for c in COLOURS if c.startswith(word)} if word.isalpha() else set()
    if len(starts) > 1:
        return "open"
    if starts == {colour}:
        return "right"
    return "wrong" if starts else ""


def named_and_gap(logprobs: Sequence[Logprob], colour: str) -> tuple[str | None, float]:
    """The first colour the reply names and its logit gap (see the module's docstring), read
    at the token that decides the word. A reply that names no colour: (None, 0.0)."""
    prefix = ""  # the start of a word that could still be more than one colour
    for entry in logprobs:
        text = prefix + entry.token
        side = _side(text, colour)
        if side in ("", "open"):
            prefix = text if side == "open" else ""
            continue
        tops = entry.top or (entry,)
        sides = [(_side(prefix + t.token, colour), t.logprob) for t in tops]
        right = [lp for sd, lp in sides if sd == "right"]
        wrong = [lp for sd, lp in sides if sd == "wrong"]
        floor = min(lp for _, lp in sides)
        gap = (max(right) if right else floor) - (max(wrong) if wrong else floor)
        word = text.strip().lower()
        return next(c for c in COLOURS if c.startswith(word)), gap
    return None, 0.0


def check_colours(model: Path, projector: Path, n_threads: int, n_batch: int = 512,
                  shades: Mapping[str, Sequence[RGB]] = SHADES) -> ColourReport:
    """Ask about one solid picture per shade, each in a new conversation, greedy, encoded on
    the CPU (the check is of this CPU's arithmetic)."""
    from PIL import Image

    from engine.config import SessionConfig
    from engine.llama.sampling import GenParams
    from engine.session import Session

    cfg = SessionConfig(model, projector, n_ctx=1024, n_threads=n_threads, n_batch=n_batch,
                        vision="cpu")
    gp = GenParams(max_tokens=8, temperature=0, top_logprobs=TOP_CANDIDATES)
    answers = []
    with tempfile.TemporaryDirectory(prefix="ebb-colours-") as tmp, Session(cfg) as s:
        for colour, rgbs in shades.items():
            for rgb in rgbs:
                picture = Path(tmp) / f"{colour}-{'-'.join(map(str, rgb))}.png"
                Image.new("RGB", (300, 200), rgb).save(picture)
                s.set_history([])  # a new conversation per picture
                res = s.turn(QUESTION, [picture], gp)
                if res.error is not None:
                    raise EbbError(f"the colour check could not ask about {colour}: {res.error}")
                named, gap = named_and_gap(res.gen.logprobs or (), colour)
                answers.append(ShadeAnswer(colour, tuple(rgb), res.text, named, gap))  # type: ignore[arg-type]
    return ColourReport(tuple(answers), n_threads, n_batch)
