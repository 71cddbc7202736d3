"""The fused decode layer (one native call per Llama layer) against its plain-PyTorch reference: the returned MLP
output, the residual stream and the K/V written into the pool; with Qwen3's q/k norms and with a mixture of
experts as the MLP; and its variant with a native GEMM per linear (decode_layer_q_: bf16, 4-bit with bf16 and
int8 activations, FP8 per channel and in blocks, grouped 8-bit with and without zero points, per-channel int8,
mixed within a layer)."""

from __future__ import annotations

import pytest
import torch

from kubellm.kernels import (
    cpu_bf16_gemm,
    cpu_fp8_gemm,
    cpu_grouped_int8_gemm,
    cpu_int4_gemm,
    cpu_int8_gemm,
    cpu_moe,
)
from kubellm.kernels.cpu_decode_layer import (
    BF16,
    FP8,
    GROUPED_INT8,
    INT4,
    INT8,
    decode_layer_,
    decode_layer_q_,
    reference_decode_layer_,
    reference_decode_layer_q_,
)
from kubellm.runtime.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.usefixtures("native_bf16_gemm")  # tests/conftest.py: skip without it, fail under CI

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, BLOCK = 96, 6, 2, 16, 160, 4
EXPERTS, TOP_K, EXPERT_INTER = 8, 2, 48


def make_layer(gen: torch.Generator, bias: bool, qk_norm: bool = False, moe: bool = False) -> dict:
    def unpacked(*shape):
        return (torch.randn(*shape, generator=gen) / shape[-1]**0.5).to(torch.bfloat16)

    def weight(n, k):
        return cpu_bf16_gemm.pack(unpacked(n, k))

    def norm(n):
        return (torch.rand(n, generator=gen) + 0.5).to(torch.bfloat16)

    qkv_n = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    rotary = RotaryEmbedding(HEAD_DIM, 64, 10000.0, None, torch.bfloat16)
    layer = dict(
        input_norm=norm(HIDDEN), post_norm=norm(HIDDEN), eps=1e-5,
        qkv=weight(qkv_n, HIDDEN), qkv_bias=torch.randn(qkv_n, generator=gen) if bias else None,
        o=weight(HIDDEN, HEADS * HEAD_DIM), gate_up=weight(2 * INTER, HIDDEN), down=weight(HIDDEN, INTER),
        intermediate=INTER, cos=rotary.cos, sin=rotary.sin, num_heads=HEADS, num_kv_heads=KV_HEADS,
        scale=HEAD_DIM**-0.5)
    if qk_norm:
        layer.update(q_norm=norm(HEAD_DIM), k_norm=norm(HEAD_DIM))
    if moe:
        w13, w2 = cpu_moe.pack(unpacked(EXPERTS, 2 * EXPERT_INTER, HIDDEN), unpacked(EXPERTS, HIDDEN, EXPERT_INTER))
        layer.update(gate_up=w13, down=w2, intermediate=EXPERT_INTER, router=weight(EXPERTS, HIDDEN), top_k=TOP_K,
                     renormalize=True)
    return layer


