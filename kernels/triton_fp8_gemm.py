"""Weight-only FP8 (e4m3) GEMM in Triton (CUDA), beside its plain-PyTorch reference: the GPU kernel for FP8
checkpoints (``quant_method: fp8``, compressed-tensors ``float-quantized``; DeepSeek / Qwen3-FP8 block scales).

``y = x @ (W * S).T (+ bias)`` for ``x`` ``[M, K]`` (bf16, fp16 or fp32; rows may be strided), ``weight``
``[N, K]`` ``torch.float8_e4m3fn`` (or its bytes as uint8), ``y`` ``[M, N]`` in ``x``'s dtype with float32
accumulation. ``scale`` (any float dtype) is one of:

* per tensor: one element (``weight_scale`` of a per-tensor checkpoint);
* per output channel: ``[N]`` or ``[N, 1]``;
* per block: ``[ceil(N / block[0]), ceil(K / block[1])]`` with ``block`` given (``weight_scale_inv`` of a
  ``weight_block_size: [128, 128]`` checkpoint; despite the name it multiplies, as it does in those models).

Entry point: ``fp8_gemm(x, weight, scale, bias=None, block=None)``.

Activations stay in their dtype (weight-only): each program loads a K tile of weight bytes, decodes e4m3 to
float32 by bit arithmetic (:func:`decode_e4m3`, exact, NaN for 0x7F/0xFF) and runs ``tl.dot`` in ``x``'s dtype
(e4m3 converts exactly to bf16 and fp16); per-tensor and per-channel scales apply once to the accumulator,
block scales once per K tile (the tile lies inside one block column). Tiling ``dot=False`` is the GEMV form
for a few rows (a broadcast multiply and a float32 sum over K instead of tl.dot), a variant
benchmarks/gpu_gemm_tiles.py times against the dot form. Bytes and bit arithmetic rather than
``tl.float8e4nv``: Triton's interpreter decodes 0x7F as 480 instead of NaN, and the same code then runs on
every GPU, not only those with FP8 conversion instructions. Dynamic per-token activation quantization
(W8A8 tensor-core FP8 dots) is not done here: activations are never quantized.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubellm.kernels import triton_gemm_tiles as gemm_tiles
from kubellm.kernels.triton_dot import dot_options

__all__ = ["decode_e4m3", "fp8_gemm", "reference_fp8_gemm"]

PER_TENSOR, PER_CHANNEL, PER_BLOCK = 0, 1, 2


@triton.jit
def _e4m3_to_float32(b):
    """int32 e4m3 codes (0..255) → float32: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities."""
    magnitude = b & 0x7F
    exponent = magnitude >> 3
    mantissa = magnitude & 0x7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)  # rebias 7 → 127
    subnormal = mantissa.to(tl.float32) * 0.001953125  # mantissa * 2^-9
    v = tl.where(exponent == 0, subnormal, normal)
    v = tl.where(magnitude == 0x7F, float("nan"), v)
    return tl.where(b >= 128, -v, v)


@triton.jit
def _decode_kernel(out_ptr, codes_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    b = tl.load(codes_ptr + i, mask=i < n, other=0).to(tl.int32)
    tl.store(out_ptr + i, _e4m3_to_float32(b), mask=i < n)


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """The kernel's e4m3 decode on its own: uint8 (or float8_e4m3fn) codes → float32 (tests compare it with
    ``torch.float8_e4m3fn`` over all 256 codes)."""
    codes = codes.contiguous().view(torch.uint8)
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    _decode_kernel[(triton.cdiv(codes.numel(), 256),)](out, codes, codes.numel(), BLOCK=256)
    return out


@triton.jit
def _fp8_gemm_kernel(
    y_ptr, x_ptr, w_ptr, scale_ptr, bias_ptr, M, N, K, K_SPLIT,
    stride_xm, stride_wn, stride_sn, stride_ys, stride_ym,
    SCALING: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)  # this program's K range (split-K: kernels/triton_gemm_tiles.py)
    rows_ok, cols_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # With block scales BLOCK_K divides SCALE_COLS and a split holds whole block columns: one per tile.
    for k0 in range(split * K_SPLIT, tl.minimum(split * K_SPLIT + K_SPLIT, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        ks_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=rows_ok[:, None] & ks_ok[None, :],
                    other=0.0)
        b = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None], mask=ks_ok[:, None] & cols_ok[None, :],
                    other=0).to(tl.int32)
        if DOT:
            if UPCAST:
                x = x.to(tl.float32)
            part = tl.dot(x, _e4m3_to_float32(b).to(x.dtype), input_precision=PRECISION)
        else:
            part = tl.sum(x.to(tl.float32)[:, :, None] * _e4m3_to_float32(b)[None, :, :], axis=1)
        if SCALING == 2:
            s = tl.load(scale_ptr + (cols // SCALE_ROWS) * stride_sn + k0 // SCALE_COLS, mask=cols_ok, other=0.0)
            acc += part * s.to(tl.float32)[None, :]
        else:
            acc += part
    if SCALING == 0:
        acc = acc * tl.load(scale_ptr).to(tl.float32)
    elif SCALING == 1:
        acc = acc * tl.load(scale_ptr + cols, mask=cols_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:  # noqa: SIM102 - a constexpr test, then a runtime one: Triton keeps them apart
        if split == 0:  # once, not once per split
            acc = acc + tl.load(bias_ptr + cols, mask=cols_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + split * stride_ys + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=rows_ok[:, None] & cols_ok[None, :])


def _scaling(scale: torch.Tensor, n: int, k: int, block: tuple[int, int] | None) -> int:
    """Which scale layout ``scale`` is (PER_TENSOR, PER_CHANNEL, PER_BLOCK); ValueError when it fits none."""
    if block is not None:
        rows, cols = block
        expected = (-(-n // rows), -(-k // cols))
        if tuple(scale.shape) != expected or cols < 16 or cols & (cols - 1):
            raise ValueError(f"block scales for a [{n}, {k}] weight in {rows}x{cols} blocks must be {list(expected)} "
                             f"(block columns a power of two >= 16), got {list(scale.shape)}")
        return PER_BLOCK
    if scale.numel() == 1:
        return PER_TENSOR
    if tuple(scale.shape) in ((n,), (n, 1)):
        return PER_CHANNEL
    raise ValueError(f"an fp8 scale is one element, [{n}] or [{n}, 1] (or per block with block=...), "
                     f"got {list(scale.shape)}")


def tiling_args(x: torch.Tensor, block: tuple[int, int] | None) -> dict[str, int]:
    """:func:`gemm_tiles.choose`'s constraints for this kernel: with block scales a K tile and a split lie inside
    whole block columns; per-channel and per-tensor scales leave K free."""
    return dict(sms=gemm_tiles.sm_count(x.device), max_block_k=min(128, block[1]) if block else 128,
                k_multiple=block[1] if block else 16, x_bytes=x.element_size())


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
             block: tuple[int, int] | None = None, **tiling: int) -> torch.Tensor:
    """``x [M, K]`` times the e4m3 ``weight [N, K]`` with its ``scale`` (layouts in the module docstring).
    ``tiling``: overrides of :func:`gemm_tiles.choose` (block_m, block_n, block_k, split, dot, ...)."""
    m, k = x.shape
    n, k_w = weight.shape
    if k != k_w:
        raise ValueError(f"x has {k} columns, the weight {k_w}")
    if weight.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"weight must be float8_e4m3fn (or its uint8 bytes), got {weight.dtype}")
    scaling = _scaling(scale, n, k, block)
    scale = scale.reshape(scale.shape[0], -1) if scaling == PER_BLOCK else scale.reshape(-1)
    scale = scale.contiguous()
    weight = weight.contiguous().view(torch.uint8)
    x = x if x.stride(-1) == 1 else x.contiguous()
    if m == 0 or n == 0:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles = gemm_tiles.choose(m, n, k, **tiling_args(x, block), **tiling)
    buf, stride_split = gemm_tiles.partials(m, n, tiles, x.dtype, x.device)
    _fp8_gemm_kernel[tiles.grid(m, n)](
        buf, x, weight, scale, scale if bias is None else bias, m, n, k, tiles.k_split,
        x.stride(0), weight.stride(0), scale.stride(0) if scaling == PER_BLOCK else 0, stride_split, buf.stride(-2),
        SCALING=scaling, SCALE_ROWS=block[0] if block else 1, SCALE_COLS=block[1] if block else 1,
        HAS_BIAS=bias is not None, DOT=tiles.dot, **dot_options(x),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return gemm_tiles.finish(buf, tiles, x.dtype)


def reference_fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                       block: tuple[int, int] | None = None) -> torch.Tensor:
    """The same product in float32 (dequantizes the whole weight: tests and checks)."""
    n, k = weight.shape
    w = weight.view(torch.float8_e4m3fn).float()
    scaling = _scaling(scale, n, k, block)
    s = scale.float()
    if scaling == PER_BLOCK:
        s = s.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    elif scaling == PER_CHANNEL:
        s = s.reshape(n, 1)
    else:
        s = s.reshape(())
    y = x.float() @ (w * s).T
    return (y if bias is None else y + bias.float()).to(x.dtype)
