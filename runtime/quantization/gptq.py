"""GPTQ v1 checkpoints (AutoGPTQ, GPTQModel, optimum; ``quant_method: gptq``), 4 and 8 bits.

One linear of ``out`` x ``in`` weights stores ``qweight`` int32 ``[in * bits / 32, out]``, packed along the input
dimension in order; ``qzeros`` int32 ``[groups, out * bits / 32]`` packed along the output dimension, each stored
as zero - 1 (v1's convention); ``scales`` ``[groups, out]``; ``g_idx`` ``[in]`` maps each input to its group
(act-order / ``desc_act`` permutes it; without it group = input // group_size). Symmetric checkpoints store the
zero 2^(bits-1) as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kubellm.runtime.layers.checkpoint_error import CheckpointError
from kubellm.runtime.layers.quantized_weight import QuantizedWeight
from kubellm.runtime.quantization.base import QuantizationFormat, unpack_cols, unpack_rows


@dataclass(frozen=True)
class GPTQ(QuantizationFormat):
    name = "gptq"
    quant_methods = ("gptq",)

    @classmethod
    def from_config(cls, qc: dict, where: str) -> GPTQ:
        bits = int(qc.get("bits", 4))
        if bits not in (4, 8):
            raise CheckpointError(f"GPTQ with {bits} bits{where} is not supported (4 or 8)")
        if qc.get("checkpoint_format", "gptq") not in ("gptq", None):
            raise CheckpointError(f"GPTQ checkpoint format {qc.get('checkpoint_format')!r}{where} is not supported "
                                  "(the v1 'gptq' layout)")
        return cls(bits, int(qc.get("group_size", 128)), symmetric=bool(qc.get("sym", True)),
                   act_order=bool(qc.get("desc_act", False)))

    def tensor_names(self) -> set[str]:
        return {"qweight", "qzeros", "scales"} | ({"g_idx"} if self.act_order else set())

    def read(self, tensors: dict) -> tuple[QuantizedWeight, int]:
        return read_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors.get("g_idx"), self.bits,
                         self.group_size), self.bits


def read_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
              bits: int, group_size: int) -> QuantizedWeight:
    values = unpack_rows(qweight, bits)  # [in, out]
    zeros = unpack_cols(qzeros, bits) + 1  # v1 stores zero - 1
    n_in = values.shape[0]
    if g_idx is not None and torch.equal(g_idx.long(), torch.arange(n_in) // (group_size if group_size > 0 else n_in)):
        g_idx = None  # the trivial map: keep groups contiguous (the fast path)
    return QuantizedWeight(values.t().contiguous(), scales.t().contiguous(), zeros.t().contiguous(), group_size,
                           None if g_idx is None else g_idx.to(torch.int32))
