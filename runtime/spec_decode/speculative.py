"""Speculative decoding: drafts proposed cheaply, verified by the model in one forward pass.

Three proposers: prompt lookup (``NgramProposer``, here), a small draft model (``DraftModelProposer`` in
``runtime/spec_decode/draft_model.py``) and an EAGLE head (``EagleProposer`` in ``runtime/spec_decode/eagle.py``). All hand the
:class:`Speculator` a batch of drafts, and all are verified here.

Prompt lookup: draft tokens copied from the sequence's own history, no draft model.

When the last ``n`` tokens (``n`` from ``max_ngram`` down to ``min_ngram``) occurred earlier in the prompt or the
output, the ``k`` tokens that followed them then are proposed now. Editing, extraction, RAG and code answers
repeat their prompt a lot, so many proposals are right, and one forward pass verifies them all.

Verification (``accept``): the model samples a token at every drafted position with the request's own
sampling parameters; drafts are accepted while the sampled token equals them, and the first sampled token that
differs is kept as the correction (or, all accepted, the token after the last draft). For a point-mass
proposal this *is* the standard rejection rule (accept draft d with probability min(1, p(d)/q(d)) = p(d); on
rejection sample from the residual, which is p without d, renormalised), so the output distribution is the
model's, and greedy output is token for token what decoding without speculation gives.

Draft-model drafts come with the draft's distribution ``q`` (temperature, top-k, top-p and min-p applied as
the sampler applies them); for those, a sampled request's draft rows follow the general rule
(:func:`rejection_sample`: accept ``x`` with probability min(1, p(x)/q(x)), else draw from normalize(max(0, p - q)))
and the row after the last draft is the sampler's own draw from ``p``. Greedy drafts are point masses: the
equality rule above.

Back-off: a sequence whose drafts keep being rejected stops proposing for a while (doubling each time), so a
workload that does not repeat itself pays almost nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from kubellm.runtime.engine.sequence import Sequence, SequenceStatus


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


@dataclass
class Draft:
    """A proposal for one sequence: its tokens and, from a draft model sampling a request, the distribution each
    was drawn from (``probs`` [len(tokens), V] float32; None for point-mass drafts: prompt lookup, greedy)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


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


class BackingOffProposer:
    """What every proposer shares: the verification outcomes it is told (``record``), the counters they add up
    to (``stats``) and the back-off they drive; ``forget`` drops a finished sequence's state."""

    def __init__(self, give_up_after: int = 2):
        self.backoff = BackOffTracker(give_up_after)

    @property
    def stats(self) -> SpeculationStats:
        return self.backoff.stats

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        self.backoff.record(seq, num_drafted, num_accepted)

    def forget(self, seq: Sequence) -> None:
        self.backoff.forget(seq)


class NgramProposer(BackingOffProposer):
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
        candidates, rooms = [], []
        for seq in running:
            if len(seq) - seq.num_computed_tokens != 1 or not speculable(seq):
                continue  # not decoding (a prefill chunk is pending), or drafts would change its output
            p = seq.sampling_params
            room = self.max_model_len - len(seq) - 1
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - seq.num_output_tokens - 1)
            candidates.append(seq)
            rooms.append(room)
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


