"""compressed-tensors checkpoints (llm-compressor; ``quant_method: compressed-tensors``): ``pack-quantized``
integer weights (W4A16, W8A16) here, ``float-quantized`` FP8 weights read as fp8.py's format.

One ``pack-quantized`` linear stores ``weight_packed`` int32 ``[out, in * bits / 32]`` densely packed along the
input dimension from the low bits, values offset by 2^(bits-1); ``weight_scale`` ``[out, groups]`` (group
strategy) or ``[out, 1]`` (channel); ``weight_zero_point`` when asymmetric; ``weight_shape`` the original
``[out, in]``; ``weight_g_idx`` with ``actorder: group``. One config group, weights only (activations of
integer formats stay in the model dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kubellm.runtime.layers.checkpoint_error import CheckpointError
from kubellm.runtime.layers.quantized_weight import QuantizedWeight
from kubellm.runtime.quantization.base import QuantizationFormat, unpack_cols, unpack_rows
from kubellm.runtime.quantization.fp8 import FP8


@dataclass(frozen=True)
class CompressedTensors(QuantizationFormat):
    name = "compressed-tensors"
    quant_methods = ("compressed-tensors",)
    flag_choice = False  # served as stored with --quantization none

    @classmethod
    def from_config(cls, qc: dict, where: str) -> QuantizationFormat:
        groups = list((qc.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise CheckpointError(f"compressed-tensors with {len(groups)} config groups{where} is not supported (one)")
        weights = groups[0].get("weights") or {}
        fmt = qc.get("format")
        if groups[0].get("input_activations") and fmt != "float-quantized":
            raise CheckpointError(f"compressed-tensors format {fmt!r} with quantized activations{where} is not "
                                  "supported")
        if fmt == "float-quantized":
            if weights.get("type") != "float" or weights.get("num_bits") != 8:
                raise CheckpointError(f"compressed-tensors float-quantized weights must be fp8{where}")
            block = weights.get("block_structure")
            return FP8(block=tuple(block) if block else None)
        if fmt != "pack-quantized":
            raise CheckpointError(f"compressed-tensors format {fmt!r}{where} is not supported (pack-quantized, "
                                  "float-quantized)")
        strategy = weights.get("strategy")
        if strategy not in ("group", "channel"):
            raise CheckpointError(f"compressed-tensors strategy {strategy!r}{where} is not supported (group, channel)")
        return cls(int(weights["num_bits"]), int(weights.get("group_size") or -1) if strategy == "group" else -1,
                   symmetric=bool(weights.get("symmetric", True)), act_order=weights.get("actorder") == "group")

    def tensor_names(self) -> set[str]:
        return ({"weight_packed", "weight_scale", "weight_shape"} | (set() if self.symmetric else
                {"weight_zero_point"}) | ({"weight_g_idx"} if self.act_order else set()))

    def read(self, tensors: dict) -> tuple[QuantizedWeight, int]:
        return read_compressed(tensors["weight_packed"], tensors["weight_scale"], tensors["weight_shape"].tolist(),
                               self.bits, self.group_size, tensors.get("weight_zero_point"),
                               tensors.get("weight_g_idx")), self.bits


def read_compressed(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor | tuple, bits: int,
                    group_size: int, zero_point: torch.Tensor | None = None,
                    g_idx: torch.Tensor | None = None) -> QuantizedWeight:
    out_features, in_features = (int(x) for x in shape)
    offset = 1 << (bits - 1)
    values = unpack_cols(packed, bits)[:, :in_features] - offset
    if zero_point is not None and zero_point.dtype == torch.int32:  # packed along the output dimension
        zero_point = unpack_rows(zero_point, bits)[:out_features] - offset
    return QuantizedWeight(values.to(torch.int8), scale, zero_point, group_size, g_idx)
