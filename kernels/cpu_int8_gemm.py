"""Weight-only int8 GEMM on CPU: a native kernel (``csrc/int8_gemm_cpu.cpp``, AVX512-BF16) beside its PyTorch
reference.

``y = (x @ q.T) * scales + bias`` with ``x`` ``[M, K]`` bfloat16, ``q`` ``[N, K]`` int8, ``scales`` and ``bias``
``[N]`` float32, ``y`` ``[M, N]`` bfloat16; products are exact (bf16 x int8 in bf16) and sums float32. The
kernel wants the weight packed once by :func:`pack` (``N % 16 == 0``, ``K`` even). It exists only in builds for
CPUs with AVX512-BF16 (``-march=native`` on such a CPU); :func:`available` says whether this process has it.
"""

from __future__ import annotations

import torch

from kubellm.kernels.cpu_extension import available as extension_available

__all__ = ["available", "int8_gemm", "pack", "packable", "reference_int8_gemm"]


def available() -> bool:
    return extension_available() and bool(torch.ops.kubellm_cpu.int8_gemm_available())


def packable(q: torch.Tensor) -> bool:
    return q.dim() == 2 and q.shape[0] % 16 == 0 and q.shape[1] % 2 == 0


def pack(q: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` int8 → ``[N/16, K/2, 16, 2]``: per block of 16 output channels and pair of inputs, the 16
    channels' pairs side by side (the kernel's operand order)."""
    n, k = q.shape
    return q.view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def int8_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.kubellm_cpu.int8_gemm(x, packed, scales, bias)


def reference_int8_gemm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    y = (x.float() @ q.float().T) * scales
    return (y if bias is None else y + bias).to(x.dtype)
