"""Autotune as a session would run (the one set-up the CLI's `autotune` and the window's
Tune share): the session's context (as `Session` picks it), batch, flash attention and mover's
layout; room for the projector beside the layers when vision is resident; threads searched
unless the configuration fixes them; flash attention chosen by measurement."""
from __future__ import annotations

import threading
from dataclasses import replace
from typing import Callable

from engine.config import SessionConfig, flash_attn_for
from engine.errors import EbbError
from engine.gguf.model_files import ModelFiles
from engine.measure.autotune import FA_FILL, Measurer, Point, TuneResult, autotune, max_layers


def projector_room(cfg: SessionConfig, need_bytes: int) -> int:
    """What the layers leave free for the projector: all it needs when it stays resident;
    nothing when it swaps in (it borrows the layers' room) or runs on the CPU."""
    return need_bytes if cfg.vision == "resident" else 0


def tune_for(cfg: SessionConfig, accel: str, budget: int,
             on_point: Callable[[Point, int], None] | None = None,
             on_flash: Callable[[int], None] | None = None,
             cancel: threading.Event | None = None, choose_flash_attn: bool = True,
             flash_history: int = FA_FILL, prompt_tokens: int = 256,
             gen_tokens: int = 48, files: ModelFiles | None = None) -> TuneResult:
    """`on_point(point, max_layers)` after each run; `on_flash(runs)` before flash attention's.
    Each run times a prompt of `prompt_tokens` and `gen_tokens` generated (fewer: a quicker,
    noisier tune). `files`: the model's and projector's headers, when read already."""
    from engine.llama.loaded_model import check_context
    from engine.placement.plan import projector_need_bytes

    cfg = replace(cfg, flash_attn=flash_attn_for(cfg, accel))  # auto: on (it tunes a device)
    files = ModelFiles.of(cfg.model_path, cfg.mmproj_path, files)
    info, proj = files.info, files.proj
    n_ctx = check_context(info, cfg.n_ctx)
    headroom = projector_room(cfg, projector_need_bytes(proj, cfg.flash)) if proj else 0
    live = cfg.mover != "reload"
    top = max_layers(info, accel, budget, n_ctx, cfg.n_batch, cfg.flash, headroom, live)
    if budget <= 0:
        raise EbbError(f"the budget on {accel} is {budget} bytes: nothing to tune")
    m = Measurer(cfg.model_path, info, accel, n_ctx, cfg.n_threads, cfg.flash, cfg.n_batch,
                 on_point=(lambda p: on_point(p, top)) if on_point is not None else None,
                 cancel=cancel, live=live, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens,
                 # a thread count the configuration sets is kept; else each phase's is searched
                 threads=(cfg.n_threads,) if cfg.n_threads else None,
                 image_tokens=proj.image_tokens if proj is not None else 0)
    return autotune(m, budget, headroom, flash_attn=choose_flash_attn, on_flash=on_flash,
                    flash_history=flash_history)
