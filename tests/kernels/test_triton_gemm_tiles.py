"""kernels/triton_gemm_tiles.py: how the Triton weight-only GEMMs tile and split their work (pure Python), and
split-K through each kernel (Triton's interpreter, tiny shapes): every split count gives the unsplit product,
the bias is added once, K tiles never straddle a scale group, and the pipelined tiles fit in shared memory.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_grouped_gemm import _expected, _weight

from kubellm.kernels import triton_fp8_gemm as tf
from kubellm.kernels import triton_gemm_tiles as tiles_mod
from kubellm.kernels import triton_grouped_gemm as tg
from kubellm.kernels import triton_int8_gemm as ti

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H200_SMS = 132
LAYERS = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # Llama-3-8B: qkv, o, gate_up, down


def _covers_k(t: tiles_mod.Tiles, k: int) -> bool:
    return t.split * t.k_split >= k > (t.split - 1) * t.k_split


@pytest.mark.parametrize(("n", "k"), LAYERS)
@pytest.mark.parametrize("m", [1, 8, 32])
def test_decode_gemms_split_k_until_every_sm_has_two_programs(m, n, k):
    t = tiles_mod.choose(m, n, k, sms=H200_SMS, k_multiple=32)
    programs = -(-m // t.block_m) * -(-n // t.block_n)
    assert programs * t.split >= 2 * H200_SMS or t.k_split <= 2 * tiles_mod.MIN_K_PER_SPLIT
    assert _covers_k(t, k) and t.k_split % t.block_k == 0 and t.k_split % 32 == 0
    if m <= tiles_mod.DECODE_ROWS:  # the H200 sweep's best decode tiles: 32 columns, about four programs per SM
        assert t.block_n == 32 and (programs * t.split >= 4 * H200_SMS or t.k_split <= 2 * tiles_mod.MIN_K_PER_SPLIT)
    if (m, n, k) == (1, 6144, 4096):  # 192 column tiles: 4 splits of 1024 inputs
        assert (t.block_m, t.block_n, t.block_k, t.split, t.k_split) == (16, 32, 128, 4, 1024)
    if (m, n, k) == (1, 28672, 4096):  # 896 column tiles fill the GPU alone
        assert t.split == 1


def test_batched_gemms_take_run_3s_tall_tiles_and_split_only_to_fill_one_wave():
    """Above DECODE_ROWS run 3's rule (its kernels' M=32/256 kit timings beat run 4's): 128 x 128 tiles on 8 warps
    for batches, one wave."""
    t = tiles_mod.choose(256, 6144, 4096, sms=H200_SMS)
    assert (t.block_m, t.block_n, t.num_warps) == (128, 128, 8)
    assert t.split == 2 and 2 * 48 * t.split >= H200_SMS  # 2 x 48 tiles, one wave
    assert tiles_mod.choose(256, 28672, 4096, sms=H200_SMS).split == 1  # 448 tiles fill the GPU alone
    assert tiles_mod.choose(128, 128, 4096, sms=H200_SMS, block_n=64).num_warps == 8  # 128 x 64: 8 warps (run 3)


# Run 3's choose (tree 757c7f3) at M > 8 for the kit's layers, read from that tree's code: (block_m, block_n,
# block_k, split, k_split, num_warps, num_stages). Its rule: 64 columns and two programs per SM up to 64 rows,
# 128 x 128 tiles on 8 warps and one wave beyond; stages 4 / 3 while they fit 160 KB.
RUN3 = {
    (9, 6144, 4096): (16, 64, 128, 4, 1024, 4, 4),  # 96 column tiles x 4 splits >= 2 x 132
    (32, 6144, 4096): (32, 64, 128, 4, 1024, 4, 4),
    (32, 4096, 14336): (32, 64, 128, 8, 1792, 4, 4),  # 64 column tiles x 8 splits
    (32, 28672, 4096): (32, 64, 128, 1, 4096, 4, 4),  # 448 column tiles: no split
    (256, 4096, 14336): (128, 128, 64, 4, 3584, 8, 3),
}


@pytest.mark.parametrize(("m", "n", "k"), list(RUN3))
def test_above_eight_rows_the_tiles_are_run_3s(m, n, k):
    """int8, FP8 per channel, and the grouped GEMM's words form (run 3's kernel) with groups of 32, whose K tile
    is the group."""
    x = torch.empty(m, k, dtype=torch.bfloat16)
    for args in (ti.tiling_args(x), tf.tiling_args(x, None), tg.tiling_args(x, 32, 4, "words")):
        t = tiles_mod.choose(m, n, k, **{**args, "sms": H200_SMS})
        want = RUN3[m, n, k]
        if args.get("w_bytes") == 4:
            want = (*want[:2], 32, *want[3:])
        assert (t.block_m, t.block_n, t.block_k, t.split, t.k_split, t.num_warps, t.num_stages) == want
        assert t.dot


def test_the_two_regimes_meet_at_eight_rows():
    """M <= 8: the run-3 sweep's decode rule (32 columns, four programs per SM); M = 9: run 3's rule."""
    eight, nine = (tiles_mod.choose(m, 6144, 4096, sms=H200_SMS) for m in (8, 9))
    assert (eight.block_n, eight.split) == (32, 4)  # 192 column tiles x 4 splits >= 4 x 132
    assert (nine.block_n, nine.split) == (64, 4)  # 96 column tiles x 4 splits >= 2 x 132
    assert tiles_mod.DECODE_ROWS == tg.FIELDS_MAX_ROWS == 8


def test_the_gemv_form_is_never_chosen_unasked_and_takes_row_tiles_of_one_to_eight():
    assert all(tiles_mod.choose(m, 6144, 4096, sms=H200_SMS).dot for m in (1, 3, 32, 256))
    assert [tiles_mod.choose(m, 6144, 4096, sms=H200_SMS, dot=False).block_m for m in (1, 2, 3, 8, 17)] == [
        1, 2, 4, 8, 8]
    assert tiles_mod.choose(1, 6144, 4096, sms=H200_SMS, dot=0, block_m=2).block_m == 2


def test_packed_kernels_k_tiles_hold_sixteen_words_per_bit_field():
    """The grouped kernel's dots run over K tile / (32 / bits) words: min_block_k keeps them at 16 or more, even
    when shared memory would shrink the tile."""
    t = tiles_mod.choose(256, 6144, 4096, sms=H200_SMS, min_block_k=128, max_block_k=256, x_bytes=4, w_bytes=1.5)
    assert t.block_k == 128 and t.num_stages == 2
    assert tiles_mod.choose(1, 64, 256, sms=H200_SMS, min_block_k=128, block_k=16).block_k == 128


def test_short_k_is_never_split_and_groups_bound_the_split_size():
    assert tiles_mod.choose(1, 64, 256, sms=H200_SMS).split == 1  # a split walks >= 256 inputs
    t = tiles_mod.choose(1, 64, 4096, sms=H200_SMS, max_block_k=64, k_multiple=192)
    assert t.block_k == 64 and t.k_split % 192 == 0 and _covers_k(t, 4096)
    forced = tiles_mod.choose(3, 40, 384, sms=H200_SMS, split=3, block_n=16)
    assert (forced.split, forced.k_split, forced.block_n) == (3, 128, 16)


@pytest.mark.parametrize(("m", "x_bytes", "w_bytes"), [(1, 2, 4), (64, 4, 4), (256, 4, 4), (256, 2, 1), (256, 4, 1.5)])
def test_pipelined_tiles_fit_the_shared_memory_budget(m, x_bytes, w_bytes):
    """The first H200 run asked for 262-352 KB per program (the limit is 227 KB): stages, then K tiles, shrink."""
    t = tiles_mod.choose(m, 6144, 4096, sms=H200_SMS, x_bytes=x_bytes, w_bytes=w_bytes)
    assert t.num_stages * t.block_k * (t.block_m * x_bytes + t.block_n * w_bytes) <= tiles_mod.SHARED_BYTES
    assert t.num_stages >= 2 and t.block_k >= 16 and _covers_k(t, 4096)


def _x_bias(m, k, n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen).to(dtype), torch.randn(n, generator=gen)


@pytest.mark.parametrize("form", tg.FORMS)
@pytest.mark.parametrize("split", [1, 2, 3])
@pytest.mark.parametrize("group", [16, 32, 64, 128, -1])
def test_grouped_gemm_split_k_and_in_tile_scales_equal_the_dequantized_weight(group, split, form):
    """K 384 in splits of whole groups (words) or whole K tiles (fields): words K tiles of 16-128 inputs (the
    group's), 128 per channel."""
    m, n, k = 3, 24, 384
    qw = _weight(n, k, 4, group, "asym", seed=group + 7)
    x, bias = _x_bias(m, k, n, torch.float32, seed=split)
    w = tg.pack(qw, 4)
    on = [None if t is None else t.to(DEVICE) for t in (x, w.packed, w.scales, w.zeros, w.perm, bias)]
    out = tg.grouped_gemm(*on, w.group, w.bits, split=split, block_n=16, block_k=128, form=form).cpu()
    torch.testing.assert_close(out, _expected(x, qw, bias), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int8_gemm_split_k_adds_the_bias_once(dtype):
    m, n, k = 5, 24, 512
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, generator=gen) / 100
    x, bias = _x_bias(m, k, n, dtype, seed=4)
    ref = ti.reference_int8_gemm(x, q, scales, bias).float()
    for split in (1, 2, 4):
        out = ti.int8_gemm(*(t.to(DEVICE) for t in (x, q, scales, bias)), split=split, block_n=16).cpu()
        torch.testing.assert_close(out.float(), ref, **({"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32
                                                       else {"atol": 1e-2, "rtol": 2**-7}))


@pytest.mark.parametrize("m", [1, 3, 17])
def test_int8_gemm_gemv_form_equals_the_reference(m):
    """Tiling dot=False: a broadcast multiply and float32 sum over K in place of tl.dot, row tiles of 1-8."""
    n, k = 40, 320
    gen = torch.Generator().manual_seed(m)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, generator=gen) / 100
    x, bias = _x_bias(m, k, n, torch.float32, seed=m + 1)
    ref = ti.reference_int8_gemm(x, q, scales, bias)
    for split in (1, 2):
        out = ti.int8_gemm(*(t.to(DEVICE) for t in (x, q, scales, bias)), split=split, block_n=16, dot=False).cpu()
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("block", [None, (16, 32)])
def test_fp8_gemm_split_k_keeps_block_scales_aligned(block):
    """Splits of whole 32-input scale columns (block 16 x 32) and per-channel scales: equal to the reference."""
    m, n, k = 3, 40, 320
    gen = torch.Generator().manual_seed(9)
    weight = (torch.randn(n, k, generator=gen) * 0.5).to(torch.float8_e4m3fn)
    scale = (torch.rand(n, generator=gen) + 0.5 if block is None
             else torch.rand(-(-n // 16), k // 32, generator=gen) + 0.5)
    x, bias = _x_bias(m, k, n, torch.float32, seed=10)
    ref = tf.reference_fp8_gemm(x, weight, scale, bias, block)
    for split in (2, 3):
        out = tf.fp8_gemm(*(t.to(DEVICE) for t in (x, weight, scale, bias)), block, split=split, block_n=16).cpu()
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)
