"""How fast bytes reach a device: timed host→device copies into one device buffer. Used to
deal layers over devices, by calibration and by the swap benchmark. Engine thread."""
from __future__ import annotations

import ctypes
import time
from typing import TYPE_CHECKING

from engine.errors import EbbError
from engine.llama import ggml
from engine.llama.devices import find_device, wait_until_done

if TYPE_CHECKING:
    import numpy as np  # imported where used: numpy is not needed before the first token


def _timed_copies(copier: ggml.Copier, device: str, t: ggml.Tensor, src: np.ndarray,
                  piece: int) -> float:
    """Seconds to copy `src` into the device buffer behind `t` in copies of `piece` bytes (sent
    as the live mover sends them), until the device has it all."""
    wait_until_done(device)
    t0 = time.perf_counter()
    for off in range(0, src.size, piece):
        copier.copy(ctypes.addressof(t), src.ctypes.data + off, off, min(piece, src.size - off))
    wait_until_done(device)
    return time.perf_counter() - t0


COPY_PIECES = (2**19, 1 * 2**20, 4 * 2**20, 16 * 2**20, 0)  # 0: the whole buffer in one copy


def measure_bandwidth(device: str, n_bytes: int = 64 * 2**20, repeats: int = 3,
                      typical: bool = False, pieces: tuple[int, ...] = COPY_PIECES) -> float:
    """Host→device copy speed: timed ggml_backend_tensor_set of `n_bytes` into one device
    buffer (touched once first, so no first-use page faults count), until the device has it.
    By default the best the link gives: copies of each size in `pieces` (0: one whole copy),
    the best rate of `repeats` tries of each (a limit). `typical`: the median of `repeats` tries
    in the pieces a restore copies in (a prediction). Copies are sent as the live mover sends
    them (`ggml.Copier`: queued to a remote device)."""
    import statistics

    import numpy as np

    g = ggml.lib()
    dev = find_device(device)
    buft = g.base.ggml_backend_dev_buffer_type(dev.handle)
    src = np.resize(np.arange(256, dtype=np.uint8), n_bytes)  # any bytes: nothing compresses
    buf = g.base.ggml_backend_buft_alloc_buffer(buft, n_bytes)
    if not buf:
        raise EbbError(f"could not allocate {n_bytes >> 20} MiB to measure bandwidth")
    copier = ggml.Copier(dev.handle, dev.remote)
    try:
        t = ggml.bytes_view(buf, n_bytes)
        _timed_copies(copier, device, t, src, min(n_bytes, 16 * 2**20))  # first use: pages appear
        if typical:
            piece = min(n_bytes, copier.piece_bytes)
            return n_bytes / statistics.median(_timed_copies(copier, device, t, src, piece)
                                               for _ in range(repeats))
        sizes = sorted({min(n_bytes, p) if p else n_bytes for p in pieces})
        best = min(_timed_copies(copier, device, t, src, piece) for piece in sizes for _ in range(repeats))
    finally:
        copier.close()
        g.base.ggml_backend_buffer_free(buf)
    return n_bytes / best
