"""Mixtral (``MixtralForCausalLM``): Mistral's attention with a mixture of experts in every layer
(``block_sparse_moe``, experts ``w1`` gate, ``w3`` up, ``w2`` down); router weights always renormalised."""

from __future__ import annotations

from kubellm.runtime.models.llama import LlamaForCausalLM, moe_mlp


class MixtralForCausalLM(LlamaForCausalLM):
    mlp_factory = staticmethod(moe_mlp)
    packed_modules_mapping = {
        **LlamaForCausalLM.packed_modules_mapping,
        "block_sparse_moe": ("mlp", None), "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None),
    }
