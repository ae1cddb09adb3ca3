"""Read a GGUF's metadata and tensor table into plain data (a reader of our own: see _Header).

Pure data out; no llama.cpp. Any thread may call it.
"""
from __future__ import annotations

import mmap
import re
import struct
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.errors import EbbError
from engine.gguf import kept_headers
from engine.gguf.families import pairing_problem, projector_family
from engine.gguf.ggml_types import UnknownTensorType, tensor_bytes

GGUF_MAGIC = b"GGUF"
KV_CACHE_BYTES_PER_ELEMENT = 2  # llama.cpp's default KV cache type is f16
_LAYER_RE = re.compile(r"^(?:blk|v\.blk)\.(\d+)\.")
UNSTATED_CONTEXT = 4096  # the context of a model whose header does not say its length


@dataclass(frozen=True)
class TensorEntry:
    name: str
    type_name: str
    shape: tuple[int, ...]  # ggml order: ne[0] is the row length
    n_bytes: int
    data_offset: int


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    file_bytes: int
    metadata: dict[str, Any]
    tensors: tuple[TensorEntry, ...]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    def tensor(self, name: str) -> TensorEntry | None:
        return next((t for t in self.tensors if t.name == name), None)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)


# GGUF value types (gguf.GGUFValueType): struct format of each scalar
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
MAX_ARRAY_KEPT = 4096  # longer arrays (the vocabulary, its merges and scores) are skipped


class _Header:
    """A GGUF header read straight from the file's bytes (mmap): the values Ebb needs are
    parsed; long arrays are stepped over by their lengths, never turned into Python objects
    (the `gguf` reader built 98k strings for SmolLM2's vocabulary: 2.7 s per open)."""

    def __init__(self, buf: Any) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        raw = bytes(self.buf[self.pos:self.pos + n])
        if len(raw) != n:
            raise ValueError("the header ends inside a string")
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.take("<I"), self.take("<Q")
            if count > MAX_ARRAY_KEPT:
                self.skip_array(etype, count)
                return _SKIPPED
            return [self.value(etype) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype}")

    def skip_array(self, etype: int, count: int) -> None:
        if etype in _SCALARS:
            self.pos += struct.calcsize(_SCALARS[etype]) * count
        elif etype == _STRING:
            unpack, buf, pos = _U64.unpack_from, self.buf, self.pos  # compiled once: 2x faster
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
            self.pos = pos
        else:
            for _ in range(count):
                self.value(etype)


_SKIPPED = object()
_U64 = struct.Struct("<Q")


def _parse(buf: Any, file_bytes: int) -> tuple[dict[str, Any], list[TensorEntry]]:
    h = _Header(buf)
    if h.take("<4s") != GGUF_MAGIC:
        raise ValueError("no GGUF magic")
    version = h.take("<I")
    if version < 2:
        raise ValueError(f"GGUF version {version} is too old (llama.cpp reads 2 and 3)")
    n_tensors, n_kv = h.take("<Q"), h.take("<Q")
    if n_tensors > 1 << 20 or n_kv > 1 << 20:
        raise ValueError(f"implausible counts ({n_tensors} tensors, {n_kv} values)")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = h.string()
        value = h.value(h.take("<I"))
        if value is not _SKIPPED:
            metadata[key] = value
    raw = []
    for _ in range(n_tensors):
        name = h.string()
        dims = tuple(h.take("<Q") for _ in range(h.take("<I")))
        raw.append((name, dims, h.take("<I"), h.take("<Q")))
    if h.pos > len(buf):  # stepped over an array past the end
        raise ValueError("the header ends inside an array")
    align = int(metadata.get("general.alignment", 32) or 32)
    data_start = (h.pos + align - 1) // align * align
    tensors = []
    for name, dims, ttype, offset in raw:
        n_elems = 1
        for d in dims:
            n_elems *= int(d)
        tname, nbytes = tensor_bytes(ttype, n_elems)
        tensors.append(TensorEntry(name, tname, dims, nbytes, data_start + offset))
    return metadata, tensors


class HeaderIncomplete(Exception):
    """The bytes given end before the header and tensor table do: fetch more."""


