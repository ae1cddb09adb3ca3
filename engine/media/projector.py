"""A vision projector (mmproj) instance through llama.cpp's mtmd, bound to a loaded model.

The owner thread of the TextRuntime owns this too. Closing frees the mtmd context (and with it
the projector's weights and compute buffer on whatever device held them).
"""
from __future__ import annotations

import contextlib
import ctypes
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import EbbError
from engine.gguf.info import (
    ProjectorInfo,
    check_projector_matches,
    model_info,
    projector_info,
    read_gguf,
)
from engine.llama import log as llama_log
from engine.llama.lib import flash_attn_type, llama
from engine.llama.loaded_model import HoldsModel
from engine.media.images import LoadedMedia

if TYPE_CHECKING:
    import numpy as np  # imported where used: numpy is not needed before the first token

_COMPUTE_RE = re.compile(r"reserve_compute_meta:\s+(\S+?)(?:\[[^\]]*\])? compute buffer size =\s+([\d.]+) MiB")
# bigger than any family's cap, in the shapes that tile differently: they size a dynamic or
# tiling projector's largest image
LARGEST_IMAGES = ((4096, 4096), (4096, 2731), (2731, 4096), (4096, 1024), (1024, 4096))
_MTMD_CHUNK_TEXT = 0
_MTMD_CHUNK_IMAGE = 1
_MTMD_CHUNK_AUDIO = 2
CLIP_SECONDS = 30  # a Whisper-like encoder takes sound in chunks of 30 s
# a clip of exactly k x 30 s makes k + 1 chunks (mtmd pads 30 s of silence and keeps every
# whole chunk): one chunk is measured on a clip a second short of it
ONE_CHUNK_SECONDS = CLIP_SECONDS - 1


@dataclass(frozen=True)
class Encoded:
    n_tokens: int
    embeddings: np.ndarray  # (n_tokens, n_embd_inp) float32
    encode_s: float


@dataclass(frozen=True)
class Bitmap:
    """One picture or clip for the tokenizer: its pixels (RGB) or samples (float32 mono at the
    projector's rate), or only its size (a placeholder: enough to count its tokens and lay out
    its positions, for one whose embeddings are cached). A clip: `width` samples, `audio`."""
    width: int
    height: int
    rgb: bytes | None
    audio: bool = False


@dataclass(frozen=True)
class TextPiece:
    tokens: list[int]


@dataclass(frozen=True)
class MediaPiece:
    """One image chunk of a tokenized prompt (a sliced image gives several)."""
    image: int  # which of the prompt's bitmaps
    index: int  # which chunk of that image
    n_tokens: int
    n_pos: int  # positions it takes (M-RoPE: fewer than its tokens)
    non_causal: bool
    chunk: Any  # the mtmd_input_chunk, valid while its TokenizedPrompt is open
    placeholder: bool


