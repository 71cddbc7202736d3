"""Weight-only int4 GEMM on CPU with per-group scales and zero points: a native kernel
(``csrc/int4_gemm_cpu.cpp``, AVX512-BF16) beside its PyTorch reference.

``y = sum over groups of s * (x_g @ q_g.T - z * sum(x_g))`` (+ bias), i.e. ``x @ ((q - z) * s).T`` with ``x``
``[M, K]`` bfloat16, ``q`` ``[N, K]`` unsigned 4-bit values (0..15; a symmetric format uses z = 8), ``scales``
and ``zeros`` ``[K / group, N]`` float32, ``y`` ``[M, N]`` bfloat16. The form every 4-bit format reads into
(runtime/quantization/: AWQ, GPTQ, compressed-tensors W4A16). The kernel wants the weight packed once by
:func:`pack` (``[N/16, K/4, 16, 2]`` uint8; ``N % 16 == 0``, ``K`` divisible by the group size, a multiple of
4). Which paths a build has depends on the ISA it was compiled for: AVX512-BF16 builds run both activation
kinds below on bfloat16 ``x``; AVX2 builds (x86-64-v3, and any build without AVX512-BF16) only
``int8_activations=True``, on bfloat16 or float32 ``x`` (``y`` in ``x``'s dtype; ``csrc/avx2_tiles.h``).
:func:`available` says whether this process has the bf16-activation path, :func:`int8_available` the int8 one,
:func:`takes_float32` whether that one takes float32.

Few rows (decode) use the weights as stored, widened in registers; from :data:`DEQUANTIZE_ROWS` rows the kernel
dequantizes each slice of the weight to bf16 once and runs all rows over it, so there the weights are rounded
to bf16 before the products, as a bf16 model's are (the reference does the same with ``weights_dtype``).

``int8_activations=True`` (any number of rows): each row's activations are quantized to int8 per weight group
(symmetric, scale ``max|x| / 127``) and multiplied with the nibbles in integer dot products (AVX512-VNNI,
``csrc/w4a8_tiles.h``), llama.cpp's Q4 x Q8: half the multiply instructions of bf16 per weight, at the cost of
rounding the activations (AVX2: vpmaddubsw / vpmaddwd, llama.cpp's Q4 x Q8 on AVX2, the same integers and
epilogue). A row's result does not depend on the rows beside it (the same bits alone or in any batch). :func:`reference_w4a8_gemm` is that math in
PyTorch; :func:`int8_available` says whether this build has it.
"""

from __future__ import annotations

import torch

from kubellm.kernels.cpu_extension import available as extension_available

__all__ = ["DEQUANTIZE_ROWS", "available", "int4_gemm", "int8_available", "pack", "packable",
           "quantize_activations", "reference_int4_gemm", "reference_w4a8_gemm", "takes_float32", "unpack"]

DEQUANTIZE_ROWS = 16  # kDequantMinRows in csrc/int4_gemm_cpu.cpp


def available() -> bool:
    """Whether :func:`int4_gemm` runs with bf16 activations here (a build with AVX512-BF16)."""
    return extension_available() and bool(torch.ops.kubellm_cpu.int4_gemm_available())


def int8_available() -> bool:
    """Whether :func:`int4_gemm` takes ``int8_activations`` here (a build with AVX512-VNNI, or with AVX2)."""
    return extension_available() and bool(torch.ops.kubellm_cpu.int4_gemm_int8_available())


def takes_float32() -> bool:
    """Whether the int8-activation path takes float32 ``x`` here (the AVX2 build; AVX-512 takes bfloat16)."""
    return int8_available() and bool(torch.ops.kubellm_cpu.int4_gemm_takes_float32())


def packable(q: torch.Tensor, group_size: int) -> bool:
    return q.dim() == 2 and q.shape[0] % 16 == 0 and group_size % 4 == 0 and q.shape[1] % group_size == 0


def pack(q: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` values 0..15 → ``[N/16, K/4, 16, 2]`` bytes: per block of 16 output channels and quad of
    inputs k..k+3, channel i's byte j (0, 1) holds q[k + j] in its low nibble and q[k + 2 + j] in its high one
    (so the low nibbles are the (k, k+1) pairs the kernel multiplies, the high ones the (k+2, k+3) pairs)."""
    n, k = q.shape
    quads = q.to(torch.uint8).view(n // 16, 16, k // 4, 2, 2).permute(0, 2, 1, 4, 3)  # [.., i, j, low/high]
    return (quads[..., 0] | (quads[..., 1] << 4)).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """:func:`pack`'s inverse: ``[N/16, K/4, 16, 2]`` bytes → ``[N, K]`` values 0..15 (uint8)."""
    nib = torch.stack([packed & 0xF, packed >> 4], dim=-1)  # [N/16, K/4, 16, 2 (j), 2 (low/high)]
    return nib.permute(0, 2, 1, 4, 3).reshape(packed.shape[0] * 16, -1)


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              bias: torch.Tensor | None = None, int8_activations: bool = False) -> torch.Tensor:
    return torch.ops.kubellm_cpu.int4_gemm(x, packed, scales, zeros, group_size, bias, int8_activations)


def reference_int4_gemm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                        bias: torch.Tensor | None = None, weights_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """In float32, on the unpacked ``[N, K]`` values; ``weights_dtype=torch.bfloat16`` rounds the dequantized
    weights first, as the kernel does from :data:`DEQUANTIZE_ROWS` rows."""
    g = torch.arange(q.shape[1]) // group_size
    w = ((q.float() - zeros.t()[:, g]) * scales.t()[:, g]).to(weights_dtype).float()
    y = x.float() @ w.T
    return (y if bias is None else y + bias).to(x.dtype)


def quantize_activations(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` → (``[M, K]`` integers -127..127 as float32, ``[M, K / group]`` float32 scales): per row and
    group of inputs ``scale = max|x| / 127`` and ``round(x * (127 / max|x|))`` (half to even; 0 for an all-zero
    group), the kernel's rounding exactly."""
    m, k = x.shape
    xf = x.float().view(m, k // group_size, group_size)
    amax = xf.abs().amax(-1)
    # 127 / amax as one float32 division, as the kernel does (a Python number over a tensor is reciprocal * 127)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xf * inv[..., None]).clamp(-127, 127)
    return xq.view(m, k), amax / 127.0


def reference_w4a8_gemm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """What ``int4_gemm(..., int8_activations=True)`` computes, in float64 on the unpacked ``[N, K]`` values:
    ``sum over groups of s * a * (xq . q - z * sum(xq))`` with :func:`quantize_activations`' ``xq`` and ``a``."""
    xq, a = quantize_activations(x, group_size)
    m, k = xq.shape
    groups = k // group_size
    xg = xq.double().view(m, groups, group_size)
    dots = torch.einsum("mgk,ngk->mgn", xg, q.double().view(-1, groups, group_size))
    centred = dots - zeros.double()[None] * xg.sum(-1)[..., None]
    y = (centred * scales.double()[None] * a.double()[..., None]).sum(1)
    return (y if bias is None else y + bias.double()).to(x.dtype)
