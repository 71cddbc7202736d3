"""Sweep the Triton weight-only GEMMs' tilings on a CUDA GPU: what kernels/triton_gemm_tiles.py's choice gives
against the best tiling found, and cuBLAS bf16 on the unquantized weight, per layer shape and row count.

    python benchmarks/gpu_gemm_tiles.py [--budget-s 240] [--out report.md]
    python benchmarks/gpu_gemm_tiles.py --device cpu --tiny     # the CPU self-test (interpreter, tiny shapes)

Kernels: the grouped 4-bit GEMM on --quantization int4's weights (groups of 32, zero points), the int8 GEMM,
FP8 per channel; each in its tl.dot form and, at M <= 8, its GEMV form (``dot=0``); the grouped GEMM in both
of its forms (``form``: fields, loading each packed word once, or words, run 3's kernel loading it per input;
kernels/triton_grouped_gemm.py). Shapes: Llama-3-8B's qkv,
o, gate_up and down. Loops run kernel, then M, then layer (a tiling compiled for one layer is reused by the
next), and every (kernel, M, layer) row gets an equal share of what is left of --budget-s, so every layer gets
a row; inside a row the candidates nearest the chosen tiling come first.

Per row: ``chosen`` is the runtime's own call (the launcher with no tiling arguments: the same path, the same
do_bench settings as benchmarks/gpu_check.py's timing table). Every candidate is compiled and compared with
that output before any is timed (a tiling that computes something else, or that Triton cannot build, is
reported, not timed), so no timing follows a multi-second compile with an idle, down-clocked GPU. Candidates are
ranked by do_bench medians (L2 flushed, 25 ms warm-up); then the chosen call, the chosen tiling passed
explicitly, the best candidate and cuBLAS are timed again in 3 interleaved rounds (medians reported), and the
chosen and best calls replayed from a CUDA graph (GPU time without the host's launch cost; L2 warm).

Why this replaced the first sweep (run 3, 2026-11-27): it timed each tiling right after compiling it with 5 ms
of warm-up, once, and its "chosen" int8 qkv M=1 read 182.5 us where the kit read 21.2 us for the same call; the
split-K rows (4 launches per call, the host's cost visible when it outlasts the L2 flush) disagreed, the
unsplit ones agreed within 1%. The interleaved rounds, the explicit-tiling twin and the replayed columns show
which of host cost, clocks or a busy GPU it was; other processes on the GPU are named in the report.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_kernels as gk  # noqa: E402

from kubellm.kernels import triton_fp8_gemm, triton_gemm_tiles, triton_grouped_gemm, triton_int8_gemm  # noqa: E402

SHAPES = [gk.GemmShape("qkv", 6144, 4096), gk.GemmShape("o", 4096, 4096), gk.GemmShape("gate_up", 28672, 4096),
          gk.GemmShape("down", 4096, 14336)]
ROWS = [1, 32, 256]
TINY_SHAPES = [gk.GemmShape("tiny-a", 40, 256), gk.GemmShape("tiny-b", 24, 512)]
TINY_ROWS = [1, 3]
SHARED_LIMIT = 232_448  # bytes of shared memory per block on an H100/H200 (the run-2 OutOfResources limit)
ROUNDS = 3
FIELDS = ("block_m", "block_n", "block_k", "split", "num_warps", "num_stages", "dot")


def tiling_of(tiles: triton_gemm_tiles.Tiles, form: str | None = None) -> dict:
    """A :class:`Tiles` (and the grouped GEMM's ``form``, if any) as the keyword overrides that reproduce it."""
    t: dict = {f: int(getattr(tiles, f)) for f in FIELDS}
    return t if form is None else {**t, "form": form}


def _key(t: dict) -> tuple:
    return (*(t[f] for f in FIELDS), t.get("form"))


def staged_bytes(t: dict[str, int], args: dict) -> float:
    """Shared memory the software pipeline stages for tiling ``t`` (choose's own estimate)."""
    x_bytes, w_bytes = args.get("x_bytes", 2), args.get("w_bytes", 1)
    return t["num_stages"] * t["block_k"] * (t["block_m"] * x_bytes + t["block_n"] * w_bytes)


def candidates(m: int, args: dict, chosen: dict, form: str | None = None) -> list[dict]:
    """The tilings tried at ``m`` rows for a kernel (in ``form``, if it has forms) whose :func:`tiling_args` are
    ``args``, nearest the chosen one first (fewest fields changed), without the chosen one itself and without
    tilings whose pipeline would not fit in shared memory. Decode (M <= 64): row tiles of M's size, 32-128 columns, split-K 1-16; the GEMV
    form (dot 0, row tiles of 1-8) at M <= 8. Batches: 64/128-row tiles, 64-256 columns, 4 or 8 warps."""
    lo, hi = args.get("min_block_k", 16), args.get("max_block_k", 128)
    if m <= 64:
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        ks = [k for k in (64, 128, 256) if lo <= k <= hi] or [hi]  # [hi]: K tiles bound by a group of 32
        grid = [dict(block_m=bm, block_n=bn, block_k=bk, split=sp, num_warps=4, num_stages=st, dot=1)
                for bn, bk, sp, st in itertools.product([32, 64, 128], ks, [1, 2, 4, 8, 16], [3, 4])]
        if m <= 8:
            gm = min(8, 1 << max(m - 1, 0).bit_length())
            grid += [dict(block_m=gm, block_n=bn, block_k=bk, split=sp, num_warps=4, num_stages=st, dot=0)
                     for bn, bk, sp, st in itertools.product([32, 64], ks, [1, 2, 4, 8, 16], [3, 4])]
    else:
        ks = [k for k in (32, 64, 128, 256) if lo <= k <= hi][:2]
        grid = [dict(block_m=bm, block_n=bn, block_k=bk, split=sp, num_warps=w, num_stages=3, dot=1)
                for bm, bn, bk, sp, w in itertools.product([128, 64], [64, 128, 256], ks, [1, 2], [4, 8])]
    if form is not None:
        grid = [{**t, "form": form} for t in grid]
    out, seen = [], {_key(chosen)}
    for t in grid:
        key = _key(t)
        if key not in seen and staged_bytes(t, args) <= SHARED_LIMIT:
            seen.add(key)
            out.append(t)
    return sorted(out, key=lambda t: _distance(t, chosen))  # stable: grid order breaks ties


def _distance(t: dict, chosen: dict) -> tuple[int, bool]:
    """Fields changed from the chosen tiling (the grouped GEMM's ``form`` is one more); the other of dot / GEMV
    (whose row tile goes with it) counts as one change and comes first among equals, so the sweep always
    compares the two."""
    form = t["dot"] != chosen["dot"]
    changed = sum(t[f] != chosen[f] for f in FIELDS if not (form and f == "block_m"))
    return changed + (t.get("form") != chosen.get("form")), not form


def row_deadline(now: float, deadline: float, rows_left: int, reserve_s: float = 0.0) -> float:
    """When the current row stops trying candidates: an equal share of what is left for every row to come,
    after keeping ``reserve_s`` per row for its chosen call and confirmation rounds."""
    return now + max(0.0, deadline - now - rows_left * reserve_s) / max(1, rows_left)


def kernels(w: gk.GemmWeights) -> dict[str, tuple[object, object, object]]:
    """name -> (call(x, **tiling), (x, form) -> the keyword arguments of gemm_tiles.choose the kernel itself
    passes, m -> the kernel's forms with the one it launches at m rows first: [None] for kernels of one form)."""
    fp8_weight, fp8_scale = gk.quantize_fp8(w.bf16, None)
    p = w.int4
    return {
        "int4 g32": (lambda x, **t: triton_grouped_gemm.grouped_gemm(x, p.packed, p.scales, p.zeros, p.perm, None,
                                                                    p.group, p.bits, **t),
                     lambda x, form: triton_grouped_gemm.tiling_args(x, p.group, p.bits, form),
                     lambda m: sorted(triton_grouped_gemm.FORMS, key=lambda f: f != triton_grouped_gemm.form_for(m))),
        "int8": (lambda x, **t: triton_int8_gemm.int8_gemm(x, w.q8, w.s8, **t),
                 lambda x, form: triton_int8_gemm.tiling_args(x), lambda m: [None]),
        "fp8 channel": (lambda x, **t: triton_fp8_gemm.fp8_gemm(x, fp8_weight, fp8_scale, None, None, **t),
                        lambda x, form: triton_fp8_gemm.tiling_args(x, None), lambda m: [None]),
    }


def bench(fn, device: str, rep: int = 40) -> float:
    """Median ms per call: do_bench on CUDA (L2 flushed between calls, 25 ms warm-up as the kit's); one timed
    call after a warm-up on CPU (the self-test: meaningless numbers)."""
    if device.startswith("cuda"):
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=rep, return_mode="median"))
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def replayed(fn, device: str) -> float | None:
    """Median ms per call replayed from a CUDA graph (no host launch cost, L2 warm); None off CUDA or on failure."""
    if not device.startswith("cuda"):
        return None
    from triton.testing import do_bench_cudagraph

    try:
        return float(do_bench_cudagraph(fn, rep=40, return_mode="median"))
    except Exception:  # noqa: BLE001 - a graph that cannot be captured leaves the column empty
        return None


