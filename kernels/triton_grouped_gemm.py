"""Weight-only 4-bit and 8-bit GEMM with per-group scales and zero points in Triton (CUDA), beside its
plain-PyTorch reference: the GPU kernel for pre-quantized checkpoints (AWQ, GPTQ 4/8-bit with act-order,
compressed-tensors W4A16/W8A16, GGUF's 4/8-bit forms).

Math: ``y = x @ ((q - z) * s).T (+ bias)`` where, for output ``n`` and input ``k`` of group ``g(k)``,
``q[n, k]`` is an unsigned ``BITS``-bit value, ``z = zeros[g, n]`` and ``s = scales[g, n]``.

Layouts (what :func:`pack` writes from a ``QuantizedWeight`` of runtime/layers/quantized_weight.py):

* ``packed`` int32 ``[K * BITS / 32, N]``: word ``[j, n]`` holds inputs ``k = j * P .. j * P + P - 1`` of output
  ``n`` (``P = 32 / BITS`` values per word), input ``j * P + i`` in bits ``i * BITS .. i * BITS + BITS - 1``
  (low bits first). The same words as GPTQ v1's ``qweight``; a column of 32 / BITS inputs per word keeps a
  K tile's loads contiguous along N (coalesced) and each word is widened in registers.
* ``scales`` float32 ``[K / group, N]``; ``zeros`` float32 ``[K / group, N]`` or None, which means the
  symmetric zero ``2^(BITS-1)`` (8 for 4 bits, 128 for 8). Float zeros take GGUF's non-integer ones.
* ``group``: inputs per scale, a multiple of 16 (32, 64, 128...) dividing ``K``, or ``K`` (per channel).
* ``perm`` int64 ``[K]`` or None: act-order (GPTQ ``desc_act``, compressed-tensors ``actorder: group``).
  :func:`pack` sorts the inputs by their group (``g_idx``) once, so groups are contiguous in ``packed``;
  :func:`grouped_gemm` then reads ``x[:, perm]`` (the same permutation on both sides: the sum is unchanged).

Entry point, for the loader through runtime/layers/kernel_choice.py (``grouped_int4_gemm`` / ``grouped_int8_gemm`` =
``triton``)::

    w = pack(quantized_weight, bits)              # once, at load
    y = grouped_gemm(x, w.packed, w.scales, w.zeros, w.perm, bias, w.group, w.bits)

``x`` ``[M, K]`` bf16, fp16 or fp32 (rows may be strided), ``bias`` ``[N]`` (any float dtype), ``y`` ``[M, N]``
in ``x``'s dtype with float32 accumulation. Each program computes a BLOCK_M x BLOCK_N tile of ``y`` over its
share of K (split-K and tile sizes: kernels/triton_gemm_tiles.py). Per K tile it loads each packed word once (a
``[BLOCK_K / P, BLOCK_N]`` tile: 4 bits of traffic per 4-bit weight, not the 32 of loading the word per input)
and, for each of the word's ``P`` bit fields ``i``, shifts the field out and multiplies it with ``x``'s inputs
``j * P + i``: ``P`` dots of K = BLOCK_K / P (>= 16 words, so BLOCK_K >= 128 at 4 bits, 64 at 8). The sum over
the fields is the tile's product in any order, so nothing is reshaped. Scales:

* a K tile inside one group (the group a multiple of BLOCK_K, or per channel): the zero point is subtracted
  (exact in bf16 for integer zeros: |q - z| <= 255) and the tile's partial sum scaled once, after its dots;
* smaller groups (GPTQ/AWQ's 32 or 64 under a 128-input tile): every word row's scale and zero are loaded
  (a word's inputs share a group) and the weight dequantized before the dot, in float32, then rounded to
  ``x``'s dtype once.

This is the ``fields`` form, launched for M <= 8 rows. Above 8 rows the ``words`` form (run 3's kernel,
``_grouped_gemm_words_kernel``) runs instead: per K tile inside one group (K tiles of at most the group, splits
of whole groups) it loads ``x``'s inputs contiguously and each input's word (a word P times, from cache),
shifts the input's bits out, subtracts the zero point, runs one ``tl.dot`` and scales the partial sum once. It
stages 8x the 4-bit weight's bytes through shared memory, but its x loads are contiguous and it never
dequantizes in float32 per word row: on the H200 it was 3-6x faster than the fields form at 32 and 256 rows.
:func:`form_for` picks the form (the numbers are there); the tiling override ``form`` forces either (tests,
benchmarks/gpu_gemm_tiles.py).

``DOT=False`` (either form) is the GEMV form for a few rows (a broadcast multiply and a float32 sum over K
instead of tl.dot; row tiles of 1-8): a tiling variant benchmarks/gpu_gemm_tiles.py times against the dot form.
(Dequantizing a whole K tile with a scale and zero tile per input needed 260-350 KB of shared memory per program
on an H200.)
Under ``TRITON_INTERPRET=1`` (CPU tensors: the tests) every tile is float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kubellm.kernels import triton_gemm_tiles as gemm_tiles
from kubellm.kernels.triton_dot import dot_options

__all__ = ["FORMS", "GroupedWeight", "form_for", "grouped_gemm", "pack", "packable", "reference_grouped_gemm",
           "scales_after_dot", "unpack"]

FORMS = ("fields", "words")  # each packed word loaded once per K tile / loaded per input (run 3's kernel)
FIELDS_MAX_ROWS = 8


@dataclass(frozen=True)
class GroupedWeight:
    """One layer packed for :func:`grouped_gemm` (field meanings in the module docstring)."""

    packed: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    perm: torch.Tensor | None
    group: int
    bits: int


def packable(bits: int, out_features: int, in_features: int, group_size: int) -> bool:
    """Whether :func:`pack` takes a layer: 4 or 8 bits, whole words along K, groups the kernel's K tile fits."""
    group = in_features if group_size <= 0 else group_size
    return (bits in (4, 8) and out_features > 0 and in_features % (32 // bits) == 0 and in_features % group == 0
            and (group == in_features or group % 16 == 0))


def pack(weight, bits: int) -> GroupedWeight:
    """A ``QuantizedWeight`` (runtime/layers/quantized_weight.py: ``values`` ``[N, K]``, ``scales``/``zeros``
    ``[N, groups]``, ``group_size``, ``g_idx``; or a GGUF ``BlockForm``, which has no ``g_idx``) in this
    kernel's layout. Values may be unsigned (0..2^bits-1) or signed (-2^(bits-1)..2^(bits-1)-1, stored offset
    by 2^(bits-1), zeros too). Act-order ``g_idx`` is sorted into contiguous groups (``perm``); it must give
    every group ``group_size`` inputs."""
    values, n_in = weight.values, weight.values.shape[1]
    n_out = values.shape[0]
    group = n_in if weight.group_size <= 0 else weight.group_size
    if not packable(bits, n_out, n_in, group):
        raise ValueError(f"cannot pack a {bits}-bit [{n_out}, {n_in}] weight with group {weight.group_size}: needs "
                         f"4 or 8 bits, in_features a multiple of {32 // max(bits, 1)} and of the group, the group "
                         "a multiple of 16 or per channel")
    lo, hi = int(values.min()), int(values.max())
    if lo >= 0 and hi < 1 << bits:
        offset = 0
    elif -(1 << (bits - 1)) <= lo and hi < 1 << (bits - 1):
        offset = 1 << (bits - 1)
    else:
        raise ValueError(f"{bits}-bit values must lie in [0, {(1 << bits) - 1}] or [{-(1 << (bits - 1))}, "
                         f"{(1 << (bits - 1)) - 1}], got [{lo}, {hi}]")
    q = values.to(torch.int32) + offset
    zeros = weight.zeros
    if zeros is not None:
        zeros = zeros.float() + offset
    elif offset == 0:  # unsigned values symmetric around 0: zero point 0, not the implied 2^(bits-1)
        zeros = torch.zeros_like(weight.scales, dtype=torch.float32)
    perm = None
    if getattr(weight, "g_idx", None) is not None:
        g_idx = weight.g_idx.long()
        perm = torch.argsort(g_idx, stable=True)
        counts = torch.bincount(g_idx, minlength=n_in // group)
        if counts.numel() != n_in // group or bool((counts != group).any()):
            raise ValueError(f"act-order g_idx must give each of the {n_in // group} groups {group} inputs")
        if torch.equal(perm, torch.arange(n_in, device=perm.device)):
            perm = None  # the trivial map: nothing to permute per call
        else:
            q = q[:, perm]
    per = 32 // bits
    shifts = torch.arange(per, device=q.device, dtype=torch.int64) * bits
    words = (q.t().long().reshape(n_in // per, per, n_out) << shifts.view(1, per, 1)).sum(1)
    packed = (words - ((words >> 31) << 32)).to(torch.int32)  # bit 31 (the top value's) is the int32 sign
    return GroupedWeight(packed.contiguous(), weight.scales.float().t().contiguous(),
                         None if zeros is None else zeros.t().contiguous(), perm, group, bits)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``[K * bits / 32, N]`` int32 words → the ``[N, K]`` unsigned values (in packed order)."""
    per = 32 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    values = (packed.unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << bits) - 1)
    return values.reshape(-1, packed.shape[1]).t()


def reference_grouped_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                           perm: torch.Tensor | None, bias: torch.Tensor | None, group: int,
                           bits: int) -> torch.Tensor:
    """The same product in float32 from the packed form (dequantizes the whole weight: tests and checks)."""
    q = unpack(packed, bits).float()
    g = torch.arange(q.shape[1], device=q.device) // group
    z = torch.full_like(scales, 1 << (bits - 1)) if zeros is None else zeros
    w = (q - z.float().t()[:, g]) * scales.float().t()[:, g]
    xs = x.float() if perm is None else x.float()[:, perm]
    y = xs @ w.T
    return (y if bias is None else y + bias.float()).to(x.dtype)


@triton.jit
def _grouped_gemm_kernel(
    y_ptr, x_ptr, p_ptr, scales_ptr, zeros_ptr, bias_ptr, M, N, K, K_SPLIT,
    stride_xm, stride_ys, stride_ym,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    SCALE_AFTER: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    PER: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PER  # word rows per K tile
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)  # this program's K range (split-K: kernels/triton_gemm_tiles.py)
    rows_ok, cols_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # A split starts on a K tile; with SCALE_AFTER every tile also lies inside one group.
    for k0 in range(split * K_SPLIT, tl.minimum(split * K_SPLIT + K_SPLIT, K), BLOCK_K):
        js = k0 // PER + tl.arange(0, WORDS)
        js_ok = js < K // PER
        w_ok = js_ok[:, None] & cols_ok[None, :]
        words = tl.load(p_ptr + js[:, None] * N + cols[None, :], mask=w_ok, other=0)
        if SCALE_AFTER:
            g = k0 // GROUP
            s = tl.load(scales_ptr + g * N + cols, mask=cols_ok, other=0.0)[None, :]
            if HAS_ZEROS:
                z = tl.load(zeros_ptr + g * N + cols, mask=cols_ok, other=0.0)[None, :]
            else:
                z = tl.full([1, BLOCK_N], 1 << (BITS - 1), tl.float32)
        else:  # one scale and zero per word row (a word's inputs share a group), read from cache
            gs = ((js * PER) // GROUP)[:, None] * N + cols[None, :]
            s = tl.load(scales_ptr + gs, mask=w_ok, other=0.0)
            if HAS_ZEROS:
                z = tl.load(zeros_ptr + gs, mask=w_ok, other=0.0)
            else:
                z = tl.full([WORDS, BLOCK_N], 1 << (BITS - 1), tl.float32)
        part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for i in tl.static_range(PER):  # bit field i of every word: inputs j * PER + i
            x = tl.load(x_ptr + rows[:, None] * stride_xm + (js * PER + i)[None, :],
                        mask=rows_ok[:, None] & js_ok[None, :], other=0.0)
            w = ((words >> (i * BITS)) & ((1 << BITS) - 1)).to(tl.float32) - z
            if not SCALE_AFTER:
                w = w * s
            if DOT:
                if UPCAST:
                    x = x.to(tl.float32)
                part += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
            else:
                part += tl.sum(x.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
        if SCALE_AFTER:
            acc += part * s
        else:
            acc += part
    if HAS_BIAS:  # noqa: SIM102 - a constexpr test, then a runtime one: Triton keeps them apart
        if split == 0:  # once, not once per split
            acc = acc + tl.load(bias_ptr + cols, mask=cols_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + split * stride_ys + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=rows_ok[:, None] & cols_ok[None, :])


@triton.jit
def _grouped_gemm_words_kernel(
    y_ptr, x_ptr, p_ptr, scales_ptr, zeros_ptr, bias_ptr, M, N, K, K_SPLIT,
    stride_xm, stride_ys, stride_ym,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Run 3's kernel (tree 757c7f3) plus the GEMV switch: x loaded contiguously, the word once per input.
    PER: tl.constexpr = 32 // BITS
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)  # this program's K range (split-K: kernels/triton_gemm_tiles.py)
    rows_ok, cols_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # BLOCK_K divides GROUP (or GROUP == K) and a split holds whole groups: a tile lies inside one group.
    for k0 in range(split * K_SPLIT, tl.minimum(split * K_SPLIT + K_SPLIT, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        ks_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=rows_ok[:, None] & ks_ok[None, :],
                    other=0.0)
        # Every input of a word loads the same word (from cache); its shift picks the input's bits.
        words = tl.load(p_ptr + (ks // PER)[:, None] * N + cols[None, :], mask=ks_ok[:, None] & cols_ok[None, :],
                        other=0)
        q = (words >> ((ks % PER) * BITS)[:, None]) & ((1 << BITS) - 1)
        g = k0 // GROUP
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + g * N + cols, mask=cols_ok, other=0.0)
        else:
            z = tl.full([BLOCK_N], 1 << (BITS - 1), tl.float32)
        if DOT:
            if UPCAST:
                x = x.to(tl.float32)
            w = (q.to(tl.float32) - z[None, :]).to(x.dtype)
            part = tl.dot(x, w, input_precision=PRECISION)
        else:
            part = tl.sum(x.to(tl.float32)[:, :, None] * (q.to(tl.float32) - z[None, :])[None, :, :], axis=1)
        acc += part * tl.load(scales_ptr + g * N + cols, mask=cols_ok, other=0.0)[None, :]
    if HAS_BIAS:  # noqa: SIM102 - a constexpr test, then a runtime one: Triton keeps them apart
        if split == 0:  # once, not once per split
            acc = acc + tl.load(bias_ptr + cols, mask=cols_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + split * stride_ys + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=rows_ok[:, None] & cols_ok[None, :])


def form_for(m: int) -> str:
    """The form launched for ``m`` rows. H200 kit timings against cuBLAS bf16, 4-bit groups of 32 (8-bit alike;
    benchmarks/results/gpu-check-2026-11-27-nvidia-h200-run{3,4}-kernels.md): at M=1 the fields form (run 4)
    read 0.63-0.91x on qkv, gate_up and down, the words form (run 3) 0.53-0.60x (but o: fields 69.7 us, words
    38.8 us); at M=32 fields 0.11-0.18x, words 0.43-0.58x; at M=256 fields 0.04-0.06x, words 0.19-0.27x. The
    fields form reads x with a stride of 32 / bits inputs and, for groups smaller than its K tile, dequantizes
    per word row in float32: both cost more as rows grow, while at one row its 4-bit weight traffic wins.
    Rows 2-8 were not timed on a GPU: they follow M=1 as decode rows."""
    return "fields" if m <= FIELDS_MAX_ROWS else "words"


def tiling_args(x: torch.Tensor, group: int, bits: int = 4, form: str = "fields") -> dict[str, int | float]:
    """:func:`gemm_tiles.choose`'s constraints for ``form`` (``group`` = K per channel). ``fields``: K tiles of
    16-64 words (tl.dot's 16 per bit field at least), splits of whole K tiles; a staged weight element costs its
    bits, plus a word row's float32 scale and zero per ``32 / bits`` elements when groups are smaller than the
    tile. ``words`` (run 3's): K tiles of at most 128 inside one group, splits of whole groups, an int32 word
    staged per input (4 bytes)."""
    k = x.shape[1]
    if form == "words":
        max_block_k = 128 if group == k else min(128, group & -group)
        return dict(sms=gemm_tiles.sm_count(x.device), max_block_k=max_block_k,
                    k_multiple=16 if group == k else group, x_bytes=x.element_size(), w_bytes=4)
    if form != "fields":
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    per = 32 // bits
    w_bytes = bits / 8 if group == k else bits / 8 + 8 / per
    return dict(sms=gemm_tiles.sm_count(x.device), min_block_k=16 * per, max_block_k=64 * per, k_multiple=16,
                x_bytes=x.element_size(), w_bytes=w_bytes)


def scales_after_dot(group: int, k: int, block_k: int) -> bool:
    """Whether every K tile lies inside one group (per channel, or groups a multiple of the tile: a split starts
    on a tile), so the kernel scales each tile's partial sum once instead of dequantizing per word row."""
    return group == k or group % block_k == 0


def grouped_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 perm: torch.Tensor | None, bias: torch.Tensor | None, group: int, bits: int,
                 **tiling: int) -> torch.Tensor:
    """``x [M, K]`` times the packed weight (layouts in the module docstring) ``(+ bias)``; ``[M, N]``.
    ``tiling``: ``form`` (one of :data:`FORMS`; default :func:`form_for`) and overrides of
    :func:`gemm_tiles.choose` (block_m, block_n, block_k, split, dot, ...)."""
    m, k = x.shape
    form = tiling.pop("form", None) or form_for(m)
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    n = packed.shape[1]
    if packed.dtype != torch.int32 or packed.shape[0] * (32 // bits) != k:
        raise ValueError(f"packed must be int32 [K * {bits} / 32, N] for K = {k}, got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    group = k if group <= 0 else group
    if k % group or scales.shape != (k // group, n) or (zeros is not None and zeros.shape != scales.shape):
        raise ValueError(f"scales (and zeros) must be [K / group, N] = [{k // max(group, 1)}, {n}] with group {group} "
                         f"dividing K = {k}, got {tuple(scales.shape)}")
    if group != k and group % 16:
        raise ValueError(f"group {group} is not a multiple of 16")
    if perm is not None:
        x = x.index_select(1, perm)
    x = x if x.stride(-1) == 1 else x.contiguous()
    if m == 0 or n == 0:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles = gemm_tiles.choose(m, n, k, **tiling_args(x, group, bits, form), **tiling)
    buf, stride_split = gemm_tiles.partials(m, n, tiles, x.dtype, x.device)
    if form == "words":  # a split's K range holds whole groups: no K tile straddles two
        _grouped_gemm_words_kernel[tiles.grid(m, n)](
            buf, x, packed.contiguous(), scales.float().contiguous(),
            scales if zeros is None else zeros.float().contiguous(), scales if bias is None else bias, m, n, k,
            tiles.k_split, x.stride(0), stride_split, buf.stride(-2),
            BITS=bits, GROUP=group, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, DOT=tiles.dot,
            **dot_options(x), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
        return gemm_tiles.finish(buf, tiles, x.dtype)
    scale_after = scales_after_dot(group, k, tiles.block_k)
    _grouped_gemm_kernel[tiles.grid(m, n)](
        buf, x, packed.contiguous(), scales.float().contiguous(),
        scales if zeros is None else zeros.float().contiguous(), scales if bias is None else bias, m, n, k,
        tiles.k_split, x.stride(0), stride_split, buf.stride(-2),
        BITS=bits, GROUP=group, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, SCALE_AFTER=scale_after,
        DOT=tiles.dot, **dot_options(x), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return gemm_tiles.finish(buf, tiles, x.dtype)
