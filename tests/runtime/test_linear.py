"""PackedLinear (weights prepacked for oneDNN) computes what nn.Linear computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kubellm.runtime.layers.linear import PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(not can_pack("cpu", torch.float32), reason="oneDNN linear ops unavailable")


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)])  # bf16: bias rounding order
@pytest.mark.parametrize("rows", [1, 37, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_same_as_nn_linear(dtype, atol, rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias).to(dtype)
    x = torch.randn(rows, 96).to(dtype)
    expected = linear(x)
    got = PackedLinear(linear)(x)
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), rtol=1e-3 if dtype == torch.float32 else 0, atol=atol)


def test_strided_and_batched_inputs():
    linear = nn.Linear(64, 32)
    base = torch.randn(5, 7, 128)
    x = base[..., ::2]  # non-contiguous last dimension
    torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=1e-4, atol=1e-5)


def test_pack_linears_replaces_every_linear_and_keeps_tied_embeddings():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 10, bias=False))
    model[3].weight = model[0].weight  # tied, as in SmolLM2
    ids = torch.tensor([1, 2, 3])
    expected = model(ids)
    assert pack_linears(model) == 2
    assert isinstance(model[1], PackedLinear) and isinstance(model[3], PackedLinear)
    torch.testing.assert_close(model(ids), expected, rtol=1e-4, atol=1e-5)
    assert model[0].weight.shape == (10, 8)  # the embedding keeps its own weight


def test_nothing_to_pack_for_other_dtypes():
    model = nn.Sequential(nn.Linear(4, 4).half())
    assert pack_linears(model) == 0 and type(model[0]) is nn.Linear
