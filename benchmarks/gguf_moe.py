"""A GGUF mixture of experts kept packed against the same file dequantized to bfloat16, end to end on CPU.

Writes a synthetic Qwen3-MoE GGUF (random weights; experts in ``--types``, attention in Q8_0; tests/runtime/
test_gguf.py's writer, random blocks for the K-quants gguf cannot write), exports it as a bfloat16 Hugging Face
folder (what a GGUF MoE ran as before its experts stayed packed: dequantized at load), builds both engines in
this process and times greedy generation of one prompt on each, interleaved, ``--rounds`` times. Prints weight
MiB (the load log's accounting), median seconds per generation, their ratio and how many tokens agree (the
bfloat16 folder rounds the dequantized weights, so a few late tokens may differ).

    python benchmarks/gguf_moe.py --threads 1 [--types Q4_0,Q4_K,Q8_0,Q6_K,Q4_K_M] [--rounds 9]

A type names all three expert tensors of a layer, except ``Q4_K_M``: Q4_K gate and up beside a Q6_K down (what
llama.cpp's Q4_K_M gives many layers). "fused layers" counts the layers whose experts run cpu_moe's fused
quantized kernel (4-bit, 8-bit or mixed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
MIXES = {"Q4_K_M": ("Q4_K", "Q4_K", "Q6_K")}  # gate, up, down


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--types", default="Q4_0,Q4_K", help="expert types, one model each")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--inter", type=int, default=512)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, str(REPO / "tests" / "runtime"))
    from test_gguf import (
        Q,
        byte_level_metadata,
        tiny_config,
        tiny_model,
        train_byte_level_tokenizer,
        write_gguf,
    )

    from kubellm.runtime.engine.llm_engine import LLM
    from kubellm.runtime.layers.moe import FusedMoE
    from kubellm.runtime.models.store import export_hf
    from kubellm.runtime.sampling.params import SamplingParams

    meta = byte_level_metadata(train_byte_level_tokenizer()) | {"pre": "qwen2"}
    model = tiny_model(tiny_config(len(meta["tokens"]), hidden_size=args.hidden, num_hidden_layers=args.layers,
                                   num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                                   num_experts=args.experts, num_experts_per_tok=8,
                                   moe_intermediate_size=args.inter, norm_topk_prob=True), "Qwen3MoeForCausalLM")
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    prompt = [list(range(3, 40))]
    print("| experts | packed MiB | bf16 MiB | fused layers | packed (s) | bf16 (s) | speed-up | tokens agree |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for type_name in args.types.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "moe.gguf"
            quants = {n: Q.Q8_0 for n in model.state_dict() if n.endswith("proj.weight")}
            quants |= {f"blk.{i}.{t}.weight": Q[q] for i in range(args.layers)
                       for t, q in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"),
                                       MIXES.get(type_name, (type_name,) * 3), strict=True)}
            write_gguf(path, model, meta, arch="qwen3moe", permute=False, quants=quants, key_length=128,
                       extra_kv={"expert_count": args.experts, "expert_used_count": 8,
                                 "expert_feed_forward_length": args.inter})
            export_hf(path, Path(tmp) / "hf", torch.bfloat16, pull_missing=False)
            llms = {kind: LLM(str(src), dtype="bfloat16", max_model_len=256, num_kv_blocks=32, block_size=16,
                              progress=False) for kind, src in (("packed", path), ("bf16", Path(tmp) / "hf"))}
            times: dict[str, list[float]] = {k: [] for k in llms}
            tokens = {}
            for _ in range(args.rounds):
                for kind, llm in llms.items():
                    start = time.perf_counter()
                    tokens[kind] = llm.generate(prompt, params, use_tqdm=False)[0].token_ids
                    times[kind].append(time.perf_counter() - start)
            mib = {k: sum(llm.engine.weight_bytes.values()) / 2**20 for k, llm in llms.items()}
            fused = sum(type(m.packed).__name__ == "QuantizedExperts"
                        for m in llms["packed"].engine.runner.model.modules() if isinstance(m, FusedMoE))
            packed, bf16 = (statistics.median(times[k]) for k in ("packed", "bf16"))
            agree = next((i for i, (a, b) in enumerate(zip(tokens["packed"], tokens["bf16"], strict=True)) if a != b),
                         args.tokens)
            print(f"| {type_name} | {mib['packed']:.1f} | {mib['bf16']:.1f} | {fused}/{args.layers} | {packed:.3f} | "
                  f"{bf16:.3f} | {bf16 / packed:.2f}x | {agree}/{args.tokens} |", flush=True)
            for llm in llms.values():
                llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
