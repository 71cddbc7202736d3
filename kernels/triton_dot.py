"""What every kubellm Triton kernel's ``tl.dot`` needs to know about its inputs, decided in one place.

``UPCAST``: tiles go to float32 right after their load. Always for float32 inputs; and for CPU tensors, which
only Triton's interpreter runs (the tests), whose bf16 arithmetic is wrong otherwise. On a GPU, bf16/fp16
tiles go to the tensor cores as they are, with float32 accumulation.
``PRECISION``: float32 dots in IEEE fp32, not TF32, so they match the float32 references.
:func:`cuda_sm_count`: the device's streaming multiprocessors, which the launchers size their grids by.
"""

from __future__ import annotations

import functools

import torch


def dot_options(x: torch.Tensor) -> dict[str, object]:
    """The ``UPCAST`` and ``PRECISION`` constexprs for a kernel whose activations are ``x``."""
    return {"UPCAST": x.device.type == "cpu" or x.dtype == torch.float32,
            "PRECISION": "ieee" if x.dtype == torch.float32 else "tf32"}


@functools.cache
def cuda_sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (read once)."""
    return torch.cuda.get_device_properties(index).multi_processor_count