def _decode_rows(gen, context_lens):
    """Random decode rows (hidden, residual) and a K/V pool of earlier tokens (and unused blocks) with shuffled
    block tables: one query token per row at the end of its context; common = the op's position/table arguments."""
    t = len(context_lens)
    blocks_each = -(-max(context_lens) // BLOCK)
    num_blocks = t * blocks_each + 3
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    tables = torch.randperm(num_blocks, generator=gen)[: t * blocks_each].view(t, blocks_each).to(torch.int32)
    positions = torch.tensor([n - 1 for n in context_lens])
    slots = torch.stack([tables[i, p // BLOCK].long() * BLOCK + p % BLOCK for i, p in enumerate(positions.tolist())])
    hidden = torch.randn(t, HIDDEN, generator=gen).to(torch.bfloat16)
    residual = torch.randn(t, HIDDEN, generator=gen).to(torch.bfloat16)
    common = dict(positions=positions, slots=slots, block_tables=tables,
                  context_lens=torch.tensor(context_lens, dtype=torch.int32))
    return hidden, residual, k_cache, v_cache, common


@pytest.mark.parametrize("context_lens,bias,window,softcap,family", [
    ([1], False, 0, 0.0, "llama"),  # the first token: attends to itself only
    ([13], True, 0, 0.0, "llama"),  # Qwen2's qkv bias, a partly filled last block
    ([9, 20, 4], False, 0, 0.0, "llama"),  # several decode rows (a batched or drafted decode step)
    ([17], False, 5, 30.0, "llama"),  # a sliding window and soft-capped scores
    ([11], False, 0, 0.0, "qwen3"),  # per-head q/k RMSNorm before rotary
    ([6, 15], False, 0, 0.0, "qwen3_moe"),  # and a mixture of experts as the MLP (two rows: other experts each)
    ([10], False, 0, 0.0, "mixtral"),  # experts behind Llama's attention
])
def test_fused_decode_layer_matches_the_reference(context_lens, bias, window, softcap, family, request):
    if family in ("qwen3_moe", "mixtral"):
        request.getfixturevalue("native_moe")
    gen = torch.Generator().manual_seed(len(context_lens) * 100 + context_lens[0])
    layer = make_layer(gen, bias, qk_norm=family.startswith("qwen3"), moe=family in ("qwen3_moe", "mixtral"))
    t = len(context_lens)
    hidden, residual, k_cache, v_cache, common = _decode_rows(gen, context_lens)
    common.update(window=window, softcap=softcap)

    runs = {}
    for name, fn in (("kernel", decode_layer_), ("reference", reference_decode_layer_)):
        h, r, k, v = hidden.clone(), residual.clone(), k_cache.clone(), v_cache.clone()
        out = fn(h, r, k_cache=k, v_cache=v, **common, **layer)
        runs[name] = (out, r, k, v)
    out, res, k, v = runs["kernel"]
    ref_out, ref_res, ref_k, ref_v = runs["reference"]
    assert out.shape == (t, HIDDEN) and out.dtype == torch.bfloat16
    # bfloat16 roundings of GEMM sums taken in another order: a few ulps, carried through the layer
    torch.testing.assert_close(res.float(), ref_res.float(), atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(k.float(), ref_k.float(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(v.float(), ref_v.float(), atol=3e-2, rtol=2e-2)
    written = torch.zeros(k_cache.shape[0] * BLOCK, dtype=torch.bool)
    written[common["slots"]] = True  # every other slot of the pool is left as it was
    assert torch.equal(k.view(-1, KV_HEADS, HEAD_DIM)[~written], k_cache.view(-1, KV_HEADS, HEAD_DIM)[~written])
    assert not torch.equal(k.view(-1, KV_HEADS, HEAD_DIM)[written], k_cache.view(-1, KV_HEADS, HEAD_DIM)[written])


def test_a_slot_outside_the_pool_is_refused():
    gen = torch.Generator().manual_seed(0)
    layer = make_layer(gen, False)
    k_cache = torch.zeros(2, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="outside the KV pool"):
        decode_layer_(torch.randn(1, HIDDEN).to(torch.bfloat16), torch.zeros(1, HIDDEN, dtype=torch.bfloat16),
                      torch.tensor([0]), torch.tensor([2 * BLOCK]), torch.zeros(1, 1, dtype=torch.int32),
                      torch.tensor([1], dtype=torch.int32), k_cache=k_cache, v_cache=k_cache.clone(), **layer)


def test_a_q_norm_without_a_k_norm_is_refused():
    gen = torch.Generator().manual_seed(0)
    layer = make_layer(gen, False, qk_norm=True)
    del layer["k_norm"]
    k_cache = torch.zeros(2, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="q_norm and k_norm come together"):
        decode_layer_(torch.randn(1, HIDDEN).to(torch.bfloat16), torch.zeros(1, HIDDEN, dtype=torch.bfloat16),
                      torch.tensor([0]), torch.tensor([0]), torch.zeros(1, 1, dtype=torch.int32),
                      torch.tensor([1], dtype=torch.int32), k_cache=k_cache, v_cache=k_cache.clone(), **layer)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("context_lens,bias,qk_norm", [([13], True, False), ([60], False, False), ([30], False, True)])
def test_one_parallel_region_gives_the_op_by_op_layer_bit_for_bit(threads, context_lens, bias, qk_norm, monkeypatch):
    """A one-row layer in one parallel region (threads claim each GEMM's items, KUBELLM_LAYER_REGION unset) against
    each kernel in its own region (=0): the same bits at 2 threads and at 3 (on a 2-core host a thread may come
    late to a phase and find its share taken; one thread keeps the op-by-op path); Qwen3's q/k norms too."""
    gen = torch.Generator().manual_seed(threads * 10 + context_lens[0])
    layer = make_layer(gen, bias, qk_norm=qk_norm)
    t = len(context_lens)
    blocks_each = -(-max(context_lens) // BLOCK)
    shape = (t * blocks_each, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    tables = torch.arange(t * blocks_each, dtype=torch.int32).view(t, blocks_each)
    positions = torch.tensor([n - 1 for n in context_lens])
    slots = torch.stack([tables[i, p // BLOCK].long() * BLOCK + p % BLOCK for i, p in enumerate(positions.tolist())])
    hidden = torch.randn(t, HIDDEN, generator=gen).to(torch.bfloat16)
    residual = torch.randn(t, HIDDEN, generator=gen).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runs = {}
        for region in ("1", "0"):
            monkeypatch.setenv("KUBELLM_LAYER_REGION", region)
            h, r, k, v = hidden.clone(), residual.clone(), k_cache.clone(), v_cache.clone()
            outs = []
            for _ in range(3):  # three layers on one residual stream
                h = decode_layer_(h, r, positions, slots, tables, torch.tensor(context_lens, dtype=torch.int32),
                                  k_cache=k, v_cache=v, **layer)
                outs.append(h)
            runs[region] = (*outs, r, k, v)
    finally:
        torch.set_num_threads(before)
    for one, by_ops in zip(runs["1"], runs["0"], strict=True):
        assert torch.equal(one, by_ops)


GROUPS = (32, 16, 32, 32)  # qkv, o (96 inputs in groups of 16), gate_up, down


@pytest.mark.parametrize("context_lens,bias,int8,family", [
    ([1], False, (False,) * 4, "llama"),
    ([13], True, (True,) * 4, "llama"),  # float32 qkv bias; int8 activations everywhere (the VNNI default)
    ([9, 20, 4], False, (True, False, True, False), "llama"),  # several rows; each linear its own activations
    ([11], False, (False,) * 4, "qwen3"),
    ([6, 15], True, (True,) * 4, "qwen3"),
])
def test_q4_decode_layer_matches_the_reference(context_lens, bias, int8, family, native_int4, request):
    if any(int8):
        request.getfixturevalue("native_int4_int8")
    gen = torch.Generator().manual_seed(len(context_lens) * 100 + context_lens[0] + 7)
    layer = make_mixed_layer(gen, bias, (INT4,) * 4, GROUPS, qk_norm=family == "qwen3", int8=int8)
    _check_against_reference(gen, layer, context_lens, decode_layer_q_, reference_decode_layer_q_)


def _check_against_reference(gen, layer, context_lens, kernel, reference):
    """Runs ``kernel`` and ``reference`` on the same random decode rows, pool and tables: the MLP output, residual
    and K/V pool within a bf16 step or two, the pool's other slots untouched."""
    t = len(context_lens)
    hidden, residual, k_cache, v_cache, common = _decode_rows(gen, context_lens)
    runs = {}
    for name, fn in (("kernel", kernel), ("reference", reference)):
        h, r, k, v = hidden.clone(), residual.clone(), k_cache.clone(), v_cache.clone()
        runs[name] = (fn(h, r, k_cache=k, v_cache=v, **common, **layer), r, k, v)
    (out, res, k, v), (ref_out, ref_res, ref_k, ref_v) = runs["kernel"], runs["reference"]
    assert out.shape == (t, HIDDEN) and out.dtype == torch.bfloat16
    assert out.float().std() > 0.5  # outputs O(1): the tolerances are a bf16 step or two at that size
    # The reference quantizes activations as the kernel does and sums in float32/64: equal but for a rare bf16
    # rounding of a sum, carried through (measured: at most 1 ulp). bf16 instead of int8 activations in one
    # linear moves outputs by ~0.05; so does any linear's scale off by 5%.
    for got, want in ((res, ref_res), (out, ref_out), (k, ref_k), (v, ref_v)):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2)
    written = torch.zeros(k_cache.shape[0] * BLOCK, dtype=torch.bool)
    written[common["slots"]] = True
    assert torch.equal(k.view(-1, KV_HEADS, HEAD_DIM)[~written], k_cache.view(-1, KV_HEADS, HEAD_DIM)[~written])


def test_q4_decode_layer_refuses_a_linear_of_the_wrong_width(native_int4):
    gen = torch.Generator().manual_seed(1)
    layer = make_mixed_layer(gen, False, (INT4,) * 4, GROUPS, qk_norm=False)
    layer["intermediate"] = INTER - 16  # gate_up has 2 * INTER outputs
    k_cache = torch.zeros(2, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="linear 2 .* has 320 outputs, not 288"):
        decode_layer_q_(torch.randn(1, HIDDEN).to(torch.bfloat16), torch.zeros(1, HIDDEN, dtype=torch.bfloat16),
                        torch.tensor([0]), torch.tensor([0]), torch.zeros(1, 1, dtype=torch.int32),
                        torch.tensor([1], dtype=torch.int32), k_cache=k_cache, v_cache=k_cache.clone(), **layer)


SHAPES = {"qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), "o": (HIDDEN, HEADS * HEAD_DIM),
          "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}


def make_linear(gen: torch.Generator, kind: int, n: int, k: int, group: int, zeros: bool = False) -> tuple:
    """A random linear of ``kind`` as its layer hands its kernel it: (weight, scales, zeros, group_size), weights
    about 1/sqrt(k) (outputs O(1))."""
    if kind == BF16:
        return cpu_bf16_gemm.pack((torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)), None, None, 0
    if kind == INT4:
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        return (cpu_int4_gemm.pack(q), (torch.rand(k // group, n, generator=gen) + 0.5).div(4 * k**0.5).half(),
                torch.rand(k // group, n, generator=gen) * 4 + 6, group)
    if kind == FP8:  # e4m3 values ~N(0, 1); the last block shorter where group does not divide k
        w = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn)
        scales = (torch.rand(-(-k // group), n, generator=gen) + 0.5) / k**0.5
        return cpu_fp8_gemm.pack(w), scales, None, group
    if kind == GROUPED_INT8:  # -128..127 around a zero point (asymmetric) or 0
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        z = (torch.rand(k // group, n, generator=gen) * 8 - 4).round() if zeros else None
        return cpu_grouped_int8_gemm.pack(q), (torch.rand(k // group, n, generator=gen) + 0.5) / (74 * k**0.5), z, \
            group
    assert kind == INT8
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    return cpu_int8_gemm.pack(q), (torch.rand(n, generator=gen) + 0.5) / (74 * k**0.5), None, 0


def make_mixed_layer(gen: torch.Generator, bias: bool, kinds: tuple, groups: tuple, qk_norm: bool,
                     int8: tuple = (False,) * 4, zeros: bool = False) -> dict:
    """make_layer's dense layer with linear i of ``kinds[i]`` (group ``groups[i]``), laid out for decode_layer_q_."""
    layer = make_layer(gen, bias, qk_norm=qk_norm)
    for name in SHAPES:
        del layer[name]
    parts = [make_linear(gen, kind, *SHAPES[name], group, zeros)
             for kind, name, group in zip(kinds, SHAPES, groups, strict=True)]
    weights, scales, zero_points, group_sizes = (list(c) for c in zip(*parts, strict=True))
    layer.update(kinds=list(kinds), weights=weights, scales=scales, zeros=zero_points, group_sizes=group_sizes,
                 int8_activations=list(int8))
    return layer


@pytest.mark.parametrize("context_lens,bias,kinds,groups,zeros,family", [
    ([1], False, (FP8,) * 4, (-1, -1, -1, -1), False, "llama"),  # FP8 per channel (group = K)
    ([13], True, (FP8,) * 4, (32, 32, 32, 32), False, "llama"),  # FP8 blocks (128 x 128 read as 128-input groups)
    ([9, 20, 4], False, (FP8, FP8, FP8, FP8), (64, 64, 64, 64), False, "qwen3"),  # last group of 96/160 shorter
    ([11], False, (GROUPED_INT8,) * 4, (32, 16, 32, 32), False, "llama"),  # GPTQ 8-bit sym, Q8_0
    ([6, 15], True, (GROUPED_INT8,) * 4, (16, 32, 32, 16), True, "qwen3"),  # zero points (Q5_K, GPTQ asym)
    ([7], True, (INT8,) * 4, (0, 0, 0, 0), False, "llama"),  # --quantization int8, qkv bias
    ([5, 12], False, (INT4, GROUPED_INT8, INT4, GROUPED_INT8), (32, 16, 32, 16), False, "llama"),  # Q4_K_M-like
    ([10], True, (BF16, FP8, GROUPED_INT8, INT4), (0, 32, 32, 32), True, "qwen3"),  # every kind in one layer
    ([3], False, (INT8, INT4, BF16, FP8), (0, 16, 0, -1), False, "llama"),
])
def test_q_decode_layer_matches_the_reference(context_lens, bias, kinds, groups, zeros, family, native_int4,
                                              native_fp8, native_grouped_int8, native_int8):
    gen = torch.Generator().manual_seed(len(context_lens) * 100 + context_lens[0] + 11)
    groups = tuple(SHAPES[name][1] if g == -1 else g for g, name in zip(groups, SHAPES, strict=True))
    layer = make_mixed_layer(gen, bias, kinds, groups, qk_norm=family == "qwen3", zeros=zeros)
    _check_against_reference(gen, layer, context_lens, decode_layer_q_, reference_decode_layer_q_)


def test_q_decode_layer_reference_sees_a_wrong_scale(native_fp8, native_grouped_int8):
    """The comparison above can fail: one linear's scales 5% off in the reference breaks it."""
    gen = torch.Generator().manual_seed(3)
    layer = make_mixed_layer(gen, False, (FP8, GROUPED_INT8, FP8, GROUPED_INT8), (32, 32, 32, 32), qk_norm=False)

    def reference(*args, **kw):
        kw["scales"] = [s * 1.05 if i == 3 else s for i, s in enumerate(kw["scales"])]
        return reference_decode_layer_q_(*args, **kw)

    with pytest.raises(AssertionError):
        _check_against_reference(gen, layer, [8], decode_layer_q_, reference)


def test_q_decode_layer_refuses_unknown_kinds_and_missing_scales(native_fp8):
    gen = torch.Generator().manual_seed(2)
    layer = make_mixed_layer(gen, False, (FP8,) * 4, (32,) * 4, qk_norm=False)
    k_cache = torch.zeros(2, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    rows = (torch.randn(1, HIDDEN).to(torch.bfloat16), torch.zeros(1, HIDDEN, dtype=torch.bfloat16),
            torch.tensor([0]), torch.tensor([0]), torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="linear 1: unknown kind 7"):
        decode_layer_q_(*rows, k_cache=k_cache, v_cache=k_cache.clone(), **{**layer, "kinds": [FP8, 7, FP8, FP8]})
    with pytest.raises(RuntimeError, match="linear 2 .kind 2. needs its scales"):
        decode_layer_q_(*rows, k_cache=k_cache, v_cache=k_cache.clone(),
                        **{**layer, "scales": [*layer["scales"][:2], None, layer["scales"][3]]})
