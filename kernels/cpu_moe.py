"""A mixture-of-experts MLP's routing and experts on CPU in one call per layer: a native kernel
(``csrc/moe_cpu.cpp``, AVX512-BF16) beside its PyTorch reference.

Routing as the PyTorch path does it (runtime/layers/moe.py ``route``): softmax of the router ``logits``
``[T, E]`` in float32, the ``top_k`` largest, rescaled to sum to 1 when ``renormalize``. Then
``out[t] = sum_j w[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t]))`` with ``e`` the token's j-th expert:
``x`` ``[T, H]`` bfloat16, ``gate_up`` ``[E, 2I, H]`` (each expert's gate rows, then its up rows), ``down``
``[E, H, I]``; ``out`` ``[T, H]`` bfloat16. Intermediate results are rounded to bfloat16 where the per-expert
PyTorch path rounds them (the gate and up outputs, silu, the product, the down output and the router weight);
the k weighted outputs are summed in float32.

The kernel wants the weights packed once by :func:`pack` (``I`` and ``H`` multiples of 16). It exists only in
builds for CPUs with AVX512-BF16; :func:`available` says whether this process has it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kubellm.kernels.cpu_extension import available as extension_available

__all__ = ["available", "moe_experts", "pack", "packable", "reference_moe_experts"]


def available() -> bool:
    return extension_available() and bool(torch.ops.kubellm_cpu.moe_experts_available())


def packable(hidden: int, inter: int, dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and hidden % 16 == 0 and inter % 16 == 0


def pack(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_up`` ``[E, 2I, H]`` → ``w13`` ``[E, I/16, 2, H/2, 16, 2]`` (per block of 16 intermediate channels
    the gate block, then the up block); ``down`` ``[E, H, I]`` → ``w2`` ``[E, H/16, I/2, 16, 2]``. Each block
    holds, per input pair (k, k+1), its 16 channels' pairs side by side: the operand order of vdpbf16ps."""
    e, two_i, h = gate_up.shape
    i = two_i // 2
    w13 = gate_up.reshape(e, 2, i // 16, 16, h // 2, 2).permute(0, 2, 1, 4, 3, 5).contiguous()
    w2 = down.reshape(e, h // 16, 16, i // 2, 2).permute(0, 1, 3, 2, 4).contiguous()
    return w13, w2


def moe_experts(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                renormalize: bool) -> torch.Tensor:
    return torch.ops.kubellm_cpu.moe_experts(x.contiguous(), logits, w13, w2, top_k, renormalize)


def reference_moe_experts(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                          top_k: int, renormalize: bool) -> torch.Tensor:
    """The same result from unpacked weights, one expert at a time."""
    weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    inter = gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        tokens, choice = (ids == e).nonzero(as_tuple=True)
        gate, up = F.linear(x[tokens], gate_up[e]).split(inter, dim=-1)
        h = (F.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype)
        y = F.linear(h, down[e]).float() * weights[tokens, choice].to(x.dtype).float().unsqueeze(1)
        out.index_add_(0, tokens, y)
    return out.to(x.dtype)
