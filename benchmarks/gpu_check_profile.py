"""Profile half of `benchmarks/gpu_check.py` (part ``profile``, issue 14): where a decode step's time goes.

One engine (CUDA graphs on, as served), the random Llama of the engine checks. Per batch size: that many
requests are prefilled, decode a few untimed warm-up steps, then ``steps`` decode steps run with a
:class:`kubellm.runtime.engine.step_timer.StepTimer` attached, which splits each step's wall time into host phases
(scheduling, building inputs and block tables, host-to-device copies, the forward call or graph replay, LM head,
sampling, the device-to-host sync of the sampled tokens, postprocessing, detokenizing / streaming) and times the
forward pass on the device with CUDA events. Then ``torch.profiler`` over a few more steps: the top ops by self
CPU time and by CUDA time.

Before that, one request's prefill step at each prompt length, twice: the first step that meets a prompt length
whose prefill kernel configuration is new to the process pays a one-time cost (on CUDA: Triton compiling that
configuration), which an untimed warm-up at other lengths does not cover.

On CPU (``--device cpu --tiny``, the kit's self-test) the GPU column says n/a and the phases are the whole step.
"""

from __future__ import annotations

import statistics
import time

import torch
from gpu_check_report import Section, Table

from kubellm.runtime.engine import step_timer

TOP_OPS = 15


def _plain_cpu(device: str) -> dict[str, str]:
    return dict(attention_backend="torch", layer_ops="torch", prepack_weights="off") if device == "cpu" else {}


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def _prompts(count: int, length: int, vocab: int, salt: int) -> list[list[int]]:
    """Distinct random-looking prompts (no prefix-cache hits between them or with other calls' salts)."""
    return [[(7919 * (salt * 1009 + b + 1) + 13 * i + salt) % vocab for i in range(length)] for b in range(count)]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step_table(title: str, records: list[step_timer.StepRecord], device: str) -> Table:
    """Mean / p90 / share of the wall time per phase over ``records``, and the one-line reading."""
    wall = [r.wall_ns / 1e6 for r in records]
    mean_wall = statistics.fmean(wall)
    gpu = [r.gpu_ms for r in records if r.gpu_ms is not None]

    def row(name: str, values: list[float] | None) -> list[str]:
        if not values:
            return [name, "n/a", "n/a", "n/a"]
        mean = statistics.fmean(values)
        return [name, f"{mean:.3f}", f"{_p90(values):.3f}", f"{100 * mean / mean_wall:.1f}%"]

    rows = [row("step wall time", wall), row("GPU time of the forward (CUDA events)", gpu if len(gpu) == len(records)
                                             else None)]
    rows += [row(f"host: {phase}", [r.phase_ns[phase] / 1e6 for r in records]) for phase in step_timer.PHASES]
    replays = sum(r.replayed for r in records)
    notes = [f"{len(records)} decode steps at batch {records[0].rows}; {replays} of them replayed a CUDA graph",
             "host phases tile the step (their means add up to the wall time); a phase's time includes what it waits "
             "for: blocking copies wait for the GPU work queued before them"]
    if len(gpu) == len(records):
        outside, share = mean_wall - statistics.fmean(gpu), 1 - statistics.fmean(gpu) / mean_wall
        verdict = "host-bound" if share > 0.5 else "GPU-bound"
        notes.append(f"reading: {verdict}: {outside:.2f} ms of {mean_wall:.2f} ms per step outside the GPU forward "
                     f"({100 * share:.0f}%)")
    else:
        top = max(step_timer.PHASES, key=lambda p: sum(r.phase_ns[p] for r in records))
        notes.append(f"reading: GPU time n/a on {device}; the host phases are the whole step ({mean_wall:.2f} ms), "
                     f"the largest: {top}")
    return Table(title, ["per step", "mean (ms)", "p90 (ms)", "share of wall"], rows, notes)


