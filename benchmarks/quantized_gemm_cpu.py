"""Quantized CPU GEMMs against the bf16 linear they stand in for, at SmolLM2-135M's (or Qwen3-0.6B's) layer shapes.

For each weight shape ``N x K`` (output x input) and row count M, timed calls in interleaved rounds after
warm-up (same process and threads; each round calls every column in turn), of:

* ``bf16``: the native bf16 linear the engine serves bf16 with (``NativeLinear``, ``kernels/cpu_bf16_gemm.py``),
  the baseline of every ratio; ``--onednn`` adds ``F.linear`` on the bf16 weight (oneDNN) as a column;
* ``int4 g32``: ``kernels/cpu_int4_gemm.py`` (4-bit, group 32 with zero points: GGUF Q4_1 / Q4_K, AWQ, GPTQ,
  ``--quantization int4``; ``--int4-groups 32 64`` adds other group sizes); ``int4 g32 a8``: the same weights
  with the activations quantized to int8 per group (``--cpu-int4-activations int8``, the default on CPUs with
  AVX512-VNNI);
* ``int8``: ``kernels/cpu_int8_gemm.py`` (``--quantization int8``: int8 with one scale per output channel);
* ``int8 g32 zp``: ``kernels/cpu_grouped_int8_gemm.py`` with group 32 and zero points (GGUF Q5_K, GPTQ 8-bit);
  ``int8 g32``: group 32, symmetric (GGUF Q8_0: the demo's token embedding, also its tied LM head, the
  49152 x 576 row); ``int8 g16``: group 16, symmetric (GGUF Q6_K); ``int8 ch``: one scale per channel (W8A16);
* ``fp8 ch``: ``kernels/cpu_fp8_gemm.py`` (e4m3, per-channel scales: FP8 / compressed-tensors float-quantized
  per channel or per tensor); ``fp8 b128``: the same with a scale per 128 inputs (128 x 128 block scales, as
  DeepSeek and Qwen3-FP8 write them; 576 inputs end in a group of 64).

``--dtype float32`` (the default where the native bf16 linear does not load; what ``--dtype auto`` serves on AVX2
hosts) runs float32 activations, against ``F.linear`` on the float32 weight, and adds ``int4 g32 deq`` /
``int8 g32 deq``: what those layers ran on AVX2 hosts before the AVX2 kernels, the weight dequantized to float32
on every call, then ``F.linear``.

Scales and zero points are float16, as the loader keeps them where exact (``--scales float32``: the form the
kernels took before they read float16, for before/after runs). Each cell is the median over the rounds of the
round's fastest call, and each ratio the median over the rounds of ``bf16 / kernel`` within the round (above
1: the kernel is faster than the native bf16 linear), so load that comes and goes hits both sides of a ratio.

    python benchmarks/quantized_gemm_cpu.py [--threads 2] [--calls 200] [--rows 1 8 32] [--scales float16]
        [--only fp8] [--model smollm2|qwen3-0.6b] [--onednn] [--cold-mib 96]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kubellm.kernels import cpu_bf16_gemm as bf16
from kubellm.kernels import cpu_fp8_gemm as f8
from kubellm.kernels import cpu_grouped_int8_gemm as g8
from kubellm.kernels import cpu_int4_gemm as k4
from kubellm.kernels import cpu_int8_gemm as k8
from kubellm.runtime.engine import host_malloc  # q/o, k/v, qkv, up, gate_up, down, the tied LM head

SHAPES = ((576, 576), (192, 576), (960, 576), (1536, 576), (3072, 576), (576, 1536), (49152, 576))
# Qwen3-0.6B: qkv, o, gate_up, down (its 151936-row LM head is left out: minutes per cell at 256 rows)
QWEN3_0_6B_SHAPES = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))
MODELS = {"smollm2": SHAPES, "qwen3-0.6b": QWEN3_0_6B_SHAPES}


def timed_rounds(fns: dict, calls: int, rounds: int = 10) -> dict[str, list[float]]:
    """Per function of ``fns``, the fastest call (seconds) of each of ``rounds`` interleaved rounds (each round
    calls every function ``calls // rounds`` times in turn), after 10 warm-up calls each: on a shared machine a
    burst of other load then hits every column of a round, not one."""
    for fn in fns.values():
        for _ in range(10):
            fn()
    best = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fastest = float("inf")
            for _ in range(max(1, calls // rounds)):
                start = time.perf_counter()
                fn()
                fastest = min(fastest, time.perf_counter() - start)
            best[name].append(fastest)
    return best


def bound(fn, *args) -> Callable[[], Callable]:
    """A maker of ``x -> fn(x, *args)`` over its own copies of the tensors in ``args``."""
    def make():
        own = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        return lambda x: fn(x, *own)
    make.nbytes = sum(a.nbytes for a in args if isinstance(a, torch.Tensor))
    return make


def rotating(make: Callable[[], Callable], cold_bytes: int) -> Callable:
    """``make()``'s function, or with ``cold_bytes`` enough copies of its weights to span that many bytes, called
    in turn: each call then reads weights the last-level cache no longer holds, as a decode step's layers do."""
    copies = [make() for _ in range(max(1, -(-cold_bytes // make.nbytes)))]
    turn = itertools.cycle(copies)
    return copies[0] if len(copies) == 1 else lambda x: next(turn)(x)


def kernels_for(n: int, k: int, scale_dtype: torch.dtype = torch.float16, int4_groups: tuple[int, ...] = (32,)):
    """(name, maker of a callable of x; see bound) for each quantized kernel available here, on random weights
    of ``[n, k]``."""
    out = []
    if k4.available() or k4.int8_available():
        q = k4.pack(torch.randint(0, 16, (n, k), dtype=torch.uint8))
        for group in int4_groups:
            s = (torch.rand(k // group, n) * 0.01).to(scale_dtype)
            z = torch.randint(0, 16, (k // group, n)).to(scale_dtype)
            if k4.available():
                out.append((f"int4 g{group}", bound(k4.int4_gemm, q, s, z, group)))
            if k4.int8_available():
                out.append((f"int4 g{group} a8", bound(k4.int4_gemm, q, s, z, group, None, True)))
    if k8.available() and k8.packable(torch.empty(n, k, dtype=torch.int8)):
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        out.append(("int8", bound(k8.int8_gemm, k8.pack(q), torch.rand(n) * 0.001)))
    if g8.available():
        p = g8.pack(torch.randint(-128, 128, (n, k), dtype=torch.int8))
        for name, group, zp in (("int8 g32 zp", 32, True), ("int8 g32", 32, False), ("int8 g16", 16, False),
                                ("int8 ch", k, False)):
            s = (torch.rand(k // group, n) * 0.001).to(scale_dtype)
            z = torch.randint(-128, 128, (k // group, n)).to(scale_dtype) if zp else None
            out.append((name, bound(g8.grouped_int8_gemm, p, s, z, group)))
    if f8.available():
        p = f8.pack((torch.randn(n, k) * 0.1).to(torch.float8_e4m3fn))
        for name, group in (("fp8 ch", k), ("fp8 b128", 128)):
            s = (torch.rand(-(-k // group), n) * 0.01).to(scale_dtype)
            out.append((name, bound(f8.fp8_gemm, p, s, group)))
    return out


def dequantizing_for(n: int, k: int) -> list:
    """What 4-bit (group 32, zero points) and 8-bit (group 32, symmetric: Q8_0) layers ran on CPUs without the
    native kernels: QuantizedLinear's ``dequantize`` path (the float32 weight rebuilt on every call)."""
    from kubellm.runtime.layers.quantized_linear import QuantizedLinear
    from kubellm.runtime.layers.quantized_weight import QuantizedWeight

    scales = torch.rand(n, k // 32) * 0.01
    int4 = QuantizedWeight(torch.randint(0, 16, (n, k)), scales, torch.randint(0, 16, (n, k // 32)).float(), 32)
    int8 = QuantizedWeight(torch.randint(-128, 128, (n, k)), scales, None, 32)
    def maker(weight: QuantizedWeight, bits: int) -> Callable[[], Callable]:
        def make():  # a layer of its own per copy, as bound's copies
            return QuantizedLinear(weight, bits, "dequantize")
        make.nbytes = sum(b.nbytes for b in make().buffers())
        return make

    return [("int4 g32 deq", maker(int4, 4)), ("int8 g32 deq", maker(int8, 8))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--calls", type=int, default=200, help="timed calls per cell, in 10 rounds")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--scales", choices=["float16", "float32"], default="float16",
                    help="dtype of the scales and zero points")
    ap.add_argument("--int4-groups", type=int, nargs="+", default=[32],
                    help="group sizes of the int4 rows (--quantization int4 uses 32; 64 also divides every shape)")
    ap.add_argument("--only", nargs="+", default=None, metavar="PREFIX",
                    help="only the kernels whose names start with one of these (e.g. fp8), beside bf16")
    ap.add_argument("--shapes", nargs="+", default=None, metavar="NxK", help="only these weight shapes")
    ap.add_argument("--model", choices=sorted(MODELS), default="smollm2", help="whose layer shapes (default SmolLM2)")
    ap.add_argument("--onednn", action="store_true", help="add F.linear on the bf16 weight (oneDNN) as a column")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                    help="activations (default: bfloat16 where the native bf16 linear loads, else float32)")
    ap.add_argument("--cold-mib", type=int, default=0, metavar="MIB",
                    help="rotate each column over copies of its weights spanning this many MiB (e.g. 96: twice "
                         "this host's 32 MiB L3), so every call reads from memory as a decode step does")
    args = ap.parse_args(argv)
    native_bf16 = (args.dtype or ("bfloat16" if bf16.available() else "float32")) == "bfloat16"
    if native_bf16 and not bf16.available():
        raise SystemExit("the native bf16 linear (the bfloat16 baseline) did not load; try --dtype float32")
    if not native_bf16 and not (k4.takes_float32() and g8.takes_float32()):
        raise SystemExit("the quantized kernels of this build take bfloat16 only (AVX512-BF16); use --dtype bfloat16")
    if args.threads:
        torch.set_num_threads(args.threads)
    host_malloc.tune()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if native_bf16 else torch.float32
    base = "bf16" if native_bf16 else "f32"
    rows = []
    with torch.inference_mode():
        shapes = MODELS[args.model] if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes]
        for n, k in shapes:
            linear = nn.Linear(k, n, bias=False).to(dtype)
            if native_bf16:
                kernels = [(base, bound(lambda x, p, n=n: bf16.bf16_linear(x, p, n), bf16.pack(linear.weight)))]
            else:
                kernels = [(base, bound(F.linear, linear.weight))]
            if args.onednn and native_bf16:
                kernels.append(("F.linear", bound(F.linear, linear.weight)))
            kernels += kernels_for(n, k, getattr(torch, args.scales), tuple(args.int4_groups))
            if not native_bf16:
                kernels += dequantizing_for(n, k)
            if args.only:
                kernels = [(name, make) for name, make in kernels if name == base or name.startswith(tuple(args.only))]
            fns = {name: rotating(make, args.cold_mib << 20) for name, make in kernels}
            kernels = kernels[1:]
            for m in args.rows:
                x = torch.randn(m, k).to(dtype)
                times = timed_rounds({name: functools.partial(fn, x) for name, fn in fns.items()}, args.calls)
                cells = [(name, statistics.median(times[name]),
                          statistics.median(b / t for b, t in zip(times[base], times[name], strict=True)))
                         for name, _ in kernels]
                rows.append((f"{n}x{k}", m, statistics.median(times[base]), cells))
    names = [name for name, _, _ in rows[0][3]] if rows else []
    print(f"\n{'bfloat16' if native_bf16 else 'float32'} activations, {args.scales} scales, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, {args.calls} calls in 10 interleaved rounds; µs = median of the rounds' "
          f"fastest calls; ratio = median over the rounds of {'native bf16' if native_bf16 else 'F.linear float32'} / kernel; "
          f"{f'weights rotated over {args.cold_mib} MiB (cold); ' if args.cold_mib else ''}load average "
          f"{os.getloadavg()[0]:.1f} at the end\n")
    print(f"| N x K | M | {base} µs | " + " | ".join(f"{n} µs | ratio" for n in names) + " |")
    print("|---|---:|---:|" + "---:|---:|" * len(names))
    for shape, m, base, cells in rows:
        print(f"| {shape} | {m} | {base * 1e6:.1f} | "
              + " | ".join(f"{t * 1e6:.1f} | {ratio:.2f}x" for _, t, ratio in cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
