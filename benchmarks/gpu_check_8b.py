"""Llama-3-8B half of `benchmarks/gpu_check.py` (parts ``llama8b`` and ``peer``, issue 31 targets 1 and 5).

The model is Llama-3-8B's shape (hidden 4096, 32 layers, 32 query / 8 KV heads of 128, MLP 14336, vocabulary
128256, untied LM head: 8.03B parameters) with random bf16 weights made on the device, tensor by tensor, from a
generator seeded by the tensor's name: no checkpoint is written or read. The engine gets them through
:func:`in_memory_weights`, which hands it a folder holding only config.json and the tests' tokenizer and swaps the
checkpoint's tensor stream for the generator; the peer copies the same tensors into transformers' model.

* ``llama8b``: the device-to-device copy bandwidth (bytes read plus bytes written over the time of a large
  ``copy_``), then kubellm's decode rate with CUDA graphs at batch 1, 8, 32 and 128: that many 128-token prompts
  are prefilled, a few decode steps run untimed, then ``steps`` decode steps are timed (host clock around
  ``LLMEngine.step``, device synchronised at both ends). The roofline of those steps is the bytes they must read
  (every weight but the embedding table once per step, plus each sequence's K and V up to its position) over the
  copy bandwidth; the table gives tok/s and its fraction of the roofline tok/s. Then, time allowing, the same
  rates with ``--layer-ops torch`` (the PyTorch layer ops the fused Triton ones replace) and the decode-step
  profile of ``gpu_check_profile`` on this model.
* ``peer``: transformers' ``LlamaForCausalLM`` with a static KV cache, one decode step (forward + greedy argmax)
  under ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (the gpt-fast recipe: Inductor kernels replayed
  from a CUDA graph), the prompt prefilled eagerly into the same cache; timed the same way at batch 1 and 32.

On CPU (``--device cpu --tiny``, the kit's self-test) the model is tiny, the vocabulary larger than the tokenizer's
as on the device, the peer compiles with the ``eager`` backend (Dynamo's full-graph trace, no code generation),
and the numbers mean nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import sys
import time
import traceback
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from gpu_check_engine import _plain_cpu
from gpu_check_engine import free_memory as _free
from gpu_check_profile import _prompts, _sync
from gpu_check_report import Section, Table

REPO = Path(__file__).resolve().parent.parent

# config.json of meta-llama/Meta-Llama-3-8B (shape fields only).
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.02)
# The self-test's model: the vocabulary is larger than the tests' 512-token tokenizer, as 128256 is on the device.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=1000, max_position_embeddings=512, rope_theta=500000.0, rms_norm_eps=1e-5,
            tie_word_embeddings=False, initializer_range=0.02)


@dataclasses.dataclass
class Plan:
    """What one run measures; FULL on the device, SMALL in the self-test."""

    shape: dict
    dtype: torch.dtype
    batches: list[int]
    peer_batches: list[int]
    prompt_len: int
    warmup: int
    steps: int
    kv_cache_memory: str
    copy_bytes: int
    # Seconds each optional step is given before the part's deadline: it is skipped with a note when fewer remain.
    need_s: dict[str, float]


FULL = Plan(LLAMA3_8B, torch.bfloat16, [1, 8, 32, 128], [1, 32], 128, 8, 64, "16GiB", 2 << 30,
            {"layer_ops": 60, "peer": 150, "profile": 60})
SMALL = Plan(TINY, torch.float32, [1, 4], [1, 2], 8, 2, 4, "64MiB", 8 << 20, {"layer_ops": 0, "peer": 0, "profile": 0})


# ------------------------------------------------------------------------------------------------ the model


def model_folder(folder: Path, shape: dict) -> Path:
    """config.json of ``shape`` and the tests' tokenizer files; the weights file is a stand-in the engine's reader
    lists (tiny, never read: :func:`in_memory_weights` replaces the tensors)."""
    if str(REPO / "tests") not in sys.path:
        sys.path.insert(0, str(REPO / "tests"))
    import tiny_checkpoints

    if not (folder / "config.json").is_file():
        tiny_checkpoints.build_checkpoint(folder, "llama", dtype=torch.bfloat16, num_hidden_layers=1)
        config = tiny_checkpoints.arch_config("llama", **shape)
        config["torch_dtype"] = "bfloat16"
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return folder


def param_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every weight of transformers' model for ``config``, read off a meta-device instance."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_hf_config(AutoConfig, config))
    return [(n, tuple(t.shape)) for n, t in model.state_dict().items()
            if not (config.get("tie_word_embeddings") and n == "lm_head.weight")]


def _hf_config(auto_config, config: dict):
    return auto_config.for_model(**{k: v for k, v in config.items() if k != "architectures"})


def random_weight(name: str, shape: tuple[int, ...], device: str, dtype: torch.dtype, std: float,
                  seed: int = 0) -> torch.Tensor:
    """Deterministic per (seed, name, device): the engine and the peer draw the same tensor. Norm gains near 1."""
    gen = torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    noise = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    return noise.mul_(0.1).add_(1.0) if name.endswith("norm.weight") else noise.mul_(std)


def random_weights(config: dict, device: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    std = float(config.get("initializer_range", 0.02))
    for name, shape in param_shapes(config):
        yield name, random_weight(name, shape, device, dtype, std)


@contextlib.contextmanager
def in_memory_weights(folder: Path, device: str, dtype: torch.dtype):
    """While open, an engine started on ``folder`` loads :func:`random_weights` made on ``device`` instead of
    reading the folder's weights file."""
    from kubellm.runtime.engine import llm_engine as engine_module
    read = engine_module.read_checkpoint

    def read_random(path):
        ckpt = read(path)
        if Path(path).resolve() != folder.resolve():
            return ckpt
        return dataclasses.replace(ckpt, tensors=lambda: random_weights(ckpt.config, device, dtype))

    engine_module.read_checkpoint = read_random
    try:
        yield
    finally:
        engine_module.read_checkpoint = read


