"""``--quantization int8``: weight-only int8 of the decoder's linear layers, quantized at load.

Each output channel (weight row) gets one scale, ``max|w| / 127``, and its weights are rounded to int8 in
``[-127, 127]``; activations stay in the model dtype. Weights take about half the memory of bf16 (a quarter of
fp32), which leaves more room for the KV cache. The GEMM, by what runs here (``kernel_choice`` decides):

* bf16 models on CPUs with AVX512-BF16: kubellm's kernel (``kernels/cpu_int8_gemm.py``), which widens the
  int8 weights to bf16 in registers: faster than bf16's prepacked GEMM up to ~64 rows (it reads half the
  bytes), level with it above.
* other CPU cases: PyTorch's int8 weight-only GEMM (``torch._weight_int8pack_mm``) for steps of up to 32
  rows, where it beats dequantizing; larger steps dequantize the weight for the call.
* CUDA: a Triton kernel (``kernels/triton_int8_gemm.py``) that reads the int8 weights and widens them in
  registers for the tensor cores, once its start-up check passed on the device (else dequantize per call).
  Correct on an H200 (the GPU kit, benchmarks/results/), not yet as fast as cuBLAS on the bf16 weight.
* other devices: dequantize per call (correct, the memory saving holds, no speed-up).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kubellm.kernels import cpu_decode_layer, cpu_int8_gemm
from kubellm.runtime.layers import kernel_choice
from kubellm.runtime.layers.kernel_choice import KernelChoice
from kubellm.runtime.quantization.base import QuantizationFormat

# Above this many rows torch's int8 GEMM loses to dequantize-then-GEMM (measured on 2 cores, SmolLM2 shapes).
INT8_GEMM_MAX_ROWS = 32


@dataclass(frozen=True)
class Int8(QuantizationFormat):
    name = "int8"
    prequantized = False

    bits: int = 8

    def quantize_linear(self, linear: nn.Linear, kernels: KernelChoice | None) -> nn.Module:
        return Int8Linear(linear, None if kernels is None else kernels.int8_path(linear.weight))


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` → (int8 ``[out, in]``, float32 scales ``[out]``), symmetric per output channel.
    An all-zero row gets scale 1 (its weights quantize to 0 either way)."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight an int8 layer computes with: ``q * scale`` per row (what reference models are given)."""
    return (q.float() * scales[:, None]).to(dtype)


PATHS = ("native", "triton", "torch", "dequantize")


class Int8Linear(nn.Module):
    """Drop-in for an ``nn.Linear``: int8 weight, one scale per output channel, activations in the model dtype.

    ``qweight`` is the int8 weight, in the native kernel's packed layout when ``path == "native"``. ``path``:
    the engine's :class:`~kubellm.runtime.layers.kernel_choice.KernelChoice` gives it; alone (tests, tools), ``auto``
    for the layer's device and dtype."""

    def __init__(self, linear: nn.Linear, path: str | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scales = quantize_int8(linear.weight)
        w = linear.weight
        self.path = path or kernel_choice.for_quantized_layer(w.device, w.dtype, "int8").int8_path(q)
        if self.path not in PATHS:
            raise ValueError(f"int8 GEMM path {self.path!r}; use one of {', '.join(PATHS)}")
        self.bias = linear.bias
        if self.path in ("native", "triton"):  # float32 scales and bias, applied before the output is rounded
            self.register_buffer("qweight", cpu_int8_gemm.pack(q) if self.path == "native" else q.contiguous())
            self.register_buffer("scales", scales)
            self.bias_f32 = None if linear.bias is None else linear.bias.detach().float().contiguous()
        else:
            self.register_buffer("qweight", q.contiguous())
            self.register_buffer("scales", scales.to(linear.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.path == "native" and x.dtype == torch.bfloat16:
            out = cpu_int8_gemm.int8_gemm(rows if rows.stride(-1) == 1 else rows.contiguous(), self.qweight,
                                          self.scales, self.bias_f32)
            return out.view(*x.shape[:-1], self.out_features)
        if self.path == "triton":
            from kubellm.kernels import triton_int8_gemm

            out = triton_int8_gemm.int8_gemm(rows, self.qweight, self.scales, self.bias_f32)
            return out.view(*x.shape[:-1], self.out_features)
        if self.path == "torch" and x.dtype == self.scales.dtype and rows.shape[0] <= INT8_GEMM_MAX_ROWS:
            out = torch._weight_int8pack_mm(rows.contiguous(), self.qweight, self.scales)
            out = out.view(*x.shape[:-1], self.out_features)
        else:
            out = nn.functional.linear(x, self.dequantized(x.dtype))
        return out if self.bias is None else out + self.bias

    def fused_decode_linear(self) -> tuple | None:
        """This layer's arguments of the fused decode layer (runtime/layers/fused_decode.py) on the native path:
        what :meth:`forward` hands ``cpu_int8_gemm.int8_gemm`` on bfloat16 rows (the bias in float32); else None."""
        if self.path != "native":
            return None
        return cpu_decode_layer.INT8, self.qweight, self.scales, None, 0, False, self.bias_f32

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of the int8 values and their scales (the load log's accounting; the bias is a parameter)."""
        scales = str(self.scales.dtype).removeprefix("torch.")
        return {"int8": self.qweight.numel(), scales: self.scales.numel() * self.scales.element_size()}

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The ``[out, in]`` weight this layer computes with."""
        q = self.qweight
        if self.path == "native":  # [N/16, K/2, 16, 2] -> [N, K]
            q = q.permute(0, 2, 1, 3).reshape(self.out_features, self.in_features)
        return q.to(dtype) * self.scales[:, None].to(dtype)
