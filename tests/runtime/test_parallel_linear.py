"""The tensor-parallel layer types load their own slice of a checkpoint tensor: the ranks' slices put back
together are the whole tensor, fused parts land at their offsets (loaded one by one or fused), and the ranks'
outputs combine (concatenated or summed) into the unsharded layer's output."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kubellm.runtime.distributed.tp_group import Group
from kubellm.runtime.layers.parallel_linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    replicated_loader,
)
from kubellm.runtime.models.checkpoint import CheckpointError

HIDDEN = 12


def _ranks(size: int) -> list[Group]:
    return [Group(rank=r, size=size) for r in range(size)]


def _load(layer: nn.Module, tensors: dict[str, torch.Tensor], shard_id=None) -> nn.Module:
    for name, t in tensors.items():
        layer.weight_loader(getattr(layer, name), t, shard_id)
    return layer


@pytest.mark.parametrize("size", [1, 2, 4])
def test_column_parallel_ranks_hold_row_slices_and_their_outputs_concatenate(size):
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(8, HIDDEN, generator=g), torch.randn(8, generator=g), torch.randn(3, HIDDEN, generator=g)
    layers = [_load(ColumnParallelLinear(HIDDEN, 8, True, tp), {"weight": w, "bias": b}) for tp in _ranks(size)]
    for r, layer in enumerate(layers):
        assert layer.weight.shape == (8 // size, HIDDEN)
        assert torch.equal(layer.weight, w.chunk(size)[r]) and torch.equal(layer.bias, b.chunk(size)[r])
    assert torch.equal(torch.cat([m.weight for m in layers]), w)
    torch.testing.assert_close(torch.cat([m(x) for m in layers], dim=-1), x @ w.T + b)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_row_parallel_ranks_hold_column_slices_and_their_partial_sums_add_up(size):
    """The bias sits on rank 0 only, so the all-reduced sum adds it once."""
    g = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(5, 8, generator=g), torch.randn(5, generator=g), torch.randn(3, 8, generator=g)
    layers = [_load(RowParallelLinear(8, 5, True, tp), {"weight": w, "bias": b}) for tp in _ranks(size)]
    assert torch.equal(torch.cat([m.weight for m in layers], dim=1), w)
    assert torch.equal(layers[0].bias, b) and all(not m.bias.any() for m in layers[1:])
    partial = [m(xs) for m, xs in zip(layers, x.chunk(size, dim=-1), strict=True)]
    torch.testing.assert_close(sum(partial), x @ w.T + b)


def test_merged_column_parts_land_at_their_offsets_one_by_one_or_fused():
    """gate/up: rank r holds [its slice of gate; its slice of up]; a checkpoint storing them fused (Phi-3)
    loads into the same rows."""
    g = torch.Generator().manual_seed(2)
    gate, up = torch.randn(8, HIDDEN, generator=g), torch.randn(8, HIDDEN, generator=g)
    for tp in _ranks(2):
        parts = MergedColumnParallelLinear(HIDDEN, {0: 8, 1: 8}, False, tp)
        parts.weight_loader(parts.weight, gate, 0)
        parts.weight_loader(parts.weight, up, 1)
        fused = _load(MergedColumnParallelLinear(HIDDEN, {0: 8, 1: 8}, False, tp), {"weight": torch.cat([gate, up])})
        expected = torch.cat([gate.chunk(2)[tp.rank], up.chunk(2)[tp.rank]])
        assert torch.equal(parts.weight, expected) and torch.equal(fused.weight, expected)
        assert parts.shard_ids == (0, 1)


@pytest.mark.parametrize("size", [1, 2])
def test_qkv_ranks_get_whole_heads_of_q_k_and_v(size):
    """4 query heads and 2 kv heads of 3 dims, with biases (Qwen2): per part and fused alike."""
    heads, kv_heads, d = 4, 2, 3
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n * d, HIDDEN, generator=g) for n in (heads, kv_heads, kv_heads))
    qb, kb, vb = (torch.randn(n * d, generator=g) for n in (heads, kv_heads, kv_heads))
    for tp in _ranks(size):
        parts = QKVParallelLinear(HIDDEN, d, heads, kv_heads, True, tp)
        for sid, w, b in (("q", q, qb), ("k", k, kb), ("v", v, vb)):
            parts.weight_loader(parts.weight, w, sid)
            parts.weight_loader(parts.bias, b, sid)
        fused = _load(QKVParallelLinear(HIDDEN, d, heads, kv_heads, True, tp),
                      {"weight": torch.cat([q, k, v]), "bias": torch.cat([qb, kb, vb])})
        r = tp.rank
        expected_w = torch.cat([q.chunk(size)[r], k.chunk(size)[r], v.chunk(size)[r]])
        expected_b = torch.cat([qb.chunk(size)[r], kb.chunk(size)[r], vb.chunk(size)[r]])
        for layer in (parts, fused):
            assert torch.equal(layer.weight, expected_w) and torch.equal(layer.bias, expected_b)
        kv_rows = kv_heads // size * d  # whole heads: rank r's k rows are heads r * kv_heads / size onwards
        assert torch.equal(parts.part(parts.weight, "k"), k[r * kv_rows:(r + 1) * kv_rows])
        assert parts.weight.shape[0] == heads // size * d + 2 * kv_rows


def test_a_checkpoint_tensor_of_the_wrong_shape_names_both_shapes():
    """The shapes are the checkpoint's (unsharded) ones, whichever rank reads them."""
    tp = Group(rank=1, size=2)
    column = ColumnParallelLinear(HIDDEN, 8, False, tp)
    with pytest.raises(CheckpointError, match=r"has shape \(3, 3\), the config implies \(8, 12\)"):
        column.weight_loader(column.weight, torch.zeros(3, 3))
    qkv = QKVParallelLinear(HIDDEN, 3, 4, 2, False, tp)
    with pytest.raises(CheckpointError, match=r"has shape \(5, 12\), the config implies \(6, 12\)"):
        qkv.weight_loader(qkv.weight, torch.zeros(5, HIDDEN), "k")
    with pytest.raises(CheckpointError, match=r"has shape \(23, 12\), the config implies \(24, 12\)"):
        qkv.weight_loader(qkv.weight, torch.zeros(23, HIDDEN))
    row = RowParallelLinear(8, 5, True, tp)
    with pytest.raises(CheckpointError, match=r"has shape \(5, 6\), the config implies \(5, 8\)"):
        row.weight_loader(row.weight, torch.zeros(5, 6))
    with pytest.raises(CheckpointError, match=r"has shape \(4,\), the config implies \(5,\)"):
        row.weight_loader(row.bias, torch.zeros(4))


