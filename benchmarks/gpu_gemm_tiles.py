"""Sweep the Triton weight-only GEMMs' tilings on a CUDA GPU: what kernels/triton_gemm_tiles.py's choice gives
against the best tiling found, and cuBLAS bf16 on the unquantized weight, per layer shape and row count.

    python benchmarks/gpu_gemm_tiles.py [--budget-s 240] [--out report.md]

Kernels: the grouped 4-bit GEMM on --quantization int4's weights (groups of 32, zero points), the int8 GEMM,
FP8 per channel. Shapes: Llama-3-8B's qkv, gate_up and down. Every tiling's output is compared with the chosen
tiling's (a tiling that computes something else is reported, not timed). Timings: triton's do_bench medians
(short: warm-up 5 ms, 20 ms of repeats), so the table ranks tilings; benchmarks/gpu_check.py gives the careful
numbers. Stops cleanly at --budget-s, printing what it measured.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_kernels as gk  # noqa: E402

from kubellm.kernels import triton_fp8_gemm, triton_gemm_tiles, triton_grouped_gemm, triton_int8_gemm  # noqa: E402

SHAPES = [gk.GemmShape("qkv", 6144, 4096), gk.GemmShape("gate_up", 28672, 4096), gk.GemmShape("down", 4096, 14336)]
ROWS = [1, 32, 256]


def tilings(m: int) -> list[dict[str, int]]:
    """The grid searched at ``m`` rows: decode tiles with split-K, or tall tiles for batches."""
    if m <= 64:
        grid = itertools.product([16 if m <= 16 else 32 if m <= 32 else 64], [32, 64, 128], [64, 128],
                                 [1, 2, 4, 8, 16], [4], [3, 4])
    else:
        grid = itertools.product([64, 128], [64, 128, 256], [32, 64], [1, 2], [0], [3])
    out = []
    for bm, bn, bk, split, warps, stages in grid:
        out.append(dict(block_m=bm, block_n=bn, block_k=bk, split=split,
                        num_warps=warps or (8 if bm * bn >= 128 * 128 else 4), num_stages=stages))
    return out


def kernels(w: gk.GemmWeights) -> dict[str, tuple[object, object]]:
    """name -> (call(x, **tiling), the keyword arguments of gemm_tiles.choose the kernel itself passes for x)."""
    fp8_weight, fp8_scale = gk.quantize_fp8(w.bf16, None)
    p = w.int4
    return {
        "int4 g32": (lambda x, **t: triton_grouped_gemm.grouped_gemm(x, p.packed, p.scales, p.zeros, p.perm, None,
                                                                    p.group, p.bits, **t),
                     lambda x: triton_grouped_gemm.tiling_args(x, p.group)),
        "int8": (lambda x, **t: triton_int8_gemm.int8_gemm(x, w.q8, w.s8, **t), triton_int8_gemm.tiling_args),
        "fp8 channel": (lambda x, **t: triton_fp8_gemm.fp8_gemm(x, fp8_weight, fp8_scale, None, None, **t),
                        lambda x: triton_fp8_gemm.tiling_args(x, None)),
    }


def bench(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=5, rep=20, return_mode="median"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-s", type=float, default=240.0, help="stop after this many seconds (%(default)s)")
    p.add_argument("--out", type=Path, default=None, help="also write the table here (Markdown)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    deadline = time.monotonic() + args.budget_s
    sms = triton_gemm_tiles.sm_count(torch.device("cuda"))
    lines = [f"# Triton GEMM tilings on {torch.cuda.get_device_name(0)} ({sms} SMs)", "",
             "| kernel | layer | M | cuBLAS bf16 (us) | chosen tiling | chosen (us) | best tiling | best (us) | "
             "chosen / best | bf16 / best |", "|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for shape in SHAPES:
        w = gk.gemm_weights(shape, "cuda")
        for name, (fn, tiling_args) in kernels(w).items():
            for m in ROWS:
                if time.monotonic() > deadline:
                    lines.append(f"\nstopped at the {args.budget_s:.0f} s budget")
                    print(lines[-1], flush=True)
                    return _write(args.out, lines)
                x = gk._activations(m, shape.k, torch.bfloat16, "cuda")
                bf16 = bench(partial(torch.matmul, x, w.bf16.T))
                want = fn(x)
                chosen = triton_gemm_tiles.choose(m, shape.n, shape.k, **tiling_args(x))
                chosen_ms = bench(partial(fn, x))
                best, best_ms, wrong = None, float("inf"), []
                for t in tilings(m):
                    try:
                        got = fn(x, **t)
                    except Exception as e:  # noqa: BLE001 - a tiling Triton cannot build is skipped, named
                        wrong.append(f"{t}: {type(e).__name__}")
                        continue
                    if not torch.allclose(got.float(), want.float(), atol=0.05, rtol=0.02):
                        wrong.append(f"{t}: differs by {(got.float() - want.float()).abs().max():.3g}")
                        continue
                    ms = bench(partial(fn, x, **t))
                    if ms < best_ms:
                        best, best_ms = t, ms
                row = (f"| {name} | {shape.name} | {m} | {bf16 * 1e3:.1f} | {_short(chosen.__dict__)} | "
                       f"{chosen_ms * 1e3:.1f} | {_short(best)} | {best_ms * 1e3:.1f} | {chosen_ms / best_ms:.2f} | "
                       f"{bf16 / best_ms:.2f} |")
                lines.append(row)
                print(row, flush=True)
                for line in wrong[:3]:
                    lines.append(f"  - {name} {shape.name} M {m} refused tiling {line}")
                    print(lines[-1], flush=True)
        del w
        torch.cuda.empty_cache()
    return _write(args.out, lines)


def _short(t: dict | None) -> str:
    if not t:
        return "-"
    return (f"{t['block_m']}x{t['block_n']}x{t['block_k']} split {t['split']} w{t['num_warps']} "
            f"s{t['num_stages']}")


def _write(out: Path | None, lines: list[str]) -> int:
    if out:
        out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
