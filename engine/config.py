"""What a session is asked to be: the model, its projector and how to place and run them.
Plain data (no I/O): the CLI, the window and the benchmarks build it; the session's owners
read it."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class PhaseTuning:
    """Autotune's per-phase choice, with the measurements the per-turn decision needs."""
    gen_layers: int  # llama.cpp's count (output layer first), as autotune measures
    prompt_layers: int
    gen_threads: int
    prompt_threads: int
    # prompt tokens/s measured at each placement (at prompt_threads)
    prompt_tps_at_gen: float
    prompt_tps_at_prompt: float
    # a prompt of the projector's image tokens in one batch (its compute buffer is larger, and
    # the speed may fall off a cliff at fewer layers): its best placement and the speeds there
    # and at generation's; -1 / 0: not measured
    image_layers: int = -1
    image_tps_at_gen: float = 0.0
    image_tps_at_image: float = 0.0

    @property
    def differs(self) -> bool:
        return self.prompt_layers != self.gen_layers

    def for_images(self) -> "PhaseTuning":
        """The choice for a prompt with images: the image batch's best layers and speeds in
        place of the text prompt's (itself when images were not measured)."""
        if self.image_layers < 0 or not self.image_tps_at_gen:
            return self
        return PhaseTuning(self.gen_layers, self.image_layers, self.gen_threads,
                           self.prompt_threads, self.image_tps_at_gen, self.image_tps_at_image)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PhaseTuning":
        return cls(int(d["gen_layers"]), int(d["prompt_layers"]), int(d["gen_threads"]),
                   int(d["prompt_threads"]), float(d["prompt_tps_at_gen"]),
                   float(d["prompt_tps_at_prompt"]), int(d.get("image_layers", -1)),
                   float(d.get("image_tps_at_gen", 0.0)), float(d.get("image_tps_at_image", 0.0)))


@dataclass(frozen=True)
class SessionConfig:
    model_path: Path
    mmproj_path: Path | None = None
    n_ctx: int | None = None
    n_threads: int | None = None
    vram_budget_bytes: int | None = None  # None: the accelerator's free memory minus a margin
    vision: str = "auto"  # auto | resident | swap | cpu
    # None: auto (flash_attn_for): on when layers run on an accelerator, off on the CPU alone,
    # where it measured slower once there is history in the cache (docs/performance.md)
    flash_attn: bool | None = None
    accel: str | None = None  # None: the first accelerator llama.cpp sees, if any
    n_batch: int = 512
    system: str | None = None
    mover: str = "auto"  # auto (live after its self-test, else reload) | live | reload
    image_max_tokens: int = 0  # 0: the projector's default
    rpc: tuple[str, ...] = ()  # RPC servers (HOST:PORT) whose devices this session may use
    gpu_layers: int | None = None  # at most this many on the accelerator (autotune's choice)
    # layers over every accelerator of this session (reload mover); without it, only when the
    # first device alone cannot hold the whole model
    spread: bool = False
    # when the next turn does not fit the context: drop-oldest (images of older turns first,
    # then the oldest whole exchanges; the cache is shifted where the model allows) | stop
    overflow: str = "drop-oldest"
    # bytes of image embeddings kept (least recently used leave first; encoded again if needed)
    image_cache_bytes: int = 1 << 30
    # autotune's per-phase choice: generation runs at its layers and threads, the prompt with
    # its threads, and a long enough prompt at its layers (live mover; engine.placement.phase_choice)
    phases: PhaseTuning | None = None
    n_threads_batch: int | None = None  # threads for prompt batches (None: n_threads)
    # the model's memory of conversations and the encoded pictures, kept on disk to reopen a
    # chat without evaluating it again (engine/llama/state_files.py); None: RAM only
    state_dir: Path | None = None
    state_disk_bytes: int = 4 << 30  # that folder's budget, least recently used first out
    # sequences answered at once (engine/llama/lanes.py): 1, the session's alone; N, N - 1 lanes
    # beside it for the endpoint's text requests; 0, auto (4 while the model runs on the CPU
    # alone, where their KV pool takes RAM only; 1 with an accelerator, whose memory is the layers')
    parallel: int = 1
    # a small model of the same vocabulary that guesses the reply's next tokens (drafter.py)
    draft_path: Path | None = None

    @property
    def flash(self) -> bool:
        """flash_attn once settled: Session and tune_for settle auto (flash_attn_for) before
        anything plans or loads with it."""
        assert self.flash_attn is not None, "flash attention auto was not settled"
        return self.flash_attn


@dataclass(frozen=True)
class Threads:
    """How many CPU threads each phase runs with, decided here and nowhere else."""
    gen: int  # one token at a time: memory-bound
    prompt: int  # batches of prompt tokens: compute-bound
    encode: int  # the image encoder on the CPU: batch work like a prompt's


def default_threads(n_threads: int | None, cores: int | None = None) -> int:
    """Threads when nothing says how many: the physical cores (`cores`, else this machine's;
    ggml's threads spin, so never more than there are cores). The one fallback: sessions
    (thread_plan), a bare runtime, autotune's grid, the RPC server and the Hub's verdict all
    ask here."""
    if n_threads:
        return n_threads
    if cores is None:
        from engine.hw import physical_cores

        cores = physical_cores()
    return cores


def thread_plan(cfg: SessionConfig, physical_cores: int) -> Threads:
    """Generation: the setting, else the physical cores (ggml's threads spin: never more than
    there are cores). Prompts: their own setting (autotune's per-phase choice), else
    generation's. Image encoding: as prompts (it used to take generation's, so a tuning of one
    generation thread encoded on one core)."""
    gen = default_threads(cfg.n_threads, physical_cores)
    prompt = cfg.n_threads_batch or gen
    return Threads(gen=gen, prompt=prompt, encode=prompt)


def flash_choice(value: object) -> bool | None:
    """Flash attention as a setting says it, as SessionConfig.flash_attn takes it: "auto" (or
    None) is None, decided by where the layers run (flash_attn_for); "on"/True and "off"/False.
    The one parser: the CLI's --flash-attn, Settings' value, the tuning file's."""
    if value is None or value == "auto":
        return None
    if value in (True, "on"):
        return True
    if value in (False, "off"):
        return False
    raise ValueError(f'flash attention is "auto", "on" or "off", not {value!r}')


def flash_attn_for(cfg: SessionConfig, accel: str | None) -> bool:
    """The flash-attention setting a session runs with: the configured one, else on when
    layers go to an accelerator and off on the CPU alone. On the 2-core EPYC Ebb is built on,
    with 2,048 tokens of history, generation ran 0.73x as fast with it on (prompt 1.09x); on a
    GPU it saves the attention scores' compute buffer and is usually faster. With sequences
    beside the session's (`parallel`, engine/llama/lanes.py) it is on on the CPU too: their cells
    share the session's KV cache, and flash attention's kernel skips another sequence's cells
    where plain attention computes them all (`ebb-engine bench peer`, 2 cores: one client 108-117
    tok/s on, 77-99 off; four at once 149-160 on, 114-147 off)."""
    if cfg.flash_attn is not None:
        return cfg.flash_attn
    if cfg.parallel != 1:
        return True
    return is_accelerator(accel) and cfg.gpu_layers != 0


CPU_DEVICE = "CPU"  # ggml's CPU device, which a user (or a test) may name as the accelerator


def is_accelerator(device: str | None) -> bool:
    """Whether layers on `device` run anywhere but this machine's CPU (None: no device)."""
    return device is not None and device.upper() != CPU_DEVICE
