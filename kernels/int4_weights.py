"""Packed 4-bit weights, two per byte along the input dimension: the form a ``QuantizedLinear``
(runtime/layers/quantized_linear.py) keeps 4-bit values in where no kernel packs them its own way. Torch only.

``packed[n, j]`` holds ``q[n, 2j]`` in its low nibble and ``q[n, 2j + 1]`` in its high one.
"""

from __future__ import annotations

import torch

__all__ = ["pack_int4"]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` integers in ``[-8, 7]`` or ``0..15`` (K even; their low four bits) → ``[N, K/2]`` uint8, even
    inputs in the low nibbles."""
    q = q.to(torch.int16)
    return ((q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)).to(torch.uint8)
