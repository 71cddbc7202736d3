"""What every kubellm Triton kernel's ``tl.dot`` needs to know about its inputs, decided in one place.

``UPCAST``: tiles go to float32 right after their load. Always for float32 inputs; and for CPU tensors, which
only Triton's interpreter runs (the tests), whose bf16 arithmetic is wrong otherwise. On a GPU, bf16/fp16
tiles go to the tensor cores as they are, with float32 accumulation.
``PRECISION``: float32 dots in IEEE fp32, not TF32, so they match the float32 references.
"""

from __future__ import annotations

import torch


def dot_options(x: torch.Tensor) -> dict[str, object]:
    """The ``UPCAST`` and ``PRECISION`` constexprs for a kernel whose activations are ``x``."""
    return {"UPCAST": x.device.type == "cpu" or x.dtype == torch.float32,
            "PRECISION": "ieee" if x.dtype == torch.float32 else "tf32"}
