"""Where a batch-1 decode step's time goes (issue 14): one request decodes alone, and each step is split into

* the engine step (``LLM.engine.step``) end to end,
* the model runner's forward pass (``ModelRunner._forward``), the LM head + logits (``_logits``) and the
  sampler, by wrapping those methods with ``time.perf_counter``; what is left is the scheduler, ``prepare``
  and the engine's bookkeeping (Python),
* inside the forward, per op, from ``torch.profiler`` (self CPU time of each ATen / kubellm_cpu op, summed over
  the profiled steps and divided by them): the bf16 GEMMs against the bytes they read, and everything else.

Run: ``python benchmarks/decode_profile.py --threads 2`` (SmolLM2-135M bf16, as ``cpu_targets.py``). With
``--ab`` it alternates the fused decode layer on and off in one engine (``KUBELLM_FUSED_DECODE``'s two paths);
with ``--ab-region`` one engine's steps, 4 at a time, with the fused layer in one parallel region and with each
kernel in its own (``KUBELLM_LAYER_REGION``, read at every call), timed step by step: on a shared host the low
percentiles are the steps no other job interrupted. ``--model`` takes offline.py's names (``qwen3-0.6b-shape``,
``qwen3-30b-a3b-4l-shape``) or a folder.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from offline import prepare_model


class Splits:
    """Wraps ``obj.name`` so each call adds its wall time to ``self.seconds[label]``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, obj, name: str, label: str) -> None:
        inner = getattr(obj, name)

        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start

        setattr(obj, name, timed)


def decode_steps(engine, prompt_len: int, tokens: int, seed: int, after_prefill=None,
                 cpu_seconds: list | None = None, batch: int = 1) -> tuple[int, float]:
    """One request alone (or ``batch`` together): the prefill step untimed (then ``after_prefill()``), then
    ``tokens`` decode steps; (steps, wall seconds); appends the calling thread's CPU seconds of those steps to
    ``cpu_seconds``."""
    import random

    from kubellm.runtime.sampling.params import SamplingParams

    rng = random.Random(seed)
    for _ in range(batch):
        prompt = [rng.randrange(engine.model_config.vocab_size) for _ in range(prompt_len)]
        engine.add_request(prompt, SamplingParams(max_tokens=tokens + 1, ignore_eos=True, temperature=0.0))
    engine.step()
    assert not engine.scheduler.waiting and all(s.num_computed_tokens >= prompt_len for s in engine.scheduler.running)
    if after_prefill is not None:
        after_prefill()
    start, cpu, steps = time.perf_counter(), time.thread_time(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    if cpu_seconds is not None:
        cpu_seconds.append(time.thread_time() - cpu)
    return steps, time.perf_counter() - start


def make_llm(model_dir: Path, threads: int):
    from kubellm.runtime.engine.llm_engine import LLM

    llm = LLM(str(model_dir), dtype="bfloat16", progress=False, num_threads=threads, kv_cache_memory="256MiB",
              max_model_len=512)
    llm.engine.warmup()
    return llm


def profile(llm, args) -> None:
    engine = llm.engine
    runner = engine.runner
    splits = Splits()
    splits.wrap(runner, "_forward", "forward (layers + final norm)")
    splits.wrap(runner, "_logits", "LM head + logits")
    splits.wrap(runner.sampler, "sample", "sampler")
    splits.wrap(runner, "prepare", "prepare (batch -> tensors)")
    steps, seconds = decode_steps(engine, args.prompt, args.tokens, 0, splits.seconds.clear)
    step_ms = 1e3 * seconds / steps
    print(f"\n{steps} decode steps, {step_ms:.2f} ms/step ({steps / seconds:.1f} tok/s), load {os.getloadavg()[0]:.1f}")
    rest = step_ms
    for label, s in splits.seconds.items():
        ms = 1e3 * s / steps
        rest -= ms
        print(f"  {label:40s} {ms:7.3f} ms  {100 * ms / step_ms:5.1f}%")
    print(f"  {'engine/scheduler/detokenizer (rest)':40s} {rest:7.3f} ms  {100 * rest / step_ms:5.1f}%")

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        steps, seconds = decode_steps(engine, args.prompt, args.tokens, 1)
    per_op: dict[str, tuple[float, int]] = {}
    for e in prof.key_averages():
        per_op[e.key] = (e.self_cpu_time_total / 1e3 / steps, e.count / steps)
    total = sum(ms for ms, _ in per_op.values())
    print(f"\ntorch.profiler, {steps} steps (profiled: {1e3 * seconds / steps:.2f} ms/step), self CPU time per step "
          f"(ops sum {total:.2f} ms):")
    for key, (ms, calls) in sorted(per_op.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"  {key:45s} {ms:7.3f} ms  {calls:6.1f} calls/step")
    cfg = engine.model_config
    weight = sum(engine.weight_bytes.values())
    gemm_ms = per_op.get("kubellm_cpu::bf16_linear", (0.0, 0))[0]
    print(f"\nweights {weight / 2**20:.1f} MiB (embedding table = tied LM head {cfg.tie_word_embeddings}); bf16_linear "
          f"{gemm_ms:.2f} ms/step -> {weight / gemm_ms / 1e6:.1f} GB/s while in the GEMMs")


def ab(args, model_dir: Path) -> None:
    """One engine, its fused decode layer switched on and off between alternated rounds (what
    ``KUBELLM_FUSED_DECODE=0`` leaves out is exactly ``fused_layers``; one engine holds the weights once, which a
    Qwen3-30B-A3B shape needs); median tok/s of each."""
    llm = make_llm(model_dir, args.threads)
    body = llm.engine.runner.model.model
    fused_layers = body.fused_layers
    assert fused_layers is not None, "this model's layers do not qualify for the fused decode layer"
    rates: dict[bool, list[float]] = {False: [], True: []}
    cpu_ms: dict[bool, list[float]] = {False: [], True: []}  # the engine thread's CPU time per step
    for r in range(args.rounds):
        for fused in (False, True) if r % 2 == 0 else (True, False):
            cpu: list[float] = []
            body.fused_layers = fused_layers if fused else None
            steps, seconds = decode_steps(llm.engine, args.prompt, args.tokens, r, cpu_seconds=cpu, batch=args.batch)
            rates[fused].append(args.batch * steps / seconds)
            cpu_ms[fused].append(1e3 * cpu[0] / steps)
    base, new = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"A/B over {args.rounds} rounds of batch {args.batch}, load {os.getloadavg()[0]:.1f}: unfused {base:.1f} tok/s "
          f"{[round(x, 1) for x in rates[False]]}, fused {new:.1f} tok/s {[round(x, 1) for x in rates[True]]}: "
          f"{new / base:.2f}x")
    # With one thread, CPU time is the step's own work, whatever else the host runs (wall time is not).
    base, new = statistics.median(cpu_ms[False]), statistics.median(cpu_ms[True])
    print(f"engine thread CPU ms/step: unfused {base:.2f} {[round(x, 2) for x in cpu_ms[False]]}, fused {new:.2f} "
          f"{[round(x, 2) for x in cpu_ms[True]]}: {base / new:.2f}x")


