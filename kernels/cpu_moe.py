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

:func:`moe_quantized_experts` is the same for experts of 4-bit or 8-bit values with per-group scales and
(optional for 8-bit) zero points, ``W = (q - z) * s`` per group of inputs, each linear in its own width: each
expert's ``gate_up`` and ``down`` as kernels/cpu_int4_gemm.py (4-bit: AWQ, GPTQ, W4A16, ``--quantization
int4``, GGUF Q4_0/Q4_1/Q4_K) or kernels/cpu_grouped_int8_gemm.py (8-bit: GPTQ 8-bit, W8A16, GGUF Q8_0/Q5_K/Q6_K)
packs it, stacked over the experts (:class:`QuantizedExperts`; a GGUF Q4_K_M layer is 4-bit gate/up beside a
6-bit down). The products use the stored values widened in registers (those GEMMs' few-rows tiles, at every row
count), and the results are rounded where the per-expert path rounds them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kubellm.kernels import cpu_grouped_int8_gemm, cpu_int4_gemm
from kubellm.kernels.cpu_extension import available as extension_available

__all__ = ["QuantizedExperts", "available", "block_params", "moe_experts", "moe_quantized_experts", "pack", "packable",
           "quantized_packable", "reference_moe_experts", "reference_quantized_moe_experts", "table_low", "unpack"]


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


def unpack(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack`: ``(gate_up [E, 2I, H], down [E, H, I])`` (for the references)."""
    e, i16, _, h2 = w13.shape[:4]
    gate_up = w13.permute(0, 2, 1, 4, 3, 5).reshape(e, 2 * i16 * 16, 2 * h2)
    down = w2.permute(0, 1, 3, 2, 4).reshape(e, w2.shape[1] * 16, 2 * w2.shape[2])
    return gate_up, down


def moe_experts(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                renormalize: bool) -> torch.Tensor:
    return torch.ops.kubellm_cpu.moe_experts(x.contiguous(), logits, w13, w2, top_k, renormalize)


class QuantizedExperts(NamedTuple):
    """A layer's quantized experts, stacked: per linear every expert's packed values (4-bit as cpu_int4_gemm packs
    them, uint8 ``w13`` ``[E, 2I/16, H/4, 16, 2]``, ``w2`` ``[E, H/16, I/4, 16, 2]``; 8-bit as
    cpu_grouped_int8_gemm does, int8 ``[E, 2I/16, H/2, 16, 2]`` and ``[E, H/16, I/2, 16, 2]``; gate rows then up
    rows), the scales and zero points ``[E, outputs / 16, inputs / group, 16]`` (:func:`block_params` of the
    GEMMs' ``[inputs / group, outputs]``; float32 or float16, in the values' range as those GEMMs read them; zero
    points None: symmetric 8-bit values) and the group size; ``low13``/``low2``
    (:func:`table_low`) where a linear's 8-bit values lie within 64 consecutive ones, which the kernel then widens
    by a table (GGUF Q6_K, Q5_K)."""

    w13: torch.Tensor
    s13: torch.Tensor
    z13: torch.Tensor | None
    group13: int
    w2: torch.Tensor
    s2: torch.Tensor
    z2: torch.Tensor | None
    group2: int
    low13: int | None = None
    low2: int | None = None

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up [E, 2I, H], down [E, H, I])`` in float32: the reference's weights."""
        def linear(packed, scales, zeros, group):
            unpack = cpu_int4_gemm.unpack if packed.dtype == torch.uint8 else cpu_grouped_int8_gemm.unpack
            q = torch.stack([unpack(p) for p in packed]).float()  # [E, N, K]
            g = torch.arange(q.shape[2]) // group
            def per_input(params):  # [E, N/16, groups, 16] -> [E, N, K]
                return params.float().transpose(1, 2).flatten(2).transpose(1, 2)[:, :, g]
            w = q if zeros is None else q - per_input(zeros)
            return w * per_input(scales)
        return linear(self.w13, self.s13, self.z13, self.group13), linear(self.w2, self.s2, self.z2, self.group2)


def block_params(t: torch.Tensor) -> torch.Tensor:
    """Scales or zero points ``[..., groups, N]`` (the GEMMs' order) → ``[..., N/16, groups, 16]``: per block of 16
    channels its groups one after another, so that a work item of the kernel reads them as one stream."""
    return t.unflatten(-1, (t.shape[-1] // 16, 16)).transpose(-3, -2).contiguous()


def table_low(packed: torch.Tensor) -> int | None:
    """For 8-bit values (int8) that lie within ``[low, low + 63]``, ``low`` (the least of them, at most 64); else
    None (4-bit values, or wider 8-bit ones)."""
    if packed.dtype != torch.int8 or packed.numel() == 0:
        return None
    low, high = int(packed.min()), int(packed.max())
    return min(low, 64) if high - min(low, 64) < 64 else None


def quantized_packable(hidden: int, inter: int, linears: tuple[tuple[int, int], tuple[int, int]]) -> bool:
    """Whether the kernel takes experts of these sizes whose gate/up and down have ``(bits, group size)``
    ``linears`` (4 or 8 bits: 5..8-bit values are int8)."""
    return hidden % 16 == 0 and inter % 16 == 0 and all(
        bits in (4, 8) and g % (4 if bits == 4 else 2) == 0 and k % g == 0
        for (bits, g), k in zip(linears, (hidden, inter), strict=True))


def moe_quantized_experts(x: torch.Tensor, logits: torch.Tensor, experts: QuantizedExperts, top_k: int,
                          renormalize: bool) -> torch.Tensor:
    return torch.ops.kubellm_cpu.moe_quantized_experts(x.contiguous(), logits, *experts, top_k, renormalize)


def reference_quantized_moe_experts(x: torch.Tensor, logits: torch.Tensor, experts: QuantizedExperts, top_k: int,
                                    renormalize: bool) -> torch.Tensor:
    """The same result from the dequantized weights in float32, one expert at a time."""
    return reference_moe_experts(x, logits, *experts.dequantized(), top_k, renormalize)


def reference_moe_experts(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                          top_k: int, renormalize: bool) -> torch.Tensor:
    """The same result from unpacked weights (bfloat16, or float32 for :func:`reference_quantized_moe_experts`), one
    expert at a time."""
    weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    inter = gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        tokens, choice = (ids == e).nonzero(as_tuple=True)
        # Products in float32 (bfloat16 weights: as exact as a bf16 GEMM), each linear's output rounded to x's dtype.
        gate, up = F.linear(x[tokens].float(), gate_up[e].float()).to(x.dtype).split(inter, dim=-1)
        h = (F.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype)
        y = F.linear(h.float(), down[e].float()).to(x.dtype).float() * weights[tokens, choice].to(x.dtype).float().unsqueeze(1)
        out.index_add_(0, tokens, y)
    return out.to(x.dtype)
