"""The live mover: move single layers of a running model between host and accelerator.

The model is loaded with every layer assigned to the accelerator (so its KV cache and compute
live there) but the weights of all repeating layers forced to host buffers, in plain GGUF
layout (no CPU repacking). Promoting layer N allocates one device buffer, re-points each of its
weight tensors there and copies the host bytes in; evicting re-points them back at their host
copies and frees the buffer (weights are read-only: nothing is copied back). After any move the
context re-schedules, so ops run where their weights now live.

Only the public ggml-backend API and the public `struct ggml_tensor` layout are used; the
weight tensors are found from one decode through `cb_eval`. A self-test at load compares logits
with the reload mover's and refuses to run on any mismatch. Owned by the engine's thread;
never call while a decode or encode runs.
"""
from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from engine.errors import EbbError
from engine.llama import ggml

if TYPE_CHECKING:
    import numpy as np  # imported where used: numpy is not needed before the first token

_LAYER_NAME = re.compile(rb"^blk\.(\d+)\.")


@dataclass
class _Moved:
    group: int  # the device buffer it shares with the layers promoted together
    n_bytes: int


# A layer's tensor structs further apart than this are pointed one by one (see `_Fields`).
MAX_FIELDS_SPAN_BYTES = 64 * 2**20
_FIELDS = ("buffer", "data", "extra")


