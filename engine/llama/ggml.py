"""ctypes bindings for the ggml-backend calls llama-cpp-python does not expose.

We open the *same* ggml that llama.cpp loaded: the `.so.0` files in `llama_cpp/lib` (the wheel
also ships unversioned copies; opening those would load a second ggml whose pointers differ).
Registry calls live in libggml.so.0, device and buffer calls in libggml-base.so.0, RPC in
libggml-rpc.so.0. Any thread may call `lib()`; device calls belong to the engine's thread.
"""
from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}

c_void_p, c_char_p, c_size_t = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t


@dataclass(frozen=True)
class GgmlLibs:
    base: Any
    core: Any
    rpc: Any | None  # None when llama.cpp was built without GGML_RPC


def lib_dir() -> Path:
    from engine.llama.binding import binding

    return Path(binding().__file__).parent / "lib"


def _sig(lib: Any, name: str, res: Any, *args: Any) -> None:
    fn = getattr(lib, name)
    fn.restype = res
    fn.argtypes = list(args)


@functools.lru_cache(maxsize=1)
def lib() -> GgmlLibs:
    """Open and type the ggml libraries llama.cpp itself uses (after importing llama_cpp)."""
    from engine.llama.lib import llama

    llama()  # loads libllama and, through it, these exact files
    d = lib_dir()
    mode = os.RTLD_GLOBAL if hasattr(os, "RTLD_GLOBAL") else 0
    base = ctypes.CDLL(str(d / "libggml-base.so.0"), mode=mode)
    core = ctypes.CDLL(str(d / "libggml.so.0"), mode=mode)
    # a normal build links RPC in (libggml-rpc.so.0); a portable one loads it as a module
    # (libggml-rpc.so, already opened by ggml_backend_load_all_from_path: the same instance)
    rpc_path = next((p for p in (d / "libggml-rpc.so.0", d / "libggml-rpc.so") if p.exists()), None)
    rpc = ctypes.CDLL(str(rpc_path), mode=mode) if rpc_path is not None else None
    _sig(core, "ggml_backend_dev_count", c_size_t)
    _sig(core, "ggml_backend_dev_get", c_void_p, c_size_t)
    _sig(core, "ggml_backend_register", None, c_void_p)
    _sig(core, "ggml_backend_reg_count", c_size_t)
    _sig(core, "ggml_backend_reg_get", c_void_p, c_size_t)
    _sig(base, "ggml_backend_reg_name", c_char_p, c_void_p)
    _sig(base, "ggml_backend_reg_dev_count", c_size_t, c_void_p)
    _sig(base, "ggml_backend_reg_dev_get", c_void_p, c_void_p, c_size_t)
    _sig(base, "ggml_backend_dev_name", c_char_p, c_void_p)
    _sig(base, "ggml_backend_dev_description", c_char_p, c_void_p)
    _sig(base, "ggml_backend_dev_type", ctypes.c_int, c_void_p)
    _sig(base, "ggml_backend_dev_memory", None, c_void_p, ctypes.POINTER(c_size_t),
         ctypes.POINTER(c_size_t))
    _sig(base, "ggml_backend_dev_backend_reg", c_void_p, c_void_p)
    _sig(base, "ggml_get_name", c_char_p, c_void_p)
    _sig(base, "ggml_nbytes", c_size_t, c_void_p)
    _sig(base, "ggml_tensor_overhead", c_size_t)
    _sig(base, "ggml_backend_buffer_get_usage", ctypes.c_int, c_void_p)
    _sig(base, "ggml_backend_buffer_set_usage", None, c_void_p, ctypes.c_int)
    _sig(base, "ggml_backend_buffer_get_base", c_void_p, c_void_p)
    _sig(base, "ggml_backend_buffer_get_size", c_size_t, c_void_p)
    _sig(base, "ggml_backend_buffer_free", None, c_void_p)
    _sig(base, "ggml_backend_buffer_is_host", ctypes.c_bool, c_void_p)
    _sig(base, "ggml_backend_buffer_name", c_char_p, c_void_p)
    _sig(base, "ggml_backend_buft_alloc_buffer", c_void_p, c_void_p, c_size_t)
    _sig(base, "ggml_backend_buft_get_alloc_size", c_size_t, c_void_p, c_void_p)
    _sig(base, "ggml_backend_buft_get_alignment", c_size_t, c_void_p)
    _sig(base, "ggml_backend_buft_name", c_char_p, c_void_p)
    _sig(base, "ggml_backend_dev_buffer_type", c_void_p, c_void_p)
    _sig(base, "ggml_backend_cpu_buffer_type", c_void_p)
    _sig(base, "ggml_backend_tensor_alloc", ctypes.c_int, c_void_p, c_void_p, c_void_p)
    _sig(base, "ggml_backend_tensor_set", None, c_void_p, c_void_p, c_size_t, c_size_t)
    _sig(base, "ggml_backend_tensor_get", None, c_void_p, c_void_p, c_size_t, c_size_t)
    _sig(base, "ggml_backend_tensor_set_async", None, c_void_p, c_void_p, c_void_p, c_size_t,
         c_size_t)
    _sig(base, "ggml_backend_dev_init", c_void_p, c_void_p, c_char_p)
    _sig(base, "ggml_backend_free", None, c_void_p)
    if rpc is not None:
        _sig(rpc, "ggml_backend_rpc_add_server", c_void_p, c_char_p)
        _sig(rpc, "ggml_backend_rpc_start_server", None, c_char_p, c_char_p, c_size_t, c_size_t,
             ctypes.POINTER(c_void_p))
    return GgmlLibs(base, core, rpc)


