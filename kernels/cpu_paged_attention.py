"""Paged-attention decode on CPU: a native C++ kernel (compiled on first use) beside a PyTorch reference.

One query token per sequence attends to that sequence's context, read in place from the paged K/V pool:

* ``q`` ``[B, num_heads, head_dim]``; ``k_cache``/``v_cache``
  ``[num_blocks, block_size, num_kv_heads, head_dim]`` (the project-wide pool layout); all float32,
  bfloat16 or float16 alike.
* ``block_tables`` ``[B, max_blocks]`` int32 (rows padded; entries past a sequence's blocks are never read);
  ``context_lens`` ``[B]`` int32 (>= 1). Token ``t`` of sequence ``b`` lives in block ``block_tables[b, t //
  block_size]`` at offset ``t % block_size``.
* GQA: query head ``h`` uses kv head ``h // (num_heads // num_kv_heads)``.
* Returns ``[B, num_heads, head_dim]`` in ``q``'s dtype; scores, softmax and accumulation are fp32.

The kernel (``csrc/paged_attention_cpu.cpp``) is part of the native CPU extension that
:mod:`kubellm.kernels.cpu_extension` builds on first use; when :func:`available` is False (no compiler, or
``KUBELLM_DISABLE_CPU_KERNELS=1``) callers use :func:`reference_paged_decode_attention`.
"""

from __future__ import annotations

import torch

from kubellm.kernels.cpu_extension import DISABLE_ENV, available, build_info

__all__ = ["DISABLE_ENV", "available", "build_info", "paged_decode_attention", "reference_paged_decode_attention"]

# Tokens per chunk of the kernel's online softmax (scores for the chunk, one rescale, then V accumulation).
_CHUNK_TOKENS = 128


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    chunk: int | None = None,
    partition: int = 0,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Decode attention with the native kernel (see the module docstring for shapes). Raises if unavailable.

    ``window``: attend only each sequence's last ``window`` tokens (sliding-window layers); ``softcap``: scores
    become ``softcap * tanh(score / softcap)`` before the softmax (scores include ``scale``).

    ``chunk`` (tokens per online-softmax chunk, 1..512) and ``partition`` (split each sequence into pieces of
    this many tokens, merged at the end; 0 = only when there are fewer (sequence, kv head) pairs than twice
    the threads) are tuning knobs; the defaults are what the benchmarks chose.
    """
    if not available():
        raise RuntimeError(
            f"the CPU paged-attention kernel is unavailable ({build_info()['error'] or DISABLE_ENV + ' is set'}); "
            "use reference_paged_decode_attention"
        )
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        block_tables = block_tables.to(torch.int32).contiguous()
    if context_lens.dtype != torch.int32 or not context_lens.is_contiguous():
        context_lens = context_lens.to(torch.int32).contiguous()
    return torch.ops.kubellm_cpu.paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, float(scale), chunk or _CHUNK_TOKENS, partition,
        window or 0, float(softcap or 0.0),
    )


def reference_paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Plain-PyTorch decode attention, same contract: per sequence, gather its blocks, attend in fp32."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for b in range(batch):
        length = int(context_lens[b])
        num_blocks = -(-length // block_size)
        blocks = block_tables[b, :num_blocks].long()
        # [num_blocks, block_size, KVH, D] -> [tokens, KVH, D], cut to the context (the tail may be garbage).
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].float()
        k = k.repeat_interleave(group, dim=1)  # [L, H, D]: query head h reads kv head h // group
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if window:
            scores[:, : max(0, length - window)] = float("-inf")
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hl,lhd->hd", probs, v).to(q.dtype)
    return out
