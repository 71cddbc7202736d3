"""Verification: the served model checks a step's drafts in one forward pass, and the rule that keeps its output.

The model samples a token at every drafted position with the request's own sampling parameters; drafts are
accepted while the sampled token equals them, and the first sampled token that differs is kept as the
correction (or, all accepted, the token after the last draft: :func:`accept`). For a point-mass proposal this
*is* the standard rejection rule (accept draft d with probability min(1, p(d)/q(d)) = p(d); on rejection sample
from the residual, which is p without d, renormalised), so the output distribution is the model's, and greedy
output is token for token what decoding without speculation gives.

Drafts a model drew for a sampled request come with the drafter's distribution ``q`` (temperature, top-k, top-p
and min-p applied as the sampler applies them: :func:`sampling_probs`); their rows follow the general rule
(:func:`rejection_sample`: accept ``x`` with probability min(1, p(x)/q(x)), else draw from
normalize(max(0, p - q))) and the row after the last draft is the sampler's own draw from ``p``.
"""

from __future__ import annotations

import math

import torch

from kubellm.runtime.engine.sequence import Sequence


def accept(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verified step adds: the accepted drafts, then the first sampled token that differs (or the
    one sampled after the last draft). ``sampled[i]`` was sampled at the position of ``drafts[i]``."""
    n = 0
    while n < len(drafts) and sampled[n] == drafts[n]:
        n += 1
    return drafts[:n] + [sampled[n]]


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
