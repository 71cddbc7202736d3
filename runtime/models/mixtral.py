"""Mixtral (``MixtralForCausalLM``): Mistral's attention with a mixture of experts in every layer
(``block_sparse_moe``, experts ``w1`` gate, ``w3`` up, ``w2`` down); router weights always renormalised."""

from __future__ import annotations

from kubellm.runtime.layers.moe import ExpertLoading, moe_mlp
from kubellm.runtime.models.llama import LlamaForCausalLM


class MixtralForCausalLM(ExpertLoading, LlamaForCausalLM):
    moe_block = "block_sparse_moe"
    moe_parts = {"w1": "gate", "w3": "up", "w2": "down"}
    mlp_factory = staticmethod(moe_mlp)
