"""Write vision projectors (mmproj) with random weights, in llama.cpp's real layouts, for tests
and the demo.

The file is a real mmproj that llama.cpp's mtmd loads and runs; its weights are random, so it
exercises the pipeline (preprocessing, tiling, token counts, positions, attention) but does not
see. Metadata `ebb.synthetic = true` marks it.

Families (`family`), with the metadata and tensors each needs beyond the common ViT ones
(`clip.vision.{image_size, patch_size, embedding_length, feed_forward_length, block_count,
attention.head_count, attention.layer_norm_epsilon, image_mean, image_std, projection_dim}`,
`v.blk.N.{attn_q,attn_k,attn_v,attn_out,ln1,ln2,ffn_up,ffn_down}`):

- `mlp` (LLaVA-1.5): `clip.has_llava_projector`, `clip.use_gelu`; `v.position_embd`,
  `mm.0` and `mm.2` (weight and bias). A fixed (image_size / patch)² tokens; no wrappers.
- `gemma3` (Gemma 3): `clip.vision.projector.scale_factor` (the average pool's kernel: 4 in
  the real models), `mm.input_projection.weight` (stored as [projection, vision width]) and
  `mm.soft_emb_norm.weight`. Images are wrapped in `<start_of_image>` / `<end_of_image>` and
  decoded with non-causal attention; (image_size / patch / scale)² tokens.
- `idefics3` (SmolVLM): `clip.vision.projector.scale_factor` (pixel shuffle) and
  `clip.vision.preproc_image_size` (the longest edge images are resized to before slicing);
  `mm.model.fc.weight` takes width x scale². A large image becomes rows x columns tiles plus a
  global view, each its own chunk, with `<fake_token_around_image>`, `<row_R_col_C>` and
  `<global-img>` text between them.
- `qwen2.5vl` (Qwen2.5-VL): `clip.use_silu`, `clip.vision.n_wa_pattern` (window attention
  every n layers), `clip.vision.spatial_merge_size` (2); two patch kernels
  (`v.patch_embd.weight`, `.weight.1`, no position table: 2-D rotary), RMS norms, biased
  Q/K/V/out and a gated FFN; the merger `mm.0` takes width x 4. Dynamic resolution: the token
  count follows the image's size (between 8 and 4096, or `image_max_tokens`); wrapped in
  `<|vision_start|>` / `<|vision_end|>`; M-RoPE positions (the language model must be
  `qwen2vl`).
- `pixtral` (Pixtral / Mistral Small 3.x vision): `clip.use_silu`, 2-D rotary in the ViT (no
  position table), RMS norms, gated FFN, `v.token_embd.img_break` ([IMG_BREAK] between rows),
  `mm.1` and `mm.2`. Dynamic resolution; one token per patch plus one break per row.
- `internvl` (InternVL 2.5 / 3): `clip.vision.projector.scale_factor` (pixel shuffle), a class
  token (`v.class_embd`, one more position), layer scales `ls1`/`ls2`, and the projector
  `mm.model.mlp.0` (layer norm over width x scale²), `.1` and `.3`. A picture becomes tiles
  of the closest aspect ratio (1 to 12) then a thumbnail, each its own chunk, wrapped in
  `<img>` / `</img>`; the language model is `qwen2`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import EbbError
from engine.gguf.families import GENERATED

FAMILIES = (*GENERATED, "pixtral")  # pixtral: written, not offered (see families.GENERATED)
PROJECTOR_TYPE = {"mlp": "mlp", "gemma3": "gemma3", "idefics3": "idefics3",
                  "qwen2.5vl": "qwen2.5vl_merger", "pixtral": "pixtral",
                  "internvl": "internvl"}  # clip.projector_type


@dataclass(frozen=True)
class ProjectorSize:
    image_size: int
    patch_size: int
    n_embd: int
    n_ff: int  # keep != n_embd: clip.cpp otherwise assumes ffn up/down are swapped
    n_head: int
    n_layers: int
    mm_hidden: int


SIZES: dict[str, ProjectorSize] = {
    # kilobytes: unit tests
    "tiny": ProjectorSize(image_size=28, patch_size=14, n_embd=32, n_ff=48, n_head=2, n_layers=2,
                          mm_hidden=64),
    # ~100 MB, encodes in about a second on 2 CPU cores
    "base": ProjectorSize(image_size=224, patch_size=14, n_embd=768, n_ff=3072, n_head=12,
                          n_layers=7, mm_hidden=2048),
    # ~600 MB, CLIP-ViT-L/14-336-like widths: realistic swap timings
    "large": ProjectorSize(image_size=336, patch_size=14, n_embd=1024, n_ff=4096, n_head=16,
                           n_layers=24, mm_hidden=4096),
}

# the tiny size per family: few tokens, but the family's structure (tiles, merges, rows)
_TINY: dict[str, ProjectorSize] = {
    "gemma3": ProjectorSize(image_size=64, patch_size=8, n_embd=32, n_ff=48, n_head=2, n_layers=2,
                            mm_hidden=0),  # 8x8 patches pooled 2x2: 16 tokens
    "idefics3": ProjectorSize(image_size=32, patch_size=8, n_embd=32, n_ff=48, n_head=2,
                              n_layers=2, mm_hidden=0),  # 4 tokens per tile
    "qwen2.5vl": ProjectorSize(image_size=64, patch_size=8, n_embd=32, n_ff=48, n_head=2,
                               n_layers=2, mm_hidden=64),
    "pixtral": ProjectorSize(image_size=64, patch_size=16, n_embd=32, n_ff=48, n_head=2,
                             n_layers=2, mm_hidden=64),
    "internvl": ProjectorSize(image_size=32, patch_size=8, n_embd=32, n_ff=48, n_head=2,
                              n_layers=2, mm_hidden=64),  # 4 tokens per tile
}
GEMMA3_POOL = 2  # the real models pool 4x4 (64x64 patches to 256 tokens); tiny ones 2x2
IDEFICS3_SHUFFLE = 2
IDEFICS3_LONGEST_EDGE = 64  # with 32-pixel tiles: a large image is 2x2 tiles + a global view
INTERNVL_SHUFFLE = 2


def _weight(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """A matmul weight, numpy shape (out, in) = ggml ne [in, out], f16, scaled 1/sqrt(in)."""
    w = rng.standard_normal((rows, cols), dtype=np.float32)
    w *= 1.0 / np.sqrt(cols)
    return w.astype(np.float16)


def _size_for(family: str, size: str) -> ProjectorSize:
    if family not in FAMILIES:
        raise EbbError(f"unknown projector family '{family}'", f"use one of {', '.join(FAMILIES)}")
    if size not in SIZES:
        raise EbbError(f"unknown projector size '{size}'", f"use one of {', '.join(SIZES)}")
    if family != "mlp" and size == "tiny":
        return _TINY[family]
    return SIZES[size]


def write_projector(out: Path, llm_n_embd: int, size: str = "tiny", seed: int = 0,
                    family: str = "mlp") -> Path:
    """Write a `family` projector whose output width is `llm_n_embd`. Returns `out`."""

    s = _size_for(family, size)
    rng = np.random.default_rng(seed)
    w = _clip_writer(out, llm_n_embd, seed, size, f"{family} projector",
                     "the multimodal pipeline; it does not see")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.has_text_encoder", False)
    w.add_string("clip.projector_type", PROJECTOR_TYPE[family])
    _vit_metadata(w, s, llm_n_embd, 1e-6)
    if family in ("mlp",):
        w.add_array("clip.vision.image_mean", [0.48145466, 0.4578275, 0.40821073])
        w.add_array("clip.vision.image_std", [0.26862954, 0.26130258, 0.27577711])
    else:
        w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
        w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    gated = family in ("qwen2.5vl", "pixtral")
    w.add_bool("clip.use_silu" if gated else "clip.use_gelu", True)
    if family == "mlp":
        w.add_bool("clip.has_llava_projector", True)
    elif family == "gemma3":
        w.add_uint32("clip.vision.projector.scale_factor", GEMMA3_POOL)
    elif family == "idefics3":
        w.add_uint32("clip.vision.projector.scale_factor", IDEFICS3_SHUFFLE)
        w.add_uint32("clip.vision.preproc_image_size", IDEFICS3_LONGEST_EDGE)
    elif family == "qwen2.5vl":
        w.add_uint32("clip.vision.n_wa_pattern", 2)
        w.add_uint32("clip.vision.spatial_merge_size", 2)
    elif family == "internvl":
        w.add_uint32("clip.vision.projector.scale_factor", INTERNVL_SHUFFLE)

    _vit(w, rng, s, family)
    _head(w, rng, s, family, llm_n_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _clip_writer(out: Path, llm_n_embd: int, seed: int, size: str, what: str, does: str) -> Any:
    """A clip GGUF writer with the header every generated projector has (marked synthetic)."""
    import gguf

    if llm_n_embd <= 0:
        raise EbbError("the model's embedding width is unknown", "pass a language model GGUF")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), arch="clip")
    w.add_name(f"Ebb synthetic {what} ({size}, random weights)")
    w.add_description(f"Generated by Ebb: random weights. It exercises {does}.")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_bool("ebb.synthetic", True)
    w.add_uint32("ebb.seed", seed)
    w.add_string("ebb.size", size)
    return w


def _vit(w: Any, rng: np.random.Generator, s: ProjectorSize, family: str) -> None:
    """The vision transformer: patch embedding, positions, blocks, final norm."""
    d, p = s.n_embd, s.patch_size
    ones, zeros = np.ones(d, dtype=np.float32), np.zeros(d, dtype=np.float32)

    def patch_kernel() -> np.ndarray:
        k = rng.standard_normal((d, 3, p, p), dtype=np.float32) / np.sqrt(3 * p * p)
        return np.asarray(k, dtype=np.float16)

    w.add_tensor("v.patch_embd.weight", patch_kernel())
    if family == "qwen2.5vl":
        w.add_tensor("v.patch_embd.weight.1", patch_kernel())  # the second frame's kernel
    elif family != "pixtral":
        w.add_tensor("v.patch_embd.bias", zeros)
        n_pos = (s.image_size // p) ** 2 + (1 if family == "internvl" else 0)  # + class token
        w.add_tensor("v.position_embd.weight",
                     (0.02 * rng.standard_normal((n_pos, d), dtype=np.float32)))
        if family == "internvl":
            w.add_tensor("v.class_embd", 0.02 * rng.standard_normal(d, dtype=np.float32))
    rms = family in ("qwen2.5vl", "pixtral")
    for i in range(s.n_layers):
        b = f"v.blk.{i}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(f"{b}.{name}.weight", _weight(rng, d, d))
            if family != "pixtral":
                w.add_tensor(f"{b}.{name}.bias", zeros)
        for ln in ("ln1", "ln2"):
            w.add_tensor(f"{b}.{ln}.weight", ones)
            if not rms:
                w.add_tensor(f"{b}.{ln}.bias", zeros)
        if family == "internvl":  # layer scales
            w.add_tensor(f"{b}.ls1.weight", ones)
            w.add_tensor(f"{b}.ls2.weight", ones)
        w.add_tensor(f"{b}.ffn_up.weight", _weight(rng, s.n_ff, d))
        w.add_tensor(f"{b}.ffn_down.weight", _weight(rng, d, s.n_ff))
        if rms:  # these families' FFN is gated (SiLU)
            w.add_tensor(f"{b}.ffn_gate.weight", _weight(rng, s.n_ff, d))
        if family == "qwen2.5vl":
            for name, n in (("ffn_up", s.n_ff), ("ffn_gate", s.n_ff), ("ffn_down", d)):
                w.add_tensor(f"{b}.{name}.bias", np.zeros(n, dtype=np.float32))
    if family == "pixtral":
        w.add_tensor("v.pre_ln.weight", ones)
    elif family in ("gemma3", "idefics3", "qwen2.5vl"):
        w.add_tensor("v.post_ln.weight", ones)
        if family != "qwen2.5vl":
            w.add_tensor("v.post_ln.bias", zeros)


def _head(w: Any, rng: np.random.Generator, s: ProjectorSize, family: str, out_w: int) -> None:
    """The projection onto the language model's embeddings."""
    d = s.n_embd
    if family == "mlp":
        w.add_tensor("mm.0.weight", _weight(rng, s.mm_hidden, d))
        w.add_tensor("mm.0.bias", np.zeros(s.mm_hidden, dtype=np.float32))
        w.add_tensor("mm.2.weight", _weight(rng, out_w, s.mm_hidden))
        w.add_tensor("mm.2.bias", np.zeros(out_w, dtype=np.float32))
    elif family == "gemma3":
        proj = rng.standard_normal((d, out_w), dtype=np.float32) / np.sqrt(d)
        w.add_tensor("mm.input_projection.weight", proj.astype(np.float16))  # ne [out, d]
        w.add_tensor("mm.soft_emb_norm.weight", np.ones(d, dtype=np.float32))
    elif family == "idefics3":
        w.add_tensor("mm.model.fc.weight", _weight(rng, out_w, d * IDEFICS3_SHUFFLE ** 2))
    elif family == "qwen2.5vl":
        w.add_tensor("mm.0.weight", _weight(rng, s.mm_hidden, d * 4))
        w.add_tensor("mm.0.bias", np.zeros(s.mm_hidden, dtype=np.float32))
        w.add_tensor("mm.2.weight", _weight(rng, out_w, s.mm_hidden))
        w.add_tensor("mm.2.bias", np.zeros(out_w, dtype=np.float32))
    elif family == "internvl":
        wide = d * INTERNVL_SHUFFLE ** 2
        w.add_tensor("mm.model.mlp.0.weight", np.ones(wide, dtype=np.float32))  # layer norm
        w.add_tensor("mm.model.mlp.0.bias", np.zeros(wide, dtype=np.float32))
        w.add_tensor("mm.model.mlp.1.weight", _weight(rng, s.mm_hidden, wide))
        w.add_tensor("mm.model.mlp.1.bias", np.zeros(s.mm_hidden, dtype=np.float32))
        w.add_tensor("mm.model.mlp.3.weight", _weight(rng, out_w, s.mm_hidden))
        w.add_tensor("mm.model.mlp.3.bias", np.zeros(out_w, dtype=np.float32))
    elif family == "pixtral":
        w.add_tensor("mm.1.weight", _weight(rng, s.mm_hidden, d))
        w.add_tensor("mm.1.bias", np.zeros(s.mm_hidden, dtype=np.float32))
        w.add_tensor("mm.2.weight", _weight(rng, out_w, s.mm_hidden))
        w.add_tensor("mm.2.bias", np.zeros(out_w, dtype=np.float32))
        w.add_tensor("v.token_embd.img_break",
                     (0.02 * rng.standard_normal(out_w, dtype=np.float32)))


