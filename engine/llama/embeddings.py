"""Embeddings (the endpoint's /v1/embeddings): one vector per token list from a loaded model,
in a context of its own, so a conversation's KV cache is untouched."""
from __future__ import annotations

from typing import Any, Sequence

from engine.errors import EbbError
from engine.llama import log as llama_log
from engine.llama.lib import flash_attn_type, llama


def embed(model: Any, inputs: Sequence[list[int]], threads: tuple[int, int],
          flash_attn: bool | None) -> list[list[float]]:
    """One vector per token list: the model's own pooling (an embedding model's GGUF says
    which), else the mean over the tokens, L2-normalised. The context's KV cache is in RAM
    and freed before returning: no device memory stays taken. `threads`: (single tokens,
    batches)."""
    import numpy as np

    L = llama()
    cparams = L.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = max(max(len(t) for t in inputs), 8)
    cparams.n_seq_max = 1
    cparams.n_threads, cparams.n_threads_batch = threads
    cparams.embeddings = True
    cparams.offload_kqv = False
    if flash_attn is not None:
        cparams.flash_attn_type = flash_attn_type(flash_attn)
    ctx = None
    for pooling in (L.LLAMA_POOLING_TYPE_UNSPECIFIED, L.LLAMA_POOLING_TYPE_MEAN):
        cparams.pooling_type = pooling
        ctx = L.llama_init_from_model(model, cparams)
        if not ctx:
            raise EbbError(f"llama.cpp could not create a context for embeddings: "
                           f"{llama_log.last_error('out of memory?')}")
        if L.llama_pooling_type(ctx) != L.LLAMA_POOLING_TYPE_NONE:
            break  # the model's own, or the mean
        L.llama_free(ctx)
    try:
        if L.llama_pooling_type(ctx) == L.LLAMA_POOLING_TYPE_RANK:
            raise EbbError("this model ranks pairs of texts; it makes no embeddings")
        n_embd = L.llama_model_n_embd(model)
        out = []
        for tokens in inputs:
            L.llama_memory_clear(L.llama_get_memory(ctx), True)
            batch = L.llama_batch_init(len(tokens), 0, 1)
            try:
                batch.n_tokens = len(tokens)
                for j, tok in enumerate(tokens):
                    batch.token[j], batch.pos[j], batch.n_seq_id[j] = tok, j, 1
                    batch.seq_id[j][0], batch.logits[j] = 0, True
                rc = L.llama_decode(ctx, batch)
            finally:
                L.llama_batch_free(batch)
            if rc != 0:
                raise EbbError(f"llama.cpp could not compute the embedding (code {rc}): "
                               f"{llama_log.last_error('no detail')}")
            vec = np.ctypeslib.as_array(L.llama_get_embeddings_seq(ctx, 0),
                                        shape=(n_embd,)).astype(np.float64)
            norm = float(np.linalg.norm(vec))
            out.append((vec / norm if norm > 0 else vec).tolist())
        return out
    finally:
        L.llama_free(ctx)
