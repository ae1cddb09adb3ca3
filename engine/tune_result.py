"""Autotune's result as data: what it measured at each layer count, what it chose, and its
JSON both ways. The one place that reads `ebb-engine autotune --json` (the CLI's --tuning
file, Tune's "Use these", the settings it writes); `engine/measure/autotune.py` measures."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from engine.config import PhaseTuning

# within FA_TIE of each other the flash attention setting asked for stays (on by default:
# smaller buffers)
FA_TIE = 0.03


def _per_threads(d: Any) -> dict[int, float]:
    return {int(t): float(v) for t, v in (d or {}).items()}


@dataclass(frozen=True)
class Point:
    layers: int
    prompt_tps: float  # at the best thread count for prompts
    gen_tps: float  # at the best thread count for generation
    load_s: float
    accel_bytes: int
    prompt_threads: int = 0
    gen_threads: int = 0
    # every thread count measured at this layer count: tokens/s per phase
    prompt_tps_by_threads: dict[int, float] = field(default_factory=dict)
    gen_tps_by_threads: dict[int, float] = field(default_factory=dict)
    # a prompt as long as the projector's image tokens (0: not measured), at prompt_threads
    image_tps: float = 0.0
    image_tps_by_threads: dict[int, float] = field(default_factory=dict)

    def prompt_tps_at(self, threads: int, kind: str = "prompt") -> float:
        """Prompt (or image batch) tokens/s at `threads`; the best measured when that count
        was not."""
        per, best = ((self.image_tps_by_threads, self.image_tps) if kind == "image"
                     else (self.prompt_tps_by_threads, self.prompt_tps))
        return per.get(threads) or best

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = asdict(self)
        d["prompt_tps"] = round(self.prompt_tps, 1)
        d["gen_tps"] = round(self.gen_tps, 2)
        d["load_s"] = round(self.load_s, 3)
        d["prompt_tps_by_threads"] = {str(t): round(v, 1) for t, v
                                      in sorted(self.prompt_tps_by_threads.items())}
        d["gen_tps_by_threads"] = {str(t): round(v, 2) for t, v
                                   in sorted(self.gen_tps_by_threads.items())}
        if self.image_tps:
            d["image_tps"] = round(self.image_tps, 1)
            d["image_tps_by_threads"] = {str(t): round(v, 1) for t, v
                                         in sorted(self.image_tps_by_threads.items())}
        else:
            del d["image_tps"], d["image_tps_by_threads"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Point:
        """JSON keys are strings; the thread counts come back as ints."""
        prompt, gen, image = (_per_threads(d.get(f"{k}_tps_by_threads")) for k in ("prompt", "gen", "image"))
        return cls(int(d["layers"]), float(d.get("prompt_tps") or max(prompt.values(), default=0.0)),
                   float(d.get("gen_tps") or max(gen.values(), default=0.0)),
                   float(d.get("load_s") or 0.0), int(d.get("accel_bytes") or 0),
                   int(d.get("prompt_threads") or 0), int(d.get("gen_threads") or 0), prompt, gen,
                   float(d.get("image_tps") or max(image.values(), default=0.0)), image)


@dataclass(frozen=True)
class FlashChoice:
    on: bool  # flash attention on for this device
    layers: int  # measured at (the best generation layer count)
    fill: int  # tokens of history cached in each run
    turn_s_on: float  # the faster of the runs with it on (0: not run, it does not fit)
    turn_s_off: float
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"on": self.on, "layers": self.layers, "fill": self.fill,
                "turn_s_on": round(self.turn_s_on, 4), "turn_s_off": round(self.turn_s_off, 4),
                "reason": self.reason}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FlashChoice:
        return cls(bool(d["on"]), int(d.get("layers") or 0), int(d.get("fill") or 0),
                   float(d.get("turn_s_on") or 0.0), float(d.get("turn_s_off") or 0.0),
                   str(d.get("reason") or ""))

    @staticmethod
    def decide(on_s: float, off_s: float, asked: bool, tie: float = FA_TIE) -> bool:
        """Pure: the faster setting; within `tie` of each other, the one asked for."""
        if not on_s or not off_s:
            return bool(on_s) or not off_s and asked
        if abs(on_s - off_s) <= tie * min(on_s, off_s):
            return asked
        return on_s < off_s


@dataclass(frozen=True)
class TuneResult:
    device: str
    budget_bytes: int
    headroom_bytes: int
    max_layers: int
    best_gen_layers: int
    best_prompt_layers: int
    points: tuple[Point, ...]
    cliff_gen_layers: int | None
    cliff_prompt_layers: int | None
    image_tokens: int = 0  # the image batch measured (0: none)
    best_image_layers: int | None = None
    cliff_image_layers: int | None = None
    flash_attn: FlashChoice | None = None  # None: not chosen by measurement
    # other work that ran beside the measurement (the machine's runnable tasks besides the
    # tuning's, median over its points; None: not known): the choice is for that load
    busy_beside: float | None = None

    def load_words(self) -> str:
        """"measured on an idle machine" / "measured with about 2 other busy tasks beside it":
        the load the choice was made under (Tune and the threads it picks are for that)."""
        if self.busy_beside is None:
            return ""
        if self.busy_beside < 0.5:
            return "measured on an otherwise idle machine"
        n = round(self.busy_beside)
        return (f"measured with about {n} other busy task{'' if n == 1 else 's'} beside it: "
                "the threads chosen suit that load (Tune again when the machine is quieter)")

    def point(self, layers: int) -> Point:
        return next(p for p in self.points if p.layers == layers)

    @property
    def best_gen_threads(self) -> int:
        return self.point(self.best_gen_layers).gen_threads

    @property
    def best_prompt_threads(self) -> int:
        return self.point(self.best_prompt_layers).prompt_threads

    def prompt_speeds(self, kind: str = "prompt") -> dict[int, float]:
        """Prompt (or image batch) tokens/s at each layer count measured, at the prompt's best
        thread count: what prices moving a prompt to its own placement."""
        threads = self.best_prompt_threads
        return {p.layers: p.prompt_tps_at(threads, kind) for p in self.points
                if kind != "image" or p.image_tps}

    def phase_tuning(self) -> PhaseTuning:
        """The per-phase choice a session runs with."""
        speeds, gen, prompt = self.prompt_speeds(), self.best_gen_layers, self.best_prompt_layers
        images = self.prompt_speeds("image")
        image = self.best_image_layers
        return PhaseTuning(gen, prompt, self.best_gen_threads, self.best_prompt_threads,
                           speeds[gen], speeds[prompt],
                           *((image, images.get(gen, 0.0), images.get(image, 0.0)) if image is not None
                             else (-1, 0.0, 0.0)))

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device, "vram_budget_bytes": self.budget_bytes,
            "headroom_bytes": self.headroom_bytes, "max_layers": self.max_layers,
            "best_gen_layers": self.best_gen_layers,
            "best_prompt_layers": self.best_prompt_layers,
            "best_gen_tps": round(self.point(self.best_gen_layers).gen_tps, 2),
            "best_prompt_tps": round(self.point(self.best_prompt_layers).prompt_tps, 1),
            "best_gen_threads": self.best_gen_threads,
            "best_prompt_threads": self.best_prompt_threads,
            "threads_searched": sorted({t for p in self.points for t in p.gen_tps_by_threads}),
            "cliff_gen_layers": self.cliff_gen_layers,
            "cliff_prompt_layers": self.cliff_prompt_layers,
            "n_runs": len(self.points),
            **({"image_tokens": self.image_tokens, "best_image_layers": self.best_image_layers,
                "best_image_tps": round(self.point(self.best_image_layers).image_tps, 1),
                "cliff_image_layers": self.cliff_image_layers}
               if self.best_image_layers is not None else {}),
            "points": [p.to_dict() for p in sorted(self.points, key=lambda p: p.layers)],
            **({"flash_attn": self.flash_attn.to_dict()} if self.flash_attn is not None else {}),
            **({"busy_beside": round(self.busy_beside, 2)} if self.busy_beside is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TuneResult:
        """`ebb-engine autotune --json` read back. KeyError, ValueError or TypeError when it is
        not autotune's JSON."""
        points = tuple(Point.from_dict(p) for p in d["points"])
        by_layers = {p.layers: p for p in points}
        gen, prompt = int(d["best_gen_layers"]), int(d["best_prompt_layers"])
        # the best counts' threads come with their points; a file without them says them here
        for layers, key, name in ((gen, "best_gen_threads", "gen_threads"),
                                  (prompt, "best_prompt_threads", "prompt_threads")):
            p = by_layers[layers]
            if not getattr(p, name) and d.get(key):
                by_layers[layers] = p = Point(**{**asdict(p), name: int(d[key])})
        image = d.get("best_image_layers")
        fa = d.get("flash_attn")
        return cls(str(d.get("device") or ""), int(d.get("vram_budget_bytes") or 0),
                   int(d.get("headroom_bytes") or 0), int(d.get("max_layers") or max(by_layers)),
                   gen, prompt, tuple(by_layers[p.layers] for p in points),
                   _opt_int(d.get("cliff_gen_layers")), _opt_int(d.get("cliff_prompt_layers")),
                   int(d.get("image_tokens") or 0), _opt_int(image),
                   _opt_int(d.get("cliff_image_layers")),
                   FlashChoice.from_dict(fa) if fa else None,
                   float(d["busy_beside"]) if d.get("busy_beside") is not None else None)


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)
