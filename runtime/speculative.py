"""Speculative decoding by prompt lookup: draft tokens copied from the sequence's own history, no draft model.

When the last ``n`` tokens (``n`` from ``max_ngram`` down to ``min_ngram``) occurred earlier in the prompt or the
output, the ``k`` tokens that followed them then are proposed now. Editing, extraction, RAG and code answers
repeat their prompt a lot, so many proposals are right, and one forward pass verifies them all.

Verification (``accept``): the model samples a token at every drafted position with the request's own
sampling parameters; drafts are accepted while the sampled token equals them, and the first sampled token that
differs is kept as the correction (or, all accepted, the token after the last draft). For a point-mass
proposal this *is* the standard rejection rule (accept draft d with probability min(1, p(d)/q(d)) = p(d); on
rejection sample from the residual, which is p without d, renormalised), so the output distribution is the
model's, and greedy output is token for token what decoding without speculation gives.

Back-off: a sequence whose drafts keep being rejected stops proposing for a while (doubling each time), so a
workload that does not repeat itself pays almost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kubellm.runtime.sequence import Sequence, SequenceStatus


@dataclass
class _BackOff:
    rejected_in_a_row: int = 0
    pause: int = 0  # proposals skipped left
    next_pause: int = 2


@dataclass
class SpeculationStats:
    num_drafts: int = 0  # proposals verified
    num_draft_tokens: int = 0  # tokens proposed and verified
    num_accepted_tokens: int = 0  # of which accepted


def speculable(seq: Sequence) -> bool:
    """Whether drafts can be verified for this request without changing what it gets.

    Excluded: per-token state that one forward pass over several positions would not update between them
    (penalties, min_tokens, a grammar), outputs that report per-token data (logprobs), and seeded requests
    (their tokens must not depend on how many drafts a batch had room for)."""
    p = seq.sampling_params
    return (p.seed is None and p.logprobs is None and p.prompt_logprobs is None and p.guided is None
            and not p.logit_bias and not p.needs_penalties and seq.num_output_tokens >= p.min_tokens)


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


class NgramProposer:
    def __init__(self, max_ngram: int, num_speculative_tokens: int, min_ngram: int = 1,
                 give_up_after: int = 2):
        if max_ngram < min_ngram or min_ngram < 1 or num_speculative_tokens < 1:
            raise ValueError(f"speculative n-gram sizes {min_ngram}..{max_ngram} and "
                             f"{num_speculative_tokens} tokens: need 1 <= min <= max and tokens >= 1")
        self.max_ngram, self.min_ngram, self.k = max_ngram, min_ngram, num_speculative_tokens
        self.give_up_after = give_up_after
        self._backoff: dict[int, _BackOff] = {}
        self.stats = SpeculationStats()

    def propose(self, seq: Sequence, room: int) -> list[int]:
        """Draft tokens for ``seq`` (at most ``room``), or [] when it is backing off or nothing matches."""
        state = self._backoff.get(seq.seq_id)
        if state is not None and state.pause > 0:
            state.pause -= 1
            return []
        k = min(self.k, room)
        if k < 1:
            return []
        return find_ngram_continuation(np.asarray(seq.token_ids, dtype=np.int64), self.max_ngram,
                                       self.min_ngram, k)

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafted
        s.num_accepted_tokens += num_accepted
        state = self._backoff.setdefault(seq.seq_id, _BackOff())
        if num_accepted:
            state.rejected_in_a_row, state.next_pause = 0, 2
            return
        state.rejected_in_a_row += 1
        if state.rejected_in_a_row >= self.give_up_after:
            state.pause, state.next_pause = state.next_pause, min(state.next_pause * 2, 64)
            state.rejected_in_a_row = 0

    def forget(self, seq: Sequence) -> None:
        self._backoff.pop(seq.seq_id, None)


def accept(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verified step adds: the accepted drafts, then the first sampled token that differs (or the
    one sampled after the last draft). ``sampled[i]`` was sampled at the position of ``drafts[i]``."""
    n = 0
    while n < len(drafts) and sampled[n] == drafts[n]:
        n += 1
    return drafts[:n] + [sampled[n]]


class Speculator:
    """The engine's side of speculation: drafts before scheduling, trims them to what was scheduled, resolves
    them after sampling. Drafts sit at the end of ``seq.token_ids`` (``seq.num_draft_tokens`` of them) between
    ``propose`` and ``resolve``, so the scheduler gives them KV slots and the runner computes them like any
    chunk; nothing of them outlives the step unless accepted."""

    def __init__(self, proposer: NgramProposer, block_manager, max_model_len: int):
        self.proposer, self.block_manager, self.max_model_len = proposer, block_manager, max_model_len

    def propose(self, running: list[Sequence]) -> list[Sequence]:
        """Append drafts to decoding sequences that can take them without crowding the KV cache."""
        bm = self.block_manager
        spare = len(bm.free) - len(running)  # keep a block per running sequence for plain decoding
        drafted = []
        for seq in running:
            if len(seq) - seq.num_computed_tokens != 1 or not speculable(seq):
                continue  # not decoding (a prefill chunk is pending), or drafts would change its output
            p = seq.sampling_params
            room = self.max_model_len - len(seq) - 1
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - seq.num_output_tokens - 1)
            drafts = self.proposer.propose(seq, room)
            extra = bm.blocks_needed(len(seq) + len(drafts)) - len(seq.block_table)
            if not drafts or extra > spare:
                continue
            spare -= extra
            seq.token_ids.extend(drafts)
            seq.num_draft_tokens = len(drafts)
            drafted.append(seq)
        return drafted

    @staticmethod
    def trim(drafted: list[Sequence], batch: list) -> None:
        """Drop the drafts the scheduler did not schedule (budget, or preempted: recompute must not see them)."""
        scheduled = {s.seq.seq_id: s.num_tokens for s in batch}
        for seq in drafted:
            running = seq.status == SequenceStatus.RUNNING
            keep = min(seq.num_draft_tokens, scheduled.get(seq.seq_id, 1) - 1) if running else 0
            if keep < seq.num_draft_tokens:
                del seq.token_ids[len(seq.token_ids) - seq.num_draft_tokens + keep :]
                seq.num_draft_tokens = keep

    def resolve(self, scheduled, sampled: list[int]) -> list[int]:
        """Accept the drafts of one scheduled entry against the tokens sampled at their positions; roll the
        rest back. Returns the tokens the step adds (accepted drafts + one)."""
        seq, d = scheduled.seq, scheduled.seq.num_draft_tokens
        new = accept(seq.token_ids[len(seq.token_ids) - d :], sampled)
        accepted = len(new) - 1
        del seq.token_ids[len(seq.token_ids) - d + accepted :]  # accepted drafts stay: their K/V are right
        seq.num_draft_tokens = 0
        scheduled.num_tokens = 1 + accepted  # rejected positions' K/V are garbage beyond num_computed_tokens
        self.proposer.record(seq, d, accepted)
        return new
