"""Engine half of `benchmarks/gpu_check.py`: the runtime end to end on the device under test.

Greedy parity. Four prompts are decoded together (continuous batching, paged KV cache) with greedy sampling,
EOS ignored, and the log-probability of every chosen token plus the top 5. The reference is the same engine
on CPU in float32 with the plain-PyTorch attention. The device runs float32 and bfloat16 with the Triton
attention forced (``attention_backend="triton"``: a kernel that fails its start-up check is an error here, not
a silent fallback). A run passes when, for every prompt:

* while the tokens agree, each chosen token's log-probability is within ``tol`` of the reference's;
* where they first differ (after which the sequences are no longer comparable), the reference's own
  log-probabilities of its token and of the device's token are within ``tol`` of each other: a near tie that
  rounding may break either way. A divergence at a clear winner fails.

``tol`` is 2e-3 nats for float32 (accumulation order only) and 0.25 nats for bfloat16 (weights, activations
and the KV cache rounded to 8 bits of mantissa through every layer), both settable on the command line.

Throughput reuses ``benchmarks/offline.py`` (same workload generator, warm-up, timing and length checks; vLLM
in a child process when it is installed here) and ``benchmarks/serve.py`` (a subprocess: ``kubellm serve``,
and vLLM's server when installed, at 32 concurrent streams).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from gpu_check_report import Check, Section, Table
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Kubernetes schedules pods onto nodes by",
    "Once upon a time, a small robot",
]
TOP_LOGPROBS = 5


@dataclass
class Generation:
    """Per prompt: the greedy tokens, each one's log-probability and the top (token, log-probability) pairs."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    top: list[list[dict[int, float]]]
    graph_sizes: tuple[int, ...] = ()  # the decode batch sizes the engine replayed from CUDA graphs
    graph_note: str = ""  # the engine's line on its CUDA graphs (what it captured, or why none)


def greedy(model: str, new_tokens: int, **engine_args) -> Generation:
    """Decode PROMPTS together with kubellm's offline API; the engine is closed and freed before returning."""
    from kubellm.runtime.engine.llm_engine import LLM
    from kubellm.runtime.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=TOP_LOGPROBS)
    with LLM(model, progress=False, **engine_args) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        graphs = llm.engine.cuda_graphs
    del llm
    free_memory()
    return Generation([o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs],
                      [[dict(lp.top) for lp in o.logprobs] for o in outs], graphs.sizes, graphs.note)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class Parity:
    compared: int = 0  # tokens compared (up to and including each prompt's first divergence)
    equal: int = 0
    max_delta: float = 0.0  # largest |log-probability difference| over equal tokens
    ties: list[str] = field(default_factory=list)  # accepted divergences
    errors: list[str] = field(default_factory=list)


def compare_greedy(reference: Generation, candidate: Generation, tol: float) -> Parity:
    """The rule in the module docstring, prompt by prompt."""
    out = Parity()
    for p, (ref_tokens, got_tokens) in enumerate(zip(reference.tokens, candidate.tokens, strict=True)):
        for i, (want, got) in enumerate(zip(ref_tokens, got_tokens, strict=False)):
            out.compared += 1
            ref_lp = reference.logprobs[p][i]
            if want == got:
                out.equal += 1
                delta = abs(ref_lp - candidate.logprobs[p][i])
                out.max_delta = max(out.max_delta, delta)
                if delta > tol:
                    out.errors.append(f"prompt {p} token {i}: log-probability {candidate.logprobs[p][i]:.4f}, "
                                      f"reference {ref_lp:.4f}")
                    break
                continue
            margin = ref_lp - reference.top[p][i].get(got, float("-inf"))
            if margin <= tol:
                out.ties.append(f"prompt {p} token {i} (margin {margin:.2g})")
            else:
                out.errors.append(f"prompt {p} token {i}: chose {got} where the reference's {want} is "
                                  f"{margin:.3g} nats more likely")
            break
        if len(got_tokens) != len(ref_tokens):
            out.errors.append(f"prompt {p}: {len(got_tokens)} tokens, reference {len(ref_tokens)}")
    return out