# The colour projector's words and their corners of the normalised RGB cube (pixels in [-1, 1])
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (1, -1, -1), "green": (-1, 1, -1), "blue": (-1, -1, 1),
    "yellow": (1, 1, -1), "black": (-1, -1, -1), "white": (1, 1, 1),
}
LLAVA_PAD_RGB = (122, 116, 104)  # clip.cpp pads an "mlp" projector's picture square with it
COLOUR_GRID = 4  # 4x4 patches whatever the size: 16 image tokens
# What a picture of colour C reads as, a token per patch in reading order (C: " red", ...):
# SmolLM2-135M names the colour after it by a logit gap of 3.4 or more, where 16 copies of the
# word alone gave 0.4 to -1 (it answered "blue" for white)
COLOUR_PHRASE = ("(", "a", " solid", None, " picture", ")", " (", "a", " solid", None, " picture", ")")
# How each stage switches: a pair of GELU units, the second shifted by the ramp, whose
# difference is 0 below the threshold and exactly 1 past threshold + ramp. Saturated units
# make every shade of a colour the same image tokens, so the model's answer does not ride on
# the last bits of one CPU's arithmetic.
SIGN_GAIN, SIGN_THRESHOLD, SIGN_RAMP = 20.0, 0.1, 0.2  # in layer-normed units
# in matching signs (3) plus the patch's own position (1)
CORNER_GAIN, CORNER_THRESHOLD, CORNER_RAMP = 40.0, 3.5, 0.25
POSITION_CODE = 0.01  # the position channels' value: small beside any colour
COLOUR_AMPLITUDE = 1.5  # each image token is its word's embedding, a little louder (gap 3.1, 2.9 at 1.0)
COLOUR_VERSION = 2  # in the cached demo projector's name: a new design makes a new file
# the residual stream's channels: the colour, its signs, then the position code
_SIGNS, _BALANCE, _POSITIONS = 3, 9, 10


