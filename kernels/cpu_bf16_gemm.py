"""Dense bf16 linear on CPU: a native kernel (``csrc/bf16_gemm_cpu.cpp``, AVX512-BF16, or AVX2 + FMA) beside its
PyTorch reference.

``y = x @ w.T + bias`` with ``x`` ``[M, K]`` bfloat16, ``w`` ``[N, K]`` bfloat16, ``bias`` ``[N]`` float32, ``y``
``[M, N]`` bfloat16; products exact, sums float32, one rounding at the end. The kernel wants the weight packed
once by :func:`pack` into ``[ceil(N/16), ceil(K/2), 16, 2]`` (per block of 16 output channels and pair of
inputs, the 16 channels' pairs side by side: the vdpbf16ps operand layout, which AVX2 widens to float32 in
registers with a shift and a mask), zero-padded to whole blocks and pairs, so any ``N`` and ``K`` work. The
packed weight is the only copy a layer keeps: :func:`unpack` and :func:`embedding` read rows back out of it (a
tied LM head's embedding lookup). :func:`available` says whether this process's build has the kernel and
:func:`isa` on which instructions it runs.
"""

from __future__ import annotations

import torch

from kubellm.kernels.cpu_extension import available as extension_available

__all__ = ["available", "bf16_linear", "embedding", "isa", "pack", "reference_bf16_linear", "unpack"]


def available() -> bool:
    return extension_available() and bool(torch.ops.kubellm_cpu.bf16_gemm_available())


def isa() -> str:
    """``avx512-bf16``, ``avx2``, or ``""`` where this process has no native bf16 linear."""
    return str(torch.ops.kubellm_cpu.bf16_gemm_isa()) if extension_available() else ""


def pack(w: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` bfloat16 → ``[ceil(N/16), ceil(K/2), 16, 2]``, zeros in the padding."""
    n, k = w.shape
    padded = torch.nn.functional.pad(w.to(torch.bfloat16), (0, -k % 2, 0, -n % 16))
    return padded.view(padded.shape[0] // 16, 16, padded.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The ``[n, k]`` weight :func:`pack` was given (a new tensor)."""
    blocks, pairs = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(blocks * 16, pairs * 2)[:n, :k].contiguous()


def embedding(packed: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows ``ids`` (any shape) of the packed ``[n, k]`` weight: ``[*ids.shape, k]``, what ``F.embedding`` of the
    unpacked weight returns (a gather of ``k / 2`` pairs 64 bytes apart per row)."""
    flat = ids.reshape(-1)
    pairs = packed.view(torch.int32)[flat // 16, :, flat % 16, 0]  # [T, K/2]: one 4-byte load per pair
    return pairs.view(torch.bfloat16)[:, :k].reshape(*ids.shape, k)


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[M, K]`` bfloat16 (any row stride) → ``[M, n]``; ``bias`` float32."""
    return torch.ops.kubellm_cpu.bf16_linear(x, packed, n, bias)


def reference_bf16_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ w.float().T
    return (y if bias is None else y + bias.float()).to(torch.bfloat16)