# ---- the general rejection rule, for drafts sampled from a draft model ----------------------------------------
def sampling_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """The distribution the sampler draws each row of ``logits`` [R, V] from, as probabilities [R, V] float32.

    Mirrors ``Sampler``: temperature, then top-k, top-p over the top-k-renormalised mass, then min-p relative to
    the most likely token, each keeping every token tied with its cut-off; greedy rows (temperature ~0 or
    top_k 1) are a point mass on the first maximum. Only for requests ``speculable`` admits (no penalties,
    bias or grammar). Sorts whole rows: it runs on draft rows only, never on plain decoding."""
    R, V = logits.shape
    x = logits.float()
    out = torch.zeros(R, V, dtype=torch.float32, device=x.device)
    greedy = [i for i, p in enumerate(params) if p.temperature < 1e-5 or p.top_k == 1]
    if greedy:
        rows = torch.tensor(greedy, device=x.device)
        out[rows, x[rows].argmax(dim=-1)] = 1.0
    sampled = sorted(set(range(R)) - set(greedy))
    if not sampled:
        return out
    rows = torch.tensor(sampled, device=x.device)
    ps = [params[i] for i in sampled]
    temp = torch.tensor([float(p.temperature) for p in ps], device=x.device)
    xs = x[rows] / temp[:, None]
    vals = xs.sort(dim=-1, descending=True).values
    m = vals[:, :1]
    top_k = torch.tensor([V if p.top_k is None or p.top_k <= 0 or p.top_k >= V else p.top_k for p in ps],
                         device=x.device)
    thr = torch.where(top_k < V, vals.gather(1, (top_k - 1)[:, None]).squeeze(1), float("-inf"))
    top_p = torch.tensor([float(p.top_p) for p in ps], device=x.device)
    if bool((top_p < 1.0).any()):
        mass = (vals - m).exp().masked_fill(vals < thr[:, None], 0.0)
        cum = mass.cumsum(dim=-1)
        # Keep candidate j while the mass before it is below p (the first always stays), as the sampler does.
        target = (top_p * cum[:, -1])[:, None].contiguous()
        n_keep = (torch.searchsorted(cum, target).squeeze(1) + 1).clamp(max=V)
        n_keep = torch.minimum(n_keep, (vals >= thr[:, None]).sum(dim=-1)).clamp(min=1)
        p_thr = vals.gather(1, (n_keep - 1)[:, None]).squeeze(1)
        thr = torch.where(top_p < 1.0, torch.maximum(thr, p_thr), thr)
    min_p = torch.tensor([math.log(p.min_p) if p.min_p > 0 else float("-inf") for p in ps], device=x.device)
    thr = torch.maximum(thr, m.squeeze(1) + min_p)
    e = (xs - m).exp().masked_fill(xs < thr[:, None], 0.0)
    out[rows] = e / e.sum(dim=-1, keepdim=True)
    return out


def draw_drafts(logits: torch.Tensor, params: list, vocab_size: int
                ) -> tuple[list[int], list[torch.Tensor | None] | None]:
    """One draft token per row of a drafter's ``logits`` [R, V'] and the distribution it came from (None for
    greedy rows; None altogether when every row is greedy): the argmax for greedy requests, else a draw from
    :func:`sampling_probs` under the request's parameters. Logits are cut or padded to ``vocab_size`` first
    (a padded embedding's extra rows are no tokens of the served model)."""
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


def rejection_sample(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """Per row: the draft ``drafts[r]`` (drawn from ``q[r]``) with probability min(1, p/q) at it, else a token
    drawn from normalize(max(0, p[r] - q[r])), which is then never the draft. ``p``, ``q``: [R, V]
    probabilities. The token that comes out has distribution ``p[r]`` whatever ``q`` is."""
    R = p.shape[0]
    rows = torch.arange(R, device=p.device)
    p_x, q_x = p[rows, drafts], q[rows, drafts]
    u = torch.rand(R, generator=generator, device=p.device)
    accepted = u * q_x < p_x  # u < p/q, without dividing by a tiny q
    residual = (p - q).clamp_(min=0.0)
    empty = residual.sum(dim=-1) <= 0  # p == q up to rounding: nothing can be rejected in exact arithmetic
    residual[empty] = p[empty]
    corrections = torch.multinomial(residual, 1, generator=generator).squeeze(1)
    return torch.where(accepted, drafts, corrections)


def verify_sampled_drafts(logits: torch.Tensor, seqs: list[Sequence], tokens: torch.Tensor) -> torch.Tensor:
    """Replace the sampler's tokens at the draft rows of sequences whose drafts carry ``draft_probs`` by the
    rejection rule's (the row after the last draft keeps the sampler's draw from p). ``seqs[r]`` owns row ``r``
    of ``logits`` [B, V]; a drafted sequence has ``1 + num_draft_tokens`` consecutive rows."""
    rows, drafts, qs, params = [], [], [], []
    r = 0
    while r < len(seqs):
        seq = seqs[r]
        d = seq.num_draft_tokens
        if d and seq.draft_probs is not None:
            rows.extend(range(r, r + d))
            drafts.extend(seq.token_ids[len(seq.token_ids) - d :])
            qs.append(seq.draft_probs)
            params.extend([seq.sampling_params] * d)
        r += 1 + d
    if not rows:
        return tokens
    index = torch.tensor(rows, device=logits.device)
    q = torch.cat(qs).to(logits.device)
    p = sampling_probs(logits.index_select(0, index), params)
    tokens = tokens.clone()
    tokens[index.to(tokens.device)] = rejection_sample(p, q, torch.tensor(drafts, device=logits.device)).to(
        tokens.device)
    return tokens
