"""Start-up self-checks for the Triton kernels: compile them for the model's shapes and dtype on the serving
device, run each once on a small random case and compare with its PyTorch reference (:func:`check` for
attention, :func:`check_layer_ops` for the fused layer ops, :func:`check_int8_gemm` for ``--quantization
int8``, :func:`check_grouped_gemm` for 4/8-bit checkpoints and ``--quantization int4``, :func:`check_fp8_gemm`
for FP8).

It costs one compile and a few milliseconds, and turns a kernel that fails to build or computes wrong on this
GPU / driver / Triton version into a logged fallback to the reference backend (``auto``) or a clear start-up
error (``triton``), instead of wrong tokens in production.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

# Worst-case element error against the fp32 references: bf16/fp16 outputs round to their own ulps.
_ATOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}


def check(device: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
          block_size: int) -> str | None:
    """None when both kernels match their references here; else what went wrong, in one line."""
    from kubellm.kernels import triton_paged_attention as decode
    from kubellm.kernels import triton_prefill_attention as prefill

    gen = torch.Generator().manual_seed(0)
    scale = head_dim**-0.5

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    lens = [1, 2 * block_size + 1, 70]  # one token, a partial last block, several decode tiles
    blocks = [-(-n // block_size) for n in lens]
    k_cache, v_cache = rand(sum(blocks), block_size, num_kv_heads, head_dim), rand(
        sum(blocks), block_size, num_kv_heads, head_dim)
    ids = torch.randperm(sum(blocks), generator=gen).to(torch.int32)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    for i, n in enumerate(blocks):
        tables[i, :n] = ids[sum(blocks[:i]) : sum(blocks[:i]) + n]
    context = torch.tensor(lens, dtype=torch.int32)
    q = rand(len(lens), num_heads, head_dim)
    pq, pk, pv = rand(20, num_heads, head_dim), rand(45, num_kv_heads, head_dim), rand(45, num_kv_heads, head_dim)
    cases = [
        ("paged decode kernel", lambda: decode.paged_decode_attention(
            *(t.to(device) for t in (q, k_cache, v_cache, tables, context)), scale),
         lambda: decode.reference_paged_decode_attention(q, k_cache, v_cache, tables, context, scale)),
        ("prefill kernel", lambda: prefill.prefill_attention(*(t.to(device) for t in (pq, pk, pv)), scale),
         lambda: prefill.reference_prefill_attention(pq, pk, pv, scale)),
        # The windowed, soft-capped variants (sliding-window layers, Gemma 2) are compiled separately.
        ("paged decode kernel (window, soft cap)", lambda: decode.paged_decode_attention(
            *(t.to(device) for t in (q, k_cache, v_cache, tables, context)), scale, window=21, softcap=5.0),
         lambda: decode.reference_paged_decode_attention(q, k_cache, v_cache, tables, context, scale, window=21,
                                                         softcap=5.0)),
        # Split KV (small batches on a big GPU): partitions of one tile; the short sequences' second is empty.
        ("paged decode kernel (split KV)", lambda: decode.paged_decode_attention(
            *(t.to(device) for t in (q, k_cache, v_cache, tables, context)), scale, partition=64),
         lambda: decode.reference_paged_decode_attention(q, k_cache, v_cache, tables, context, scale)),
        ("prefill kernel (window, soft cap)", lambda: prefill.prefill_attention(
            *(t.to(device) for t in (pq, pk, pv)), scale, window=21, softcap=5.0),
         lambda: prefill.reference_prefill_attention(pq, pk, pv, scale, window=21, softcap=5.0)),
    ]
    for name, kernel, reference in cases:
        if reason := _compare(name, device, dtype, kernel, reference):
            return reason
    return None


def _compare(name: str, device: str, dtype: torch.dtype, kernel, reference, relative: bool = False) -> str | None:
    """Run ``kernel()`` and ``reference()``; None when they agree within _ATOL[dtype], else why not. ``relative``:
    errors over (|reference| + 1), for outputs that grow with the reduction length (GEMMs)."""
    try:
        out = kernel().float().cpu()
    except Exception as e:  # noqa: BLE001 - a compile or launch failure is the answer
        return f"the Triton {name} failed on {device} ({dtype}): {type(e).__name__}: {e}"
    ref = reference().float()
    diff = (out - ref).abs() / (ref.abs() + 1) if relative else (out - ref).abs()
    error = diff.nan_to_num(float("inf")).max().item()
    if error > _ATOL[dtype]:
        return (f"the Triton {name} differs from its reference on {device} ({dtype}) by {error:.3g} "
                f"({'relative ' if relative else ''}tolerance {_ATOL[dtype]})")
    return None


def check_int8_gemm(device: str, dtype: torch.dtype) -> str | None:
    """The weight-only int8 GEMM kernel against its reference on ``device``; None when it matches."""
    from kubellm.kernels import triton_int8_gemm

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(20, 200, generator=gen).to(dtype)  # partial tiles on every side
    q = torch.randint(-127, 128, (72, 200), generator=gen, dtype=torch.int8)
    scales, bias = torch.rand(72, generator=gen) / 50, torch.randn(72, generator=gen)
    return _compare("int8 GEMM", device, dtype,
                    lambda: triton_int8_gemm.int8_gemm(*(t.to(device) for t in (x, q, scales, bias))),
                    lambda: triton_int8_gemm.reference_int8_gemm(x, q, scales, bias), relative=True)


def check_grouped_gemm(device: str, dtype: torch.dtype, bits: int) -> str | None:
    """The grouped 4- or 8-bit GEMM (pre-quantized checkpoints) against its reference on ``device``, with and
    without zero points (two compiled variants), act-order permuted; None when both match."""
    from kubellm.kernels import triton_grouped_gemm as grouped

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(20, 256, generator=gen).to(dtype)  # four groups of 64, partial row and column tiles
    packed = torch.randint(-2**31, 2**31, (256 * bits // 32, 72), generator=gen, dtype=torch.int64).to(torch.int32)
    scales = torch.rand(4, 72, generator=gen) / (10 if bits == 4 else 500)
    zeros = torch.randint(0, 1 << bits, (4, 72), generator=gen).float()
    perm, bias = torch.randperm(256, generator=gen), torch.randn(72, generator=gen)
    for name, z in ((f"grouped {bits}-bit GEMM", zeros), (f"grouped {bits}-bit GEMM (symmetric)", None)):
        args = (packed, scales, z, perm, bias)
        reason = _compare(name, device, dtype,
                          lambda a=args: grouped.grouped_gemm(x.to(device), *(None if t is None else t.to(device)
                                                                             for t in a), 64, bits),
                          lambda a=args: grouped.reference_grouped_gemm(x, *a, 64, bits), relative=True)
        if reason:
            return reason
    return None


def check_fp8_gemm(device: str, dtype: torch.dtype) -> str | None:
    """The FP8 weight GEMM against its reference on ``device`` for per-tensor, per-channel and 128x128 block
    scales (three compiled variants); None when all match."""
    from kubellm.kernels import triton_fp8_gemm as fp8

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(20, 320, generator=gen).to(dtype)  # a partial last block column, partial tiles
    weight = torch.randint(0, 256, (136, 320), generator=gen, dtype=torch.uint8)
    weight[weight.bitwise_and(0x7F) == 0x7F] = 0  # no NaN codes in a check of finite math
    bias = torch.randn(136, generator=gen)
    cases = (("per tensor", torch.tensor(0.01), None), ("per channel", torch.rand(136, generator=gen) / 50, None),
             ("128x128 blocks", torch.rand(2, 3, generator=gen) / 50, (128, 128)))
    for label, scale, block in cases:
        reason = _compare(f"FP8 GEMM ({label})", device, dtype,
                          lambda s=scale, b=block: fp8.fp8_gemm(x.to(device), weight.to(device), s.to(device),
                                                                bias.to(device), b),
                          lambda s=scale, b=block: fp8.reference_fp8_gemm(x, weight, s, bias, b), relative=True)
        if reason:
            return reason
    return None


def check_layer_ops(device: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> str | None:
    """The fused layer ops (kernels/triton_layer_ops.py) against their references on ``device`` at the model's
    head shape, q/k as strided views into one qkv row as the models pass them; None when all match."""
    from kubellm.kernels import triton_layer_ops as ops

    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, d = num_heads or 4, num_kv_heads or 2, head_dim or 64
    t, hidden, inter = 5, 320, 200  # not powers of two: masked tails

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    x, res, w, gate_up = rand(t, hidden), rand(t, hidden), rand(hidden), rand(t, 2 * inter)
    qkv, qw, kw = rand(t, (heads + 2 * kv_heads) * d), rand(d), rand(d)
    cos, sin = rand(40, d), rand(40, d)
    pos = torch.tensor([0, 39, 7, 7, 1])

    def split(a):
        q, k, _ = a.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        return q.view(t, heads, d), k.view(t, kv_heads, d)

    def in_place(fn, *tensors):
        """Run ``fn`` on copies of ``tensors``, return them concatenated (what an in-place op leaves)."""
        copies = [a.clone() for a in tensors]
        fn(*copies)
        return torch.cat([a.flatten() for a in copies])

    def on(device_, f):  # the inputs on ``device_``, then f of them
        return lambda: f(*(a.to(device_) for a in (x, res, w, gate_up, qkv, qw, kw, cos, sin, pos)))

    cases = [
        ("RMSNorm", lambda m: lambda x, r, w, *_: m.rms_norm(x, w, 1e-6)),
        ("residual add + RMSNorm", lambda m: lambda x, r, w, *_: in_place(
            lambda a, b: m.add_rms_norm_(a, b, w, 1e-6), x, r)),
        ("SiLU-and-mul", lambda m: lambda x, r, w, gu, *_: m.silu_and_mul(gu)),
        ("rotary embedding", lambda m: lambda x, r, w, gu, qkv, qw, kw, c, s, p: in_place(
            lambda a: m.rotary_embedding_(p, *split(a), c, s), qkv)),
        ("q/k norm + rotary", lambda m: lambda x, r, w, gu, qkv, qw, kw, c, s, p: in_place(
            lambda a: m.qk_norm_rotary_(p, *split(a), qw, kw, 1e-6, c, s), qkv)),
    ]
    refs = SimpleNamespace(rms_norm=ops.reference_rms_norm, add_rms_norm_=ops.reference_add_rms_norm_,
                           silu_and_mul=ops.reference_silu_and_mul, rotary_embedding_=ops.reference_rotary_embedding_,
                           qk_norm_rotary_=ops.reference_qk_norm_rotary_)
    for name, make in cases:
        # Relative: products of random tables reach ~10, where one bf16 ulp exceeds the absolute tolerance.
        reason = _compare(name, device, dtype, on(device, make(ops)), on("cpu", make(refs)), relative=True)
        if reason:
            return reason
    return None

