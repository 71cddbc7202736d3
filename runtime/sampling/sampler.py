"""Pick the next token for every sequence in a batch, from the model's last-position logits.

Pipeline, per row (each step only runs for the rows that need it):

1. penalties on the raw logits: ``repetition_penalty`` (vLLM / Hugging Face: over prompt and output
   tokens, positive logits divided by it, negative ones multiplied), then ``frequency_penalty`` and
   ``presence_penalty`` (OpenAI: over output tokens only, ``l -= f * count + p * (count > 0)``);
2. ``min_tokens``: while fewer output tokens exist, the row's ``stop_token_ids`` and (unless
   ``ignore_eos``) the EOS ids are masked to -inf;
3. greedy rows (temperature ~0, or ``top_k == 1``) take the argmax of the penalised logits;
4. the other rows are divided by their temperature and then filtered, in this order: **top-k**, then
   **top-p** (over the top-k-renormalised distribution), then **min-p** (relative to the most likely
   token, which the two filters before always keep). A filter keeps every token whose scaled logit is at
   least the cut-off logit, so tokens tied with the last kept one are kept too (as Hugging Face's
   warpers do);
5. one token is drawn per row by inverse-CDF sampling in token-id order: one uniform number per row, a
   cumulative sum of the kept probabilities and a binary search.

Reproducibility: a row whose sequence has a ``generator`` (``SamplingParams.seed``) draws its one uniform
number per step from that generator, and every other quantity its draw depends on is computed from its own
logits row only, so the same seed and prompt give the same tokens whatever else shares the batch and in
whatever order (up to one-ulp differences of vectorised ``exp`` at exact decision boundaries, which is
vanishingly rare). Unseeded rows draw from the global torch RNG in one batched call.

Cost: the all-greedy case is a single ``argmax``. Sampling draws one random number per row (drawing a
vocabulary's worth per row, as exponential-race / Gumbel sampling does, is ~10x slower on CPU). top-k /
top-p first look at a small candidate set (the k+1 or 64 largest logits) and sort the whole row only for
rows whose nucleus does not fit in it; rows that fit are sampled among their candidates without another
pass over the vocabulary. On CPU, wide selections and sorts use numpy (SIMD sort / introselect, 5-20x
faster than ``torch.sort`` / a wide ``torch.topk``). Large ``[B, V]`` scratch tensors are kept between
calls, so a ``Sampler`` must not be called from two threads at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_GREEDY_TEMPERATURE = 1e-5  # the same threshold as SamplingParams.greedy
_TOP_P_FIRST_WIDTH = 64  # candidates looked at first for top-p rows; a wider nucleus sorts the whole row
_TORCH_TOPK_MAX = 128  # on CPU, wider candidate sets come from numpy's introselect (cost independent of k)


class Sampler:
    """Callable ``sampler(logits [B, V] float32, seqs) -> token ids [B] int64``.

    ``seqs[i]`` describes row ``i`` of ``logits`` and needs ``sampling_params`` (a ``SamplingParams``),
    ``prompt_token_ids``, ``output_token_ids``, ``num_output_tokens`` and ``generator``
    (``torch.Generator | None``), as ``kubellm.runtime.engine.sequence.Sequence`` has. ``logits`` is never
    modified. Token ids sampled are always ``< V``.
    """

    def __init__(self, eos_token_ids: Iterable[int]):
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self._buffers: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------------------------------------
    def __call__(self, logits: torch.Tensor, seqs: SequenceOf[Any]) -> torch.Tensor:
        return self.sample(logits, seqs)[0]

    def sample(self, logits: torch.Tensor, seqs: SequenceOf[Any],
               allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
        """Token ids [B] and, per row, its ``TokenLogprobs`` when ``sampling_params.logprobs`` asks (else None).

        ``allowed``: an optional bool mask [B, V] (a grammar's); False entries are never sampled.
        """
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits must be [len(seqs), V], got {tuple(logits.shape)} for {len(seqs)} seqs")
        B, V = logits.shape
        device = logits.device

        sampled: list[int] = []  # rows that draw a token (not greedy)
        temps: list[float] = []
        penalised: list[int] = []
        biased: list[int] = []
        banned: list[tuple[int, list[int]]] = []  # (row, token ids masked by min_tokens)
        want_logprobs: list[int] = []
        for i, seq in enumerate(seqs):
            p = seq.sampling_params
            if not (p.temperature < _GREEDY_TEMPERATURE or p.top_k == 1):
                sampled.append(i)
                temps.append(float(p.temperature))
            if p.needs_penalties:
                penalised.append(i)
            if p.logit_bias:
                biased.append(i)
            if p.min_tokens and seq.num_output_tokens < p.min_tokens:
                ids = list(p.stop_token_ids)
                if not p.ignore_eos:
                    ids.extend(self.eos_token_ids)
                if ids:
                    banned.append((i, ids))
            if p.logprobs is not None:
                want_logprobs.append(i)

        modified = bool(penalised or banned or biased) or allowed is not None
        if not sampled and not modified:
            tokens = _argmax(logits)
            return tokens, _logprobs(logits, tokens, seqs, want_logprobs)

        # The processed logits: penalties, logit_bias, min_tokens bans (logprobs are read here), then the
        # grammar mask and the temperature on sampled rows. Left as the input tensor when nothing changes it,
        # since everything below only reads it.
        if modified or logits.dtype != torch.float32 or not logits.is_contiguous():
            work = self._buffer("work", B * V, device).view(B, V)
            work.copy_(logits)
            if penalised:
                self._apply_penalties(work, [seqs[i] for i in penalised], penalised)
            if biased:
                _apply_logit_bias(work, [(i, seqs[i].sampling_params.logit_bias) for i in biased])
            if banned:
                self._mask_banned(work, banned)
        else:
            work = logits
        processed = _rows(work, want_logprobs)  # a copy: the mask and temperature below work in place
        if allowed is not None:
            work.masked_fill_(~allowed, float("-inf"))
        if any(t != 1.0 for t in temps):
            column = self._temperature_column(B, sampled, temps, device)
            if work is logits:
                work = torch.div(logits, column, out=self._buffer("work", B * V, device).view(B, V))
            else:
                work.div_(column)

        if len(sampled) == B:
            tokens = self._sample_rows(work, seqs)
        else:
            tokens = _argmax(work)  # greedy rows (one pass over all rows is cheaper than gathering them first)
            if sampled:
                rows = torch.tensor(sampled, device=device)
                x = torch.index_select(
                    work, 0, rows, out=self._buffer("rows", len(sampled) * V, device).view(-1, V)
                )
                tokens[rows] = self._sample_rows(x, [seqs[i] for i in sampled])
        return tokens, _logprobs(processed, tokens, seqs, want_logprobs, rows_only=True)

    # ------------------------------------------------------------------------------------------------
    def _buffer(self, name: str, numel: int, device: torch.device) -> torch.Tensor:
        """A reusable float32 scratch tensor (big fresh allocations page-fault on every call)."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.device != device:
            buf = torch.empty(numel, dtype=torch.float32, device=device)
            self._buffers[name] = buf
        return buf[:numel]

    @staticmethod
    def _temperature_column(B: int, rows: list[int], temps: list[float], device) -> torch.Tensor:
        col = torch.ones(B, 1, dtype=torch.float32)
        col[rows, 0] = torch.tensor(temps, dtype=torch.float32)
        return col.to(device)

    def _apply_penalties(self, work: torch.Tensor, seqs: list[Any], rows: list[int]) -> None:
        apply_penalties(
            work,
            [s.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs],
            [s.sampling_params.repetition_penalty for s in seqs],
            [s.sampling_params.frequency_penalty for s in seqs],
            [s.sampling_params.presence_penalty for s in seqs],
            rows=rows,
            counts_buffer=self._counts_buffer(work.numel(), work.device),
        )

    def _counts_buffer(self, numel: int, device) -> torch.Tensor:
        # Kept all-zero between calls: apply_penalties zeroes exactly the entries it incremented.
        buf = self._buffers.get("counts")
        if buf is None or buf.numel() < numel or buf.device != device:
            buf = torch.zeros(numel, dtype=torch.float32, device=device)
            self._buffers["counts"] = buf
        return buf[:numel]

    @staticmethod
    def _mask_banned(work: torch.Tensor, banned: list[tuple[int, list[int]]]) -> None:
        V = work.shape[1]
        keys = [row * V + t for row, ids in banned for t in ids if 0 <= t < V]
        if keys:
            work.view(-1)[torch.tensor(keys, device=work.device)] = float("-inf")

    # ------------------------------------------------------------------------------------------------
    def _sample_rows(self, x: torch.Tensor, seqs: list[Any]) -> torch.Tensor:
        """Sample one token per row of the temperature-scaled logits ``x`` [R, V] (read-only)."""
        R, V = x.shape
        device = x.device
        u = _uniforms(seqs, device)
        m = x.amax(dim=-1)  # the most likely token's logit per row; every filter keeps it

        top_k = torch.tensor([_top_k(s.sampling_params.top_k, V) for s in seqs], device=device)
        top_p = torch.tensor([float(s.sampling_params.top_p) for s in seqs], device=device)
        min_p = [float(s.sampling_params.min_p) for s in seqs]
        # min-p as a logit cut-off: p_i < min_p * p_max  <=>  x_i < x_max + log(min_p).
        cut = m + torch.tensor([math.log(v) if v > 0 else float("-inf") for v in min_p], device=device)

        tokens = torch.empty(R, dtype=torch.long, device=device)
        filtered = ((top_k < V) | (top_p < 1.0)).nonzero().squeeze(1)
        full_rows = torch.ones(R, dtype=torch.bool, device=device)
        if filtered.numel():
            n = filtered.numel()
            if n == R:
                xf = x
            else:
                xf = torch.index_select(x, 0, filtered, out=self._buffer("subset", n * V, device).view(n, V))
            kf, pf, mf = top_k[filtered], top_p[filtered], m[filtered]
            # top-p's normaliser for rows without top-k is the mass of the whole row.
            total = torch.full((n,), float("nan"), device=device)
            p_only = ((pf < 1.0) & (kf >= V)).nonzero().squeeze(1)
            if p_only.numel():
                e = self._buffer("probs", p_only.numel() * V, device).view(-1, V)
                if p_only.numel() == n:
                    torch.sub(xf, mf[:, None], out=e)
                else:
                    torch.index_select(xf, 0, p_only, out=e).sub_(mf[p_only, None])
                total[p_only] = e.exp_().sum(dim=-1)
            f_tokens, f_done, f_cut = _sample_filtered(xf, mf, kf, pf, cut[filtered], u[filtered], total)
            tokens[filtered] = f_tokens
            full_rows[filtered] = ~f_done
            cut[filtered] = f_cut
        full = full_rows.nonzero().squeeze(1)
        if full.numel():
            n = full.numel()
            if n == R:
                xs = x
            else:
                xs = torch.index_select(x, 0, full, out=self._buffer("subset", n * V, device).view(n, V))
            e = self._buffer("probs", n * V, device).view(n, V)
            tokens[full] = _sample_full(xs, m[full], cut[full], u[full], e)
        return tokens


@dataclass(frozen=True)
class TokenLogprobs:
    """The sampled token's log-probability and the ``top`` (token id, log-probability) pairs, most likely first."""

    logprob: float
    top: list[tuple[int, float]]


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
    return x.index_select(0, torch.tensor(rows, device=x.device)) if rows else None


def _logprobs(x: torch.Tensor | None, tokens: torch.Tensor, seqs: SequenceOf[Any], rows: list[int],
              rows_only: bool = False) -> list[TokenLogprobs | None]:
    """Per row of ``seqs``: the ``TokenLogprobs`` of its token with k = ``sampling_params.logprobs``, or None.

    ``x`` is [B, V], or [len(rows), V] holding just those rows when ``rows_only``.
    """
    out: list[TokenLogprobs | None] = [None] * len(seqs)
    if rows:
        x = x if rows_only else _rows(x, rows)
        chosen = tokens[torch.tensor(rows, device=tokens.device)]
        ks = [seqs[i].sampling_params.logprobs for i in rows]
        for i, entry in zip(rows, token_logprobs(x, chosen, ks), strict=True):
            out[i] = entry
    return out


def token_logprobs(x: torch.Tensor, tokens: torch.Tensor, ks: list[int]) -> list[TokenLogprobs]:
    """log-softmax of each row of ``x`` [R, V] at ``tokens`` [R], and its ``ks[r]`` most likely tokens."""
    x = x.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    chosen = (x.gather(1, tokens.view(-1, 1).to(x.device)) - lse).squeeze(1).tolist()
    k = max(ks)
    top_v, top_i = x.topk(k, dim=-1) if k else (x[:, :0], x[:, :0].long())
    top_v, top_i = (top_v - lse).tolist(), top_i.tolist()
    return [TokenLogprobs(chosen[r], list(zip(top_i[r][:n], top_v[r][:n], strict=True))) for r, n in enumerate(ks)]


def _apply_logit_bias(work: torch.Tensor, rows: list[tuple[int, dict[int, float]]]) -> None:
    V = work.shape[1]
    keys = [(row * V + t, b) for row, bias in rows for t, b in bias.items() if 0 <= t < V]
    if keys:
        idx = torch.tensor([k for k, _ in keys], device=work.device)
        work.view(-1).index_add_(0, idx, torch.tensor([b for _, b in keys], dtype=work.dtype, device=work.device))


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first maximum); numpy's SIMD argmax is ~5x faster than torch's on CPU."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.argmax(x.detach().numpy(), axis=-1).astype(np.int64, copy=False))
    return x.argmax(dim=-1)


