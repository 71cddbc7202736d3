"""Linear layers that know how tensor parallelism splits them, and load their own slice of a checkpoint tensor.

Megatron-style: a column-parallel layer holds 1/N of the output features (whole heads, whole MLP channels) and
computes that slice of the output; a row-parallel layer holds 1/N of the input features and computes a partial
sum, which the block owning it all-reduces (attention after ``o_proj``, the MLP after ``down_proj``, a mixture
of experts once over all its experts). The collective stays in the block, not in the layer, because a layer is
swapped after loading for a drop-in that computes the same thing faster (``PackedLinear``, ``Int8Linear``,
``QuantizedLinear``), and the sum must survive the swap.

Each layer is an ``nn.Linear`` of its per-rank shape (so the drop-ins, kernels and quantizers read ``weight``
and ``bias`` as ever) plus ``weight_loader(param, loaded, shard_id)``: ``loaded`` is the whole checkpoint
tensor, the layer takes this rank's slice. Fused layers (q/k/v, gate/up) take either one part, named by its
shard id, or the whole fused tensor (``shard_id`` None, as Phi-3's checkpoints store them) and cut it per part
before slicing, so each rank still gets whole heads. A model maps checkpoint names to its parameters and shard
ids (``packed_modules_mapping`` on the model class); parameters of modules without a ``weight_loader``
(norms, MoE routers) are replicated: :func:`replicated_loader` copies them whole. The embedding and the LM
head split the vocabulary (runtime/layers/vocab_parallel.py).

Every loader checks shapes and raises :class:`CheckpointError` with the checkpoint's and the implied shape;
the model's loader adds the tensor's name.

Checkpoints quantized elsewhere shard by the same rules through ``quantized_loader(weight, bias, shard_id)``:
runtime/quantization/loading.py reads each stored part (AWQ, GPTQ, compressed-tensors, FP8, GGUF blocks)
into a :class:`QuantizedWeight` (values ``[out, in]`` unpacked, scales per group) and the layer that the
quantized layer replaces returns this rank's part of it. Slicing the unpacked form makes every packing (AWQ's
eight nibbles per word along the outputs, GPTQ's and compressed-tensors' along the inputs, GGUF's blocks)
shard alike; the row-parallel split must keep groups whole (an act-order map is sliced with the inputs
instead).
"""

from __future__ import annotations

import torch
from torch import nn

from kubellm.runtime.distributed.tp_group import Group
from kubellm.runtime.layers.checkpoint_error import CheckpointError
from kubellm.runtime.layers.quantized_weight import QuantizedWeight

ShardId = int | str | None


