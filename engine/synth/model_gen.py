"""Write language models with random f16 weights and a real tokenizer.

For realistic swap timings on a real GPU (several GB, real shapes) and for tests. The tokenizer
and chat template are copied from a real model (SmolLM2 by default), so llama.cpp loads and runs
the file; its replies are noise. Weights stream to disk tensor by tensor (little RAM).

Architectures (`arch`), with what llama.cpp needs of each beyond llama's keys and tensors:

- `llama`: LLaVA-1.5, SmolVLM (Idefics3) and Pixtral/Mistral language models.
- `qwen2`: InternVL 2.5/3's language model (Q/K/V biases are optional and left out).
- `qwen2vl` (Qwen2-VL, Qwen2.5-VL): `qwen2vl.rope.dimension_sections` (4 counts summing to
  head_dim / 2) makes positions M-RoPE: 4 per image embedding (time, row, column, unused).
  Q/K/V biases are optional and left out.
- `gemma3`: `gemma3.attention.layer_norm_rms_epsilon`; per layer `attn_q_norm`, `attn_k_norm`
  (head_dim), `post_attention_norm` and `post_ffw_norm`. No sliding window is written, so every
  layer attends to the whole context.

The output norm is scaled up (`PEAK`) so logits are peaked: greedy decoding then has clear
top-1/top-2 margins and replies do not flip on rounding noise.
"""
from __future__ import annotations

import functools

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from engine.errors import EbbError


ARCHS = ("llama", "qwen2vl", "gemma3", "qwen2")

# The language model of each vision family: its architecture and the special tokens its
# projector's wrappers look up in the vocabulary (mtmd finds them by their text).
FAMILY_MODELS: dict[str, tuple[str, tuple[str, ...]]] = {
    "mlp": ("llama", ()),
    "qwen2.5vl": ("qwen2vl", ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")),
    "gemma3": ("gemma3", ("<start_of_image>", "<end_of_image>")),
    "idefics3": ("llama", ("<fake_token_around_image>", "<global-img>", "<image>",
                           *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)))),
    "pixtral": ("llama", ("[IMG]", "[IMG_BREAK]", "[IMG_END]")),
    "internvl": ("qwen2", ("<img>", "</img>", "<IMG_CONTEXT>")),
    # audio (engine/synth/projector_gen.py write_audio_projector)
    "ultravox": ("llama", ()),
    "qwen2a": ("qwen2", ("<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>")),
    "qwen2.5o": ("qwen2vl", ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                             "<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>")),
}
PEAK = 6.0  # output_norm weight: logits ~6x wider than a unit-norm model's


@dataclass(frozen=True)
class ModelShape:
    n_layers: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_ctx_train: int = 8192


# Real shapes for planning from the header (`make-model --like`): weights are holes in a sparse file.
LIKE: dict[str, tuple[ModelShape, int]] = {
    "llama-8b": (ModelShape(n_layers=32, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8,
                            n_ctx_train=131072), 128256),
    "llama-70b": (ModelShape(n_layers=80, n_embd=8192, n_ff=28672, n_head=64, n_head_kv=8,
                             n_ctx_train=131072), 128256),
}

SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape(n_layers=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2),
    "3b": ModelShape(n_layers=24, n_embd=2560, n_ff=8192, n_head=20, n_head_kv=4),  # ~3.9 GB f16
}


def _copy_tokenizer(src: Path, w: Any, extra_tokens: tuple[str, ...] = (),
                    skip: tuple[str, ...] = ()) -> int:
    """Copy `src`'s tokenizer into `w`, with `extra_tokens` appended as control tokens (the
    special tokens a vision family's wrappers use). Returns the vocabulary size."""
    from gguf import GGUFValueType, TokenType

    n_vocab = 0
    for key, vtype, sub, value in _tokenizer_fields(str(src), Path(src).stat().st_mtime_ns):
        if key in skip:
            continue
        if key == "tokenizer.ggml.tokens":
            value = list(value) + [t for t in extra_tokens if t not in value]
            n_vocab = len(value)
        elif key == "tokenizer.ggml.token_type":
            value = list(value) + [int(TokenType.CONTROL)] * len(extra_tokens)
        elif key == "tokenizer.ggml.scores":
            value = list(value) + [0.0] * len(extra_tokens)
        w.add_key_value(key, value, vtype, sub if vtype == GGUFValueType.ARRAY else None)
    if not n_vocab:
        raise EbbError(f"{src} has no tokenizer to copy", "pass a llama.cpp chat model")
    return n_vocab