def parity_check(name: str, case: str, reference: Generation, run, tol: float) -> Check:
    """``run()`` -> Generation on the device; a Check by :func:`compare_greedy`. An exception fails it."""
    tolerance = f"{tol:g} nats per token; divergence only at a near tie"
    try:
        candidate = run()
    except Exception as e:  # noqa: BLE001 - an engine that cannot start or step is this check's answer
        free_memory()
        return Check(name, case, False, "-", tolerance, f"{type(e).__name__}: {e}")
    r = compare_greedy(reference, candidate, tol)
    measured = f"{r.equal}/{r.compared} tokens equal, max logprob diff {r.max_delta:.2g}"
    if r.ties:
        measured += f"; near ties: {', '.join(r.ties)}"
    return Check(name, case, not r.errors, measured, tolerance, "; ".join(r.errors))


# ------------------------------------------------------------------------------------------------ models


def random_llama(folder: Path, tiny: bool) -> Path:
    """A random-weight Llama checkpoint in Hugging Face format, built by the tests' own builder
    (tests/tiny_checkpoints.py: trained 512-token BPE, deterministic weights), bf16 on disk so float32 and
    bfloat16 runs share the same weights. Full size: Llama-3.2-1B's decoder (hidden 2048, 16 layers, 32/8
    heads of 64, intermediate 8192: 0.97B parameters) over the small vocabulary."""
    if str(REPO / "tests") not in sys.path:
        sys.path.insert(0, str(REPO / "tests"))
    import tiny_checkpoints

    if (folder / "config.json").is_file():
        return folder
    shape = {} if tiny else dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                 num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                 max_position_embeddings=4096, rope_theta=500000.0, initializer_range=0.03)
    return tiny_checkpoints.build_checkpoint(folder, "llama", dtype=torch.bfloat16, **shape)


# SmolLM2-135M's decoder (config.json of HuggingFaceTB/SmolLM2-135M-Instruct) over the tests' small vocabulary.
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, tie_word_embeddings=True, rope_theta=100000.0,
                     max_position_embeddings=8192, initializer_range=0.04)


def _demo_cached() -> bool:
    """Whether the demo GGUF is already in kubellm's model cache. Never ``pull`` here: on a GPU machine without a
    package index pip would retry its download for minutes before failing."""
    from kubellm.runtime.models import store as model_store
    return model_store.model_path("smollm2").is_file()


def demo_model(work_dir: Path, demo_files: Path | None = None) -> tuple[str, str]:
    """(label, model) of the demo-model checks: the real SmolLM2 GGUF when cached (`kubellm models pull smollm2`).
    Else random weights: for the config.json and tokenizer in ``demo_files`` (the demo's own, exported where pip
    works: the real model's shapes, vocabulary and tokenizer, so serve.py's word prompts tokenize as they would),
    or at its decoder's shape over the tests' 512-token vocabulary."""
    if _demo_cached():
        return "smollm2 (SmolLM2-135M Q4_1 GGUF)", "smollm2"
    if str(REPO / "tests") not in sys.path:
        sys.path.insert(0, str(REPO / "tests"))
    import tiny_checkpoints

    if demo_files is not None:
        folder = work_dir / "smollm2-random"
        if not (folder / "model.safetensors").is_file():
            shutil.copytree(demo_files, folder, dirs_exist_ok=True)
            config = json.loads((folder / "config.json").read_text())
            save_file(tiny_checkpoints.random_tensors(config, dtype=torch.bfloat16), str(folder / "model.safetensors"),
                      metadata={"format": "pt"})
        return "SmolLM2-135M config and tokenizer, random weights (demo GGUF not cached here)", str(folder)
    folder = work_dir / "smollm2-shape"
    if not (folder / "config.json").is_file():
        tiny_checkpoints.build_checkpoint(folder, "llama", dtype=torch.bfloat16, **SMOLLM2_SHAPE)
    return "random SmolLM2-135M-shaped, vocabulary 512 (demo GGUF not cached here)", str(folder)


def demo_hf_folder(work_dir: Path, dtype: torch.dtype, demo_files: Path | None = None) -> Path:
    """A Hugging Face folder of the demo model for serve.py (and vLLM beside it)."""
    from kubellm.runtime.models import store as model_store
    _, model = demo_model(work_dir, demo_files)
    return model_store.cached_hf_export(model, dtype) if model == "smollm2" else Path(model)


