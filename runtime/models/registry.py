"""Architecture (config.json ``architectures``) → model class. A new family is a file under runtime/models/
and a line here; everything else (loading, tensor parallelism, kernels, quantization) comes with its layers."""

from __future__ import annotations

import importlib

MODEL_CLASSES = {
    "LlamaForCausalLM": "kubellm.runtime.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "kubellm.runtime.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "kubellm.runtime.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "kubellm.runtime.models.qwen3:Qwen3ForCausalLM",
    "Phi3ForCausalLM": "kubellm.runtime.models.phi3:Phi3ForCausalLM",
    "Qwen3MoeForCausalLM": "kubellm.runtime.models.qwen3_moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "kubellm.runtime.models.mixtral:MixtralForCausalLM",
    "Gemma2ForCausalLM": "kubellm.runtime.models.gemma:GemmaForCausalLM",
    "Gemma3ForCausalLM": "kubellm.runtime.models.gemma:GemmaForCausalLM",
    "Gemma3ForConditionalGeneration": "kubellm.runtime.models.gemma:GemmaForCausalLM",  # the text tower
}


def model_class(architecture: str):
    module, name = MODEL_CLASSES[architecture].split(":")
    return getattr(importlib.import_module(module), name)
