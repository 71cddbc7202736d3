"""Architecture (config.json ``architectures``) → model class. A new family is a file under runtime/models/
and a line here; everything else comes with its layers. Built from the tensor-parallel layer types
(runtime/layers/parallel_linear.py: column-, row-parallel, fused q/k/v and gate/up), a family is sharded and
loaded by them: its class only names how checkpoint tensors map onto its parameters
(``packed_modules_mapping``, e.g. Mixtral's ``w1``/``w3`` → parts 0/1 of ``gate_up_proj``). Kernels,
prepacking and quantization replace the same ``nn.Linear`` modules in every family."""

from __future__ import annotations

import importlib

MODEL_CLASSES = {
    "LlamaForCausalLM": "kubellm.runtime.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "kubellm.runtime.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "kubellm.runtime.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "kubellm.runtime.models.qwen3:Qwen3ForCausalLM",
    # Phi-3: the Llama block; its checkpoints store qkv_proj and gate_up_proj fused, which the fused layers load
    # whole (and slice per part with tensor parallelism); LongRoPE comes from the config.
    "Phi3ForCausalLM": "kubellm.runtime.models.llama:LlamaForCausalLM",
    "Qwen3MoeForCausalLM": "kubellm.runtime.models.qwen3_moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "kubellm.runtime.models.mixtral:MixtralForCausalLM",
    "Gemma2ForCausalLM": "kubellm.runtime.models.gemma:GemmaForCausalLM",
    "Gemma3ForCausalLM": "kubellm.runtime.models.gemma:GemmaForCausalLM",
    "Gemma3ForConditionalGeneration": "kubellm.runtime.models.gemma:GemmaForCausalLM",  # the text tower
}


def model_class(architecture: str):
    module, name = MODEL_CLASSES[architecture].split(":")
    return getattr(importlib.import_module(module), name)
