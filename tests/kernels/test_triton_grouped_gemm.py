"""kernels/triton_grouped_gemm.py (the CUDA GEMM of pre-quantized 4/8-bit checkpoints) through Triton's
interpreter on tiny shapes: the kernel against ``x @ QuantizedWeight.dequantize().T`` (runtime/layers/quantized_weight.py,
independent of the packing), over 4 and 8 bits, groups 32/64/128 and per channel, asymmetric and symmetric
zero points, act-order ``g_idx``, bias, partial row/column tiles and strided rows; GPTQ's qweight words and
every GGUF block type's form multiply as their readers say; the packed words pinned; a wrong nibble order or
an off-by-one zero point fails the same comparison.

Tolerances: float32 activations 1e-4 absolute + 1e-5 relative (accumulation order only); bf16 1e-2 + 2^-7
relative (the output's own rounding: the reference stays float32 on the same rounded inputs).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from test_gguf_blocks import _random_blocks

from kubellm.kernels import triton_check
from kubellm.kernels import triton_grouped_gemm as tg
from kubellm.runtime.layers.quantized_weight import QuantizedWeight
from kubellm.runtime.quantization import gguf as gguf_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-2, "rtol": 2**-7}}


def _weight(n: int, k: int, bits: int, group: int, zero_mode: str, seed: int, g_idx: torch.Tensor | None = None):
    """A QuantizedWeight as the readers return them. zero_mode: ``asym`` (unsigned values, zeros anywhere in
    range: AWQ, GPTQ asymmetric), ``mid`` (unsigned values, zero 2^(bits-1) stored: GPTQ symmetric),
    ``signed`` (signed values, no zeros: compressed-tensors symmetric) or ``signed-asym`` (signed values and
    zeros: compressed-tensors asymmetric)."""
    gen = torch.Generator().manual_seed(seed)
    groups = 1 if group <= 0 else k // group
    top = 1 << bits
    values = torch.randint(0, top, (n, k), generator=gen)
    scales = torch.rand(n, groups, generator=gen) / (10 if bits == 4 else 300) + 1e-3
    if zero_mode == "signed":
        return QuantizedWeight((values - top // 2).to(torch.int8), scales, None, group, g_idx)
    zeros = (torch.randint(0, top, (n, groups), generator=gen) if zero_mode.endswith("asym")
             else torch.full((n, groups), top // 2))
    if zero_mode == "signed-asym":
        return QuantizedWeight((values - top // 2).to(torch.int8), scales, zeros - top // 2, group, g_idx)
    return QuantizedWeight(values.to(torch.int32), scales, zeros.to(torch.int32), group, g_idx)


def _run(x: torch.Tensor, w: tg.GroupedWeight, bias: torch.Tensor | None, **blocks) -> torch.Tensor:
    on = [None if t is None else t.to(DEVICE) for t in (x, w.packed, w.scales, w.zeros, w.perm, bias)]
    return tg.grouped_gemm(*on, w.group, w.bits, **blocks).cpu()


def _expected(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.float() @ qw.dequantize().T
    return y if bias is None else y + bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("zero_mode", ["asym", "mid", "signed", "signed-asym"])
@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_equals_the_dequantized_weight_over_groups_and_zero_points(bits, zero_mode, dtype):
    """M 3 and 17 (a partial second row tile), N 40 and 24 (partial column tiles), K 256, 128 and 200 (per
    channel: a partial last K tile)."""
    for i, (m, n, k, group) in enumerate([(3, 40, 256, 32), (17, 24, 256, 64), (3, 40, 128, 128),
                                          (2, 24, 200, -1)]):
        qw = _weight(n, k, bits, group, zero_mode, seed=i + 10 * bits)
        gen = torch.Generator().manual_seed(i)
        x = torch.randn(m, k, generator=gen).to(dtype)
        bias = torch.randn(n, generator=gen) if i % 2 else None
        w = tg.pack(qw, bits)
        assert w.perm is None and (w.zeros is None) == (zero_mode == "signed")
        out = _run(x, w, bias, block_n=32)
        torch.testing.assert_close(out.float(), _expected(x, qw, bias), **TOL[dtype])
        torch.testing.assert_close(out.float(), tg.reference_grouped_gemm(x, w.packed, w.scales, w.zeros, w.perm,
                                                                          bias, w.group, bits).float(), **TOL[dtype])


@pytest.mark.parametrize("bits", [4, 8])
def test_act_order_sorts_the_inputs_once_and_both_orderings_equal_the_reference(bits):
    """GPTQ desc_act: g_idx assigns inputs to groups out of order. The kernel reads x through ``perm`` itself,
    or the caller passes x already permuted: both equal the g_idx-aware dequantized weight."""
    n, k, group = 40, 256, 64
    gen = torch.Generator().manual_seed(5)
    g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=gen)].to(torch.int32)
    qw = _weight(n, k, bits, group, "asym", seed=6, g_idx=g_idx)
    x, bias = torch.randn(5, k, generator=gen), torch.randn(n, generator=gen)
    w = tg.pack(qw, bits)
    assert w.perm is not None and torch.equal(g_idx[w.perm].long(), torch.arange(k) // group)
    expected = _expected(x, qw, bias)
    torch.testing.assert_close(_run(x, w, bias, block_n=32), expected, **TOL[torch.float32])
    permuted = tg.GroupedWeight(w.packed, w.scales, w.zeros, None, w.group, w.bits)
    torch.testing.assert_close(_run(x[:, w.perm], permuted, bias, block_n=32), expected, **TOL[torch.float32])
    ignored = _run(x, permuted, bias, block_n=32)  # forgetting the permutation is wrong, not silently right
    assert not torch.allclose(ignored, expected, atol=1e-2, rtol=1e-2)
    trivial = _weight(n, k, bits, group, "asym", seed=6, g_idx=(torch.arange(k) // group).to(torch.int32))
    assert tg.pack(trivial, bits).perm is None


@pytest.mark.parametrize("dot", [True, False], ids=["dot", "gemv"])
@pytest.mark.parametrize("zero_mode", ["asym", "signed"])
@pytest.mark.parametrize(("bits", "group", "block_k"), [(4, 32, 128), (4, 128, 128), (4, 128, 256), (4, -1, 128),
                                                         (8, 32, 64), (8, 128, 64), (8, 32, 128), (8, -1, 128)])
def test_each_bit_field_dot_and_the_gemv_form_equal_the_reference_at_one_three_and_seventeen_rows(
        bits, group, block_k, zero_mode, dot):
    """The word tile loaded once and multiplied per bit field, with scales after the dot (the tile inside a group:
    group 128 under 128-input tiles, 8-bit group 128 under 64, per channel) and before it (group 32 under 128 or
    64, group 128 under 256); with zero points and without (the implied 2^(bits-1)); tl.dot and the GEMV form.
    K 256 (one or two K tiles), N 40 (a partial 32-column tile), M 1, 3 and 17 (a partial second row tile)."""
    n, k = 40, 256
    qw = _weight(n, k, bits, group, zero_mode, seed=bits + group)
    w = tg.pack(qw, bits)
    assert (w.zeros is None) == (zero_mode == "signed")
    for m in (1, 3, 17):
        gen = torch.Generator().manual_seed(m)
        x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
        blocks = dict(block_n=32, block_k=block_k, dot=dot, block_m=None if dot else 2, form="fields")
        torch.testing.assert_close(_run(x, w, bias if m != 3 else None, **blocks),
                                   _expected(x, qw, bias if m != 3 else None), **TOL[torch.float32])


@pytest.mark.parametrize("form", tg.FORMS)
@pytest.mark.parametrize("zero_mode", ["asym", "signed"])
@pytest.mark.parametrize(("bits", "group"), [(4, 32), (4, 128), (4, -1), (8, 32), (8, 128), (8, -1)])
def test_both_forms_equal_the_reference_at_one_to_seventeen_rows(bits, group, zero_mode, form):
    """Each form forced (whatever M's default), tl.dot at M 1, 3, 8, 9 and 17 and the GEMV form at M <= 8, with
    their own default tilings otherwise; K 256, N 40 (a partial column tile); bias at odd M."""
    n, k = 40, 256
    qw = _weight(n, k, bits, group, zero_mode, seed=3 * bits + group)
    w = tg.pack(qw, bits)
    for m in (1, 3, 8, 9, 17):
        gen = torch.Generator().manual_seed(m)
        x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen) if m % 2 else None
        for dot in (True, False) if m <= 8 else (True,):
            torch.testing.assert_close(_run(x, w, bias, form=form, dot=dot), _expected(x, qw, bias),
                                       **TOL[torch.float32])


@pytest.mark.parametrize("form", tg.FORMS)
def test_act_order_through_both_forms_in_bf16(form):
    n, k, group = 24, 256, 64
    gen = torch.Generator().manual_seed(21)
    g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=gen)].to(torch.int32)
    qw = _weight(n, k, 4, group, "asym", seed=22, g_idx=g_idx)
    w = tg.pack(qw, 4)
    assert w.perm is not None
    for m in (1, 9):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        torch.testing.assert_close(_run(x, w, None, form=form).float(), _expected(x, qw, None), **TOL[torch.bfloat16])


class _Recorder:
    def __init__(self):
        self.calls = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls += 1
        return launch


def test_fields_form_up_to_eight_rows_words_form_above_and_a_forced_form_is_launched(monkeypatch):
    """form_for is the whole rule (run 3 / run 4 H200 numbers in its docstring), and grouped_gemm launches the
    kernel it names unless the tiling forces one; an unknown form is refused."""
    assert [tg.form_for(m) for m in (1, 2, 8, 9, 17, 32, 256)] == ["fields"] * 3 + ["words"] * 4
    w = tg.pack(_weight(8, 128, 4, 32, "asym", 0), 4)
    for m, forced, want in [(8, None, "fields"), (9, None, "words"), (1, "words", "words"), (32, "fields", "fields")]:
        kernels = {"fields": _Recorder(), "words": _Recorder()}
        monkeypatch.setattr(tg, "_grouped_gemm_kernel", kernels["fields"])
        monkeypatch.setattr(tg, "_grouped_gemm_words_kernel", kernels["words"])
        tiling = {} if forced is None else {"form": forced}
        tg.grouped_gemm(torch.zeros(m, 128), w.packed, w.scales, w.zeros, None, None, 32, 4, **tiling)
        assert {f: r.calls for f, r in kernels.items()} == {f: int(f == want) for f in kernels}, (m, forced)
    with pytest.raises(ValueError, match="form must be one of"):
        tg.grouped_gemm(torch.zeros(1, 128), w.packed, w.scales, w.zeros, None, None, 32, 4, form="bytes")


def test_both_scale_placements_are_exercised():
    """The cases above reach both branches of the kernel (a failure here means the parameters drifted)."""
    assert tg.scales_after_dot(128, 256, 128) and tg.scales_after_dot(256, 256, 128)
    assert not tg.scales_after_dot(32, 256, 128) and not tg.scales_after_dot(128, 256, 256)
    assert not tg.scales_after_dot(48, 384, 64)  # a group not a multiple of the tile: tiles straddle groups


@pytest.mark.parametrize("bits", [4, 8])
def test_act_order_through_the_gemv_form(bits):
    n, k, group = 24, 256, 32
    gen = torch.Generator().manual_seed(15)
    g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=gen)].to(torch.int32)
    qw = _weight(n, k, bits, group, "asym", seed=16, g_idx=g_idx)
    x = torch.randn(3, k, generator=gen).to(torch.bfloat16)
    w = tg.pack(qw, bits)
    assert w.perm is not None
    out = _run(x, w, None, block_n=16, dot=False)
    torch.testing.assert_close(out.float(), _expected(x, qw, None), **TOL[torch.bfloat16])


def test_extreme_values_and_zero_points_are_exact_and_strided_rows_are_read_by_their_stride():
    """4-bit 0 and 15 against zeros 0 and 15 (differences -15..15), 8-bit 0 and 255 against 0 and 255: with
    unit scales and integer activations every product and sum is exact in float32."""
    for bits in (4, 8):
        top = (1 << bits) - 1
        values = torch.tensor([0, top] * 64).view(1, 128).repeat(32, 1)
        values[1::2] = top - values[1::2]
        zeros = torch.tensor([[0, top]] * 16).view(32, 1).repeat(1, 2)
        qw = QuantizedWeight(values, torch.ones(32, 2), zeros, 64)
        wide = torch.randint(-3, 4, (3, 160)).float()
        x = wide[:, 16:144]  # rows strided by 160
        out = _run(x, tg.pack(qw, bits), None, block_n=16)
        assert torch.equal(out, x @ qw.dequantize().T)


def test_the_packed_words_hold_consecutive_inputs_low_bits_first():
    four = tg.pack(QuantizedWeight(torch.arange(8).view(1, 8), torch.ones(1, 1), None, -1), 4)
    assert four.packed.tolist() == [[0x76543210]] and four.zeros.tolist() == [[0.0]]  # unsigned, no zeros: 0
    eight = tg.pack(QuantizedWeight(torch.tensor([[1, 2, 3, 255]]), torch.ones(1, 1), torch.ones(1, 1), -1), 8)
    assert eight.packed.tolist() == [[0xFF030201 - (1 << 32)]]  # bit 31 set: a negative int32
    signed = tg.pack(QuantizedWeight(torch.tensor([[-8, 7] * 4], dtype=torch.int8), torch.ones(1, 1), None, -1), 4)
    assert signed.packed.tolist() == [[0xF0F0F0F0 - (1 << 32)]] and signed.zeros is None  # offset by 8
    assert torch.equal(tg.unpack(tg.pack(_weight(8, 64, 4, 32, "asym", 0), 4).packed, 4),
                       _weight(8, 64, 4, 32, "asym", 0).values)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_gptq_checkpoints_qweight_words_are_the_packed_words_and_multiply_as_read(bits):
    """GPTQ v1 words read by runtime/quantization/gptq.read_gptq (zeros stored minus one) pack back to the very same
    int32 words, and the kernel on them equals the reader's dequantized weight."""
    from kubellm.runtime.quantization.gptq import read_gptq

    gen = torch.Generator().manual_seed(bits)
    k, n, group = 128, 32, 32
    qweight = torch.randint(-2**31, 2**31, (k * bits // 32, n), generator=gen, dtype=torch.int64).to(torch.int32)
    qzeros = torch.randint(-2**31, 2**31, (k // group, n * bits // 32), generator=gen, dtype=torch.int64)
    qw = read_gptq(qweight, qzeros.to(torch.int32), torch.rand(k // group, n, generator=gen) / 50, None, bits, group)
    w = tg.pack(qw, bits)
    assert torch.equal(w.packed, qweight)
    x = torch.randn(2, k, generator=gen)
    torch.testing.assert_close(_run(x, w, None, block_n=16), _expected(x, qw, None), **TOL[torch.float32])


@pytest.mark.parametrize("type_name", list(gguf_blocks.BLOCKS))
def test_each_gguf_form_multiplies_as_gguf_dequantizes_it(type_name):
    """GGUF blocks read by runtime/quantization/gguf.py (float zeros for the affine types, signed Q8_0/Q6_K values,
    Q6_K's group 16) through this kernel equal gguf's own dequantization of the same bytes."""
    n, k = 40, 256
    raw = _random_blocks(type_name, n, k, seed=7)
    form = gguf_blocks.unpack(type_name, torch.from_numpy(raw), k)
    w = tg.pack(form, 4 if form.kernel == "int4" else 8)  # a BlockForm reads like a QuantizedWeight
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(7))
    ref = x @ torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[type_name]).reshape(n, k)).T
    torch.testing.assert_close(_run(x, w, None, block_n=32), ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("mutation", ["nibble order", "zero off by one"])
def test_a_mutated_layout_fails_the_comparison(mutation):
    """The comparison the tests above rely on catches a packing with the inputs of each word reversed, and
    zero points one off."""
    qw = _weight(24, 128, 4, 32, "asym", seed=8)
    w = tg.pack(qw, 4)
    if mutation == "nibble order":
        reversed_words = tg.unpack(w.packed, 4).reshape(24, 16, 8).flip(-1).reshape(24, 128)
        w = tg.pack(SimpleNamespace(values=reversed_words, scales=qw.scales, zeros=qw.zeros, group_size=32,
                                    g_idx=None), 4)
    else:
        w = tg.GroupedWeight(w.packed, w.scales, w.zeros + 1, None, w.group, w.bits)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(9))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(_run(x, w, None, block_n=16), _expected(x, qw, None), **TOL[torch.float32])


def test_what_cannot_be_packed_or_multiplied_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"must lie in \[0, 15\] or \[-8, 7\], got \[0, 16\]"):
        tg.pack(QuantizedWeight(torch.tensor([[0, 16] * 16]), torch.ones(1, 1), None, -1), 4)
    with pytest.raises(ValueError, match="group a multiple of 16 or per channel"):
        tg.pack(_weight(8, 64, 4, 32, "asym", 0).__class__(torch.zeros(8, 64, dtype=torch.int32),
                                                          torch.ones(8, 8), None, 8), 4)
    assert not tg.packable(4, 8, 100, -1) and tg.packable(8, 8, 100, -1) and not tg.packable(3, 8, 96, 32)
    uneven = (torch.arange(128) // 32).to(torch.int32)
    uneven[0] = 1  # group 0 has 31 inputs, group 1 has 33
    with pytest.raises(ValueError, match="g_idx must give each of the 4 groups 32 inputs"):
        tg.pack(_weight(8, 128, 4, 32, "asym", 0, g_idx=uneven), 4)
    w = tg.pack(_weight(8, 128, 4, 32, "asym", 0), 4)
    with pytest.raises(ValueError, match=r"packed must be int32 \[K \* 4 / 32, N\] for K = 64"):
        tg.grouped_gemm(torch.zeros(1, 64), w.packed, w.scales, w.zeros, None, None, 32, 4)
    with pytest.raises(ValueError, match=r"scales \(and zeros\) must be \[K / group, N\] = \[2, 8\]"):
        tg.grouped_gemm(torch.zeros(1, 128), w.packed, w.scales, w.zeros, None, None, 64, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bits", [4, 8])
def test_start_up_check_passes_the_sound_kernel_and_names_a_broken_one(bits, dtype, monkeypatch):
    assert triton_check.check_grouped_gemm(DEVICE, dtype, bits) is None
    sound = tg.grouped_gemm
    monkeypatch.setattr(tg, "grouped_gemm", lambda *a, **k: sound(*a, **k) * 1.05)
    assert f"grouped {bits}-bit GEMM differs from its reference" in triton_check.check_grouped_gemm(DEVICE, dtype,
                                                                                                     bits)
