"""The native FP8 (e4m3fn) weight-only GEMM against its float32 reference."""

from __future__ import annotations

import pytest
import torch

from kubellm.kernels import cpu_fp8_gemm as f8

pytestmark = pytest.mark.usefixtures("native_fp8")  # skip without it; fail under CI where the CPU has it

FINITE_BYTES = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # 0x7f, 0xff: NaN


def _case(m, n, k, group, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 40).to(torch.float8_e4m3fn)  # subnormals up to 448
    scales = torch.rand(-(-k // group), n, generator=g) * 0.01 + 0.0005
    b = torch.randn(n, generator=g) if bias else None
    return x, w, scales, b


def _check(x, w, scales, group, b=None):
    out = f8.fp8_gemm(x, f8.pack(w), scales, group, b)
    rounded = f8.rounds_weights(x.shape[0], x.shape[1], group)  # the weights are rounded to bf16 there
    ref = f8.reference_fp8_gemm(x, w, scales, group, b, torch.bfloat16 if rounded else torch.float32)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("m", [1, 48])  # the widened bytes (few rows) and the dequantized tile (many)
def test_every_finite_e4m3_byte_widens_exactly(m):
    """A one-hot x reads back each weight byte times a scale of 1: all 254 finite values, subnormals, both
    zeros and +-448 included, exactly as torch.float8_e4m3fn converts them."""
    n = FINITE_BYTES.numel()
    raw = torch.zeros(n, 8, dtype=torch.uint8)
    raw[:, 5] = FINITE_BYTES  # input 5: the second pair of the second quad
    w = raw.view(torch.float8_e4m3fn)
    x = torch.zeros(m, 8, dtype=torch.bfloat16)
    x[:, 5] = 1.0
    out = f8.fp8_gemm(x, f8.pack(w), torch.ones(1, n), 8)
    expected = w[:, 5].float()
    assert torch.equal(out.float(), expected.expand(m, n))  # every e4m3 value is a bf16 value
    scaled = f8.fp8_gemm(x, f8.pack(w), torch.full((1, n), 2.0**-5), 8)
    assert torch.equal(scaled.float(), expected.expand(m, n) * 2.0**-5)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 8, 12, 13, 15, 16, 17, 25, 47, 48, 64, 130, 300])
@pytest.mark.parametrize(("n", "k", "group"), [(16, 128, 128), (48, 256, 32), (576, 576, 128), (80, 1536, 128),
                                               (40, 96, 96), (33, 100, 100)])
def test_matches_the_reference(m, n, k, group):
    """Row tiles of 1..12 and their remainders, the dequantizing path from 16 rows per channel (group = K) and
    from 48 with 128-input groups (a 128 x 128 block scale's rows), 576 inputs ending in a group of 64."""
    _check(*_case(m, n, k, group, seed=m + n + k)[:3], group)


@pytest.mark.parametrize(("n", "k"), [(576, 576), (80, 1536), (33, 100)])
def test_per_channel_rows_alone_and_batched_are_the_same_bits(n, k):
    """One scale per channel: the batch's scratch holds the exact widened bytes and the scale multiplies the sums,
    as the few-rows path does, so each row of a batch (16+ rows) is what that row alone (1 row) gives."""
    x, w, scales, b = _case(40, n, k, k, seed=n, bias=True)
    packed = f8.pack(w)
    assert not f8.rounds_weights(40, k, k) and f8.rounds_weights(f8.DEQUANTIZE_ROWS, k, 64)
    batch = f8.fp8_gemm(x, packed, scales, k, b)
    alone = torch.cat([f8.fp8_gemm(x[i:i + 1], packed, scales, k, b) for i in range(40)])
    assert torch.equal(batch, alone)
    _check(x, w, scales, k, b)


@pytest.mark.parametrize("n", [1, 7, 17, 33, 50, 63, 100])
@pytest.mark.parametrize("m", [1, 5, 14, 50])
def test_output_counts_not_a_multiple_of_16_or_64(n, m):
    """The last 16-channel block is padded by pack; its scales and bias are read masked (N of them)."""
    x, w, scales, b = _case(m, n, 192, 64, seed=n, bias=True)
    _check(x, w, scales, 64, b)


@pytest.mark.parametrize("m", [3, 50])
def test_bias_and_strided_rows(m):
    x, w, scales, b = _case(m, 32, 256, 128, bias=True)
    wide = torch.zeros(m, 300, dtype=torch.bfloat16)
    wide[:, :256] = x
    out = f8.fp8_gemm(wide[:, :256], f8.pack(w), scales, 128, b)
    assert torch.equal(out, f8.fp8_gemm(x, f8.pack(w), scales, 128, b))
    _check(x, w, scales, 128, b)


@pytest.mark.parametrize("m", [1, 7, 60])
def test_float16_scales_give_the_float32_result_bit_for_bit(m):
    x, w, scales, b = _case(m, 40, 256, 128, seed=m, bias=True)
    scales = scales.half().float()
    packed = f8.pack(w)
    assert torch.equal(f8.fp8_gemm(x, packed, scales.half(), 128, b), f8.fp8_gemm(x, packed, scales, 128, b))


def test_pack_layout_and_unpack():
    """Byte 16 l + 8 p + i of a quad is pair p's byte 8 l + i, pair bytes being (channel c, input j) at 2 c + j."""
    w = torch.arange(20 * 8, dtype=torch.int32).remainder(251).to(torch.uint8).view(20, 8).view(torch.float8_e4m3fn)
    p = f8.pack(w)
    raw = w.view(torch.uint8)
    assert p.shape == (2, 2, 64) and p.dtype == torch.uint8
    # block 1, quad 1 (inputs 4..7), pair p = 1 (inputs 6, 7), channel c = 3 (row 19), j = 1: pair byte 7
    assert int(p[1, 1, 16 * 0 + 8 * 1 + 7]) == int(raw[19, 7])
    # channel c = 4 (row 4 of block 0), j = 0: pair byte 8 → l = 1, i = 0; pair p = 0 (inputs 0, 1 of quad 0)
    assert int(p[0, 0, 16 * 1 + 0]) == int(raw[4, 0])
    assert not p[1].view(2, 4, 2, 8)[:, 1:].any()  # channels 20..31 (pair bytes 8..31) do not exist
    assert torch.equal(f8.unpack(p, 20).view(torch.uint8), raw)


def test_packable_shapes():
    assert f8.packable(576, -1) and f8.packable(576, 128) and f8.packable(100, 100)
    assert not f8.packable(98, -1) and not f8.packable(96, 6)


@pytest.mark.parametrize(("bad", "match"), [
    (lambda x, p, s: (x.float(), p, s, 128), "bfloat16"),
    (lambda x, p, s: (x, p, s, 6), "group_size"),
    (lambda x, p, s: (x, p, s[:1], 64), "scales"),
    (lambda x, p, s: (x, p, s.bfloat16(), 128), r"scales .* float32 or float16"),
    (lambda x, p, s: (x, p, s[:, :8].contiguous(), 128), "blocks of 16"),
    (lambda x, p, s: (x[:, :128], p, s, 128), "columns"),
    (lambda x, p, s: (x, p.view(p.shape[0], -1, 32), s, 128), "packed"),
])  # fmt: skip
def test_bad_inputs_are_refused(bad, match):
    x, w, scales, _ = _case(2, 32, 256, 128)
    with pytest.raises(RuntimeError, match=match):
        f8.fp8_gemm(*bad(x, f8.pack(w), scales))