def not_gguf_words(head: bytes) -> str:
    """What a file that should be a GGUF is instead, in words (never Python's bytes repr): "a web
    page (HTML)", "text that starts “hell”", "its first bytes are 4A 3F 00 12"."""
    head = bytes(head[:64])
    if not head:
        return "it is empty"
    lower = head.lstrip().lower()
    if lower.startswith((b"<!doctype html", b"<html", b"<?xml", b"<")):
        return "it is a web page (HTML or XML), not the model: a download that went wrong?"
    if head.startswith(b"version https://git-lfs"):
        return "it is a Git LFS pointer, not the file itself"
    if head.startswith(b"PK\x03\x04"):
        return "it is a ZIP archive: unpack it first"
    if head.startswith(b"\x1f\x8b"):
        return "it is gzip-compressed: unpack it first"
    try:
        text = head[:16].decode("utf-8")
    except UnicodeDecodeError:
        text = ""
    if text and all(c.isprintable() or c in "\t\r\n" for c in text):
        return f"it is text that starts “{text.strip()[:12].rstrip()}”"
    return "its first bytes are " + " ".join(f"{b:02X}" for b in head[:4])


def parse_gguf_prefix(prefix: bytes, file_bytes: int, name: str) -> GGUFFile:
    """The header and tensor table from the first bytes of a GGUF of `file_bytes` bytes (a
    remote file read by HTTP ranges). Raises HeaderIncomplete when `prefix` ends inside them,
    EbbError when the file is not a GGUF or is damaged; the result is what `read_gguf` gives
    for the whole file."""
    if prefix[:4] != GGUF_MAGIC[:len(prefix[:4])]:
        raise EbbError(f"{name} is not a GGUF file ({not_gguf_words(prefix)})",
                       "pick a .gguf file in llama.cpp's format")
    try:
        metadata, tensors = _parse(prefix, file_bytes)
    except UnknownTensorType as exc:
        raise EbbError(f"{name} holds tensors of a type this version of Ebb does not know (ggml "
                       f"type {exc.type_id})", "pick another quantisation, or update Ebb") from None
    except (struct.error, ValueError, IndexError) as exc:
        if len(prefix) < file_bytes:
            raise HeaderIncomplete(str(exc)) from None
        raise EbbError(f"{name} is a damaged GGUF file ({exc})", "pick another file") from None
    end = max((t.data_offset + t.n_bytes for t in tensors), default=0)
    if end > file_bytes:
        raise EbbError(f"{name} is truncated: its tensors need {end} bytes, the file has "
                       f"{file_bytes}", "pick another file")
    return GGUFFile(Path(name), file_bytes, metadata, tuple(tensors))


# llama.cpp's split files (gguf-split, convert --split-max-tensors): PREFIX-00001-of-00003.gguf
SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def read_gguf(path: Path) -> GGUFFile:
    """Parse header and tensor table; raise EbbError for anything that is not a whole GGUF. A
    split model is read whole from its first part (llama.cpp loads it so): every part's tensors,
    the first part's metadata (a split model read as its first part planned 30/30 layers where
    13 fit); a later part, or a set with a part missing, is an EbbError naming what to do."""
    gf = _read_one(Path(path))
    count = int(gf.metadata.get("split.count") or 1)
    if count <= 1:
        return gf
    no = int(gf.metadata.get("split.no") or 0)
    m = SPLIT_NAME.match(gf.path.name)
    if m is None:
        raise EbbError(f"{gf.path.name} is part {no + 1} of a model split in {count}, and its name "
                       "does not say where the other parts are (NAME-00001-of-"
                       f"{count:05d}.gguf)", "give the parts llama.cpp's split names")
    first = gf.path.with_name(f"{m['stem']}-00001-of-{count:05d}.gguf")
    if no != 0:
        raise EbbError(f"{gf.path.name} is part {no + 1} of {count} of a split model",
                       f"open its first part, {first.name}")
    if int(m["count"]) != count:
        raise EbbError(f"{gf.path.name} says the model is split in {count} parts, and its name "
                       f"says {int(m['count'])}: the set is damaged or mixed", "download the set again")
    names = [gf.path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(2, count + 1)]
    missing = [p.name for p in names if not p.is_file()]
    if missing:
        raise EbbError(f"{gf.path.name} is the first of {count} parts of a split model, and "
                       f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing beside it",
                       "download every part into the same folder")
    return merge_parts([gf, *(_read_one(p) for p in names)])


