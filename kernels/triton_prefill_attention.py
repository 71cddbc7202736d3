"""Causal prefill attention in Triton (CUDA), beside the plain-PyTorch reference it must equal.

Same contract as :mod:`kubellm.kernels.cpu_prefill_attention`: one sequence's chunk ``q`` ``[T, H, D]`` is the
last ``T`` positions of a context with keys/values ``k``/``v`` ``[S, KVH, D]`` (``S >= T``); query ``t``
attends keys ``0 .. S - T + t`` (the last ``window`` of them with a sliding window; a ``softcap`` turns each
score ``s``, scale included, into ``softcap * tanh(s / softcap)``); query head ``h`` reads kv head
``h // (H // KVH)``; output ``[T, H, D]`` in ``q``'s dtype. Rows and heads may be strided (the fused qkv projection's views), ``head_dim`` contiguous.

Flash-attention style: one program per (tile of BLOCK_M queries, query head) streams key tiles with an online
softmax from the first key its first query's window admits (key tiles wholly before it are never read) and
stops at the tile's causal edge. On a GPU the two matmuls take bf16/fp16 tiles to the tensor
cores and accumulate in fp32 (fp32 inputs use IEEE fp32, not TF32, to match the reference); under
``TRITON_INTERPRET=1`` every tile goes to float32 right after its load (the interpreter's bf16 is wrong
otherwise).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubellm.kernels.cpu_prefill_attention import reference_prefill_attention
from kubellm.kernels.triton_dot import dot_options
from kubellm.kernels.triton_paged_attention import soft_cap

__all__ = ["prefill_attention", "reference_prefill_attention"]

_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, qk_scale, num_queries, num_keys, window, cap,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    offset = num_keys - num_queries  # query t sits at context position offset + t
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_ok = rows < num_queries
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=rows_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    denom = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys past the tile's last query are masked for every row of it: stop there. With a window, keys before
    # the first query's window are masked for every row too: start there.
    end = tl.minimum(num_keys, offset + (tile + 1) * BLOCK_M)
    begin = tl.where(window > 0, tl.maximum(offset + tile * BLOCK_M - window + 1, 0), 0)
    for start in range(begin, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        cols_ok = cols < num_keys
        k = tl.load(k_ptr + cols[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                    mask=cols_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_ptr + cols[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
                    mask=cols_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # log2 units
        if SOFTCAP:
            scores = soft_cap(scores, cap)
        visible = cols_ok[None, :] & (cols[None, :] <= offset + rows[:, None])
        visible = visible & ((window <= 0) | (cols[None, :] > offset + rows[:, None] - window))
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padded rows see no key at all
        p = tl.exp2(scores - m_safe[:, None])
        rescale = tl.exp2(m - m_safe)
        denom = denom * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rows_ok[:, None] & d_ok[None, :])


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                      block_m: int = 64, block_n: int = 64, window: int | None = None,
                      softcap: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal prefill attention with the Triton kernel (shapes in the module docstring). ``window``: query p
    sees keys (p - window, p] only; ``softcap``: scores become ``softcap * tanh(score / softcap)``; ``out``
    (``[T, H, D]``, q's dtype): written and returned instead of a new tensor."""
    num_queries, num_heads, head_dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if num_keys < num_queries:
        raise ValueError(f"{num_queries} queries need at least as many keys, got {num_keys}")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if out is None:
        out = torch.empty((num_queries, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_queries == 0:
        return out
    # tl.dot needs tiles of at least 16 on every side.
    block_m = max(16, min(block_m, triton.next_power_of_2(num_queries)))
    grid = (triton.cdiv(num_queries, block_m), num_heads)
    _prefill_kernel[grid](
        out, q, k, v, float(scale) * _LOG2E, num_queries, num_keys, window or 0, float(softcap or 1.0) * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m, BLOCK_N=max(16, block_n), SOFTCAP=bool(softcap), **dot_options(q),
    )
    return out
