"""`ebb-engine bench media`: many frames under one swap.

For each count N, a video of N different scenes (noise: no frame repeats another, so every one
is kept) is sent to fresh sessions on the same device:
- **batch**: the whole video in one message: every frame encoded under one plan (one borrow of
  the device when the plan swaps);
- **per item**: the same frames as N pictures in N messages: a borrow each;
- **resident**: the whole video with the projector resident on the device (no swap);
- **bare mtmd**: the same frames encoded by a bare loop of `mtmd_encode_chunk` on the CPU, beside
  Ebb's CPU encode of them (vision "cpu"): Ebb's overhead over llama.cpp's own path.
Each time is the vision work of the turn (the plan's steps: evict, load, encode, free, restore);
the ratios are printed (goal for Ebb ÷ bare: ≤ 1.05). Without an accelerator (no --rpc or GPU)
the swap rows cannot run and say so.
"""
from __future__ import annotations

import ctypes
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import SessionConfig, default_threads
from engine.llama.sampling import GenParams

if TYPE_CHECKING:
    from engine.events import TurnResult

VISION_STEPS = ("evict", "load_projector", "encode", "free_projector", "restore", "plan")


def write_scenes(path: Path, n: int, size: tuple[int, int] = (224, 224)) -> Path:
    """A video of n one-second scenes of noise (every frame differs), 1 fps, MP4."""
    import av
    import numpy as np

    rng = np.random.default_rng(n)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=1)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for i in range(n):
            arr = (rng.random((size[1], size[0], 3)) * 255).astype(np.uint8)
            frame = av.VideoFrame.from_ndarray(arr, format="rgb24")
            frame.pts = i
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return path


def _vision_s(res: TurnResult) -> float:
    return float(sum(sp.end_s - sp.start_s for sp in res.spans if sp.name in VISION_STEPS))


def _encode_s(res: TurnResult) -> float:
    return float(sum(sp.end_s - sp.start_s for sp in res.spans if sp.name == "encode"))


def _batch(cfg: SessionConfig, clip: Path, n: int) -> tuple[float, float, Any]:
    from engine.session import Session

    gp = GenParams(max_tokens=1, temperature=0)
    with Session(cfg) as s:
        res = s.turn("Describe the video.", [f"{clip}#every=1"], gp)
        if res.error:
            raise RuntimeError(res.error)
        if res.n_images_encoded != n:
            raise RuntimeError(f"{res.n_images_encoded} frames encoded, {n} sent")
        return _vision_s(res), _encode_s(res), res


def _per_item(cfg: SessionConfig, clip: Path, n: int) -> float:
    from engine.session import Session

    gp = GenParams(max_tokens=1, temperature=0)
    total = 0.0
    with Session(cfg) as s:
        for i in range(n):
            res = s.turn("And this frame?", [f"{clip}#frames={i}"], gp)
            if res.error:
                raise RuntimeError(res.error)
            total += _vision_s(res)
    return total


def bare_mtmd_encode_s(cfg: SessionConfig, clip: Path, n: int) -> float:
    """The frames Ebb sends, encoded by a bare loop of mtmd_encode_chunk on the CPU."""
    import llama_cpp.mtmd_cpp as M

    from engine.llama.lib import llama
    from engine.media import video

    L = llama()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    no_devices = (ctypes.c_void_p * 1)(None)  # the CPU only: never a device registered earlier
    mp.devices = ctypes.cast(no_devices, ctypes.c_void_p)  # in this process (a stand-in gone)
    model_p = L.llama_model_load_from_file(str(cfg.model_path).encode(), mp)
    params = M.mtmd_context_params_default()
    params.use_gpu = False
    params.n_threads = default_threads(cfg.n_threads)
    params.print_timings = False
    mctx = M.mtmd_init_from_file(str(cfg.mmproj_path).encode(), model_p, params)
    chunks = M.mtmd_input_chunks_init()
    try:
        info = video.probe(clip)
        side = 0
        from engine.gguf.info import projector_info, read_gguf

        assert cfg.mmproj_path is not None
        side = projector_info(read_gguf(cfg.mmproj_path)).image_size or 896
        frames = video.decode(clip, [float(i) for i in range(n)], video.frame_size(info, side))
        bitmaps = []
        for _, im in frames:
            data = im.tobytes()
            buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
            bitmaps.append(M.mtmd_bitmap_init(im.width, im.height, buf))
        marker = M.mtmd_default_marker().decode()
        text = M.mtmd_input_text()
        raw = (marker * len(bitmaps)).encode()
        text.text, text.text_len, text.add_special, text.parse_special = raw, len(raw), False, True
        arr = (M.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
        if M.mtmd_tokenize(mctx, chunks, ctypes.byref(text), arr, len(bitmaps)) != 0:
            raise RuntimeError("mtmd could not tokenize the frames")
        total = 0.0
        for i in range(M.mtmd_input_chunks_size(chunks)):
            chunk = M.mtmd_input_chunks_get(chunks, i)
            if M.mtmd_input_chunk_get_type(chunk) == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                continue
            t0 = time.perf_counter()
            if M.mtmd_encode_chunk(mctx, chunk) != 0:
                raise RuntimeError("mtmd could not encode a frame")
            total += time.perf_counter() - t0
        for bm in bitmaps:
            M.mtmd_bitmap_free(bm)
        return total
    finally:
        M.mtmd_input_chunks_free(chunks)
        M.mtmd_free(mctx)
        L.llama_model_free(model_p)


def bench_media(cfg: SessionConfig, items: list[int], swap: bool) -> dict[str, Any]:
    """Per count: the vision seconds of each way and their ratios."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="ebb-bench-media-") as tmp:
        for n in items:
            clip = write_scenes(Path(tmp) / f"scenes-{n}.mp4", n)
            row: dict[str, Any] = {"items": n}
            cpu_s, cpu_encode_s, _ = _batch(replace(cfg, vision="cpu"), clip, n)
            bare_s = bare_mtmd_encode_s(cfg, clip, n)
            row.update(cpu_s=round(cpu_s, 3), ebb_encode_s=round(cpu_encode_s, 3),
                       bare_mtmd_s=round(bare_s, 3),
                       ebb_vs_bare=round(cpu_encode_s / bare_s, 3) if bare_s else None)
            if swap:
                batch_s, _, res = _batch(replace(cfg, vision="swap"), clip, n)
                per_s = _per_item(replace(cfg, vision="swap"), clip, n)
                resident_s, _, _ = _batch(replace(cfg, vision="resident"), clip, n)
                row.update(batch_s=round(batch_s, 3), per_item_s=round(per_s, 3),
                           resident_s=round(resident_s, 3), strategy=res.strategy,
                           batch_vs_per_item=round(batch_s / per_s, 3) if per_s else None,
                           batch_vs_resident=round(batch_s / resident_s, 3) if resident_s else None)
            rows.append(row)
    return {"rows": rows, "swap": swap}