def check_parts(parts: list[GGUFFile]) -> None:
    """A split set is whole and in order as llama.cpp will load it: part i says it is part i
    (`split.no`) of as many as there are (`split.count`), and the tensors add up to what the
    first part says (`split.tensors.count`); else an EbbError naming the part. (llama.cpp
    refuses such a set only when it loads it.)"""
    count = len(parts)
    for i, part in enumerate(parts):
        no = int(part.metadata.get("split.no") or 0)
        says = int(part.metadata.get("split.count") or 1)
        name = part.path.name
        if says != count:
            raise EbbError(f"{name} says the model is split in {says} parts, and the set has {count}",
                           "download the whole set again")
        if no != i:
            raise EbbError(f"{name} is part {i + 1} of the split model by its name, and part {no + 1} "
                           "by its header: the parts are mixed up", "download the set again")
    n_tensors = sum(len(p.tensors) for p in parts)
    want = parts[0].metadata.get("split.tensors.count")
    if want is not None and int(want) != n_tensors:
        raise EbbError(f"{parts[0].path.name} says the split model has {int(want)} tensors, and its "
                       f"{count} parts hold {n_tensors}", "download the set again")


def merge_parts(parts: list[GGUFFile]) -> GGUFFile:
    """A split GGUF's parts as one file (read here or from the Hub), checked (`check_parts`):
    the first part's path and metadata, every part's tensors and bytes."""
    if len(parts) == 1 and int(parts[0].metadata.get("split.count") or 1) <= 1:
        return parts[0]
    check_parts(parts)
    return replace(parts[0], file_bytes=sum(p.file_bytes for p in parts),
                   tensors=tuple(t for p in parts for t in p.tensors))


# Headers read, by file version (engine/gguf/kept_headers.py): the window's load and Tune read
# each header once into a ModelFiles (engine/gguf/model_files.py) and pass it down; the CLI,
# the benches and the endpoint ask again, and get the header parsed before. GGUFFile is frozen
# and nobody writes its metadata: shared safely. A version seen by an earlier run is read back
# from disk instead of parsed.
_HEADERS: OrderedDict[kept_headers.Version, GGUFFile] = OrderedDict()
_HEADERS_KEPT = 8
_HEADERS_LOCK = threading.Lock()
HEADER_READS = [0]  # files parsed in this process: what a test of "read once" counts


def _read_one(path: Path) -> GGUFFile:
    """One file's header and tensor table, parsed once per version of the file."""
    try:
        version = kept_headers.version_of(path)
    except OSError:
        return _parse_file(path)  # it says what is wrong
    with _HEADERS_LOCK:
        known = _HEADERS.get(version)
        if known is not None:
            _HEADERS.move_to_end(version)
            return known if known.path == path else replace(known, path=path)
    gf = _from_kept(path, kept_headers.load(version))
    if gf is None:
        gf = _parse_file(path)
        kept_headers.keep(version, gf.file_bytes, gf.metadata,
                          [[t.name, t.type_name, list(t.shape), t.n_bytes, t.data_offset] for t in gf.tensors])
    with _HEADERS_LOCK:
        _HEADERS[version] = gf
        while len(_HEADERS) > _HEADERS_KEPT:
            _HEADERS.popitem(last=False)
    return gf


def _from_kept(path: Path, kept: dict[str, Any] | None) -> GGUFFile | None:
    if kept is None:
        return None
    try:
        tensors = tuple(TensorEntry(str(n), str(t), tuple(int(d) for d in shape), int(b), int(o))
                        for n, t, shape, b, o in kept["tensors"])
        return GGUFFile(path, int(kept["file_bytes"]), dict(kept["metadata"]), tensors)
    except (KeyError, TypeError, ValueError):  # written by another format: parse again
        return None


