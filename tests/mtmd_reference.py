"""llama.cpp's own multimodal pipeline, as its tools run it (mtmd-cli / llama-server): the
whole templated prompt with a marker per image goes through `mtmd_tokenize` with the bitmaps,
`mtmd_helper_eval_chunks` evaluates every chunk, then greedy decoding. Nothing of Ebb's engine
is used beyond binding the library (and reading pictures as RGB; sound is decoded by mtmd's
own helper, as its tools do), so tests can hold Ebb's
replies against it.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np

from engine.llama.lib import llama


def reference_reply(model: Path, mmproj: Path, prompt: str, images: list[Path], n_tokens: int,
                    n_threads: int = 2, n_ctx: int = 2048, n_batch: int = 512,
                    flash_attn: bool = True) -> tuple[str, list[dict[str, Any]]]:
    """The greedy reply llama.cpp's pipeline gives to `prompt` (already templated, one mtmd
    marker per image, in order), and each step as a logprobs entry: the token, and the best
    two logits as its `top_logprobs` (only their difference, the margin, is meant)."""
    import llama_cpp.mtmd_cpp as M
    from PIL import Image

    L = llama()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    no_devices = (ctypes.c_void_p * 1)(None)  # CPU only: never ask another registered device
    mp.devices = ctypes.cast(no_devices, ctypes.c_void_p)
    model_p = L.llama_model_load_from_file(str(model).encode(), mp)
    assert model_p, f"llama.cpp could not load {model}"
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_batch, n_batch
    cp.n_threads = cp.n_threads_batch = n_threads
    cp.flash_attn_type = 1 if flash_attn else 0
    ctx = L.llama_init_from_model(model_p, cp)
    params = M.mtmd_context_params_default()
    params.use_gpu = False
    params.n_threads = n_threads
    params.print_timings = False
    params.flash_attn_type = 1 if flash_attn else 0
    mctx = M.mtmd_init_from_file(str(mmproj).encode(), model_p, params)
    assert mctx, f"mtmd could not load {mmproj}"
    bitmaps: list[Any] = []
    chunks = M.mtmd_input_chunks_init()
    vocab = L.llama_model_get_vocab(model_p)
    try:
        for path in images:
            if Path(path).suffix.lower() in (".wav", ".mp3", ".flac"):  # decoded by mtmd's helper
                bm = M.mtmd_helper_bitmap_init_from_file(mctx, str(path).encode(), False)
                assert bm and M.mtmd_bitmap_is_audio(bm), f"mtmd could not decode {path}"
                bitmaps.append(bm)
                continue
            rgb = Image.open(path).convert("RGB")
            data = rgb.tobytes()
            buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
            bitmaps.append(M.mtmd_bitmap_init(rgb.width, rgb.height, buf))
        text = M.mtmd_input_text()
        raw = prompt.encode()
        text.text, text.text_len = raw, len(raw)
        text.add_special, text.parse_special = True, True
        arr = (M.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
        assert M.mtmd_tokenize(mctx, chunks, ctypes.byref(text), arr, len(bitmaps)) == 0
        n_past = L.llama_pos(0)
        assert M.mtmd_helper_eval_chunks(mctx, ctx, chunks, 0, 0, n_batch, True,
                                         ctypes.byref(n_past)) == 0
        pos = n_past.value
        n_vocab = L.llama_vocab_n_tokens(vocab)
        out: list[int] = []
        steps: list[dict[str, Any]] = []

        def piece(tok: int) -> bytes:
            buf = ctypes.create_string_buffer(256)
            n = L.llama_token_to_piece(vocab, tok, buf, len(buf), 0, False)
            return buf.raw[:n]

        for _ in range(n_tokens):
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            top2 = np.partition(logits, -2)[-2:]
            tok = int(np.argmax(logits))
            if L.llama_vocab_is_eog(vocab, tok):
                break
            raw = piece(tok)
            steps.append({"token": raw.decode("utf-8", errors="replace"), "bytes": list(raw),
                          "top_logprobs": [{"logprob": float(top2.max())},
                                           {"logprob": float(top2.min())}]})
            out.append(tok)
            batch = L.llama_batch_init(1, 0, 1)
            batch.n_tokens = 1
            batch.token[0] = tok
            batch.pos[0] = pos
            batch.n_seq_id[0] = 1
            batch.seq_id[0][0] = 0
            batch.logits[0] = 1
            assert L.llama_decode(ctx, batch) == 0
            L.llama_batch_free(batch)
            pos += 1
        text = b"".join(piece(tok) for tok in out)
        return text.decode("utf-8", errors="replace"), steps
    finally:
        M.mtmd_input_chunks_free(chunks)
        for b in bitmaps:
            M.mtmd_bitmap_free(b)
        M.mtmd_free(mctx)
        L.llama_free(ctx)
        L.llama_model_free(model_p)
