"""The Triton layer ops (kernels/triton_layer_ops.py) against cpu_layer_ops' PyTorch references: values, in-place
semantics, q/k as strided views into the fused qkv output as the models pass them.

Without a GPU they run through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); shapes stay tiny.
The kernels round where the references round (bf16 to nearest-even by hand, so the interpreter's truncating
cast does not differ from a GPU's), so bf16/fp16 results are bit-identical here; fp32 differs in the last ulps
of the reductions and exp.
"""

from __future__ import annotations

import pytest
import torch

from kubellm.kernels import triton_check
from kubellm.kernels import triton_layer_ops as ops
from kubellm.runtime.layers.rotary import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ATOL = {torch.float32: 1e-5, torch.bfloat16: 0.0, torch.float16: 0.0}
if DEVICE == "cuda":  # compiled: FMA contraction and fast exp may move a rounding by one ulp
    ATOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a.float().cpu(), b.float().cpu(), rtol=0, atol=ATOL[dtype] * scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (3, 40)])
def test_rms_norm(dtype, tokens, hidden):
    g = torch.Generator().manual_seed(tokens * hidden)
    x = (torch.randn(tokens, hidden, generator=g) * 3).to(dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    out = ops.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-5)
    close(out, ops.reference_rms_norm(x, w, 1e-5), dtype)
    assert not torch.equal(out.float().cpu(), x.float())  # it did something


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_reads_strided_rows(dtype):
    base = torch.randn(3, 50).to(dtype)
    x = base[:, 5:37]  # rows 50 apart, 32 contiguous columns
    w = torch.rand(32).to(dtype)
    close(ops.rms_norm(base.to(DEVICE)[:, 5:37], w.to(DEVICE), 1e-6), ops.reference_rms_norm(x.contiguous(), w, 1e-6),
          dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_both_in_place(dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 48, generator=g).to(dtype)
    res = torch.randn(3, 48, generator=g).to(dtype)
    w = (torch.rand(48, generator=g) + 0.5).to(dtype)
    x_k, res_k = x.to(DEVICE, copy=True), res.to(DEVICE, copy=True)
    assert ops.add_rms_norm_(x_k, res_k, w.to(DEVICE), 1e-5) is None
    ops.reference_add_rms_norm_(x, res, w, 1e-5)
    assert torch.equal(res_k.cpu(), res)  # one rounded add: exact in every dtype
    close(x_k, x, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 24), (2, 1100)])  # 1100: two column blocks, a masked tail
def test_silu_and_mul(dtype, tokens, inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(tokens, 2 * inter, generator=g) * 6).to(dtype)  # far into both tails of sigmoid
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)
    out = ops.silu_and_mul(gate_up.to(DEVICE))
    assert out.shape == (tokens, inter)
    close(out, ops.reference_silu_and_mul(gate_up), dtype, scale=10)


def _qkv_views(qkv, tokens, heads, kv_heads, head_dim):
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (2, 2, 6)])  # 6: a half of 3, masked
def test_rotary_in_place_on_fused_qkv_views(dtype, heads, kv_heads, head_dim):
    tokens, max_pos = 3, 64
    rope = RotaryEmbedding(head_dim, max_pos, 10000.0, None, dtype)
    g = torch.Generator().manual_seed(heads)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.tensor([0, 63, 17])
    kernel = qkv.to(DEVICE, copy=True)
    ops.rotary_embedding_(positions.to(DEVICE), *_qkv_views(kernel, tokens, heads, kv_heads, head_dim),
                          rope.cos.to(DEVICE), rope.sin.to(DEVICE))
    reference = qkv.clone()
    ops.reference_rotary_embedding_(positions, *_qkv_views(reference, tokens, heads, kv_heads, head_dim), rope.cos,
                                    rope.sin)
    close(kernel, reference, dtype)  # q and k rotated, v untouched
    assert torch.equal(kernel[:, (heads + kv_heads) * head_dim:].cpu(), qkv[:, (heads + kv_heads) * head_dim:])
    assert not torch.equal(kernel[1].cpu(), qkv[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (2, 1, 6)])
def test_qk_norm_rotary_in_place_on_fused_qkv_views(dtype, heads, kv_heads, head_dim):
    tokens, max_pos, eps = 3, 64, 1e-6
    rope = RotaryEmbedding(head_dim, max_pos, 1e6, None, dtype)
    g = torch.Generator().manual_seed(head_dim)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 4).to(dtype)
    qw = (torch.rand(head_dim, generator=g) + 0.5).to(dtype)
    kw = (torch.rand(head_dim, generator=g) + 0.5).to(dtype)
    positions = torch.tensor([5, 0, 63])
    kernel = qkv.to(DEVICE, copy=True)
    ops.qk_norm_rotary_(positions.to(DEVICE), *_qkv_views(kernel, tokens, heads, kv_heads, head_dim),
                        qw.to(DEVICE), kw.to(DEVICE), eps, rope.cos.to(DEVICE), rope.sin.to(DEVICE))
    reference = qkv.clone()
    ops.reference_qk_norm_rotary_(positions, *_qkv_views(reference, tokens, heads, kv_heads, head_dim), qw, kw, eps,
                                  rope.cos, rope.sin)
    close(kernel, reference, dtype, scale=4)
    assert torch.equal(kernel[:, (heads + kv_heads) * head_dim:].cpu(), qkv[:, (heads + kv_heads) * head_dim:])


def test_dtype_mismatch_is_an_error_not_garbage():
    x = torch.randn(2, 8, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="dtype"):
        ops.rms_norm(x, torch.ones(8, device=DEVICE), 1e-5)


def test_empty_batch():
    x = torch.empty(0, 16, dtype=torch.bfloat16, device=DEVICE)
    assert ops.rms_norm(x, torch.ones(16, dtype=torch.bfloat16, device=DEVICE), 1e-5).shape == (0, 16)
    assert ops.silu_and_mul(torch.empty(0, 8, device=DEVICE)).shape == (0, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_start_up_check_passes_and_catches_a_wrong_kernel(dtype, monkeypatch):
    assert triton_check.check_layer_ops(DEVICE, dtype, 4, 2, 16) is None
    monkeypatch.setattr(ops, "silu_and_mul", lambda gu: ops.reference_silu_and_mul(gu) * 1.1)
    assert "SiLU-and-mul differs from its reference" in triton_check.check_layer_ops(DEVICE, dtype, 4, 2, 16)