def _top_k(k: int, V: int) -> int:
    return V if k is None or k <= 0 or k >= V else int(k)


def _uniforms(seqs: list[Any], device) -> torch.Tensor:
    """One U[0, 1) draw per row: from the row's own generator when it has one, else from the global RNG."""
    seeded = [i for i, s in enumerate(seqs) if getattr(s, "generator", None) is not None]
    if not seeded:
        return torch.rand(len(seqs), device=device)
    u = torch.empty(len(seqs), dtype=torch.float32)
    if len(seeded) < len(seqs):
        seeded_set = set(seeded)
        unseeded = [i for i in range(len(seqs)) if i not in seeded_set]
        u[unseeded] = torch.rand(len(unseeded))
    u[seeded] = torch.cat([torch.rand(1, generator=seqs[i].generator) for i in seeded])
    return u.to(device)


def _largest(x: torch.Tensor, W: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``W`` largest entries of each row, descending, and their indices (``None`` when ``W == V``).

    On CPU, numpy's SIMD sort and introselect are 5-20x faster than ``torch.sort`` / a wide ``torch.topk``.
    The order among equal values is unspecified; callers only rely on the values and on index sets.
    """
    R, V = x.shape
    if x.device.type != "cpu" or (W <= _TORCH_TOPK_MAX and W < V):
        if W >= V:
            return x.sort(dim=-1, descending=True).values, None
        return x.topk(W, dim=-1)
    a = x.detach().numpy()
    if W >= V:
        return torch.from_numpy(np.ascontiguousarray(np.sort(a, axis=-1)[:, ::-1])), None
    idx = np.argpartition(a, V - W, axis=-1)[:, V - W :]
    vals = np.take_along_axis(a, idx, axis=-1)
    order = np.argsort(-vals, axis=-1)
    return (
        torch.from_numpy(np.take_along_axis(vals, order, axis=-1)),
        torch.from_numpy(np.take_along_axis(idx, order, axis=-1).astype(np.int64, copy=False)),
    )


def _draw(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index of the first entry of each row of the running sum ``cdf`` [R, W] above ``u * total``.

    Entries whose probability is 0 are never chosen (their running sum equals the previous one).
    """
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)