def write_colour_projector(out: Path, model: Path, size: str = "tiny",
                           amplitude: float = COLOUR_AMPLITUDE, grid: int = COLOUR_GRID) -> Path:
    """An "mlp" (LLaVA) projector with closed-form weights that sees one thing: a picture's
    colour, as the sign of each channel against llava's pad grey, (122, 116, 104) (red: R over
    122, G under 116 and B under 104). The patch embedding takes each patch's mean R, G and B;
    the position table gives each patch a zero-mean code of its index; the first block's FFN
    turns the layer-normed colour into six sign indicators (R+, R-, G+, ...), and every other
    weight that could change the stream is zero (the rest random, so the file has its size's
    weight and cost); the first MLP layer has a unit pair per colour and position, on only when
    all three of the colour's signs match there (red, green, blue, yellow, black, white: six
    of the cube's eight corners); the second maps the pair onto the language model's own
    embedding of that position's token of COLOUR_PHRASE, read from `model`'s token table. A
    picture of that colour, in any shade, then reads "(a solid red picture) (a solid red
    picture)" (grey padding is no colour: no tokens), and the model can name it."""
    import gguf
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from engine.gguf.info import model_info, read_gguf

    info = model_info(read_gguf(model))
    s = _size_for("mlp", size)
    s = replace(s, patch_size=s.image_size // grid)
    pieces = {piece for piece in COLOUR_PHRASE if piece} | {f" {c}" for c in COLOURS}
    words = _token_embeddings(model, pieces, GGUFReader, dequantize)
    rng = np.random.default_rng(0)
    d, p, n_pos = s.n_embd, s.patch_size, grid * grid
    if _POSITIONS + n_pos > d:
        raise EbbError(f"a {grid}x{grid} colour projector needs a wider vision model than '{size}'",
                       "use a smaller grid")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), arch="clip")
    _colour_metadata(w, gguf, s, size, info.n_embd)
    patch = np.zeros((d, 3, p, p), dtype=np.float32)
    for ch in range(3):
        patch[ch, ch] = 1.0 / (p * p)  # embedding channel ch = the patch's mean of colour ch
    w.add_tensor("v.patch_embd.weight", patch.astype(np.float16))
    zeros, ones = np.zeros(d, dtype=np.float32), np.ones(d, dtype=np.float32)
    w.add_tensor("v.patch_embd.bias", zeros)
    w.add_tensor("v.position_embd.weight", _position_code(n_pos, d))
    for i in range(s.n_layers):
        b = f"v.blk.{i}"
        for name in ("attn_q", "attn_k", "attn_v"):
            w.add_tensor(f"{b}.{name}.weight", _weight(rng, d, d))
        w.add_tensor(f"{b}.attn_out.weight", np.zeros((d, d), dtype=np.float16))
        for ln in ("ln1", "ln2"):
            w.add_tensor(f"{b}.{ln}.weight", ones)
            w.add_tensor(f"{b}.{ln}.bias", zeros)
        up, down = _weight(rng, s.n_ff, d), np.zeros((d, s.n_ff), dtype=np.float16)
        if i == 0:  # clip.cpp runs every block but the last: the first always runs
            up, up_b, down = _sign_ffn(up, down)
            w.add_tensor(f"{b}.ffn_up.bias", up_b)
        w.add_tensor(f"{b}.ffn_up.weight", up)
        w.add_tensor(f"{b}.ffn_down.weight", down)
    hidden = max(s.mm_hidden, 2 * len(COLOURS) * len(COLOUR_PHRASE))
    mm0, mm0_b, mm2 = _phrase_mlp(d, hidden, words, amplitude)
    w.add_tensor("mm.0.weight", mm0.astype(np.float16))
    w.add_tensor("mm.0.bias", mm0_b)
    w.add_tensor("mm.2.weight", mm2.astype(np.float16))
    w.add_tensor("mm.2.bias", np.zeros(info.n_embd, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _position_code(n_pos: int, d: int) -> np.ndarray:
    """Patch j: POSITION_CODE in its own channel, less as much in a shared one. The code's mean
    is 0, so a grey patch (no colour) still layer-norms to 0 in the colour channels."""
    table = np.zeros((n_pos, d), dtype=np.float32)
    for j in range(n_pos):
        table[j, _POSITIONS + j] = POSITION_CODE
        table[j, _BALANCE] = -POSITION_CODE
    return table


def _colour_metadata(w: Any, gguf: Any, s: ProjectorSize, size: str, llm_n_embd: int) -> None:
    w.add_name(f"Ebb colour projector ({size}): sees a picture's colour")
    w.add_description("Generated by Ebb: closed-form weights that map a picture's colour onto "
                      "the model's word for it (red, green, blue, yellow, black, white).")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_bool("ebb.synthetic", True)
    w.add_string("ebb.size", size)
    w.add_string("ebb.kind", "colour")
    w.add_uint32("ebb.colour_version", COLOUR_VERSION)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.has_text_encoder", False)
    w.add_bool("clip.has_llava_projector", True)
    w.add_string("clip.projector_type", "mlp")
    w.add_bool("clip.use_gelu", True)
    _vit_metadata(w, s, llm_n_embd, 1e-5)
    # a channel's middle is llava's pad colour: padding normalises to 0 and is no colour
    w.add_array("clip.vision.image_mean", [c / 255 for c in LLAVA_PAD_RGB])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])


