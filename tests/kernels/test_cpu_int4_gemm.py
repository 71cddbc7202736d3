"""The native int4 GEMM (per-group scales and zero points) against its float32 reference."""

from __future__ import annotations

import pytest
import torch

from kubellm.kernels import cpu_int4_gemm as k4

pytestmark = pytest.mark.usefixtures("native_int4")  # skip without it; fail under CI where the CPU has it


def _reference(x, q, scales, zeros, group, bias=None):
    """The float32 reference, with the weights rounded to bf16 where the kernel dequantizes them (many rows)."""
    rounded = torch.bfloat16 if x.shape[0] >= k4.DEQUANTIZE_ROWS else torch.float32
    return k4.reference_int4_gemm(x, q, scales, zeros, group, bias, weights_dtype=rounded)


def _case(m, n, k, group, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(k // group, n, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 16, (k // group, n), generator=g).float()
    b = torch.randn(n, generator=g) if bias else None
    return x, q, scales, zeros, b


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 16, 17, 32, 41])
@pytest.mark.parametrize(("n", "k", "group"), [(16, 128, 128), (48, 256, 64), (576, 576, 32), (80, 1536, 128)])
def test_matches_the_reference(m, n, k, group):
    """Row tiles of 1..6 and their remainders, odd numbers of 16-channel blocks, several groups per row; from 16
    rows the dequantizing path (uneven row tiles, items of 1-4 blocks, several items per thread)."""
    x, q, scales, zeros, _ = _case(m, n, k, group, seed=m + n)
    out = k4.int4_gemm(x, k4.pack(q), scales, zeros, group)
    torch.testing.assert_close(out.float(), _reference(x, q, scales, zeros, group).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("m", [4, 20])  # both paths
def test_bias_strided_rows_and_a_symmetric_zero(m):
    x, q, scales, _, b = _case(m, 32, 256, 128, bias=True)
    zeros = torch.full_like(scales, 8.0)  # what symmetric formats pass
    wide = torch.zeros(m, 300, dtype=torch.bfloat16)
    wide[:, :256] = x
    out = k4.int4_gemm(wide[:, :256], k4.pack(q), scales, zeros, 128, b)
    torch.testing.assert_close(out.float(), _reference(x, q, scales, zeros, 128, b).float(), rtol=1e-2, atol=1e-2)


def test_the_bf16_rounding_is_the_only_difference_between_the_paths():
    """Rows alone (weights as stored) and in a batch (dequantized to bf16) against the float32 reference: both
    within bf16 of it (rtol 2^-7 is 2 bf16 ulps of the output, the batch's weights add ~2^-9 relative each), and the
    batch closer to the reference that rounds the weights as it does."""
    x, q, scales, zeros, _ = _case(24, 96, 576, 32, seed=3)
    packed = k4.pack(q)
    batch = k4.int4_gemm(x, packed, scales, zeros, 32).float()
    alone = torch.cat([k4.int4_gemm(x[i:i + 1], packed, scales, zeros, 32) for i in range(24)]).float()
    exact = k4.reference_int4_gemm(x, q, scales, zeros, 32).float()
    rounded = k4.reference_int4_gemm(x, q, scales, zeros, 32, weights_dtype=torch.bfloat16).float()
    for out in (batch, alone):
        torch.testing.assert_close(out, exact, rtol=2**-7, atol=2e-2)
    assert (batch - rounded).abs().mean() < (batch - exact).abs().mean()


def test_pack_puts_pairs_in_nibbles():
    q = torch.arange(32 * 8, dtype=torch.uint8).view(32, 8) % 16
    p = k4.pack(q)
    assert p.shape == (2, 2, 16, 2) and p.dtype == torch.uint8
    # channel 19, inputs 4..7: byte j holds q[4 + j] (low nibble) and q[6 + j] (high nibble)
    assert int(p[1, 1, 3, 0]) == int(q[19, 4]) | int(q[19, 6]) << 4
    assert int(p[1, 1, 3, 1]) == int(q[19, 5]) | int(q[19, 7]) << 4


@pytest.mark.parametrize("m", [1, 16])  # both paths
def test_extreme_nibbles_and_zeros_are_exact(m):
    """0 and 15 with zero points 0..15 (the +128 offset of the widening, the 1 + v / 16 of the dequantization
    must cancel exactly)."""
    q = torch.tensor([[0, 15, 15, 0] * 8] * 16, dtype=torch.uint8)
    x = torch.zeros(m, 32, dtype=torch.bfloat16)
    x[:, 1] = 1.0
    x[:, 2] = 2.0
    zeros = torch.arange(16.0).view(1, 16)
    out = k4.int4_gemm(x, k4.pack(q), torch.full((1, 16), 0.5), zeros, 32)
    assert torch.equal(out.float(), ((45 - 3 * zeros) * 0.5).expand(m, 16))


@pytest.mark.parametrize("m", [1, 7, 20])  # 20: the dequantizing path
def test_float16_scales_and_zeros_give_the_float32_result_bit_for_bit(m):
    """The loader keeps scales and zero points in float16 where exact (GGUF's d); widened in the kernel, they
    must give exactly what the same values in float32 give, alone or mixed (float16 scales, float32 zeros)."""
    x, q, scales, zeros, b = _case(m, 48, 256, 32, seed=m, bias=True)
    scales = scales.half().float()  # values float16 holds exactly
    packed = k4.pack(q)
    expected = k4.int4_gemm(x, packed, scales, zeros, 32, b)
    assert torch.equal(k4.int4_gemm(x, packed, scales.half(), zeros.half(), 32, b), expected)
    assert torch.equal(k4.int4_gemm(x, packed, scales.half(), zeros, 32, b), expected)
    torch.testing.assert_close(expected.float(), _reference(x, q, scales, zeros, 32, b).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(("bad", "match"), [
    (lambda x, p, s, z: (x.float(), p, s, z, 128), "bfloat16"),
    (lambda x, p, s, z: (x, p, s, z, 96), "group_size"),
    (lambda x, p, s, z: (x, p, s, z, 2), "multiple of 4"),
    (lambda x, p, s, z: (x, p, s[:1], z, 128), "scales must be contiguous"),
    (lambda x, p, s, z: (x, p, s, z.bfloat16(), 128), r"zeros .* float32 or float16"),
    (lambda x, p, s, z: (x[:, :128], p, s, z, 128), "columns"),
])  # fmt: skip
def test_bad_inputs_are_refused(bad, match):
    x, q, scales, zeros, _ = _case(2, 32, 256, 128)
    with pytest.raises(RuntimeError, match=match):
        k4.int4_gemm(*bad(x, k4.pack(q), scales, zeros))