# ------------------------------------------------------------------------------------------------ the roofline


@dataclasses.dataclass
class Bytes:
    """What a decode step must read: every weight but the embedding table (its rows are gathered), and K and V."""

    weights: int
    kv_per_token: int

    @classmethod
    def of(cls, shape: dict, dtype: torch.dtype) -> Bytes:
        h, layers, inter = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]
        q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h
        params = layers * per_layer + h + shape["vocab_size"] * h  # + final norm + LM head
        return cls(params * dtype.itemsize, 2 * layers * kv * dtype.itemsize)


def copy_bandwidth(device: str, nbytes: int, repeats: int = 10) -> float:
    """Bytes per second of a device-to-device ``copy_``, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    if device == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(repeats):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = begin.elapsed_time(end) / 1e3
    else:
        for _ in range(repeats):
            dst.copy_(src)
        seconds = time.perf_counter() - start
    del src, dst
    return 2 * nbytes * repeats / seconds


@dataclasses.dataclass
class Rate:
    """``steps`` timed decode steps of ``batch`` sequences; ``kv_tokens``: the K/V entries they read in all."""

    batch: int
    steps: int
    tokens: int
    seconds: float
    kv_tokens: int
    note: str = ""

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    def roofline_s(self, b: Bytes, bandwidth: float) -> float:
        return (self.steps * b.weights + self.kv_tokens * b.kv_per_token) / bandwidth


def _kv_tokens(contexts: list[int], steps: int) -> int:
    """K/V entries read by ``steps`` steps when sequence i starts at ``contexts[i]`` tokens (each step reads its
    whole context, the token it appends included, and grows it by one)."""
    return sum(steps * c + steps * (steps - 1) // 2 for c in contexts)






# ------------------------------------------------------------------------------------------------ kubellm


def engine_rates(folder: Path, device: str, plan: Plan, batches: list[int], **engine_args) -> tuple[list[Rate], str]:
    """kubellm's decode rate per batch size (module docstring) and the engine's kernel line."""
    from kubellm.runtime.engine.llm_engine import LLM
    from kubellm.runtime.sampling.params import SamplingParams

    vocab = plan.shape["vocab_size"]
    rates = []
    with in_memory_weights(folder, device, plan.dtype), LLM(
            str(folder), progress=False, device=device, dtype=str(plan.dtype).removeprefix("torch."),
            max_num_seqs=max(batches), max_model_len=512, max_num_batched_tokens=8192,
            kv_cache_memory=plan.kv_cache_memory, seed=0, **{**_plain_cpu(device), **engine_args}) as llm:
        engine = llm.engine
        kernels = f"{engine.kernels.describe()}; CUDA graphs: {engine.cuda_graphs.note or 'off'}"
        for salt, batch in enumerate(batches):
            # + slack: sequences prefilled in an early chunk decode while the others still prefill, and none may
            # finish inside the timed steps (on 2026-11-28, batch 128 without it: 8128 tokens, not 128 x 64).
            params = SamplingParams(max_tokens=plan.warmup + plan.steps + 16, ignore_eos=True, temperature=0.0)
            seqs = [engine.requests[engine.add_request(p, params)].seq
                    for p in _prompts(batch, plan.prompt_len, vocab, salt + 1)]
            while any(s.num_output_tokens == 0 for s in seqs):
                engine.step()  # the prefill (chunks)
            for _ in range(plan.warmup):
                engine.step()
            _sync(device)
            before = [len(s) for s in seqs]
            start = time.perf_counter()
            for _ in range(plan.steps):
                engine.step()
            _sync(device)
            seconds = time.perf_counter() - start
            tokens = sum(len(s) - b for s, b in zip(seqs, before, strict=True))
            note = "" if tokens == batch * plan.steps else f"{tokens} tokens, not {batch} x {plan.steps}"
            # The token sampled last is fed in the next step: a step over a sequence of n tokens reads n entries.
            rates.append(Rate(batch, plan.steps, tokens, seconds, _kv_tokens(before, plan.steps), note))
            engine.abort_all()
    del llm
    _free()
    return rates, kernels


# ------------------------------------------------------------------------------------------------ the peer


def peer_model(config: dict, device: str, dtype: torch.dtype):
    """transformers' model for ``config`` on ``device`` holding :func:`random_weights`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(_hf_config(AutoConfig, config), dtype=dtype)
    params = model.state_dict()
    with torch.no_grad():
        for name, t in random_weights(config, device, dtype):
            params[name].copy_(t)
            del t
    if config.get("tie_word_embeddings"):
        model.tie_weights()
    return model.eval()


