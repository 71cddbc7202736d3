"""The engine's side of speculative decoding: drafts appended before scheduling, trimmed to what was scheduled,
resolved after sampling. Which proposer drafts is the :class:`~kubellm.runtime.spec_decode.proposer.Proposer`'s
business (``factory.make_proposer`` builds it)."""

from __future__ import annotations

from kubellm.runtime.engine.sequence import Sequence, SequenceStatus
from kubellm.runtime.spec_decode.proposer import Proposer, draft_room, speculable
from kubellm.runtime.spec_decode.verification import accept


class Speculator:
    """The engine's side of speculation: drafts before scheduling, trims them to what was scheduled, resolves
    them after sampling. Drafts sit at the end of ``seq.token_ids`` (``seq.num_draft_tokens`` of them) between
    ``propose`` and ``resolve``, so the scheduler gives them KV slots and the runner computes them like any
    chunk; nothing of them outlives the step unless accepted."""

    def __init__(self, proposer: Proposer, block_manager, max_model_len: int):
        self.proposer, self.block_manager, self.max_model_len = proposer, block_manager, max_model_len

    def propose(self, running: list[Sequence]) -> list[Sequence]:
        """Append drafts to decoding sequences that can take them without crowding the KV cache."""
        candidates, rooms = [], []
        for seq in running:
            if len(seq) - seq.num_computed_tokens != 1 or not speculable(seq):
                continue  # not decoding (a prefill chunk is pending), or drafts would change its output
            candidates.append(seq)
            rooms.append(draft_room(seq, self.max_model_len))
        if not candidates:
            return []
        bm = self.block_manager
        spare = len(bm.free) - len(running)  # keep a block per running sequence for plain decoding
        drafted = []
        for seq, draft in zip(candidates, self.proposer.propose(candidates, rooms), strict=True):
            extra = bm.blocks_needed(len(seq) + len(draft.tokens)) - len(seq.block_table)
            if not draft.tokens or extra > spare:
                continue
            spare -= extra
            seq.token_ids.extend(draft.tokens)
            seq.num_draft_tokens = len(draft.tokens)
            seq.draft_probs = draft.probs
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
                if seq.draft_probs is not None:
                    seq.draft_probs = seq.draft_probs[:keep] if keep else None

    def observe(self, batch: list, last_hidden: tuple | None) -> None:
        """After postprocess: a proposer that reads hidden states gets the step's (``ModelRunner.last_hidden``:
        the final hidden states and where each batch entry's rows start)."""
        if self.proposer.reads_hidden_states:
            self.proposer.observe(batch, *last_hidden)

    def resolve(self, scheduled, sampled: list[int]) -> list[int]:
        """Accept the drafts of one scheduled entry against the tokens sampled at their positions; roll the
        rest back. Returns the tokens the step adds (accepted drafts + one)."""
        seq, d = scheduled.seq, scheduled.seq.num_draft_tokens
        new = accept(seq.token_ids[len(seq.token_ids) - d :], sampled)
        accepted = len(new) - 1
        del seq.token_ids[len(seq.token_ids) - d + accepted :]  # accepted drafts stay: their K/V are right
        seq.num_draft_tokens, seq.draft_probs = 0, None
        scheduled.num_tokens = 1 + accepted  # rejected positions' K/V are garbage beyond num_computed_tokens
        self.proposer.record(seq, d, accepted)
        return new