def test_parts_a_layer_does_not_have_are_refused():
    tp = Group()
    qkv = QKVParallelLinear(HIDDEN, 3, 4, 2, False, tp)
    with pytest.raises(CheckpointError, match="names part 'x'; the layer has parts 'q', 'k', 'v'"):
        qkv.weight_loader(qkv.weight, torch.zeros(6, HIDDEN), "x")
    for layer in (ColumnParallelLinear(HIDDEN, 8, False, tp), RowParallelLinear(8, 5, False, tp)):
        with pytest.raises(CheckpointError, match="part 0 of a layer that has no parts"):
            layer.weight_loader(layer.weight, layer.weight.detach().clone(), 0)
    norm = nn.Parameter(torch.ones(4))
    with pytest.raises(CheckpointError, match="part 'q' of a parameter that has no parts"):
        replicated_loader(norm, torch.ones(4), "q")


@pytest.mark.parametrize(("make", "message"), [
    (lambda tp: QKVParallelLinear(HIDDEN, 3, 4, 1, False, tp), "does not divide the layer's 1 kv heads"),
    (lambda tp: QKVParallelLinear(HIDDEN, 3, 3, 3, False, tp), "does not divide the layer's 3 attention heads"),
    (lambda tp: MergedColumnParallelLinear(HIDDEN, {0: 5, 1: 5}, False, tp), "does not divide the layer's 5 output features of part 0"),
    (lambda tp: RowParallelLinear(7, 4, False, tp), "does not divide the layer's 7 input features"),
])  # fmt: skip
def test_sizes_the_ranks_cannot_share_evenly_are_refused(make, message):
    """kv heads are split, never replicated: 2 ranks need at least 2 of them."""
    with pytest.raises(ValueError, match=message):
        make(Group(rank=0, size=2))
