"""How fast the native bf16 GEMV streams its weight from memory, next to a plain ``sum`` pass with the same threads.

    .venv/bin/python benchmarks/gemv_stream.py --threads 2

Issue 14's batch-1 target is judged against a ``sum`` pass over 512 MiB (cpu_targets.py). A decode step is a chain
of one-row GEMVs, so this asks what the GEMV itself reaches: per layer shape (SmolLM2-135M's, from
bf16_gemm_cpu.py), ``bf16_linear`` at one row over enough distinct packed copies of the weight to fill ``--mib``
MiB, so no call finds its weight in cache (the L3 here is 32 MiB), best of ``--repeats``; then a ``sum`` over
512 MiB of float32 right after it, best of ``--repeats``. GB/s = weight bytes over the time. Each call from
Python also pays a fixed cost (the op's Python and dispatcher layers, output allocation, the OpenMP fork/join)
that the fused decode layer mostly does not; it is measured once on a tiny in-cache weight and the "net" column
takes it off every call. Run it on an idle host; the ``sum`` column moves with the host (35-80 GB/s seen), so read
the ratios of each line.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from bf16_gemm_cpu import SHAPES
from cpu_targets import best_seconds

from kubellm.kernels import cpu_bf16_gemm


def call_cost(repeats: int, calls: int = 20000) -> float:
    """Seconds of one one-row call on a 32 x 64 weight in cache: the per-call cost besides the stream."""
    w, x = cpu_bf16_gemm.pack(torch.randn(32, 64, dtype=torch.bfloat16)), torch.randn(1, 64, dtype=torch.bfloat16)

    def run():
        for _ in range(calls):
            cpu_bf16_gemm.bf16_linear(x, w, 32)

    return best_seconds(run, repeats) / calls


def gemv_seconds(n: int, k: int, mib: int, repeats: int) -> tuple[float, int]:
    """Seconds per one-row bf16_linear call over distinct packed [n, k] weights filling ``mib`` MiB, and calls."""
    copies = max(1, mib * 2**20 // (n * k * 2))
    weights = [cpu_bf16_gemm.pack(torch.randn(n, k, dtype=torch.bfloat16)) for _ in range(copies)]
    x = torch.randn(1, k, dtype=torch.bfloat16)

    def run():
        for w in weights:
            cpu_bf16_gemm.bf16_linear(x, w, n)

    return best_seconds(run, repeats) / copies, copies


def sum_rate(mib: int, repeats: int) -> float:
    buf = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    return buf.nbytes / best_seconds(buf.sum, repeats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch threads for both the GEMV and the sum")
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(SHAPES), help="whose layer shapes")
    ap.add_argument("--mib", type=int, default=256, help="distinct weight copies per shape fill this many MiB")
    ap.add_argument("--sum-mib", type=int, default=512, help="size of the sum pass")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if not cpu_bf16_gemm.available():
        print("the native bf16 kernel is not available on this CPU (it needs AVX512-BF16)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    cost = call_cost(args.repeats)
    print(f"threads={args.threads}, load average {os.getloadavg()[0]:.1f}, cost of a call: {cost * 1e6:.2f} us")
    print("| weight | N x K | MB | us/call | GEMV GB/s | net of the call cost | sum GB/s | GEMV / sum | net / sum |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, n, k in SHAPES[args.model]:
        seconds, _ = gemv_seconds(n, k, args.mib, args.repeats)
        total = sum_rate(args.sum_mib, args.repeats)
        gemv, net = n * k * 2 / seconds, n * k * 2 / max(seconds - cost, 1e-9)
        print(f"| {name} | {n}x{k} | {n * k * 2 / 1e6:.2f} | {seconds * 1e6:.1f} | {gemv / 1e9:.1f} | {net / 1e9:.1f} | "
              f"{total / 1e9:.1f} | {gemv / total:.2f} | {net / total:.2f} |", flush=True)
    print(f"load average after {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
