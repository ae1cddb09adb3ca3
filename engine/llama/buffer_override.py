"""llama.cpp's tensor buffer-type overrides (`--override-tensor` in its tools) as the ctypes
array `llama_model_params.tensor_buft_overrides` takes: which tensors (a regex) live in which
device's memory, or the CPU's."""
from __future__ import annotations

import ctypes
from typing import Any


class _BuftOverride(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def override_array(overrides: tuple[tuple[str, str], ...]) -> Any:
    from engine.llama import ggml
    from engine.llama.devices import find_device

    g = ggml.lib()
    arr = (_BuftOverride * (len(overrides) + 1))()
    for i, (pattern, dev) in enumerate(overrides):
        buft = (g.base.ggml_backend_cpu_buffer_type() if dev == "CPU"
                else g.base.ggml_backend_dev_buffer_type(find_device(dev).handle))
        arr[i].pattern, arr[i].buft = pattern.encode(), buft
    return arr
