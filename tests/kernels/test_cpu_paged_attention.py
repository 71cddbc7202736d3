"""CPU paged-attention decode: the native kernel against the plain-PyTorch reference, and the reference itself
against dense attention (SDPA) over each sequence's un-paged K/V.

The pools are built adversarially: block ids are a random permutation, unreferenced blocks and the slots past
each sequence's end hold NaN, and block-table entries past a sequence's blocks are out-of-range ids, so any
read of memory the contract does not allow shows up as a NaN or a crash.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kubellm.kernels import cpu_extension as cx
from kubellm.kernels import cpu_paged_attention as cpa

GARBAGE_OFFSET = 1000  # padded block-table entries: num_blocks + this (never valid)
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}


def make_case(context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0, extra_blocks=5):
    """A paged pool holding each sequence's K/V under shuffled block ids, plus the dense K/V it came from."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks) + extra_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    max_blocks = max(blocks) + 2
    block_tables = torch.full((len(context_lens), max_blocks), num_blocks + GARBAGE_OFFSET, dtype=torch.int32)
    ids = torch.randperm(num_blocks, generator=gen)
    dense_k, dense_v = [], []
    used = 0
    for b, (n, nb) in enumerate(zip(context_lens, blocks, strict=True)):
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        dense_k.append(k)
        dense_v.append(v)
        seq_ids = ids[used : used + nb]
        used += nb
        block_tables[b, :nb] = seq_ids.to(torch.int32)
        for t in range(n):  # slot by slot: the tail of the last block stays NaN
            k_cache[seq_ids[t // block_size], t % block_size] = k[t]
            v_cache[seq_ids[t // block_size], t % block_size] = v[t]
    q = (2.0 * torch.randn(len(context_lens), num_heads, head_dim, generator=gen)).to(dtype)
    context = torch.tensor(context_lens, dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, context, dense_k, dense_v


def context_lens_for(batch: int, block_size: int, seed: int) -> list[int]:
    """Always 1, an exact multiple of block_size and one long sequence (many blocks); random lengths after."""
    rng = torch.Generator().manual_seed(seed)
    fixed = [1, 3 * block_size, 37 * block_size + 5]
    rand = [int(x) for x in torch.randint(1, 6 * block_size, (max(0, batch - len(fixed)),), generator=rng)]
    return (fixed + rand)[:batch]


def dense_attention(q, dense_k, dense_v, scale):
    """Per sequence: SDPA of its single query over its un-paged K/V (GQA via repeat_interleave), in fp32."""
    num_heads = q.shape[1]
    outs = []
    for b, (k, v) in enumerate(zip(dense_k, dense_v, strict=True)):
        group = num_heads // k.shape[1]
        kt = k.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [H, L, D]
        vt = v.float().transpose(0, 1).repeat_interleave(group, dim=0)
        qt = q[b].float().unsqueeze(1)  # [H, 1, D]
        outs.append(F.scaled_dot_product_attention(qt, kt, vt, scale=scale).squeeze(1))
    return torch.stack(outs)


@pytest.fixture(scope="module")
def kernel(native_kernels):
    """The native kernel, built once per session (first build: about a minute on 2 cores; later sessions load
    it from disk). tests/conftest.py's native_kernels skips without it, or fails under CI."""
    return cpa.paged_decode_attention


# ----------------------------------------------------------------------------------------------- reference


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2)], ids=["mha", "gqa3", "gqa4"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_reference_matches_dense_sdpa(block_size, heads, head_dim):
    num_heads, num_kv_heads = heads
    lens = context_lens_for(5, block_size, seed=block_size + head_dim)
    q, kc, vc, bt, cl, dk, dv = make_case(lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32)
    scale = head_dim**-0.5
    out = cpa.reference_paged_decode_attention(q, kc, vc, bt, cl, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, dense_attention(q, dk, dv, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_low_precision_matches_dense(dtype):
    lens = [1, 16, 70]
    q, kc, vc, bt, cl, dk, dv = make_case(lens, 9, 3, 64, 16, dtype)
    out = cpa.reference_paged_decode_attention(q, kc, vc, bt, cl, 0.125)
    assert out.dtype == dtype and torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), dense_attention(q, dk, dv, 0.125), **TOL[dtype])


def test_reference_single_token_returns_its_value():
    q, kc, vc, bt, cl, _, dv = make_case([1, 1], 6, 2, 64, 16, torch.float32)
    out = cpa.reference_paged_decode_attention(q, kc, vc, bt, cl, 0.125)
    for b in range(2):
        torch.testing.assert_close(out[b], dv[b][0].repeat_interleave(3, dim=0))


# ------------------------------------------------------------------------------------------- kernel parity


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2)], ids=["g1", "g3", "g4"])
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_kernel_matches_reference(kernel, batch, block_size, heads, head_dim, dtype):
    num_heads, num_kv_heads = heads
    lens = context_lens_for(batch, block_size, seed=batch * 7 + block_size)
    q, kc, vc, bt, cl, _, _ = make_case(
        lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=batch
    )
    scale = head_dim**-0.5
    out = kernel(q, kc, vc, bt, cl, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out.float()).all(), "kernel read NaN memory outside the contexts"
    ref = cpa.reference_paged_decode_attention(q, kc, vc, bt, cl, scale)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(24, 3, 64), (40, 8, 128), (14, 2, 64), (16, 1, 64), (12, 4, 80), (6, 2, 32), (4, 2, 256)],
    ids=["g8", "g5", "g7", "mqa16", "d80", "d32", "d256"],
)
def test_kernel_other_shapes(kernel, num_heads, num_kv_heads, head_dim, dtype):
    """Groups above 4 (several head passes per kv head) and head_dims without a specialised path."""
    lens = [1, 33, 160, 7]
    q, kc, vc, bt, cl, _, _ = make_case(lens, num_heads, num_kv_heads, head_dim, 16, dtype)
    out = kernel(q, kc, vc, bt, cl, head_dim**-0.5)
    ref = cpa.reference_paged_decode_attention(q, kc, vc, bt, cl, head_dim**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("partition", [1, 5, 16, 100, 0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_split_sequences(kernel, partition, dtype):
    """Sequences split into partitions whose partial softmax states are merged (used when B is small)."""
    lens = [300, 1, 17, 129]
    q, kc, vc, bt, cl, _, _ = make_case(lens, 9, 3, 64, 16, dtype, seed=partition)
    ref = cpa.reference_paged_decode_attention(q, kc, vc, bt, cl, 0.125)
    out = kernel(q, kc, vc, bt, cl, 0.125, partition=partition)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    single = kernel(q[:1], kc, vc, bt[:1], cl[:1], 0.125, partition=partition)
    torch.testing.assert_close(single.float(), ref[:1].float(), **TOL[dtype])


@pytest.mark.parametrize("chunk", [1, 16, 100, 512])
def test_kernel_chunk_sizes(kernel, chunk):
    lens = context_lens_for(6, 16, seed=chunk)
    q, kc, vc, bt, cl, _, _ = make_case(lens, 8, 2, 64, 16, torch.float32, seed=chunk)
    ref = cpa.reference_paged_decode_attention(q, kc, vc, bt, cl, 0.125)
    torch.testing.assert_close(kernel(q, kc, vc, bt, cl, 0.125, chunk=chunk), ref, **TOL[torch.float32])


def test_kernel_long_context_single_sequence(kernel):
    lens = [4000]
    q, kc, vc, bt, cl, dk, dv = make_case(lens, 9, 3, 64, 16, torch.float32)
    torch.testing.assert_close(
        kernel(q, kc, vc, bt, cl, 0.125), dense_attention(q, dk, dv, 0.125), atol=1e-5, rtol=1e-5
    )


def test_kernel_extreme_scores_are_stable(kernel):
    """Large logits (peaked softmax) must not overflow: the running max keeps exp arguments <= 0."""
    q, kc, vc, bt, cl, _, _ = make_case([50, 200], 8, 2, 64, 16, torch.float32)
    q = q * 40.0
    out = kernel(q, kc, vc, bt, cl, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(
        out, cpa.reference_paged_decode_attention(q, kc, vc, bt, cl, 1.0), atol=1e-4, rtol=1e-4
    )


def test_kernel_strided_q_and_int64_metadata(kernel):
    """q as a view of a fused qkv projection (row stride > H * D); int64 block tables/lens are converted."""
    lens = [5, 40, 17]
    q, kc, vc, bt, cl, _, _ = make_case(lens, 9, 3, 64, 16, torch.bfloat16)
    qkv = torch.cat([q, torch.randn(3, 6, 64).to(torch.bfloat16)], dim=1)
    q_view = qkv[:, :9]
    assert not q_view.is_contiguous()
    ref = cpa.reference_paged_decode_attention(q, kc, vc, bt, cl, 0.125)
    out = kernel(q_view, kc, vc, bt.long(), cl.long(), 0.125)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])


def test_kernel_respects_thread_count(kernel):
    lens = context_lens_for(9, 16, seed=3)
    q, kc, vc, bt, cl, _, _ = make_case(lens, 9, 3, 64, 16, torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(q, kc, vc, bt, cl, 0.125)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(kernel(q, kc, vc, bt, cl, 0.125), one, atol=0, rtol=0)


def test_kernel_empty_batch_and_empty_context(kernel):
    q, kc, vc, bt, cl, _, _ = make_case([3, 20], 4, 2, 64, 16, torch.float32)
    assert kernel(q[:0], kc, vc, bt[:0], cl[:0], 0.125).shape == (0, 4, 64)
    cl0 = cl.clone()
    cl0[0] = 0  # outside the contract (lens >= 1); both implementations return zeros for it
    out = kernel(q, kc, vc, bt, cl0, 0.125)
    ref = cpa.reference_paged_decode_attention(q, kc, vc, bt, cl0, 0.125)
    assert (out[0] == 0).all()
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_kernel_rejects_bad_inputs(kernel):
    q, kc, vc, bt, cl, _, _ = make_case([3, 20], 4, 2, 64, 16, torch.float32)
    bad = bt.clone()
    bad[1, 1] = kc.shape[0]  # a referenced entry out of range
    with pytest.raises(RuntimeError, match="out of range"):
        kernel(q, kc, vc, bad, cl, 0.125)
    with pytest.raises(RuntimeError, match="columns"):
        kernel(q, kc, vc, bt, torch.tensor([3, 16 * bt.shape[1] + 1], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="dtype"):
        kernel(q.to(torch.bfloat16), kc, vc, bt, cl, 0.125)
    with pytest.raises(RuntimeError, match="multiple"):
        kernel(q[:, :3], kc, vc, bt, cl, 0.125)


# ------------------------------------------------------------------------------------------------ loading


def test_disable_env_forces_fallback(monkeypatch):
    monkeypatch.setenv(cpa.DISABLE_ENV, "1")
    assert cpa.available() is False
    q, kc, vc, bt, cl, _, _ = make_case([3], 4, 2, 64, 16, torch.float32)
    with pytest.raises(RuntimeError, match="unavailable"):
        cpa.paged_decode_attention(q, kc, vc, bt, cl, 0.125)


def test_build_info_reports_state(kernel):
    info = cpa.build_info()
    assert info["ok"] is True and info["error"] is None
    assert "torch_extensions" in str(info["build_directory"])


def test_build_failure_warns_once_and_falls_back(monkeypatch, caplog):
    monkeypatch.setattr(cx, "_state", {"tried": False, "ok": False, "error": None, "build_seconds": None})
    monkeypatch.setattr(cx, "_op_registered", lambda: False)

    def broken_build():
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cx, "_build", broken_build)
    with caplog.at_level("WARNING", logger=cx.__name__):
        assert cpa.available() is False
        assert cpa.available() is False
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
    assert "no C++ compiler" in cpa.build_info()["error"]


# ---------------------------------------------------------------------------------- windows and soft caps


def test_reference_window_is_dense_attention_over_the_last_tokens():
    lens = [1, 40, 100]
    q, kc, vc, bt, cl, dk, dv = make_case(lens, 4, 2, 32, 16, torch.float32)
    window = 24
    ref = cpa.reference_paged_decode_attention(q, kc, vc, bt, cl, 0.2, window=window)
    dense = dense_attention(q, [k[-window:] for k in dk], [v[-window:] for v in dv], 0.2)
    torch.testing.assert_close(ref, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("window", "softcap"), [(1, None), (16, None), (37, None), (1000, None), (None, 5.0),
                                                 (37, 2.0)])  # fmt: skip
@pytest.mark.parametrize("partition", [0, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_window_and_softcap_match_the_reference(kernel, window, softcap, partition, dtype):
    """Windows shorter than, across and longer than the contexts (and split into partitions); soft caps small
    enough to change the scores (q is scaled up so they bite)."""
    lens = [300, 1, 17, 129, 48]
    q, kc, vc, bt, cl, _, _ = make_case(lens, 9, 3, 64, 16, dtype, seed=3)
    q = (q.float() * 3).to(dtype)
    ref = cpa.reference_paged_decode_attention(q, kc, vc, bt, cl, 0.125, window=window, softcap=softcap)
    out = kernel(q, kc, vc, bt, cl, 0.125, partition=partition, window=window, softcap=softcap)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    if window is not None and window < 300:  # the window really changes the answer
        plain = cpa.reference_paged_decode_attention(q, kc, vc, bt, cl, 0.125, softcap=softcap)
        assert not torch.allclose(plain[0].float(), ref[0].float(), atol=1e-3)
