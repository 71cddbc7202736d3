"""What every quantization format implements (:class:`QuantizationFormat`), and the bit unpacking the packed-integer
checkpoint formats share.

A format is one module of this package (awq.py, gptq.py, compressed_tensors.py, fp8.py, gguf.py, int8.py,
int4.py) with one subclass, listed in registry.py. Two kinds:

* checkpoints quantized elsewhere (``prequantized``): an instance is one checkpoint's settings, made by
  :meth:`QuantizationFormat.from_config` from config.json's ``quantization_config``. The loader
  (loading.py) asks it which tensors one stored linear has (:meth:`tensor_names`) and reads them into the one
  form every quantized layer takes (:meth:`read` → runtime/layers/quantized_weight.py's ``QuantizedWeight``).
  Naming one with ``--quantization`` is a check that the checkpoint is quantized that way.
* weight-only methods applied at load (``--quantization int8|int4``): :meth:`quantize_linear` replaces a
  full-precision ``nn.Linear`` of the decoder layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from kubellm.runtime.layers.quantized_weight import QuantizedWeight

if TYPE_CHECKING:  # the GGUF reader imports its format without the kernel choice's imports
    from kubellm.runtime.layers.kernel_choice import KernelChoice


@dataclass(frozen=True)
class QuantizationFormat:
    """One quantization format; an instance holds one checkpoint's (or one ``--quantization``'s) settings."""

    name: ClassVar[str]  # what --quantization, the kernel choice and the logs call it
    quant_methods: ClassVar[tuple[str, ...]] = ()  # config.json quant_method values from_config reads
    prequantized: ClassVar[bool] = True  # the checkpoint brings the quantized weights (False: quantized at load)
    flag_choice: ClassVar[bool] = True  # a --quantization choice (compressed-tensors is only detected)

    bits: int = 4  # of each stored value (8 for FP8)
    group_size: int = -1  # inputs per scale; -1: one group per output channel
    symmetric: bool = True
    act_order: bool = False  # inputs grouped by a stored map (GPTQ desc_act), not by position
    block: tuple[int, int] | None = None  # FP8 block-wise scales (rows, columns)

    @classmethod
    def from_config(cls, qc: dict, where: str) -> QuantizationFormat:
        """The format a ``quantization_config`` with one of :attr:`quant_methods` declares; a CheckpointError
        naming what is not supported (``where``: `` in <source>`` or empty)."""
        raise NotImplementedError(f"{cls.name} is not read from a checkpoint's config")

    @property
    def float_weights(self) -> bool:
        """Whether the stored values are floats (FP8 e4m3) rather than integers."""
        return False

    def tensor_names(self) -> set[str]:
        """The tensor names' last components one stored linear (or one part of a fused one) must bring."""
        raise NotImplementedError(f"{self.name} does not load from a checkpoint")

    def read(self, tensors: dict) -> tuple[QuantizedWeight, int]:
        """One stored part's tensors (by :meth:`tensor_names`, plus the optional ones the format knows) in the
        layers' form, and the bits of its values. Errors of shape or content raise RuntimeError, IndexError or
        ValueError; the loader names the layer."""
        raise NotImplementedError(f"{self.name} does not load from a checkpoint")

    def check_tensor(self, name: str, tensor: object, where: str) -> None:
        """Refuse a stored tensor this format cannot read (CheckpointError); most formats take what comes."""

    def quantize_linear(self, linear: nn.Linear, kernels: KernelChoice | None) -> nn.Module:
        """``linear``'s replacement for a method applied at load, on the GEMM ``kernels`` chose (``auto`` for its
        device and dtype without)."""
        raise NotImplementedError(f"{self.name} is a checkpoint's format; it does not quantize at load")

    def describe(self) -> str:
        """For the load log: ``awq, 4-bit, act-order``."""
        return f"{self.name}, {self.bits}-bit{', act-order' if self.act_order else ''}"


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[r, c]`` holding 32 / bits values per word along dim 0, low bits first → ``[r * 32 / bits, c]``."""
    per = 32 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    values = (packed.unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << bits) - 1)  # [r, per, c]
    return values.reshape(-1, packed.shape[1])


def unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[r, c]`` holding 32 / bits values per word along dim 1, low bits first → ``[r, c * 32 / bits]``."""
    return unpack_rows(packed.t().contiguous(), bits).t()
