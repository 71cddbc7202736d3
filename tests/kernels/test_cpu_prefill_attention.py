"""The native causal prefill attention kernel against its float32 PyTorch reference and against SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kubellm.kernels import cpu_prefill_attention as pa

# bf16: the kernel rounds the softmax probabilities to bf16 for P.V on AVX512-BF16 CPUs, as flash attention does
# on GPUs; PyTorch's own bf16 SDPA deviates from the float32 reference by the same ~1-2 bf16 ulps.
ATOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 2e-3}


pytestmark = pytest.mark.usefixtures("native_kernels")  # tests/conftest.py: skip without them, fail under CI


def qkv_views(tokens, heads, kv_heads, head_dim, dtype, seed=0):
    """q/k/v as the model has them: strided views into one fused projection output."""
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (8, 2, 32), (6, 1, 80)],
                         ids=["gqa3-d64", "mha-d128", "gqa4-d32", "mqa-d80"])
@pytest.mark.parametrize("tokens", [1, 15, 16, 17, 64, 65, 200])
def test_whole_prompt_matches_reference(dtype, heads, kv_heads, head_dim, tokens):
    q, k, v = qkv_views(tokens, heads, kv_heads, head_dim, dtype, seed=tokens)
    scale = head_dim**-0.5
    out = pa.prefill_attention(q, k, v, scale)
    assert out.shape == (tokens, heads, head_dim) and out.dtype == dtype
    torch.testing.assert_close(out.float(), pa.reference_prefill_attention(q, k, v, scale).float(), rtol=0,
                               atol=ATOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,context", [(1, 100), (16, 40), (50, 130), (7, 64), (64, 300)])
def test_later_chunk_sees_the_cached_context(dtype, tokens, context):
    """A chunk's queries are the last `tokens` positions of `context` keys (chunked prefill, prefix hits)."""
    g = torch.Generator().manual_seed(context)
    q = torch.randn(tokens, 9, 64, generator=g).to(dtype)
    k = torch.randn(context, 3, 64, generator=g).to(dtype)
    v = torch.randn(context, 3, 64, generator=g).to(dtype)
    out = pa.prefill_attention(q, k, v, 0.125)
    torch.testing.assert_close(out.float(), pa.reference_prefill_attention(q, k, v, 0.125).float(), rtol=0,
                               atol=ATOL[dtype])


def test_agrees_with_pytorch_sdpa():
    q, k, v = qkv_views(97, 9, 3, 64, torch.float32, seed=3)
    sdpa = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                          is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(pa.prefill_attention(q, k, v, 64**-0.5), sdpa, rtol=0, atol=2e-5)


def test_extreme_scores_stay_finite():
    q, k, v = qkv_views(70, 4, 2, 64, torch.float32, seed=5)
    q = q * 300  # scores in the thousands: the online softmax must rescale, not overflow
    out = pa.prefill_attention(q, k, v, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, pa.reference_prefill_attention(q, k, v, 1.0), rtol=0, atol=1e-4)


def test_same_result_with_one_thread():
    q, k, v = qkv_views(150, 9, 3, 64, torch.bfloat16, seed=9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = pa.prefill_attention(q, k, v, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, pa.prefill_attention(q, k, v, 0.125))  # work split never changes the math


@pytest.mark.parametrize("bad,match", [
    (lambda q, k, v: (q, k[:10], v[:10]), "must include"),
    (lambda q, k, v: (q, k.float(), v.float()), "dtypes differ"),
    (lambda q, k, v: (q[:, :8], k[:, :3], v[:, :3]), "multiple"),
])
def test_bad_inputs_raise(bad, match):
    q, k, v = qkv_views(20, 9, 3, 64, torch.bfloat16)
    with pytest.raises(RuntimeError, match=match):
        pa.prefill_attention(*bad(q, k, v), 0.125)


def test_empty_chunk():
    q, k, v = qkv_views(0, 9, 3, 64, torch.bfloat16)
    assert pa.prefill_attention(q, k, v, 0.125).shape == (0, 9, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 80])  # the bf16 pair path, the fixed-size path, the generic one
@pytest.mark.parametrize(("tokens", "context", "window", "softcap"), [
    (200, 200, 1, None), (200, 200, 37, None), (130, 300, 64, None), (16, 300, 100, 3.0), (65, 65, 500, None),
    (40, 40, None, 2.0), (1, 300, 10, None),
])  # fmt: skip
def test_window_and_softcap_match_the_reference(dtype, head_dim, tokens, context, window, softcap):
    """Windows of one key, inside a key block, aligned to one, across several and longer than the context;
    soft caps small enough to change the scores; whole prompts and later chunks."""
    g = torch.Generator().manual_seed(tokens + context)
    q = (3 * torch.randn(tokens, 8, head_dim, generator=g)).to(dtype)
    k = torch.randn(context, 2, head_dim, generator=g).to(dtype)
    v = torch.randn(context, 2, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    out = pa.prefill_attention(q, k, v, scale, window=window, softcap=softcap)
    ref = pa.reference_prefill_attention(q, k, v, scale, window=window, softcap=softcap)
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=ATOL[dtype])
    if window is not None and window < context:  # the window changes the answer
        plain = pa.reference_prefill_attention(q, k, v, scale, softcap=softcap)
        assert not torch.allclose(plain[-1].float(), ref[-1].float(), atol=1e-3)


def test_out_receives_the_chunk_in_place():
    """A chunk's result goes straight into its rows of the step's output (no copy): bitwise what the allocating call
    returns, the rows around it untouched."""
    q, k, v = qkv_views(40, 9, 3, 64, torch.bfloat16, seed=3)
    step = torch.full((50, 9, 64), 7.0, dtype=torch.bfloat16)
    rows = step[4:44]
    got = pa.prefill_attention(q, k, v, 0.125, window=16, out=rows)
    assert got.data_ptr() == rows.data_ptr()
    assert torch.equal(rows, pa.prefill_attention(q, k, v, 0.125, window=16))
    assert (step[:4] == 7).all() and (step[44:] == 7).all()
    with pytest.raises(RuntimeError, match="contiguous"):
        pa.prefill_attention(q, k, v, 0.125, out=step[4:44].transpose(0, 1).contiguous().transpose(0, 1))
