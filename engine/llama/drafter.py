"""A draft model: a small model of the same vocabulary that guesses the next tokens of the
loaded model's reply (speculative decoding, as llama-server's `--model-draft`). The runtime's
decode loop checks its guesses in one batch, as it checks n-gram drafts (lookup.py).

It holds the conversation's text tokens in a context of its own (pictures and clips are the
loaded model's alone: their cells are left out, and the guesses are made from the text around
them, which is still a guess the check keeps or not; llama.cpp #17066 refuses drafting there).
Its cache follows the conversation by common prefix: a new reply evaluates only what came since.
On the runtime's thread.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import EbbError
from engine.llama.lib import llama
from engine.llama.snapshots import common_prefix

if TYPE_CHECKING:
    from engine.llama.runtime import TextRuntime

VOCAB_CHECKED = 512  # token texts compared with the loaded model's (and the last ones, and the specials)


class Drafter:
    def __init__(self, path: Path, n_ctx: int, n_threads: int, target: TextRuntime) -> None:
        """`target`: the loaded model's runtime, whose vocabulary the draft must share."""
        from engine.gguf.info import model_info, read_gguf
        from engine.llama.loaded_model import LoadParams
        from engine.llama.runtime import TextRuntime

        self.path = path
        info = model_info(read_gguf(path))  # a damaged file says so here
        # its own context up to what it was trained for: past it, no guesses (the reply goes on)
        self.rt = TextRuntime(LoadParams(path, n_ctx=min(n_ctx, info.max_context), n_threads=n_threads), info)
        try:
            self._check_vocab(target)
        except BaseException:
            self.rt.close()
            raise
        self.n_ctx = self.rt.n_ctx

    def _check_vocab(self, target: TextRuntime) -> None:
        L = llama()
        mine, theirs = self.rt.vocab, target.vocab
        n = L.llama_vocab_n_tokens(mine)
        if n != L.llama_vocab_n_tokens(theirs):
            raise EbbError(f"the draft model {self.path.name} has a vocabulary of {n} tokens, the loaded "
                           f"model {L.llama_vocab_n_tokens(theirs)}: its guesses would be other tokens",
                           "pick a draft model of the same family (the same tokenizer)")
        ids = [*range(min(n, VOCAB_CHECKED)), *range(max(0, n - VOCAB_CHECKED), n),
               *(t for t in (L.llama_vocab_bos(mine), L.llama_vocab_eos(mine)) if t >= 0)]
        for t in ids:
            if L.llama_vocab_get_text(mine, t) != L.llama_vocab_get_text(theirs, t):
                raise EbbError(f"the draft model {self.path.name} names token {t} otherwise than the "
                               "loaded model: their tokenizers differ", "pick a draft model of the "
                               "same family (the same tokenizer)")

    def draft(self, context: list[int], k: int) -> list[int]:
        """Up to `k` greedy guesses after `context` (the conversation's text tokens and the token
        just chosen). None where the context no longer fits the draft's."""
        import numpy as np

        if k <= 0 or not context or len(context) + k >= self.n_ctx:
            return []
        L = llama()
        rt = self.rt
        n_keep = min(common_prefix(rt.slot.cells, context), len(context) - 1)
        rt.slot.drop_from(n_keep)
        rt._decode_tokens(context[n_keep:])
        out: list[int] = []
        n_vocab = rt.info.n_vocab
        while True:
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(rt.ctx, -1), shape=(n_vocab,))
            tok = int(np.argmax(logits))
            if L.llama_vocab_is_eog(rt.vocab, tok):
                break
            out.append(tok)
            if len(out) == k:
                break
            rt._decode_tokens([tok])
        return out

    def close(self) -> None:
        self.rt.close()