def _sample_full(x: torch.Tensor, m: torch.Tensor, cut: torch.Tensor, u: torch.Tensor, e: torch.Tensor):
    """Sample over the whole vocabulary, dropping tokens whose logit is below ``cut`` (-inf: none)."""
    torch.sub(x, m[:, None], out=e).exp_()  # unnormalised probabilities, the max is exactly 1
    if bool((cut > float("-inf")).any()):
        e.masked_fill_(x < cut[:, None], 0.0)
    return _draw(e.cumsum_(dim=-1), u)


def _sample_filtered(
    x: torch.Tensor,
    m: torch.Tensor,
    k: torch.Tensor,
    p: torch.Tensor,
    cut: torch.Tensor,
    u: torch.Tensor,
    total: torch.Tensor,
):
    """top-k / top-p (then min-p) for rows that have one of them (``total``: the row's probability mass
    ``sum(exp(x - m))``, needed for rows with top-p and without top-k).

    Returns ``(tokens, done, cut)``: ``done`` marks rows sampled here; the others still need a full-
    vocabulary draw with the returned logit cut-off (all filters folded into it).
    """
    R, V = x.shape
    device = x.device
    tokens = torch.zeros(R, dtype=torch.long, device=device)
    done = torch.zeros(R, dtype=torch.bool, device=device)
    cut = cut.clone()
    has_k, has_p = k < V, p < 1.0
    # Width of the first candidate set: every top-k row's k (+1 to see whether ties run past it), and a
    # guess for top-p rows.
    width = int(torch.where(has_k, k + 1, torch.where(has_p, _TOP_P_FIRST_WIDTH, 1)).max())
    width = V if width > V // 2 else width
    # Each candidate's exp(x - m) is <= 1, so W candidates hold at most W: a top-p row with p * total > W
    # cannot fit and goes straight to the full sort.
    too_wide = has_p & ~has_k & (p * total > width) if width < V else torch.zeros_like(has_p)
    pending, later = (~too_wide).nonzero().squeeze(1), too_wide.nonzero().squeeze(1)
    if not pending.numel():
        pending, later, width = later, later[:0], V
    while pending.numel():
        W = width
        xs = x if pending.numel() == R else x.index_select(0, pending)
        vals, idx = _largest(xs, W)
        ks, ps, ms, hk, hp = k[pending], p[pending], m[pending], has_k[pending], has_p[pending]

        # top-k cut-off: the k-th largest logit (-inf when top-k is off).
        kth = vals.gather(1, (ks.clamp(max=W) - 1)[:, None]).squeeze(1)
        thr = torch.where(hk, kth, torch.full_like(kth, float("-inf")))
        any_k = bool(hk.any())
        probs = (vals - ms[:, None]).exp_()
        if any_k:
            probs.masked_fill_(vals < thr[:, None], 0.0)

        resolved = torch.ones_like(hk)
        if bool(hp.any()):
            cum = probs.cumsum(dim=-1)
            # Mass of the top-k-filtered distribution: inside the candidates unless tokens tied with the
            # k-th one run past them (then summed over the row, rare).
            denom = torch.where(hk, cum[:, -1], total[pending])
            for j in (hk & hp & (vals[:, -1] >= thr) & (W < V)).nonzero().squeeze(1).tolist():
                row = xs[j]
                denom[j] = (row - ms[j]).exp_().masked_fill_(row < thr[j], 0.0).sum()
            # Keep the smallest prefix (by logit) whose mass reaches p: candidate j stays while the mass
            # before it, cum[j - 1], is still below p (the first one always stays).
            target = (ps * denom)[:, None].contiguous()
            n_keep = (torch.searchsorted(cum, target).squeeze(1) + 1).clamp_(max=W)
            if any_k:
                n_keep = torch.minimum(n_keep, (vals >= thr[:, None]).sum(dim=-1))
            n_keep.clamp_(min=1)
            p_thr = vals.gather(1, (n_keep - 1)[:, None]).squeeze(1)
            thr = torch.where(hp, torch.maximum(thr, p_thr), thr)
            resolved = ~hp | (n_keep < W) | (W == V)
        thr = torch.maximum(thr, cut[pending])  # min-p last

        # Rows whose kept tokens all lie among the candidates are sampled there, in token-id order so the
        # draw is the same as a full-vocabulary one (and so independent of the candidate width).
        inside = resolved & (vals[:, -1] < thr) & (W < V)
        if bool(inside.any()):
            sel = inside.nonzero().squeeze(1)
            c_idx, order = idx[sel].sort(dim=-1)
            c_vals = vals[sel].gather(1, order)
            c_probs = (c_vals - ms[sel, None]).exp_().masked_fill_(c_vals < thr[sel, None], 0.0)
            pos = _draw(c_probs.cumsum_(dim=-1), u[pending[sel]])
            tokens[pending[sel]] = c_idx.gather(1, pos[:, None]).squeeze(1)
            done[pending[sel]] = True
        cut[pending[resolved]] = thr[resolved]
        pending, later = torch.cat([pending[~resolved], later]).sort().values, later[:0]  # stays ascending
        width = V  # the nucleus is wider than the candidates: sort the whole row
    return tokens, done, cut


