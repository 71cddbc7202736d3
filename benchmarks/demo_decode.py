"""Batch-1 decode tok/s of the demo model (the SmolLM2-135M-Instruct Q4_1 GGUF `kubellm demo` serves), engine steps
timed one by one: a 40-token prompt, then ``--tokens`` greedy tokens; decode tok/s = (steps - 1) / (last step's end -
first step's end), three runs in one engine.

``--dtype`` as the engine takes it (default auto: float32 on CPUs without AVX512-BF16). ``--before`` hides the
int8-activation 4-bit GEMM and the grouped 8-bit GEMM from the kernel probe, so those layers dequantize per call as
they did on AVX2 hosts before the AVX2 kernels; everything else is the same, for before/after runs in one build.

    python benchmarks/demo_decode.py --threads 2 [--dtype bfloat16] [--before] [--tokens 64]
"""

from __future__ import annotations

import argparse
import time

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--before", action="store_true", help="dequantize the 4-bit and 8-bit layers per call")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kubellm.kernels import cpu_grouped_int8_gemm, cpu_int4_gemm

    if args.before:
        for module, name in ((cpu_int4_gemm, "int8_available"), (cpu_int4_gemm, "takes_float32"),
                             (cpu_grouped_int8_gemm, "available"), (cpu_grouped_int8_gemm, "takes_float32")):
            setattr(module, name, lambda: False)
    from kubellm.runtime.engine.config import EngineConfig
    from kubellm.runtime.engine.llm_engine import LLMEngine
    from kubellm.runtime.models import store as model_store
    from kubellm.runtime.sampling.params import SamplingParams

    path = model_store.resolve("smollm2", pull_missing=True)
    engine = LLMEngine(EngineConfig(model=str(path), dtype=args.dtype, kv_cache_memory="512MiB", max_model_len=2048),
                       progress=False)
    print(f"{engine.config.dtype}, {args.threads} threads: {engine.kernels.describe('gguf')}")
    for run in range(args.runs):
        engine.add_request(list(range(100, 140)), SamplingParams(max_tokens=args.tokens, temperature=0.0,
                                                                 ignore_eos=True))
        ends = []
        while engine.has_unfinished_requests():
            engine.step()
            ends.append(time.perf_counter())
        print(f"run {run}: {len(ends) - 1} decode steps, {(len(ends) - 1) / (ends[-1] - ends[0]):.2f} tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
