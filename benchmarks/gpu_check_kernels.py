"""Kernel half of `benchmarks/gpu_check.py`: every Triton kernel against its PyTorch reference at real shapes,
then timed against what it competes with.

Correctness: each kernel runs on the device; its plain-PyTorch reference (the one the kernel module exports)
runs on the same rounded inputs upcast to float32, so the reference is the exact answer and the kernel's error
is its own. An element passes when ``|kernel - reference| <= atol + rtol * |reference|`` (torch.testing's
rule; tolerances in ``TOLERANCES``). Reported: the largest absolute error and the largest relative error over
elements with ``|reference| > atol`` (relative error near zero says nothing). A kernel that raises fails its
check with the exception.

Timing (CUDA: ``triton.testing.do_bench``, median; CPU self-test: wall clock of one call, meaningless as a
speed and reported only to exercise the code):

* paged decode: bytes the kernel must read (the context's K and V, plus q and the output) per second,
  against the device's peak memory bandwidth (:func:`peak_bandwidth`);
* prefill: causal attention FLOP/s (4 · heads · head_dim · visible (query, key) pairs) against torch SDPA
  over the same tensors, and FlashAttention's ``flash_attn_func`` when it imports;
* ``--quantization int8`` / ``int4`` GEMMs (the int8 kernel; int4 is the grouped 4-bit GEMM on the runtime's own
  int4 weights, groups of 32 with float zero points): time against cuBLAS ``torch.matmul`` on the bf16 weight
  they quantize;
* pre-quantized GEMMs (grouped 4-bit asymmetric g128 as AWQ/GPTQ store it, the same with act-order, grouped
  8-bit g128, FP8 per channel and per 128x128 block): likewise, from the same bf16 weight quantized by
  :func:`prequantized_weights` into each format's form.

The fused layer ops (RMSNorm, residual add + RMSNorm, SiLU-and-mul, rotary, q/k norm + rotary) are checked
(:func:`check_layer_ops`), not timed here: their gain is fewer launches per decode step (the ``profile`` part).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from gpu_check_report import Check, Section, Table

from kubellm.kernels import triton_fp8_gemm, triton_grouped_gemm, triton_int8_gemm, triton_layer_ops
from kubellm.kernels import triton_paged_attention as decode
from kubellm.kernels import triton_prefill_attention as prefill
from kubellm.runtime.layers.quantized_weight import QuantizedWeight
from kubellm.runtime.quantization.int4 import int4_group, quantize_int4
from kubellm.runtime.quantization.int8 import quantize_int8

# (atol, rtol) per activation dtype: float32 to accumulation-order noise; bf16/fp16 to a few ulps of the
# output's own rounding (the kernels write their dtype, the reference stays float32).
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 2e-2), torch.float16: (4e-3, 4e-3)}

# Peak memory bandwidth (GB/s) by device name, for when torch does not expose the memory clock and bus width.
# Vendor data sheets; the first matching key wins, so the more specific names come first.
PEAK_BANDWIDTH_GBS = {
    "H200": 4800.0,
    "H100 PCIe": 2000.0,
    "H100 NVL": 3900.0,
    "H100": 3350.0,  # SXM5
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100": 1555.0,  # 40GB
    "L40S": 864.0,
    "L40": 864.0,
    "L4": 300.0,
}


@dataclass(frozen=True)
class AttentionShape:
    heads: int
    kv_heads: int
    head_dim: int

    def __str__(self) -> str:
        return f"{self.heads}q/{self.kv_heads}kv x {self.head_dim}"


@dataclass(frozen=True)
class GemmShape:
    name: str
    n: int  # output features
    k: int  # input features


@dataclass(frozen=True)
class Sweep:
    """Which shapes each kernel runs at. ``decode``: (batch, context lengths) cases; ``prefill``: (queries,
    keys) cases, keys >= queries (a later chunk when greater); ``*_timing_only``: too big for the reference's
    memory, timed but not compared; ``gemm_rows``: M (tokens per step) for every GEMM shape;
    ``decode_partition``: also check the first decode case split into partitions of this many tokens (the
    CPU self-test, where the launcher never splits unasked; on a GPU it splits small batches by itself)."""

    attention: AttentionShape
    block_size: int
    decode: list[tuple[str, list[int]]]
    prefill: list[tuple[int, int]]
    prefill_timing_only: list[tuple[int, int]]
    gemms: list[GemmShape]
    gemm_rows: list[int]
    dtypes: list[torch.dtype]  # every case
    extra_dtypes: list[torch.dtype]  # the first case of each kernel only
    decode_partition: int = 0
    layer_ops: tuple[int, int] = (4096, 14336)  # (hidden, intermediate) of the fused layer ops, heads = attention's
    layer_rows: tuple[int, ...] = (1, 32, 256)  # tokens per step; every dtype of dtypes + extra_dtypes at each


def _lengths(batch: int, low: int, high: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(low, high + 1, (batch,), generator=gen)]


# Llama-3-8B and Qwen3-8B share their attention (32 query heads, 8 kv heads, head_dim 128) and q/k/v/o
# projections; their MLPs differ (intermediate 14336 and 12288).
FULL = Sweep(
    attention=AttentionShape(32, 8, 128),
    block_size=16,
    decode=[("batch 1, ctx 128", [128]), ("batch 1, ctx 32768", [32768]), ("batch 4, ctx 8192", [8192] * 4),
            ("batch 32, ctx 4096", [4096] * 32),
            ("batch 256, ctx 128-2048", _lengths(256, 128, 2048, seed=0)), ("batch 256, ctx 4096", [4096] * 256)],
    prefill=[(128, 128), (1024, 1024), (4096, 4096), (512, 8192)],
    prefill_timing_only=[(8192, 8192), (16384, 16384)],
    gemms=[GemmShape("qkv (Llama-3-8B, Qwen3-8B)", 6144, 4096), GemmShape("o (Llama-3-8B, Qwen3-8B)", 4096, 4096),
           GemmShape("gate_up (Llama-3-8B)", 2 * 14336, 4096), GemmShape("down (Llama-3-8B)", 4096, 14336),
           GemmShape("gate_up (Qwen3-8B)", 2 * 12288, 4096), GemmShape("down (Qwen3-8B)", 4096, 12288)],
    gemm_rows=[1, 32, 256],
    dtypes=[torch.bfloat16],
    extra_dtypes=[torch.float16, torch.float32],
)

# The CPU self-test: the same code paths at shapes Triton's interpreter gets through in seconds.
TINY = Sweep(
    attention=AttentionShape(4, 2, 16),
    block_size=16,
    decode=[("batch 3, ctx 1-40", [1, 17, 40])],
    prefill=[(17, 17), (7, 33)],
    prefill_timing_only=[],
    gemms=[GemmShape("tiny", 32, 256)],
    gemm_rows=[3],
    dtypes=[torch.float32],
    extra_dtypes=[torch.bfloat16],
    decode_partition=16,
    layer_ops=(40, 24),
    layer_rows=(3,),
)


# ------------------------------------------------------------------------------------------------ compare


def compare(name: str, case: str, dtype: torch.dtype, kernel: Callable[[], torch.Tensor],
            reference: Callable[[], torch.Tensor]) -> Check:
    """Run ``kernel()`` (output in ``dtype``) and ``reference()`` (float32); pass/fail by TOLERANCES[dtype]."""
    atol, rtol = TOLERANCES[dtype]
    tolerance = f"atol {atol:g} + rtol {rtol:g}"
    try:
        out = kernel().float()
    except Exception as e:  # noqa: BLE001 - a compile or launch failure is this check's answer
        return Check(name, case, False, "-", tolerance, f"the kernel raised {type(e).__name__}: {e}")
    ref = reference().float().to(out.device)
    diff = (out - ref).abs().nan_to_num(float("inf"))
    bad = diff > atol + rtol * ref.abs()
    big = ref.abs() > atol
    max_abs = diff.max().item()
    max_rel = (diff[big] / ref.abs()[big]).max().item() if big.any() else 0.0
    measured = f"max abs {max_abs:.3g}, max rel {max_rel:.3g}"
    if not bad.any():
        return Check(name, case, True, measured, tolerance)
    first = [int(i) for i in torch.nonzero(bad)[0]]
    return Check(name, case, False, measured, tolerance,
                 f"{int(bad.sum())} of {bad.numel()} elements out of tolerance (first at {first}: "
                 f"{out[tuple(first)].item():.5g} vs {ref[tuple(first)].item():.5g})")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------------------------------------ cases


def decode_case(lens: list[int], shape: AttentionShape, block_size: int, dtype: torch.dtype, device: str,
                seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``(q, k_cache, v_cache, block_tables, context_lens)`` for sequences of ``lens`` tokens, laid out as the
    kernels' contract says, and adversarially: shuffled block ids, NaN in every slot no sequence owns (a
    spare block, the tail of each last block) and out-of-range ids past each table's end, so a read outside
    the contract shows up as NaN or a crash. Built on ``device`` in one pass (real shapes hold 1M tokens)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks) + 1
    pool = (num_blocks, block_size, shape.kv_heads, shape.head_dim)
    torch.manual_seed(seed)
    k_cache = torch.randn(pool, device=device).to(dtype)
    v_cache = torch.randn(pool, device=device).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(lens), max(blocks)), num_blocks + 1000, dtype=torch.int32)
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    start = 0
    for b, (n, nb) in enumerate(zip(lens, blocks, strict=True)):
        seq_blocks = ids[start : start + nb]
        start += nb
        tables[b, :nb] = seq_blocks.to(torch.int32)
        owned[seq_blocks] = True
        owned[seq_blocks[-1], n - (nb - 1) * block_size :] = False
    unowned = (~owned).to(device)
    k_cache[unowned] = float("nan")
    v_cache[unowned] = float("nan")
    q = torch.randn(len(lens), shape.heads, shape.head_dim, device=device).to(dtype)
    return q, k_cache, v_cache, tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def prefill_case(queries: int, keys: int, shape: AttentionShape, dtype: torch.dtype, device: str,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    q = torch.randn(queries, shape.heads, shape.head_dim, device=device).to(dtype)
    k = torch.randn(keys, shape.kv_heads, shape.head_dim, device=device).to(dtype)
    v = torch.randn(keys, shape.kv_heads, shape.head_dim, device=device).to(dtype)
    return q, k, v


@dataclass
class GemmWeights:
    """One layer's weight ``[N, K]`` in bf16 and in the two weight-only forms the runtime computes from it."""

    bf16: torch.Tensor
    q8: torch.Tensor  # int8 [N, K]
    s8: torch.Tensor  # float32 [N]
    int4: triton_grouped_gemm.GroupedWeight  # 4-bit, groups of 32, float zero points


