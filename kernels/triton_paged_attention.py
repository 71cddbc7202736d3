"""Paged-attention decode in Triton (CUDA), beside the plain-PyTorch reference it must equal.

Same contract as :mod:`kubellm.kernels.cpu_paged_attention`: one query token per sequence, ``q``
``[B, H, D]``; the pool ``k_cache``/``v_cache`` ``[num_blocks, block_size, KVH, D]`` read in place through
``block_tables`` ``[B, max_blocks]`` int32 and ``context_lens`` ``[B]`` int32 (>= 1); query head ``h`` reads
kv head ``h // (H // KVH)``; output ``[B, H, D]`` in ``q``'s dtype, fp32 softmax and accumulation. With a
sliding ``window`` a sequence attends only its last ``window`` tokens; a ``softcap`` turns each score ``s``
(scale included) into ``softcap * tanh(s / softcap)``.

One program per (sequence, kv head) takes all the query heads that share that kv head as the rows of one
tile (padded to 16, the smallest ``tl.dot``) and streams the context in tiles of BLOCK_N tokens that may span
several KV blocks (each token's block looked up in the table), with an online softmax: the context is read
once per kv head, never gathered, and small blocks cost no extra loop trips. A windowed sequence's stream
starts at the window's first token: the blocks before it are never read (nor their block-table entries, so
they may name blocks the sequence has given back). Block size and head dim need not
be powers of two. On a GPU bf16/fp16 tiles go to the tensor cores with fp32 accumulation (fp32 inputs use
IEEE fp32, not TF32); on CPU it runs only under ``TRITON_INTERPRET=1`` (the tests), where every tile goes to
float32 right after its load (the interpreter's bf16 is wrong otherwise).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubellm.kernels.cpu_paged_attention import reference_paged_decode_attention
from kubellm.kernels.triton_dot import dot_options

__all__ = ["paged_decode_attention", "reference_paged_decode_attention"]

_LOG2E = 1.4426950408889634


@triton.jit
def soft_cap(scores, cap):
    """``softcap * tanh(s / softcap)`` with scores and ``cap`` both in log2 units (times log2(e)), as the online
    softmax keeps them. tanh from one exp (the interpreter and every backend have it), never overflowing:
    tanh|x| = (1 - e) / (1 + e) with e = exp(-2|x|)."""
    x = scores / cap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t) * cap


@triton.jit
def _paged_decode_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, qk_scale, window, cap,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_table,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    length = tl.load(lens_ptr + seq)
    first = tl.where(window > 0, tl.maximum(length - window, 0), 0)  # the window's first token

    m = tl.zeros([BLOCK_G], dtype=tl.float32) - float("inf")  # running max of each row's scores
    denom = tl.zeros([BLOCK_G], dtype=tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(first, length, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        live = pos < length
        block = tl.load(tables_ptr + seq * stride_table + pos // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        lanes = live[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + block[:, None] * stride_kb + slot[:, None] * stride_kt + kv_head * stride_kh
                    + d[None, :], mask=lanes, other=0.0)
        v = tl.load(v_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vt + kv_head * stride_vh
                    + d[None, :], mask=lanes, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # log2 units
        if SOFTCAP:
            scores = soft_cap(scores, cap)
        scores = tl.where(live[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # finite: the first tile holds the window's first token
        p = tl.exp2(scores - m_new[:, None])
        rescale = tl.exp2(m - m_new)
        denom = denom * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / denom[:, None]
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    block_n: int = 64,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Decode attention with the Triton kernel (shapes in the module docstring); ``block_n`` tokens per tile.
    ``window``: attend only each sequence's last ``window`` tokens; ``softcap``: scores become
    ``softcap * tanh(score / softcap)`` before the softmax (scores include ``scale``)."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV pool must be contiguous in head_dim")
    block_tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    _paged_decode_kernel[(batch, num_kv_heads)](
        out, q, k_cache, v_cache, block_tables, context_lens, float(scale) * _LOG2E, window or 0,
        float(softcap or 1.0) * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size,
        BLOCK_N=max(16, block_n), HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        SOFTCAP=bool(softcap), **dot_options(q),
    )
    return out