def check_parity(section: Section, label: str, model: str, device: str, new_tokens: int,
                 tolerances: dict[torch.dtype, float], kv_cache_memory: str) -> Generation | None:
    """CPU float32 reference, then the device in float32 and bfloat16 with Triton attention. Returns the
    reference (the tensor-parallel check compares against it too), None when it could not run."""
    common = dict(max_model_len=512, kv_cache_memory=kv_cache_memory, seed=0)
    try:
        reference = greedy(model, new_tokens, device="cpu", dtype="float32", attention_backend="torch",
                           layer_ops="torch", prepack_weights="off", **common)  # pure PyTorch everywhere
    except Exception as e:  # noqa: BLE001
        section.checks.append(Check("greedy parity", f"{label}: CPU float32 reference", False, "-", "-",
                                    f"the reference run failed: {type(e).__name__}: {e}"))
        return None
    for dtype, tol in tolerances.items():
        name = str(dtype).removeprefix("torch.")
        section.checks.append(parity_check(
            "greedy parity", f"{label}, {device} {name} (Triton attention) vs CPU float32, "
            f"{len(PROMPTS)} prompts x {new_tokens} tokens", reference,
            lambda d=name: greedy(model, new_tokens, device=device, dtype=d, attention_backend="triton", **common),
            tol))
    return reference


# ------------------------------------------------------------------------------------------------ throughput


def _offline():
    """benchmarks/offline.py as a module (this folder is on sys.path when gpu_check.py runs as a script)."""
    import offline

    return offline


def offline_throughput(section: Section, label: str, folder: Path, batches: list[int], lengths: tuple[int, int],
                       dtype: str, kv_cache_memory: str) -> None:
    """kubellm's LLM.generate at each batch size (N requests of ``lengths`` = (input, output) tokens, all at
    once, so the batch is N wide), and vLLM's offline LLM on the same workload when it is importable."""
    offline = _offline()
    vllm = importlib.util.find_spec("vllm") is not None
    table = Table(f"Offline throughput: {label} ({dtype})",
                  ["system", "batch", "requests x (in, out)", "wall (s)", "output tok/s", "total tok/s"],
                  notes=["benchmarks/offline.py's protocol: random token-id prompts, greedy, EOS ignored, one "
                         "untimed warm-up (here: 2 prompts as long as the timed ones, not offline.py's 16 tokens); "
                         "timed from submission to the last token"])
    if not vllm:
        table.notes.append("vLLM: not importable in this environment, not compared")
    for batch in batches:
        argv = ["--model", str(folder), "--dtype", dtype, "--num-requests", str(batch),
                "--min-input", str(lengths[0]), "--max-input", str(lengths[0]),
                "--min-output", str(lengths[1]), "--max-output", str(lengths[1]),
                "--max-num-seqs", str(max(batch, 2)), "--max-num-batched-tokens", "8192",
                "--kv-cache-memory", kv_cache_memory]
        for system in ["kubellm"] + (["vllm"] if vllm else []):
            args = offline.parse_args(argv + ["--systems", system] + (["--vllm-venv", sys.prefix] if system == "vllm"
                                                                       else []))
            info = offline.model_info(folder)
            wl = offline.make_workload(args, info["vocab"])
            # Warm up at the timed prompts' length: a first prefill at a new length class pays one-time costs
            # (Triton compiling that tile configuration: the H200's batch-1 row of 2026-11-27 run 3 paid it).
            wl.warmup_prompts = offline.make_workload(argparse.Namespace(
                **{**vars(args), "seed": args.seed + 1_000_003, "num_requests": 2}), info["vocab"]).prompts
            try:
                r = offline.RUNNERS[system](args, folder, wl, info)
            except Exception as e:  # noqa: BLE001 - a throughput run is a measurement; say why it is missing
                table.rows.append([system, str(batch), f"{batch} x {lengths}", "-", "-", "-"])
                table.notes.append(f"{system} at batch {batch} failed: {type(e).__name__}: {e}")
                continue
            finally:
                free_memory()
            table.rows.append([system, str(batch), f"{batch} x {lengths}", f"{r.wall_s:.2f}",
                               f"{r.output_tok_s:,.0f}", f"{r.total_tok_s:,.0f}"])
    section.tables.append(table)