def ab_region(args, model_dir: Path) -> None:
    """One engine, KUBELLM_LAYER_REGION=0/1 alternated every 4 decode steps; per-step wall-time percentiles."""
    import random

    from kubellm.runtime.sampling.params import SamplingParams

    engine = make_llm(model_dir, args.threads).engine
    times: dict[str, list[float]] = {"0": [], "1": []}
    rng = random.Random(0)
    try:
        for r in range(args.rounds):
            prompt = [rng.randrange(engine.model_config.vocab_size) for _ in range(args.prompt)]
            engine.add_request(prompt, SamplingParams(max_tokens=args.tokens + 1, ignore_eos=True, temperature=0.0))
            engine.step()
            step = 0
            while engine.has_unfinished_requests():
                value = "01"[(step // 4 + r) % 2]
                os.environ["KUBELLM_LAYER_REGION"] = value
                start = time.perf_counter()
                engine.step()
                times[value].append(1e3 * (time.perf_counter() - start))
                step += 1
    finally:
        os.environ.pop("KUBELLM_LAYER_REGION", None)

    def pct(value: str, q: float) -> float:
        return sorted(times[value])[int(q * (len(times[value]) - 1))]

    print(f"{len(times['0'])} steps each, load {os.getloadavg()[0]:.1f}; ms/step at p10 / p25 / median:")
    for value, name in (("0", "one region per kernel"), ("1", "one region per layer")):
        print(f"  {name:22s} {pct(value, .1):7.3f} / {pct(value, .25):7.3f} / {pct(value, .5):7.3f}")
    print("  per layer / per kernel speed: " + ", ".join(f"{name} {pct('0', q) / pct('1', q):.3f}x"
                                                      for name, q in (("p10", .1), ("p25", .25), ("median", .5))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--ab", action="store_true", help="alternate the fused decode layer on and off")
    p.add_argument("--ab-region", action="store_true", help="alternate the fused layer's one parallel region on and off")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--batch", type=int, default=1, help="--ab: requests decoding together (one prefill step)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = prepare_model(args.model, "bfloat16")
    print(f"load average {os.getloadavg()}")
    if args.ab:
        ab(args, model_dir)
    elif args.ab_region:
        ab_region(args, model_dir)
    else:
        profile(make_llm(model_dir, args.threads), args)
    print(f"load average after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