def _cache_argument(model) -> str:
    """The forward's name for the KV cache: ``past_key_values`` (transformers 4.x and 5.x up to ~5.20), ``cache``
    (later 5.x)."""
    names = inspect.signature(model.forward).parameters
    return "cache" if "cache" in names and "past_key_values" not in names else "past_key_values"


def peer_decode(model, device: str, prompts: list[list[int]], new_tokens: int,
                compile_kwargs: dict) -> Iterator[torch.Tensor]:
    """Greedy decoding with a static cache: the prompts (all one length) prefilled eagerly, then one compiled step
    (forward + argmax) per token; yields each step's ``[batch, 1]`` tokens, the prefill's first (the consumer may
    synchronise and time between yields)."""
    from transformers import StaticCache

    batch, length = len(prompts), len(prompts[0])
    cache = StaticCache(config=model.config, max_cache_len=length + new_tokens)
    kw = {_cache_argument(model): cache, "use_cache": True}

    def decode(tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=tokens, position_ids=position, **kw).logits
        return logits[:, -1].argmax(-1, keepdim=True)

    step = torch.compile(decode, **compile_kwargs)
    with torch.no_grad():
        positions = torch.arange(length, device=device).expand(batch, -1)
        ids = torch.tensor(prompts, device=device)
        tokens = model(input_ids=ids, position_ids=positions, **kw).logits[:, -1].argmax(-1, keepdim=True)
        yield tokens
        position = torch.full((batch, 1), length, device=device)
        for _ in range(new_tokens - 1):
            torch.compiler.cudagraph_mark_step_begin()
            tokens = step(tokens, position).clone()  # the graph's output buffer is rewritten by the next replay
            position += 1
            yield tokens


def peer_rate(model, device: str, plan: Plan, batch: int, compile_kwargs: dict) -> Rate:
    """One batch size through :func:`peer_decode`: ``warmup`` steps untimed (the compile among them), then
    ``steps`` timed."""
    prompts = _prompts(batch, plan.prompt_len, plan.shape["vocab_size"], 7)
    steps = peer_decode(model, device, prompts, 1 + plan.warmup + plan.steps, compile_kwargs)
    for _ in range(1 + plan.warmup):
        next(steps)
    _sync(device)
    start = time.perf_counter()
    for _ in steps:
        pass
    _sync(device)
    seconds = time.perf_counter() - start
    contexts = [plan.prompt_len + plan.warmup + 1] * batch  # cached tokens + the one each timed step appends
    return Rate(batch, plan.steps, batch * plan.steps, seconds, _kv_tokens(contexts, plan.steps))


