"""Paged attention over the KV-cache pool, with one seam: the backend.

Cache layout, per layer, for K and for V alike: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A token's *slot* is ``block_id * block_size + offset``; ``slot_mapping[t]`` says where token t's
K/V go. Tokens of a step are ordered decodes first (one query each), then prefill chunks.

The torch backend is the reference: it gathers each sequence's context from the pool by its block
table and runs plain attention. The native CPU backend and the Triton backend (CUDA) consume the same
metadata and read the pool in place for decodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kubellm.runtime.layers import kernel_choice


@dataclass
class PrefillSpan:
    """One sequence's chunk of new tokens: queries ``[start, start + num_tokens)`` of the step."""

    start: int
    num_tokens: int
    context_len: int  # tokens of context after this chunk (cached + this chunk)
    context_slots: torch.Tensor | None  # [context_len] slots to gather; None when the chunk is the whole context
    mask: torch.Tensor | None  # [num_tokens, context_len] bool, True = may attend; None with context_slots None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decodes: int = 0
    decode_block_ids: torch.Tensor | None = None  # [num_decodes * max_blocks] int64, block tables padded with 0
    decode_bias: torch.Tensor | None = None  # [num_decodes, max_blocks * block_size, 1] float32: 0, or -inf past the context
    prefills: list[PrefillSpan] = field(default_factory=list)
    # Raw paged inputs for kernels that read the pool in place (native CPU kernel, Triton).
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int32, padded with 0
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] int32


@dataclass(frozen=True)
class LayerOptions:
    """What one layer's attention adds to plain causal attention (Gemma): a sliding window (a query at position p
    sees keys p - window < j <= p, as transformers masks it) and soft-capped logits (cap * tanh(s / cap))."""

    window: int | None = None
    softcap: float | None = None

    @property
    def plain(self) -> bool:
        return self.window is None and self.softcap is None


PLAIN = LayerOptions()


class TorchAttentionBackend:
    """Reference paged attention in plain PyTorch; runs anywhere, used on CPU."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, opts: LayerOptions = PLAIN) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] (new tokens) → output [T, H, D]; writes k/v into the cache first."""
        kvh, d = self.num_kv_heads, self.head_dim
        k_flat = k_cache.view(-1, kvh, d)
        v_flat = v_cache.view(-1, kvh, d)
        k_flat.index_copy_(0, meta.slot_mapping, k)
        v_flat.index_copy_(0, meta.slot_mapping, v)
        nd = meta.num_decodes
        if nd == q.shape[0]:  # a pure decode step: no output buffer to assemble
            return self._decode(q, k_cache, v_cache, meta, opts)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, opts)
        for p in meta.prefills:
            s, e = p.start, p.start + p.num_tokens
            self._prefill(q[s:e], k[s:e], v[s:e], k_flat, v_flat, p, opts, out=out[s:e])
        return out

    def _decode(self, q, k_cache, v_cache, meta, opts: LayerOptions = PLAIN):
        # Gather whole blocks (index_select on rows is several times faster than slot-wise indexing),
        # then per KV head two batched matmuls that read the gathered K/V in place through strides.
        b = q.shape[0]
        kvh, g, d = self.num_kv_heads, self.group, self.head_dim
        length = meta.decode_bias.shape[1]
        keys = torch.index_select(k_cache.view(k_cache.shape[0], -1), 0, meta.decode_block_ids).view(b, length, kvh, d)
        values = torch.index_select(v_cache.view(v_cache.shape[0], -1), 0, meta.decode_block_ids).view(
            b, length, kvh, d)
        qv = q.view(b, kvh, g, d)
        out = torch.empty_like(qv)
        bias = meta.decode_bias
        if opts.window is not None:  # keys at or before context_len - 1 - window fell out of the window
            ctx = meta.decode_context_lens.to(torch.int64)
            old = torch.arange(length, device=q.device)[None, :] <= (ctx - 1 - opts.window)[:, None]
            bias = bias.masked_fill(old.unsqueeze(-1), float("-inf"))
        for h in range(kvh):
            scores = torch.bmm(keys[:, :, h], qv[:, h].transpose(1, 2)).float().mul_(self.scale)  # [B, L, G]
            if opts.softcap is not None:
                scores = torch.tanh(scores / opts.softcap) * opts.softcap
            probs = torch.softmax(scores.add_(bias), dim=1).to(q.dtype)
            out[:, h] = torch.bmm(probs.transpose(1, 2), values[:, :, h])  # [B, G, D]
        return out.view(b, self.num_heads, d)

    def _prefill(self, q, k, v, k_flat, v_flat, span: PrefillSpan, opts: LayerOptions = PLAIN, out=None):
        """The chunk's attention output [n, H, D], written into ``out`` (its rows of the step's output) when given."""
        o = self._prefill_reference(q, k, v, k_flat, v_flat, span, opts)
        return o if out is None else out.copy_(o)

    def _prefill_reference(self, q, k, v, k_flat, v_flat, span: PrefillSpan, opts: LayerOptions):
        if span.context_slots is not None:
            k = torch.index_select(k_flat, 0, span.context_slots)
            v = torch.index_select(v_flat, 0, span.context_slots)
        if not opts.plain:
            return self._masked_prefill(q, k, v, span, opts)
        # [1, heads, tokens, D] views with enable_gqa: the 4-D form reaches PyTorch's flash CPU kernel
        # (2-3x faster here than 3-D inputs, which fall back to the math path) and needs no K/V copies.
        qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        gqa = self.group > 1
        if span.mask is None:
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=self.scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=span.mask, scale=self.scale, enable_gqa=gqa)
        return o[0].transpose(0, 1)

    def _masked_prefill(self, q, k, v, span: PrefillSpan, opts: LayerOptions):
        """Attention with the window and/or soft cap spelled out: q [n, H, D] at positions context_len - n ..,
        k/v [context_len, KVH, D]."""
        n, ctx = q.shape[0], k.shape[0]
        q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if opts.window is not None:
            allowed &= k_pos > q_pos - opts.window
        qt, kt, vt = (x.transpose(0, 1) for x in (q, k, v))  # [heads, tokens, D]
        if self.group > 1:
            kt, vt = kt.repeat_interleave(self.group, dim=0), vt.repeat_interleave(self.group, dim=0)
        if opts.softcap is None:
            o = F.scaled_dot_product_attention(qt.unsqueeze(0), kt.unsqueeze(0), vt.unsqueeze(0),
                                               attn_mask=allowed, scale=self.scale)[0]
            return o.transpose(0, 1)
        scores = torch.matmul(qt, kt.transpose(1, 2)).float() * self.scale
        scores = torch.tanh(scores / opts.softcap) * opts.softcap
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).to(q.dtype)
        return torch.matmul(probs, vt).transpose(0, 1)


