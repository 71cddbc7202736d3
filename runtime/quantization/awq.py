"""AWQ checkpoints (AutoAWQ, llm-compressor's AWQ export; ``quant_method: awq``), GEMM layout only.

One linear of ``out`` x ``in`` weights stores ``qweight`` int32 ``[in, out / 8]``, eight 4-bit values per word in
AWQ's interleaved order (word bits 4i..4i+3 hold column ``AWQ_ORDER[i]`` of the eight); ``qzeros`` int32
``[in / group, out / 8]`` packed the same way; ``scales`` ``[in / group, out]``. Always asymmetric.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kubellm.runtime.layers.checkpoint_error import CheckpointError
from kubellm.runtime.layers.quantized_weight import QuantizedWeight
from kubellm.runtime.quantization.base import QuantizationFormat, unpack_cols

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # word nibble i holds column AWQ_ORDER[i] of its eight


@dataclass(frozen=True)
class AWQ(QuantizationFormat):
    name = "awq"
    quant_methods = ("awq",)

    @classmethod
    def from_config(cls, qc: dict, where: str) -> AWQ:
        if (qc.get("version") or "gemm").lower() != "gemm":
            raise CheckpointError(f"AWQ version {qc.get('version')!r}{where} is not supported (GEMM only)")
        return cls(int(qc.get("bits") or qc.get("w_bit") or 4), int(qc.get("group_size") or qc.get("q_group_size")
                   or 128), symmetric=not qc.get("zero_point", True))

    def tensor_names(self) -> set[str]:
        return {"qweight", "qzeros", "scales"}

    def read(self, tensors: dict) -> tuple[QuantizedWeight, int]:
        return read_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], self.group_size), self.bits


def read_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> QuantizedWeight:
    reverse = torch.tensor([AWQ_ORDER.index(j) for j in range(8)], device=qweight.device)

    def unpack(packed: torch.Tensor) -> torch.Tensor:  # [r, c / 8] → [r, c] in column order
        nibbles = unpack_cols(packed, 4).view(packed.shape[0], -1, 8)  # word nibble i of each word
        return nibbles[:, :, reverse].reshape(packed.shape[0], -1)

    return QuantizedWeight(unpack(qweight).t().contiguous(), scales.t().contiguous(), unpack(qzeros).t().contiguous(),
                           group_size)
