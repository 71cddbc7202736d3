"""The fused elementwise ops a module runs when its ``native`` switch is on, and the RMSNorm that uses them.

A module that can run RMSNorm (with the residual add), rotary embedding, SiLU-and-mul or Qwen3's q/k norm +
rotary through a fused kernel declares two class attributes: ``native = False`` and ``ops = CPU_OPS``.
:func:`use_native_ops` flips every such module of a model at once to kernels/cpu_layer_ops.py, or to
kernels/triton_layer_ops.py on CUDA (the same functions), or back to the PyTorch references.
"""

from __future__ import annotations

import torch
from torch import nn

from kubellm.kernels import cpu_layer_ops

CPU_OPS = cpu_layer_ops  # the default ops module; the fused decode layer (fused_decode.py) runs only these


class RMSNorm(nn.Module):
    """Normalises in float32 like the Hugging Face implementation, then scales in the model dtype.

    With ``residual``, first folds ``x`` into the residual stream: returns ``(norm(residual + x), residual + x)``.
    ``native`` (set by :func:`use_native_ops`) runs the fused kernel of ``ops`` (the CPU module, or the Triton one
    on CUDA), which does both in place.
    """

    native = False
    ops = CPU_OPS  # the fused kernels' module when native

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            if self.native:
                return self.ops.rms_norm(x, self.weight, self.eps)
            return cpu_layer_ops.reference_rms_norm(x, self.weight, self.eps)
        if self.native:
            self.ops.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return cpu_layer_ops.reference_rms_norm(residual, self.weight, self.eps), residual


def on_cpu_ops(*modules: nn.Module) -> bool:
    """Whether every module runs the native CPU ops (what the fused decode layer computes)."""
    return all(m.native and m.ops is CPU_OPS for m in modules)


def use_native_ops(model: nn.Module, enabled: bool, ops_module=CPU_OPS) -> None:
    """Route RMSNorm, rotary and SiLU-and-mul through the fused kernels of ``ops_module`` (kernels/cpu_layer_ops.py,
    or kernels/triton_layer_ops.py on CUDA: same functions) or back to the references: every module whose class
    declares a ``native`` switch."""
    for module in model.modules():
        if isinstance(getattr(type(module), "native", None), bool):
            module.native, module.ops = enabled, ops_module