# ----------------------------------------------------------------------------------------------------
def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: SequenceOf[SequenceOf[int]],
    output_token_ids: SequenceOf[SequenceOf[int]],
    repetition_penalties: SequenceOf[float],
    frequency_penalties: SequenceOf[float],
    presence_penalties: SequenceOf[float],
    rows: SequenceOf[int] | None = None,
    counts_buffer: torch.Tensor | None = None,
) -> None:
    """Apply the penalties to ``logits`` [B, V] (contiguous) in place; list entry ``j`` is for row ``rows[j]``
    (default: row ``j``).

    For every token that occurs in the row's prompt or output, ``l = l / r if l > 0 else l * r`` with
    ``r`` the repetition penalty; then, for every token that occurs ``c > 0`` times in the output,
    ``l = l - f * c - p`` (frequency, presence). Only the touched entries are read and written, so the cost
    is proportional to the number of token ids, not to ``B * V``. ``counts_buffer``: an all-zero float32
    tensor of at least ``B * V`` entries that is left all-zero (saves an allocation per call). Ids outside
    ``[0, V)`` are ignored.
    """
    B, V = logits.shape
    if rows is None:
        rows = range(len(prompt_token_ids))
    flat = logits.view(-1)
    device = logits.device

    rep_rows = [j for j, r in enumerate(repetition_penalties) if r != 1.0]
    if rep_rows:
        keys, per_key = _flat_keys(
            [[prompt_token_ids[j], output_token_ids[j]] for j in rep_rows],
            [rows[j] for j in rep_rows],
            [repetition_penalties[j] for j in rep_rows],
            V,
        )
        if keys.size:
            keys_t, r = torch.from_numpy(keys).to(device), torch.from_numpy(per_key).to(device)
            g = flat.index_select(0, keys_t)  # duplicate keys read the same value, write the same result
            flat.index_copy_(0, keys_t, torch.where(g > 0, g / r, g * r))

    add_rows = [j for j in range(len(rows)) if frequency_penalties[j] != 0.0 or presence_penalties[j] != 0.0]
    if add_rows:
        keys, per_key = _flat_keys(
            [[output_token_ids[j]] for j in add_rows],
            [rows[j] for j in add_rows],
            [(frequency_penalties[j], presence_penalties[j]) for j in add_rows],
            V,
        )
        if keys.size:
            keys_t, fp = torch.from_numpy(keys).to(device), torch.from_numpy(per_key).to(device)
            counts = counts_buffer if counts_buffer is not None else torch.zeros(B * V, device=device)
            counts.index_add_(0, keys_t, torch.ones(len(keys), device=device))
            c = counts.index_select(0, keys_t)
            counts.index_fill_(0, keys_t, 0.0)
            g = flat.index_select(0, keys_t)
            flat.index_copy_(0, keys_t, g - fp[:, 0] * c - fp[:, 1])


