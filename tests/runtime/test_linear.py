"""PackedLinear (weights prepacked for oneDNN) computes what nn.Linear computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kubellm.kernels import cpu_extension
from kubellm.runtime.layers.linear import (
    NativeLinear,
    PackedLinear,
    can_pack,
    pack_linears,
    prepack_unavailable,
)

pytestmark = pytest.mark.skipif(not can_pack("cpu", torch.float32), reason="oneDNN linear ops unavailable")


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)])  # bf16: bias rounding order
@pytest.mark.parametrize("rows", [1, 37, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_same_as_nn_linear(dtype, atol, rows, bias):
    if not can_pack("cpu", dtype):
        pytest.skip(prepack_unavailable("cpu", dtype))  # test_bf16_prepack_follows_the_cpu pins down when
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


def test_bf16_prepack_follows_the_cpu():
    """oneDNN's bf16 prepacked linear needs AVX-512 BW/VL/DQ (or AVX-NE-CONVERT) at run time: where the CPU (or
    the KUBELLM_CPU_ISA cap) lacks them it is reported unavailable and nothing is packed, so bfloat16 models keep
    F.linear; where it has them, it packs."""
    flags = cpu_extension.cpu_flags()
    capped = cpu_extension.isa_cap() not in (None, "x86-64-v4", "x86-64-v4-bf16")
    runs = not capped and ({"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags)
    assert can_pack("cpu", torch.bfloat16) == runs, prepack_unavailable("cpu", torch.bfloat16)
    model = nn.Sequential(nn.Linear(16, 8)).to(torch.bfloat16)
    x = torch.randn(2, 16).to(torch.bfloat16)
    expected = model(x)
    assert pack_linears(model) == (1 if runs else 0)
    torch.testing.assert_close(model(x).float(), expected.float(), rtol=0, atol=1.6e-2)


def test_isa_cap_below_avx512_refuses_bf16_prepack(monkeypatch):
    monkeypatch.setenv(cpu_extension.ISA_ENV, "x86-64-v3")
    assert "KUBELLM_CPU_ISA=x86-64-v3" in prepack_unavailable("cpu", torch.bfloat16)
    assert prepack_unavailable("cpu", torch.float32) is None


def test_nothing_to_pack_for_other_dtypes():
    model = nn.Sequential(nn.Linear(4, 4).half())
    assert pack_linears(model) == 0 and type(model[0]) is nn.Linear


@pytest.mark.usefixtures("native_bf16_gemm")
@pytest.mark.parametrize("rows", [1, 6, 37])
@pytest.mark.parametrize("bias", [False, True])
def test_native_linear_same_as_nn_linear_in_bfloat16(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    x = torch.randn(3, rows, 96).to(torch.bfloat16)
    got = NativeLinear(linear)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (3, rows, 200)
    torch.testing.assert_close(got.float(), linear(x).float(), rtol=2**-7, atol=2e-2)


@pytest.mark.usefixtures("native_bf16_gemm")
def test_native_packing_moves_a_tied_embedding_onto_the_packed_table():
    """The embedding's rows come from the LM head's packed weight and its own weight is gone (one copy of the
    table); an untied embedding keeps its weight."""
    from kubellm.runtime.distributed.tp_group import Group
    from kubellm.runtime.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding

    torch.manual_seed(0)
    tied, untied = (nn.ModuleDict({"embed": VocabParallelEmbedding(100, 48, Group()),
                                   "head": ParallelLMHead(48, 100, Group())}).to(torch.bfloat16) for _ in range(2))
    tied["head"].weight = tied["embed"].weight
    ids = torch.tensor([0, 17, 99, 17])
    for model in (tied, untied):
        expected_rows, expected_logits = model["embed"](ids), model["head"](model["embed"](ids))
        assert pack_linears(model, "native") == 1 and isinstance(model["head"], NativeLinear)
        assert torch.equal(model["embed"](ids), expected_rows)
        torch.testing.assert_close(model["head"](model["embed"](ids)).float(), expected_logits.float(),
                                   rtol=2**-7, atol=2e-2)
    assert "weight" not in dict(tied["embed"].named_parameters())
    assert untied["embed"].weight.shape == (100, 48)


def test_native_packing_takes_only_bfloat16():
    model = nn.Sequential(nn.Linear(4, 4))
    assert pack_linears(model, "native") == 0 and type(model[0]) is nn.Linear