def op_tables(prof, steps: int, label: str, device: str) -> list[Table]:
    """Top ops by self CPU time and by self CUDA time, per step."""
    events = list(prof.key_averages())

    def device_us(e) -> float:
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0) or 0.0

    def rows(key) -> list[list[str]]:
        top = sorted(events, key=key, reverse=True)[:TOP_OPS]
        return [[e.key[:80], f"{e.count / steps:.1f}", f"{e.self_cpu_time_total / 1e3 / steps:.3f}",
                 f"{device_us(e) / 1e3 / steps:.3f}" if device == "cuda" else "n/a"] for e in top]

    header = ["op", "calls / step", "self CPU (ms / step)", "self CUDA (ms / step)"]
    tables = [Table(f"torch.profiler, {label}: top {TOP_OPS} ops by self CPU time", header,
                    rows(lambda e: e.self_cpu_time_total), [f"{steps} decode steps under the profiler"])]
    if device == "cuda":
        tables.append(Table(f"torch.profiler, {label}: top {TOP_OPS} ops by self CUDA time", header,
                            rows(device_us), [f"{steps} decode steps under the profiler"]))
    else:
        tables[0].notes.append(f"{device} run: no CUDA time column")
    return tables


def prefill_table(engine, device: str, lengths: list[int], vocab: int) -> Table:
    """One request's prefill step (1 output token) at each length, twice with different tokens."""
    from kubellm.runtime.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    table = Table("Prefill step of one request: first at its length in this engine, then again",
                  ["prompt tokens", "first step (ms)", "again (ms)", "first / again"],
                  notes=["a first step much slower than the second pays a one-time cost (on CUDA: Triton compiling "
                         "the prefill kernel's tile configuration for that length class); a throughput run whose "
                         "warm-up used other lengths pays it inside its timed region"])
    for length in lengths:
        times = []
        for salt in (1, 2):
            engine.add_request(_prompts(1, length, vocab, 100 * length + salt)[0], params)
            _sync(device)
            start = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            _sync(device)
            times.append(1e3 * (time.perf_counter() - start))
        table.rows.append([str(length), f"{times[0]:.2f}", f"{times[1]:.2f}", f"{times[0] / times[1]:.1f}x"])
    return table


def profile_decode(section: Section, label: str, model: str, device: str, dtype: str, batches: list[int],
                   prompt_len: int, steps: int, warmup: int, profiled_steps: int, prefill_lengths: list[int],
                   kv_cache_memory: str) -> None:
    """The part's tables (module docstring) into ``section``."""
    import json
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    from kubellm.runtime.engine.llm_engine import LLM
    from kubellm.runtime.sampling.params import SamplingParams

    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    with LLM(model, progress=False, device=device, dtype=dtype, max_num_seqs=max(batches), cuda_graphs=True,
             max_model_len=512, kv_cache_memory=kv_cache_memory, seed=0, **_plain_cpu(device)) as llm:
        engine = llm.engine
        section.notes.append(f"engine: {label}, {device} {dtype}, CUDA graphs: {engine.cuda_graphs.note or 'off'}")
        section.tables.append(prefill_table(engine, device, prefill_lengths, vocab))
        for batch in batches:
            params = SamplingParams(max_tokens=warmup + steps + profiled_steps + 2, ignore_eos=True, temperature=0.0)
            for prompt in _prompts(batch, prompt_len, vocab, batch):
                engine.add_request(prompt, params)
            while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                                  for s in engine.scheduler.running):
                engine.step()  # the prefill (chunks)
            for _ in range(warmup):
                engine.step()
            timer = step_timer.StepTimer(device)
            engine.runner.step_timer = timer
            try:
                for _ in range(steps):
                    engine.step()
            finally:
                engine.runner.step_timer = None
            records = [r for r in timer.records if r.decode and r.rows == batch]
            case = f"{label} ({dtype}), batch {batch}, {prompt_len}-token prompts"
            section.tables.append(step_table(f"Decode step phases: {case}", records, device))
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
            _sync(device)
            with profile(activities=activities) as prof:
                for _ in range(profiled_steps):
                    engine.step()
                _sync(device)
            section.tables.extend(op_tables(prof, profiled_steps, f"batch {batch}", device))
            engine.abort_all()
