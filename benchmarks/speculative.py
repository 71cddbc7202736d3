"""Speculative decoding against decoding without it, in one process, on two workloads.

  repetitive  chat requests whose answers quote their prompt (fix typos in a paragraph, rename a variable in
              code, pull a list out of a text): what prompt lookup is for
  random      prompts of random words, answers that repeat nothing: where speculation must cost ~nothing

Proposers (one engine each, built side by side from the same folder, plus one without speculation):

  ngram         prompt lookup (--speculative-ngram)
  draft-random  a draft model: the target's config cut to --draft-layers layers, random weights, the same
                tokenizer (a draft that is almost never right: what a useless draft costs after back-off)
  draft-same    the target itself as its own draft: every draft right (the upper bound of what acceptance buys
                when the draft costs as much as the target)
  eagle         an EAGLE-1 head (--speculative-method eagle) from --eagle-head PATH, e.g. the one
                benchmarks/train_eagle_head.py self-distils for the demo model

Each request runs alone (batch 1: one at a time, sequentially), greedy, the same max_tokens. In float32 greedy
output must be identical (checked: exit 1 otherwise); in bf16 it is not even batch-invariant without
speculation. The table gives output tok/s, the ratio, and the draft acceptance rate. Run:

  .venv/bin/python benchmarks/speculative.py [--model smollm2] [--ngram 3] [--k 4] [--max-tokens 128]
      [--proposers ngram,draft-random,draft-same,eagle] [--draft-layers 2] [--eagle-head PATH]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

PARAGRAPH = (
    "Kubernetes operators encode the knowlege of a human operator in software. They watch custom resources, "
    "compare the desired state with the observed state, and act to close the gap: creating deployments, "
    "scaling replicas, and reporting conditions. A good operator is level-triggered, idempotent and "
    "observable, so that a restart never loses work and a user can allways tell what it is doing."
)
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def format_receipt(items, tax_rate):
    lines = [f"{item.name}: {item.price * item.quantity:.2f}" for item in items]
    lines.append(f"total: {total_price(items, tax_rate):.2f}")
    return "\\n".join(lines)
'''
REPETITIVE = [
    f"Fix the spelling mistakes in this text and return the whole corrected text:\n\n{PARAGRAPH}",
    f"Rename the variable `subtotal` to `net` in this code and return the full code:\n\n{CODE}",
    f"Repeat this text exactly, word for word:\n\n{PARAGRAPH}",
    f"Add a docstring to each function and return the full code:\n\n{CODE}",
]


def random_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    words = ["cloud", "river", "engine", "quiet", "orange", "planet", "seven", "ladder", "violin", "harbor", "pencil", "winter", "garden", "signal"]
    return [tokenizer.encode_chat([{"role": "user", "content": " ".join(rng.choice(words) for _ in range(40))}])
            for _ in range(n)]


def random_draft(target: Path, dest: Path, layers: int, seed: int = 0) -> Path:
    """A draft with the target's tokenizer and shapes but only ``layers`` layers of random weights."""
    import json
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    dest.mkdir(parents=True, exist_ok=True)
    for f in target.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dest / f.name)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for path in sorted(target.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if ".layers." in name and int(name.split(".layers.")[1].split(".")[0]) >= layers:
                    continue
                shape = f.get_slice(name).get_shape()
                tensors[name] = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(
                    shape, generator=g) * 0.02
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dest / "model.safetensors"))
    return dest


