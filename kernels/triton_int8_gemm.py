"""Weight-only int8 GEMM in Triton (CUDA), beside the PyTorch reference it must equal.

Same contract as :mod:`kubellm.kernels.cpu_int8_gemm`, with the weight unpacked: ``y = (x @ q.T) * scales +
bias`` for ``x`` ``[M, K]`` (bf16, fp16 or fp32), ``q`` ``[N, K]`` int8, ``scales``/``bias`` ``[N]`` float32;
``y`` ``[M, N]`` in ``x``'s dtype. Each program computes a BLOCK_M x BLOCK_N tile of ``y``, reading int8 weight
tiles and widening them to ``x``'s dtype in registers (exact: |q| <= 127) for ``tl.dot`` with float32
accumulation, so the weights cross the memory bus as int8; the scales and bias apply once, to the float32
tile. ``DOT=False`` (tiling ``dot=False``) is the GEMV form for a few rows: a broadcast multiply and a float32
sum over K in place of tl.dot, a variant benchmarks/gpu_gemm_tiles.py times against the dot form. Under
``TRITON_INTERPRET=1`` (CPU tensors: the tests) every tile goes to float32 right after its load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubellm.kernels import triton_gemm_tiles as gemm_tiles
from kubellm.kernels.cpu_int8_gemm import reference_int8_gemm
from kubellm.kernels.triton_dot import dot_options

__all__ = ["int8_gemm", "reference_int8_gemm"]


@triton.jit
def _int8_gemm_kernel(
    y_ptr, x_ptr, q_ptr, scales_ptr, bias_ptr, M, N, K, K_SPLIT,
    stride_xm, stride_qn, stride_ys, stride_ym,
    HAS_BIAS: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)  # this program's K range (split-K: kernels/triton_gemm_tiles.py)
    rows_ok, cols_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(split * K_SPLIT, tl.minimum(split * K_SPLIT + K_SPLIT, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        ks_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=rows_ok[:, None] & ks_ok[None, :],
                    other=0.0)
        q = tl.load(q_ptr + cols[:, None] * stride_qn + ks[None, :], mask=cols_ok[:, None] & ks_ok[None, :],
                    other=0)
        if DOT:
            if UPCAST:
                x = x.to(tl.float32)
            acc += tl.dot(x, tl.trans(q.to(x.dtype)), input_precision=PRECISION)
        else:  # q is [BLOCK_N, BLOCK_K]: reduce along its rows' K
            acc += tl.sum(x.to(tl.float32)[:, None, :] * q.to(tl.float32)[None, :, :], axis=2)
    acc = acc * tl.load(scales_ptr + cols, mask=cols_ok, other=0.0)[None, :]
    if HAS_BIAS:  # noqa: SIM102 - a constexpr test, then a runtime one: Triton keeps them apart
        if split == 0:  # once, not once per split
            acc = acc + tl.load(bias_ptr + cols, mask=cols_ok, other=0.0)[None, :]
    tl.store(y_ptr + split * stride_ys + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=rows_ok[:, None] & cols_ok[None, :])


def tiling_args(x: torch.Tensor) -> dict[str, int]:
    """:func:`gemm_tiles.choose`'s constraints for this kernel: none beyond the device and x's element size."""
    return dict(sms=gemm_tiles.sm_count(x.device), x_bytes=x.element_size())


def int8_gemm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
              **tiling: int) -> torch.Tensor:
    """``x [M, K]`` times the int8 weight ``q [N, K]``, per-channel ``scales`` (and ``bias``) in float32.
    ``tiling``: overrides of :func:`gemm_tiles.choose` (block_m, block_n, block_k, split, dot, ...)."""
    m, k = x.shape
    n, k_q = q.shape
    if k != k_q:
        raise ValueError(f"x has {k} columns, the weight {k_q}")
    if q.dtype != torch.int8 or scales.dtype != torch.float32 or scales.shape != (n,):
        raise ValueError("q must be int8 [N, K] and scales float32 [N]")
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = q.contiguous()
    if m == 0 or n == 0:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles = gemm_tiles.choose(m, n, k, **tiling_args(x), **tiling)
    buf, stride_split = gemm_tiles.partials(m, n, tiles, x.dtype, x.device)
    _int8_gemm_kernel[tiles.grid(m, n)](
        buf, x, q, scales, bias if bias is not None else scales, m, n, k, tiles.k_split,
        x.stride(0), q.stride(0), stride_split, buf.stride(-2),
        HAS_BIAS=bias is not None, DOT=tiles.dot, **dot_options(x),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return gemm_tiles.finish(buf, tiles, x.dtype)
