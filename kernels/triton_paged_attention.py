"""Paged-attention decode in Triton (CUDA), beside the plain-PyTorch reference it must equal.

Same contract as :mod:`kubellm.kernels.cpu_paged_attention`: one query token per sequence, ``q``
``[B, H, D]``; the pool ``k_cache``/``v_cache`` ``[num_blocks, block_size, KVH, D]`` read in place through
``block_tables`` ``[B, max_blocks]`` int32 and ``context_lens`` ``[B]`` int32 (>= 1); query head ``h`` reads
kv head ``h // (H // KVH)``; output ``[B, H, D]`` in ``q``'s dtype, fp32 softmax and accumulation. With a
sliding ``window`` a sequence attends only its last ``window`` tokens; a ``softcap`` turns each score ``s``
(scale included) into ``softcap * tanh(s / softcap)``.

One program per (sequence, kv head) takes all the query heads that share that kv head as the rows of one
tile (padded to 16, the smallest ``tl.dot``) and streams the context in tiles of BLOCK_N tokens that may span
several KV blocks (each token's block looked up in the table), with an online softmax: the context is read
once per kv head, never gathered, and small blocks cost no extra loop trips. A windowed sequence's stream
starts at the window's first token: the blocks before it are never read (nor their block-table entries, so
they may name blocks the sequence has given back). Block size and head dim need not
be powers of two. On a GPU bf16/fp16 tiles go to the tensor cores with fp32 accumulation (fp32 inputs use
IEEE fp32, not TF32); on CPU it runs only under ``TRITON_INTERPRET=1`` (the tests), where every tile goes to
float32 right after its load (the interpreter's bf16 is wrong otherwise).

Split KV ("flash-decoding"): when (sequences x kv heads) programs cannot fill the GPU, each sequence's context
is cut into partitions of ``partition`` tokens (a power of two, a multiple of BLOCK_N), one program each (grid
axis 2), and each program writes its unnormalised output, running max and sum (float32) to scratch; a second
kernel combines the partitions with a log-sum-exp rescale. A partition past the context or wholly before the
window reads nothing and contributes nothing (max -inf, sum 0). How many partitions comes from static sizes
only (the batch, the block table's width, the device's SM count: :func:`partition_tokens`), never from
``context_lens``, so a CUDA graph captured at one step replays correctly at any other; no atomics, so results
are the same run to run. A context within the first partition gets the single pass's bits: a graph's table is
max_model_len wide (split), eager's as wide as the longest context, and both must decode the same tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubellm.kernels.cpu_paged_attention import reference_paged_decode_attention
from kubellm.kernels.triton_dot import cuda_sm_count, dot_options

__all__ = ["chosen_partition", "paged_decode_attention", "partition_tokens", "reference_paged_decode_attention"]

_LOG2E = 1.4426950408889634
MIN_PARTITION, MAX_PARTITION = 256, 2048  # tokens per split-KV partition (powers of two)
MAX_PARTITIONS = 128  # the combine kernel holds every partition of one head in one tile
WAVES = 2  # split until about this many programs per SM


def partition_tokens(batch: int, num_kv_heads: int, max_context: int, sm_count: int, block_n: int = 64) -> int:
    """Tokens per split-KV partition for a decode launch, or 0 for the single-pass kernel: split only when the
    ``batch x num_kv_heads`` programs leave SMs idle and ``max_context`` (a static bound on every context:
    the block table's width in tokens) spans more than one partition. Aims at WAVES programs per SM, within
    MIN_PARTITION..MAX_PARTITION tokens (more only to stay within MAX_PARTITIONS)."""
    programs = batch * num_kv_heads
    if programs >= sm_count or max_context <= MIN_PARTITION:
        return 0
    wanted = -(-WAVES * sm_count // programs)  # partitions per sequence
    size = min(MAX_PARTITION, max(MIN_PARTITION, triton.next_power_of_2(-(-max_context // wanted))))
    size = max(size, block_n, triton.next_power_of_2(-(-max_context // MAX_PARTITIONS)))
    return size if size < max_context else 0


def chosen_partition(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, block_n: int = 64) -> int:
    """The :func:`partition_tokens` :func:`paged_decode_attention` uses for these inputs when not told one."""
    max_context = block_tables.shape[1] * k_cache.shape[1]  # static: a graph replays it whatever the lengths
    return partition_tokens(q.shape[0], k_cache.shape[2], max_context, _sm_count(q.device), max(16, block_n))


def _sm_count(device: torch.device) -> int:
    """The device's SMs; 1 for CPU (the interpreter), which never splits unasked."""
    return cuda_sm_count(device.index or 0) if device.type == "cuda" else 1


@triton.jit
def soft_cap(scores, cap):
    """``softcap * tanh(s / softcap)`` with scores and ``cap`` both in log2 units (times log2(e)), as the online
    softmax keeps them. tanh from one exp (the interpreter and every backend have it), never overflowing:
    tanh|x| = (1 - e) / (1 + e) with e = exp(-2|x|)."""
    x = scores / cap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t) * cap


