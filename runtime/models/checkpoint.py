"""What a loader hands the runtime, whatever the file format: config, tensors, tokenizer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import tokenizers
import torch

from kubellm.runtime.layers.checkpoint_error import CheckpointError

__all__ = ["Checkpoint", "CheckpointError"]


@dataclass
class Checkpoint:
    """A model in Hugging Face terms, independent of where it came from (HF folder or GGUF).

    ``config`` is a config.json-style dict (``architectures``, ``hidden_size``, ``num_key_value_heads``,
    ``rope_scaling``, ``tie_word_embeddings``...). ``tensors()`` yields (HF parameter name, tensor)
    pairs lazily so a loader never holds two copies of the weights; names follow transformers'
    ``LlamaForCausalLM`` (``model.layers.0.self_attn.q_proj.weight``...). ``tokenizer_config`` is a
    tokenizer_config.json-style dict (``chat_template``, ``bos_token``, ``eos_token``,
    ``add_bos_token``...).
    """

    config: dict
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    tokenizer: tokenizers.Tokenizer
    tokenizer_config: dict = field(default_factory=dict)
    generation_config: dict = field(default_factory=dict)
    source: str = ""  # path it was read from, for error messages and logs
    # GGUF: tensors() with the decoder linears' quantized blocks as runtime/quantization/gguf.BlockForm instead of
    # dequantized (None: the format has no such form); the loader keeps them packed.
    packed_tensors: Callable[[], Iterator[tuple[str, object]]] | None = None
    # packed_tensors() yields the token embedding packed too (kept so by runtime/layers/quantized_embedding.py).
    packed_embedding: bool = False