def _parse_file(path: Path) -> GGUFFile:
    HEADER_READS[0] += 1
    with open(path, "rb") as fh:
        magic = fh.read(4)
        if magic != GGUF_MAGIC:
            raise EbbError(f"{path} is not a GGUF file ({not_gguf_words(magic + fh.read(60))})",
                           "pass a .gguf model file (llama.cpp format)")
        file_bytes = path.stat().st_size
        try:
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                metadata, tensors = _parse(buf, file_bytes)
        except UnknownTensorType as exc:  # not damage: a format newer than this build
            raise EbbError(f"{path} holds tensors of a type this version of Ebb does not know "
                           f"(ggml type {exc.type_id})",
                           "use a file in a common quantisation (Q4_K_M, Q8_0, F16), or update Ebb") from None
        except Exception as exc:  # a damaged file fails in many ways
            raise EbbError(f"{path} is a damaged or truncated GGUF file ({type(exc).__name__}: "
                           f"{exc})", "download the file again") from None
    end = max((t.data_offset + t.n_bytes for t in tensors), default=0)
    if end > file_bytes:
        raise EbbError(f"{path} is truncated: its tensors need {end} bytes, the file has {file_bytes}",
                       "download the file again")
    return GGUFFile(path, file_bytes, metadata, tuple(tensors))


# ---------------------------------------------------------------- language model


@dataclass(frozen=True)
class ModelInfo:
    path: str
    architecture: str
    name: str
    n_layers: int
    n_embd: int
    n_head: int
    n_head_kv: list[int]
    n_ctx_train: int
    n_vocab: int
    file_bytes: int
    tensor_bytes: int
    layer_bytes: list[int]
    non_layer_bytes: int
    non_layer_tensors: dict[str, int]
    kv_bytes_per_token_per_layer: list[int]
    kv_bytes_per_token: int
    has_chat_template: bool
    n_ff: int = 0  # the widest feed-forward layer

    @property
    def max_context(self) -> int:
        """The longest context this model takes: its training length (UNSTATED_CONTEXT when the
        header does not say)."""
        return self.n_ctx_train or UNSTATED_CONTEXT

    def fit_context(self, n_ctx: int) -> int:
        """`n_ctx` as far as this model allows: what planning, what-if and a verdict use for a
        setting larger than the model's context (a session refuses one instead: check_context)."""
        return min(n_ctx, self.max_context)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _per_layer(value: Any, n_layers: int, default: int) -> list[int]:
    if value is None:
        return [default] * n_layers
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)] * n_layers


def _n_vocab(gf: GGUFFile) -> int:
    t = gf.tensor("token_embd.weight")
    if t is not None and len(t.shape) >= 2:
        return t.shape[1]
    return int(gf.metadata.get(f"{gf.architecture}.vocab_size", 0))


def model_info(gf: GGUFFile) -> ModelInfo:
    arch = gf.architecture
    md = gf.metadata
    n_layers = int(md.get(f"{arch}.block_count", 0))
    n_embd = int(md.get(f"{arch}.embedding_length", 0))
    head_raw = md.get(f"{arch}.attention.head_count", 0)
    n_head = int(max(head_raw) if isinstance(head_raw, list) else head_raw)
    heads = _per_layer(head_raw, n_layers, 0)
    heads_kv = _per_layer(md.get(f"{arch}.attention.head_count_kv"), n_layers, 0)
    heads_kv = [kv if kv or not h else h for kv, h in zip(heads_kv, heads)]
    head_dim = n_embd // n_head if n_head else 0
    k_len = int(md.get(f"{arch}.attention.key_length", head_dim))
    v_len = int(md.get(f"{arch}.attention.value_length", head_dim))
    kv_per_layer = [kv * (k_len + v_len) * KV_CACHE_BYTES_PER_ELEMENT for kv in heads_kv]
    layer_bytes = [0] * n_layers
    non_layer: dict[str, int] = {}
    for t in gf.tensors:
        m = _LAYER_RE.match(t.name)
        if m and int(m.group(1)) < n_layers:
            layer_bytes[int(m.group(1))] += t.n_bytes
        else:
            non_layer[t.name] = t.n_bytes
    return ModelInfo(
        path=str(gf.path), architecture=arch, name=str(md.get("general.name", gf.path.stem)),
        n_layers=n_layers, n_embd=n_embd, n_head=n_head, n_head_kv=heads_kv,
        n_ctx_train=int(md.get(f"{arch}.context_length", 0)),
        n_vocab=_n_vocab(gf),
        n_ff=max(_per_layer(md.get(f"{arch}.feed_forward_length"), n_layers, 0) or [0]),
        file_bytes=gf.file_bytes, tensor_bytes=gf.tensor_bytes, layer_bytes=layer_bytes,
        non_layer_bytes=sum(non_layer.values()), non_layer_tensors=non_layer,
        kv_bytes_per_token_per_layer=kv_per_layer, kv_bytes_per_token=sum(kv_per_layer),
        has_chat_template="tokenizer.chat_template" in md,
    )


