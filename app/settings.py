"""The window's settings and the session config built from them (Qt-free).

Saved in the store's settings table; DEFAULTS names every key. DEMO stands for the generated
demo projector (random weights) wherever a projector path is accepted.
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.config import PhaseTuning, SessionConfig
from engine.units import parse_size

DEMO = "demo"
DEMO_LABEL = ("demo projector: generated, not trained — at most it tells a picture's colour "
              "(red, green, blue, yellow, black, white)")
DEFAULTS: dict[str, Any] = {"vram_budget": "", "threads": 0, "ctx": 4096, "image_max_tokens": 0,
                            "flash_attn": True, "vision": "auto", "rpc": [], "model_folders": [],
                            "gpu_layers": -1, "spread": False, "max_tokens": 0,
                            "overflow": "drop-oldest", "image_cache": "1GiB",
                            # each phase at its best (Model → Tune…): the prompt's layers (-1: as
                            # generation's) and threads (0: as generation's), and the prompt
                            # speeds autotune measured per layer count, which price a move
                            "prompt_layers": -1, "threads_batch": 0, "prompt_speeds": {},
                            # the same for a prompt with images (a batch of the projector's
                            # image tokens): -1 as for text prompts
                            "image_layers": -1, "image_speeds": {},
                            # Settings → Local server: the OpenAI-compatible endpoint
                            "server": False, "server_host": "127.0.0.1", "server_port": 8089,
                            "server_api_key": ""}
# RPC servers lost during a step before this process restarted itself (see engine/llama/fatal.py)
LOST_RPC = {e for e in os.environ.get("EBB_LOST_RPC", "").split(",") if e}


def load_settings(store: Any) -> dict[str, Any]:
    """Every setting, saved or default."""
    return {k: store.setting(k, v) for k, v in DEFAULTS.items()}


def session_config(store: Any, model: str, mmproj: str, ctx: int | None = None,
                   threads: int | None = None,
                   rpc: list[str] | None = None) -> tuple[SessionConfig, list[str]]:
    """A SessionConfig from the saved settings (remembering this model as the last used), and
    the RPC servers to connect: `rpc` first, then Settings' list, less any lost ones."""
    s = load_settings(store)
    store.set_setting("model", model)
    store.set_setting("mmproj", mmproj)
    cfg = SessionConfig(
        model_path=Path(model), mmproj_path=Path(mmproj) if mmproj else None,
        n_ctx=ctx or int(s["ctx"]), n_threads=threads or (int(s["threads"]) or None),
        vram_budget_bytes=parse_size(s["vram_budget"]) if s["vram_budget"] else None,
        vision=str(s["vision"]), flash_attn=bool(s["flash_attn"]),
        image_max_tokens=int(s["image_max_tokens"]),
        gpu_layers=int(s["gpu_layers"]) if int(s["gpu_layers"]) >= 0 else None,
        spread=bool(s["spread"]), overflow=str(s["overflow"]),
        image_cache_bytes=parse_size(s["image_cache"]) if s["image_cache"] else 1 << 30,
        n_threads_batch=int(s["threads_batch"]) or None, phases=phase_tuning(s))
    servers = list(rpc or []) + [r for r in s["rpc"] if r not in (rpc or [])]
    return cfg, [r for r in servers if r not in LOST_RPC]


def phase_tuning(s: dict[str, Any]) -> PhaseTuning | None:
    """The per-phase choice from the settings: only when the two phases' layer counts differ
    and autotune measured prompts at both (a move is priced from those measurements)."""
    gen, prompt, image = int(s["gpu_layers"]), int(s["prompt_layers"]), int(s["image_layers"])
    speeds = {int(k): float(v) for k, v in (s.get("prompt_speeds") or {}).items()}
    images = {int(k): float(v) for k, v in (s.get("image_speeds") or {}).items()}
    if image < 0 or gen not in images or image not in images:
        image = -1
    text = prompt >= 0 and gen != prompt and gen in speeds and prompt in speeds
    if gen < 0 or not (text or (image >= 0 and image != gen)):
        return None
    if not text:  # images alone move: text prompts stay at generation's placement
        prompt = gen
    return PhaseTuning(gen, prompt, int(s["threads"]), int(s["threads_batch"]),
                       speeds.get(gen, 1.0), speeds.get(prompt, 1.0), image,
                       images.get(gen, 0.0), images.get(image, 0.0))


def phase_settings(result: dict[str, Any]) -> dict[str, Any]:
    """The settings that use autotune's result: each phase's layers and threads, and the prompt
    speeds it measured (at the prompt's best thread count) for pricing a move."""
    threads = int(result.get("best_prompt_threads") or 0)
    speeds, images = {}, {}
    for p in result["points"]:
        per = p.get("prompt_tps_by_threads") or {}
        speeds[str(p["layers"])] = float(per.get(str(threads)) or p["prompt_tps"])
        if p.get("image_tps"):
            per = p.get("image_tps_by_threads") or {}
            images[str(p["layers"])] = float(per.get(str(threads)) or p["image_tps"])
    image = result.get("best_image_layers")
    return {"gpu_layers": int(result["best_gen_layers"]),
            "prompt_layers": int(result["best_prompt_layers"]),
            "threads": int(result.get("best_gen_threads") or 0), "threads_batch": threads,
            "prompt_speeds": speeds, "image_layers": int(image) if image is not None else -1,
            "image_speeds": images}


def resolve_paths(cfg: SessionConfig) -> SessionConfig:
    """Worker thread: fetch the default model and make the demo projector if asked (slow the
    first time, so never on the GUI thread); a context longer than the model was trained for
    is cut to the model's (the setting is one number for every model)."""
    from engine.gguf.info import model_info, read_gguf
    from engine.gguf.models import (
        default_projector_path,
        existing_file,
        resolve_model_path,
    )

    model = resolve_model_path(str(cfg.model_path))
    proj = cfg.mmproj_path
    if proj is not None:
        proj = default_projector_path(model) if str(proj) == DEMO else existing_file(str(proj), "projector")
    n_ctx = cfg.n_ctx
    trained = model_info(read_gguf(model)).n_ctx_train
    if n_ctx is not None and trained and n_ctx > trained:
        n_ctx = trained
    return replace(cfg, model_path=model, mmproj_path=proj, n_ctx=n_ctx)