@triton.jit
def _paged_decode_kernel(
    out_ptr, max_ptr, sum_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, qk_scale, window, cap,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_op, stride_mb, stride_mh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_table,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, PARTITION: tl.constexpr,
):
    """PARTITION 0: the whole context, normalised output to ``out``. Otherwise tokens
    [part * PARTITION, (part + 1) * PARTITION) of it: unnormalised output to ``out`` [B, H, parts, D] and the
    rows' running max and sum to ``max``/``sum`` [B, H, parts]."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    length = tl.load(lens_ptr + seq)
    first = tl.where(window > 0, tl.maximum(length - window, 0), 0)  # the window's first token
    end = length
    if PARTITION:
        first = tl.maximum(first, part * PARTITION)
        end = tl.minimum(length, (part + 1) * PARTITION)  # <= first: nothing to read

    m = tl.zeros([BLOCK_G], dtype=tl.float32) - float("inf")  # running max of each row's scores
    denom = tl.zeros([BLOCK_G], dtype=tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(first, end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        live = pos < end
        block = tl.load(tables_ptr + seq * stride_table + pos // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        lanes = live[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + block[:, None] * stride_kb + slot[:, None] * stride_kt + kv_head * stride_kh
                    + d[None, :], mask=lanes, other=0.0)
        v = tl.load(v_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vt + kv_head * stride_vh
                    + d[None, :], mask=lanes, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # log2 units
        if SOFTCAP:
            scores = soft_cap(scores, cap)
        scores = tl.where(live[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # finite: the first tile holds the span's first token
        p = tl.exp2(scores - m_new[:, None])
        rescale = tl.exp2(m - m_new)
        denom = denom * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    rows = seq * stride_ob + heads[:, None] * stride_oh + part * stride_op + d[None, :]
    if PARTITION:
        tl.store(out_ptr + rows, acc, mask=g_ok[:, None] & d_ok[None, :])
        stats = seq * stride_mb + heads * stride_mh + part
        tl.store(max_ptr + stats, m, mask=g_ok)
        tl.store(sum_ptr + stats, denom, mask=g_ok)
    else:
        tl.store(out_ptr + rows, (acc / denom[:, None]).to(out_ptr.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_partitions_kernel(
    out_ptr, part_ptr, max_ptr, sum_ptr, parts, stride_ob, stride_oh, stride_pb, stride_ph, stride_pp,
    stride_mb, stride_mh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """One program per (sequence, query head): the partitions' outputs weighted by exp2(max_p - max) (0 for
    an empty partition, max_p = -inf), over the weighted sums."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.arange(0, BLOCK_P)
    p_ok = p < parts
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    stats = seq * stride_mb + head * stride_mh + p
    m = tl.load(max_ptr + stats, mask=p_ok, other=float("-inf"))
    denom = tl.load(sum_ptr + stats, mask=p_ok, other=0.0)
    acc = tl.load(part_ptr + seq * stride_pb + head * stride_ph + p[:, None] * stride_pp + d[None, :],
                  mask=p_ok[:, None] & d_ok[None, :], other=0.0)
    top = tl.max(m, axis=0)  # finite: the partition holding the last token is never empty
    weight = tl.where(m > float("-inf"), tl.exp2(m - top), 0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(denom * weight, axis=0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    block_n: int = 64,
    window: int | None = None,
    softcap: float | None = None,
    partition: int | None = None,
) -> torch.Tensor:
    """Decode attention with the Triton kernel (shapes in the module docstring); ``block_n`` tokens per tile.
    ``window``: attend only each sequence's last ``window`` tokens; ``softcap``: scores become
    ``softcap * tanh(score / softcap)`` before the softmax (scores include ``scale``). ``partition``: tokens
    per split-KV partition (a power of two >= ``block_n``), 0 for the single pass, None to let
    :func:`partition_tokens` choose from the batch, the table's width and the device."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV pool must be contiguous in head_dim")
    block_tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if partition is None:
        partition = chosen_partition(q, k_cache, block_tables, block_n)
    block_n = max(16, block_n)
    max_context = block_tables.shape[1] * block_size
    if partition and (partition & (partition - 1) or partition < block_n):
        raise ValueError(f"partition={partition} must be a power of two >= block_n={block_n}")
    parts = -(-max_context // partition) if partition else 1
    if parts == 1:
        partition = 0
    target, maxes, sums = out, out, out  # the single pass writes out and no statistics
    if partition:
        target = torch.empty((batch, num_heads, parts, head_dim), dtype=torch.float32, device=q.device)
        maxes = torch.empty((batch, num_heads, parts), dtype=torch.float32, device=q.device)
        sums = torch.empty_like(maxes)
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    _paged_decode_kernel[(batch, num_kv_heads, parts)](
        target, maxes, sums, q, k_cache, v_cache, block_tables, context_lens, float(scale) * _LOG2E, window or 0,
        float(softcap or 1.0) * _LOG2E,
        q.stride(0), q.stride(1), target.stride(0), target.stride(1), target.stride(2) if partition else 0,
        maxes.stride(0), maxes.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size,
        BLOCK_N=block_n, HEAD_DIM=head_dim, BLOCK_D=block_d,
        SOFTCAP=bool(softcap), PARTITION=partition, **dot_options(q),
    )
    if partition:
        _combine_partitions_kernel[(batch, num_heads)](
            out, target, maxes, sums, parts, out.stride(0), out.stride(1),
            target.stride(0), target.stride(1), target.stride(2), maxes.stride(0), maxes.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_P=triton.next_power_of_2(parts),
        )
    return out
