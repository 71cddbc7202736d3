"""Fused elementwise layer ops in Triton (CUDA): the same functions, signatures and in-place semantics as
:mod:`kubellm.kernels.cpu_layer_ops` (RMSNorm, residual add + RMSNorm, SiLU-and-mul, rotary embedding, Qwen3's
q/k norm + rotary), so a model calls whichever module the kernel choice picked. Their references are
cpu_layer_ops' (plain PyTorch, any device), re-exported here.

Why: a decode step on a GPU at batch 1 spends most of its forward in hundreds of tiny PyTorch elementwise
kernels (a reduce, an rsqrt, adds, casts, rotary's cat per layer); each op here is one launch.

Every load goes to float32 at once (the interpreter mis-handles bf16 otherwise) and every intermediate the
reference rounds to the model dtype is rounded at the same point (``_round``), so outputs match the
references but for the float32 reductions' order. One program per row (norms), per (token, head) (rotary),
per (row, column block) (SiLU-and-mul); rows may be strided (q/k are views into the fused qkv output), the
last dim must be contiguous. Positions are not range-checked (a check would sync the host every step); the
runner only passes positions inside the rotary table. On CPU these run only under ``TRITON_INTERPRET=1``
(tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubellm.kernels.cpu_layer_ops import (
    reference_add_rms_norm_,
    reference_qk_norm_rotary_,
    reference_rms_norm,
    reference_rotary_embedding_,
    reference_silu_and_mul,
)

__all__ = [
    "rms_norm", "add_rms_norm_", "silu_and_mul", "rotary_embedding_", "qk_norm_rotary_",
    "reference_rms_norm", "reference_add_rms_norm_", "reference_silu_and_mul", "reference_rotary_embedding_",
    "reference_qk_norm_rotary_",
]

_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_SILU_BLOCK = 1024


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """What storing to the model dtype and reading back gives (the references round there). bf16 rounds to
    nearest-even by hand: the interpreter's cast truncates, the GPU's rounds; this way both agree (and the cast
    of a value rounded here is exact on either)."""
    if DTYPE == tl.bfloat16:  # noqa: SIM300 - DTYPE is a constexpr argument, not a constant
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, x_stride, res_stride, out_stride, n, eps,
                     ADD: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:  # residual <- residual + x (rounded, as the reference's in-place add), then normalise it
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = _round(x + r, DTYPE)
        tl.store(res_ptr + row * res_stride + cols, x.to(DTYPE), mask=mask)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    y = _round(x * inv, DTYPE) * w
    tl.store(out_ptr + row * out_stride + cols, _round(y, DTYPE).to(DTYPE), mask=mask)


@triton.jit
def _silu_and_mul_kernel(in_ptr, out_ptr, in_stride, out_stride, inter, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(in_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(in_ptr + row * in_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = _round(gate / (1.0 + tl.exp(-gate)), DTYPE)  # silu(gate) is a tensor of its own in the reference
    tl.store(out_ptr + row * out_stride + cols, _round(act * up, DTYPE).to(DTYPE), mask=mask)


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_tok, q_head, k_tok, k_head, cs_stride,
                   num_q_heads, eps, HALF: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr,
                   DTYPE: tl.constexpr):
    """One head of one token: q heads first, then k heads (axis 1). NORM: Qwen3's per-head RMSNorm first."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < num_q_heads:
        base, w_ptr = q_ptr + tok * q_tok + head * q_head, qw_ptr
    else:
        base, w_ptr = k_ptr + tok * k_tok + (head - num_q_heads) * k_head, kw_ptr
    d = tl.arange(0, BLOCK)
    mask = d < HALF
    x1 = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + d, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
        x1 = _round(_round(x1 * inv, DTYPE) * tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32), DTYPE)
        x2 = _round(_round(x2 * inv, DTYPE) * tl.load(w_ptr + HALF + d, mask=mask, other=0.0).to(tl.float32),
                    DTYPE)
    pos = tl.load(pos_ptr + tok)
    c1 = tl.load(cos_ptr + pos * cs_stride + d, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * cs_stride + HALF + d, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * cs_stride + d, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * cs_stride + HALF + d, mask=mask, other=0.0).to(tl.float32)
    # x*cos + rotate_half(x)*sin, each product rounded like the reference's tensors
    y1 = _round(x1 * c1, DTYPE) + _round(-x2 * s1, DTYPE)
    y2 = _round(x2 * c2, DTYPE) + _round(x1 * s2, DTYPE)
    tl.store(base + d, _round(y1, DTYPE).to(DTYPE), mask=mask)
    tl.store(base + HALF + d, _round(y2, DTYPE).to(DTYPE), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as 2-D rows with a contiguous last dim (a view where possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _same_dtype(x: torch.Tensor, *others: torch.Tensor) -> None:
    """The kernels read every tensor as ``x``'s dtype: a mismatch is an error, as on CPU, not garbage."""
    if any(o.dtype != x.dtype for o in others):
        raise ValueError(f"dtype mismatch: {x.dtype} vs {[o.dtype for o in others]}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _same_dtype(x, weight)
    rows = _rows(x)
    n = rows.shape[1]
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, rows, weight, out, rows.stride(0), rows.stride(0), out.stride(0), n,
                                           eps, ADD=False, BLOCK=triton.next_power_of_2(n), DTYPE=_TL_DTYPE[x.dtype])
    return out.view(x.shape)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """residual += x; x = rms_norm(residual): both in place (2-D, rows strided, last dim contiguous)."""
    _same_dtype(x, residual, weight)
    if x.dim() != 2 or residual.shape != x.shape or x.stride(1) != 1 or residual.stride(1) != 1:
        raise ValueError(f"add_rms_norm_ takes two [T, H] tensors with contiguous rows (got {tuple(x.shape)}, "
                         f"{tuple(residual.shape)})")
    n = x.shape[1]
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, residual, weight, x, x.stride(0), residual.stride(0), x.stride(0), n, eps,
                                        ADD=True, BLOCK=triton.next_power_of_2(n), DTYPE=_TL_DTYPE[x.dtype])


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows = _rows(gate_up)
    inter = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        block = min(_SILU_BLOCK, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
            rows, out, rows.stride(0), out.stride(0), inter, BLOCK=block, DTYPE=_TL_DTYPE[gate_up.dtype])
    return out.view(*gate_up.shape[:-1], inter)


def _rotary(positions, q, k, cos, sin, q_weight, k_weight, eps, norm: bool) -> None:
    t, heads, d = q.shape
    _same_dtype(q, k, cos, sin, *(() if q_weight is None else (q_weight, k_weight)))
    if (k.shape[0] != t or k.shape[2] != d or q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(1) != 1
            or sin.stride() != cos.stride() or d % 2):
        raise ValueError(f"rotary takes q [T, H, D], k [T, KVH, D] with contiguous heads and even D, tables "
                         f"[P, D] alike (got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(cos.shape)})")
    if t == 0:
        return
    w_q, w_k = (q_weight, k_weight) if norm else (cos, cos)  # unused pointers without NORM
    _rotary_kernel[(t, heads + k.shape[1])](
        positions, q, k, cos, sin, w_q, w_k, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        heads, eps, HALF=d // 2, BLOCK=triton.next_power_of_2(d // 2), NORM=norm, DTYPE=_TL_DTYPE[q.dtype])


def rotary_embedding_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> None:
    _rotary(positions, q, k, cos, sin, None, None, 0.0, norm=False)


def qk_norm_rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                    k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> None:
    _rotary(positions, q, k, cos, sin, q_weight, k_weight, eps, norm=True)
