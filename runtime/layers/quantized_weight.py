"""The one form every quantized layer is built from, whatever the format that stored it.

Each format's reader (runtime/quantization/<format>.py) turns its stored tensors into a :class:`QuantizedWeight`:
integer (or FP8) values ``[out, in]``, scales and zero points per (output, group of inputs) and an optional input
→ group map. The quantized layers (quantized_linear.py) take it, the tensor-parallel layers slice it
(``output_slice``/``input_slice``: parallel_linear.py, vocab_parallel.py), and :meth:`QuantizedWeight.dequantize`
is the reference every kernel is compared with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantizedWeight:
    """One layer's weights as stored: ``values`` ``[out, in]`` (integers, or fp8), ``scales`` and ``zeros``
    ``[out, groups]`` (zeros None when symmetric around 0), ``g_idx`` ``[in]`` (None: input // group_size)."""

    values: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int
    g_idx: torch.Tensor | None = None

    def groups_of_inputs(self) -> torch.Tensor:
        n = self.values.shape[1]
        if self.g_idx is not None:
            return self.g_idx.long()
        size = n if self.group_size <= 0 else self.group_size
        return torch.arange(n, device=self.values.device) // size

    def output_slice(self, start: int, n: int) -> QuantizedWeight:
        """Outputs ``start .. start + n`` (a column-parallel shard): rows of values, scales and zeros; the
        input → group map is the whole layer's."""
        return QuantizedWeight(self.values.narrow(0, start, n), self.scales.narrow(0, start, n),
                               None if self.zeros is None else self.zeros.narrow(0, start, n), self.group_size,
                               self.g_idx)

    def input_slice(self, start: int, n: int) -> QuantizedWeight:
        """Inputs ``start .. start + n`` (a row-parallel shard). Contiguous groups must not be cut: the slice
        takes whole groups and their scales. With an act-order map the inputs of a group lie anywhere, so the
        slice takes its part of ``g_idx`` and keeps every group's scales (each output row's few group scales;
        the map indexes them as before). One group per output (``group_size`` -1) stays one group."""
        values = self.values.narrow(1, start, n)
        if self.g_idx is not None:
            return QuantizedWeight(values, self.scales, self.zeros, self.group_size, self.g_idx.narrow(0, start, n))
        if self.group_size <= 0:
            return QuantizedWeight(values, self.scales, self.zeros, -1)
        if start % self.group_size or n % self.group_size:
            raise ValueError(f"inputs {start}..{start + n} of each rank cut groups of {self.group_size} inputs")
        g0, groups = start // self.group_size, n // self.group_size
        return QuantizedWeight(values, self.scales.narrow(1, g0, groups),
                               None if self.zeros is None else self.zeros.narrow(1, g0, groups), self.group_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The reference: ``(values - zeros) * scales`` per (output, group of each input), in float32."""
        g = self.groups_of_inputs()
        scale = self.scales.float()[:, g]
        w = self.values.float()
        if self.zeros is not None:
            w = w - self.zeros.float()[:, g]
        return (w * scale).to(dtype)
