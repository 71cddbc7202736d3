"""The native int4 GEMM (per-group scales and zero points) against its references, in the build this host loaded:
bf16 activations in AVX512-BF16 builds only; int8 activations in those (AVX512-VNNI) and in AVX2 builds, which
also take float32 activations."""

from __future__ import annotations

import pytest
import torch

from kubellm.kernels import cpu_int4_gemm as k4

# the bf16-activation path: skip without it; fail under CI where the CPU has it
bf16_activations = pytest.mark.usefixtures("native_int4")


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


@bf16_activations
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 15, 16, 17, 32, 41, 64, 130])
@pytest.mark.parametrize(("n", "k", "group"), [(16, 128, 128), (48, 256, 64), (576, 576, 32), (80, 1536, 128)])
def test_matches_the_reference(m, n, k, group):
    """Row tiles of 1..6 and their remainders, odd numbers of 16-channel blocks, several groups per row; from 16
    rows the dequantizing path (uneven row tiles, items of 1-4 blocks, several items per thread)."""
    x, q, scales, zeros, _ = _case(m, n, k, group, seed=m + n)
    out = k4.int4_gemm(x, k4.pack(q), scales, zeros, group)
    torch.testing.assert_close(out.float(), _reference(x, q, scales, zeros, group).float(), rtol=1e-2, atol=1e-2)


@bf16_activations
@pytest.mark.parametrize("m", [4, 20])  # both paths
def test_bias_strided_rows_and_a_symmetric_zero(m):
    x, q, scales, _, b = _case(m, 32, 256, 128, bias=True)
    zeros = torch.full_like(scales, 8.0)  # what symmetric formats pass
    wide = torch.zeros(m, 300, dtype=torch.bfloat16)
    wide[:, :256] = x
    out = k4.int4_gemm(wide[:, :256], k4.pack(q), scales, zeros, 128, b)
    torch.testing.assert_close(out.float(), _reference(x, q, scales, zeros, 128, b).float(), rtol=1e-2, atol=1e-2)


@bf16_activations
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


@bf16_activations
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


@bf16_activations
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


@bf16_activations
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


# ---- int8 activations (w4a8_tiles.h): 1-2 plain rows in dot_groups, blocks of 3-8 rows in the assembly tile --------
def _w4a8(x, q, scales, zeros, group, bias=None):
    return k4.int4_gemm(x, k4.pack(q), scales, zeros, group, bias, int8_activations=True)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 14, 17, 32, 47])
@pytest.mark.parametrize(("n", "k", "group"), [(16, 128, 128), (48, 256, 64), (80, 576, 32), (144, 1536, 128),
                                               (32, 96, 32), (64, 192, 12)])
def test_int8_activations_match_their_reference(m, n, k, group, native_int4_int8):
    """Odd numbers of blocks (items of 1-4), groups of 32/64/128 and odd quads per group (12), several items per
    thread, every row block (1-2 plain rows, tiles of 4, 6 and 8 rows padded with zero rows) alone and after
    whole blocks of 8: the kernel computes exactly reference_w4a8_gemm's integers, so only float32 sums and the
    bf16 output differ."""
    x, q, scales, zeros, b = _case(m, n, k, group, seed=m * n + group, bias=True)
    out = _w4a8(x, q, scales, zeros, group, b)
    ref = k4.reference_w4a8_gemm(x, q, scales, zeros, group, b)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize(("n", "k", "group"), [(80, 576, 32), (48, 256, 64), (64, 192, 12)])
def test_int8_activations_give_a_row_the_same_bits_alone_and_in_any_batch(n, k, group, native_int4_int8):
    """130 rows (16 blocks of 8 in the assembly tile, 2 plain rows) against each row alone (the 1-row tile) and
    against batches of 2 (the two-row tile), 3, 5, 7 and 12 (tiles of 4, 6 and 8 padded with zero rows; 8 plus
    a padded 4): the same operations in the same order, so a request's output does not depend on what it is
    batched with."""
    x, q, scales, zeros, b = _case(130, n, k, group, seed=n + group, bias=True)
    packed = k4.pack(q)
    full = k4.int4_gemm(x, packed, scales, zeros, group, b, int8_activations=True)
    alone = torch.cat([k4.int4_gemm(x[i:i + 1], packed, scales, zeros, group, b, int8_activations=True)
                       for i in range(x.shape[0])])
    torch.testing.assert_close(full, alone, rtol=0, atol=0)
    for rows in (2, 3, 5, 7, 12):
        torch.testing.assert_close(k4.int4_gemm(x[:rows], packed, scales, zeros, group, b, int8_activations=True),
                                   full[:rows], rtol=0, atol=0)


