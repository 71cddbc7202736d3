"""The native mixture-of-experts kernel (csrc/moe_cpu.cpp) against its per-expert PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from kubellm.kernels import cpu_grouped_int8_gemm, cpu_int4_gemm, cpu_moe

pytestmark = pytest.mark.usefixtures("native_moe")  # skip without it; fail under CI where the CPU has it


def _case(tokens, hidden, inter, experts, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(tokens, experts, generator=g)  # float32: no ties, whose order torch.topk leaves open
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(torch.bfloat16)
    down = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(torch.bfloat16)
    return x, logits, gate_up, down


def _check(x, logits, gate_up, down, top_k, renormalize):
    out = cpu_moe.moe_experts(x, logits, *cpu_moe.pack(gate_up, down), top_k, renormalize)
    ref = cpu_moe.reference_moe_experts(x, logits, gate_up, down, top_k, renormalize)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tokens", [1, 3, 13, 40])
@pytest.mark.parametrize(("hidden", "inter", "experts", "top_k"), [(64, 32, 128, 8), (48, 16, 8, 2), (80, 48, 4, 4)])
def test_matches_the_reference(tokens, hidden, inter, experts, top_k):
    """128 experts top-8 (Qwen3-30B-A3B's routing), row tiles of 1..12 and their remainders (40 tokens put more
    than 12 rows on an expert of 4), an odd number of 16-channel output blocks (48, 80)."""
    _check(*_case(tokens, hidden, inter, experts, seed=tokens + experts), top_k, renormalize=True)


@pytest.mark.parametrize("tokens", [1, 300])  # 300: routed by more than one thread (256 tokens per item)
def test_routing_without_renormalisation(tokens):
    """Qwen3-MoE with norm_topk_prob false keeps the softmax probabilities of the k chosen experts."""
    _check(*_case(tokens, 32, 16, 16, seed=5), top_k=4, renormalize=False)


def test_ties_go_to_the_lower_expert_id():
    """Equal logits (frequent among 128 bfloat16 ones) choose the lower id: expert 1 (not 3) beside expert 2."""
    hidden = inter = 16
    gate_up = torch.eye(inter, hidden).repeat(4, 2, 1).to(torch.bfloat16)
    down = torch.stack([torch.eye(hidden, inter) * (e + 1) for e in range(4)]).to(torch.bfloat16)
    x = torch.ones(1, hidden, dtype=torch.bfloat16)
    out = cpu_moe.moe_experts(x, torch.tensor([[0.0, 1.0, 2.0, 1.0]]), *cpu_moe.pack(gate_up, down), 2, True)
    h = torch.nn.functional.silu(torch.tensor(1.0)).item()
    p2 = torch.softmax(torch.tensor([2.0, 1.0]), 0)  # experts 2 and 1 (scales 3 and 2), renormalised
    torch.testing.assert_close(out.float(), torch.full((1, hidden), h * (3 * p2[0] + 2 * p2[1]).item()), rtol=1e-2,
                               atol=1e-2)


def test_each_choice_weights_its_own_expert():
    """Two experts whose down projections are +identity and -identity: the output is (w0 - w1) * h, so swapped
    weights, a dropped choice or a pair read from the wrong expert all change it."""
    hidden = inter = 16
    x = torch.randn(5, hidden).to(torch.bfloat16)
    gate_up = torch.cat([torch.eye(inter, hidden) * 4, torch.eye(inter, hidden)], 0).expand(2, -1, -1)
    down = torch.stack([torch.eye(hidden, inter), -torch.eye(hidden, inter)])
    first = torch.tensor([0.75, 0.25]).log()  # softmax: 0.75 for expert 0, 0.25 for expert 1
    logits = torch.stack([first, first.flip(0), first, first.flip(0), first])
    gate_up, down = gate_up.to(torch.bfloat16).contiguous(), down.to(torch.bfloat16)
    out = cpu_moe.moe_experts(x, logits, *cpu_moe.pack(gate_up, down), 2, True)
    h = (torch.nn.functional.silu(4 * x.float()).to(torch.bfloat16).float() * x.float()).to(torch.bfloat16).float()
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0]).unsqueeze(1)
    torch.testing.assert_close(out.float(), (sign * 0.5 * h).to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)


def test_pack_layout():
    """w13 holds gate block j then up block j, each as (k, k+1) pairs of 16 channels; w2 likewise for down."""
    e, inter, hidden = 2, 32, 16
    gate_up = torch.arange(e * 2 * inter * hidden, dtype=torch.float32).view(e, 2 * inter, hidden)
    down = torch.arange(e * hidden * inter, dtype=torch.float32).view(e, hidden, inter)
    w13, w2 = cpu_moe.pack(gate_up, down)
    assert w13.shape == (e, inter // 16, 2, hidden // 2, 16, 2) and w2.shape == (e, hidden // 16, inter // 2, 16, 2)
    # expert 1, block 1, the up half, input pair 3, channel 5, second of the pair: up row 16 + 5, column 7
    assert w13[1, 1, 1, 3, 5, 1] == gate_up[1, inter + 16 + 5, 7]
    assert w13[1, 1, 0, 3, 5, 0] == gate_up[1, 16 + 5, 6]
    assert w2[1, 0, 4, 9, 1] == down[1, 9, 9]
    unpacked_gate_up, unpacked_down = cpu_moe.unpack(w13, w2)  # what the fused decode layer's reference reads
    assert torch.equal(unpacked_gate_up, gate_up) and torch.equal(unpacked_down, down)


# A linear's form as the loaders hand it to the kernel: (bits, zero points). 4-bit values always have zero points
# (anywhere in 0..15, fractional for GGUF Q4_1/Q4_K); 8-bit ones none (GGUF Q8_0, GPTQ symmetric) or float ones
# (GGUF Q5_K, GPTQ asymmetric shifted by -128). 6-bit values (-32..31, GGUF Q6_K) and 5-bit ones (0..31 with float
# zero points, GGUF Q5_K) are int8 that the kernel widens by table.
INT4, INT8, INT8_ZEROS, INT6, INT5_ZEROS = (4, True), (8, False), (8, True), (6, False), (5, True)
_RANGES = {4: (0, 16), 8: (-128, 128), 6: (-32, 32), 5: (0, 32)}


def _quantized_case(tokens, hidden, inter, experts, group13, group2, seed=0, half=False, forms=(INT4, INT4)):
    """Random quantized experts as cpu_int4_gemm / cpu_grouped_int8_gemm pack them, stacked; ``forms`` the gate/up
    and down linears' (bits, zero points)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(tokens, experts, generator=g)

    def linear(n, k, group, form):
        bits, with_zeros = form
        low, top = _RANGES[bits]
        q = torch.randint(low, top, (experts, n, k), generator=g)
        scales = (torch.rand(experts, k // group, n, generator=g) + 0.5) / ((top - low) / 2 * k**0.5)
        zeros = torch.randint(0, 16, (experts, k // group, n), generator=g).float() if bits == 4 else \
            (torch.rand(experts, k // group, n, generator=g) - 0.5) * 64 if with_zeros else None
        if half:
            scales, zeros = scales.half(), None if zeros is None else zeros.half()
        pack = cpu_int4_gemm.pack if bits == 4 else cpu_grouped_int8_gemm.pack
        return (torch.stack([pack(w.to(torch.uint8 if bits == 4 else torch.int8)) for w in q]),
                cpu_moe.block_params(scales), None if zeros is None else cpu_moe.block_params(zeros))

    w13, s13, z13 = linear(2 * inter, hidden, group13, forms[0])
    w2, s2, z2 = linear(hidden, inter, group2, forms[1])
    return x, logits, cpu_moe.QuantizedExperts(w13, s13, z13, group13, w2, s2, z2, group2, cpu_moe.table_low(w13),
                                               cpu_moe.table_low(w2))


def _check_quantized(x, logits, experts, top_k, renormalize):
    out = cpu_moe.moe_quantized_experts(x, logits, experts, top_k, renormalize)
    ref = cpu_moe.reference_quantized_moe_experts(x, logits, experts, top_k, renormalize)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tokens", [1, 7, 40])
@pytest.mark.parametrize(("hidden", "inter", "experts", "top_k", "group13", "group2"),
                         [(64, 32, 128, 8, 32, 32), (128, 64, 8, 2, 64, 32), (80, 48, 4, 4, 16, 48)])
def test_int4_experts_match_the_reference(tokens, hidden, inter, experts, top_k, group13, group2):
    """4-bit experts: routing as above, 128 experts of which most get no token, groups of 16..64 that differ
    between the two linears, row tiles of 1..6 and remainders (40 tokens on 4 experts), an odd number of output
    blocks (80)."""
    _check_quantized(*_quantized_case(tokens, hidden, inter, experts, group13, group2, seed=tokens + experts),
                     top_k, True)


@pytest.mark.parametrize("tokens", [1, 7, 40])
@pytest.mark.parametrize(("forms", "hidden", "inter", "group13", "group2"), [
    ((INT8, INT8), 96, 64, 32, 32),  # GGUF Q8_0
    ((INT6, INT6), 80, 48, 16, 16),  # GGUF Q6_K
    ((INT5_ZEROS, INT5_ZEROS), 96, 64, 32, 32),  # GGUF Q5_K
    ((INT8, INT8), 80, 48, 16, 16),  # groups of 16, full int8 range
    ((INT8_ZEROS, INT8_ZEROS), 96, 64, 32, 32),  # GPTQ 8-bit asymmetric
    ((INT8_ZEROS, INT6), 80, 48, 80, 48),  # per channel (group = inputs), with and without zero points
    ((INT4, INT6), 96, 64, 32, 16),  # GGUF Q4_K_M: Q4_K gate/up, Q6_K down
    ((INT8, INT4), 80, 48, 16, 16),  # and 8-bit gate/up beside 4-bit down
], ids=["q8_0", "q6_k", "q5_k", "int8-g16", "int8-zeros", "per-channel", "4-bit-gate-up-6-bit-down",
        "8-bit-gate-up-4-bit-down"])
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_8bit_and_mixed_experts_match_the_reference(tokens, forms, hidden, inter, group13, group2, top_k):
    """8-bit experts (int8 values over their whole range) with the group sizes of the forms that occur, with and
    without float zero points, and layers whose two linears differ in width; row tiles of 1..6 and remainders,
    odd numbers of 16-channel output blocks (hidden 80), top-k 1 to 8 of 16 experts."""
    _check_quantized(*_quantized_case(tokens, hidden, inter, 16, group13, group2, seed=tokens + top_k, forms=forms),
                     top_k, True)


def test_narrow_8bit_values_get_a_value_table():
    """table_low gives the least value of int8 values within 64 consecutive ones (what the kernel's table widens):
    Q6_K's -32..31 and Q5_K's 0..31 get one, full-range int8 and 4-bit values none."""
    assert cpu_moe.table_low(torch.tensor([-32, 31, 0], dtype=torch.int8)) == -32
    assert cpu_moe.table_low(torch.tensor([0, 31], dtype=torch.int8)) == 0
    assert cpu_moe.table_low(torch.tensor([100, 127], dtype=torch.int8)) == 64  # the table stays within int8
    assert cpu_moe.table_low(torch.tensor([-32, 32], dtype=torch.int8)) is None
    assert cpu_moe.table_low(torch.tensor([0, 15], dtype=torch.uint8)) is None


def test_a_value_table_too_narrow_for_the_values_changes_the_result():
    """The table is what widens the values (a low 32 too high maps -32..-1 to 32..63): the kernel must take it from
    the values, not from their width."""
    x, logits, experts = _quantized_case(3, 80, 48, 16, 16, 16, forms=(INT6, INT6))
    assert experts.low13 == experts.low2 == -32
    good = cpu_moe.moe_quantized_experts(x, logits, experts, 2, True)
    bad = cpu_moe.moe_quantized_experts(x, logits, experts._replace(low2=0), 2, True)
    assert not torch.allclose(good.float(), bad.float(), atol=2e-2, rtol=2e-2)


def test_block_params_put_each_blocks_groups_one_after_another():
    """[E, groups, N] -> [E, N/16, groups, 16]: expert 1, channel 16 + 5, group 2 is block 1, group 2, lane 5."""
    t = torch.arange(2 * 3 * 32, dtype=torch.float32).view(2, 3, 32)
    b = cpu_moe.block_params(t)
    assert b.shape == (2, 2, 3, 16) and b.is_contiguous() and b[1, 1, 2, 5] == t[1, 2, 21]


def test_8bit_experts_take_float16_scales():
    """GGUF Q8_0's d is float16, kept so by the loader."""
    _check_quantized(*_quantized_case(9, 64, 32, 16, 32, 32, seed=4, half=True, forms=(INT8, INT8)), 4, True)


def test_8bit_experts_take_float16_scales_and_zero_points():
    """Q5_K's form (0..31 by table, float zero points) with both parameters float16: the tile's own inlined
    parameter loads (int8_tiles.h load_params16) widen half and float alike."""
    _check_quantized(*_quantized_case(9, 96, 64, 16, 32, 32, seed=5, half=True, forms=(INT5_ZEROS, INT5_ZEROS)),
                     4, True)


def test_int4_experts_take_float16_scales_and_no_renormalisation():
    _check_quantized(*_quantized_case(9, 64, 32, 16, 32, 32, seed=3, half=True), 4, False)


def test_quantized_experts_refuse_a_group_size_that_does_not_divide_the_inputs():
    x, logits, experts = _quantized_case(2, 64, 32, 4, 32, 32)
    with pytest.raises(RuntimeError, match=r"w2's group size \(24\) must be a multiple of 4 that divides 32"):
        cpu_moe.moe_quantized_experts(x, logits, experts._replace(group2=24), 2, True)
    x, logits, experts = _quantized_case(2, 64, 32, 4, 32, 32, forms=(INT8, INT8))
    with pytest.raises(RuntimeError, match=r"w13's group size \(6\) must be a multiple of 2 that divides 64"):
        cpu_moe.moe_quantized_experts(x, logits, experts._replace(group13=6), 2, True)


def test_4bit_experts_need_zero_points():
    x, logits, experts = _quantized_case(2, 64, 32, 4, 32, 32)
    with pytest.raises(RuntimeError, match="w13: 4-bit values need zero points"):
        cpu_moe.moe_quantized_experts(x, logits, experts._replace(z13=None), 2, True)