def _check(loaded: torch.Tensor, implied: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != tuple(implied):
        raise CheckpointError(f"has shape {tuple(loaded.shape)}, the config implies {tuple(implied)}")


def take_slice(loaded: torch.Tensor, dst: torch.Tensor, dim: int, tp: Group) -> None:
    """Copy this rank's equal slice of ``loaded`` along ``dim`` into ``dst`` (its shape is the slice's)."""
    implied = list(dst.shape)
    implied[dim] *= tp.size
    _check(loaded, tuple(implied))
    dst.copy_(loaded.narrow(dim, tp.rank * dst.shape[dim], dst.shape[dim]) if tp.size > 1 else loaded)


def replicated_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
    """Every rank holds the whole tensor."""
    if shard_id is not None:
        raise CheckpointError(f"is mapped to part {shard_id!r} of a parameter that has no parts")
    _check(loaded, tuple(param.shape))
    param.data.copy_(loaded)


def _rank_rows(total: int, per_rank: int, tp: Group, what: str) -> int:
    """The first of this rank's ``per_rank`` outputs among ``total`` (a checkpoint part's); checks the size."""
    if total != per_rank * tp.size:
        raise CheckpointError(f"has {total} {what}, the config implies {per_rank * tp.size}")
    return tp.rank * per_rank


def _divide(n: int, tp: Group, what: str) -> int:
    if n % tp.size:
        raise ValueError(f"tensor_parallel_size {tp.size} does not divide the layer's {n} {what}")
    return n // tp.size


class ColumnParallelLinear(nn.Linear):
    """Output features (weight rows, bias) split over the ranks: ``weight`` is ``[out / N, in]``."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: Group):
        super().__init__(in_features, _divide(out_features, tp, "output features"), bias=bias)
        self.tp = tp

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        if shard_id is not None:
            raise CheckpointError(f"is mapped to part {shard_id!r} of a layer that has no parts")
        take_slice(loaded, param.data, 0, self.tp)

    def quantized_loader(self, weight: QuantizedWeight, bias: torch.Tensor | None, shard_id: ShardId = None
                         ) -> tuple[QuantizedWeight, torch.Tensor | None]:
        """This rank's outputs of a quantized checkpoint part (and of its bias)."""
        if shard_id is not None:
            raise CheckpointError(f"is mapped to part {shard_id!r} of a layer that has no parts")
        return _output_slice(weight, bias, self.out_features, self.tp)


def _output_slice(weight: QuantizedWeight, bias: torch.Tensor | None, rows: int, tp: Group
                  ) -> tuple[QuantizedWeight, torch.Tensor | None]:
    start = _rank_rows(weight.values.shape[0], rows, tp, "quantized outputs")
    return weight.output_slice(start, rows), None if bias is None else bias.narrow(0, start, rows)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one matmul (gate/up: parts 0 and 1). ``parts`` maps each shard id
    to its unsharded output size, in output order; each rank's rows are its slice of part 0, then of part 1..."""

    def __init__(self, in_features: int, parts: dict[ShardId, int], bias: bool, tp: Group):
        self.part_rows = {sid: _divide(rows, tp, f"output features of part {sid!r}") for sid, rows in parts.items()}
        super().__init__(in_features, sum(parts.values()), bias, tp)

    @property
    def shard_ids(self) -> tuple[ShardId, ...]:
        """The parts a checkpoint must provide (one at a time or all at once, fused)."""
        return tuple(self.part_rows)

    def part(self, param: torch.Tensor, shard_id: ShardId) -> torch.Tensor:
        """This rank's rows of part ``shard_id`` inside ``param`` (a view)."""
        if shard_id not in self.part_rows:
            raise CheckpointError(f"names part {shard_id!r}; the layer has parts {', '.join(map(repr, self.part_rows))}")
        offset = 0
        for sid, rows in self.part_rows.items():
            if sid == shard_id:
                return param.data.narrow(0, offset, rows)
            offset += rows
        raise AssertionError("unreachable")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        if shard_id is not None:
            take_slice(loaded, self.part(param, shard_id), 0, self.tp)
            return
        # The fused tensor as the checkpoint stores it: each part whole, one after the other.
        full = [rows * self.tp.size for rows in self.part_rows.values()]
        implied = (sum(full), *param.shape[1:])
        _check(loaded, implied)
        for sid, chunk in zip(self.part_rows, loaded.split(full), strict=True):
            take_slice(chunk, self.part(param, sid), 0, self.tp)

    def quantized_loader(self, weight: QuantizedWeight, bias: torch.Tensor | None, shard_id: ShardId = None
                         ) -> tuple[QuantizedWeight, torch.Tensor | None]:
        """This rank's outputs of one quantized part, or of every part of a fused one (``shard_id`` None), cut
        per part first as for dense weights; the parts' slices are concatenated by the caller / here."""
        if shard_id is not None:
            if shard_id not in self.part_rows:
                raise CheckpointError(f"names part {shard_id!r}; the layer has parts "
                                      f"{', '.join(map(repr, self.part_rows))}")
            return _output_slice(weight, bias, self.part_rows[shard_id], self.tp)
        if self.tp.size == 1:
            return weight, bias
        full = [rows * self.tp.size for rows in self.part_rows.values()]
        _rank_rows(weight.values.shape[0], sum(self.part_rows.values()), self.tp, "quantized outputs")
        slices, start = [], 0
        for rows, n in zip(self.part_rows.values(), full, strict=True):
            slices.append(_output_slice(weight.output_slice(start, n), None if bias is None else bias[start:start + n],
                                        rows, self.tp))
            start += n
        parts = [w for w, _ in slices]
        return (QuantizedWeight(torch.cat([p.values for p in parts]), torch.cat([p.scales for p in parts]),
                                None if weight.zeros is None else torch.cat([p.zeros for p in parts]),
                                weight.group_size, weight.g_idx),
                None if bias is None else torch.cat([b for _, b in slices]))


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v (shard ids ``"q"``, ``"k"``, ``"v"``) in one matmul, split by whole heads. Every rank needs at
    least one kv head of its own: kv heads are not replicated, so N must divide the kv heads too."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, tp: Group):
        _divide(num_heads, tp, "attention heads")
        _divide(num_kv_heads, tp, "kv heads")
        kv = num_kv_heads * head_dim
        super().__init__(hidden, {"q": num_heads * head_dim, "k": kv, "v": kv}, bias, tp)


class RowParallelLinear(nn.Linear):
    """Input features split over the ranks: ``weight`` is ``[out, in / N]`` and the output a partial sum the
    owning block all-reduces. The bias is added once: rank 0 holds it, the others hold zeros."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: Group):
        super().__init__(_divide(in_features, tp, "input features"), out_features, bias=bias)
        self.tp = tp

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        if shard_id is not None:
            raise CheckpointError(f"is mapped to part {shard_id!r} of a layer that has no parts")
        if param is self.bias:
            _check(loaded, tuple(param.shape))
            if self.tp.rank == 0:
                param.data.copy_(loaded)
            else:
                param.data.zero_()
            return
        take_slice(loaded, param.data, 1, self.tp)

    def quantized_loader(self, weight: QuantizedWeight, bias: torch.Tensor | None, shard_id: ShardId = None
                         ) -> tuple[QuantizedWeight, torch.Tensor | None]:
        """This rank's inputs of a quantized checkpoint tensor, in whole groups; the bias on rank 0 only."""
        if shard_id is not None:
            raise CheckpointError(f"is mapped to part {shard_id!r} of a layer that has no parts")
        n = self.in_features
        if weight.values.shape[1] != n * self.tp.size:
            raise CheckpointError(f"has {weight.values.shape[1]} quantized inputs, the config implies "
                                  f"{n * self.tp.size}")
        try:
            weight = weight.input_slice(self.tp.rank * n, n) if self.tp.size > 1 else weight
        except ValueError as e:
            raise CheckpointError(f"cannot be split over tensor_parallel_size {self.tp.size}: {e}; each rank's "
                                  f"{n} inputs must be whole groups (use a tensor_parallel_size that divides the "
                                  "groups, or tensor_parallel_size 1)") from None
        if bias is not None and self.tp.rank != 0:
            bias = torch.zeros_like(bias)
        return weight, bias
