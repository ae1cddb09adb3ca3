"""Events the engine emits (one module, frozen dataclasses). Each carries a monotonic
timestamp `t_s` and the id of the request it belongs to (0 for none)."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from engine import testhooks
from engine.stops import StopReason
from engine.tune_result import TuneResult


def _now() -> float:
    return time.monotonic()


@dataclass(frozen=True)
class Event:
    request_id: int
    t_s: float = field(default_factory=_now, kw_only=True)


@dataclass(frozen=True)
class ModelLoading(Event):
    model_path: str


@dataclass(frozen=True)
class DeviceInfo:
    name: str  # llama.cpp's name: "CPU", "CUDA0", "RPC0[127.0.0.1:50052]" …
    description: str
    kind: str  # cpu, gpu, igpu, accel
    free_bytes: int | None
    total_bytes: int | None
    remote: bool
    handle: int  # ggml_backend_dev_t; valid for the whole process

    @property
    def is_accelerator(self) -> bool:
        return self.kind != "cpu"

    @property
    def identity(self) -> str:
        """What computes on it, for results remembered across runs: a remote device is its host
        and size (a server started again on another port is the same hardware), a local one
        its description."""
        if self.remote:
            host = self.description.rsplit(":", 1)[0] if ":" in self.description else self.description
            return f"rpc:{host}:{self.total_bytes}"
        return self.description

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["handle"]
        return d


@dataclass(frozen=True)
class LoadDetails:
    """Where a loaded model sits and how it got there (ModelLoaded.details)."""
    mover: str = "reload"
    mover_note: str = ""
    accelerator: str | None = None
    accelerator_endpoint: str | None = None  # the RPC server behind it, if any
    budget_bytes: int = 0
    n_layers_on_accel: int = 0
    layers_by_device: dict[str, int] = field(default_factory=dict)
    placement_reason: str = ""
    memory_note: str = ""  # the device held less than its budget said: what was done
    projector: str = ""  # its path; "" without one
    projector_refused: str = ""  # why the projector asked for is not used (the model runs for text)
    draft_refused: str = ""  # why the draft model asked for is not used (replies come without it)
    projector_synthetic: bool = False
    projector_names_colours: bool = False  # the demo's colour projector
    projector_sees: bool = True  # takes pictures
    projector_hears: bool = False  # takes sound clips
    clip_chunk_tokens: int = 0  # tokens a 30-second chunk of sound takes (0: does not hear)
    # tokens a video frame or a PDF page takes, made at `picture_side` pixels (0: does not see)
    picture_tokens: int = 0
    picture_side: int = 0
    vision: bool = False  # the projector is on (pictures and clips, whichever it takes)
    rpc_bytes_sent: int = 0
    backend_notes: tuple[str, ...] = ()  # a GPU backend built in that cannot run here
    safe_mode: bool = False
    # the model and projector as asked ("default", "demo" or paths): remembered as last used
    requested: tuple[str, str] | None = None
    devices: tuple[DeviceInfo, ...] = ()  # this session's devices, as the load saw them
    # the tool-call format the model's chat template teaches (engine/tools/calls.py: hermes,
    # llama3, mistral); "": none Ebb knows, so tools are described in the system prompt
    tool_format: str = ""


@dataclass(frozen=True)
class ModelLoaded(Event):
    model_path: str
    model_name: str
    n_layers: int
    n_ctx: int
    n_threads: int
    load_s: float
    details: LoadDetails = field(default_factory=LoadDetails)


pause_point = testhooks.pause_point  # test hook: engine/testhooks.py


@dataclass(frozen=True)
class TurnFinished(Event):
    result: TurnResult


@dataclass(frozen=True)
class ToolCallChanged(Event):
    """A tool call of the window's turn: asked (the card waits for Allow or Deny), running, or
    ended (engine/tools/loop.py CallRecord.to_dict, with `said`: the result as the model
    read it)."""
    call: dict[str, Any]


@dataclass(frozen=True)
class ServerTurn(Event):
    """The window's local server answered an HTTP client (request_id: the session's turn, as
    its spans carry it)."""
    client: str
    n_prompt_tokens: int
    n_gen_tokens: int
    finish_reason: str
    n_images: int = 0
    strategy: str = ""
    client_gone: bool = False


@dataclass(frozen=True)
class EngineFailed(Event):
    message: str


@dataclass(frozen=True)
class VisionChanged(Event):
    enabled: bool


# The steps in which the model gives the accelerator up and takes it back: a swap's own cost
# (the projector's load, encode and free are the same whichever mover runs).
SWAP_STEPS = ("save_state", "evict", "restore", "restore_state")


@dataclass(frozen=True)
class Span(Event):
    """One pipeline step: plan, save_state, evict, load_projector, encode, free_projector,
    restore, restore_state, prefill, decode. Times are monotonic seconds."""
    name: str
    start_s: float
    end_s: float
    device: str
    bytes: int = 0
    predicted_s: float | None = None
    detail: str = ""
    lane: int = 0  # the sequence it ran in: 0 the session's, k a lane's (engine/llama/lanes.py)

    def to_dict(self, t0: float = 0.0) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "start_s": round(self.start_s - t0, 6),
                             "end_s": round(self.end_s - t0, 6), "device": self.device,
                             "bytes": self.bytes}
        if self.predicted_s is not None:
            d["predicted_s"] = round(self.predicted_s, 6)
        if self.detail:
            d["detail"] = self.detail
        return d


@dataclass(frozen=True)
class PrefillProgress(Event):
    """A prompt being evaluated: `n_done` of `n_total` positions so far, since `start_s`
    (monotonic), on `device`. Sent after each batch; the prefill's Span follows at its end."""
    start_s: float
    n_done: int
    n_total: int
    device: str