class KernelAttentionBackend(TorchAttentionBackend):
    """Kernels with the CPU/Triton contract: decode reads K/V blocks in place from the pool; prefill is a
    flash-style causal kernel over the chunk's keys (plus the cached context, gathered, for later chunks). Both
    take the layer's window and soft cap, and skip the key blocks a window leaves out."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, decode_kernel, prefill_kernel):
        super().__init__(num_heads, num_kv_heads, head_dim)
        self._decode_kernel, self._prefill_kernel = decode_kernel, prefill_kernel

    def _decode(self, q, k_cache, v_cache, meta, opts=PLAIN):
        return self._decode_kernel(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                   self.scale, window=opts.window, softcap=opts.softcap)

    def _prefill(self, q, k, v, k_flat, v_flat, span: PrefillSpan, opts=PLAIN, out=None):
        if span.context_slots is not None:  # the kernel's causal offset is the mask the reference builds
            k = torch.index_select(k_flat, 0, span.context_slots)
            v = torch.index_select(v_flat, 0, span.context_slots)
        return self._prefill_kernel(q, k, v, self.scale, window=opts.window, softcap=opts.softcap, out=out)


class NativeCpuAttentionBackend(KernelAttentionBackend):
    """The compiled CPU kernels (kernels/csrc)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        from kubellm.kernels.cpu_paged_attention import paged_decode_attention
        from kubellm.kernels.cpu_prefill_attention import prefill_attention

        super().__init__(num_heads, num_kv_heads, head_dim, paged_decode_attention, prefill_attention)


class TritonAttentionBackend(KernelAttentionBackend):
    """The Triton kernels (CUDA; on CPU only under TRITON_INTERPRET=1)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        from kubellm.kernels.triton_paged_attention import paged_decode_attention
        from kubellm.kernels.triton_prefill_attention import prefill_attention

        super().__init__(num_heads, num_kv_heads, head_dim, paged_decode_attention, prefill_attention)


def attention_backend(kind: str, num_heads: int, num_kv_heads: int, head_dim: int) -> TorchAttentionBackend:
    """The backend of a decided kind (:mod:`kubellm.runtime.layers.kernel_choice` decides): cpu, triton or torch."""
    backends = {"cpu": NativeCpuAttentionBackend, "triton": TritonAttentionBackend, "torch": TorchAttentionBackend}
    return backends[kind](num_heads, num_kv_heads, head_dim)


def make_backend(kind: str, device: str, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, block_size: int = 16) -> TorchAttentionBackend:
    """The backend ``--attention-backend kind`` gives a model of this shape on ``device`` (tests, tools): ``auto``
    as :mod:`kubellm.runtime.layers.kernel_choice` rules it; an explicit kind that cannot run is a ValueError."""
    settings = kernel_choice.KernelSettings(attention=kind, layer_ops="torch", prepack="off")
    target = kernel_choice.Target(device, dtype, num_heads, num_kv_heads, head_dim, block_size)
    kind = kernel_choice.choose(settings, target, kernel_choice.probe(settings, target)).attention
    return attention_backend(kind, num_heads, num_kv_heads, head_dim)


class Attention(torch.nn.Module):
    """Binds one layer's cache tensors and backend; the runner sets ``k_cache``/``v_cache``/``backend``."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, opts: LayerOptions = PLAIN):
        super().__init__()
        self.backend = TorchAttentionBackend(num_heads, num_kv_heads, head_dim)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.opts = opts

    def forward(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.opts)
