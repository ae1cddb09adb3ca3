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
    import gguf

    s = _size_for(family, size)
    if llm_n_embd <= 0:
        raise EbbError("the model's embedding width is unknown", "pass a language model GGUF")
    rng = np.random.default_rng(seed)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), arch="clip")
    w.add_name(f"Ebb synthetic {family} projector ({size}, random weights)")
    w.add_description("Generated by ebb-engine make-projector: random weights. It exercises the "
                      "multimodal pipeline; it does not see.")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_bool("ebb.synthetic", True)
    w.add_uint32("ebb.seed", seed)
    w.add_string("ebb.size", size)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.has_text_encoder", False)
    w.add_string("clip.projector_type", PROJECTOR_TYPE[family])
    w.add_uint32("clip.vision.image_size", s.image_size)
    w.add_uint32("clip.vision.patch_size", s.patch_size)
    w.add_uint32("clip.vision.embedding_length", s.n_embd)
    w.add_uint32("clip.vision.feed_forward_length", s.n_ff)
    w.add_uint32("clip.vision.projection_dim", llm_n_embd)
    w.add_uint32("clip.vision.attention.head_count", s.n_head)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_uint32("clip.vision.block_count", s.n_layers)
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
COLOUR_GAIN = 8.0  # how sharply a colour unit switches on at its own corner
COLOUR_GRID = 4
# p.x is 3 at a colour's own corner and 1 at a neighbouring one: a unit switches on past 1 (a
# real picture's colour is off the corner, and llava pads a picture square with grey).
# Measured on SmolLM2-135M: 1.5 and 2.0 name fewer colours than 1.0
COLOUR_THRESHOLD = 1.0


def write_colour_projector(out: Path, model: Path, size: str = "tiny") -> Path:
    """An "mlp" (LLaVA) projector with closed-form weights that sees one thing: a picture's
    colour. The patch embedding takes each patch's mean R, G and B; the blocks pass it through
    unchanged (their attention output and FFN down-projection are zero; their other weights
    random, so the file has its size's weight and cost); the first MLP layer has one unit per
    colour, on only at its corner of the RGB cube (red, green, blue, yellow, black, white); the
    second maps that unit onto the language model's own embedding of the colour's word (" red",
    ...), read from `model`'s token table. Every image token of a solid picture is then that
    word, and the model can name it."""
    import gguf
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from engine.gguf.info import model_info, read_gguf

    info = model_info(read_gguf(model))
    s = _size_for("mlp", size)
    # 4x4 patches whatever the size: 16 image tokens (hundreds of copies of one word drown
    # a small model's answer)
    s = replace(s, patch_size=s.image_size // COLOUR_GRID)
    words = _colour_word_embeddings(model, GGUFReader, dequantize)
    rng = np.random.default_rng(0)
    d, p, hidden = s.n_embd, s.patch_size, max(s.mm_hidden, len(COLOURS))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), arch="clip")
    w.add_name(f"Ebb colour projector ({size}): sees a picture's colour")
    w.add_description("Generated by Ebb: closed-form weights that map a picture's mean colour "
                      "onto the model's word for it (red, green, blue, yellow, black, white).")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_bool("ebb.synthetic", True)
    w.add_string("ebb.size", size)
    w.add_string("ebb.kind", "colour")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.has_text_encoder", False)
    w.add_bool("clip.has_llava_projector", True)
    w.add_string("clip.projector_type", "mlp")
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.image_size", s.image_size)
    w.add_uint32("clip.vision.patch_size", p)
    w.add_uint32("clip.vision.embedding_length", d)
    w.add_uint32("clip.vision.feed_forward_length", s.n_ff)
    w.add_uint32("clip.vision.projection_dim", info.n_embd)
    w.add_uint32("clip.vision.attention.head_count", s.n_head)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    w.add_uint32("clip.vision.block_count", s.n_layers)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])  # pixels to [-1, 1]
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])

    patch = np.zeros((d, 3, p, p), dtype=np.float32)
    for ch in range(3):
        patch[ch, ch] = 1.0 / (p * p)  # embedding channel ch = the patch's mean of colour ch
    w.add_tensor("v.patch_embd.weight", patch.astype(np.float16))
    zeros, ones = np.zeros(d, dtype=np.float32), np.ones(d, dtype=np.float32)
    w.add_tensor("v.patch_embd.bias", zeros)
    w.add_tensor("v.position_embd.weight", np.zeros(((s.image_size // p) ** 2, d), dtype=np.float32))
    for i in range(s.n_layers):
        b = f"v.blk.{i}"
        for name in ("attn_q", "attn_k", "attn_v"):
            w.add_tensor(f"{b}.{name}.weight", _weight(rng, d, d))
        w.add_tensor(f"{b}.attn_out.weight", np.zeros((d, d), dtype=np.float16))
        for ln in ("ln1", "ln2"):
            w.add_tensor(f"{b}.{ln}.weight", ones)
            w.add_tensor(f"{b}.{ln}.bias", zeros)
        w.add_tensor(f"{b}.ffn_up.weight", _weight(rng, s.n_ff, d))
        w.add_tensor(f"{b}.ffn_down.weight", np.zeros((d, s.n_ff), dtype=np.float16))
    mm0 = np.zeros((hidden, d), dtype=np.float32)
    mm0_b = np.zeros(hidden, dtype=np.float32)
    mm2 = np.zeros((info.n_embd, hidden), dtype=np.float32)
    for c, (name, corner) in enumerate(COLOURS.items()):
        mm0[c, :3] = COLOUR_GAIN * np.array(corner, dtype=np.float32)
        mm0_b[c] = -COLOUR_THRESHOLD * COLOUR_GAIN
        mm2[:, c] = words[name] / COLOUR_GAIN
    w.add_tensor("mm.0.weight", mm0.astype(np.float16))
    w.add_tensor("mm.0.bias", mm0_b)
    w.add_tensor("mm.2.weight", mm2.astype(np.float16))
    w.add_tensor("mm.2.bias", np.zeros(info.n_embd, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _colour_word_embeddings(model: Path, reader: Any, dequantize: Any) -> dict[str, np.ndarray]:
    """The model's input embedding of " red", " green", ... (each one token in SmolLM2's and
    most BPE vocabularies)."""
    r = reader(model, "r")
    tokens = [bytes(r.fields["tokenizer.ggml.tokens"].parts[i]).decode("utf-8", "replace")
              for i in r.fields["tokenizer.ggml.tokens"].data]
    table = next((t for t in r.tensors if t.name == "token_embd.weight"), None)
    if table is None:
        raise EbbError(f"{model.name} has no token embedding table", "pass a language model")
    emb = np.asarray(dequantize(table.data, table.tensor_type), dtype=np.float32)
    out = {}
    for name in COLOURS:
        for form in ("Ġ" + name, "▁" + name, " " + name):  # BPE and SentencePiece spellings
            if form in tokens:
                out[name] = emb[tokens.index(form)]
                break
        else:
            raise EbbError(f"{model.name}'s vocabulary has no single token for ' {name}'",
                           "the colour projector needs a model whose vocabulary has the words")
    return out