def peer_rates(device: str, plan: Plan, config: dict, time_left: Callable[[], float]) -> tuple[list[Rate], str]:
    """The peer per batch size; each gets a fresh compile (Dynamo reset) and is skipped when time runs short."""
    import transformers

    compile_kwargs = dict(mode="reduce-overhead", fullgraph=True) if device == "cuda" else dict(backend="eager",
                                                                                               fullgraph=True)
    described = f"transformers {transformers.__version__}, StaticCache, torch.compile({compile_kwargs})"
    model = peer_model(config, device, plan.dtype)
    rates = []
    try:
        for batch in plan.peer_batches:
            if rates and time_left() < plan.need_s["peer"]:
                rates.append(Rate(batch, 0, 0, 0.0, 0, f"skipped: {time_left():.0f} s left of the part's budget"))
                continue
            torch._dynamo.reset()
            start = time.perf_counter()
            try:
                rate = peer_rate(model, device, plan, batch, compile_kwargs)
            except Exception as e:  # noqa: BLE001 - a graph break under fullgraph: the peer compiled in pieces
                if not compile_kwargs.get("fullgraph"):
                    raise
                compile_kwargs["fullgraph"] = False
                described += f"; fullgraph=True failed ({type(e).__name__}: {str(e)[:200]}), so fullgraph=False"
                torch._dynamo.reset()
                rate = peer_rate(model, device, plan, batch, compile_kwargs)
            rate.note = f"compile + warm-up + timed steps: {time.perf_counter() - start:.0f} s"
            rates.append(rate)
    finally:
        del model
        torch._dynamo.reset()
        _free()
    return rates, described


# ------------------------------------------------------------------------------------------------ the part


def run_part(section: Section, device: str, tiny: bool, skip: set[str], work_dir: Path, budget_s: float) -> None:
    """Section 6 (module docstring), in order of what issue 31 needs most: kubellm's rates, the PyTorch layer
    ops, the peer, the profile. ``budget_s``: each step after the first is skipped when it would start with fewer
    seconds left than it needs; a step that raises is a failed check, and the next ones still run."""
    plan = SMALL if tiny else FULL
    deadline = time.monotonic() + budget_s

    def time_left() -> float:
        return deadline - time.monotonic()

    folder = model_folder(work_dir / ("llama-8b-shape-tiny" if tiny else "llama-8b-shape"), plan.shape)
    b = Bytes.of(plan.shape, plan.dtype)
    bandwidth = copy_bandwidth(device, plan.copy_bytes)
    label = "Llama-3-8B shape" if not tiny else "Llama-shaped (tiny)"
    section.notes.append(
        f"model: {label}, random {str(plan.dtype).removeprefix('torch.')} weights made on the device "
        f"({b.weights / 1e9:.2f} GB read per decode step without the embedding table; K+V "
        f"{b.kv_per_token / 1024:.0f} KiB per token); device-to-device copy: {bandwidth / 1e9:,.0f} GB/s "
        f"(bytes read + written, {plan.copy_bytes >> 20} MiB copied 10 times)")
    section.notes.append(f"roofline of a run of decode steps = (steps x weight bytes + K/V bytes read) / copy "
                         f"bandwidth; {plan.prompt_len}-token prompts, {plan.warmup} untimed decode steps, then "
                         f"{plan.steps} timed")
    run = _Steps(section, time_left)
    ours: dict[int, Rate] = {}
    if "llama8b" in skip:
        section.skipped.append("--skip llama8b")
    else:
        run("kubellm decode", 0, lambda: ours.update(_ours(section, folder, device, plan, label, b, bandwidth)))
        if device == "cuda" and ours:
            run("layer-ops comparison", plan.need_s["layer_ops"],
                lambda: _layer_ops(section, folder, device, plan, label, ours))
    if "peer" in skip:
        section.skipped.append("--skip peer")
    else:
        run("peer", 0, lambda: _peer(section, folder, device, plan, b, bandwidth, ours, time_left))
    if "llama8b" not in skip:
        run("decode-step profile", plan.need_s["profile"], lambda: _profile(section, folder, device, plan, label))


class _Steps:
    """Runs the part's steps: skipped with a line when short of time, a failed check when one raises."""

    def __init__(self, section: Section, time_left: Callable[[], float]):
        self.section, self.time_left = section, time_left

    def __call__(self, name: str, need_s: float, fn: Callable[[], None]) -> None:
        from gpu_check_report import Check

        if need_s and self.time_left() < need_s:
            self.section.skipped.append(f"{name}: {self.time_left():.0f} s left of the part's budget, "
                                        f"{need_s:.0f} s needed")
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the kit must not hide its own bugs, nor lose the other steps
            traceback.print_exc()
            self.section.checks.append(Check(f"{name} (crashed)", "-", False, "-", "-", f"{type(e).__name__}: {e}"))
        finally:
            _free()


