"""What a saved reply keeps of how it was made: the line under it in the transcript, whether
Continue may go on with it, which messages the model still remembered, which model wrote it (an
export says). Typed here; JSON only in the store's `stats` column (`to_json` / `from_json`,
which reads every row written before, with its missing or null figures). Qt-free.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from engine.events import SWAP_STEPS, TurnResult


@dataclass
class ReplyStats:
    n_gen_tokens: int = 0
    gen_tokens_per_s: float = 0.0
    prompt_s: float = 0.0  # the prompt's time (a continued reply: every part's, summed)
    stop_reason: str = ""  # a StopReason's value; "" when the turn never decoded
    n_reply_tokens: int | None = None  # Continue: the engine's count of the whole reply
    n_prompt_tokens: int = 0
    n_prompt_tokens_evaluated: int = 0
    n_prompt_tokens_restored: int = 0  # taken from a kept state of the conversation
    model: str = ""  # the model file's name
    flash_attn: bool | None = None  # None: not known (a reply saved before it was said)
    strategy: str = ""  # how its pictures were encoded (swap, resident, cpu; "none")
    n_images: int = 0  # the message's attachments
    n_turns_dropped: int = 0  # to fit: older messages and images that left the model's memory
    n_images_dropped: int = 0
    n_tokens_dropped: int = 0
    memory_starts_at: int = 0  # the conversation's first message (by place) still remembered
    device_notes: tuple[str, ...] = ()  # what the device could not hold, and where it ran
    seed: int | None = None  # the draw it sampled with (None: greedy or not known)
    seed_fixed: bool = False  # fixed in Chat settings: Regenerate repeats it
    encode_s: float = 0.0
    swap_s: float = 0.0
    continued: int = 0  # times Continue grew it
    edited: bool = False  # written by the user (an edited version of a reply)
    memory_from: int | None = None  # the first message (by id) the model still remembered
    # why the store refused it (a full disk): shown with the reply until it is written; never
    # stored itself
    unsaved: str = field(default="", compare=False)

    @classmethod
    def from_turn(cls, r: TurnResult, model: str = "", seed: int | None = None,
                  seed_fixed: bool = False) -> ReplyStats:
        g = r.gen
        return cls(
            n_gen_tokens=g.n_gen_tokens, gen_tokens_per_s=round(g.gen_tokens_per_s, 2),
            prompt_s=round(g.prompt_s, 4), stop_reason=str(g.stop_reason or ""),
            n_reply_tokens=g.n_reply_tokens, n_prompt_tokens=g.n_prompt_tokens,
            n_prompt_tokens_evaluated=g.n_prompt_tokens_evaluated,
            n_prompt_tokens_restored=g.n_prompt_tokens_restored, model=model,
            flash_attn=g.flash_attn, strategy=r.strategy, n_images=r.n_images,
            n_turns_dropped=r.n_turns_dropped, n_images_dropped=r.n_images_dropped,
            n_tokens_dropped=r.n_tokens_dropped, memory_starts_at=r.memory_starts_at,
            device_notes=tuple(r.device_notes), seed=seed, seed_fixed=seed_fixed,
            encode_s=sum(s.end_s - s.start_s for s in r.spans if s.name == "encode"),
            swap_s=sum(s.end_s - s.start_s for s in r.spans if s.name in SWAP_STEPS))

    def continued_by(self, more: ReplyStats) -> ReplyStats:
        """This reply grown by Continue's `more`: its tokens and times summed, the newest
        speed, stop and draw."""
        n = self.n_gen_tokens + more.n_gen_tokens
        if more.n_reply_tokens:  # the engine counted the whole reply (an interrupted one had none)
            n = max(n, more.n_reply_tokens)
        drawn = more.seed is not None
        return replace(self, n_gen_tokens=n, encode_s=self.encode_s + more.encode_s,
                       swap_s=self.swap_s + more.swap_s, prompt_s=self.prompt_s + more.prompt_s,
                       gen_tokens_per_s=more.gen_tokens_per_s, stop_reason=more.stop_reason,
                       seed=more.seed if drawn else self.seed,
                       seed_fixed=more.seed_fixed if drawn else self.seed_fixed,
                       continued=self.continued + 1)

    @property
    def empty(self) -> bool:
        """Nothing to say (a user's message, a reply still being written)."""
        return not self.to_json()

    def to_json(self) -> dict[str, Any]:
        """The figures that say something (a default is left out), as the store keeps them."""
        default = ReplyStats()
        out = {k: v for k, v in asdict(self).items() if v != getattr(default, k) and k != "unsaved"}
        if "device_notes" in out:
            out["device_notes"] = list(out["device_notes"])
        return out

    @classmethod
    def from_json(cls, d: Any) -> ReplyStats:
        """A stored row's stats, whatever it lacks: a missing, null or mistyped figure is its
        default (rows written by earlier versions, or a reply saved as it stopped)."""
        if not isinstance(d, dict):
            return cls()
        values: dict[str, Any] = {}
        for f in fields(cls):
            v = d.get(f.name)
            kind = _KINDS.get(f.name, type(f.default))
            if v is None or isinstance(v, bool) and kind in (int, float):
                continue
            if kind is bool and isinstance(v, bool):
                values[f.name] = v
            elif kind in (int, float) and isinstance(v, (int, float)):
                values[f.name] = kind(v)
            elif kind is str and isinstance(v, str):
                values[f.name] = v
            elif kind is tuple and isinstance(v, list):
                values[f.name] = tuple(str(x) for x in v)
        return cls(**values)


# what each field holds where its default does not say (None, or a tuple)
_KINDS: dict[str, type] = {"n_reply_tokens": int, "seed": int, "memory_from": int,
                           "flash_attn": bool, "device_notes": tuple}
