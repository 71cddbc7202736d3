"""Weight-only FP8 (e4m3fn) GEMM on CPU with a scale per (output, group of inputs): a native kernel
(``csrc/fp8_gemm_cpu.cpp``, AVX512-BF16) beside its PyTorch reference.

``y = x @ (w * s).T`` (+ bias), group by group: ``x`` ``[M, K]`` bfloat16 (rows may be strided), ``w``
``[N, K]`` ``torch.float8_e4m3fn``, ``scales`` ``[ceil(K / group), N]`` float32 or float16, ``bias`` ``[N]``
float32, ``y`` ``[M, N]`` bfloat16. ``group`` is any multiple of 4 inputs; ``K`` itself is one scale per
channel (a per-tensor scale is that scale repeated), 128 is a DeepSeek / Qwen3-FP8 128 x 128 block scale read
as one scale per (output, 128 inputs). The last group may hold fewer inputs (``K % group``).

Few rows (decode) widen the e4m3 bytes to bf16 in registers, exactly, and apply the scale per group; from
:data:`DEQUANTIZE_ROWS` rows the kernel dequantizes each slice of the weight to bf16 (``w * s`` rounded, as a
bf16 model's weights are) once and runs all rows over it (the reference does the same with
``weights_dtype``). With one scale per channel (``group >= K``) the many-rows path starts at
:data:`DEQUANTIZE_ROWS_PER_CHANNEL` rows and keeps the widened bytes exact, the scale applied to the sums as
in the few-rows path: no rounding of the weights, and the same bits for a row alone or in a batch
(:func:`rounds_weights` says which calls round). The kernel wants the weight packed once by :func:`pack`
(``[ceil(N/16), K/4, 64]`` bytes, the last block padded with zero channels; any ``N``, ``K`` a multiple of 4). It exists only in builds for CPUs with
AVX512-BF16; :func:`available` says whether this process has it.
"""

from __future__ import annotations

import torch

from kubellm.kernels.cpu_extension import available as extension_available

__all__ = ["DEQUANTIZE_ROWS", "DEQUANTIZE_ROWS_PER_CHANNEL", "available", "fp8_gemm", "pack", "packable",
           "reference_fp8_gemm", "rounds_weights"]

DEQUANTIZE_ROWS = 48  # kDequantMinRows in csrc/fp8_gemm_cpu.cpp
DEQUANTIZE_ROWS_PER_CHANNEL = 16  # kDequantMinRowsPerChannel there (group >= K: the weights stay exact)


def rounds_weights(rows: int, k: int, group_size: int) -> bool:
    """Whether :func:`fp8_gemm` of ``rows`` rows rounds ``w * s`` to bf16 before the products (the dequantizing
    path with a scale per group; per channel it keeps the widened bytes and scales the sums)."""
    return group_size < k and rows >= DEQUANTIZE_ROWS


def available() -> bool:
    return extension_available() and bool(torch.ops.kubellm_cpu.fp8_gemm_available())


def packable(in_features: int, group_size: int) -> bool:
    """Whether the kernel takes a layer of ``in_features`` inputs with a scale per ``group_size`` of them
    (-1 or ``in_features``: per channel): both multiples of 4."""
    group = in_features if group_size <= 0 else group_size
    return in_features % 4 == 0 and group % 4 == 0


def pack(w: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` e4m3fn → ``[ceil(N/16), K/4, 64]`` uint8. Per block of 16 output channels and quad of inputs
    k..k+3: the 32 bytes of the pair (k, k+1) are the 16 channels' pairs side by side (``b = 2 c + j``, the
    int8 kernels' order), then those of (k+2, k+3); the quad's 64 bytes take them 8 at a time, alternating
    (byte ``16 l + 8 p + i`` is pair ``p``'s byte ``8 l + i``), which the kernel's byte unpacks undo within
    each 16-byte lane. Missing channels are 0."""
    n, k = w.shape
    q = w.view(torch.uint8)
    if pad := -n % 16:
        q = torch.cat([q, q.new_zeros(pad, k)])
    pairs = q.view((n + pad) // 16, 16, k // 4, 2, 2).permute(0, 2, 3, 1, 4)  # [block, quad, p, c, j]
    return pairs.reshape(-1, k // 4, 2, 4, 8).transpose(2, 3).reshape(-1, k // 4, 64).contiguous()


def unpack(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """:func:`pack`'s inverse: ``[out_features, K]`` e4m3fn."""
    blocks, quads = packed.shape[:2]
    pairs = packed.view(blocks, quads, 4, 2, 8).transpose(2, 3).reshape(blocks, quads, 2, 16, 2)
    q = pairs.permute(0, 3, 1, 2, 4).reshape(blocks * 16, quads * 4)[:out_features]
    return q.contiguous().view(torch.float8_e4m3fn)


def fp8_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.kubellm_cpu.fp8_gemm(x, packed, scales, group_size, bias)


def reference_fp8_gemm(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, group_size: int,
                       bias: torch.Tensor | None = None, weights_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """In float32 from the unpacked ``w`` (dequantizes the whole weight: tests and checks);
    ``weights_dtype=torch.bfloat16`` rounds the dequantized weights first, as the kernel does where
    :func:`rounds_weights` says."""
    g = torch.arange(w.shape[1]) // group_size
    weight = (w.float() * scales.float().t()[:, g]).to(weights_dtype).float()
    y = x.float() @ weight.T
    return (y if bias is None else y + bias).to(x.dtype)
