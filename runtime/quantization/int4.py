"""``--quantization int4``: 4-bit weights of the decoder's linear layers, quantized at load.

Asymmetric min-max per output channel and group of 32 inputs (one group per row where 32 does not divide the
input size): values 0..15 with ``w ≈ (q - z) * s``, ``s = (max - min) / 15``, a float zero point ``z = -min / s``,
both kept in float16: 4 bits a weight plus 1 for the group's pair, about 31% of bf16's weight memory. Asymmetric
because 16 levels spread over a group's own range lose less than a symmetric grid around 0 that leaves part of
one side unused; groups of 32 because on the demo model 64 still lost 42% in perplexity (benchmarks/README.md
"Quality", which also says why 32 flatters that model) for 0.5 bits a weight less. The layer is the
:class:`~kubellm.runtime.layers.quantized_linear.QuantizedLinear` 4-bit checkpoints load into (experts' too), so it
computes with their GEMMs: the native kernel (``kernels/cpu_int4_gemm.py``) for bf16 on CPUs with AVX512-BF16
(and AVX2 builds with int8 activations), the Triton grouped GEMM (``kernels/triton_grouped_gemm.py``) on CUDA once
its start-up check passed, else dequantize per call (correct, slow).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kubellm.runtime.layers import kernel_choice
from kubellm.runtime.layers.kernel_choice import KernelChoice
from kubellm.runtime.layers.quantized_linear import QuantizedLinear
from kubellm.runtime.layers.quantized_weight import QuantizedWeight
from kubellm.runtime.quantization.base import QuantizationFormat

INT4_GROUP = 32


@dataclass(frozen=True)
class Int4(QuantizationFormat):
    name = "int4"
    prequantized = False

    symmetric: bool = False
    group_size: int = INT4_GROUP

    def quantize_linear(self, linear: nn.Linear, kernels: KernelChoice | None) -> nn.Module:
        return int4_layer(linear, kernels)


def int4_group(in_features: int) -> int:
    """:data:`INT4_GROUP` where it divides ``in_features``, else one group per row."""
    return INT4_GROUP if in_features % INT4_GROUP == 0 else in_features


def quantize_int4(weight: torch.Tensor, group: int) -> QuantizedWeight:
    """``weight [out, in]`` → values 0..15 ``[out, in]`` (uint8) with a scale and a zero point per output channel
    and group of ``group`` inputs (``[out, in/group]``), asymmetric min-max: ``w ≈ (q - z) * s`` with
    ``s = (max - min) / 15`` and ``z = -min / s``, so each group's 16 levels span exactly its own range. The
    zero point is a float (GGUF Q4_1's free minimum, not AWQ's integer one), and both are rounded to float16
    first and the values computed from the rounded pair, so the layer keeps them in float16 at no extra error;
    where float16 cannot hold one (a near-constant group far from zero), that layer keeps float32."""
    out_features, in_features = weight.shape
    if in_features % 2 or in_features % group:
        raise ValueError(f"int4 needs an even input size divisible by the group ({group}), got {in_features}")
    w = weight.detach().float().view(out_features, in_features // group, group)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    scales = (hi - lo) / 15.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # a constant group: q = 0 is the value
    scales = _fp16_where_exact_enough(scales)
    zeros = _fp16_where_exact_enough(-lo / scales)
    q = torch.round(w / scales[:, :, None] + zeros[:, :, None]).clamp_(0, 15)
    return QuantizedWeight(q.view(out_features, in_features).to(torch.uint8), scales, zeros, group)


def _fp16_where_exact_enough(t: torch.Tensor) -> torch.Tensor:
    """``t`` (float32) rounded to float16 where float16 holds it (finite, not flushed to zero), else as is."""
    half = t.to(torch.float16).float()
    return torch.where(torch.isfinite(half) & ((half != 0) | (t == 0)), half, t)


def int4_layer(linear: nn.Linear, kernels: KernelChoice | None = None):
    """``--quantization int4`` for one layer: :func:`quantize_int4`'s weights in a :class:`QuantizedLinear`, the
    layer every 4-bit checkpoint format loads into, on the GEMM ``kernels`` chose for its shape (native CPU
    kernel, Triton grouped GEMM on CUDA, else dequantize per call); ``auto`` for its device and dtype without."""
    w = linear.weight
    group = int4_group(linear.in_features)
    if kernels is None:
        kernels = kernel_choice.for_quantized_layer(w.device, w.dtype, "int4")
    path = kernels.grouped_path(4, linear.out_features, linear.in_features, group)
    return QuantizedLinear(quantize_int4(w, group), 4, path, None if linear.bias is None else linear.bias.detach(),
                           int8_activations=kernels.int4_activations == "int8")