def _vit_metadata(w: Any, s: ProjectorSize, llm_n_embd: int, eps: float) -> None:
    """The vision tower's shape, as every family's projector states it."""
    w.add_uint32("clip.vision.image_size", s.image_size)
    w.add_uint32("clip.vision.patch_size", s.patch_size)
    w.add_uint32("clip.vision.embedding_length", s.n_embd)
    w.add_uint32("clip.vision.feed_forward_length", s.n_ff)
    w.add_uint32("clip.vision.projection_dim", llm_n_embd)
    w.add_uint32("clip.vision.attention.head_count", s.n_head)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", eps)
    w.add_uint32("clip.vision.block_count", s.n_layers)


def _sign_ffn(up: np.ndarray, down: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The first block's FFN: units 4i..4i+3 read layer-normed channel i (0-2: R, G, B) and
    write its sign indicators, in [0, 1], into channels 3 + 2i (over the middle) and 4 + 2i
    (under). A grey patch (all channels 0) normalises to 0: no sign, no colour."""
    up, down = up.astype(np.float32), down.astype(np.float32)
    up[:12] = 0.0
    up_b = np.zeros(up.shape[0], dtype=np.float32)
    for ch in range(3):
        for k, sign in enumerate((1.0, -1.0)):
            on, full, out = 4 * ch + 2 * k, 4 * ch + 2 * k + 1, 3 + 2 * ch + k
            up[on, ch] = up[full, ch] = SIGN_GAIN * sign
            up_b[on] = -SIGN_GAIN * SIGN_THRESHOLD
            up_b[full] = -SIGN_GAIN * (SIGN_THRESHOLD + SIGN_RAMP)
            down[out, on], down[out, full] = _pair_scale(SIGN_GAIN, SIGN_RAMP, 1.0)
    return up.astype(np.float16), up_b, down.astype(np.float16)


def _phrase_mlp(d: int, hidden: int, words: dict[str, np.ndarray],
                amplitude: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """mm.0 and mm.2: a unit pair per colour c and phrase position j, on when c's three signs
    all match at patch j, writing `amplitude` times the embedding of COLOUR_PHRASE[j]."""
    n_embd = len(next(iter(words.values())))
    mm0 = np.zeros((hidden, d), dtype=np.float32)
    mm0_b = np.zeros(hidden, dtype=np.float32)
    mm2 = np.zeros((n_embd, hidden), dtype=np.float32)
    on_w, full_w = _pair_scale(CORNER_GAIN, CORNER_RAMP, amplitude)
    for c, (name, corner) in enumerate(COLOURS.items()):
        for j, piece in enumerate(COLOUR_PHRASE):
            on = 2 * (c * len(COLOUR_PHRASE) + j)
            for unit in (on, on + 1):
                for ch, sign in enumerate(corner):
                    mm0[unit, _SIGNS + 2 * ch + (sign < 0)] = CORNER_GAIN
                mm0[unit, _POSITIONS + j] = CORNER_GAIN / POSITION_CODE
            mm0_b[on] = -CORNER_GAIN * CORNER_THRESHOLD
            mm0_b[on + 1] = -CORNER_GAIN * (CORNER_THRESHOLD + CORNER_RAMP)
            word = words[piece or f" {name}"]
            mm2[:, on], mm2[:, on + 1] = word * on_w, word * full_w
    return mm0, mm0_b, mm2


def _pair_scale(gain: float, ramp: float, amplitude: float) -> tuple[float, float]:
    """The weights that read a GELU pair (on, full = on shifted by gain * ramp) as a switch:
    on - full is gain * ramp once saturated, so the pair reads as `amplitude` there."""
    return amplitude / (gain * ramp), -amplitude / (gain * ramp)


def _token_embeddings(model: Path, pieces: set[str], reader: Any,
                      dequantize: Any) -> dict[str, np.ndarray]:
    """The model's input embedding of each piece of text (" red", "(", ...), each one token in
    SmolLM2's and most BPE vocabularies."""
    r = reader(model, "r")
    tokens = [bytes(r.fields["tokenizer.ggml.tokens"].parts[i]).decode("utf-8", "replace")
              for i in r.fields["tokenizer.ggml.tokens"].data]
    index = {t: i for i, t in reversed(list(enumerate(tokens)))}
    table = next((t for t in r.tensors if t.name == "token_embd.weight"), None)
    if table is None:
        raise EbbError(f"{model.name} has no token embedding table", "pass a language model")
    emb = np.asarray(dequantize(table.data, table.tensor_type), dtype=np.float32)
    out = {}
    for piece in pieces:
        body = piece[1:] if piece.startswith(" ") else None
        # BPE (GPT-2's byte spelling) and SentencePiece spellings of a leading space
        forms = ("Ġ" + body, "▁" + body, piece) if body is not None else (piece,)
        found = next((index[f] for f in forms if f in index), None)
        if found is None:
            raise EbbError(f"{model.name}'s vocabulary has no single token for {piece!r}",
                           "the colour projector needs a model whose vocabulary has the words")
        out[piece] = emb[found]
    return out


# ------------------------------------------------------------------ audio encoders

N_MEL = 128  # Whisper large-v3's mel bins: Ultravox v0.5 and Qwen2-Audio use them
AUDIO_POSITIONS = 1500  # a 30-second chunk: 3000 mel frames, halved by the second conv
ULTRAVOX_STACK = 8  # frames stacked before Ultravox's projector (its real value)
AUDIO_PROJECTOR_TYPE = {"ultravox": "ultravox", "qwen2a": "qwen2a", "qwen2.5o": "qwen2.5o"}


def write_audio_projector(out: Path, llm_n_embd: int, family: str = "ultravox",
                          size: str = "tiny", seed: int = 0,
                          stack_factor: int = ULTRAVOX_STACK) -> Path:
    """Write an audio projector (random weights) in llama.cpp's real layout for `family`:

    - `ultravox` (Ultravox v0.5): a Whisper encoder (`a.conv1d.{1,2}`, `a.position_embd`,
      `a.blk.N.*` with no K bias, `a.post_ln`), frames stacked by 8, then RMS norm, a
      swapped SwiGLU (`mm.a.mlp.1`), RMS norm and `mm.a.mlp.2`; no wrappers: 187 tokens per 30 s.
    - `qwen2a` (Qwen2-Audio): the Whisper encoder, an average pool of 2 and `mm.a.fc`; wrapped
      in `<|audio_bos|>` / `<|audio_eos|>`: 750 tokens per 30 s.
    - `qwen2.5o` (Qwen2.5-Omni): one file with both a Qwen2.5-VL vision encoder and the
      Qwen2-Audio one (`clip.projector_type` "qwen2.5o", as llama.cpp's converter writes).

    Sound goes in as 16 kHz mono, cut into 30-second chunks (each its own chunk of tokens).
    `stack_factor` (Ultravox): 8 is the real models'; the llama.cpp Ebb builds miscounts the
    tokens that makes and would abort (engine/gguf/info.py `audio_count_problem`), so the
    suite runs the family's graph with 4."""

    if family not in AUDIO_PROJECTOR_TYPE:
        raise EbbError(f"unknown audio projector family '{family}'",
                       f"use one of {', '.join(AUDIO_PROJECTOR_TYPE)}")
    if size not in SIZES:
        raise EbbError(f"unknown projector size '{size}'", f"use one of {', '.join(SIZES)}")
    s = SIZES[size]
    rng = np.random.default_rng(seed)
    w = _clip_writer(out, llm_n_embd, seed, size, f"{family} audio projector",
                     "the audio pipeline; it does not hear")
    omni = family == "qwen2.5o"
    w.add_bool("clip.has_vision_encoder", omni)
    w.add_bool("clip.has_audio_encoder", True)
    w.add_bool("clip.has_text_encoder", False)
    w.add_string("clip.projector_type", AUDIO_PROJECTOR_TYPE[family])
    if omni:  # the vision half: as the qwen2.5vl family writes it
        v = _size_for("qwen2.5vl", size)
        _vit_metadata(w, v, llm_n_embd, 1e-6)
        w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
        w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
        w.add_bool("clip.use_silu", True)
        w.add_uint32("clip.vision.n_wa_pattern", 2)
        w.add_uint32("clip.vision.spatial_merge_size", 2)
        _vit(w, rng, v, "qwen2.5vl")
        _head(w, rng, v, "qwen2.5vl", llm_n_embd)
    d = s.n_embd
    w.add_uint32("clip.audio.num_mel_bins", N_MEL)
    w.add_uint32("clip.audio.embedding_length", d)
    w.add_uint32("clip.audio.feed_forward_length", s.n_ff)
    w.add_uint32("clip.audio.block_count", s.n_layers)
    w.add_uint32("clip.audio.attention.head_count", s.n_head)
    w.add_float32("clip.audio.attention.layer_norm_epsilon", 1e-5)
    w.add_uint32("clip.audio.projection_dim", llm_n_embd)
    if family == "ultravox":
        w.add_uint32("clip.audio.projector.stack_factor", stack_factor)
    _whisper_encoder(w, rng, s)
    if family == "ultravox":
        wide, hidden = d * stack_factor, s.mm_hidden
        w.add_tensor("mm.a.norm_pre.weight", np.ones(wide, dtype=np.float32))
        w.add_tensor("mm.a.mlp.1.weight", _weight(rng, 2 * hidden, wide))  # SwiGLU: two halves
        w.add_tensor("mm.a.norm_mid.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor("mm.a.mlp.2.weight", _weight(rng, llm_n_embd, hidden))
    else:
        w.add_tensor("mm.a.fc.weight", _weight(rng, llm_n_embd, d))
        w.add_tensor("mm.a.fc.bias", np.zeros(llm_n_embd, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _whisper_encoder(w: Any, rng: np.random.Generator, s: ProjectorSize) -> None:
    """Whisper's encoder as llama.cpp names it: two convolutions over the mel frames (the
    second halves them), a position table, pre-norm blocks with GELU and no K bias, a norm."""
    d = s.n_embd
    ones, zeros = np.ones(d, dtype=np.float32), np.zeros(d, dtype=np.float32)
    conv1 = rng.standard_normal((d, N_MEL, 3), dtype=np.float32) / np.sqrt(3 * N_MEL)
    conv2 = rng.standard_normal((d, d, 3), dtype=np.float32) / np.sqrt(3 * d)
    w.add_tensor("a.conv1d.1.weight", conv1.astype(np.float16))
    w.add_tensor("a.conv1d.1.bias", np.zeros((d, 1), dtype=np.float32))
    w.add_tensor("a.conv1d.2.weight", conv2.astype(np.float16))
    w.add_tensor("a.conv1d.2.bias", np.zeros((d, 1), dtype=np.float32))
    w.add_tensor("a.position_embd.weight",
                 0.02 * rng.standard_normal((AUDIO_POSITIONS, d), dtype=np.float32))
    for i in range(s.n_layers):
        b = f"a.blk.{i}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(f"{b}.{name}.weight", _weight(rng, d, d))
            if name != "attn_k":
                w.add_tensor(f"{b}.{name}.bias", zeros)
        for ln in ("ln1", "ln2"):
            w.add_tensor(f"{b}.{ln}.weight", ones)
            w.add_tensor(f"{b}.{ln}.bias", zeros)
        w.add_tensor(f"{b}.ffn_up.weight", _weight(rng, s.n_ff, d))
        w.add_tensor(f"{b}.ffn_up.bias", np.zeros(s.n_ff, dtype=np.float32))
        w.add_tensor(f"{b}.ffn_down.weight", _weight(rng, d, s.n_ff))
        w.add_tensor(f"{b}.ffn_down.bias", zeros)
    w.add_tensor("a.post_ln.weight", ones)
    w.add_tensor("a.post_ln.bias", zeros)
