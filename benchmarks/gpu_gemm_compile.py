"""Compile the Triton weight-only GEMMs for an H100/H200 (sm_90) on a machine without a GPU: what the launchers
would launch at the GPU kit's layer shapes, checked for what only a compile shows (the run-2 failures were
``OutOfResources: shared memory``), before a GPU session is spent on it.

    python benchmarks/gpu_gemm_compile.py [--arch 90] [--rows 1,32,256]

Triton ships ptxas, so ``triton.compile`` builds the cubin here. Each launcher is called on empty CPU tensors
of the real shapes with the kernel swapped for a recorder (no launch) and an H200's 132 SMs, so the tiling is
:func:`triton_gemm_tiles.choose`'s for that GPU; the recorded arguments become the compile's signature,
constexprs and alignment hints (16-byte pointers, integers divisible by 16, as the JIT specializes them). Forms:
the grouped 4-bit GEMM (groups 32 and 128, per channel), the grouped 8-bit GEMM (group 32), the int8 GEMM, FP8
per channel and per 128x128 block; bf16 activations, and fp16/fp32 for the first form of each kernel; each in
its chosen tl.dot tiling and in the GEMV form; the grouped GEMMs in both forms (fields: the word loaded once,
launched at M <= 8; words: run 3's kernel, launched above), each form at every M. Reported per distinct
compile: shared memory per block (against 232,448 bytes), registers and spilled bytes (cuobjdump). Exit 1
when a compile fails or does not fit. The local Triton may be newer than the GPU's (3.6 on the lent H200): the
numbers are close, not identical.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile, not interpret: import the kernels as JIT functions
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kubellm.kernels import triton_fp8_gemm, triton_gemm_tiles, triton_grouped_gemm, triton_int8_gemm  # noqa: E402

SHARED_LIMIT = 232_448
H200_SMS = 132
LAYERS = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
         torch.int8: "i8", torch.uint8: "u8"}


@dataclass
class Launch:
    kernel: object
    args: tuple
    kwargs: dict


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records instead of launching."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(Launch(self.kernel, args, kwargs))


def forms(m: int, n: int, k: int, dtype: torch.dtype, first_only: bool) -> list[tuple[str, object, object]]:
    """(name, module, call) for each kernel form at ``[m, k] x [k, n]``; the calls take tiling overrides."""
    x = torch.empty(m, k, dtype=dtype)

    def grouped(bits, group, zeros):
        g = k if group <= 0 else group
        packed = torch.empty(k * bits // 32, n, dtype=torch.int32)
        scales = torch.empty(k // g, n)
        return lambda **t: triton_grouped_gemm.grouped_gemm(x, packed, scales, scales if zeros else None, None,
                                                            None, group, bits, **t)

    q8, s8 = torch.empty(n, k, dtype=torch.int8), torch.empty(n)
    w8 = torch.empty(n, k, dtype=torch.uint8)
    blocks = torch.empty(-(-n // 128), -(-k // 128))
    out = [("int4 g32 zeros", triton_grouped_gemm, grouped(4, 32, True)),
           ("int4 g128 zeros", triton_grouped_gemm, grouped(4, 128, True)),
           ("int4 per channel", triton_grouped_gemm, grouped(4, -1, False)),
           ("int8-bit g32 zeros", triton_grouped_gemm, grouped(8, 32, True)),
           ("int8", triton_int8_gemm, lambda **t: triton_int8_gemm.int8_gemm(x, q8, s8, **t)),
           ("fp8 channel", triton_fp8_gemm, lambda **t: triton_fp8_gemm.fp8_gemm(x, w8, s8, None, None, **t)),
           ("fp8 block 128", triton_fp8_gemm,
            lambda **t: triton_fp8_gemm.fp8_gemm(x, w8, blocks, None, (128, 128), **t))]
    if first_only:
        seen, firsts = set(), []
        for f in out:
            if f[1] not in seen:
                seen.add(f[1])
                firsts.append(f)
        return firsts
    return out


def record(module, call, **tiling) -> Launch:
    """The launch ``call`` would make on an H200 (every kernel of the module swapped for a recorder)."""
    names = [a for a in vars(module) if a.startswith("_") and a.endswith("_kernel") and "decode" not in a]
    saved = {name: getattr(module, name) for name in names}
    recorders = [_Recorder(kernel) for kernel in saved.values()]
    saved_sms = triton_gemm_tiles.sm_count
    for name, recorder in zip(names, recorders, strict=True):
        setattr(module, name, recorder)
    triton_gemm_tiles.sm_count = lambda device: H200_SMS
    try:
        call(**tiling)
    finally:
        for name, kernel in saved.items():
            setattr(module, name, kernel)
        triton_gemm_tiles.sm_count = saved_sms
    (launch,) = [launch for recorder in recorders for launch in recorder.launches]
    return launch


def compile_source(launch: Launch) -> tuple[ASTSource, dict]:
    """The launch's signature, constexprs and alignment hints as the JIT would specialize them."""
    fn = launch.kernel
    params = fn.arg_names
    constexprs = {p.name for p in fn.params if p.is_constexpr}
    options = {k: launch.kwargs[k] for k in ("num_warps", "num_stages") if k in launch.kwargs}
    values = dict(zip(params, launch.args, strict=False))  # constexprs come as keywords
    values.update({k: v for k, v in launch.kwargs.items() if k not in options})
    signature, consts, attrs = {}, {}, {}
    for i, p in enumerate(params):
        v = values[p]
        if p in constexprs:
            signature[p], consts[p] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            signature[p] = "*" + TYPES[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 256-byte aligned
        elif isinstance(v, bool):
            signature[p] = "i1"
        elif isinstance(v, int):
            if v == 1:
                signature[p], consts[p] = "constexpr", 1  # the JIT specializes 1 away
            else:
                signature[p] = "i32" if abs(v) < 2**31 else "i64"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            raise TypeError(f"{p}: cannot type {type(v).__name__}")
    return ASTSource(fn, signature, consts, attrs), options


def usage(cubin: bytes) -> tuple[int | None, int | None]:
    """Registers and spilled bytes (spill stores) of a cubin, from cuobjdump; (None, None) when unavailable."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True,
                                  timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return None, None
    regs = re.search(r"REG:(\d+)", text)
    local = re.search(r"LOCAL:(\d+)", text)
    return (int(regs.group(1)) if regs else None), (int(local.group(1)) if local else None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (%(default)s: H100/H200)")
    p.add_argument("--rows", default="1,32,256", help="M values (%(default)s)")
    p.add_argument("--layers", default=",".join(name for name, _, _ in LAYERS),
                   help="of " + ", ".join(name for name, _, _ in LAYERS) + " (%(default)s)")
    args = p.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    layers = [layer for layer in LAYERS if layer[0] in args.layers.split(",")]
    done: dict[str, tuple] = {}
    failures = 0
    print("| form | x | M | layers | tiling | shared (bytes) | registers | spilled (bytes) | verdict |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in (int(r) for r in args.rows.split(",")):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for lname, n, k in layers:
                for fname, module, call in forms(m, n, k, dtype, first_only=dtype != torch.bfloat16):
                    grouped = module is triton_grouped_gemm
                    for dot, form in itertools.product((True, False) if m <= 8 else (True,),
                                                       triton_grouped_gemm.FORMS if grouped else (None,)):
                        launch = record(module, call, dot=dot, **({"form": form} if form else {}))
                        src, options = compile_source(launch)
                        key = src.hash() + str(sorted(options.items()))
                        label = _tiling(launch)
                        if key in done:  # the same compile as an earlier layer's
                            done[key][3].append(lname)
                            continue
                        try:
                            compiled = triton.compile(src, target=target, options=options)
                            shared = compiled.metadata.shared
                            regs, spilled = usage(compiled.asm["cubin"])
                            verdict = "fits" if shared <= SHARED_LIMIT else "TOO MUCH SHARED MEMORY"
                        except Exception as e:  # noqa: BLE001 - a compile failure is this row's answer
                            shared, regs, spilled, verdict = None, None, None, f"FAILED: {type(e).__name__}: {e}"
                        failures += verdict != "fits"
                        done[key] = (fname, TYPES[dtype], m, [lname], label, shared, regs, spilled, verdict)
                        print(_row(done[key]), flush=True)
    print(f"\n{len(done)} distinct compiles, {failures} failed or did not fit "
          f"(layers per row: those sharing the compile, as listed when the row was printed; sm_{args.arch}, "
          f"triton {triton.__version__})")
    return 1 if failures else 0


def _tiling(launch: Launch) -> str:
    kw = launch.kwargs
    form = "dot" if kw.get("DOT", True) else "gemv"
    grouped = ("" if "BITS" not in kw else " words" if "SCALE_AFTER" not in kw
               else " fields, scale after" if kw["SCALE_AFTER"] else " fields, scale per row")
    return f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} w{kw['num_warps']} s{kw['num_stages']} {form}{grouped}"


def _row(r: tuple) -> str:
    fname, x, m, layers, label, shared, regs, spilled, verdict = r
    return (f"| {fname} | {x} | {m} | {layers[0]} | {label} | {'-' if shared is None else shared} | "
            f"{'-' if regs is None else regs} | {'-' if spilled is None else spilled} | {verdict} |")


if __name__ == "__main__":
    sys.exit(main())