# ---------------------------------------------------------------- vision projector


@dataclass(frozen=True)
class ProjectorInfo:
    path: str
    projector_type: str
    family: str  # engine/gguf/families.py
    synthetic: bool
    image_size: int
    patch_size: int
    n_embd: int
    n_ff: int
    n_head: int
    n_layers: int
    n_image_tokens: int
    output_width: int
    weight_bytes: int
    compute_buffer_bytes_estimate: int
    compute_buffer_bytes_estimate_flash_attn: int
    # from mtmd once loaded (ProjectorRuntime / probe_projector): its compute buffer reserve
    # and the image tokens of the largest image it takes (dynamic resolution: its cap)
    compute_buffer_bytes_measured: int = 0
    n_image_tokens_measured: int = 0
    sees: bool = True  # a vision encoder: takes pictures
    hears: bool = False  # an audio encoder: takes sound (an omni projector has both)
    names_colours: bool = False  # Ebb's demo: the closed-form colour projector ("ebb.kind")

    @property
    def compute_buffer_bytes(self) -> int:
        return self.compute_buffer_bytes_measured or self.compute_buffer_bytes_estimate

    @property
    def image_tokens(self) -> int:
        """Image tokens to plan one image with: mtmd's count once known, else the header's."""
        return self.n_image_tokens_measured or self.n_image_tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _projector_output_width(gf: GGUFFile) -> int:
    for name in ("mm.2.weight", "mm.model.fc.weight", "mm.model.mlp.3.weight",
                 "mm.input_projection.weight", "mm.a.mlp.2.weight", "mm.a.fc.weight"):
        t = gf.tensor(name)
        if t is not None and len(t.shape) >= 2:
            # A matmul weight's ne[1] is its output width (input_projection is stored transposed).
            return t.shape[0] if name == "mm.input_projection.weight" else t.shape[1]
    return int(gf.metadata.get("clip.vision.projection_dim", 0))


def estimate_compute_buffer_bytes(n_pos: int, n_embd: int, n_ff: int, n_head: int,
                                  image_size: int, flash_attn: bool) -> int:
    """Peak of a ViT encoder graph in ggml's allocator (f32 activations), estimated.

    FFN peak: the residual stream, the up-projection and half again for its activation.
    Attention peak (flash attention off): the n_head x n_pos x n_pos scores plus four streams
    (residual, Q, K, V). Both plus the image in f32. Calibrated against mtmd's reported CPU
    compute buffer for the generated base and large projectors (within 4%, see
    tests/test_projector.py); real projector graphs differ, so treat it as an estimate.
    """
    f32 = 4
    stream = n_pos * n_embd * f32
    image = 3 * image_size * image_size * f32
    ffn_peak = stream + (3 * n_pos * n_ff * f32) // 2
    attention_peak = 0 if flash_attn else n_head * n_pos * n_pos * f32 + 4 * stream
    return max(ffn_peak, attention_peak) + image


# Whisper-like audio encoders: a 30-second chunk is 3000 mel frames, halved by a convolution
AUDIO_CHUNK_FRAMES = 3000
_STACKING = frozenset({"ultravox", "voxtral", "meralion", "glma"})  # frames stacked after it
_AVG_POOLED = frozenset({"qwen2a", "qwen2.5o", "voxtral", "musicflamingo"})  # pooled by 2


