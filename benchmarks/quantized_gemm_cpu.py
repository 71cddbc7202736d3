"""Quantized CPU GEMMs against the bf16 linear they stand in for, at SmolLM2-135M's (or Qwen3-0.6B's) layer shapes.

For each weight shape ``N x K`` (output x input) and row count M, the minimum over ``--calls`` timed calls
(in interleaved rounds after warm-up, same process and threads) of:

* ``bf16``: ``F.linear`` on the bf16 weight; ``bf16 packed``: the oneDNN-prepacked linear the engine runs;
* ``int4 g32``: ``kernels/cpu_int4_gemm.py`` (4-bit, group 32 with zero points: GGUF Q4_1 / Q4_K, AWQ, GPTQ,
  ``--quantization int4``; ``--int4-groups 32 64`` adds other group sizes);
* ``int8``: ``kernels/cpu_int8_gemm.py`` (``--quantization int8``: int8 with one scale per output channel);
* ``int8 g32 zp``: ``kernels/cpu_grouped_int8_gemm.py`` with group 32 and zero points (GGUF Q5_K, GPTQ 8-bit);
  ``int8 g32``: group 32, symmetric (GGUF Q8_0: the demo's token embedding, also its tied LM head, the
  49152 x 576 row); ``int8 g16``: group 16, symmetric (GGUF Q6_K); ``int8 ch``: one scale per channel (W8A16);
* ``fp8 ch``: ``kernels/cpu_fp8_gemm.py`` (e4m3, per-channel scales: FP8 / compressed-tensors float-quantized
  per channel or per tensor); ``fp8 b128``: the same with a scale per 128 inputs (128 x 128 block scales, as
  DeepSeek and Qwen3-FP8 write them; 576 inputs end in a group of 64).

Scales and zero points are float16, as the loader keeps them where exact (``--scales float32``: the form the
kernels took before they read float16, for before/after runs). Ratios are ``best bf16 µs / kernel µs``
(above 1: the kernel is faster than both bf16 paths).

    python benchmarks/quantized_gemm_cpu.py [--threads 2] [--calls 200] [--rows 1 8 32] [--scales float16]
        [--only fp8] [--model smollm2|qwen3-0.6b]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from kubellm.kernels import cpu_fp8_gemm as f8
from kubellm.kernels import cpu_grouped_int8_gemm as g8
from kubellm.kernels import cpu_int4_gemm as k4
from kubellm.kernels import cpu_int8_gemm as k8
from kubellm.runtime import host_malloc
from kubellm.runtime.layers.linear import PackedLinear, can_pack

# q/o, k/v, qkv, up, gate_up, down, the tied LM head
SHAPES = ((576, 576), (192, 576), (960, 576), (1536, 576), (3072, 576), (576, 1536), (49152, 576))
# Qwen3-0.6B: qkv, o, gate_up, down (its 151936-row LM head is left out: minutes per cell at 256 rows)
QWEN3_0_6B_SHAPES = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))
MODELS = {"smollm2": SHAPES, "qwen3-0.6b": QWEN3_0_6B_SHAPES}


def best_of(fns: dict, calls: int, rounds: int = 10) -> dict:
    """Minimum seconds of one call of each of ``fns`` over ``calls`` calls, taken in ``rounds`` interleaved
    rounds (each round calls every function in turn), after 10 warm-up calls each: on a shared machine a burst
    of other load then hits every column, not one."""
    for fn in fns.values():
        for _ in range(10):
            fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(max(1, calls // rounds)):
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def kernels_for(n: int, k: int, scale_dtype: torch.dtype = torch.float16, int4_groups: tuple[int, ...] = (32,)):
    """(name, callable of x) for each quantized kernel available here, on random weights of ``[n, k]``."""
    out = []
    if k4.available():
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        for group in int4_groups:
            s = (torch.rand(k // group, n) * 0.01).to(scale_dtype)
            z = torch.randint(0, 16, (k // group, n)).to(scale_dtype)
            out.append((f"int4 g{group}", lambda x, p=k4.pack(q), s=s, z=z, g=group: k4.int4_gemm(x, p, s, z, g)))
    if k8.available() and k8.packable(torch.empty(n, k, dtype=torch.int8)):
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        out.append(("int8", lambda x, p=k8.pack(q), s=torch.rand(n) * 0.001: k8.int8_gemm(x, p, s)))
    if g8.available():
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
        p = g8.pack(q)
        for name, group, zp in (("int8 g32 zp", 32, True), ("int8 g32", 32, False), ("int8 g16", 16, False),
                                ("int8 ch", k, False)):
            s = (torch.rand(k // group, n) * 0.001).to(scale_dtype)
            z = torch.randint(-128, 128, (k // group, n)).to(scale_dtype) if zp else None
            out.append((name, lambda x, p=p, s=s, z=z, g=group: g8.grouped_int8_gemm(x, p, s, z, g)))
    if f8.available():
        p = f8.pack((torch.randn(n, k) * 0.1).to(torch.float8_e4m3fn))
        for name, group in (("fp8 ch", k), ("fp8 b128", 128)):
            s = (torch.rand(-(-k // group), n) * 0.01).to(scale_dtype)
            out.append((name, lambda x, p=p, s=s, g=group: f8.fp8_gemm(x, p, s, g)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--calls", type=int, default=200, help="timed calls per cell (the minimum is reported)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--scales", choices=["float16", "float32"], default="float16",
                    help="dtype of the scales and zero points")
    ap.add_argument("--int4-groups", type=int, nargs="+", default=[32],
                    help="group sizes of the int4 rows (--quantization int4 uses 32; 64 also divides every shape)")
    ap.add_argument("--only", nargs="+", default=None, metavar="PREFIX",
                    help="only the kernels whose names start with one of these (e.g. fp8), beside bf16")
    ap.add_argument("--shapes", nargs="+", default=None, metavar="NxK", help="only these weight shapes")
    ap.add_argument("--model", choices=sorted(MODELS), default="smollm2", help="whose layer shapes (default SmolLM2)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    host_malloc.tune()
    torch.manual_seed(0)
    dtype = torch.bfloat16
    rows = []
    with torch.inference_mode():
        shapes = MODELS[args.model] if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes]
        for n, k in shapes:
            linear = nn.Linear(k, n, bias=False).to(dtype)
            packed = PackedLinear(linear) if can_pack("cpu", dtype) else linear
            kernels = kernels_for(n, k, getattr(torch, args.scales), tuple(args.int4_groups))
            if args.only:
                kernels = [(name, f) for name, f in kernels if name.startswith(tuple(args.only))]
            for m in args.rows:
                x = torch.randn(m, k).to(dtype)
                fns = {"bf16": lambda x=x, w=linear.weight: F.linear(x, w), "bf16 packed": lambda x=x, p=packed: p(x)}
                fns |= {name: lambda f=f, x=x: f(x) for name, f in kernels}
                best = best_of(fns, args.calls)
                cells = [(name, best[name]) for name, _ in kernels]
                rows.append((f"{n}x{k}", m, best["bf16"], best["bf16 packed"], cells))
    names = [name for name, _ in rows[0][4]] if rows else []
    print(f"\nbfloat16 activations, {args.scales} scales, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, "
          f"min of {args.calls} calls; ratio = best bf16 / kernel\n")
    print("| N x K | M | bf16 µs | bf16 packed µs | " + " | ".join(f"{n} µs | ratio" for n in names) + " |")
    print("|---|---:|---:|---:|" + "---:|---:|" * len(names))
    for shape, m, bf16, bf16_packed, cells in rows:
        best = min(bf16, bf16_packed)
        print(f"| {shape} | {m} | {bf16 * 1e6:.1f} | {bf16_packed * 1e6:.1f} | "
              + " | ".join(f"{t * 1e6:.1f} | {best / t:.2f}x" for _, t in cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
