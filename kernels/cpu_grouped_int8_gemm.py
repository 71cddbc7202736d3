"""Weight-only 8-bit GEMM on CPU with per-group scales and optional zero points: a native kernel
(``csrc/grouped_int8_gemm_cpu.cpp``, AVX512-BF16 or AVX2) beside its PyTorch reference.

``y = x @ ((q - z) * s).T`` (+ bias), group by group: ``x`` ``[M, K]`` bfloat16 (rows may be strided),
``q`` ``[N, K]`` int8 (-128..127), ``scales`` and ``zeros`` ``[K / group, N]`` float32 (``zeros`` None:
symmetric), ``bias`` ``[N]`` float32, ``y`` ``[M, N]`` bfloat16. ``group`` is any even divisor of ``K``
(16, 32, 64, 128; ``K`` itself is one scale per channel). Products are exact (bf16 x int8 in bf16), sums float32.

What reads into it: GPTQ 8-bit and compressed-tensors W8A16 (unsigned values ``u`` with zero ``z``: pass
``q = u - 128`` and ``zeros = z - 128``), GGUF Q8_0 (group 32, no zeros), Q6_K (group 16, no zeros) and Q5_K
(group 32, zeros) through :mod:`kubellm.runtime.quantization.gguf`. Act-order (``g_idx``) checkpoints need their
inputs sorted by group first (permute ``q``'s columns once, ``x``'s per call).

The kernel wants the weight packed once by :func:`pack` (``[ceil(N/16), K/2, 16, 2]`` int8, the last block
padded with zero channels; any ``N``, even ``K``). It exists in builds for CPUs with AVX512-BF16 and in AVX2
builds (x86-64-v3, ``csrc/avx2_tiles.h``), which also take float32 ``x`` (``y`` in ``x``'s dtype; products
float32-rounded then) and never dequantize; :func:`available` says whether this process has it,
:func:`takes_float32` whether it takes float32.

Few rows (decode) use the weights as stored, widened in registers; from :data:`DEQUANTIZE_ROWS` rows the kernel
dequantizes each slice of the weight to bf16 once and runs all rows over it, so there the weights are rounded
to bf16 before the products, as a bf16 model's are (the reference does the same with ``weights_dtype``); one
scale per channel without zero points stays exact (the scale is applied to the sums).
"""

from __future__ import annotations

import torch

from kubellm.kernels.cpu_extension import available as extension_available

__all__ = ["DEQUANTIZE_ROWS", "available", "grouped_int8_gemm", "pack", "packable", "reference_grouped_int8_gemm",
           "rounds_weights", "takes_float32", "unpack"]

DEQUANTIZE_ROWS = 16  # kDequantMinRowsG8 in csrc/grouped_int8_gemm_cpu.cpp


def available() -> bool:
    return extension_available() and bool(torch.ops.kubellm_cpu.grouped_int8_gemm_available())


def rounds_weights(rows: int) -> bool:
    """Whether the kernel rounds the dequantized weights to bf16 for ``rows`` rows: the AVX512-BF16 build from
    :data:`DEQUANTIZE_ROWS` (unless one scale per channel without zero points); the AVX2 build never."""
    return rows >= DEQUANTIZE_ROWS and not takes_float32()


def takes_float32() -> bool:
    """Whether :func:`grouped_int8_gemm` takes float32 ``x`` here (the AVX2 build; AVX-512 takes bfloat16)."""
    return available() and bool(torch.ops.kubellm_cpu.grouped_int8_gemm_takes_float32())


def packable(q: torch.Tensor, group_size: int) -> bool:
    k = q.shape[-1]
    return q.dim() == 2 and group_size >= 2 and group_size % 2 == 0 and k % group_size == 0


def pack(q: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` int8 → ``[ceil(N/16), K/2, 16, 2]``: per block of 16 output channels and pair of inputs
    (k, k+1), the 16 channels' pairs side by side (the kernel's operand order); missing channels are 0."""
    n, k = q.shape
    pad = -n % 16
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
    return q.to(torch.int8).view((n + pad) // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """:func:`pack`'s layout back to ``[ceil(N/16) * 16, K]`` int8 (the padding channels included)."""
    return packed.permute(0, 2, 1, 3).reshape(packed.shape[0] * 16, -1)


def grouped_int8_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                      group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.kubellm_cpu.grouped_int8_gemm(x, packed, scales, zeros, group_size, bias)


def reference_grouped_int8_gemm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                                group_size: int, bias: torch.Tensor | None = None,
                                weights_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The same product in float32 from the unpacked ``q`` (dequantizes the whole weight: tests and checks);
    ``weights_dtype=torch.bfloat16`` rounds the dequantized weights first, as the kernel does from
    :data:`DEQUANTIZE_ROWS` rows."""
    g = torch.arange(q.shape[1]) // group_size
    w = q.float() if zeros is None else q.float() - zeros.t()[:, g]
    y = x.float() @ (w * scales.t()[:, g].float()).to(weights_dtype).float().T
    return (y if bias is None else y + bias).to(x.dtype)
