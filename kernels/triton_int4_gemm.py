"""Weight-only int4 GEMM in Triton (CUDA), beside its plain-PyTorch reference.

``y = x @ W.T (+ bias)`` where ``W[n, k] = q[n, k] * scales[n, k // group]``: ``q`` are signed 4-bit values
in ``[-8, 7]`` packed two per byte along ``k`` (the layout of :mod:`kubellm.kernels.int4_weights`, which also
holds the reference), ``scales`` float32 ``[N, K / group]``. ``x`` ``[M, K]`` (bf16, fp16 or fp32), ``y``
``[M, N]`` in ``x``'s dtype, float32 accumulation.

Each program computes a BLOCK_M x BLOCK_N tile of ``y``; per K tile (inside one quantization group) it loads
the packed bytes once, splits them into the even-k and odd-k nibbles (sign-extended by an arithmetic shift),
and runs two ``tl.dot``s against the matching even and odd columns of ``x``; the group's scale multiplies the
tile's partial sum. The weights cross the memory bus at half a byte each. Under ``TRITON_INTERPRET=1`` (CPU
tensors: the tests) every tile is float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubellm.kernels.int4_weights import reference_int4_gemm, unpack_int4
from kubellm.kernels.triton_dot import dot_options

__all__ = ["int4_gemm", "reference_int4_gemm", "unpack_int4"]


@triton.jit
def _int4_gemm_kernel(
    y_ptr, x_ptr, p_ptr, scales_ptr, bias_ptr, M, N, K,
    stride_xm, stride_pn, stride_sn, stride_ym,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok, cols_ok = rows < M, cols < N
    half = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # BLOCK_K divides GROUP: a tile never straddles two groups
        pairs = k0 // 2 + half
        pairs_ok = pairs < K // 2
        p = tl.load(p_ptr + cols[:, None] * stride_pn + pairs[None, :], mask=cols_ok[:, None] & pairs_ok[None, :],
                    other=0)
        p = p.to(tl.int8, bitcast=True)
        low = (p << 4) >> 4  # arithmetic shifts sign-extend each nibble
        high = p >> 4
        x_mask = rows_ok[:, None] & pairs_ok[None, :]
        x_even = tl.load(x_ptr + rows[:, None] * stride_xm + 2 * pairs[None, :], mask=x_mask, other=0.0)
        x_odd = tl.load(x_ptr + rows[:, None] * stride_xm + 2 * pairs[None, :] + 1, mask=x_mask, other=0.0)
        if UPCAST:
            x_even = x_even.to(tl.float32)
            x_odd = x_odd.to(tl.float32)
        part = tl.dot(x_even, tl.trans(low.to(x_even.dtype)), input_precision=PRECISION)
        part += tl.dot(x_odd, tl.trans(high.to(x_odd.dtype)), input_precision=PRECISION)
        scale = tl.load(scales_ptr + cols * stride_sn + k0 // GROUP, mask=cols_ok, other=0.0)
        acc += part * scale[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=cols_ok, other=0.0)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=rows_ok[:, None] & cols_ok[None, :])


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int,
              bias: torch.Tensor | None = None, *, block_m: int = 16, block_n: int = 64,
              block_k: int = 64) -> torch.Tensor:
    """``x [M, K]`` times the packed int4 weight ``[N, K/2]`` with group-wise float32 ``scales [N, K/group]``."""
    m, k = x.shape
    n = packed.shape[0]
    if packed.dtype != torch.uint8 or packed.shape[1] * 2 != k:
        raise ValueError(f"packed must be uint8 [N, K/2] for K = {k}, got {packed.dtype} {tuple(packed.shape)}")
    if k % group or scales.shape != (n, k // group) or scales.dtype != torch.float32:
        raise ValueError(f"scales must be float32 [N, K/group] = [{n}, {k // group}] with group {group} dividing {k}")
    block_k = min(max(32, block_k), group)  # two dots of BLOCK_K/2 >= 16 columns, inside one group
    if group % block_k:
        raise ValueError(f"group {group} must be a multiple of the K tile {block_k}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    packed, scales = packed.contiguous(), scales.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](
        y, x, packed, scales, bias if bias is not None else scales, m, n, k,
        x.stride(0), packed.stride(0), scales.stride(0), y.stride(0),
        GROUP=group, HAS_BIAS=bias is not None, **dot_options(x),
        BLOCK_M=max(16, block_m), BLOCK_N=max(16, block_n), BLOCK_K=block_k,
    )
    return y