def timed(llm, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    from kubellm.runtime.sampling.params import SamplingParams

    outs, elapsed = [], 0.0
    for p in prompts:  # batch 1: one request at a time
        start = time.perf_counter()
        out = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)[0]
        elapsed += time.perf_counter() - start
        outs.append(out.token_ids)
    return outs, elapsed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="known model name, .gguf or HF folder (default smollm2)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--ngram", type=int, default=3, help="--speculative-ngram (default 3)")
    p.add_argument("--k", type=int, default=4, help="--num-speculative-tokens (default 4)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeat", type=int, default=3, help="timed passes per workload and side (median reported)")
    p.add_argument("--proposers", default="ngram,draft-random,draft-same",
                   help="comma-separated: ngram, draft-random, draft-same, eagle (default: the first three)")
    p.add_argument("--draft-layers", type=int, default=2, help="layers of the random draft (default 2)")
    p.add_argument("--eagle-head", type=Path, default=None, help="the EAGLE head folder for the eagle proposer")
    args = p.parse_args(argv)

    import tempfile

    from kubellm.runtime.engine.config import parse_dtype
    from kubellm.runtime.engine.llm_engine import LLM
    from kubellm.runtime.models import store as model_store

    if args.threads:
        torch.set_num_threads(args.threads)
    folder = Path(args.model).expanduser()
    if not folder.is_dir():  # a known model name or a .gguf: exported once into the kubellm cache
        folder = model_store.cached_hf_export(args.model, parse_dtype(args.dtype))
    kw = dict(progress=False, dtype=args.dtype, max_model_len=1024, kv_cache_memory="512MiB")
    plain = LLM(str(folder), **kw)
    proposers = [name.strip() for name in args.proposers.split(",") if name.strip()]
    engines = {}
    for name in proposers:
        if name == "ngram":
            engines[name] = LLM(str(folder), speculative_ngram=args.ngram, num_speculative_tokens=args.k, **kw)
        elif name in ("draft-random", "draft-same"):
            draft = folder if name == "draft-same" else random_draft(
                folder, Path(tempfile.mkdtemp(prefix="kubellm-draft-")), args.draft_layers)
            engines[name] = LLM(str(folder), speculative_model=str(draft), num_speculative_tokens=args.k, **kw)
        elif name == "eagle":
            if args.eagle_head is None:
                p.error("the eagle proposer needs --eagle-head PATH (benchmarks/train_eagle_head.py writes one)")
            engines[name] = LLM(str(folder), speculative_model=str(args.eagle_head), speculative_method="eagle",
                                num_speculative_tokens=args.k, **kw)
        else:
            p.error(f"unknown proposer {name!r}; use ngram, draft-random, draft-same, eagle")
    for llm in (plain, *engines.values()):
        llm.engine.warmup()
    workloads = {"repetitive": [plain.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in REPETITIVE],
                 "random": random_prompts(plain.tokenizer, 4)}
    rows, identical = [], True
    for name, prompts in workloads.items():
        before = {n: e.engine.stats().speculation for n, e in engines.items()}
        rates: dict[str, list[float]] = {n: [] for n in ("off", *engines)}
        outs: dict[str, list] = {}
        for _ in range(args.repeat):  # alternated, so drift on a shared machine hits every side alike
            for side, llm in (("off", plain), *engines.items()):
                outs[side], seconds = timed(llm, prompts, args.max_tokens)
                rates[side].append(sum(len(o) for o in outs[side]) / seconds)
        off = statistics.median(rates["off"])
        for side in engines:
            after = engines[side].engine.stats().speculation
            identical &= outs["off"] == outs[side]
            for a, b in zip(outs["off"], outs[side], strict=True):
                if a != b:
                    at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                    print(f"{name}/{side}: outputs diverge at token {at} of {len(a)}", file=sys.stderr)
            on = statistics.median(rates[side])
            drafted = after.num_draft_tokens - before[side].num_draft_tokens
            accepted = after.num_accepted_tokens - before[side].num_accepted_tokens
            rows.append((name, side, sum(len(o) for o in outs["off"]), off, on, on / off,
                         accepted / drafted if drafted else 0.0, drafted // args.repeat))
        print(f"{name}: done", file=sys.stderr, flush=True)
    print(f"\nmodel {folder.name}, {args.dtype}, batch 1, greedy, max_tokens {args.max_tokens}, "
          f"--num-speculative-tokens {args.k} (ngram: --speculative-ngram {args.ngram}; draft-random: "
          f"{args.draft_layers} random layers), {torch.get_num_threads()} threads, median of {args.repeat} "
          "alternated passes\n")
    print("| workload | proposer | output tokens | tok/s off | tok/s on | speed-up | acceptance | draft tokens per pass |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, side, tokens, off, on, ratio, acc, drafted in rows:
        print(f"| {name} | {side} | {tokens} | {off:.1f} | {on:.1f} | {ratio:.2f}x | {acc:.0%} | {drafted} |")
    print(f"\ngreedy outputs identical with and without speculation: {'yes' if identical else 'no'}")
    if args.dtype != "float32":
        # bf16 GEMMs round differently for different batch shapes, so even without speculation the same request
        # decodes differently alone and in a batch; a verification step is one more batch shape.
        print("(exact identity is checked in float32; in bf16 greedy decoding is not batch-invariant, with or "
              "without speculation)")
        return 0
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
