"""The proposer interface: what each way of drafting tokens implements, and what they share.

Three proposers sit behind it: prompt lookup (:class:`~kubellm.runtime.spec_decode.ngram.NgramProposer`), a
small draft model (:class:`~kubellm.runtime.spec_decode.draft_model.DraftModelProposer`) and an EAGLE head
(:class:`~kubellm.runtime.spec_decode.eagle.EagleProposer`). ``make_proposer`` (``factory.py``) builds the one
the engine config names; the engine drives it through this life cycle and never asks which one it is:

1. ``kv_block_bytes()``: what one block of the proposer's own KV cache costs (0: it has none); the engine takes
   it out of the KV-cache budget, so its pool and the proposer's have the same number of blocks;
2. ``allocate(num_blocks)``: the proposer builds that pool, once the engine has sized its own;
3. each step, ``propose(seqs, rooms)`` before scheduling (through the :class:`Speculator`), ``record`` after
   verification, and ``observe(batch, hidden, starts)`` after postprocess for a proposer that
   ``reads_hidden_states`` (the runner then keeps the served model's final hidden states);
4. ``forget(seq)`` when a request ends.

Drafts are verified in ``verification.py``. A sequence whose drafts keep being rejected stops proposing for a
while (doubling each time), so a workload that does not repeat itself pays almost nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kubellm.runtime.engine.sequence import Sequence
from kubellm.runtime.spec_decode.verification import sampling_probs


@dataclass
class Draft:
    """A proposal for one sequence: its tokens and, from a model drafting for a sampled request, the distribution
    each was drawn from (``probs`` [len(tokens), V] float32; None for point-mass drafts: prompt lookup, greedy)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


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


def draft_room(seq: Sequence, max_model_len: int) -> int:
    """Draft tokens ``seq`` can take this step: its context length and max_tokens leave room for them plus the
    token verification adds."""
    room = max_model_len - len(seq) - 1
    if seq.sampling_params.max_tokens is not None:
        room = min(room, seq.sampling_params.max_tokens - seq.num_output_tokens - 1)
    return room


@dataclass
class _BackOff:
    rejected_in_a_row: int = 0
    pause: int = 0  # proposals skipped left
    next_pause: int = 2


class BackOffTracker:
    """Counts what was drafted and accepted, and pauses a sequence whose drafts keep failing (2, 4, 8... up to
    64 proposals skipped after ``give_up_after`` fully rejected drafts in a row)."""

    def __init__(self, give_up_after: int = 2):
        self.give_up_after = give_up_after
        self._state: dict[int, _BackOff] = {}
        self.stats = SpeculationStats()

    def paused(self, seq: Sequence) -> bool:
        """Whether ``seq`` skips this proposal (counts the skip)."""
        state = self._state.get(seq.seq_id)
        if state is not None and state.pause > 0:
            state.pause -= 1
            return True
        return False

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafted
        s.num_accepted_tokens += num_accepted
        state = self._state.setdefault(seq.seq_id, _BackOff())
        if num_accepted:
            state.rejected_in_a_row, state.next_pause = 0, 2
            return
        state.rejected_in_a_row += 1
        if state.rejected_in_a_row >= self.give_up_after:
            state.pause, state.next_pause = state.next_pause, min(state.next_pause * 2, 64)
            state.rejected_in_a_row = 0

    def forget(self, seq: Sequence) -> None:
        self._state.pop(seq.seq_id, None)


class Proposer(ABC):
    """Drafts tokens for decoding sequences. Subclasses implement :meth:`propose`, and the hooks their own KV
    cache or the served model's hidden states need; the back-off and the counters are shared."""

    reads_hidden_states = False  # drafts from the served model's final hidden states (see observe)

    def __init__(self, give_up_after: int = 2):
        self.backoff = BackOffTracker(give_up_after)

    @abstractmethod
    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[Draft]:
        """One draft per sequence of ``seqs`` (decoding, ``speculable``), at most ``rooms[i]`` tokens each; an
        empty draft where it has none (backing off, nothing found, no room in its own cache)."""

    def kv_block_bytes(self) -> int:
        """Bytes one block of the proposer's own KV cache takes (0: it keeps none)."""
        return 0

    def allocate(self, num_blocks: int) -> None:  # noqa: B027 - optional hook: most proposers keep no cache
        """Build the proposer's own KV cache with ``num_blocks`` blocks (as many as the engine's pool)."""

    def observe(self, batch: list, hidden: torch.Tensor, starts: list[int]) -> None:  # noqa: B027 - optional hook
        """After each step's postprocess, with ``reads_hidden_states``: the served model's final hidden states
        ``hidden`` [rows, hidden_size] of the scheduled ``batch``, entry ``i``'s first row at ``starts[i]``."""

    @property
    def stats(self) -> SpeculationStats:
        return self.backoff.stats

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """Verification's outcome for one draft of ``seq``: counted, and it drives the back-off."""
        self.backoff.record(seq, num_drafted, num_accepted)

    def forget(self, seq: Sequence) -> None:
        """Drop the state kept for a finished sequence."""
        self.backoff.forget(seq)


def draw_drafts(logits: torch.Tensor, params: list, vocab_size: int
                ) -> tuple[list[int], list[torch.Tensor | None] | None]:
    """One draft token per row of a drafting model's ``logits`` [R, V'] and the distribution it came from (None
    for greedy rows; None altogether when every row is greedy): the argmax for greedy requests, else a draw from
    :func:`~kubellm.runtime.spec_decode.verification.sampling_probs` under the request's parameters. Logits are
    cut or padded to ``vocab_size`` first (a padded embedding's extra rows are no tokens of the served model)."""
    if logits.shape[1] > vocab_size:
        logits = logits[:, :vocab_size]
    elif logits.shape[1] < vocab_size:
        logits = torch.nn.functional.pad(logits, (0, vocab_size - logits.shape[1]), value=float("-inf"))
    greedy = [p.temperature < 1e-5 or p.top_k == 1 for p in params]
    if all(greedy):
        return logits.argmax(dim=-1).tolist(), None
    q = sampling_probs(logits, params)
    tokens = torch.multinomial(q, 1).squeeze(1).tolist()
    return tokens, [None if g else q[r] for r, g in enumerate(greedy)]