def _audio_type(md: dict[str, Any]) -> str:
    return str(md.get("clip.audio.projector_type") or md.get("clip.projector_type", "unknown"))


def audio_chunk_tokens(md: dict[str, Any]) -> tuple[int, int]:
    """(tokens llama.cpp's clip.cpp counts for a 30-second chunk, tokens its graph makes) for a
    Whisper-like audio encoder, from the header. They differ where the count aligns the frames
    to the stack factor before the convolution halves them (Ultravox's real factor 8: 187
    counted, 188 made): clip.cpp then aborts the process when it encodes."""
    kind = _audio_type(md)
    stack = int(md.get("clip.audio.projector.stack_factor", 0) or 0)
    frames = AUDIO_CHUNK_FRAMES
    counted = frames
    if kind in _STACKING and stack > 0:
        counted = -(-frames // stack) * stack // stack
    counted //= 2
    made = frames // 2
    if kind in _AVG_POOLED:
        counted //= 2
        made //= 2
    if kind in _STACKING and stack > 0:
        made = -(-made // stack)
    return counted, made


class SoundRefused(EbbError):
    """A projector that only hears, which this llama.cpp cannot encode sound with (it would
    abort): the language model still runs, for text."""


def audio_count_problem(md: dict[str, Any]) -> str | None:
    """Why llama.cpp would abort encoding sound with this projector, or None."""
    counted, made = audio_chunk_tokens(md)
    if counted != made:
        stack = md.get("clip.audio.projector.stack_factor")
        return (f"the llama.cpp in this Ebb miscounts this {_audio_type(md)} audio encoder's "
                f"tokens (stack factor {stack}: it counts {counted} a chunk, its graph makes "
                f"{made}) and would stop the app when it encodes a clip")
    return None


def projector_info(gf: GGUFFile) -> ProjectorInfo:
    md = gf.metadata
    sees = bool(md.get("clip.has_vision_encoder", False))
    hears = bool(md.get("clip.has_audio_encoder", False))
    if gf.architecture != "clip" or not (sees or hears):
        raise EbbError(f"{gf.path} is not a projector (architecture "
                       f"'{gf.architecture}', no clip vision or audio encoder)",
                       "pass the mmproj .gguf that belongs to the model")
    if hears and (problem := audio_count_problem(md)):
        if not sees:
            raise SoundRefused(f"{gf.path.name}: {problem}",
                               "use a llama.cpp build that counts it right, or another audio model")
        hears = False  # an omni projector: its pictures still work; sound is refused
    if not sees:
        return _audio_projector_info(gf)
    image_size = int(md.get("clip.vision.image_size", 0))
    patch_size = int(md.get("clip.vision.patch_size", 1)) or 1
    n_embd = int(md.get("clip.vision.embedding_length", 0))
    n_ff = int(md.get("clip.vision.feed_forward_length", 0))
    n_head = int(md.get("clip.vision.attention.head_count", 1))
    n_pos = (image_size // patch_size) ** 2 + (1 if gf.tensor("v.class_embd") else 0)
    kw = dict(n_pos=n_pos, n_embd=n_embd, n_ff=n_ff, n_head=n_head, image_size=image_size)
    ptype = str(md.get("clip.vision.projector_type") or md.get("clip.projector_type", "unknown"))
    return ProjectorInfo(
        path=str(gf.path), projector_type=ptype, family=projector_family(ptype),
        synthetic=bool(md.get("ebb.synthetic", False)), image_size=image_size,
        names_colours=md.get("ebb.kind") == "colour",
        patch_size=patch_size, n_embd=n_embd, n_ff=n_ff, n_head=n_head,
        n_layers=int(md.get("clip.vision.block_count", 0)),
        n_image_tokens=(image_size // patch_size) ** 2,
        output_width=_projector_output_width(gf), weight_bytes=gf.tensor_bytes,
        compute_buffer_bytes_estimate=estimate_compute_buffer_bytes(flash_attn=False, **kw),
        compute_buffer_bytes_estimate_flash_attn=estimate_compute_buffer_bytes(flash_attn=True, **kw),
        hears=hears,
    )


def _audio_projector_info(gf: GGUFFile) -> ProjectorInfo:
    """An audio-only projector: its encoder's numbers stand where a vision one's would (a
    30-second chunk in place of the largest picture)."""
    md = gf.metadata
    n_embd = int(md.get("clip.audio.embedding_length", 0))
    n_ff = int(md.get("clip.audio.feed_forward_length", 0))
    n_head = int(md.get("clip.audio.attention.head_count", 1))
    n_mel = int(md.get("clip.audio.num_mel_bins", 128))
    n_pos = AUDIO_CHUNK_FRAMES // 2
    ptype = _audio_type(md)

    def buffer(flash_attn: bool) -> int:  # the mel frames stand for the picture
        return estimate_compute_buffer_bytes(n_pos=n_pos, n_embd=n_embd, n_ff=n_ff, n_head=n_head,
                                             image_size=0, flash_attn=flash_attn) \
            + n_mel * AUDIO_CHUNK_FRAMES * 4
    return ProjectorInfo(
        path=str(gf.path), projector_type=ptype, family=projector_family(ptype),
        synthetic=bool(md.get("ebb.synthetic", False)), image_size=0, patch_size=1,
        n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_layers=int(md.get("clip.audio.block_count", 0)),
        n_image_tokens=audio_chunk_tokens(md)[0], output_width=_projector_output_width(gf),
        weight_bytes=gf.tensor_bytes, compute_buffer_bytes_estimate=buffer(False),
        compute_buffer_bytes_estimate_flash_attn=buffer(True), sees=False, hears=True)


def check_projector_matches(model: ModelInfo, proj: ProjectorInfo) -> None:
    """Raise EbbError when the projector belongs to another family of language model, or its
    output width differs from the model's n_embd."""
    problem = pairing_problem(model.architecture, proj.projector_type)
    if problem:
        raise EbbError(
            f"projector {Path(proj.path).name} ({proj.family}) and model "
            f"{Path(model.path).name} ({model.architecture}) do not belong together: {problem}",
            "use the mmproj file published with this model")
    if proj.output_width and proj.output_width != model.n_embd:
        raise EbbError(
            f"projector {Path(proj.path).name} outputs width {proj.output_width} but model "
            f"{Path(model.path).name} has n_embd {model.n_embd}: they do not belong together",
            "use the mmproj file made for this model (or `ebb-engine make-projector --for MODEL`)")


@dataclass(frozen=True)
class Inspection:
    model: ModelInfo
    projector: ProjectorInfo | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model.to_dict(),
                "projector": self.projector.to_dict() if self.projector else None,
                "notes": self.notes}


def inspect_files(model_path: Path, mmproj_path: Path | None = None) -> Inspection:
    gf = read_gguf(model_path)
    if gf.architecture == "clip":
        raise EbbError(f"{model_path} is a projector (mmproj), not a language model",
                       "pass it with --mmproj and give the language model first")
    model = model_info(gf)
    proj = None
    if mmproj_path is not None:
        proj = projector_info(read_gguf(mmproj_path))
        check_projector_matches(model, proj)
    return Inspection(model, proj)


@dataclass(frozen=True)
class ProjectorChoice:
    path: Path
    family: str  # "" when the file is not a vision projector
    problem: str | None  # why it does not belong with the model; None: it does
    sees: bool = True  # takes pictures
    hears: bool = False  # takes sound


def projector_choices(model: Path, candidates: list[Path]) -> list[ProjectorChoice]:
    """Each candidate projector for `model` with its family and what stops the pair (family,
    width, an audio projector, a damaged file), from the headers alone; fitting ones first."""
    m = model_info(read_gguf(model))
    out = []
    for path in candidates:
        try:
            proj = projector_info(read_gguf(path))
        except EbbError as exc:
            out.append(ProjectorChoice(path, "", exc.what))
            continue
        try:
            check_projector_matches(m, proj)
            out.append(ProjectorChoice(path, proj.family, None, proj.sees, proj.hears))
        except EbbError as exc:
            out.append(ProjectorChoice(path, proj.family, exc.what, proj.sees, proj.hears))
    return sorted(out, key=lambda c: c.problem is not None)
