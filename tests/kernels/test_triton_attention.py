"""The Triton attention kernels (the CUDA path) against the same PyTorch references the CPU kernels answer to.

Without a GPU they run through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), which executes
the kernels' own code, masks and index math on CPU tensors; shapes stay small because every interpreted
program costs milliseconds. The decode pools are the CPU kernel tests' adversarial ones: shuffled block ids,
NaN in every slot no sequence owns and out-of-range ids past each block table's end, so a read outside the
contract shows up as NaN or a crash.
"""

from __future__ import annotations

import pytest
import torch
from test_cpu_paged_attention import GARBAGE_OFFSET, TOL, context_lens_for, make_case
from test_cpu_prefill_attention import qkv_views

from kubellm.kernels import triton_paged_attention as tpa
from kubellm.kernels import triton_prefill_attention as tpp

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _to(device, *tensors):
    return [t.to(device) for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (9, 3, 64), (8, 2, 24), (6, 1, 32)],
                         ids=["mha-d16", "gqa3-d64", "gqa4-d24", "mqa-d32"])
@pytest.mark.parametrize("block_size", [16, 3])
def test_decode_matches_reference(dtype, heads, kv_heads, head_dim, block_size):
    """Block size 3 and head_dim 24 are not powers of two (masked lanes); the long sequence spans several
    16-token tiles, each crossing KV blocks."""
    lens = context_lens_for(4, block_size, seed=head_dim + block_size)
    if block_size == 16:
        lens[2] = 70  # keep the interpreter's work small: 37 blocks of 16 would be 600 tokens
    q, kc, vc, bt, cl, _, _ = make_case(lens, heads, kv_heads, head_dim, block_size, dtype, seed=block_size)
    scale = head_dim**-0.5
    ref = tpa.reference_paged_decode_attention(q, kc, vc, bt, cl, scale)
    out = tpa.paged_decode_attention(*_to(DEVICE, q, kc, vc, bt, cl), scale, block_n=16).cpu()
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out.float()).all(), "the kernel read memory outside the contexts"
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def test_decode_reads_a_strided_query_and_handles_an_empty_batch():
    """q as a view into the fused qkv output (rows strided); batch 0 launches nothing."""
    lens = [1, 9, 20]
    q, kc, vc, bt, cl, _, _ = make_case(lens, 4, 2, 16, 4, torch.float32)
    fused = torch.cat([q.reshape(3, -1), torch.randn(3, 32)], dim=1)
    q_view = fused[:, :64].view(3, 4, 16)
    assert not q_view.is_contiguous()
    out = tpa.paged_decode_attention(*_to(DEVICE, q_view, kc, vc, bt, cl), 0.25).cpu()
    torch.testing.assert_close(out, tpa.reference_paged_decode_attention(q, kc, vc, bt, cl, 0.25),
                               **TOL[torch.float32])
    empty = tpa.paged_decode_attention(*_to(DEVICE, q[:0], kc, vc, bt[:0], cl[:0]), 0.25)
    assert empty.shape == (0, 4, 16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 24), (6, 1, 32)],
                         ids=["gqa3-d64", "gqa4-d24", "mqa-d32"])
@pytest.mark.parametrize("tokens,context", [(1, 1), (17, 17), (40, 40), (1, 50), (7, 33), (20, 45)])
def test_prefill_matches_reference(dtype, heads, kv_heads, head_dim, tokens, context):
    """Whole prompts (tokens == context) and later chunks over cached context; 16-row query tiles and 16-key
    tiles, so tiles are partial, cross the causal edge and (40 tokens) stop early."""
    q, _, _ = qkv_views(tokens, heads, kv_heads, head_dim, dtype, seed=tokens)
    _, k, v = qkv_views(context, heads, kv_heads, head_dim, dtype, seed=context + 1)
    scale = head_dim**-0.5
    out = tpp.prefill_attention(*_to(DEVICE, q, k, v), scale, block_m=16, block_n=16).cpu()
    assert out.shape == (tokens, heads, head_dim) and out.dtype == dtype
    ref = tpp.reference_prefill_attention(q, k, v, scale)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def test_prefill_refuses_fewer_keys_than_queries():
    q, k, v = qkv_views(5, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="5 queries need at least as many keys, got 3"):
        tpp.prefill_attention(q, k[:3], v[:3], 0.25)


