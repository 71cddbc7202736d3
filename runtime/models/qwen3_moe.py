"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (per-head q/k norms) with mixture-of-experts MLPs on
the layers ``decoder_sparse_step``/``mlp_only_layers`` select; router weights renormalised when
``norm_topk_prob`` says so. The experts' gate/up/down_proj load through Llama's name mapping."""

from __future__ import annotations

from kubellm.runtime.models.llama import LlamaForCausalLM, moe_mlp
from kubellm.runtime.models.qwen3 import Qwen3Attention


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
    mlp_factory = staticmethod(moe_mlp)