def served_throughput(section: Section, folder: Path, dtype: str, concurrency: int = 32,
                      num_requests: int = 128) -> None:
    """benchmarks/serve.py in a subprocess: kubellm serve (and vLLM's server when importable)."""
    systems = "kubellm,vllm" if importlib.util.find_spec("vllm") else "kubellm"
    with tempfile.TemporaryDirectory(prefix="kubellm-gpu-check-serve-") as tmp:
        out = Path(tmp) / "serve.json"
        cmd = [sys.executable, str(REPO / "benchmarks" / "serve.py"), "--systems", systems, "--baseline", "kubellm",
               "--model", str(folder), "--dtype", dtype, "--num-requests", str(num_requests),
               "--max-concurrency", str(concurrency), "--kv-cache-memory", "8GiB", "--json", str(out)]
        if "vllm" in systems:
            cmd += ["--vllm-venv", sys.prefix]
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, check=False)
        doc = json.loads(out.read_text()) if out.is_file() else {"results": []}
    table = Table(f"Served throughput: {folder.name} ({dtype}), {concurrency} concurrent streams",
                  ["system", "ok", "requests", "output tok/s", "total tok/s", "TTFT p50 (ms)", "TPOT p50 (ms)"],
                  notes=[f"benchmarks/serve.py --systems {systems} --num-requests {num_requests} "
                         f"--max-concurrency {concurrency} (exit status {proc.returncode})"])
    if "vllm" not in systems:
        table.notes.append("vLLM: not importable in this environment, not compared")
    for r in doc["results"]:
        table.rows.append([r["system"], "yes" if r["ok"] and not r["failed"] else f"no: {r['error']}",
                           str(r["completed"]), f"{r['output_throughput']:,.0f}", f"{r['total_token_throughput']:,.0f}",
                           f"{r['ttft_ms'].get('p50', float('nan')):.1f}", f"{r['tpot_ms'].get('p50', float('nan')):.1f}"])
    if not doc["results"]:
        table.notes.append("serve.py wrote no results; its log is in this run's stderr")
    section.tables.append(table)


# ------------------------------------------------------------------------------------------------ CUDA graphs


def _plain_cpu(device: str) -> dict[str, str]:
    """On CPU (the kit's self-test) plain PyTorch kernels: the graphs' checks do not need the native CPU build."""
    return dict(attention_backend="torch", layer_ops="torch", prepack_weights="off") if device == "cpu" else {}


def check_cuda_graphs(section: Section, label: str, model: str, device: str, dtype: str, new_tokens: int,
                      tol: float, kv_cache_memory: str) -> None:
    """Greedy with CUDA graphs (``cuda_graphs=True``, the default) against the same engine without them, same
    device, dtype and kernels. Where the device captures graphs, a run that decoded eagerly anyway (the start-up
    check fell back) fails with the engine's reason; elsewhere (CPU) the setting is a no-op and this compares
    eager with eager. Divergence only at a near tie, as :func:`compare_greedy` rules: padded batches change the
    GEMMs' row count, which may round differently."""
    from kubellm.runtime.engine import cuda_graphs
    common = dict(device=device, dtype=dtype, max_model_len=512, kv_cache_memory=kv_cache_memory, seed=0,
                  **_plain_cpu(device))
    case = f"{label}, {device} {dtype}, {len(PROMPTS)} prompts x {new_tokens} tokens"
    try:
        eager = greedy(model, new_tokens, cuda_graphs=False, **common)
    except Exception as e:  # noqa: BLE001
        section.checks.append(Check("greedy, CUDA graphs vs eager", case, False, "-", "-",
                                    f"the eager run failed: {type(e).__name__}: {e}"))
        return
    graphed: Generation | None = None

    def run() -> Generation:
        nonlocal graphed
        graphed = greedy(model, new_tokens, cuda_graphs=True, **common)
        return graphed

    section.checks.append(parity_check("greedy, CUDA graphs vs eager", case, eager, run, tol))
    if torch.device(device).type not in cuda_graphs.CAPTURE_PRIMITIVES:
        section.skipped.append(f"CUDA graphs on {device}: the setting is a no-op there, both runs above were eager")
    elif graphed is not None:
        section.checks.append(Check("CUDA graphs captured", case, bool(graphed.graph_sizes), graphed.graph_note,
                                    "every planned decode batch size captured",
                                    "" if graphed.graph_sizes else graphed.graph_note))


