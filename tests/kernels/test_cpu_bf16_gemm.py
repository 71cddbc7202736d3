"""The native bf16 linear against its float32 reference, and the packed layout's round trips."""

from __future__ import annotations

import os

import pytest
import torch

from kubellm.kernels import cpu_bf16_gemm as kb


def _case(m, n, k, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    return x, w, (torch.randn(n, generator=g) if bias else None)


def _close(out, ref):
    """Both sum the same exact products in float32 (different orders): within an output ulp or two of bf16."""
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2e-2)


@pytest.mark.usefixtures("native_bf16_gemm")
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 13, 16, 17, 64, 300])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (40, 66), (100, 130), (200, 7), (1000, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_reference(m, n, k, bias):
    """Every stream width (1-8 rows) and row tiles of the tiled path with remainders (9.. rows); N not a
    multiple of 16 (the masked last block), 64 or 4 (items of 1-4 blocks); K with an odd number of pairs (66,
    130) and odd K (7: x padded like the weight's last pair); with and without bias."""
    x, w, b = _case(m, n, k, seed=m * n + k, bias=bias)
    _close(kb.bf16_linear(x, kb.pack(w), n, b), kb.reference_bf16_linear(x, w, b))


@pytest.mark.usefixtures("native_bf16_gemm")
@pytest.mark.parametrize("m", [2, 20])
def test_strided_rows(m):
    x, w, b = _case(m, 48, 256, bias=True)
    wide = torch.zeros(m, 300, dtype=torch.bfloat16)
    wide[:, :256] = x
    _close(kb.bf16_linear(wide[:, :256], kb.pack(w), 48, b), kb.reference_bf16_linear(x, w, b))


@pytest.mark.usefixtures("native_bf16_gemm")
def test_exact_products_and_one_rounding():
    """Small integers: every product and sum exact in float32, so the kernel equals the reference bit for bit
    (a rounding of the weights or of partial sums to bf16 would break it)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-8, 8, (7, 90), generator=g).to(torch.bfloat16)
    w = torch.randint(-8, 8, (33, 90), generator=g).to(torch.bfloat16)
    b = torch.randint(-50, 50, (33,), generator=g).float()
    for rows in (x[:1], x[:4], x):  # stream widths and the tiled path
        assert torch.equal(kb.bf16_linear(rows, kb.pack(w), 33, b), kb.reference_bf16_linear(rows, w, b))


@pytest.mark.usefixtures("native_bf16_gemm")
def test_zero_rows_and_bad_shapes():
    w = torch.randn(32, 64).to(torch.bfloat16)
    assert kb.bf16_linear(torch.zeros(0, 64, dtype=torch.bfloat16), kb.pack(w), 32).shape == (0, 32)
    with pytest.raises(RuntimeError, match="columns"):
        kb.bf16_linear(torch.zeros(2, 62, dtype=torch.bfloat16), kb.pack(w), 32)
    with pytest.raises(RuntimeError, match="blocks"):
        kb.bf16_linear(torch.zeros(2, 64, dtype=torch.bfloat16), kb.pack(w), 40)
    with pytest.raises(RuntimeError, match="bias"):
        kb.bf16_linear(torch.zeros(2, 64, dtype=torch.bfloat16), kb.pack(w), 32, torch.zeros(32, dtype=torch.bfloat16))


def test_pack_places_pairs_and_pads():
    w = torch.arange(20 * 5, dtype=torch.float32).view(20, 5).to(torch.bfloat16)
    p = kb.pack(w)
    assert p.shape == (2, 3, 16, 2) and p.dtype == torch.bfloat16
    assert p[1, 1, 2, 0] == w[18, 2] and p[1, 1, 2, 1] == w[18, 3]  # channel 18, inputs 2 and 3
    assert p[1, 2, 2, 1] == 0 and p[1, 0, 5, 0] == 0  # the padded input 5 and channel 21


@pytest.mark.parametrize(("n", "k"), [(20, 5), (64, 576), (49, 130)])
def test_unpack_and_embedding_read_the_weight_back(n, k):
    w = torch.randn(n, k).to(torch.bfloat16)
    p = kb.pack(w)
    assert torch.equal(kb.unpack(p, n, k), w)
    ids = torch.tensor([[0, n - 1, 3], [n // 2, 1, n - 1]])
    assert torch.equal(kb.embedding(p, ids, k), torch.nn.functional.embedding(ids, w))


@pytest.mark.usefixtures("native_bf16_gemm")
def test_the_build_runs_the_best_instructions_this_cpu_has():
    """AVX512-BF16 where the CPU (as capped by KUBELLM_CPU_ISA) has it, else the AVX2 path: so CI on an AVX-512
    host tests one and its x86-64-v3 pass (make test-avx2) the other."""
    from kubellm.kernels import cpu_extension

    if os.environ.get(cpu_extension.MARCH_ENV, "").strip():
        pytest.skip(f"{cpu_extension.MARCH_ENV} chooses the build")
    expected = "avx512-bf16" if "x86-64-v4-bf16" in cpu_extension.supported_levels() else "avx2"
    assert kb.isa() == expected
