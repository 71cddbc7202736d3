"""Fused elementwise layer ops on CPU (RMSNorm, residual add + RMSNorm, SiLU-and-mul, rotary embedding):
native C++ kernels (``csrc/layer_ops_cpu.cpp``, built with the rest of the CPU extension) beside PyTorch
references of the same math.

Contract, all tensors in the model dtype (float32, bfloat16 or float16), rows = tokens:

* ``rms_norm(x [T, H], w [H], eps)`` → ``w * dtype(x * rsqrt(mean(x², -1) + eps))``, normalised in float32.
* ``add_rms_norm_(x, residual, w, eps)``: ``residual ← residual + x``, then ``x ← rms_norm(residual)``, both in
  place (what every layer after the first does: fold the previous sublayer's output into the residual stream).
* ``silu_and_mul(gate_up [T, 2I])`` → ``silu(gate) * up`` ``[T, I]``.
* ``rotary_embedding_(positions [T] int64, q [T, H, D], k [T, KVH, D], cos, sin [P, D])``: rotate-half
  rotary embedding, in place (q/k may be strided views into the fused qkv projection).
* ``qk_norm_rotary_(positions, q, k, q_weight [D], k_weight [D], eps, cos, sin)``: Qwen3's RMSNorm over each
  head of q and of k, then the rotary embedding, in place: one call where the model made five (two norms, each
  copying its strided view, and the rotary kernel).

The kernels round every intermediate the references round to the model dtype, at the same point, so outputs
agree bit for bit but for the last float32 ulp of the references' reductions and exp (see the tests for the
tolerances). :func:`available` is :func:`kubellm.kernels.cpu_extension.available`.
"""

from __future__ import annotations

import torch

from kubellm.kernels.cpu_extension import available

__all__ = [
    "available", "rms_norm", "add_rms_norm_", "silu_and_mul", "rotary_embedding_", "qk_norm_rotary_",
    "reference_rms_norm", "reference_add_rms_norm_", "reference_silu_and_mul", "reference_rotary_embedding_",
    "reference_qk_norm_rotary_",
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.kubellm_cpu.rms_norm(x, weight, eps)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    torch.ops.kubellm_cpu.add_rms_norm_(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return torch.ops.kubellm_cpu.silu_and_mul(gate_up)


def rotary_embedding_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> None:
    torch.ops.kubellm_cpu.rotary_embedding_(positions, q, k, cos, sin)


def qk_norm_rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                    k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> None:
    torch.ops.kubellm_cpu.qk_norm_rotary_(positions, q, k, q_weight, k_weight, eps, cos, sin)


# ---- references (plain PyTorch, any device) -----------------------------------------------------------------
def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def reference_add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    residual.add_(x)
    x.copy_(reference_rms_norm(residual, weight, eps))


def reference_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference_rotary_embedding_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                                sin: torch.Tensor) -> None:
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    q.copy_(q * c + _rotate_half(q) * s)
    k.copy_(k * c + _rotate_half(k) * s)


def reference_qk_norm_rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                              k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> None:
    q.copy_(reference_rms_norm(q, q_weight, eps))  # the norm is over the last dim: each head of each token
    k.copy_(reference_rms_norm(k, k_weight, eps))
    reference_rotary_embedding_(positions, q, k, cos, sin)