def decode_throughput(section: Section, label: str, model: str, device: str, dtype: str, batches: list[int],
                      lengths: tuple[int, int], kv_cache_memory: str) -> None:
    """Output tok/s with and without CUDA graphs: per batch size, that many random-token prompts of ``lengths``
    = (input, output) tokens submitted at once, greedy, EOS ignored, one untimed warm-up per engine. Short prompts
    and long outputs, so decode steps dominate the time."""
    from kubellm.runtime.engine.llm_engine import LLM
    from kubellm.runtime.sampling.params import SamplingParams

    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rates: dict[tuple[bool, int], float] = {}
    captured: dict[bool, str] = {}
    for graphs in (False, True):
        with LLM(model, progress=False, device=device, dtype=dtype, max_num_seqs=max(batches), cuda_graphs=graphs,
                 max_model_len=max(512, sum(lengths)), kv_cache_memory=kv_cache_memory, seed=0,
                 **_plain_cpu(device)) as llm:
            captured[graphs] = llm.engine.cuda_graphs.note if graphs else "-"
            warm = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
            llm.generate([[1 + i % (vocab - 1) for i in range(lengths[0])]] * max(batches), warm, use_tqdm=False)
            params = SamplingParams(max_tokens=lengths[1], ignore_eos=True, temperature=0.0)
            for batch in batches:
                prompts = [[(7919 * (b + 1) + 13 * i) % vocab for i in range(lengths[0])] for b in range(batch)]
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                rates[graphs, batch] = batch * lengths[1] / (time.perf_counter() - start)
        free_memory()
    table = Table(f"Decode throughput with and without CUDA graphs: {label} ({dtype})",
                  ["batch", "requests x (in, out)", "eager output tok/s", "graphs output tok/s", "graphs / eager"],
                  notes=[f"with graphs: {captured[True]}",
                         "timed from submission to the last token; short prompts, so decode steps dominate"])
    if device != "cuda":
        table.notes.append(f"{device} run: --cuda-graphs is a no-op here, both columns are eager")
    for batch in batches:
        eager, graphed = rates[False, batch], rates[True, batch]
        table.rows.append([str(batch), f"{batch} x {lengths}", f"{eager:,.1f}", f"{graphed:,.1f}",
                           f"{graphed / eager:.2f}x"])
    section.tables.append(table)


# ------------------------------------------------------------------------------------------------ tensor parallel


def tensor_parallel(section: Section, folder: Path, reference: Generation | None, new_tokens: int, tol: float,
                    batch: int, lengths: tuple[int, int]) -> None:
    """TP=2 over NCCL on two GPUs: greedy parity in bfloat16 against the CPU float32 reference, then one
    offline throughput run (offline.py's workload, timed here: offline.py has no tensor-parallel flag)."""
    if reference is None:
        section.skipped.append("tensor parallelism: no CPU reference to compare with (its run failed above)")
        return
    common = dict(device="cuda", dtype="bfloat16", attention_backend="triton", tensor_parallel_size=2,
                  max_model_len=max(512, sum(lengths)), kv_cache_memory="8GiB", seed=0)
    section.checks.append(parity_check(
        "greedy parity, TP=2", f"{folder.name}, 2 GPUs bfloat16 vs CPU float32", reference,
        lambda: greedy(str(folder), new_tokens, **common), tol))
    offline = _offline()
    args = argparse.Namespace(seed=0, num_requests=batch, min_input=lengths[0], max_input=lengths[0],
                              min_output=lengths[1], max_output=lengths[1])
    wl = offline.make_workload(args, offline.model_info(folder)["vocab"])
    from kubellm.runtime.engine.llm_engine import LLM
    from kubellm.runtime.sampling.params import SamplingParams

    table = Table("Offline throughput, TP=2 (bfloat16)", ["batch", "requests x (in, out)", "wall (s)", "output tok/s"])
    with LLM(str(folder), progress=False, max_num_seqs=batch, **common) as llm:
        warm = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
        llm.generate(wl.warmup_prompts, warm, use_tqdm=False)
        params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0) for o in wl.outputs]
        start = time.perf_counter()
        llm.generate(wl.prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    table.rows.append([str(batch), f"{batch} x {lengths}", f"{wall:.2f}", f"{wl.output_tokens / wall:,.0f}"])
    section.tables.append(table)
    free_memory()
