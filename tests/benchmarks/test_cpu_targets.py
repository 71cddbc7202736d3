"""benchmarks/cpu_targets.py's accounting: the bytes a decode step reads and the FLOPs a request costs, checked
against the checkpoint's own tensors (tied and untied LM heads), and the batch-1 run decoding what it reports.
Timings mean nothing here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import cpu_targets  # noqa: E402

from kubellm.runtime.engine.llm_engine import LLM  # noqa: E402


# Untied and tied embeddings; in bfloat16 a tied embedding packed with the native LM head has no weight left.
@pytest.mark.parametrize(("arch", "dtype"), [("llama", "float32"), ("qwen2", "float32"), ("qwen2", "bfloat16")])
def test_bytes_and_flops_follow_the_checkpoint_tensors(arch, dtype, tiny_checkpoint_factory):
    path = tiny_checkpoint_factory(arch)
    tensors = {}
    for f in path.glob("*.safetensors"):
        tensors |= load_file(f)
    llm = LLM(str(path), progress=False, dtype=dtype, num_kv_blocks=32, block_size=4)
    size = 4 if dtype == "float32" else 2
    cost = cpu_targets.ModelCost(llm.engine)
    cfg = llm.engine.model_config
    embed = tensors["model.embed_tokens.weight"]
    # A step reads every tensor once, the embedding table only by its row unless the LM head is that table.
    everything = sum(t.numel() for n, t in tensors.items() if n != "lm_head.weight") * size
    expected = everything if cfg.tie_word_embeddings else everything - embed.numel() * size + embed.shape[1] * size + \
        tensors["lm_head.weight"].numel() * size
    assert cost.weight_bytes_per_step == expected
    projections = sum(t.numel() for n, t in tensors.items() if n.endswith("proj.weight"))
    assert cost.body_flops_per_token == 2 * projections
    assert cost.head_flops_per_row == 2 * embed.numel()
    assert cost.kv_bytes_per_key == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * size
    # 3 prompt tokens and 2 outputs: 4 tokens through the body, 2 LM-head rows, 1 + 2 + 3 + 4 attended keys.
    assert cost.request_flops(3, 2) == 4 * cost.body_flops_per_token + 2 * cost.head_flops_per_row + \
        10 * cost.attn_flops_per_key


def test_batch1_decode_times_only_decode_steps(tiny_checkpoint_factory):
    llm = LLM(str(tiny_checkpoint_factory("llama")), progress=False, dtype="float32", num_kv_blocks=64, block_size=4)
    cost = cpu_targets.ModelCost(llm.engine)
    run = cpu_targets.batch1_decode(llm, cost, prompt_len=5, tokens=6, repeats=2, vocab=100)
    assert run["tokens"] == 6  # the prefill step samples the first of the 7 tokens asked for, untimed
    # Step i attends over 5 + i keys: (6 + 7 + ... + 11) / 6 = 8.5 keys per token on top of the weights.
    assert run["bytes_per_token"] == pytest.approx(cost.weight_bytes_per_step + 8.5 * cost.kv_bytes_per_key)
    assert not llm.engine.has_unfinished_requests()
