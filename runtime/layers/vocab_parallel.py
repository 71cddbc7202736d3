"""The embedding and the LM head split over the vocabulary: each rank holds a contiguous slice of the rows.

With tensor parallelism every rank holds ``rows = round_up(ceil(vocab / N), PAD)`` rows, rank r the token ids
``r * rows ..``; the last rank's slice runs past the vocabulary and those rows stay zero. (Without it the
layers hold the vocabulary as is, unpadded.) A token's embedding lives on one rank: each rank looks up the
ids in its slice, writes zeros for the others, and the all-reduce sums the one real row per token into every
rank. The LM head computes this rank's slice of the logits; :func:`gather_logits` (called by the model's
``compute_logits``, not by the layer, since prepacking swaps the layer for a drop-in) concatenates the ranks'
slices and drops the padding. Tied embeddings share one parameter, as the two layers shard alike.

A GGUF token embedding kept packed (runtime/layers/quantized_embedding.py) shards the same way:
:meth:`VocabParallelEmbedding.quantized_loader` keeps this rank's rows of the quantized table (values, scales and
zero points are per row, so any row split keeps groups whole), the padding rows zero; with tied embeddings that
packed slice is the rank's LM head.
"""

from __future__ import annotations

import torch
from torch import nn

from kubellm.runtime.distributed.tp_group import Group
from kubellm.runtime.layers.checkpoint_error import CheckpointError
from kubellm.runtime.layers.quantized_weight import QuantizedWeight

PAD = 64  # rows per rank are a multiple of this, so every rank's GEMM has whole 64-row tiles


def vocab_rows(vocab_size: int, tp: Group) -> tuple[int, int]:
    """(first token id, rows) of this rank's slice; the whole vocabulary without tensor parallelism."""
    if tp.size == 1:
        return 0, vocab_size
    rows = -(-vocab_size // tp.size)
    rows = -(-rows // PAD) * PAD
    return tp.rank * rows, rows


def _load_rows(layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor, shard_id) -> None:
    """This rank's rows of the ``[vocab, hidden]`` checkpoint tensor; padding rows zero."""
    if shard_id is not None:
        raise CheckpointError(f"is mapped to part {shard_id!r} of a layer that has no parts")
    implied = (layer.vocab_size, param.shape[1])
    if tuple(loaded.shape) != implied:
        raise CheckpointError(f"has shape {tuple(loaded.shape)}, the config implies {implied}")
    real = max(0, min(param.shape[0], layer.vocab_size - layer.vocab_start))
    param.data[:real].copy_(loaded[layer.vocab_start : layer.vocab_start + real])
    param.data[real:].zero_()


class VocabParallelEmbedding(nn.Embedding):
    """``weight`` is ``[rows, hidden]``: this rank's token ids ``vocab_start .. vocab_start + rows``."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: Group):
        start, rows = vocab_rows(vocab_size, tp)
        super().__init__(rows, hidden_size)
        self.vocab_size, self.vocab_start, self.tp = vocab_size, start, tp

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _load_rows(self, param, loaded, shard_id)

    def quantized_loader(self, weight: QuantizedWeight, bias: torch.Tensor | None, shard_id=None
                         ) -> tuple[QuantizedWeight, None]:
        """This rank's rows of a quantized ``[vocab, hidden]`` table, padding rows zero (values and scales)."""
        if shard_id is not None or bias is not None:
            raise CheckpointError("a quantized embedding has neither parts nor a bias")
        implied = (self.vocab_size, self.embedding_dim)
        if tuple(weight.values.shape) != implied:
            raise CheckpointError(f"has shape {tuple(weight.values.shape)}, the config implies {implied}")
        if self.tp.size == 1:
            return weight, None
        real = max(0, min(self.num_embeddings, self.vocab_size - self.vocab_start))
        mine, pad = weight.output_slice(self.vocab_start, real), self.num_embeddings - real

        def padded(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else torch.cat([t, t.new_zeros(pad, t.shape[1])])

        return QuantizedWeight(padded(mine.values), padded(mine.scales), padded(mine.zeros), weight.group_size,
                               weight.g_idx), None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] → [T, hidden], the same on every rank."""
        return vocab_parallel_lookup(input_ids, self.lookup, self.vocab_start, self.num_embeddings, self.tp)

    def lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        """This rank's rows ``local_ids`` → ``[*local_ids.shape, hidden]``. A tied LM head packed for the native
        bf16 kernel replaces it by a read of its packed weight (runtime/layers/linear.py, pack_linears)."""
        return nn.functional.embedding(local_ids, self.weight)


def vocab_parallel_lookup(input_ids: torch.Tensor, lookup, vocab_start: int, rows: int, tp: Group) -> torch.Tensor:
    """``lookup(local ids) -> [..., hidden]`` over this rank's ``rows`` from ``vocab_start``; ids elsewhere read
    zeros, and the all-reduce leaves each token's one real row on every rank."""
    if tp.size == 1:
        return lookup(input_ids)
    local = input_ids - vocab_start
    elsewhere = (local < 0) | (local >= rows)
    out = lookup(local.masked_fill(elsewhere, 0))
    return tp.all_reduce(out.masked_fill_(elsewhere.unsqueeze(-1), 0))


class ParallelLMHead(nn.Linear):
    """``weight`` is ``[rows, hidden]`` (no bias): this rank's slice of the logits; see :func:`gather_logits`."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: Group):
        start, rows = vocab_rows(vocab_size, tp)
        super().__init__(hidden_size, rows, bias=False)
        self.vocab_size, self.vocab_start, self.tp = vocab_size, start, tp

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _load_rows(self, param, loaded, shard_id)


def gather_logits(local: torch.Tensor, tp: Group, vocab_size: int) -> torch.Tensor:
    """Every rank's ``[N, rows]`` slice → ``[N, vocab]`` (a collective: every rank must call it)."""
    if tp.size == 1:
        return local
    return tp.all_gather(local)[:, :vocab_size]
