"""The fused CPU layer ops (RMSNorm, add + RMSNorm, SiLU-and-mul, rotary, q/k norm + rotary) against their PyTorch
references."""

from __future__ import annotations

import pytest
import torch

from kubellm.kernels import cpu_layer_ops as ops
from kubellm.runtime.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# bf16 results are bit-identical by construction (same rounding points); fp32 differs in the last ulps of the
# reductions / exp / FMA contraction; fp16 rounding of those fp32 ulps can flip one fp16 ulp.
ATOL = {torch.float32: 1e-5, torch.bfloat16: 0.0, torch.float16: 2e-3}


pytestmark = pytest.mark.usefixtures("native_kernels")  # tests/conftest.py: skip without them, fail under CI


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=ATOL[dtype] * scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 576), (37, 576), (300, 96), (5, 19)])
def test_rms_norm(dtype, tokens, hidden):
    g = torch.Generator().manual_seed(tokens * hidden)
    x = (torch.randn(tokens, hidden, generator=g) * 3).to(dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    close(ops.rms_norm(x, w, 1e-5), ops.reference_rms_norm(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reads_strided_rows(dtype):
    base = torch.randn(8, 100).to(dtype)
    x = base[:, 10:74]  # rows 100 apart, 64 contiguous columns
    w = torch.rand(64).to(dtype)
    close(ops.rms_norm(x, w, 1e-6), ops.reference_rms_norm(x.contiguous(), w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 576), (33, 576), (7, 40)])
def test_add_rms_norm_updates_both_in_place(dtype, tokens, hidden):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    res = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    x_ref, res_ref = x.clone(), res.clone()
    ops.add_rms_norm_(x, res, w, 1e-5)
    ops.reference_add_rms_norm_(x_ref, res_ref, w, 1e-5)
    assert torch.equal(res, res_ref)  # one rounded add: exact in every dtype
    close(x, x_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 1536), (50, 1536), (3, 23)])
def test_silu_and_mul(dtype, tokens, inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(tokens, 2 * inter, generator=g) * 6).to(dtype)  # far into both tails of sigmoid
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)
    out = ops.silu_and_mul(gate_up)
    assert out.shape == (tokens, inter)
    close(out, ops.reference_silu_and_mul(gate_up), dtype, scale=10)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 1, 32), (2, 2, 6)])
def test_rotary_in_place_on_fused_qkv_views(dtype, heads, kv_heads, head_dim):
    tokens, max_pos = 23, 4096
    rope = RotaryEmbedding(head_dim, max_pos, 10000.0, None, dtype)
    g = torch.Generator().manual_seed(heads)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    positions = torch.randint(0, max_pos, (tokens,), generator=g)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    q_ref, k_ref = rope(positions, q.clone(), k.clone())
    ops.rotary_embedding_(positions, q, k, rope.cos, rope.sin)
    close(q, q_ref, dtype)
    close(k, k_ref, dtype)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v is not touched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (4, 1, 32), (2, 2, 6)])
def test_qk_norm_rotary_in_place_on_fused_qkv_views(dtype, heads, kv_heads, head_dim):
    tokens, max_pos, eps = 19, 4096, 1e-6
    rope = RotaryEmbedding(head_dim, max_pos, 1e6, None, dtype)
    g = torch.Generator().manual_seed(head_dim)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 4).to(dtype)
    qw = (torch.rand(head_dim, generator=g) + 0.5).to(dtype)
    kw = (torch.rand(head_dim, generator=g) + 0.5).to(dtype)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    positions = torch.randint(0, max_pos, (tokens,), generator=g)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    # What Qwen3's torch path computes: the norm over each head's row, then rotary.
    q_ref = ops.reference_rms_norm(q.reshape(-1, head_dim), qw, eps).view(tokens, heads, head_dim)
    k_ref = ops.reference_rms_norm(k.reshape(-1, head_dim), kw, eps).view(tokens, kv_heads, head_dim)
    q_ref, k_ref = rope(positions, q_ref, k_ref)
    q_ref2, k_ref2 = q.clone(), k.clone()
    ops.reference_qk_norm_rotary_(positions, q_ref2, k_ref2, qw, kw, eps, rope.cos, rope.sin)
    assert torch.equal(q_ref2, q_ref) and torch.equal(k_ref2, k_ref)
    ops.qk_norm_rotary_(positions, q, k, qw, kw, eps, rope.cos, rope.sin)
    close(q, q_ref, dtype, scale=4)
    close(k, k_ref, dtype, scale=4)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v is not touched


def test_rotary_rejects_positions_outside_the_table():
    rope = RotaryEmbedding(8, 16, 10000.0, None, torch.float32)
    q, k = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        ops.rotary_embedding_(torch.tensor([3, 16]), q, k, rope.cos, rope.sin)


def test_dtype_mismatch_is_an_error_not_garbage():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.rms_norm(x, torch.ones(8), 1e-5)


def test_empty_batch():
    x = torch.empty(0, 16, dtype=torch.bfloat16)
    assert ops.rms_norm(x, torch.ones(16, dtype=torch.bfloat16), 1e-5).shape == (0, 16)
    assert ops.silu_and_mul(torch.empty(0, 8)).shape == (0, 4)
