"""A token embedding whose table stays quantized (a GGUF file's Q8_0 ``token_embd``): a lookup dequantizes only
the rows it reads, so the table costs its packed bytes (Q8_0: 1.06 bytes a weight instead of bf16's 2).

The table is a :class:`QuantizedLinear` ``[vocab, hidden]``; a model with tied embeddings uses that same layer
as its LM head, which then computes the logits from the packed form with the layer's GEMM. With tensor
parallelism the table is this rank's vocabulary slice (``VocabParallelEmbedding.quantized_loader``) and a lookup
goes through the same masking and all-reduce as the float embedding (runtime/layers/vocab_parallel.py).
"""

from __future__ import annotations

import torch
from torch import nn

from kubellm.runtime.distributed.tp_group import Group
from kubellm.runtime.layers.quantized_linear import QuantizedLinear
from kubellm.runtime.layers.vocab_parallel import vocab_parallel_lookup


class QuantizedEmbedding(nn.Module):
    """``ids [...] -> [..., hidden]`` in ``dtype`` (the model's), read from ``table``'s packed rows: token ids
    ``vocab_start ..`` of the vocabulary, all of it without tensor parallelism (``tp`` None)."""

    def __init__(self, table: QuantizedLinear, dtype: torch.dtype, vocab_start: int = 0, tp: Group | None = None):
        super().__init__()
        self.table, self.dtype, self.vocab_start, self.tp = table, dtype, vocab_start, tp or Group()
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_lookup(input_ids, lambda ids: self.table.rows(ids, self.dtype), self.vocab_start,
                                     self.num_embeddings, self.tp)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, dtype={str(self.dtype).removeprefix('torch.')}"
