"""A token embedding whose table stays quantized (a GGUF file's Q8_0 ``token_embd``): a lookup dequantizes only
the rows it reads, so the table costs its packed bytes (Q8_0: 1.06 bytes a weight instead of bf16's 2).

The table is a :class:`QuantizedLinear` ``[vocab, hidden]``; a model with tied embeddings uses that same layer
as its LM head, which then computes the logits from the packed form with the layer's GEMM.
"""

from __future__ import annotations

import torch
from torch import nn

from kubellm.runtime.layers.quantized_linear import QuantizedLinear


class QuantizedEmbedding(nn.Module):
    """``ids [...] -> [..., hidden]`` in ``dtype`` (the model's), read from ``table``'s packed rows."""

    def __init__(self, table: QuantizedLinear, dtype: torch.dtype):
        super().__init__()
        self.table, self.dtype = table, dtype
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(input_ids, self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, dtype={str(self.dtype).removeprefix('torch.')}"
