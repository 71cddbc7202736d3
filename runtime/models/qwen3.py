"""Qwen3 (dense): the Llama block with an RMSNorm over each head of q and of k, before rotary; no q/k/v bias.

The norms hold ``head_dim`` weights shared by every head, so tensor parallelism replicates them and each rank
normalises its own heads. With the native (CPU) or Triton layer ops, norms and rotary are one in-place kernel call.
"""

from __future__ import annotations

import torch

from kubellm.runtime.layers.layer_ops import RMSNorm
from kubellm.runtime.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg, rotary, tp):
        super().__init__(cfg, rotary, tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The q/k norms, then rotary (the Llama block calls this right after the qkv projection)."""
        if self.native:
            self.ops.qk_norm_rotary_(positions, q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                self.rotary.cos, self.rotary.sin)
            return q, k
        t = q.shape[0]
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(t, self.num_heads, self.head_dim)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(t, self.num_kv_heads, self.head_dim)
        return super().rotate(positions, q, k)

    def fused_qk_norms(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fused decode layer runs the same native norm + rotary kernel, with the layer's eps (the q/k norms'
        too: both are the config's rms_norm_eps)."""
        return (self.q_norm.weight, self.k_norm.weight) if type(self) is Qwen3Attention else None


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