class TokenizedPrompt:
    """mtmd's chunks of a whole prompt: text (wrappers and tile separators included) and
    images. Owns the chunks; close() frees them."""

    def __init__(self, M: Any, chunks: Any, pieces: list[TextPiece | MediaPiece], mctx: Any) -> None:
        self._M, self._chunks = M, chunks
        self.pieces = pieces
        self.mctx = mctx  # the mtmd context that made them (positions, attention)

    def images(self) -> list[MediaPiece]:
        return [p for p in self.pieces if isinstance(p, MediaPiece)]

    def close(self) -> None:
        if self._chunks is not None:
            self._M.mtmd_input_chunks_free(self._chunks)
            self._chunks = None

    def __enter__(self) -> "TokenizedPrompt":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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

    def __init__(self, path: Path, model: HoldsModel, n_threads: int, device: str | None = None,
                 flash_attn: bool | None = None, image_max_tokens: int = 0,
                 info: ProjectorInfo | None = None) -> None:
        self.path = Path(path)
        self.info = info or projector_info(read_gguf(self.path))
        check_projector_matches(model.info, self.info)
        # the width of what the model takes as input embeddings (Qwen3-VL's deepstack: wider)
        self.n_embd = int(llama().llama_model_n_embd_inp(model.model)) or model.info.n_embd
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
            params.flash_attn_type = flash_attn_type(flash_attn)
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
        self.sees = bool(M.mtmd_support_vision(ctx))
        # sound only where Ebb's header check found no count that would abort (info.py)
        self.hears = bool(M.mtmd_support_audio(ctx)) and self.info.hears
        self.sample_rate = int(M.mtmd_get_audio_sample_rate(ctx)) if self.hears else 0

    def decode_audio(self, data: bytes, name: str) -> bytes:
        """A WAV, MP3 or FLAC file's bytes as float32 mono samples at the projector's rate,
        decoded (and resampled) by mtmd's own helper, as llama.cpp's tools decode it."""
        M = self._M
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        llama_log.clear()
        bm = M.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(data), False)
        if not bm:
            raise EbbError(f"{name} could not be decoded as sound: "
                           f"{llama_log.last_error('damaged, or a format the decoder does not know')}",
                           "use a WAV, MP3 or FLAC file")
        try:
            if not M.mtmd_bitmap_is_audio(bm):
                raise EbbError(f"{name} is not a sound clip", "use a WAV, MP3 or FLAC file")
            n = int(M.mtmd_bitmap_get_n_bytes(bm))
            return ctypes.string_at(M.mtmd_bitmap_get_data(bm), n)
        finally:
            M.mtmd_bitmap_free(bm)

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

    def image_tokens(self, width: int, height: int) -> tuple[int, int]:
        """(image tokens, image chunks) mtmd makes of a width x height picture (counted on a
        placeholder: nothing is preprocessed)."""
        with self.tokenize(self.marker, [Bitmap(width, height, None)], add_special=False) as tp:
            pieces = tp.images()
            return sum(p.n_tokens for p in pieces), len(pieces)

    def clip_tokens(self, n_samples: int) -> tuple[int, int]:
        """(tokens, chunks) mtmd makes of a clip of `n_samples` (counted on a placeholder)."""
        with self.tokenize(self.marker, [Bitmap(n_samples, 1, None, audio=True)],
                           add_special=False) as tp:
            pieces = tp.images()
            return sum(p.n_tokens for p in pieces), len(pieces)

    def measured_info(self) -> ProjectorInfo:
        """The header's info with mtmd's numbers: its compute buffer reserve and the tokens of
        the largest picture it takes (a dynamic-resolution family's cap)."""
        if self.sees:
            most = max(self.image_tokens(w, h)[0] for w, h in LARGEST_IMAGES)
        else:  # one chunk of sound: each chunk of a longer clip is as large
            most = self.clip_tokens(ONE_CHUNK_SECONDS * self.sample_rate)[0]
        return replace(self.info, compute_buffer_bytes_measured=self.compute_buffer_bytes,
                       n_image_tokens_measured=most)

    def tokenize(self, text: str, bitmaps: list[Bitmap], add_special: bool) -> TokenizedPrompt:
        """mtmd's chunks of `text`, one marker per bitmap (in order), as llama.cpp's own tools
        make them."""
        M = self._M
        made = []
        chunks = M.mtmd_input_chunks_init()
        try:
            for i, b in enumerate(bitmaps):
                if b.audio:
                    if not self.hears:
                        raise EbbError("this message has a sound clip but the projector does not "
                                       "hear", "load an audio or omni projector, or remove the clip")
                    samples = None if b.rgb is None else \
                        (ctypes.c_float * (len(b.rgb) // 4)).from_buffer_copy(b.rgb)
                    bm = M.mtmd_bitmap_init_from_audio(b.width, samples)
                else:
                    if not self.sees:
                        raise EbbError("this message has a picture but the projector does not "
                                       "see", "load a vision or omni projector, or remove it")
                    buf = None if b.rgb is None else (ctypes.c_uint8 * len(b.rgb)).from_buffer_copy(b.rgb)
                    bm = M.mtmd_bitmap_init(b.width, b.height, buf)
                if not bm:
                    raise EbbError(f"mtmd could not take attachment {i + 1} ({b.width}x{b.height})")
                made.append(bm)
                M.mtmd_bitmap_set_id(bm, str(i).encode())
            raw = text.encode("utf-8")
            inp = M.mtmd_input_text()
            inp.text, inp.text_len = raw, len(raw)
            inp.add_special, inp.parse_special = add_special, True
            arr = (M.mtmd_bitmap_p_ctypes * max(1, len(made)))(*made)
            llama_log.clear()
            rc = M.mtmd_tokenize(self.ctx, chunks, ctypes.byref(inp), arr, len(made))
            if rc != 0:
                raise EbbError(f"mtmd could not preprocess the message's images (code {rc}): "
                               f"{llama_log.last_error('no detail')}", "try another picture")
            pieces = self._pieces(chunks, bitmaps)
        except BaseException:
            M.mtmd_input_chunks_free(chunks)
            raise
        finally:
            for bm in made:
                M.mtmd_bitmap_free(bm)
        return TokenizedPrompt(M, chunks, pieces, self.ctx)

    def _pieces(self, chunks: Any, bitmaps: list[Bitmap]) -> list[TextPiece | MediaPiece]:
        M = self._M
        pieces: list[TextPiece | MediaPiece] = []
        seen: dict[int, int] = {}
        for i in range(M.mtmd_input_chunks_size(chunks)):
            c = M.mtmd_input_chunks_get(chunks, i)
            kind = M.mtmd_input_chunk_get_type(c)
            if kind == _MTMD_CHUNK_TEXT:
                n = ctypes.c_size_t(0)
                toks = M.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(n))
                tokens = [int(toks[j]) for j in range(n.value)]
                if any(t < 0 for t in tokens):  # a wrapper token mtmd looked up and missed
                    raise EbbError(
                        f"the language model's vocabulary lacks the special tokens that "
                        f"{self.info.family} projectors wrap images with: they do not belong "
                        "together", "use the language model published with this projector")
                pieces.append(TextPiece(tokens))
                continue
            if kind not in (_MTMD_CHUNK_IMAGE, _MTMD_CHUNK_AUDIO):
                raise EbbError(f"this projector made a chunk of a kind Ebb does not know ({kind})")
            image = int((M.mtmd_input_chunk_get_id(c) or b"0").decode())
            index = seen.get(image, 0)
            seen[image] = index + 1
            pieces.append(MediaPiece(
                image=image, index=index, n_tokens=int(M.mtmd_input_chunk_get_n_tokens(c)),
                n_pos=int(M.mtmd_input_chunk_get_n_pos(c)),
                non_causal=bool(M.mtmd_decode_use_non_causal(self.ctx, c)), chunk=c,
                placeholder=bitmaps[image].rgb is None))
        return pieces

    def encode_chunk(self, piece: MediaPiece, name: str = "") -> Encoded:
        """Encode one image chunk; returns its embeddings (copied out of mtmd)."""
        if piece.placeholder:
            raise EbbError("an image chunk without pixels cannot be encoded",
                           "this is a bug in Ebb; please report it")
        M = self._M
        t0 = time.perf_counter()
        rc = M.mtmd_encode_chunk(self.ctx, piece.chunk)
        encode_s = time.perf_counter() - t0
        if rc != 0:
            raise EbbError(f"encoding image {name} failed (code {rc}): {llama_log.last_error('')}")
        out = M.mtmd_get_output_embd(self.ctx)
        n = piece.n_tokens
        import numpy as np

        emb = np.ctypeslib.as_array(out, shape=(n * self.n_embd,)).copy()
        return Encoded(n, emb.reshape(n, self.n_embd), encode_s)

    def encode(self, image: LoadedMedia) -> list[Encoded]:
        """Preprocess and encode one image on its own: the embeddings of each of its chunks."""
        bm = Bitmap(image.width, image.height, image.rgb)
        with self.tokenize(self.marker, [bm], add_special=False) as tp:
            return [self.encode_chunk(p, Path(image.path).name) for p in tp.images()]


@dataclass(frozen=True)
class ProjectorProbe:
    info: ProjectorInfo  # with mtmd's measured buffer and largest-image tokens
    image_size: tuple[int, int]
    image_tokens: int  # for a picture of image_size
    image_chunks: int


class _VocabOnly:
    """A language model loaded for its vocabulary alone (what mtmd's tokenizer needs)."""

    def __init__(self, path: Path) -> None:
        L = llama()
        mp = L.llama_model_default_params()
        mp.vocab_only = True
        mp.n_gpu_layers = 0
        no_devices = (ctypes.c_void_p * 1)(None)  # ask no device (a registered one may be gone)
        mp.devices = ctypes.cast(no_devices, ctypes.c_void_p)
        self.model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise EbbError(f"llama.cpp could not read the vocabulary of {path.name}: "
                           f"{llama_log.last_error('no detail')}")
        self.info = model_info(read_gguf(path))

    def close(self) -> None:
        llama().llama_model_free(self.model)


def probe_projector(mmproj: Path, model: Path, image_size: tuple[int, int], n_threads: int,
                    flash_attn: bool | None = None, image_max_tokens: int = 0) -> ProjectorProbe:
    """Load the projector in RAM with mtmd (the language model's vocabulary only) and read its
    own numbers: the compute buffer it reserves and the tokens of a picture of `image_size`."""
    holder = _VocabOnly(Path(model))
    try:
        with ProjectorRuntime(Path(mmproj), holder, n_threads, None, flash_attn,
                              image_max_tokens) as pr:
            tokens, chunks = (pr.image_tokens(*image_size) if pr.sees
                              else pr.clip_tokens(ONE_CHUNK_SECONDS * pr.sample_rate))
            return ProjectorProbe(pr.measured_info(), image_size, tokens, chunks)
    finally:
        holder.close()
