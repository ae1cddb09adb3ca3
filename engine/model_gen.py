"""Write llama-architecture language models with random f16 weights and a real tokenizer.

For realistic swap timings on a real GPU (several GB, real shapes) and for tests. The tokenizer
and chat template are copied from a real model (SmolLM2 by default), so llama.cpp loads and runs
the file; its replies are noise. Weights stream to disk tensor by tensor (little RAM).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from engine.errors import EbbError


@dataclass(frozen=True)
class ModelShape:
    n_layers: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_ctx_train: int = 8192


SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape(n_layers=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2),
    "3b": ModelShape(n_layers=24, n_embd=2560, n_ff=8192, n_head=20, n_head_kv=4),  # ~3.9 GB f16
}


def _copy_tokenizer(src: Path, w: Any) -> int:
    from gguf import GGUFReader, GGUFValueType

    r = GGUFReader(src, "r")
    n_vocab = 0
    for key, f in r.fields.items():
        if not (key.startswith("tokenizer.") or key == "general.quantization_version"):
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == GGUFValueType.ARRAY and len(f.types) > 1 else None
        value = f.contents()
        if key == "tokenizer.ggml.tokens":
            n_vocab = len(value)
        w.add_key_value(key, value, vtype, sub)
    if not n_vocab:
        raise EbbError(f"{src} has no tokenizer to copy", "pass a llama.cpp chat model")
    return n_vocab


def _tensors(s: ModelShape, n_vocab: int) -> Iterator[tuple[str, tuple[int, ...]]]:
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
        yield f"{p}.ffn_norm.weight", (s.n_embd,)
        yield f"{p}.ffn_gate.weight", (s.n_ff, s.n_embd)
        yield f"{p}.ffn_up.weight", (s.n_ff, s.n_embd)
        yield f"{p}.ffn_down.weight", (s.n_embd, s.n_ff)
    yield "output_norm.weight", (s.n_embd,)


def write_model(out: Path, shape: ModelShape, tokenizer_from: Path, seed: int = 0) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(out), arch="llama")
    w.add_name("Ebb synthetic llama (random weights)")
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
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    n_vocab = _copy_tokenizer(tokenizer_from, w)
    w.add_vocab_size(n_vocab)
    specs = list(_tensors(shape, n_vocab))
    for name, shp in specs:
        dtype = np.float32 if len(shp) == 1 else np.float16
        w.add_tensor_info(name, shp, np.dtype(dtype), int(np.prod(shp)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _name, shp in specs:
        if len(shp) == 1:
            w.write_tensor_data(np.ones(shp, dtype=np.float32))
        else:
            a = rng.standard_normal(shp, dtype=np.float32)
            a *= 1.0 / np.sqrt(shp[1])
            w.write_tensor_data(a.astype(np.float16))
    w.close()
    return out