@dataclass(frozen=True)
class Residency(Event):
    """Where each part lives now: per layer, output, embeddings, projector, and the ledger."""
    layer_devices: tuple[str, ...]
    output_device: str
    embeddings_device: str
    projector_device: str  # "RAM", a device name, "loading", or "" without a projector
    ledger: dict[str, dict[str, int]]
    # sizes, for the map's tooltips: each layer's weights, the embeddings', the output's
    layer_bytes: tuple[int, ...] = ()
    embeddings_bytes: int = 0
    output_bytes: int = 0


@dataclass(frozen=True)
class MemorySample(Event):
    device: str
    ledger_bytes: int
    reported_used_bytes: int | None  # the device's own reading (NVML / ggml), if any
    ledger_kinds: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class TunePoint(Event):
    """One autotune run finished: tokens/s at this many accelerator layers (at each phase's
    best thread count), and at every thread count measured."""
    layers: int
    prompt_tps: float
    gen_tps: float
    prompt_tps_by_threads: dict[int, float] = field(default_factory=dict)
    gen_tps_by_threads: dict[int, float] = field(default_factory=dict)
    max_layers: int = -1  # the search's upper end (the most that fit the budget); -1: unknown


@dataclass(frozen=True)
class TuneNote(Event):
    """What autotune does next, between its runs (choosing flash attention)."""
    text: str


@dataclass(frozen=True)
class TuneFinished(Event):
    result: TuneResult | None  # None: stopped before it finished


@dataclass(frozen=True)
class PhasesUsed:
    """Where (device layers) and with how many threads each phase of a turn ran, and why:
    with autotune's per-phase choice (engine/placement/phase_mover.py)."""
    prompt_layers: int
    gen_layers: int
    prompt_threads: int
    gen_threads: int
    moved: bool  # the prompt ran at its own placement (a rebalance before and after it)
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_layers": self.prompt_layers, "gen_layers": self.gen_layers,
                "prompt_threads": self.prompt_threads, "gen_threads": self.gen_threads,
                "moved": self.moved, "reason": self.reason}