@functools.lru_cache(maxsize=4)
def _tokenizer_fields(src: str, mtime_ns: int) -> tuple[tuple[str, Any, Any, Any], ...]:
    """`src`'s tokenizer keys, read once per file and process (gguf's reader takes seconds to
    open a real vocabulary; the suite writes dozens of models from one)."""
    from gguf import GGUFReader, GGUFValueType

    out = []
    for key, f in GGUFReader(src, "r").fields.items():
        if key.startswith("tokenizer.") or key == "general.quantization_version":
            vtype = f.types[0]
            sub = f.types[1] if vtype == GGUFValueType.ARRAY and len(f.types) > 1 else None
            value = f.contents()
            out.append((key, vtype, sub, tuple(value) if isinstance(value, list) else value))
    return tuple(out)


def _tensors(s: ModelShape, n_vocab: int, arch: str = "llama") -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape = reversed ggml ne) in file order."""
    hd = s.n_embd // s.n_head
    yield "token_embd.weight", (n_vocab, s.n_embd)
    for i in range(s.n_layers):
        p = f"blk.{i}"
        yield f"{p}.attn_norm.weight", (s.n_embd,)
        yield f"{p}.attn_q.weight", (s.n_embd, s.n_embd)
        yield f"{p}.attn_k.weight", (s.n_head_kv * hd, s.n_embd)
        yield f"{p}.attn_v.weight", (s.n_head_kv * hd, s.n_embd)
        yield f"{p}.attn_output.weight", (s.n_embd, s.n_embd)
        if arch == "gemma3":
            yield f"{p}.attn_q_norm.weight", (hd,)
            yield f"{p}.attn_k_norm.weight", (hd,)
            yield f"{p}.post_attention_norm.weight", (s.n_embd,)
        yield f"{p}.ffn_norm.weight", (s.n_embd,)
        yield f"{p}.ffn_gate.weight", (s.n_ff, s.n_embd)
        yield f"{p}.ffn_up.weight", (s.n_ff, s.n_embd)
        yield f"{p}.ffn_down.weight", (s.n_embd, s.n_ff)
        if arch == "gemma3":
            yield f"{p}.post_ffw_norm.weight", (s.n_embd,)
    yield "output_norm.weight", (s.n_embd,)


def _llama_writer(out: Path, shape: ModelShape, name: str, arch: str = "llama",
                  split_max_tensors: int = 0) -> Any:
    """A GGUF writer with the hyper-parameters of `shape` set for `arch` (split in parts of at
    most `split_max_tensors` tensors, as llama.cpp's gguf-split writes them; 0: one file)."""
    import gguf

    if arch not in ARCHS:
        raise EbbError(f"unknown model architecture '{arch}'", f"use one of {', '.join(ARCHS)}")
    w = gguf.GGUFWriter(str(out), arch=arch, split_max_tensors=split_max_tensors)
    w.add_name(name)
    w.add_bool("ebb.synthetic", True)
    w.add_block_count(shape.n_layers)
    w.add_context_length(shape.n_ctx_train)
    w.add_embedding_length(shape.n_embd)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_rope_dimension_count(shape.n_embd // shape.n_head)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    if arch == "qwen2vl":
        hd = shape.n_embd // shape.n_head
        # Qwen2.5-VL's split of the rotary pairs: time, rows, columns (a quarter, 3/8, 3/8)
        t = hd // 8
        w.add_array("qwen2vl.rope.dimension_sections", [t, (hd // 2 - t) // 2, hd // 2 - t - (hd // 2 - t) // 2, 0])
    return w


def write_model(out: Path, shape: ModelShape, tokenizer_from: Path, seed: int = 0,
                family: str = "mlp", chat_template: str | None = None,
                split_max_tensors: int = 0) -> Path:
    """A language model for a vision `family` (FAMILY_MODELS; "mlp" is plain llama);
    `chat_template` (Jinja) in place of the tokenizer source's. With `split_max_tensors` it is
    split as llama.cpp splits models (OUT-00001-of-0000N.gguf, ...): returns the first part."""
    import gguf

    if family not in FAMILY_MODELS:
        raise EbbError(f"unknown model family '{family}'", f"use one of {', '.join(FAMILY_MODELS)}")
    arch, extra = FAMILY_MODELS[family]
    w = _llama_writer(out, shape, f"Ebb synthetic {arch} for {family} (random weights)", arch,
                      split_max_tensors)
    w.add_string("ebb.family", family)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    n_vocab = _copy_tokenizer(tokenizer_from, w, extra, skip=("tokenizer.chat_template",)
                              if chat_template is not None else ())
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.add_vocab_size(n_vocab)
    specs = list(_tensors(shape, n_vocab, arch))
    for name, shp in specs:
        dtype = np.float32 if len(shp) == 1 else np.float16
        w.add_tensor_info(name, shp, np.dtype(dtype), int(np.prod(shp)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shp in specs:
        if name == "output_norm.weight":
            w.write_tensor_data(np.full(shp, PEAK, dtype=np.float32))
        elif name.endswith(("post_attention_norm.weight", "post_ffw_norm.weight")):
            # Gemma's blocks add normalised outputs to an embedding scaled by sqrt(n_embd):
            # at unit weight the input token outweighs them and a tied output echoes it
            w.write_tensor_data(np.full(shp, 4.0, dtype=np.float32))
        elif len(shp) == 1:
            w.write_tensor_data(np.ones(shp, dtype=np.float32))
        else:
            a = rng.standard_normal(shp, dtype=np.float32)
            a *= 1.0 / np.sqrt(shp[1])
            w.write_tensor_data(a.astype(np.float16))
    w.close()
    parts: list[Path] = w.format_shard_names(Path(out))
    return parts[0]


def write_sparse_model(out: Path, like: str) -> Path:
    """A GGUF with the metadata and tensor table of a real model (Q4_0 weights) whose tensor
    data is a hole: the file has its full size but takes almost no disk. For `plan` and tests;
    llama.cpp cannot run it (no tokenizer, no weights)."""
    import gguf

    if like not in LIKE:
        raise EbbError(f"unknown model shape '{like}'", f"use one of {', '.join(LIKE)}")
    shape, n_vocab = LIKE[like]
    w = _llama_writer(out, shape, f"Ebb sparse {like} (header only, no weights)")
    w.add_bool("ebb.sparse", True)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    q4 = gguf.GGMLQuantizationType.Q4_0
    block, block_bytes = gguf.GGML_QUANT_SIZES[q4]
    alignment = 32
    data_bytes = 0
    specs = list(_tensors(shape, n_vocab)) + [("output.weight", (n_vocab, shape.n_embd))]
    for name, shp in specs:
        if len(shp) == 1:
            nbytes = shp[0] * 4
            w.add_tensor_info(name, shp, np.dtype(np.float32), nbytes)
        else:
            rows, cols = shp
            nbytes = rows * cols // block * block_bytes
            w.add_tensor_info(name, (rows, cols // block * block_bytes), np.dtype(np.uint8), nbytes,
                              raw_dtype=q4)
        data_bytes += -(-nbytes // alignment) * alignment
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0] if isinstance(w.fout, list) else w.fout
    assert fout is not None
    fout.flush()
    start = -(-fout.tell() // alignment) * alignment
    fout.truncate(start + data_bytes)  # the weights: one hole
    w.close()
    return out


def with_chat_template(src: Path, out: Path, chat_template: str) -> Path:
    """A copy of the model `src` (its weights and every key) with `chat_template` (Jinja) in
    place of its own: a real model that speaks another template's format (tests of function
    calling in a template's own format on a model that can answer)."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(src, "r")
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(out, arch=str(arch), endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, {gguf.Keys.Tokenizer.CHAT_TEMPLATE: MetadataDetails(
        gguf.GGUFValueType.STRING, chat_template)}, [])
    return out
