"""What a session is asked to be: the model, its projector and how to place and run them.
Plain data (no I/O): the CLI, the window and the benchmarks build it; the session's owners
read it."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SessionConfig:
    model_path: Path
    mmproj_path: Path | None = None
    n_ctx: int | None = None
    n_threads: int | None = None
    vram_budget_bytes: int | None = None  # None: the accelerator's free memory minus a margin
    vision: str = "auto"  # auto | resident | swap | cpu
    flash_attn: bool = True
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
