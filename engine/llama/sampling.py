"""How a reply's next token is chosen: `GenParams` (what a request asks for) built into
llama.cpp's sampler chain (grammar first, then logit bias, penalties, and greedy or top-k, top-p,
min-p, temperature and a seeded draw), and each sampled token's log-probabilities in OpenAI's
shape, from the model's own logits."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from engine.errors import EbbError
from engine.events import Logprob
from engine.llama import log as llama_log
from engine.llama.lib import llama

REPEAT_LAST_N = 64  # tokens the repeat penalty looks back over (llama.cpp's default)


@dataclass(frozen=True)
class GenParams:
    max_tokens: int = 0  # 0: no cap (until the model stops or the context is full)
    temperature: float = 0.7
    seed: int = 0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0  # 1: none; over the last REPEAT_LAST_N tokens
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from a token already used
    frequency_penalty: float = 0.0  # ... and this much per use
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    grammar: str = ""  # GBNF (root rule "root"): only what it allows is sampled (JSON replies)
    # the grammar is JSON's: with a cap, the reply ends in one complete value (json_tail.py)
    json_reply: bool = False
    top_logprobs: int = -1  # -1: none; else each sampled token's logprob and this many best
    # with top_logprobs: told each token's entry as it is sampled (a stream sends them along)
    on_logprob: Callable[[Logprob], None] | None = field(default=None, compare=False)
    # speculative decoding from n-gram lookup (engine/llama/lookup.py): "auto" drafts where the
    # reply is greedy and nothing else shapes the choice, and stops where it does not pay
    speculate: str = "auto"  # auto | off

    @property
    def can_speculate(self) -> bool:
        """Drafts can be checked: each row of a draft's batch is sampled by the reply's own chain
        and a guess is taken when the draw is the guess, greedy or sampled (with a sure guess,
        q(d) = 1, that is speculative sampling's rule: taken with probability p(d), else a draw
        from p without d, so every token keeps its distribution); with no grammar, penalties,
        bias or logprobs (each of those keeps state or needs every token's step)."""
        return (self.speculate == "auto" and not self.grammar
                and not self.json_reply and self.repeat_penalty == 1.0 and not self.presence_penalty
                and not self.frequency_penalty and not self.logit_bias and self.top_logprobs < 0)


def sampler_chain(gp: GenParams, vocab: Any, n_vocab: int) -> Any:
    """A new llama.cpp sampler chain for `gp`; the caller frees it (llama_sampler_free)."""
    L = llama()
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    if gp.grammar:  # first: every later stage picks among what the grammar allows
        g = L.llama_sampler_init_grammar(vocab, gp.grammar.encode(), b"root")
        if not g:
            L.llama_sampler_free(chain)
            raise EbbError(f"llama.cpp could not use the reply's grammar: "
                           f"{llama_log.last_error('no detail')}",
                           "check the grammar (or the JSON schema it was made from)")
        L.llama_sampler_chain_add(chain, g)
    if gp.logit_bias:
        L.llama_sampler_chain_add(chain, _logit_bias_sampler(gp.logit_bias, n_vocab, chain))
    if gp.repeat_penalty != 1.0 or gp.presence_penalty or gp.frequency_penalty:
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_penalties(
            n_vocab, REPEAT_LAST_N, gp.repeat_penalty, gp.frequency_penalty, gp.presence_penalty))
    if gp.temperature <= 0:
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
    else:
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(gp.top_k))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(gp.top_p, 1))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_min_p(gp.min_p, 1))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(gp.temperature))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(gp.seed & 0xFFFFFFFF))
    return chain


def _logit_bias_sampler(biases: tuple[tuple[int, float], ...], n_vocab: int, chain: Any) -> Any:
    L = llama()
    outside = [t for t, _ in biases if not 0 <= t < n_vocab]
    if outside:
        L.llama_sampler_free(chain)
        raise EbbError(f"logit_bias names token {outside[0]}, and this model's vocabulary "
                       f"has {n_vocab} tokens (0 to {n_vocab - 1})", "use this model's token ids")
    entries = (L.llama_logit_bias * len(biases))(*[L.llama_logit_bias(t, b) for t, b in biases])
    return L.llama_sampler_init_logit_bias(n_vocab, len(biases), entries)  # copies them


def logprob_entry(ctx: Any, n_vocab: int, token: int, k: int,
                  piece: Callable[[int], bytes], row: int = -1) -> Logprob:
    """The sampled token's log-probability and the `k` most likely, from the context's last
    logits (before any sampler), or a batch's `row` (a lane's, engine/llama/lanes.py)."""
    import numpy as np

    L = llama()
    logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, row), shape=(n_vocab,)).astype(np.float64)
    top = float(logits.max())
    lp = logits - (top + np.log(np.exp(logits - top).sum()))

    def entry(t: int, top: tuple[Logprob, ...] = ()) -> Logprob:
        raw = piece(t)
        return Logprob(raw.decode("utf-8", errors="replace"), float(lp[t]), tuple(raw), top)

    best = np.argpartition(-lp, k)[:k] if k else np.array([], dtype=int)
    best = best[np.argsort(-lp[best])]
    return entry(token, tuple(entry(int(t)) for t in best))

