"""How kubellm's Triton weight-only GEMMs (int8, grouped 4/8-bit, FP8) tile their work, decided in one place.

A decode GEMM (a few rows) is bound by the weight's bytes, so every SM needs several programs streaming their own
slice of the weight at once. Output tiles alone give too few: ``N / 64`` programs for one row block (96 for
Llama-3-8B's qkv on a 132-SM GPU, each walking all of K), which read an int4 weight at 3% of an H200's bandwidth in
the first GPU run. Then K is split across programs too (split-K): each writes float32 partial sums of its K range
into ``[split, M, N]`` and one ``torch.sum`` over the splits adds them in a fixed order (deterministic: no atomics;
graph-capturable: sizes depend only on shapes). A batched GEMM is bound by the tensor cores and the
dequantization instead: taller row tiles reuse each dequantized weight tile for more rows.

Two regimes, split at :data:`DECODE_ROWS`. At M <= 8 the third H200 run's sweep (benchmarks/gpu_gemm_tiles.py)
shaped the defaults: 32-column tiles and about four programs per SM (many small programs keep more weight bytes
in flight than a few wide ones). At M > 8 :func:`choose` returns what it returned in run 3 (tree 757c7f3):
64-column tiles and two programs per SM up to 64 rows, 128 x 128 tiles on 8 warps beyond. Run 4 (tree 2a46545)
applied the sweep's rule to batches too and its kit timings got worse there: int8 Qwen3 down at M=32 88.6 us
against run 3's 32.0 us, qkv 29.4 against 23.0. ``dot=False`` is the GEMV form of each kernel (a
broadcast multiply and a sum over K in float32, rows tiles of 1-8 instead of tl.dot's 16): a variant the sweep
times against the tl.dot form; :func:`choose` never picks it unless asked.

:func:`choose` is pure (shapes and an SM count in, :class:`Tiles` out) and unit-tested; :func:`partials` and
:func:`finish` are the split-K buffer around a launch. Under Triton's interpreter (CPU tensors: the tests) the
"device" has :data:`INTERPRETER_SMS` SMs, few enough that small test shapes take the split-K path too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kubellm.kernels.triton_dot import cuda_sm_count

INTERPRETER_SMS = 4
DECODE_ROWS = 8  # up to this many rows the decode rule; above it run 3's rule (module docstring)
MIN_K_PER_SPLIT = 256  # a split walks at least this many inputs: fewer and its fixed costs dominate
SHARED_BYTES = 160 * 1024  # pipelined tiles' budget: an H100/H200 has 227 KB per block, Ampere 163 KB


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    split: int  # programs along K
    k_split: int  # inputs per split, a multiple of block_k (the last split may be shorter)
    num_warps: int
    num_stages: int
    dot: bool = True  # tl.dot on tensor cores; False: the GEMV form (module docstring)

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        return (_cdiv(m, self.block_m), _cdiv(n, self.block_n), self.split)


def choose(m: int, n: int, k: int, *, sms: int, max_block_k: int = 128, min_block_k: int = 16,
           k_multiple: int = 16, block_m: int | None = None, block_n: int | None = None,
           block_k: int | None = None, split: int | None = None, num_warps: int | None = None,
           num_stages: int | None = None, dot: bool | None = None, x_bytes: int = 2, w_bytes: float = 1) -> Tiles:
    """Tiles for ``[m, k] x [k, n]``. ``max_block_k`` / ``min_block_k``: the K tiles the kernel allows (powers of
    two, >= 16; a packed kernel needs 16 words per bit field for tl.dot); ``k_multiple``: what each split's K
    range must be a multiple of (a scale group, so no K tile straddles two groups in kernels that scale after the
    dot). ``block_*``, ``split``, ``num_warps``, ``num_stages`` and ``dot`` override the choice (tests,
    benchmarks/gpu_gemm_tiles.py); ``x_bytes`` and ``w_bytes`` (per weight element, as staged: packed bits plus
    any per-row scales) size the shared memory."""
    dot = True if dot is None else bool(dot)
    decode = m <= DECODE_ROWS
    if dot:
        block_m = block_m or (16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128)
    else:  # no 16-row minimum without tl.dot; more than 8 rows is a GEMM's job
        block_m = block_m or min(8, 1 << max(m - 1, 0).bit_length())
    if decode:
        block_n = block_n or 32
        num_warps = num_warps or (8 if block_m * block_n >= 128 * 128 else 4)
    else:  # run 3's rule
        block_n = block_n or (64 if m <= 64 else 128)
        num_warps = num_warps or (4 if block_m * block_n <= 64 * 64 else 8)
    block_k = max(min_block_k, min(max_block_k, block_k or (128 if m <= 64 else 64)))
    if num_stages is None:
        # Software pipelining keeps one x tile and one weight tile per stage in shared memory: stay under
        # SHARED_BYTES (the run-2 failures were OutOfResources: shared memory).
        num_stages = 4 if m <= 64 else 3
        while num_stages > 2 and num_stages * block_k * (block_m * x_bytes + block_n * w_bytes) > SHARED_BYTES:
            num_stages -= 1
        while (block_k > max(16, min_block_k)
               and num_stages * block_k * (block_m * x_bytes + block_n * w_bytes) > SHARED_BYTES):
            block_k //= 2
    unit = block_k * k_multiple // _gcd(block_k, k_multiple)  # a split's K range: whole tiles and whole groups
    if split is None:
        programs = _cdiv(m, block_m) * _cdiv(n, block_n)
        split = 1
        # Decode GEMMs want about four programs per SM, up to 64 rows two (run 3's), batched ones (tensor-core
        # bound) one wave: partials cost traffic.
        waves = 4 if decode else 2 if m <= 64 else 1
        while programs * split < waves * sms and k // (split * 2) >= max(MIN_K_PER_SPLIT, unit):
            split *= 2
    k_split = _cdiv(_cdiv(k, split), unit) * unit
    return Tiles(block_m, block_n, block_k, _cdiv(k, k_split), k_split, num_warps, num_stages, dot)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def sm_count(device: torch.device) -> int:
    return cuda_sm_count(device.index or 0) if device.type == "cuda" else INTERPRETER_SMS


def partials(m: int, n: int, tiles: Tiles, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, int]:
    """Where a launch stores: ``y [m, n]`` itself when K is not split, else float32 ``[split, m, n]``; and the
    stride between splits (0 without split-K)."""
    if tiles.split == 1:
        return torch.empty((m, n), dtype=dtype, device=device), 0
    buf = torch.empty((tiles.split, m, n), dtype=torch.float32, device=device)
    return buf, buf.stride(0)


def finish(buf: torch.Tensor, tiles: Tiles, dtype: torch.dtype) -> torch.Tensor:
    """``y`` from what :func:`partials` gave the launch."""
    return buf if tiles.split == 1 else buf.sum(0).to(dtype)