def _flat_keys(id_lists, rows, per_row_values, V: int) -> tuple[np.ndarray, np.ndarray]:
    """``row * V + token_id`` for every id of every row (int64), and each row's value repeated per id."""
    arrays, lengths = [], []
    for parts in id_lists:
        n = 0
        for ids in parts:
            a = np.asarray(ids, dtype=np.int64)
            arrays.append(a)
            n += a.size
        lengths.append(n)
    if not arrays:
        return np.empty(0, np.int64), np.empty(0, np.float32)
    ids = np.concatenate(arrays)
    lengths = np.asarray(lengths)
    keys = ids + np.repeat(np.asarray(rows, dtype=np.int64) * V, lengths)
    values = np.repeat(np.asarray(per_row_values, dtype=np.float32), lengths, axis=0)
    if ids.size and (ids.min() < 0 or ids.max() >= V):
        ok = (ids >= 0) & (ids < V)
        keys, values = keys[ok], values[ok]
    return keys, values


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log-softmax of ``logits`` [B, V] at ``token_ids`` [B] -> float32 [B] (of the logits passed in)."""
    logits = logits.float()
    chosen = logits.gather(1, token_ids.long().view(-1, 1)).squeeze(1)
    return chosen - torch.logsumexp(logits, dim=-1)
