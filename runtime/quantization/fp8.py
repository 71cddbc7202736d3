"""FP8 checkpoints (``quant_method: fp8``, and compressed-tensors' ``float-quantized``, which reads into this).

One linear stores its e4m3 ``weight`` ``[out, in]`` with ``weight_scale`` per tensor or per output channel, or
``weight_scale_inv`` per 128 x 128 block (DeepSeek, Qwen3-FP8; filed as ``weight_scale`` by the loader).
Static activation scales (``input_scale``) are dropped: activations stay in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kubellm.runtime.layers.quantized_weight import QuantizedWeight
from kubellm.runtime.quantization.base import QuantizationFormat


@dataclass(frozen=True)
class FP8(QuantizationFormat):
    name = "fp8"
    quant_methods = ("fp8",)

    bits: int = 8

    @classmethod
    def from_config(cls, qc: dict, where: str) -> FP8:
        block = qc.get("weight_block_size")
        return cls(block=tuple(block) if block else None)

    @property
    def float_weights(self) -> bool:
        return True

    def tensor_names(self) -> set[str]:
        return {"weight", "weight_scale"}

    def read(self, tensors: dict) -> tuple[QuantizedWeight, int]:
        return fp8_weight(tensors["weight"], tensors["weight_scale"], self.block), self.bits


def fp8_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> QuantizedWeight:
    """FP8 e4m3 ``weight [out, in]`` and its scale (per tensor, per output channel, or per block of
    ``block`` = (rows, columns)) as a :class:`QuantizedWeight`: one scale per (output, group of ``columns``
    inputs) for blocks, per output otherwise, so fused parts concatenate whatever their sizes."""
    out_features = weight.shape[0]
    s = scale.float()
    if block is not None:
        rows, cols = block
        return QuantizedWeight(weight, s.repeat_interleave(rows, 0)[:out_features].contiguous(), None, cols)
    if s.numel() == 1:
        s = s.reshape(1, 1).expand(out_features, 1)
    return QuantizedWeight(weight, s.reshape(out_features, 1).contiguous(), None, -1)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e4m3 weight ``[out, in]`` times its scale: a scalar, ``[out]``/``[out, 1]``, or one per block (the
    reference the FP8 kernels are compared with)."""
    w = weight.float()
    s = scale.float()
    if block is not None:
        rows, cols = block
        s = s.repeat_interleave(rows, 0)[: w.shape[0]].repeat_interleave(cols, 1)[:, : w.shape[1]]
    elif s.dim() == 1 and s.numel() == w.shape[0] and s.numel() > 1:
        s = s.unsqueeze(1)
    return (w * s).to(dtype)