@dataclass(frozen=True)
class Logprob:
    """A sampled token's log-probability from the model's own logits (before any sampler), and
    the `top` most likely at that step; OpenAI's chat shape at the JSON edge (`to_dict`)."""
    token: str
    logprob: float
    bytes: tuple[int, ...]
    top: tuple[Logprob, ...] = ()

    def to_dict(self, with_top: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {"token": self.token, "logprob": self.logprob, "bytes": list(self.bytes)}
        if with_top:
            d["top_logprobs"] = [t.to_dict(False) for t in self.top]
        return d


@dataclass(frozen=True)
class GenStats:
    """A reply's figures, from the runtime's decode loop to the JSON edge (`to_dict`). A turn
    that never decoded (an error before the reply) has `stop_reason` None and no figures."""
    n_prompt_tokens: int = 0
    n_gen_tokens: int = 0
    prompt_s: float = 0.0
    gen_s: float = 0.0
    stop_reason: StopReason | None = None
    n_prompt_tokens_evaluated: int = 0
    n_prompt_tokens_restored: int = 0  # taken from a kept state of the conversation
    restore_s: float = 0.0  # the seconds that took
    # taken back when the conversation was opened, while the user typed: not waited for
    restored_ahead: bool = False
    logprobs: tuple[Logprob, ...] | None = None  # with GenParams.top_logprobs >= 0: each token's
    flash_attn: bool | None = None  # whether the turn ran with flash attention (None: not known)
    # Continue: the whole reply's length in tokens (an interrupted reply has no count saved)
    n_reply_tokens: int | None = None
    # speculative decoding (engine/llama/lookup.py): batches with a draft, tokens guessed, taken
    n_drafts: int = 0
    n_drafted: int = 0
    n_draft_accepted: int = 0

    @classmethod
    def cancelled(cls) -> GenStats:
        """Stopped before the reply's first token."""
        return cls(stop_reason=StopReason.CANCELLED)

    @property
    def gen_tokens_per_s(self) -> float:
        return self.n_gen_tokens / self.gen_s if self.gen_s > 0 else 0.0

    @property
    def prompt_tokens_per_s(self) -> float:
        n = self.n_prompt_tokens_evaluated
        return n / self.prompt_s if self.prompt_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        if self.stop_reason is None:
            return {}
        d: dict[str, Any] = {
            "n_prompt_tokens": self.n_prompt_tokens,
            "n_gen_tokens": self.n_gen_tokens, "prompt_s": round(self.prompt_s, 4),
            "gen_s": round(self.gen_s, 4), "gen_tokens_per_s": round(self.gen_tokens_per_s, 2),
            "prompt_tokens_per_s": round(self.prompt_tokens_per_s, 2),
            "n_prompt_tokens_evaluated": self.n_prompt_tokens_evaluated,
            "n_drafted": self.n_drafted, "n_draft_accepted": self.n_draft_accepted,
            "n_prompt_tokens_restored": self.n_prompt_tokens_restored,
            "restore_s": round(self.restore_s, 4), "restored_ahead": self.restored_ahead,
            "stop_reason": self.stop_reason, "flash_attn": self.flash_attn}
        if self.logprobs is not None:
            d["logprobs"] = [e.to_dict() for e in self.logprobs]
        if self.n_reply_tokens is not None:
            d["n_reply_tokens"] = self.n_reply_tokens
        return d


@dataclass
class TurnResult:
    """What one turn (or Continue) did: the reply, the vision plan carried out, its spans and
    figures; built by the Session as the turn goes, `to_dict` at the JSON edges."""
    request_id: int
    text: str = ""
    strategy: str = "none"
    reason: str = ""
    spans: list[Span] = field(default_factory=list)
    device_peak_bytes: dict[str, int] = field(default_factory=dict)
    n_images: int = 0
    # each attachment as the message keeps it (a video's frames, a PDF's pages: attachments.py)
    attachments: list[str] = field(default_factory=list)
    attachment_lines: list[str] = field(default_factory=list)  # "2:10 · 32 frames, ... tokens"
    attachment_notes: list[list[str]] = field(default_factory=list)  # each one's (repeats left out)
    notes: list[str] = field(default_factory=list)  # what the user should know (frames left out)
    n_images_encoded: int = 0  # the message's images encoded in this turn
    n_images_cached: int = 0  # the message's images whose embeddings were already known
    n_image_tokens_encoded: int = 0  # image tokens (every chunk) encoded in this turn
    n_image_chunks_encoded: int = 0
    gen: GenStats = field(default_factory=GenStats)
    error: str | None = None
    device_lost: str | None = None  # a remote device went away before this turn
    continued: bool = False  # Continue of the last reply: `text` is what was added
    # the context overflowed: what left the model's memory for this turn to fit
    n_turns_dropped: int = 0  # whole turns (user and assistant messages), oldest first
    n_images_dropped: int = 0  # images of older turns (their text stays)
    n_tokens_dropped: int = 0
    memory_starts_at: int = 0  # the conversation's first message still in the model's memory
    shifted_cells: int = 0  # cells kept by moving them in the KV cache (no prefill)
    swap_mover: str = ""  # the mover this turn's swap used (live | reload), "" without a swap
    mover_note: str = ""  # why this turn's swap did not use the session's mover
    # what the device could not hold in this turn and where it ran instead (also in `reason`)
    device_notes: list[str] = field(default_factory=list)
    # with a per-phase choice: where and with how many threads each phase ran, and why
    phases: PhasesUsed | None = None

    def to_dict(self) -> dict[str, Any]:
        t0 = self.spans[0].start_s if self.spans else 0.0
        d: dict[str, Any] = {"text": self.text, "strategy": self.strategy, "reason": self.reason,
                             "spans": [s.to_dict(t0) for s in self.spans],
                             "device_peak_bytes": self.device_peak_bytes,
                             "n_images": self.n_images, "n_images_encoded": self.n_images_encoded,
                             "n_images_cached": self.n_images_cached,
                             "n_image_tokens_encoded": self.n_image_tokens_encoded,
                             "n_image_chunks_encoded": self.n_image_chunks_encoded,
                             "swap_mover": self.swap_mover, **self.gen.to_dict()}
        if self.attachments:  # what was taken of each: the reference a reopened chat puts back
            d["attachments"] = [
                {"ref": ref, "line": line, "notes": notes} for ref, line, notes in zip(
                    self.attachments, self.attachment_lines + [""] * len(self.attachments),
                    self.attachment_notes + [[]] * len(self.attachments))]
        if self.device_notes:
            d["device_notes"] = self.device_notes
        if self.phases is not None:
            d["phases"] = self.phases.to_dict()
        if self.continued:
            d["continued"] = True
        d.update(n_turns_dropped=self.n_turns_dropped, n_images_dropped=self.n_images_dropped,
                 n_tokens_dropped=self.n_tokens_dropped, memory_starts_at=self.memory_starts_at,
                 shifted_cells=self.shifted_cells)
        if self.error is not None:
            d["error"] = self.error
        if self.device_lost is not None:
            d["device_lost"] = self.device_lost
        return d