# ---------------------------------------------------------------------------------- windows and soft caps


def _forget_before_windows(kc, vc, bt, cl, window):
    """The pool and tables as a windowed sequence may leave them: every token before its window NaN, and the
    table entries of blocks wholly before it out-of-range ids (blocks given back to the pool). A kernel that
    reads either, even masked, answers NaN or crashes."""
    kc, vc, bt = kc.clone(), vc.clone(), bt.clone()
    block_size = kc.shape[1]
    for b, length in enumerate(cl.tolist()):
        first = max(0, length - window)
        for t in range(first):
            kc[bt[b, t // block_size], t % block_size] = float("nan")
            vc[bt[b, t // block_size], t % block_size] = float("nan")
        bt[b, : first // block_size] = kc.shape[0] + GARBAGE_OFFSET
    return kc, vc, bt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("window", "softcap"), [(1, None), (5, None), (16, None), (37, 2.0), (1000, None),
                                                 (None, 1.5)])  # fmt: skip
def test_decode_window_and_softcap_match_the_reference(dtype, window, softcap):
    """Windows of one token, inside a block, aligned to tiles, across tiles and longer than the contexts; the
    tokens before each window are never read (NaN there, garbage block ids before it)."""
    lens = [70, 1, 17, 40]
    q, kc, vc, bt, cl, _, _ = make_case(lens, 6, 2, 16, 4, dtype, seed=5)
    q = (q.float() * 3).to(dtype)  # scores large enough for the caps to bite
    ref = tpa.reference_paged_decode_attention(q, kc, vc, bt, cl, 0.25, window=window, softcap=softcap)
    if window is None or window < 70:  # the options really change the answer (for the 70-token sequence)
        plain = tpa.reference_paged_decode_attention(q, kc, vc, bt, cl, 0.25)
        assert not torch.allclose(plain[0].float(), ref[0].float(), atol=1e-3)
    if window is not None:
        kc, vc, bt = _forget_before_windows(kc, vc, bt, cl, window)
    out = tpa.paged_decode_attention(*_to(DEVICE, q, kc, vc, bt, cl), 0.25, block_n=16, window=window,
                                     softcap=softcap).cpu()
    assert torch.isfinite(out.float()).all(), "the kernel read a token before the window"
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("tokens", "context", "window", "softcap"), [
    (40, 40, 1, None), (40, 40, 7, None), (20, 45, 16, None), (7, 45, 10, 2.0), (33, 33, 100, None),
    (20, 20, None, 1.5), (1, 50, 5, None),
])  # fmt: skip
def test_prefill_window_and_softcap_match_the_reference(dtype, tokens, context, window, softcap):
    """Windows of one key, inside a key tile, across several and longer than the context; whole prompts and
    later chunks; keys before the first query's window are never read (NaN there)."""
    g = torch.Generator().manual_seed(tokens + context)
    q = (3 * torch.randn(tokens, 6, 16, generator=g)).to(dtype)
    k = torch.randn(context, 2, 16, generator=g).to(dtype)
    v = torch.randn(context, 2, 16, generator=g).to(dtype)
    ref = tpp.reference_prefill_attention(q, k, v, 0.25, window=window, softcap=softcap)
    if window is not None:
        unseen = max(0, context - tokens - window + 1)  # before the first query's window
        k, v = k.clone(), v.clone()
        k[:unseen], v[:unseen] = float("nan"), float("nan")
    out = tpp.prefill_attention(*_to(DEVICE, q, k, v), 0.25, block_m=16, block_n=16, window=window,
                                softcap=softcap).cpu()
    assert torch.isfinite(out.float()).all(), "the kernel read a key before the window"
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    if window is None or window < context:  # the options really change the answer
        plain = tpp.reference_prefill_attention(q.float(), k.float().nan_to_num(), v.float().nan_to_num(), 0.25)
        assert not torch.allclose(plain[-1], ref[-1].float(), atol=1e-3)


# --------------------------------------------------------------------------------------------- split KV


@pytest.mark.parametrize(("batch", "kv_heads", "max_context", "sms", "expected"), [
    (1, 8, 32768, 132, 1024),  # 8 programs: 32 partitions, about two waves
    (4, 8, 8192, 132, 1024),
    (16, 8, 4096, 132, 2048),  # 128 programs: just short of one wave, two partitions
    (32, 8, 4096, 132, 0),  # 256 programs fill the GPU: single pass
    (1, 8, 256, 132, 0),  # one minimum partition covers the context
    (1, 8, 300, 132, 256),
    (1, 1, 2**20, 132, 8192),  # partitions capped at MAX_PARTITIONS, so longer than MAX_PARTITION
    (1, 8, 32768, 1, 0),  # CPU (the interpreter): never unasked
])  # fmt: skip
def test_partition_tokens_splits_only_when_programs_leave_sms_idle(batch, kv_heads, max_context, sms, expected):
    size = tpa.partition_tokens(batch, kv_heads, max_context, sms)
    assert size == expected
    if size:
        assert size & (size - 1) == 0 and size % 64 == 0 and -(-max_context // size) <= tpa.MAX_PARTITIONS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (8, 2, 24), (6, 1, 32)],
                         ids=["mha-d16", "gqa4-d24", "mqa-d32"])
@pytest.mark.parametrize(("block_size", "partition"), [(16, 16), (3, 32)])
def test_split_decode_matches_the_single_pass_and_the_reference(dtype, heads, kv_heads, head_dim, block_size,
                                                                partition):
    """Partitions of one and two 16-token tiles, over 16-token blocks and 3-token ones (a partition's edge
    inside a block); contexts of one token and shorter than one partition leave later partitions empty. The
    same inputs give the same bits twice (no atomics)."""
    lens = [1, 11, 70, 33]
    q, kc, vc, bt, cl, _, _ = make_case(lens, heads, kv_heads, head_dim, block_size, dtype, seed=7)
    args = (*_to(DEVICE, q, kc, vc, bt, cl), head_dim**-0.5)
    split = tpa.paged_decode_attention(*args, block_n=16, partition=partition).cpu()
    assert torch.isfinite(split.float()).all(), "an empty partition made NaN, or a read left the contexts"
    ref = tpa.reference_paged_decode_attention(q, kc, vc, bt, cl, head_dim**-0.5)
    torch.testing.assert_close(split.float(), ref.float(), **TOL[dtype])
    single = tpa.paged_decode_attention(*args, block_n=16, partition=0).cpu()
    torch.testing.assert_close(split.float(), single.float(), **TOL[dtype])
    assert torch.equal(split, tpa.paged_decode_attention(*args, block_n=16, partition=partition).cpu())


@pytest.mark.parametrize(("window", "softcap"), [(1, None), (5, 2.0), (20, None), (40, 1.5), (None, 1.5)])
def test_split_decode_with_windows_and_softcap_matches_the_reference(window, softcap):
    """16-token partitions: a window of 1 or 5 leaves every partition but the last one or two wholly before
    it (max -inf, sum 0, never read: NaN and garbage block ids there), 20 and 40 start inside a partition."""
    lens = [70, 1, 17, 40]
    q, kc, vc, bt, cl, _, _ = make_case(lens, 6, 2, 16, 4, torch.float32, seed=5)
    q = q * 3  # scores large enough for the caps to bite
    ref = tpa.reference_paged_decode_attention(q, kc, vc, bt, cl, 0.25, window=window, softcap=softcap)
    if window is not None:
        kc, vc, bt = _forget_before_windows(kc, vc, bt, cl, window)
    out = tpa.paged_decode_attention(*_to(DEVICE, q, kc, vc, bt, cl), 0.25, block_n=16, window=window,
                                     softcap=softcap, partition=16).cpu()
    assert torch.isfinite(out).all(), "an empty partition made NaN, or the kernel read before the window"
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_of_contexts_within_the_first_partition_equals_the_single_pass_bitwise(dtype):
    """A CUDA graph's block table is max_model_len wide (split), eager's only as wide as the longest context
    (single pass): while every context fits in the first partition, both give the same bits, so graphs and
    eager decode the same tokens."""
    q, kc, vc, bt, cl, _, _ = make_case([1, 11, 16], 4, 2, 16, 4, dtype, seed=2)
    args = (*_to(DEVICE, q, kc, vc, bt, cl), 0.25)
    split = tpa.paged_decode_attention(*args, block_n=16, partition=16)
    assert bt.shape[1] * 4 > 16  # two partitions, the second empty
    assert torch.equal(split, tpa.paged_decode_attention(*args, block_n=16, partition=0))


def test_split_is_chosen_from_the_table_width_and_the_sm_count(monkeypatch):
    """On a device with SMs to spare the launcher splits by the block table's width in tokens (static under
    a CUDA graph), whatever the context lengths; contexts far shorter than the table are still right."""
    chosen = []
    sound = tpa.partition_tokens
    monkeypatch.setattr(tpa, "_sm_count", lambda device: 64)
    monkeypatch.setattr(tpa, "partition_tokens", lambda *a, **k: chosen.append((a, sound(*a, **k))) or chosen[-1][1])
    q, kc, vc, bt, cl, _, _ = make_case([300, 5], 4, 2, 16, 16, torch.float32, seed=3)
    out = tpa.paged_decode_attention(*_to(DEVICE, q, kc, vc, bt, cl), 0.25).cpu()
    assert chosen == [((2, 2, bt.shape[1] * 16, 64, 64), 256)]
    torch.testing.assert_close(out, tpa.reference_paged_decode_attention(q, kc, vc, bt, cl, 0.25),
                               **TOL[torch.float32])


def test_split_refuses_a_partition_that_is_not_whole_tiles():
    q, kc, vc, bt, cl, _, _ = make_case([20], 4, 2, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="partition=24 must be a power of two >= block_n=16"):
        tpa.paged_decode_attention(q, kc, vc, bt, cl, 0.25, block_n=16, partition=24)


# ------------------------------------------------------------------------------------------ start-up check


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_start_up_check_passes_for_sound_kernels(dtype):
    from kubellm.kernels import triton_check

    assert triton_check.check(DEVICE, dtype, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16) is None


def test_start_up_check_reports_a_wrong_or_failing_kernel(monkeypatch):
    """A kernel off by one ulp-scale amount passes; one that is wrong or cannot compile is named, and an
    explicit --attention-backend triton then refuses to start with that reason."""
    from kubellm.kernels import triton_check
    from kubellm.runtime.layers.attention import make_backend

    sound = tpa.paged_decode_attention
    monkeypatch.setattr(tpa, "paged_decode_attention", lambda *a, **k: sound(*a, **k) + 1e-6)
    assert triton_check.check(DEVICE, torch.float32, 4, 2, 16, 4) is None
    monkeypatch.setattr(tpa, "paged_decode_attention", lambda *a, **k: sound(*a, **k) * 1.01)
    reason = triton_check.check(DEVICE, torch.float32, 4, 2, 16, 4)
    assert reason and reason.startswith("the Triton paged decode kernel differs from its reference")

    def broken(*args, **kwargs):
        raise RuntimeError("PTX assembly aborted")

    monkeypatch.setattr(tpp, "prefill_attention", broken)
    monkeypatch.setattr(tpa, "paged_decode_attention", sound)
    reason = triton_check.check(DEVICE, torch.bfloat16, 4, 2, 16, 4)
    assert reason and "prefill kernel failed" in reason and "PTX assembly aborted" in reason
    with pytest.raises(ValueError, match="prefill kernel failed.*use --attention-backend torch"):
        make_backend("triton", DEVICE, 4, 2, 16, dtype=torch.bfloat16, block_size=4)
