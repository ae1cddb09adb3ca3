"""Drafts for speculative decoding from the conversation itself (n-gram lookup, as llama.cpp's
`--spec-type ngram-simple` and "prompt lookup decoding"): where the last few tokens were seen
before, the tokens that followed them then are the guess for what follows now. Documents, code
and quotes repeat; a reply that quotes them gets several tokens a step. Pure: token ids in,
token ids out.

`Speculation` keeps the reply's account: drafts made and tokens accepted, and switches itself
off when drafting does not pay (few tokens accepted for the batches it costs)."""
from __future__ import annotations

from dataclasses import dataclass

MAX_DRAFT = 8  # tokens guessed at once at most (a GPU checks 9 in about the time of one)
NGRAM_SIZES = (4, 3, 2)  # the longest seen-before run of the last tokens wins
MIN_TRIES = 6  # drafts before the account can switch it off
MIN_ACCEPTED_PER_DRAFT = 0.8  # on average: below this it costs more than it gives


class NgramIndex:
    """Where each run of 2-4 tokens last ended, over the tokens seen so far."""

    def __init__(self, tokens: list[int] | None = None) -> None:
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> where it last ended
        self._before: dict[tuple[int, ...], int] = {}  # ... and where it ended before that
        self.add(tokens or [])

    def add(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens)
            for n in NGRAM_SIZES:
                if end >= n:
                    key = tuple(self.tokens[end - n:end])
                    prev = self._last.get(key)
                    self._last[key] = end
                    if prev is not None:
                        self._before[key] = prev

    def draft(self, k: int = MAX_DRAFT) -> list[int]:
        """Up to `k` tokens that followed the longest earlier occurrence of the last tokens."""
        end = len(self.tokens)
        for n in NGRAM_SIZES:
            if end < n:
                continue
            key = tuple(self.tokens[end - n:end])
            at = self._last.get(key)
            if at == end:  # that is the run now: the one before it
                at = self._before.get(key)
            if at is None or at >= end:
                continue
            follow = self.tokens[at:min(at + k, end)]
            if follow:
                return follow
        return []


@dataclass
class Speculation:
    """One reply's drafting, on while it pays: a draft's batch costs `batch_s`, a token alone
    `single_s`; a draft of k tokens that gets a taken pays when (1 + a) × single_s > batch_s.
    Each draft is as long as the last ones earned (twice the tokens taken, plus one: 2 to 8)."""
    on: bool = True
    drafts: int = 0  # batches with a draft
    drafted: int = 0  # tokens guessed
    accepted: int = 0  # of them, taken
    single_s: float = 0.0  # a step of one token (running mean)
    batch_s: float = 0.0  # a draft's batch (running mean)
    length: int = MAX_DRAFT // 2  # the next draft's most tokens

    def stepped(self, seconds: float) -> None:
        """A step of one token took `seconds`."""
        self.single_s = seconds if not self.single_s else 0.8 * self.single_s + 0.2 * seconds

    def record(self, drafted: int, accepted: int, seconds: float = 0.0) -> None:
        self.drafts += 1
        self.drafted += drafted
        self.accepted += accepted
        if seconds:
            self.batch_s = seconds if not self.batch_s else 0.8 * self.batch_s + 0.2 * seconds
        self.length = max(2, min(MAX_DRAFT, 2 * accepted + 1))
        if self.drafts < MIN_TRIES:
            return
        taken = self.accepted / self.drafts
        if taken < MIN_ACCEPTED_PER_DRAFT or (
                self.single_s and self.batch_s and (1 + taken) * self.single_s < self.batch_s):
            self.on = False

    def to_dict(self) -> dict[str, int | bool]:
        return {"drafts": self.drafts, "drafted": self.drafted, "accepted": self.accepted,
                "on": self.on}


def accepted_prefix(draft: list[int], predicted: list[int]) -> int:
    """How many draft tokens the model agrees with: `predicted[j]` is the model's choice after
    the batch's j-th token (the current token, then the drafts)."""
    n = 0
    while n < len(draft) and predicted[n] == draft[n]:
        n += 1
    return n