BUFFER_USAGE_WEIGHTS = 1
# ggml-rpc sends a hash before the bytes of a weight copy larger than this (a constant of this
# ggml version): a server whose cache holds those bytes takes them from its disk
RPC_HASH_THRESHOLD_BYTES = 10 * 1024 * 1024
GGML_TYPE_I8 = 24
GGML_MAX_SRC = 10
GGML_MAX_NAME = 64


class Tensor(ctypes.Structure):
    """Mirror of the public `struct ggml_tensor` (ggml.h, ggml 0.25.x). `check_tensor_layout`
    verifies it against the library before anything relies on it."""
    _fields_ = [
        ("type", ctypes.c_int32),
        ("buffer", c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", c_size_t * 4),
        ("op", ctypes.c_int32),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", c_void_p * GGML_MAX_SRC),
        ("view_src", c_void_p),
        ("view_offs", c_size_t),
        ("data", c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


def tensor_at(ptr: int) -> Tensor:
    return Tensor.from_address(ptr)


def bytes_view(buffer: int, n_bytes: int) -> Tensor:
    """A 1-D I8 tensor over the first `n_bytes` of a backend buffer: copy any bytes into it
    with `ggml_backend_tensor_set` (keep the object alive while copying)."""
    t = Tensor()
    t.type, t.buffer, t.data = GGML_TYPE_I8, buffer, lib().base.ggml_backend_buffer_get_base(buffer)
    t.ne[:] = [n_bytes, 1, 1, 1]
    t.nb[:] = [1, n_bytes, n_bytes, n_bytes]
    return t


# How host bytes are best sent to a remote (RPC) device. Each copy is one message that ggml's
# dispatcher thread writes to the socket. `ggml_backend_tensor_set` waits for that; queued
# (`ggml_backend_tensor_set_async`), the next piece is made ready while the last is on the
# wire: on loopback 46.5 MiB went over in 11.5 ms instead of 14.7. Pieces of 0.5-1 MiB were
# the fastest queued (4 MiB ones 14.8 ms). The queue holds a copy of each piece's bytes: a piece
# that would take it over RPC_QUEUE_BYTES is sent waiting (which waits for those before it), so
# a tensor of hundreds of MiB sent whole is never held twice over.
RPC_COPY_PIECE_BYTES = 2**20
RPC_QUEUE_BYTES = 4 * 2**20


class Copier:
    """Copies host bytes into device tensors: queued for a remote device (see above, through
    a backend of its own on ggml's one connection to the server, so requests stay in order),
    else `ggml_backend_tensor_set`. The last pieces may still be on their way when `copy`
    returns: anything asked of the device afterwards comes after them, and `wait_until_done`
    waits for them. Close it after use. Engine thread."""

    def __init__(self, dev_handle: int, remote: bool) -> None:
        self.base = lib().base
        self.backend = self.base.ggml_backend_dev_init(dev_handle, None) if remote else None
        self.piece_bytes = RPC_COPY_PIECE_BYTES if self.backend else 4 * 2**20
        self._queued_bytes = 0

    def copy(self, tensor: int, src: int, offset: int, n_bytes: int) -> None:
        """`n_bytes` from host address `src` to `offset` in `tensor` (an address), as one piece."""
        self._queued_bytes += n_bytes
        if self.backend is None or self._queued_bytes > RPC_QUEUE_BYTES:
            self._queued_bytes = 0
            self.base.ggml_backend_tensor_set(tensor, src, offset, n_bytes)
        else:
            self.base.ggml_backend_tensor_set_async(self.backend, tensor, src, offset, n_bytes)

    def close(self) -> None:
        if self.backend:
            self.base.ggml_backend_free(self.backend)
            self.backend = None


def check_tensor_layout(sample_ptr: int) -> str | None:
    """None when our mirror matches the library on a real tensor, else what differs."""
    g = lib()
    overhead = int(g.base.ggml_tensor_overhead())
    if overhead < ctypes.sizeof(Tensor) or overhead - ctypes.sizeof(Tensor) > 64:
        return f"ggml_tensor_overhead() is {overhead}, our struct is {ctypes.sizeof(Tensor)}"
    t = tensor_at(sample_ptr)
    name = (g.base.ggml_get_name(sample_ptr) or b"").decode()
    if t.name.decode(errors="replace") != name:
        return f"tensor name at the mirrored offset is {t.name!r}, ggml says {name!r}"
    elements = t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3]
    if elements <= 0 or int(g.base.ggml_nbytes(sample_ptr)) != t.nb[3] * t.ne[3]:
        return "tensor shape or strides at the mirrored offsets disagree with ggml_nbytes"
    return None


def device_handles() -> list[int]:
    g = lib()
    return [g.core.ggml_backend_dev_get(i) for i in range(g.core.ggml_backend_dev_count())]


def device_name(dev: int) -> str:
    return (lib().base.ggml_backend_dev_name(dev) or b"?").decode()


def device_description(dev: int) -> str:
    return (lib().base.ggml_backend_dev_description(dev) or b"").decode()


def device_kind(dev: int) -> str:
    return DEVICE_TYPES.get(lib().base.ggml_backend_dev_type(dev), "unknown")


def device_memory(dev: int) -> tuple[int, int]:
    free, total = c_size_t(0), c_size_t(0)
    lib().base.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    return int(free.value), int(total.value)


def device_reg_name(dev: int) -> str:
    g = lib()
    reg = g.base.ggml_backend_dev_backend_reg(dev)
    return (g.base.ggml_backend_reg_name(reg) or b"").decode() if reg else ""


def cpu_extra_buffer_types() -> list[str]:
    """Names of the CPU backend's extra buffer types (e.g. CPU_REPACK, AMX); [] if unknown."""
    try:
        g = lib()
        core, base = g.core, g.base
        core.ggml_backend_dev_by_type.restype = ctypes.c_void_p
        core.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
        dev = core.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
        if not dev:
            return []
        base.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
        base.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
        base.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
        base.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        reg = base.ggml_backend_dev_backend_reg(dev)
        addr = base.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
        if not addr:
            return []
        fn = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(addr)
        arr = fn(dev)
        base.ggml_backend_buft_name.restype = ctypes.c_char_p
        base.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
        names = []
        i = 0
        while arr and arr[i]:
            names.append(base.ggml_backend_buft_name(arr[i]).decode(errors="replace"))
            i += 1
        return names
    except (AttributeError, OSError):
        return []
