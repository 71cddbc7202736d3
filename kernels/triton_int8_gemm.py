"""Weight-only int8 GEMM in Triton (CUDA), beside the PyTorch reference it must equal.

Same contract as :mod:`kubellm.kernels.cpu_int8_gemm`, with the weight unpacked: ``y = (x @ q.T) * scales +
bias`` for ``x`` ``[M, K]`` (bf16, fp16 or fp32), ``q`` ``[N, K]`` int8, ``scales``/``bias`` ``[N]`` float32;
``y`` ``[M, N]`` in ``x``'s dtype. Each program computes a BLOCK_M x BLOCK_N tile of ``y``, reading int8 weight
tiles and widening them to ``x``'s dtype in registers (exact: |q| <= 127) for ``tl.dot`` with float32
accumulation, so the weights cross the memory bus as int8; the scales and bias apply once, to the float32
tile. Under ``TRITON_INTERPRET=1`` (CPU tensors: the tests) every tile goes to float32 right after its load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubellm.kernels.cpu_int8_gemm import reference_int8_gemm
from kubellm.kernels.triton_dot import dot_options

__all__ = ["int8_gemm", "reference_int8_gemm"]


@triton.jit
def _int8_gemm_kernel(
    y_ptr, x_ptr, q_ptr, scales_ptr, bias_ptr, M, N, K,
    stride_xm, stride_qn, stride_ym,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok, cols_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        ks_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=rows_ok[:, None] & ks_ok[None, :],
                    other=0.0)
        q = tl.load(q_ptr + cols[:, None] * stride_qn + ks[None, :], mask=cols_ok[:, None] & ks_ok[None, :],
                    other=0)
        if UPCAST:
            x = x.to(tl.float32)
        w = q.to(x.dtype)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    acc = acc * tl.load(scales_ptr + cols, mask=cols_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=cols_ok, other=0.0)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=rows_ok[:, None] & cols_ok[None, :])


def int8_gemm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None, *,
              block_m: int = 16, block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """``x [M, K]`` times the int8 weight ``q [N, K]``, per-channel ``scales`` (and ``bias``) in float32."""
    m, k = x.shape
    n, k_q = q.shape
    if k != k_q:
        raise ValueError(f"x has {k} columns, the weight {k_q}")
    if q.dtype != torch.int8 or scales.dtype != torch.float32 or scales.shape != (n,):
        raise ValueError("q must be int8 [N, K] and scales float32 [N]")
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = q.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int8_gemm_kernel[grid](
        y, x, q, scales, bias if bias is not None else scales, m, n, k,
        x.stride(0), q.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, **dot_options(x),
        BLOCK_M=max(16, block_m), BLOCK_N=max(16, block_n), BLOCK_K=max(16, block_k),
    )
    return y
