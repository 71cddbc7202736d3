"""The native bf16 linear (kernels/cpu_bf16_gemm.py) against oneDNN's prepacked GEMM (what PackedLinear runs)
and plain F.linear, at SmolLM2-135M and Qwen3-0.6B layer shapes, LM heads included.

    .venv/bin/python benchmarks/bf16_gemm_cpu.py --threads 2 --rows 1,2,4,8,16,32,64,256,1024

Where oneDNN cannot prepack bf16 (AVX2-only CPUs) its column is the float32 prepacked GEMM instead: what those
CPUs ran before the AVX2 kernel (``--dtype auto`` takes float32 there).

Per shape and row count: ms per call (best of --rounds rounds, the three interleaved A, B, C within each round
so a shared host's load hits all alike), GB/s (weight bytes read per call over the time; the row-count-1
stream's bandwidth), GFLOP/s, and the kernel's speed-up over oneDNN prepacked. The load average is printed with
the table: on a loaded host read the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

# (name, N, K): the fused projections as kubellm's layers hold them.
SHAPES = {
    "smollm2-135m": [("qkv", 576 + 2 * 192, 576), ("o", 576, 576), ("gate_up", 2 * 1536, 576),
                     ("down", 576, 1536), ("lm_head", 49152, 576)],
    "qwen3-0.6b": [("qkv", 2048 + 2 * 1024, 1024), ("o", 1024, 2048), ("gate_up", 2 * 3072, 1024),
                   ("down", 1024, 3072), ("lm_head", 151936, 1024)],
}


def _time(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,256,1024")
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--shapes", default="", help="only these layer names (e.g. lm_head,down)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--min-seconds", type=float, default=0.005, help="per measurement (calls are repeated)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kubellm.kernels import cpu_bf16_gemm as kb

    if not kb.available():
        raise SystemExit("the native bf16 linear is not available in this build (needs AVX512-BF16 or AVX2)")
    from kubellm.runtime.layers.linear import can_pack

    onednn_dtype = torch.bfloat16 if can_pack("cpu", torch.bfloat16) else torch.float32
    only = set(filter(None, args.shapes.split(",")))
    print(f"threads {args.threads}; {os.uname().nodename}; kernel {kb.isa()}; oneDNN "
          f"{str(onednn_dtype).removeprefix('torch.')}; load average {os.getloadavg()[0]:.2f} at start")
    print("| model | layer | N x K | rows | kernel ms | oneDNN ms | F.linear ms | kernel GB/s | kernel GFLOP/s "
          "| oneDNN GFLOP/s | kernel / oneDNN |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for model in args.models.split(","):
        for name, n, k in SHAPES[model]:
            if only and name not in only:
                continue
            g = torch.Generator().manual_seed(0)
            w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
            packed = kb.pack(w)
            onednn = torch.ops.mkldnn._reorder_linear_weight(w.to(onednn_dtype), 32)
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k, generator=g).to(torch.bfloat16)
                fns = {
                    "kernel": lambda x=x, p=packed, n=n: kb.bf16_linear(x, p, n),
                    "onednn": lambda x=x.to(onednn_dtype), p=onednn: torch.ops.mkldnn._linear_pointwise(
                        x, p, None, "none", [], ""),
                    "flinear": lambda x=x, w=w: torch.nn.functional.linear(x, w),
                }
                once = max(1e-5, min(_time(f, 1) for f in fns.values()))
                calls = max(1, int(args.min_seconds / once))
                best = dict.fromkeys(fns, float("inf"))
                for _ in range(args.rounds):
                    for key, f in fns.items():
                        best[key] = min(best[key], _time(f, calls))
                flops, nbytes = 2.0 * m * n * k, 2.0 * n * k
                ms = {key: v * 1e3 for key, v in best.items()}
                print(f"| {model} | {name} | {n} x {k} | {m} | {ms['kernel']:.3f} | {ms['onednn']:.3f} | "
                      f"{ms['flinear']:.3f} | {nbytes / best['kernel'] / 1e9:.1f} | "
                      f"{flops / best['kernel'] / 1e9:.0f} | {flops / best['onednn'] / 1e9:.0f} | "
                      f"{best['onednn'] / best['kernel']:.2f}x |", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