class _Fields:
    """The `buffer`, `data` and `extra` fields of weight tensors (one layer's, or those of all
    the layers promoted into one buffer), written in a few numpy stores rather than three
    ctypes writes per tensor (a restore points a few hundred tensors; one by one that took
    0.6 ms of Python, a layer at a time 0.15 ms). The structs lie in the model's ggml
    context, side by side: one uint64 view spans them and only their fields' words are touched.
    Structs too far apart or not 8-byte aligned are written one by one. `host` holds the
    fields as the model loaded them (the layer in RAM); they do not change while it lives."""

    def __init__(self, ptrs: list[int], views: list[ggml.Tensor]) -> None:
        import numpy as np

        self.views = views
        lo, hi = min(ptrs), max(ptrs) + ctypes.sizeof(ggml.Tensor)
        self.mem: np.ndarray | None = None
        if hi - lo <= MAX_FIELDS_SPAN_BYTES and all((p - lo) % 8 == 0 for p in ptrs):
            words = (ctypes.c_uint64 * ((hi - lo) // 8)).from_address(lo)
            self.mem = np.ctypeslib.as_array(words)
            at = np.array(ptrs, dtype=np.uint64) - np.uint64(lo)
            self.idx = [(at + np.uint64(getattr(ggml.Tensor, f).offset)) // np.uint64(8) for f in _FIELDS]
        self.host = self.read()

    def write(self, buffer: Any, data: Any, extra: Any) -> None:
        """Set every tensor's fields, each from one value or one per tensor (0: NULL)."""
        import numpy as np

        values = (buffer, data, extra)
        if self.mem is not None:
            for idx, v in zip(self.idx, values):
                self.mem[idx] = v
            return
        cols = [np.broadcast_to(np.asarray(v, dtype=np.uint64), (len(self.views),)) for v in values]
        for i, view in enumerate(self.views):
            for f, col in zip(_FIELDS, cols):
                setattr(view, f, int(col[i]) or None)

    def read(self) -> list[Any]:
        """The fields as they are now, in `write`'s order."""
        import numpy as np

        if self.mem is not None:
            return [self.mem[idx].copy() for idx in self.idx]
        return [np.array([getattr(v, f) or 0 for v in self.views], dtype=np.uint64) for f in _FIELDS]

    def to_host(self) -> None:
        self.write(*self.host)


@dataclass
class _Group:
    buffer: int
    alloc_bytes: int
    layers: set[int]
    fields: _Fields  # every tensor of the layers promoted together, pointed in one go


@dataclass
class MoveStats:
    """Device buffers allocated and freed so far (a leak shows as allocs > frees + held)."""
    n_allocs: int = 0
    n_frees: int = 0


# Copies of neighbouring tensors are merged, then sent in pieces of `ggml.Copier.piece_bytes`
# (over RPC every copy is one message: tensor-sized ~0.3 MiB and whole 30 MiB groups were both
# slower than 1 MiB pieces queued up to 4 MiB at a time; see `ggml.RPC_COPY_PIECE_BYTES`).
# Host bytes between two tensors that may be copied along rather than start a new copy.
MAX_COPY_GAP_BYTES = 4096


@dataclass(frozen=True)
class Entry:
    """One weight tensor to promote: its pointer, host address, bytes, device size, and the
    host buffer it lives in."""
    ptr: int
    host: int
    n_bytes: int
    alloc_bytes: int
    host_buffer: int = 0


@dataclass(frozen=True)
class Layout:
    offsets: list[int]  # device offset of each entry, in the entries' order
    copies: list[tuple[int, int, int]]  # (host address, device offset, bytes), each <= chunk
    zero_pads: list[tuple[int, int]]  # (device offset, bytes): row padding to zero
    total_bytes: int


def _align_up(n: int, align: int) -> int:
    return -(-n // align) * align


def layout_copies(entries: list[Entry], align: int, chunk_bytes: int,
                  max_gap_bytes: int = MAX_COPY_GAP_BYTES,
                  whole_over_bytes: int | None = None) -> Layout:
    """Place `entries` in one device buffer. A tensor that follows its neighbour in the same host
    buffer (a gap of at most `max_gap_bytes`, the same offset modulo `align`, and the neighbour
    needs no row padding) keeps its host distance on the device, so the pair is one contiguous
    range (the gap's bytes go along, never past the host buffer);
    each range is copied in pieces of at most `chunk_bytes`. A tensor of more than
    `whole_over_bytes` (when given) joins no neighbour and goes over in one copy of exactly its
    bytes: ggml's RPC client then sends a hash first, and a server whose cache has those bytes
    takes them from its disk. Pure: no ggml calls."""
    offsets = [0] * len(entries)
    runs: list[list[int]] = []  # [host start, device start, bytes, whole]
    pads: list[tuple[int, int]] = []
    end = 0  # device bytes used so far
    prev: Entry | None = None
    for i in sorted(range(len(entries)), key=lambda k: entries[k].host):
        e = entries[i]
        whole = whole_over_bytes is not None and e.n_bytes > whole_over_bytes
        run = runs[-1] if runs else None
        joins = (run is not None and prev is not None and not whole and not run[3]
                 and prev.alloc_bytes == prev.n_bytes
                 and prev.host_buffer == e.host_buffer
                 and 0 <= e.host - (run[0] + run[2]) <= max_gap_bytes
                 and (run[1] + e.host - run[0]) % align == 0)
        if joins:
            assert run is not None
            offsets[i] = run[1] + e.host - run[0]
            run[2] = e.host - run[0] + e.n_bytes
        else:
            offsets[i] = _align_up(end, align)
            runs.append([e.host, offsets[i], e.n_bytes, int(whole)])
        if e.alloc_bytes > e.n_bytes:
            pads.append((offsets[i] + e.n_bytes, e.alloc_bytes - e.n_bytes))
        end = max(end, offsets[i] + e.alloc_bytes)
        prev = e
    copies = [(host + k, dev + k, n if whole else min(chunk_bytes, n - k))
              for host, dev, n, whole in runs for k in range(0, n, n if whole else chunk_bytes)]
    return Layout(offsets, copies, pads, _align_up(end, align))


def discover_layer_weights(decode_one: Callable[[Any], None]) -> dict[int, list[int]]:
    """Run one decode through `decode_one(cb_eval)` and collect, per layer, the host weight
    tensors its graph reads. Keyed by pointer (tied embeddings share a name)."""
    from engine.llama.binding import binding

    g = ggml.lib()
    found: dict[int, int] = {}

    def on_node(node: int, ask: bool, _user: Any) -> bool:
        if not ask:
            return True  # "observe" must return True or the graph aborts
        t = ggml.tensor_at(node)
        for src in t.src:
            if not src or src in found:
                continue
            s = ggml.tensor_at(src)
            if s.buffer and g.base.ggml_backend_buffer_get_usage(s.buffer) == ggml.BUFFER_USAGE_WEIGHTS:
                m = _LAYER_NAME.match(s.name)
                if m and g.base.ggml_backend_buffer_is_host(s.buffer):
                    found[src] = int(m.group(1))
        return False

    cb = binding().ggml_backend_sched_eval_callback(on_node)
    decode_one(cb)
    layers: dict[int, list[int]] = {}
    for ptr, layer in found.items():
        layers.setdefault(layer, []).append(ptr)
    return layers


class LiveMover:
    """Promotes and evicts layers of one loaded model (see module docstring)."""

    def __init__(self, layer_tensors: dict[int, list[int]], accel_handle: int,
                 reschedule: Callable[[], None], remote: bool = False) -> None:
        self.g = ggml.lib()
        self.remote = remote
        self.layers = layer_tensors
        self.buft = self.g.base.ggml_backend_dev_buffer_type(accel_handle)
        self.align = int(self.g.base.ggml_backend_buft_get_alignment(self.buft))
        self._reschedule = reschedule
        self._moved: dict[int, _Moved] = {}
        self._staging: np.ndarray | None = None
        self._groups: dict[int, _Group] = {}
        self._next_group = 0
        # what does not change while the model lives, asked once: each tensor's view, each
        # layer's host entries, the device layout of each group of layers promoted together
        self._views: dict[int, ggml.Tensor] = {}
        self._entries: dict[int, list[Entry]] = {}
        self._fields: dict[int, _Fields] = {}
        self._layer_bytes: dict[int, int] = {}
        self._layouts: dict[tuple[int, ...], tuple[Layout, np.ndarray, _Fields]] = {}
        self.stats = MoveStats()
        sample = next((p for ptrs in layer_tensors.values() for p in ptrs), None)
        problem = "no layer weights found in host buffers" if sample is None else \
            ggml.check_tensor_layout(sample)
        if problem:
            raise EbbError(f"live mover unavailable: {problem}")
        self._copier = ggml.Copier(accel_handle, remote)

    def layer_bytes(self, layer: int) -> int:
        n = self._layer_bytes.get(layer)
        if n is None:  # a ctypes call per tensor: asked once (a restore groups by it)
            n = self._layer_bytes[layer] = sum(int(self.g.base.ggml_nbytes(p))
                                               for p in self.layers.get(layer, []))
        return n

    def on_device(self) -> list[int]:
        return sorted(self._moved)

    def device_bytes(self) -> int:
        """Bytes of device buffers this mover holds now."""
        return sum(g.alloc_bytes for g in self._groups.values())

    def n_buffers(self) -> int:
        """Device buffers this mover holds now (neighbouring layers may share one)."""
        return len(self._groups)

    def group_of(self, layer: int) -> list[int]:
        """The layers that share `layer`'s device buffer: evicting frees it only with all."""
        moved = self._moved.get(layer)
        return sorted(self._groups[moved.group].layers) if moved else []

    def _view(self, ptr: int) -> ggml.Tensor:
        view = self._views.get(ptr)
        if view is None:
            view = self._views[ptr] = ggml.tensor_at(ptr)
        return view

    def _entries_of(self, layer: int) -> list[Entry]:
        """The layer's tensors as they lie on the host (asked while the layer is there), with
        their aligned device sizes (a remote device answers those over the network: once)."""
        entries = self._entries.get(layer)
        if entries is None:
            b = self.g.base
            entries = [Entry(p, int(t.data), int(b.ggml_nbytes(p)),
                             _align_up(int(b.ggml_backend_buft_get_alloc_size(self.buft, p)), self.align),
                             int(t.buffer))
                       for p in self.layers[layer] for t in (self._view(p),)]
            self._entries[layer] = entries
            self._fields[layer] = _Fields([e.ptr for e in entries], [self._view(e.ptr) for e in entries])
        return entries

    def promote(self, layer: int) -> int:
        """Copy one layer to the device (its own buffer). Bytes copied."""
        return self.promote_many([layer])

    def promote_many(self, layers: list[int]) -> int:
        """Copy `layers`' weights to the accelerator in one buffer and point the model at them.
        The device buffer mirrors the host layout where it can, so neighbouring tensors go over
        in a few large copies (`layout_copies`). Bytes of tensor data copied."""
        layers = [la for la in layers if la not in self._moved and la in self.layers]
        if not layers:
            return 0
        import numpy as np

        b = self.g.base
        entries = [e for la in layers for e in self._entries_of(la)]
        key = tuple(layers)
        cached = self._layouts.get(key)
        if cached is None:  # asked while the layers are on the host: `fields.host` is theirs
            layout = layout_copies(entries, self.align, self._copier.piece_bytes,
                                   whole_over_bytes=ggml.RPC_HASH_THRESHOLD_BYTES if self.remote else None)
            cached = self._layouts[key] = (layout, np.array(layout.offsets, dtype=np.uint64),
                                           _Fields([e.ptr for e in entries],
                                                   [self._view(e.ptr) for e in entries]))
        layout, offsets, fields = cached
        buf = b.ggml_backend_buft_alloc_buffer(self.buft, layout.total_bytes)
        if not buf:
            raise EbbError(f"the accelerator is out of memory moving {len(layers)} layers "
                           f"({layout.total_bytes / 2**20:.1f} MiB)")
        self.stats.n_allocs += 1
        b.ggml_backend_buffer_set_usage(buf, ggml.BUFFER_USAGE_WEIGHTS)
        base = int(b.ggml_backend_buffer_get_base(buf))
        whole = ggml.bytes_view(buf, layout.total_bytes)  # for the copies and the row padding
        try:
            if self.remote:
                # ggml_backend_tensor_alloc would ask the server to initialise each quantized
                # tensor and wait for it (a round trip each) only to zero its row padding:
                # point the tensors ourselves and send the zeros (copies need no reply).
                fields.write(buf, offsets + np.uint64(base), 0)
                for offset, n in layout.zero_pads:
                    self._copier.copy(ctypes.addressof(whole), self._zeros(n).ctypes.data, offset, n)
            else:  # ggml_backend_tensor_alloc places only unplaced tensors
                fields.write(0, 0, fields.host[2])
                for e, offset in zip(entries, layout.offsets):
                    if b.ggml_backend_tensor_alloc(buf, e.ptr, base + offset) != 0:
                        raise EbbError("ggml could not place a tensor of layer "
                                       f"{self._layer_of(e.ptr, layers)} on the device")
            for host, offset, n in layout.copies:  # the last may be on their way on return
                self._copier.copy(ctypes.addressof(whole), host, offset, n)
        except BaseException:
            fields.to_host()
            b.ggml_backend_buffer_free(buf)
            self.stats.n_frees += 1
            raise
        gid = self._next_group
        self._next_group += 1
        self._groups[gid] = _Group(buf, layout.total_bytes, set(layers), fields)
        copied = 0
        for la in layers:
            n = sum(e.n_bytes for e in self._entries[la])
            self._moved[la] = _Moved(gid, n)
            copied += n
        return copied

    def _layer_of(self, ptr: int, layers: list[int]) -> int:
        return next(la for la in layers if ptr in self.layers[la])

    def _zeros(self, n_bytes: int) -> np.ndarray:
        import numpy as np

        if self._staging is None or self._staging.size < n_bytes:
            self._staging = np.zeros(n_bytes, dtype=np.uint8)
        return self._staging

    def evict(self, layer: int) -> int:
        """Point `layer` back at its host copy; free its device buffer once no layer uses it.
        Returns the device bytes freed."""
        return self.evict_many([layer])

    def evict_many(self, layers: list[int]) -> int:
        """`evict` each of `layers`; the layers of a buffer that all leave are pointed back in
        one go. Returns the device bytes freed."""
        leaving: dict[int, list[int]] = {}
        for layer in layers:
            moved = self._moved.pop(layer, None)
            if moved is not None:
                leaving.setdefault(moved.group, []).append(layer)
        freed = 0
        for gid, gone in leaving.items():
            group = self._groups[gid]
            if group.layers == set(gone):
                group.fields.to_host()
            else:
                for layer in gone:
                    self._fields[layer].to_host()
            group.layers.difference_update(gone)
            if not group.layers:
                self.g.base.ggml_backend_buffer_free(group.buffer)
                del self._groups[gid]
                self.stats.n_frees += 1
                freed += group.alloc_bytes
        return freed

    def detach(self, layer: int) -> tuple[int, list[Any]]:
        """Point a promoted `layer` at its host copy as `evict` does, but keep its device buffer
        and bytes; `reattach` with the returned fields points it back with nothing copied
        (the self-test checks both states without sending the layer twice)."""
        assert layer in self._moved
        here = (layer, self._fields[layer].read())
        self._fields[layer].to_host()
        return here

    def reattach(self, fields: tuple[int, list[Any]]) -> None:
        layer, values = fields
        self._fields[layer].write(*values)

    def reschedule(self) -> None:
        self._reschedule()

    def close(self) -> None:
        """Evict everything (the model must still be alive)."""
        for layer in list(self._moved):
            self.evict(layer)
        self._copier.close()
