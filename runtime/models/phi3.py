"""Phi-3 / Phi-3.5 (``Phi3ForCausalLM``): the Llama block, with q/k/v and gate/up already fused in the
checkpoint, and LongRoPE for the long-context variants (runtime/layers/rotary.py).

The fused tensors are cut back into Llama's names as they stream in, so loading, tensor-parallel sharding and
every kernel are the Llama family's own.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kubellm.runtime.models.config import ModelConfig
from kubellm.runtime.models.llama import LlamaForCausalLM


def unfuse(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """``qkv_proj`` → q/k/v_proj and ``gate_up_proj`` → gate/up_proj (gate first, as Phi3MLP chunks it)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name, tensor in weights:
        if name.endswith(".self_attn.qkv_proj.weight"):
            prefix = name.removesuffix("qkv_proj.weight")
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv]), strict=True):
                yield f"{prefix}{part}.weight", chunk
        elif name.endswith(".mlp.gate_up_proj.weight"):
            prefix = name.removesuffix("gate_up_proj.weight")
            gate, up = tensor.chunk(2)
            yield f"{prefix}gate_proj.weight", gate
            yield f"{prefix}up_proj.weight", up
        else:
            yield name, tensor


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "") -> None:
        super().load_weights(unfuse(weights, self.config), source)
