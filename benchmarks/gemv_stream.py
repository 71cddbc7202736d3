"""How fast the native bf16 GEMV streams its weight from memory, next to a plain ``sum`` pass with the same threads.

    .venv/bin/python benchmarks/gemv_stream.py --threads 2

Issue 14's batch-1 target is judged against a ``sum`` pass over 512 MiB (cpu_targets.py). A decode step is a chain
of one-row GEMVs, so this asks what the GEMV itself reaches: per layer shape (SmolLM2-135M's, from
bf16_gemm_cpu.py), ``bf16_linear`` at one row over enough distinct packed copies of the weight to fill ``--mib``
MiB, so no call finds its weight in cache (the L3 here is 32 MiB), best of ``--repeats``; then a ``sum`` over
512 MiB of float32 right after it, best of ``--repeats``. GB/s = weight bytes over the time. Run it on an idle
host; the ``sum`` column moves with the host (35-77 GB/s seen), so read the GEMV/``sum`` ratio of each line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # safe-path mode leaves this folder off sys.path
from bf16_gemm_cpu import SHAPES  # noqa: E402

from kubellm.kernels import cpu_bf16_gemm  # noqa: E402


def best_seconds(fn, repeats: int) -> float:
    fn()  # first touch
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def gemv_rate(n: int, k: int, mib: int, repeats: int) -> float:
    """Bytes/s of one-row bf16_linear calls over distinct packed [n, k] weights filling ``mib`` MiB."""
    copies = max(1, mib * 2**20 // (n * k * 2))
    weights = [cpu_bf16_gemm.pack(torch.randn(n, k, dtype=torch.bfloat16)) for _ in range(copies)]
    x = torch.randn(1, k, dtype=torch.bfloat16)

    def run():
        for w in weights:
            cpu_bf16_gemm.bf16_linear(x, w, n)

    return copies * n * k * 2 / best_seconds(run, repeats)


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
    print(f"threads={args.threads}, load average {os.getloadavg()[0]:.1f}")
    print("| weight | N x K | MB | GEMV GB/s | sum GB/s | GEMV / sum |")
    print("|---|---|---:|---:|---:|---:|")
    for name, n, k in SHAPES[args.model]:
        gemv = gemv_rate(n, k, args.mib, args.repeats)
        total = sum_rate(args.sum_mib, args.repeats)
        print(f"| {name} | {n}x{k} | {n * k * 2 / 1e6:.2f} | {gemv / 1e9:.1f} | {total / 1e9:.1f} | "
              f"{gemv / total:.2f} |", flush=True)
    print(f"load average after {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
