"""Causal prefill attention on CPU: a native C++ kernel (``csrc/prefill_attention_cpu.cpp``, part of the CPU
extension) beside a PyTorch reference.

One sequence's chunk: ``q`` ``[T, H, D]`` are the last ``T`` positions of a context whose keys and values are
``k``/``v`` ``[S, KVH, D]`` (``S >= T``; ``S == T`` for a whole prompt). Query ``t`` attends keys
``0 .. S - T + t`` (the last ``window`` of them with a sliding window); query head ``h`` reads kv head ``h // (H // KVH)``. Rows and heads may be strided views
(the fused qkv projection's output), ``head_dim`` contiguous. Returns ``[T, H, D]`` in ``q``'s dtype; scores,
softmax and accumulation are float32.
"""

from __future__ import annotations

import torch

from kubellm.kernels.cpu_extension import available

__all__ = ["available", "prefill_attention", "reference_prefill_attention"]


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                      window: int | None = None, softcap: float | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """``window``: query p sees keys (p - window, p] only (sliding-window layers); ``softcap``: scores become
    ``softcap * tanh(score / softcap)`` (scores include ``scale``). ``out`` (contiguous ``[T, H, D]``, q's dtype,
    e.g. this chunk's rows of the step's output): written and returned instead of a new tensor."""
    if out is None:
        return torch.ops.kubellm_cpu.prefill_attention(q, k, v, float(scale), window or 0, float(softcap or 0.0))
    torch.ops.kubellm_cpu.prefill_attention_out(q, k, v, float(scale), window or 0, float(softcap or 0.0), out)
    return out


def reference_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                                window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """The same math in plain float32 PyTorch (materialises the [H, T, S] scores: tests only)."""
    t, h, _ = q.shape
    s, kvh, _ = k.shape
    group = h // kvh
    qf = q.float().transpose(0, 1)  # [H, T, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = qf @ kf.transpose(1, 2) * scale  # [H, T, S]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    key = torch.arange(s, device=q.device)[None, :]
    query = (s - t + torch.arange(t, device=q.device))[:, None]
    visible = key <= query
    if window:
        visible &= key > query - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ vf).transpose(0, 1).to(q.dtype)
