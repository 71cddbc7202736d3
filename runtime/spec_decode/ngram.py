"""Prompt lookup: draft tokens copied from the sequence's own history, no draft model.

When the last ``n`` tokens (``n`` from ``max_ngram`` down to ``min_ngram``) occurred earlier in the prompt or the
output, the ``k`` tokens that followed them then are proposed now. Editing, extraction, RAG and code answers
repeat their prompt a lot, so many proposals are right, and one forward pass verifies them all. The drafts are
point masses: verification (``verification.accept``) keeps the output distribution the model's.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kubellm.runtime.engine.sequence import Sequence
from kubellm.runtime.spec_decode.proposer import Draft, Proposer


def find_ngram_continuation(tokens: np.ndarray, max_ngram: int, min_ngram: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix n-gram."""
    n_tokens = len(tokens)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        windows = sliding_window_view(tokens[: n_tokens - 1], n)  # every n-gram that has a next token
        hits = np.flatnonzero((windows == tokens[n_tokens - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the most recent occurrence
            return tokens[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    def __init__(self, max_ngram: int, num_speculative_tokens: int, min_ngram: int = 1,
                 give_up_after: int = 2):
        if max_ngram < min_ngram or min_ngram < 1 or num_speculative_tokens < 1:
            raise ValueError(f"speculative n-gram sizes {min_ngram}..{max_ngram} and "
                             f"{num_speculative_tokens} tokens: need 1 <= min <= max and tokens >= 1")
        super().__init__(give_up_after)
        self.max_ngram, self.min_ngram, self.k = max_ngram, min_ngram, num_speculative_tokens

    def propose_one(self, seq: Sequence, room: int) -> list[int]:
        """Draft tokens for ``seq`` (at most ``room``), or [] when it is backing off or nothing matches."""
        if self.backoff.paused(seq):
            return []
        k = min(self.k, room)
        if k < 1:
            return []
        return find_ngram_continuation(np.asarray(seq.token_ids, dtype=np.int64), self.max_ngram,
                                       self.min_ngram, k)

    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[Draft]:
        return [Draft(self.propose_one(seq, room)) for seq, room in zip(seqs, rooms, strict=True)]
