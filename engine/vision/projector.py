"""A vision projector (mmproj) instance through llama.cpp's mtmd, bound to a loaded model.

The owner thread of the TextRuntime owns this too. Closing frees the mtmd context (and with it
the projector's weights and compute buffer on whatever device held them).
"""
from __future__ import annotations

import contextlib
import ctypes
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import EbbError
from engine.gguf.info import (
    ProjectorInfo,
    check_projector_matches,
    projector_info,
    read_gguf,
)
from engine.llama import log as llama_log
from engine.llama.lib import llama
from engine.vision.images import LoadedImage

_COMPUTE_RE = re.compile(r"reserve_compute_meta:\s+(\S+?)(?:\[[^\]]*\])? compute buffer size =\s+([\d.]+) MiB")
_MTMD_CHUNK_IMAGE = 1


@dataclass(frozen=True)
class Encoded:
    image_sha256: str
    n_tokens: int
    embeddings: np.ndarray  # (n_tokens, n_embd) float32
    encode_s: float


def _mtmd() -> Any:
    llama()
    import llama_cpp.mtmd_cpp as M

    cb = llama_log.callback()
    M.mtmd_log_set(cb, ctypes.c_void_p(0))
    M.mtmd_helper_log_set(cb, ctypes.c_void_p(0))
    return M


class ProjectorRuntime:
    """One mtmd context bound to a loaded model (anything with `.model` and `.info`).

    `device=None` keeps the projector in RAM (CPU backend); a device name puts its weights and
    compute buffer on that accelerator.
    """

    def __init__(self, path: Path, model: Any, n_threads: int, device: str | None = None,
                 flash_attn: bool | None = None, image_max_tokens: int = 0,
                 info: ProjectorInfo | None = None) -> None:
        self.path = Path(path)
        self.info = info or projector_info(read_gguf(self.path))
        check_projector_matches(model.info, self.info)
        self.n_embd = model.info.n_embd
        M = self._M = _mtmd()
        params = M.mtmd_context_params_default()
        params.use_gpu = device is not None
        if device is not None:
            from engine.llama.devices import find_device

            params.device = find_device(device).handle
        params.n_threads = n_threads
        params.print_timings = False
        params.warmup = True
        if flash_attn is not None:
            params.flash_attn_type = 1 if flash_attn else 0
        if image_max_tokens > 0:
            params.image_max_tokens = image_max_tokens
        self._stack = contextlib.ExitStack()
        llama_log.clear()
        t0 = time.perf_counter()
        ctx = M.mtmd_init_from_file(str(self.path).encode(), model.model, params)
        if not ctx:
            raise EbbError(f"llama.cpp could not load the projector {self.path.name}: "
                           f"{llama_log.last_error('no detail')}", "check the mmproj file")
        self._stack.callback(M.mtmd_free, ctx)
        self.ctx = ctx
        self.load_s = time.perf_counter() - t0
        self.device_name, self.compute_buffer_bytes = self._compute_buffer_from_log()
        self.marker = M.mtmd_default_marker().decode()

    @staticmethod
    def _compute_buffer_from_log() -> tuple[str, int]:
        for _level, line in reversed(llama_log.recent(200)):
            m = _COMPUTE_RE.search(line)
            if m:
                return m.group(1), int(float(m.group(2)) * 1024 * 1024)
        return "unknown", 0

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "ProjectorRuntime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def encode(self, image: LoadedImage) -> Encoded:
        """Preprocess and encode one image; returns its embeddings (copied out of mtmd)."""
        M = self._M
        buf = (ctypes.c_uint8 * len(image.rgb)).from_buffer_copy(image.rgb)
        bitmap = M.mtmd_bitmap_init(image.width, image.height, buf)
        if not bitmap:
            raise EbbError(f"mtmd could not take image {Path(image.path).name}")
        chunks = M.mtmd_input_chunks_init()
        try:
            text = M.mtmd_input_text()
            marker = M.mtmd_default_marker()
            text.text, text.text_len = marker, len(marker)
            text.add_special, text.parse_special = False, True
            arr = (M.mtmd_bitmap_p_ctypes * 1)(bitmap)
            rc = M.mtmd_tokenize(self.ctx, chunks, ctypes.byref(text), arr, 1)
            if rc != 0:
                raise EbbError(f"mtmd could not preprocess image {Path(image.path).name} "
                               f"(code {rc}): {llama_log.last_error('')}")
            chunk = next(M.mtmd_input_chunks_get(chunks, i)
                         for i in range(M.mtmd_input_chunks_size(chunks))
                         if M.mtmd_input_chunk_get_type(M.mtmd_input_chunks_get(chunks, i))
                         == _MTMD_CHUNK_IMAGE)
            n_tokens = M.mtmd_input_chunk_get_n_tokens(chunk)
            t0 = time.perf_counter()
            rc = M.mtmd_encode_chunk(self.ctx, chunk)
            encode_s = time.perf_counter() - t0
            if rc != 0:
                raise EbbError(f"encoding image {Path(image.path).name} failed (code {rc}): "
                               f"{llama_log.last_error('')}")
            out = M.mtmd_get_output_embd(self.ctx)
            emb = np.ctypeslib.as_array(out, shape=(n_tokens * self.n_embd,)).copy()
        finally:
            M.mtmd_input_chunks_free(chunks)
            M.mtmd_bitmap_free(bitmap)
        return Encoded(image.sha256, n_tokens, emb.reshape(n_tokens, self.n_embd), encode_s)
