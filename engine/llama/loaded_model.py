"""A llama_model loaded with its weights placed as `LoadParams` say (devices, layers, the
buffer-type overrides), and what belongs to a load rather than to a context: the context length
a model allows (`check_context`) and what a saved state of it is tied to (`state_identity`).

Thread rule: as runtime.py's: one thread owns these objects.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from engine.errors import DeviceOutOfMemory, EbbError
from engine.gguf.info import ModelInfo, model_info, read_gguf
from engine.llama import log as llama_log
from engine.llama.buffer_log import buffers_from_log
from engine.llama.buffer_override import override_array
from engine.llama.chat_template import JINJA_MODULES
from engine.llama.lib import import_meanwhile, llama
from engine.llama.state_files import file_identity

DEFAULT_CTX = 4096
DEFAULT_BATCH = 512


@dataclass(frozen=True)
class LoadParams:
    model_path: Path
    n_ctx: int | None = None  # None: min(DEFAULT_CTX, the model's training context)
    n_threads: int | None = None  # None: physical cores
    n_threads_batch: int | None = None  # threads for prompt batches; None: n_threads
    n_gpu_layers: int = 0  # llama.cpp's count: the output layer first, then the last layers
    devices: tuple[str, ...] | None = ()  # accelerators to use (none: CPU only); None: all
    tensor_split: tuple[float, ...] = ()  # share of the offloaded layers per device, in order
    flash_attn: bool | None = None  # None: llama.cpp decides
    n_batch: int = DEFAULT_BATCH
    repack: bool = True  # False: keep host weights in plain GGUF layout (no CPU_REPACK copy)
    # (regex, device name or "CPU"): llama.cpp's tensor_buft_overrides, first match wins
    buft_overrides: tuple[tuple[str, str], ...] = ()
    # the thread counts given are the most: fewer are used while the cores are shared
    # (engine/llama/thread_share.py); False: exactly those, always
    share_threads: bool = False
    # sequences beside the session's in the same context (engine/llama/lanes.py), and the KV
    # cells they share beyond `n_ctx`; 0: the context holds sequence 0 alone
    lanes: int = 0
    lane_cells: int = 0


def state_identity(model_path: Path, n_ctx: int, flash_attn: bool | None) -> dict[str, Any]:
    return {"model": file_identity(model_path), "n_ctx": n_ctx, "flash_attn": flash_attn,
            "kv": "f16", "llama_cpp": _llama_version()}


@functools.lru_cache(maxsize=1)
def _llama_version() -> str:
    """The llama.cpp build a saved state comes from (its bytes are that build's format)."""
    from importlib import metadata

    try:
        return metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:
        return "unknown"


def check_context(info: ModelInfo, n_ctx: int | None) -> int:
    """The context length to use; EbbError when the request exceeds the model's."""
    limit = info.max_context
    if n_ctx is None:
        return min(DEFAULT_CTX, limit)
    if n_ctx <= 0:
        raise EbbError(f"context length must be positive, got {n_ctx}", "pass e.g. --ctx 4096")
    if n_ctx > limit:
        raise EbbError(f"context {n_ctx} is larger than this model allows ({limit} tokens)",
                       f"pass --ctx {limit} or less")
    return n_ctx


class HoldsModel(Protocol):
    """What a projector binds to: a loaded llama_model (the ctypes pointer) and its facts, a
    `LoadedModel` or a `TextRuntime`."""
    model: Any
    info: ModelInfo


class LoadedModel:
    """A llama_model (weights placed per params). Close frees it."""

    def __init__(self, params: LoadParams, info: ModelInfo | None = None) -> None:
        L = llama()
        self.params = params
        self.info = info or model_info(read_gguf(params.model_path))
        self._stack = contextlib.ExitStack()
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = params.n_gpu_layers
        from engine.llama import ggml, native

        # no AMX buffer (its mul_mat segfaults), nothing extra in safe mode: engine.llama.native
        mparams.use_extra_bufts = self.extra_bufts = native.use_extra_bufts(
            params.repack, ggml.cpu_extra_buffer_types())
        if params.devices is not None:
            from engine.llama.devices import find_device

            handles = [find_device(n).handle for n in params.devices] + [None]
            self._devices_arr = (ctypes.c_void_p * len(handles))(*handles)  # alive while loading
            mparams.devices = ctypes.cast(self._devices_arr, ctypes.c_void_p)
        if params.tensor_split:
            n = int(L.llama_max_devices())
            self._split = (ctypes.c_float * n)(*(list(params.tensor_split) + [0.0] * n)[:n])
            mparams.tensor_split = ctypes.cast(self._split, ctypes.POINTER(ctypes.c_float))
        if params.buft_overrides:
            self._overrides = override_array(params.buft_overrides)  # alive while loading
            mparams.tensor_buft_overrides = ctypes.cast(self._overrides, ctypes.c_void_p)
        # a Python callback per tensor: Python's signal handlers (Ctrl-C) get to run during the
        # load, which is otherwise one long C call
        self._progress = L.llama_progress_callback(lambda _progress, _user: True)
        mparams.progress_callback = self._progress
        llama_log.clear()
        import_meanwhile(JINJA_MODULES)  # the first prompt's template, while the weights load
        t0 = time.perf_counter()
        model = L.llama_model_load_from_file(str(params.model_path).encode(), mparams)
        if not model:
            raise _load_error(params.model_path)
        self.load_s = time.perf_counter() - t0
        self._stack.callback(L.llama_model_free, model)
        self.model = model
        self.vocab = L.llama_model_get_vocab(model)
        self.buffers = buffers_from_log()

    def close(self) -> None:
        self._stack.close()


def _load_error(path: Path) -> EbbError:
    cause = llama_log.last_error("llama.cpp could not load it")
    if "unable to allocate" in cause or "failed to allocate" in cause:
        return DeviceOutOfMemory(f"{path.name}: a device could not allocate memory for the "
                                 f"model ({cause})", "load fewer layers there, or use the CPU")
    if "unknown model architecture" in cause:
        arch = cause.split("unknown model architecture:", 1)[-1].strip().strip("'\"")
        return EbbError(f"{path.name}: model architecture '{arch}' is not supported by this "
                        "llama.cpp (llama-cpp-python 0.3.36)",
                        "use a model whose architecture llama.cpp supports")
    return EbbError(f"{path.name}: llama.cpp could not load the model: {cause}",
                    "check that the file is a complete llama.cpp GGUF model")