def _ours(section: Section, folder: Path, device: str, plan: Plan, label: str, b: Bytes,
          bandwidth: float) -> dict[int, Rate]:
    rates, kernels = engine_rates(folder, device, plan, plan.batches)
    section.tables.append(_rate_table(f"kubellm decode with CUDA graphs: {label}", rates, b, bandwidth,
                                      [f"engine: {kernels}"]))
    ours = {r.batch: r for r in rates}
    if 1 in ours:
        fraction = ours[1].roofline_s(b, bandwidth) / ours[1].seconds
        section.notes.append(f"issue 31 target 1 (batch 1 at >= 70% of the roofline): {fraction:.1%}, "
                             f"{'met' if fraction >= 0.7 else 'not met'}")
    return ours


def _layer_ops(section: Section, folder: Path, device: str, plan: Plan, label: str, ours: dict[int, Rate]) -> None:
    batches = [x for x in plan.batches if x in (1, 32)]
    rates, kernels = engine_rates(folder, device, plan, batches, layer_ops="torch")
    table = Table(f"Layer ops: the engine's choice (the table above) against PyTorch's (--layer-ops torch): {label}",
                  ["batch", "engine's layer ops tok/s", "PyTorch layer ops tok/s", "ratio"],
                  notes=[f"PyTorch run's engine: {kernels}"])
    for r in rates:
        table.rows.append([str(r.batch), f"{ours[r.batch].tok_s:,.1f}", f"{r.tok_s:,.1f}",
                           f"{ours[r.batch].tok_s / r.tok_s:.2f}x"])
    section.tables.append(table)


def _peer(section: Section, folder: Path, device: str, plan: Plan, b: Bytes, bandwidth: float,
          ours: dict[int, Rate], time_left: Callable[[], float]) -> None:
    config = json.loads((folder / "config.json").read_text())
    peers, described = peer_rates(device, plan, config, time_left)
    table = _rate_table(f"Peer: {described}", peers, b, bandwidth,
                        ["same weights; prompt prefilled eagerly into the static cache; a step is the compiled "
                         "forward + argmax; the static cache's attention reads all of its slots (the roofline "
                         "counts only the filled ones, as for kubellm)"])
    table.header.append("kubellm / peer")
    for row, r in zip(table.rows, peers, strict=True):
        row.append(f"{ours[r.batch].tok_s / r.tok_s:.2f}x" if r.batch in ours and r.steps else "-")
    section.tables.append(table)
    wanted = {1: 1.3, 32: 2.0}  # issue 31 target 5
    for r in peers:
        if r.batch in wanted and r.batch in ours and r.steps:
            ratio = ours[r.batch].tok_s / r.tok_s
            section.notes.append(f"issue 31 target 5 at batch {r.batch} (kubellm >= {wanted[r.batch]}x the "
                                 f"peer): {ratio:.2f}x, {'met' if ratio >= wanted[r.batch] else 'not met'}")


def _profile(section: Section, folder: Path, device: str, plan: Plan, label: str) -> None:
    import gpu_check_profile

    settings = dict(batches=[1, 32], prompt_len=128, steps=32, warmup=8, profiled_steps=3, prefill_lengths=[128]) \
        if plan is FULL else dict(batches=[1, 4], prompt_len=4, steps=4, warmup=2, profiled_steps=2,
                                  prefill_lengths=[4])
    with in_memory_weights(folder, device, plan.dtype):
        gpu_check_profile.profile_decode(section, label, str(folder), device, str(plan.dtype).removeprefix("torch."),
                                         kv_cache_memory=plan.kv_cache_memory, **settings)


def _rate_table(title: str, rates: list[Rate], b: Bytes, bandwidth: float, notes: list[str]) -> Table:
    table = Table(title, ["batch", "timed steps", "step (ms)", "output tok/s", "K/V read per step (GB)",
                          "roofline tok/s", "fraction of roofline"], notes=list(notes))
    for r in rates:
        if not r.steps:
            table.rows.append([str(r.batch), "-", "-", "-", "-", "-", "-"])
        else:
            roofline = r.tokens / r.roofline_s(b, bandwidth)
            table.rows.append([str(r.batch), str(r.steps), f"{1e3 * r.seconds / r.steps:.2f}", f"{r.tok_s:,.1f}",
                               f"{r.kv_tokens * b.kv_per_token / r.steps / 1e9:.3f}", f"{roofline:,.1f}",
                               f"{r.tok_s / roofline:.1%}"])
        if r.note:
            table.notes.append(f"batch {r.batch}: {r.note}")
    return table
