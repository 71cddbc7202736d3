"""The native int8 GEMM (``--quantization int8``: one scale per output channel) against its float32 reference."""

from __future__ import annotations

import pytest
import torch

from kubellm.kernels import cpu_int8_gemm as k8

pytestmark = pytest.mark.usefixtures("native_int8")  # skip without it; fail under CI where the CPU has it


def _case(m, k, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    return x, q, torch.rand(n, generator=g) / 50, torch.randn(n, generator=g)


@pytest.mark.parametrize("m", [1, 7, 12, 13, 15, 16, 17, 41, 300])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (64, 16), (1536, 48), (576, 3072), (2, 32)])
def test_matches_the_reference(m, k, n):
    """Row tiles of 12 and their remainders below DEQUANTIZE_ROWS; from there the widen-once path (row tiles
    of up to 6, items of 1-4 blocks, several items per thread); an odd block count (48), a single input pair."""
    x, q, scales, bias = _case(m, k, n, seed=m * n + k)
    for b in (None, bias):
        out = k8.int8_gemm(x, k8.pack(q), scales, b)
        torch.testing.assert_close(out.float(), k8.reference_int8_gemm(x, q, scales, b).float(), atol=1e-2,
                                   rtol=2**-7)  # one bf16 rounding


@pytest.mark.parametrize("m", [5, 20])  # both paths
def test_strided_rows(m):
    """Rows of a wider buffer (fused outputs feed the next GEMM)."""
    x, q, scales, _ = _case(m, 576, 64, seed=m)
    wide = torch.zeros(m, 580, dtype=torch.bfloat16)
    wide[:, :576] = x
    torch.testing.assert_close(k8.int8_gemm(wide[:, :576], k8.pack(q), scales).float(),
                               k8.reference_int8_gemm(x, q, scales).float(), atol=1e-2, rtol=2**-7)


def test_a_batch_gives_each_row_what_it_gets_alone_bit_for_bit():
    """The widen-once path keeps the int8 weights exact and scales the same float32 sums, so a row's output
    does not depend on how many rows share the call (a decode step and a prefill agree)."""
    x, q, scales, bias = _case(40, 576, 80, seed=5)
    packed = k8.pack(q)
    batch = k8.int8_gemm(x, packed, scales, bias)
    alone = torch.cat([k8.int8_gemm(x[i:i + 1], packed, scales, bias) for i in range(40)])
    assert torch.equal(batch, alone)


@pytest.mark.parametrize("m", [1, 16])  # both paths
def test_extreme_values_are_exact(m):
    """-127 and 127 widen to bf16 exactly: a one-hot x reads back the weight column times its scale."""
    q = torch.tensor([[-127, 127] * 16] * 32, dtype=torch.int8)
    x = torch.zeros(m, 32, dtype=torch.bfloat16)
    x[:, 1] = 1.0
    out = k8.int8_gemm(x, k8.pack(q), torch.full((32,), 0.5))
    assert torch.equal(out, torch.full((m, 32), 63.5, dtype=torch.bfloat16))


def test_refuses_bad_shapes_and_dtypes():
    q = k8.pack(torch.zeros(32, 8, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="x has 6 columns, the weight 8"):
        k8.int8_gemm(torch.zeros(2, 6, dtype=torch.bfloat16), q, torch.ones(32))
    with pytest.raises(RuntimeError, match="x must be \\[M, K\\] bfloat16"):
        k8.int8_gemm(torch.zeros(2, 8), q, torch.ones(32))
    with pytest.raises(RuntimeError, match="scales must be \\[N\\] float32"):
        k8.int8_gemm(torch.zeros(2, 8, dtype=torch.bfloat16), q, torch.ones(16))