def gemm_weights(shape: GemmShape, device: str, seed: int = 0) -> GemmWeights:
    """A bf16 weight with a trained layer's scale (std 0.02), quantized by the runtime's own quantizers: what
    ``--quantization int8`` serves, and what ``--quantization int4`` serves through the grouped 4-bit GEMM."""
    torch.manual_seed(seed)
    w = (0.02 * torch.randn(shape.n, shape.k, device=device)).to(torch.bfloat16)
    int4 = triton_grouped_gemm.pack(quantize_int4(w, int4_group(shape.k)), 4)
    return GemmWeights(w, *quantize_int8(w), int4)


def _int4_call(x: torch.Tensor, w: triton_grouped_gemm.GroupedWeight) -> torch.Tensor:
    return triton_grouped_gemm.grouped_gemm(x, w.packed, w.scales, w.zeros, w.perm, None, w.group, w.bits)


def _int4_reference(x: torch.Tensor, w: triton_grouped_gemm.GroupedWeight) -> torch.Tensor:
    return triton_grouped_gemm.reference_grouped_gemm(x, w.packed, w.scales, w.zeros, w.perm, None, w.group, w.bits)


def _int4_bytes(w: triton_grouped_gemm.GroupedWeight) -> int:
    """What one call reads: packed words, scales and zero points."""
    return sum(t.numel() * t.element_size() for t in (w.packed, w.scales, w.zeros) if t is not None)