@pytest.mark.parametrize("zeros_of", ["symmetric", "float"])
def test_int8_activations_with_symmetric_and_float_zeros(zeros_of, native_int4_int8):
    """z = 8 (GPTQ, W4A16, Q4_0) and fractional zero points (GGUF Q4_1 / Q4_K: -min / d), float16 scales."""
    x, q, scales, _, _ = _case(3, 64, 512, 32, seed=5)
    g = torch.Generator().manual_seed(6)
    zeros = torch.full_like(scales, 8.0) if zeros_of == "symmetric" else torch.rand(scales.shape, generator=g) * 15
    scales = scales.half()
    out = _w4a8(x, q, scales, zeros, 32)
    torch.testing.assert_close(out.float(), k4.reference_w4a8_gemm(x, q, scales.float(), zeros, 32).float(),
                               rtol=2**-7, atol=1e-3)


def test_int8_activations_are_what_the_kernel_computes(native_int4_int8):
    """The flag takes the int8 path at 1 and at 20 rows (closer to its own reference than to the bf16 one, which
    differs by the activations' rounding), within 1% of the bf16 activations' result on random data."""
    x, q, scales, zeros, _ = _case(20, 96, 1536, 64, seed=7)
    for rows in (x[:1], x):
        out = _w4a8(rows, q, scales, zeros, 64).float()
        exact = k4.reference_int4_gemm(rows, q, scales, zeros, 64).float()
        own = k4.reference_w4a8_gemm(rows, q, scales, zeros, 64).float()
        assert (out - own).abs().max() * 4 < (out - exact).abs().max()
        assert (out - exact).norm() < 0.01 * exact.norm()


def test_int8_activations_of_zero_and_extreme_rows(native_int4_int8):
    """An all-zero group quantizes to 0 (scale 0, no division by zero), a group's largest value to +-127 exactly,
    and values halfway between two integers round to even, as torch.round does."""
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    x[0, 32:36] = torch.tensor([-2.0, 1.0, 0.5, 0.25])  # first group all zero; 127/2 * 1 = 63.5 -> 64 (even)
    x[1] = torch.randn(64, generator=torch.Generator().manual_seed(0)).bfloat16()
    xq, a = k4.quantize_activations(x, 32)
    assert torch.equal(xq[0, :32], torch.zeros(32)) and a[0, 0] == 0
    assert xq[0, 32:36].tolist() == [-127.0, 64.0, 32.0, 16.0]
    q = torch.randint(0, 16, (16, 64), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    scales, zeros = torch.full((2, 16), 0.01), torch.full((2, 16), 8.0)
    torch.testing.assert_close(_w4a8(x, q, scales, zeros, 32).float(),
                               k4.reference_w4a8_gemm(x, q, scales, zeros, 32).float(), rtol=2**-7, atol=1e-4)


def test_the_build_reports_the_paths_it_has(native_int4_int8):
    """An AVX512-BF16 build has both activation kinds on bfloat16; an AVX2 build int8 activations only, on
    bfloat16 and float32, and refuses bf16 activations by name."""
    assert k4.takes_float32() == (not k4.available())
    if not k4.available():
        x, q, scales, zeros, _ = _case(1, 16, 64, 32)
        with pytest.raises(RuntimeError, match="int8_activations=True"):
            k4.int4_gemm(x, k4.pack(q), scales, zeros, 32)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 9])
@pytest.mark.parametrize(("n", "k", "group"), [(80, 576, 32), (144, 1536, 128), (64, 192, 12)])
def test_float32_int8_activations_where_the_build_takes_them(m, n, k, group, native_int4_int8):
    """The AVX2 build takes float32 x (what an AVX2 engine runs, --dtype auto): the same integers as
    reference_w4a8_gemm, float32 out; bf16 x gives the float32 result of its values rounded once (the same bits
    as the AVX-512 kernel's epilogue). The AVX-512 build refuses float32 by name."""
    x, q, scales, zeros, b = _case(m, n, k, group, seed=m * k, bias=True)
    x = x.float() + torch.randn(x.shape, generator=torch.Generator().manual_seed(m)) * 1e-3  # not bf16 values
    if not k4.takes_float32():
        with pytest.raises(RuntimeError, match="bfloat16"):
            _w4a8(x, q, scales, zeros, group, b)
        return
    out = _w4a8(x, q, scales, zeros, group, b)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, k4.reference_w4a8_gemm(x, q, scales, zeros, group, b), rtol=1e-5, atol=1e-5)
    rows = x.bfloat16()
    torch.testing.assert_close(_w4a8(rows, q, scales, zeros, group, b), _w4a8(rows.float(), q, scales, zeros, group,
                                                                             b).bfloat16(), rtol=0, atol=0)
