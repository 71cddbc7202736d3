"""The native grouped 8-bit GEMM (per-group scales, optional zero points) against its float32 reference, in the
build this host loaded (AVX512-BF16, or AVX2 with float32 activations too)."""

from __future__ import annotations

import pytest
import torch

from kubellm.kernels import cpu_grouped_int8_gemm as g8

pytestmark = pytest.mark.usefixtures("native_grouped_int8")  # skip without it; fail under CI where the CPU has it


def _case(m, n, k, group, seed=0, zeros=True, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(k // group, n, generator=g) * 0.002 + 0.0001
    z = torch.randint(-128, 128, (k // group, n), generator=g).float() if zeros else None
    b = torch.randn(n, generator=g) if bias else None
    return x, q, scales, z, b


def _reference(x, q, scales, z, group, b=None):
    """The float32 reference, with the weights rounded to bf16 where the kernel dequantizes them (many rows in the
    AVX-512 build; not one scale per channel without zero points, which it keeps exact)."""
    exact = not g8.rounds_weights(x.shape[0]) or (z is None and group == q.shape[1])
    rounded = torch.float32 if exact else torch.bfloat16
    return g8.reference_grouped_int8_gemm(x, q, scales, z, group, b, weights_dtype=rounded)


def _check(x, q, scales, z, group, b=None):
    out = g8.grouped_int8_gemm(x, g8.pack(q), scales, z, group, b)
    ref = _reference(x, q, scales, z, group, b)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("m", [1, 2, 3, 6, 7, 13, 15, 16, 17, 40, 64, 300])
@pytest.mark.parametrize(("n", "k", "group"), [(16, 128, 16), (48, 256, 32), (576, 576, 64), (80, 1536, 128),
                                               (40, 96, 96)])
@pytest.mark.parametrize("zeros", [True, False], ids=["zeros", "symmetric"])
def test_matches_the_reference(m, n, k, group, zeros):
    """Row tiles of 1..12 and their remainders, odd block counts, groups 16..128 and per channel (group = K);
    from DEQUANTIZE_ROWS the dequantizing path (uneven row tiles, items of 1-4 blocks, several per thread)."""
    _check(*_case(m, n, k, group, seed=m + n + k, zeros=zeros)[:4], group)


@pytest.mark.parametrize("n", [1, 7, 17, 33, 50, 63])
@pytest.mark.parametrize("m", [1, 5, 14, 20])
def test_output_counts_not_a_multiple_of_16(n, m):
    """The last 16-channel block is padded by pack; its scales, zeros and bias are read masked (N of them)."""
    x, q, scales, z, b = _case(m, n, 64, 32, seed=n, bias=True)
    _check(x, q, scales, z, 32, b)


@pytest.mark.parametrize("m", [4, 20])  # both paths
@pytest.mark.parametrize(("group", "zeros"), [(32, True), (256, False)], ids=["g32-zeros", "channel"])
def test_bias_and_strided_rows(m, group, zeros):
    x, q, scales, z, b = _case(m, 32, 256, group, zeros=zeros, bias=True)
    wide = torch.zeros(m, 300, dtype=torch.bfloat16)
    wide[:, :256] = x
    out = g8.grouped_int8_gemm(wide[:, :256], g8.pack(q), scales, z, group, b)
    torch.testing.assert_close(out.float(), _reference(x, q, scales, z, group, b).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("m", [1, 16])  # both paths
@pytest.mark.parametrize("group", [32, 64], ids=["grouped", "channel"])
def test_extreme_values_are_exact(m, group):
    """-128 and 127 widen (and dequantize) to bf16 exactly: a one-hot x reads back the weight column times its
    scale; with zero point -128 the 255 steps of an unsigned 8-bit format come back exactly too."""
    q = torch.tensor([[-128, 127] * 32] * 16, dtype=torch.int8)
    x = torch.zeros(m, 64, dtype=torch.bfloat16)
    x[:, 1] = 1.0
    scales = torch.full((64 // group, 16), 0.5)
    out = g8.grouped_int8_gemm(x, g8.pack(q), scales, None, group)
    assert torch.equal(out, torch.full((m, 16), 63.5, dtype=torch.bfloat16))
    out = g8.grouped_int8_gemm(x, g8.pack(q), scales, torch.full_like(scales, -128.0), group)
    assert torch.equal(out, torch.full((m, 16), 127.5, dtype=torch.bfloat16))


def test_the_bf16_rounding_is_the_only_difference_between_the_paths():
    """Rows alone (weights as stored) and in a batch (dequantized to bf16 by the AVX-512 build) against the float32
    reference: both within bf16 of it (rtol 2^-7 is 2 bf16 ulps of the output, the batch's weights add ~2^-9
    relative each), and the batch closer to the reference that rounds the weights as it does; the AVX2 build,
    which never rounds them, gives a row the same bits alone and in the batch."""
    x, q, scales, z, _ = _case(24, 96, 576, 32, seed=3)
    packed = g8.pack(q)
    batch = g8.grouped_int8_gemm(x, packed, scales, z, 32).float()
    alone = torch.cat([g8.grouped_int8_gemm(x[i:i + 1], packed, scales, z, 32) for i in range(24)]).float()
    exact = g8.reference_grouped_int8_gemm(x, q, scales, z, 32).float()
    rounded = g8.reference_grouped_int8_gemm(x, q, scales, z, 32, weights_dtype=torch.bfloat16).float()
    for out in (batch, alone):
        torch.testing.assert_close(out, exact, rtol=2**-7, atol=2e-2)
    if g8.rounds_weights(24):
        assert (batch - rounded).abs().mean() < (batch - exact).abs().mean()
    else:
        assert torch.equal(batch, alone)


def test_one_scale_per_channel_gives_a_row_the_same_bits_alone_or_in_a_batch():
    """Per channel without zero points the batch path keeps the int8 weights exact and scales the float32 sums,
    as the few-rows path does (compressed-tensors W8A16 channel: decode and prefill agree). (With a bias the
    few-rows path rounds once more, scale then bias; the batch adds it in the same FMA.)"""
    x, q, scales, _, _ = _case(40, 50, 576, 576, seed=4, zeros=False)
    packed = g8.pack(q)
    batch = g8.grouped_int8_gemm(x, packed, scales, None, 576)
    alone = torch.cat([g8.grouped_int8_gemm(x[i:i + 1], packed, scales, None, 576) for i in range(40)])
    assert torch.equal(batch, alone)


def test_pack_layout():
    q = (torch.arange(20 * 4) % 256 - 128).to(torch.int8).view(20, 4)
    p = g8.pack(q)
    assert p.shape == (2, 2, 16, 2) and p.dtype == torch.int8
    assert int(p[1, 1, 3, 0]) == int(q[19, 2]) and int(p[1, 1, 3, 1]) == int(q[19, 3])
    assert not p[1, :, 4:].any()  # channels 20..31 do not exist


@pytest.mark.parametrize("zeros", [True, False], ids=["zeros", "symmetric"])
@pytest.mark.parametrize("m", [1, 7, 20])
def test_float16_scales_and_zeros_give_the_float32_result_bit_for_bit(m, zeros):
    """float16 scales and zero points (GGUF's d, fp16 checkpoint scales) widened in the kernel give exactly what
    the same values in float32 give, 40 channels included (a masked partial last block)."""
    x, q, scales, z, b = _case(m, 40, 256, 32, seed=m, zeros=zeros, bias=True)
    scales = scales.half().float()
    packed = g8.pack(q)
    expected = g8.grouped_int8_gemm(x, packed, scales, z, 32, b)
    assert torch.equal(g8.grouped_int8_gemm(x, packed, scales.half(), None if z is None else z.half(), 32, b),
                       expected)
    _check(x, q, scales.half(), z, 32, b)


@pytest.mark.parametrize(("bad", "match"), [
    (lambda x, p, s, z: (x.half(), p, s, z, 32), "bfloat16"),
    (lambda x, p, s, z: (x, p, s, z, 24), "group_size"),
    (lambda x, p, s, z: (x, p, s[:1], z, 32), "scales"),
    (lambda x, p, s, z: (x, p, s, z[:, :16], 32), "zeros"),
    (lambda x, p, s, z: (x, p, s.bfloat16(), z, 32), r"scales .* float32 or float16"),
    (lambda x, p, s, z: (x, p, s[:, :8].contiguous(), None, 32), "blocks of 16"),
    (lambda x, p, s, z: (x[:, :128], p, s, z, 32), "columns"),
])  # fmt: skip
def test_bad_inputs_are_refused(bad, match):
    x, q, scales, zeros, _ = _case(2, 32, 256, 32)
    with pytest.raises(RuntimeError, match=match):
        g8.grouped_int8_gemm(*bad(x, g8.pack(q), scales, zeros))


@pytest.mark.parametrize("m", [1, 2, 3, 20])
@pytest.mark.parametrize(("n", "k", "group", "zeros"), [(50, 576, 32, False), (48, 256, 16, True), (40, 96, 96, False)])
def test_float32_activations_where_the_build_takes_them(m, n, k, group, zeros):
    """The AVX2 build takes float32 x (what an AVX2 engine runs, --dtype auto) and returns float32, the reference's
    float32 result up to the order of the sums; the AVX-512 build refuses it by name."""
    x, q, scales, z, b = _case(m, n, k, group, seed=m + n, zeros=zeros, bias=True)
    x = x.float() + torch.randn(x.shape, generator=torch.Generator().manual_seed(m)) * 1e-3  # not bf16 values
    if not g8.takes_float32():
        with pytest.raises(RuntimeError, match="bfloat16"):
            g8.grouped_int8_gemm(x, g8.pack(q), scales, z, group, b)
        return
    out = g8.grouped_int8_gemm(x, g8.pack(q), scales.half(), None if z is None else z.half(), group, b)
    assert out.dtype == torch.float32
    ref = g8.reference_grouped_int8_gemm(x, q, scales.half().float(), z, group, b)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
