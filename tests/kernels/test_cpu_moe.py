"""The native mixture-of-experts kernel (csrc/moe_cpu.cpp) against its per-expert PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from kubellm.kernels import cpu_int4_gemm, cpu_moe

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


def _int4_case(tokens, hidden, inter, experts, group13, group2, seed=0, half=False):
    """Random 4-bit experts as cpu_int4_gemm packs them, stacked; zero points anywhere in 0..15."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(tokens, experts, generator=g)

    def linear(n, k, group):
        q = torch.randint(0, 16, (experts, n, k), generator=g, dtype=torch.uint8)
        scales = (torch.rand(experts, k // group, n, generator=g) + 0.5) / (8 * k**0.5)
        zeros = torch.randint(0, 16, (experts, k // group, n), generator=g).float()
        if half:
            scales, zeros = scales.half(), zeros.half()
        return torch.stack([cpu_int4_gemm.pack(w) for w in q]), scales, zeros

    w13, s13, z13 = linear(2 * inter, hidden, group13)
    w2, s2, z2 = linear(hidden, inter, group2)
    return x, logits, cpu_moe.Int4Experts(w13, s13, z13, group13, w2, s2, z2, group2)


@pytest.mark.parametrize("tokens", [1, 7, 40])
@pytest.mark.parametrize(("hidden", "inter", "experts", "top_k", "group13", "group2"),
                         [(64, 32, 128, 8, 32, 32), (128, 64, 8, 2, 64, 32), (80, 48, 4, 4, 16, 48)])
def test_int4_experts_match_the_reference(tokens, hidden, inter, experts, top_k, group13, group2):
    """4-bit experts: routing as above, 128 experts of which most get no token, groups of 16..64 that differ
    between the two linears, row tiles of 1..6 and remainders (40 tokens on 4 experts), an odd number of output
    blocks (80)."""
    x, logits, experts4 = _int4_case(tokens, hidden, inter, experts, group13, group2, seed=tokens + experts)
    out = cpu_moe.moe_int4_experts(x, logits, experts4, top_k, True)
    ref = cpu_moe.reference_int4_moe_experts(x, logits, experts4, top_k, True)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_int4_experts_take_float16_scales_and_no_renormalisation():
    x, logits, experts4 = _int4_case(9, 64, 32, 16, 32, 32, seed=3, half=True)
    out = cpu_moe.moe_int4_experts(x, logits, experts4, 4, False)
    ref = cpu_moe.reference_int4_moe_experts(x, logits, experts4, 4, False)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_int4_experts_refuse_a_group_size_that_does_not_divide_the_inputs():
    x, logits, experts4 = _int4_case(2, 64, 32, 4, 32, 32)
    with pytest.raises(RuntimeError, match=r"w2's group size \(24\) must be a multiple of 4 that divides 32"):
        cpu_moe.moe_int4_experts(x, logits, experts4._replace(group2=24), 2, True)