def quantize_grouped(w: torch.Tensor, bits: int, group: int, act_order: bool = False,
                     seed: int = 0) -> QuantizedWeight:
    """``w [N, K]`` in the form AWQ / GPTQ asymmetric checkpoints store: unsigned values, min-max scale and
    integer zero point per (output, group). ``act_order``: the groups take the inputs in a random order (GPTQ
    ``desc_act``), recorded in ``g_idx``."""
    n, k = w.shape
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed)).to(w.device) if act_order else None
    grouped = (w if order is None else w[:, order]).float().view(n, k // group, group)
    lo, hi = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
    top = (1 << bits) - 1
    scales = ((hi - lo) / top).clamp(min=1e-8)
    zeros = (-lo / scales).round().clamp(0, top)
    values = (grouped / scales[..., None] + zeros[..., None]).round().clamp(0, top).view(n, k).to(torch.int32)
    g_idx = None
    if order is not None:
        values = torch.empty_like(values).index_copy_(1, order, values)
        g_idx = torch.empty(k, dtype=torch.int32, device=w.device).index_copy_(
            0, order, (torch.arange(k, device=w.device) // group).to(torch.int32))
    return QuantizedWeight(values, scales, zeros, group, g_idx)


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` → (e4m3 weight, float32 scale) as FP8 checkpoints store them: the amax of each output
    channel (``block`` None) or of each block mapped to 448, the largest e4m3 value."""
    n, k = w.shape
    w = w.float()
    if block is None:
        scale = (w.abs().amax(1, keepdim=True) / 448).clamp(min=1e-12)
        return (w / scale).to(torch.float8_e4m3fn), scale
    rows, cols = block
    padded = F.pad(w, (0, -k % cols, 0, -n % rows))
    amax = padded.view(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols).abs().amax((1, 3))
    scale = (amax / 448).clamp(min=1e-12)
    expanded = scale.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
    return (w / expanded).to(torch.float8_e4m3fn), scale


@dataclass
class PrequantizedCase:
    """One pre-quantized form of a layer's weight and how to call its kernel and reference on ``x``."""

    name: str  # the kernel check's name
    label: str  # what the case adds to the shape (group, scales)
    kernel: Callable[[torch.Tensor], torch.Tensor]
    reference: Callable[[torch.Tensor], torch.Tensor]  # on float32 x
    weight_bytes: int  # what one call reads: packed weight, scales, zeros


def prequantized_weights(w: torch.Tensor) -> list[PrequantizedCase]:
    """``w`` (bf16 ``[N, K]``) in each pre-quantized form the Triton GEMMs serve."""
    group = int4_group(w.shape[1])
    cases = []
    for bits, act_order in ((4, False), (4, True), (8, False)):
        p = triton_grouped_gemm.pack(quantize_grouped(w, bits, group, act_order), bits)
        args = (p.packed, p.scales, p.zeros, p.perm, None, p.group, p.bits)
        cases.append(PrequantizedCase(
            f"grouped {bits}-bit GEMM", f"group {group}, zeros{', act-order' if act_order else ''}",
            partial(_grouped_call, args=args), partial(_grouped_reference, args=args),
            p.packed.numel() * 4 + p.scales.numel() * 4 + p.zeros.numel() * 4))
    for block in (None, (128, 128)):
        weight, scale = quantize_fp8(w, block)
        cases.append(PrequantizedCase(
            "FP8 GEMM", "per channel" if block is None else "128x128 blocks",
            partial(_fp8_call, weight=weight, scale=scale, block=block),
            partial(_fp8_reference, weight=weight, scale=scale, block=block),
            weight.numel() + scale.numel() * 4))
    return cases


def _grouped_call(x: torch.Tensor, args: tuple) -> torch.Tensor:
    return triton_grouped_gemm.grouped_gemm(x, *args)


def _grouped_reference(x: torch.Tensor, args: tuple) -> torch.Tensor:
    return triton_grouped_gemm.reference_grouped_gemm(x, *args)


def _fp8_call(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    return triton_fp8_gemm.fp8_gemm(x, weight, scale, None, block)


def _fp8_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    return triton_fp8_gemm.reference_fp8_gemm(x, weight, scale, None, block)


def _activations(rows: int, k: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.randn(rows, k, device=device).to(dtype)


# ------------------------------------------------------------------------------------------------ correctness


def _dtype_cases(sweep: Sweep, cases: list) -> list[tuple[object, torch.dtype]]:
    """Every case in sweep.dtypes, and the first case again in each of sweep.extra_dtypes."""
    out = [(c, d) for c in cases for d in sweep.dtypes]
    return out + [(cases[0], d) for d in sweep.extra_dtypes] if cases else out


def check_kernels(section: Section, sweep: Sweep, device: str) -> None:
    shape, bs = sweep.attention, sweep.block_size
    scale = shape.head_dim**-0.5
    cases = [(c, d, None) for c, d in _dtype_cases(sweep, sweep.decode)]
    if sweep.decode_partition:  # the split path where the launcher would not choose it
        cases += [(c, d, sweep.decode_partition) for c, d in _dtype_cases(sweep, sweep.decode[:1])]
    for (label, lens), dtype, partition in cases:
        q, kc, vc, bt, cl = decode_case(lens, shape, bs, dtype, device)
        path = _decode_path(q, kc, bt, partition)
        section.checks.append(compare(
            "paged decode attention", f"{shape}, block {bs}, {label}, {path}, {_dtype_name(dtype)}", dtype,
            partial(decode.paged_decode_attention, q, kc, vc, bt, cl, scale, block_n=16 if partition else 64,
                    partition=partition),
            partial(decode.reference_paged_decode_attention, q.float(), kc.float(), vc.float(), bt, cl, scale)))
        del q, kc, vc
    for (t, s), dtype in _dtype_cases(sweep, sweep.prefill):
        q, k, v = prefill_case(t, s, shape, dtype, device)
        section.checks.append(compare(
            "prefill attention", f"{shape}, {t} queries over {s} keys, {_dtype_name(dtype)}", dtype,
            partial(prefill.prefill_attention, q, k, v, scale),
            partial(prefill.reference_prefill_attention, q.float(), k.float(), v.float(), scale)))
        del q, k, v
    for g in sweep.gemms:
        w = gemm_weights(g, device)
        for rows, dtype in _dtype_cases(sweep, sweep.gemm_rows):
            x = _activations(rows, g.k, dtype, device)
            case = f"{g.name}: M {rows}, N {g.n}, K {g.k}, {_dtype_name(dtype)}"
            section.checks.append(compare(
                "int8 GEMM", case, dtype, partial(triton_int8_gemm.int8_gemm, x, w.q8, w.s8),
                partial(triton_int8_gemm.reference_int8_gemm, x.float(), w.q8, w.s8)))
            section.checks.append(compare(
                "int4 GEMM", f"{case}, grouped 4-bit GEMM, group {w.int4.group}, zeros", dtype,
                partial(_int4_call, x, w.int4), partial(_int4_reference, x.float(), w.int4)))
        prequantized = prequantized_weights(w.bf16)
        for rows, dtype in _dtype_cases(sweep, sweep.gemm_rows):
            x = _activations(rows, g.k, dtype, device)
            for c in prequantized:
                section.checks.append(compare(
                    c.name, f"{g.name}: M {rows}, N {g.n}, K {g.k}, {c.label}, {_dtype_name(dtype)}", dtype,
                    partial(c.kernel, x), partial(c.reference, x.float())))
        del w, prequantized
        _free(device)
    check_layer_ops(section, sweep, device)


def _in_place(fn: Callable[..., None], *tensors: torch.Tensor) -> torch.Tensor:
    """``fn`` on copies of ``tensors``; what it left in them, flattened into one tensor."""
    copies = [t.clone() for t in tensors]
    fn(*copies)
    return torch.cat([t.flatten() for t in copies])


def check_layer_ops(section: Section, sweep: Sweep, device: str) -> None:
    """The fused layer ops (kernels/triton_layer_ops.py) at the sweep's hidden / intermediate / head shapes, every
    row count in every dtype."""
    gen = torch.Generator().manual_seed(14)
    for dtype in [*sweep.dtypes, *sweep.extra_dtypes]:
        for rows in sweep.layer_rows:
            section.checks += _layer_op_checks(sweep, rows, dtype, device, gen)


def _layer_op_checks(sweep: Sweep, rows: int, dtype: torch.dtype, device: str, gen: torch.Generator) -> list[Check]:
    """One row count in one dtype: q and k as views into one fused qkv row, as the models pass them; real rotary
    tables (theta 1e6, 8192 positions); the references on the same inputs upcast to float32."""
    from kubellm.runtime.layers.rotary import RotaryEmbedding

    ops, shape, eps = triton_layer_ops, sweep.attention, 1e-6
    hidden, inter = sweep.layer_ops
    h, kvh, d = shape.heads, shape.kv_heads, shape.head_dim
    rope = RotaryEmbedding(d, 8192, 1e6, None, dtype)
    cos, sin = rope.cos.to(device), rope.sin.to(device)

    def rand(*size, scale=1.0):
        return (torch.randn(*size, generator=gen) * scale).to(dtype).to(device)

    def split(qkv: torch.Tensor):
        q, k, _ = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
        return q.view(-1, h, d), k.view(-1, kvh, d)

    x, res, gate_up = rand(rows, hidden), rand(rows, hidden, scale=4), rand(rows, 2 * inter, scale=3)
    qkv = rand(rows, (h + 2 * kvh) * d, scale=2)
    w, qw, kw = rand(hidden, scale=0.3) + 1, rand(d, scale=0.3) + 1, rand(d, scale=0.3) + 1
    pos = torch.randint(0, 8192, (rows,), generator=gen).to(device)
    xf, resf, guf, qkvf, wf, qwf, kwf, cf, sf = (t.float() for t in (x, res, gate_up, qkv, w, qw, kw, cos, sin))
    cases = [
        ("RMSNorm", f"{rows} x {hidden}", partial(ops.rms_norm, x, w, eps),
         partial(ops.reference_rms_norm, xf, wf, eps)),
        ("residual add + RMSNorm", f"{rows} x {hidden}, in place",
         partial(_in_place, lambda a, b: ops.add_rms_norm_(a, b, w, eps), x, res),
         partial(_in_place, lambda a, b: ops.reference_add_rms_norm_(a, b, wf, eps), xf, resf)),
        ("SiLU-and-mul", f"{rows} x 2*{inter}", partial(ops.silu_and_mul, gate_up),
         partial(ops.reference_silu_and_mul, guf)),
        ("rotary embedding", f"{rows} tokens, {shape}, qkv views, in place",
         partial(_in_place, lambda a: ops.rotary_embedding_(pos, *split(a), cos, sin), qkv),
         partial(_in_place, lambda a: ops.reference_rotary_embedding_(pos, *split(a), cf, sf), qkvf)),
        ("q/k norm + rotary", f"{rows} tokens, {shape}, qkv views, in place",
         partial(_in_place, lambda a: ops.qk_norm_rotary_(pos, *split(a), qw, kw, eps, cos, sin), qkv),
         partial(_in_place, lambda a: ops.reference_qk_norm_rotary_(pos, *split(a), qwf, kwf, eps, cf, sf), qkvf)),
    ]
    return [compare(name, f"{case}, {_dtype_name(dtype)}", dtype, kernel, reference)
            for name, case, kernel, reference in cases]


# ------------------------------------------------------------------------------------------------ timing


def measure_ms(fn: Callable[[], object], device: str) -> float:
    """Median milliseconds per call: triton's do_bench on CUDA (warm-up, L2 flushed between calls); on CPU
    one call after one warm-up (the self-test: the interpreter's speed means nothing)."""
    if device.startswith("cuda"):
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def measure_replayed_ms(fn: Callable[[], object], device: str) -> float | None:
    """Median milliseconds per call replayed from a CUDA graph (triton's do_bench_cudagraph): the GPU's time
    without the host's launch cost, as graph-served decode runs (L2 not flushed between calls); None off CUDA."""
    if not device.startswith("cuda"):
        return None
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, rep=100, return_mode="median"))


def peak_bandwidth(device: str) -> tuple[float | None, str]:
    """(peak GB/s, where it came from): memory clock x bus width x 2 (double data rate) from torch's device
    properties when it exposes them, else PEAK_BANDWIDTH_GBS by device name, else unknown."""
    if not device.startswith("cuda"):
        return None, "no peak bandwidth for a CPU run"
    props = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        gbs = bus_bits / 8 * clock_khz * 1e3 * 2 / 1e9
        return gbs, f"{gbs:.0f} GB/s from torch device properties ({clock_khz / 1e3:.0f} MHz x {bus_bits}-bit x 2)"
    return bandwidth_from_name(props.name)


def bandwidth_from_name(name: str) -> tuple[float | None, str]:
    for key, gbs in PEAK_BANDWIDTH_GBS.items():
        if key.lower() in name.lower():
            return gbs, f"{gbs:.0f} GB/s from the data-sheet table for {key!r} (torch gave no memory clock)"
    return None, f"peak bandwidth unknown for {name!r} (no memory clock from torch, not in the table)"


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:,.{digits}f}"


def _decode_path(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                 partition: int | None = None) -> str:
    """Which kernel path a decode call takes: the launcher's choice unless ``partition`` forces one."""
    partition = decode.chosen_partition(q, k_cache, block_tables) if partition is None else partition
    if not partition:
        return "single pass"
    parts = -(-block_tables.shape[1] * k_cache.shape[1] // partition)
    return f"split KV {parts} x {partition} tokens"


def time_decode(section: Section, sweep: Sweep, device: str) -> None:
    shape, bs = sweep.attention, sweep.block_size
    peak, source = peak_bandwidth(device)
    table = Table("Paged decode attention (bf16)" if sweep is FULL else "Paged decode attention",
                  ["case", "path", "time (us)", "GB/s read", "% of peak", "single pass (us)", "split speed-up",
                   "replayed (us)", "single pass replayed (us)"],
                  notes=[f"peak: {source}",
                         "bytes: the context's K and V (every token, every kv head) plus q and the output, per call "
                         "(not the split path's float32 partials, a few hundred KB)",
                         "path: the launcher's own choice (partition_tokens: split KV when batch x kv heads "
                         "programs leave SMs idle); single pass: the same call forced to partition=0",
                         "time: do_bench, L2 flushed, includes the host's launch cost where it outlasts the flush; "
                         "replayed: calls replayed from a CUDA graph (no launch cost, L2 warm), as graphs serve "
                         "decode"])
    dtype = sweep.dtypes[0]
    for label, lens in sweep.decode:
        q, kc, vc, bt, cl = decode_case(lens, shape, bs, dtype, device)
        kv_bytes = 2 * sum(lens) * shape.kv_heads * shape.head_dim * kc.element_size()
        total = kv_bytes + 2 * q.numel() * q.element_size() + bt.numel() * 4
        call = partial(decode.paged_decode_attention, q, kc, vc, bt, cl, shape.head_dim**-0.5)
        ms = measure_ms(call, device)
        gbs = total / (ms * 1e-3) / 1e9
        path = _decode_path(q, kc, bt)
        single = measure_ms(partial(call, partition=0), device) if path != "single pass" else None
        replayed = single_replayed = None
        try:
            replayed = measure_replayed_ms(call, device)
            single_replayed = measure_replayed_ms(partial(call, partition=0), device) if single else None
        except Exception as e:  # noqa: BLE001 - the launch-bound times above still stand
            table.notes.append(f"{label}: graph replay failed: {type(e).__name__}: {e}")
        table.rows.append([f"{label}, {shape}", path, _fmt(ms * 1e3), _fmt(gbs),
                           _fmt(100 * gbs / peak) if peak else "-", _fmt(single and single * 1e3),
                           _fmt(single and single / ms, 2) + ("x" if single else ""),
                           _fmt(replayed and replayed * 1e3), _fmt(single_replayed and single_replayed * 1e3)])
        del q, kc, vc
    section.tables.append(table)


def causal_flops(queries: int, keys: int, shape: AttentionShape) -> float:
    """4 · heads · head_dim per visible (query, key) pair: QK^T and PV, a multiply and an add each."""
    visible = queries * (keys - queries) + queries * (queries + 1) // 2
    return 4.0 * shape.heads * shape.head_dim * visible


def _flash_attn():
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


def time_prefill(section: Section, sweep: Sweep, device: str) -> None:
    shape, dtype = sweep.attention, sweep.dtypes[0]
    scale = shape.head_dim**-0.5
    flash = _flash_attn() if device.startswith("cuda") and dtype != torch.float32 else None
    table = Table(f"Prefill attention ({_dtype_name(dtype)}), TFLOP/s",
                  ["queries x keys", "Triton (ms)", "Triton", "torch SDPA", "FlashAttention", "Triton speed / SDPA"],
                  notes=["FLOPs: 4 x heads x head_dim x visible (query, key) pairs (causal)",
                         "SDPA: F.scaled_dot_product_attention(is_causal=True, enable_gqa=True), whole prompts "
                         "only (its causal mask is top-left aligned, wrong for a later chunk)"])
    if flash is None:
        table.notes.append("FlashAttention: not importable here (pip install flash-attn), column empty")
    for t, s in sweep.prefill + sweep.prefill_timing_only:
        q, k, v = prefill_case(t, s, shape, dtype, device)
        tflops = causal_flops(t, s, shape) / 1e12
        triton_ms = measure_ms(partial(prefill.prefill_attention, q, k, v, scale), device)
        sdpa_ms = flash_ms = None
        if t == s:
            qh, kh, vh = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))
            sdpa_ms = measure_ms(partial(F.scaled_dot_product_attention, qh, kh, vh, is_causal=True, scale=scale,
                                         enable_gqa=True), device)
        if flash is not None:
            qb, kb, vb = (x.unsqueeze(0) for x in (q, k, v))
            flash_ms = measure_ms(partial(flash, qb, kb, vb, causal=True, softmax_scale=scale), device)
        rates = [tflops / (ms * 1e-3) if ms else None for ms in (triton_ms, sdpa_ms, flash_ms)]
        table.rows.append([f"{t} x {s}", _fmt(triton_ms, 3), *(_fmt(r, 2) for r in rates),
                           _fmt(sdpa_ms / triton_ms, 2) if sdpa_ms else "-"])
        del q, k, v
    section.tables.append(table)


def time_gemms(section: Section, sweep: Sweep, device: str) -> None:
    dtype = torch.bfloat16
    table = Table("Weight-only GEMMs (bf16 activations) against cuBLAS bf16 torch.matmul",
                  ["layer", "M", "bf16 matmul (us)", "int8 (us)", "int4 (us)", "int8 speed-up", "int4 speed-up",
                   "int4 weight GB/s"],
                  notes=["speed-up: bf16 time / kernel time (> 1: faster than cuBLAS on the unquantized weight)",
                         "int4: the grouped 4-bit GEMM on --quantization int4's weights (groups of 32, zero points)",
                         "int4 weight GB/s: packed weight + scales + zeros per call (the floor at small M)"])
    for g in sweep.gemms:
        w = gemm_weights(g, device)
        for rows in sweep.gemm_rows:
            x = _activations(rows, g.k, dtype, device)
            bf16 = measure_ms(partial(torch.matmul, x, w.bf16.T), device)
            i8 = measure_ms(partial(triton_int8_gemm.int8_gemm, x, w.q8, w.s8), device)
            i4 = measure_ms(partial(_int4_call, x, w.int4), device)
            i4_bytes = _int4_bytes(w.int4)
            table.rows.append([g.name, str(rows), _fmt(bf16 * 1e3), _fmt(i8 * 1e3), _fmt(i4 * 1e3),
                               _fmt(bf16 / i8, 2), _fmt(bf16 / i4, 2), _fmt(i4_bytes / (i4 * 1e-3) / 1e9)])
        del w
        _free(device)
    section.tables.append(table)
    time_prequantized_gemms(section, sweep, device)


def time_prequantized_gemms(section: Section, sweep: Sweep, device: str) -> None:
    dtype = torch.bfloat16
    table = Table("Pre-quantized weight GEMMs (bf16 activations) against cuBLAS bf16 torch.matmul",
                  ["layer", "M", "form", "bf16 matmul (us)", "kernel (us)", "speed-up", "weight GB/s"],
                  notes=["forms: the bf16 weight quantized as each format stores it (prequantized_weights)",
                         "speed-up: bf16 time / kernel time; weight GB/s: packed weight + scales + zeros per call"])
    for g in sweep.gemms:
        w = gemm_weights(g, device)
        cases = prequantized_weights(w.bf16)
        for rows in sweep.gemm_rows:
            x = _activations(rows, g.k, dtype, device)
            bf16 = measure_ms(partial(torch.matmul, x, w.bf16.T), device)
            for c in cases:
                ms = measure_ms(partial(c.kernel, x), device)
                table.rows.append([g.name, str(rows), f"{c.name}, {c.label}", _fmt(bf16 * 1e3), _fmt(ms * 1e3),
                                   _fmt(bf16 / ms, 2), _fmt(c.weight_bytes / (ms * 1e-3) / 1e9)])
        del w, cases
        _free(device)
    section.tables.append(table)


def _free(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