def other_gpu_processes() -> list[str]:
    """Compute processes on the GPU other than this one (nvidia-smi), which would skew every timing."""
    import os

    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip() and line.split(",")[0].strip() != str(os.getpid())]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-s", type=float, default=240.0, help="seconds for the whole sweep (%(default)s): every "
                   "row keeps time for its chosen call and confirmation rounds, candidates share the rest")
    p.add_argument("--out", type=Path, default=None, help="also write the table here (Markdown)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for the self-test (%(default)s)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, 2 candidates a row (the CPU self-test)")
    args = p.parse_args(argv)
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --device cpu --tiny, the self-test)")
    shapes, rows = (TINY_SHAPES, TINY_ROWS) if args.tiny else (SHAPES, ROWS)
    per_row_cap = 2 if args.tiny else None
    deadline = time.monotonic() + args.budget_s
    sms = triton_gemm_tiles.sm_count(torch.device(device))
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else "CPU (Triton interpreter: timings meaningless)"
    lines = [f"# Triton GEMM tilings on {name} ({sms} SMs)", ""]
    busy = other_gpu_processes() if device.startswith("cuda") else []
    if busy:
        lines += [f"WARNING: other processes on the GPU while timing: {'; '.join(busy)}", ""]
    lines += ["| kernel | layer | M | cuBLAS bf16 (us) | chosen tiling | chosen (us) | chosen, explicit (us) | "
              "chosen replayed (us) | best tiling | best (us) | best replayed (us) | chosen / best | bf16 / best | "
              "tried |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    weights = {s.name: gk.gemm_weights(s, device) for s in shapes}
    calls = {s.name: kernels(weights[s.name]) for s in shapes}
    names = list(calls[shapes[0].name])
    plan = [(kname, m, s) for kname in names for m in rows for s in shapes]
    confirm_s: list[float] = []
    for i, (kname, m, shape) in enumerate(plan):
        fn, tiling_args, forms = calls[shape.name][kname]
        x = gk._activations(m, shape.k, torch.bfloat16, device)
        form, *others = forms(m)
        chosen = tiling_of(triton_gemm_tiles.choose(m, shape.n, shape.k, **tiling_args(x, form)), form)
        want = fn(x)
        reserve = statistics.mean(confirm_s) if confirm_s else 2.0
        stop = row_deadline(time.monotonic(), deadline, len(plan) - i, reserve)
        good, wrong = [], []
        cands = sorted((t for f in (form, *others) for t in candidates(m, tiling_args(x, f), chosen, f)),
                       key=lambda t: _distance(t, chosen))  # stable: the launched form's first among equals
        for t in cands:  # compile and check first, time later
            if time.monotonic() > stop or (per_row_cap and len(good) >= per_row_cap):
                break
            try:
                got = fn(x, **t)
            except Exception as e:  # noqa: BLE001 - a tiling Triton cannot build is skipped, named
                wrong.append(f"{_short(t)}: {type(e).__name__}")
                continue
            if not torch.allclose(got.float(), want.float(), atol=0.05, rtol=0.02):
                wrong.append(f"{_short(t)}: differs by {(got.float() - want.float()).abs().max():.3g}")
                continue
            good.append(t)
        best, best_ms = None, float("inf")
        for t in good:
            ms = bench(partial(fn, x, **t), device)
            if ms < best_ms:
                best, best_ms = t, ms
        started = time.monotonic()
        row = _confirm(fn, x, weights[shape.name].bf16, chosen, best, device)
        confirm_s.append(time.monotonic() - started)
        if row["best"] == row["chosen"]:  # nothing beat the chosen call in the confirmation rounds
            best = None
        line = (f"| {kname} | {shape.name} | {m} | {_us(row['bf16'])} | {_short(chosen)} | {_us(row['chosen'])} | "
                f"{_us(row['explicit'])} | {_us(row['chosen_replayed'])} | {_short(best)} | {_us(row['best'])} | "
                f"{_us(row['best_replayed'])} | {_ratio(row['chosen'], row['best'])} | "
                f"{_ratio(row['bf16'], row['best'])} | {len(good)} |")
        lines.append(line)
        print(line, flush=True)
        for w in wrong[:3]:
            lines.append(f"  - {kname} {shape.name} M {m} refused tiling {w}")
            print(lines[-1], flush=True)
    lines += ["", "- chosen: the launcher's own call (no tiling arguments), as the runtime and gpu_check.py call it; "
              "chosen, explicit: the same tiling passed as arguments (equal up to noise, or the call path costs)",
              f"- chosen, explicit, best, cuBLAS: medians of {ROUNDS} interleaved do_bench rounds (L2 flushed, "
              "includes the host's launch cost where it outlasts the flush); replayed: CUDA graph replay (GPU time "
              "only, L2 warm: small layers' weights may stay in L2)",
              "- best: the fastest candidate by one do_bench each; tried: candidates compiled, checked and timed "
              "within the row's share of --budget-s"]
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


def _confirm(fn, x: torch.Tensor, bf16_weight: torch.Tensor, chosen: dict, best: dict | None,
             device: str) -> dict[str, float | None]:
    """Interleaved rounds of the chosen call, the chosen tiling passed explicitly, the best tiling and cuBLAS."""
    calls = {"chosen": partial(fn, x), "explicit": partial(fn, x, **chosen),
             "bf16": partial(torch.matmul, x, bf16_weight.T)}
    if best is not None:
        calls["best"] = partial(fn, x, **best)
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(ROUNDS if device.startswith("cuda") else 1):
        for k, call in calls.items():
            times[k].append(bench(call, device, rep=50))
    out: dict[str, float | None] = {k: statistics.median(v) for k, v in times.items()}
    out.setdefault("best", None)
    out["chosen_replayed"] = replayed(calls["chosen"], device)
    out["best_replayed"] = replayed(calls["best"], device) if best is not None else None
    if best is None or out["chosen"] <= out["best"]:  # nothing beat the chosen tiling in the confirmation rounds
        out["best"], out["best_replayed"] = out["chosen"], out["chosen_replayed"]
    return out


def _short(t: dict | None) -> str:
    if not t:
        return "(the chosen)"
    form = (f" {t['form']}" if t.get("form") else "") + ("" if t.get("dot", 1) else " gemv")
    return (f"{t['block_m']}x{t['block_n']}x{t['block_k']} split {t['split']} w{t['num_warps']} "
            f"s{t['num_stages']}{form}")


def _us(ms: float | None) -> str:
    return "-" if ms is None else f"{ms * 1e3:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


if __name__ == "__main__":
    sys.exit(main())
