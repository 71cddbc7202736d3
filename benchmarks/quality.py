"""Quality of kubellm's weight formats on one model: perplexity on a fixed text and agreement with bf16.

Every number comes from kubellm's own engine (``LLM.generate``), the way a deployment computes:

* **perplexity**: the text (benchmarks/data/quality_text.txt, ~3,000 SmolLM2 tokens) is cut into windows of
  ``--window`` tokens; each window is one request with ``prompt_logprobs=1``, so every token after a window's
  first is scored from the raw logits given the tokens before it in that window. Perplexity = exp(mean
  negative log-likelihood) over all scored tokens.
* **top-1 = reference**: on the same teacher-forced positions, how often the variant's most likely next token
  is the reference's.
* **greedy agreement**: ``--prompts`` slices of the text (``--prompt-tokens`` each, evenly spaced) continued
  greedily for ``--new-tokens`` tokens (EOS ignored), all submitted at once. *Prefix* = mean fraction of the
  tokens up to the first one that differs from the reference's continuation; *tokens* = fraction of
  positions holding the same token (after a divergence the contexts differ, so this only shows how far
  apart the texts drift).

The reference is the first variant (bf16 on the dequantized weights). The demo model's GGUF is Q4_1 (every
decoder linear; the embedding Q8_0), so "bf16" here means those Q4_1 weights dequantized, and int8 / int4
re-quantize them. See benchmarks/README.md for the table and ``--help`` for the variants.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import prequantized_checkpoints
import torch

TEXT = Path(__file__).resolve().parent / "data" / "quality_text.txt"


@dataclass(frozen=True)
class Variant:
    """One way to run the model: which weights (``source``), in which dtype, with which --quantization."""

    label: str
    source: str  # "dense-bf16" | "dense-fp32" (the exported, dequantized folder) | "gguf" (the file, packed) |
    #              one of prequantized_checkpoints.FORMATS (written from the bf16 folder)
    dtype: str = "bfloat16"
    quantization: str = "none"
    int4_activations: str = "bf16"  # --cpu-int4-activations


VARIANTS = {
    "bf16": Variant("bf16 (dequantized weights)", "dense-bf16"),
    "fp32": Variant("float32 (dequantized weights)", "dense-fp32", dtype="float32"),
    "int8": Variant("--quantization int8", "dense-bf16", quantization="int8"),
    "int4": Variant("--quantization int4 --cpu-int4-activations bf16", "dense-bf16", quantization="int4"),
    "int4-fp32": Variant("--quantization int4, float32 (dequantize-per-call path)", "dense-fp32", dtype="float32",
                         quantization="int4"),
    "int4-a8": Variant("--quantization int4 --cpu-int4-activations int8 (every row)", "dense-bf16",
                       quantization="int4", int4_activations="int8"),
    "gguf": Variant("GGUF kept packed, --cpu-int4-activations bf16", "gguf"),
    "gguf-a8": Variant("GGUF kept packed, --cpu-int4-activations int8 (every row)", "gguf", int4_activations="int8"),
    "awq": Variant("AWQ 4-bit g64", "awq"),
    "gptq": Variant("GPTQ 4-bit sym g64", "gptq"),
    "w4a16": Variant("compressed-tensors W4A16 g64", "w4a16"),
    "fp8": Variant("compressed-tensors FP8 (per channel)", "fp8"),
}
DEFAULT_VARIANTS = "bf16,fp32,int8,int4,gguf,awq,gptq,w4a16,fp8"


# ------------------------------------------------------------------------------------------------ measuring
def windows(ids: list[int], size: int) -> list[list[int]]:
    """Consecutive, non-overlapping windows of ``size`` tokens; a last shorter one if it has 2+ tokens."""
    out = [ids[i : i + size] for i in range(0, len(ids), size)]
    return [w for w in out if len(w) >= 2]


def greedy_prompts(ids: list[int], n: int, length: int) -> list[list[int]]:
    """``n`` slices of ``length`` tokens starting at evenly spaced offsets of ``ids``."""
    if len(ids) < length:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than --prompt-tokens {length}")
    span = len(ids) - length
    starts = [round(i * span / max(n - 1, 1)) for i in range(n)]
    return [ids[s : s + length] for s in starts]


@dataclass
class Scores:
    nll: list[float]  # negative log-likelihood of every scored token
    top1: list[int]  # the most likely token at each scored position
    greedy: list[list[int]]  # each prompt's continuation

    @property
    def perplexity(self) -> float:
        return math.exp(sum(self.nll) / len(self.nll))


def score(llm, text_windows: list[list[int]], prompts: list[list[int]], new_tokens: int) -> Scores:
    from kubellm.runtime.sampling.params import SamplingParams

    scored = llm.generate(text_windows, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1),
                          use_tqdm=False)
    nll, top1 = [], []
    for out in scored:
        for entry in out.prompt_logprobs[1:]:  # the first token has no context in its window
            nll.append(-entry.logprob)
            top1.append(entry.top[0][0])
    cont = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    return Scores(nll, top1, [list(o.token_ids) for o in cont])


def prefix_agreement(tokens: list[int], reference: list[int]) -> float:
    """Fraction of ``reference`` that ``tokens`` repeats before the first difference."""
    same = 0
    for a, b in zip(tokens, reference, strict=True):
        if a != b:
            break
        same += 1
    return same / len(reference)


def position_agreement(tokens: list[int], reference: list[int]) -> float:
    return sum(a == b for a, b in zip(tokens, reference, strict=True)) / len(reference)


@dataclass
class Row:
    variant: str
    label: str
    weight_mib: float
    perplexity: float
    scored_tokens: int
    top1_agreement: float  # teacher-forced, vs the reference
    greedy_prefix: float
    greedy_tokens: float
    seconds: float  # load + scoring, for orientation only


def compare(name: str, variant: Variant, scores: Scores, reference: Scores, weight_bytes: dict[str, int],
            seconds: float) -> Row:
    top1 = sum(a == b for a, b in zip(scores.top1, reference.top1, strict=True)) / len(reference.top1)
    pairs = list(zip(scores.greedy, reference.greedy, strict=True))
    return Row(name, variant.label, sum(weight_bytes.values()) / 2**20, scores.perplexity, len(scores.nll), top1,
               sum(prefix_agreement(a, b) for a, b in pairs) / len(pairs),
               sum(position_agreement(a, b) for a, b in pairs) / len(pairs), seconds)


def markdown(rows: list[Row]) -> str:
    ref = rows[0]
    lines = ["| variant | weights MiB | perplexity | vs " + ref.variant + " | top-1 = " + ref.variant
             + " | greedy prefix = " + ref.variant + " | greedy tokens = " + ref.variant + " |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.label} | {r.weight_mib:.1f} | {r.perplexity:.3f} | "
                     f"{100 * (r.perplexity / ref.perplexity - 1):+.2f}% | {100 * r.top1_agreement:.1f}% | "
                     f"{100 * r.greedy_prefix:.1f}% | {100 * r.greedy_tokens:.1f}% |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- the weights
def model_sources(model: str, needed: set[str]) -> dict[str, Path]:
    """The folder or file each source runs from. ``model``: a kubellm model name or .gguf (exported once to
    dense bf16/fp32 folders in the kubellm cache) or a Hugging Face folder (dense; no "gguf" source then)."""
    from kubellm.runtime.models import store as model_store
    path = Path(model).expanduser()
    out: dict[str, Path] = {}
    if path.is_dir():
        out["dense-bf16"] = out["dense-fp32"] = path.resolve()
    else:
        gguf = model_store.resolve(model, pull_missing=True)
        out["gguf"] = gguf
        for dtype in ("bf16", "fp32"):
            if f"dense-{dtype}" in needed or (dtype == "bf16" and needed - {"gguf", "dense-fp32"}):
                torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
                # by the name a user gave, so offline.py's export of the same model is reused
                out[f"dense-{dtype}"] = model_store.cached_hf_export(model, torch_dtype)
    for fmt in needed & set(prequantized_checkpoints.FORMATS):
        out[fmt] = prequantized_checkpoints.quantized_folder(out["dense-bf16"], fmt,
                                                             model_store.cache_root() / "quantized")
    missing = needed - set(out)
    if missing:
        raise SystemExit(f"--variants: {', '.join(sorted(missing))} need a GGUF model, not a folder")
    return out


def run_variant(path: Path, variant: Variant, text_windows, prompts, args) -> tuple[Scores, dict[str, int]]:
    from kubellm.runtime.engine.llm_engine import LLM

    longest = max(max(map(len, text_windows)) + 1, args.prompt_tokens + args.new_tokens)  # +1: the sampled token
    llm = LLM(str(path), progress=False, dtype=variant.dtype, quantization=variant.quantization,
              cpu_int4_activations=variant.int4_activations, kv_cache_memory=args.kv_cache_memory,
              max_model_len=longest, num_threads=args.threads, seed=0)
    try:
        return score(llm, text_windows, prompts, args.new_tokens), dict(llm.engine.weight_bytes)
    finally:
        llm.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/quality.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="kubellm model name, .gguf file or dense HF folder")
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help="comma-separated, the first is the reference; from: " + ", ".join(
                       f"{k} ({v.label})" for k, v in VARIANTS.items()) + " (default %(default)s)")
    p.add_argument("--text", type=Path, default=TEXT, help="UTF-8 text to score (default: %(default)s)")
    p.add_argument("--window", type=int, default=512, help="tokens per perplexity window (default %(default)s)")
    p.add_argument("--prompts", type=int, default=16, help="greedy prompts (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--json", type=Path, help="write the rows and settings as JSON")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if unknown := [v for v in args.variants if v not in VARIANTS]:
        p.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.window < 2 or args.prompts < 1 or args.prompt_tokens < 1 or args.new_tokens < 1:
        p.error("need --window >= 2 and --prompts, --prompt-tokens, --new-tokens >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from kubellm.runtime.models.loader import read_checkpoint
    from kubellm.runtime.text.tokenizer import Tokenizer

    sources = model_sources(args.model, {VARIANTS[v].source for v in args.variants})
    tokenizer = Tokenizer.from_checkpoint(read_checkpoint(next(iter(sources.values()))))
    ids = tokenizer.encode(args.text.read_text(encoding="utf-8"), add_special_tokens=False)
    text_windows = windows(ids, args.window)
    prompts = greedy_prompts(ids, args.prompts, args.prompt_tokens)
    print(f"{args.text.name}: {len(ids)} tokens in {len(text_windows)} windows of up to {args.window}; "
          f"{args.prompts} prompts x {args.new_tokens} greedy tokens", file=sys.stderr, flush=True)
    rows, reference = [], None
    for name in args.variants:
        variant = VARIANTS[name]
        start = time.perf_counter()
        scores, weight_bytes = run_variant(sources[variant.source], variant, text_windows, prompts, args)
        reference = reference or scores
        rows.append(compare(name, variant, scores, reference, weight_bytes, time.perf_counter() - start))
        print(f"{name}: perplexity {scores.perplexity:.3f} ({rows[-1].seconds:.0f} s)", file=sys.stderr, flush=True)
        gc.collect()
    print(markdown(rows))
    if args.json:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "json"}
        args.json.write_text(json.dumps({"settings": {**settings, "text_tokens": len(ids)},
                                         "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
