"""Packed signed int4 weights (two per byte along the input dimension) and the plain-PyTorch int4 GEMM that
the Triton kernel (``kernels/triton_int4_gemm.py``) must equal. Torch only: importable without triton.

``packed[n, j]`` holds ``q[n, 2j]`` in its low nibble and ``q[n, 2j + 1]`` in its high one, each a two's
complement value in ``[-8, 7]``; ``W[n, k] = q[n, k] * scales[n, k // group]``.
"""

from __future__ import annotations

import torch

__all__ = ["dequantize_int4", "pack_int4", "reference_int4_gemm", "unpack_int4"]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` integers in ``[-8, 7]`` or ``0..15`` (K even; their low four bits) → ``[N, K/2]`` uint8, even
    inputs in the low nibbles."""
    q = q.to(torch.int16)
    return ((q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``[N, K/2]`` uint8 → ``[N, K]`` int8 in ``[-8, 7]``."""
    wide = packed.to(torch.int16)
    low = (wide & 0xF) - ((wide & 0x8) << 1)
    high = (wide >> 4) - ((wide & 0x80) >> 3)
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1).to(torch.int8)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, group: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[N, K]`` weight the packed nibbles and their group scales stand for."""
    return (unpack_int4(packed).float() * scales.repeat_interleave(group, dim=1)).to(dtype)


def reference_int4_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` in float32 (dequantizes the whole weight: tests and checks only)."""
    y = x.float() @ dequantize_int4(packed, scales, group).T
    return (y if bias is None else y + bias).to(x.dtype)
