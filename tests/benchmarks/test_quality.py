"""benchmarks/quality.py's machinery on tiny random checkpoints (the real model's numbers live in
benchmarks/README.md): its perplexity is transformers' on the same windows, its agreement measures count what
they say, and a run over a folder writes a row per variant, including a format written by the tests' writers."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import quality  # noqa: E402

from kubellm.runtime.engine.llm_engine import LLM  # noqa: E402
from tiny_checkpoints import load_hf_model  # noqa: E402


def test_windows_cut_the_text_without_overlap_and_drop_a_last_single_token():
    assert quality.windows(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5]]
    assert quality.windows(list(range(8)), 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_greedy_prompts_span_the_text_from_its_start_to_its_end():
    ids = list(range(100))
    prompts = quality.greedy_prompts(ids, 3, 10)
    assert prompts == [ids[0:10], ids[45:55], ids[90:100]]
    with pytest.raises(ValueError, match="fewer than --prompt-tokens"):
        quality.greedy_prompts(ids[:5], 2, 10)


def test_prefix_agreement_stops_at_the_first_difference_and_position_agreement_does_not():
    ref = [1, 2, 3, 4]
    assert quality.prefix_agreement([1, 2, 9, 4], ref) == 0.5
    assert quality.position_agreement([1, 2, 9, 4], ref) == 0.75
    assert quality.prefix_agreement([9, 2, 3, 4], ref) == 0.0
    assert quality.prefix_agreement(ref, ref) == quality.position_agreement(ref, ref) == 1.0


@pytest.mark.slow
def test_perplexity_and_top1_equal_transformers_on_the_same_windows(tiny_llama):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 500, (70,), generator=gen).tolist()
    text_windows = quality.windows(ids, 32)  # 32, 32, 6 tokens: a short last window too
    llm = LLM(str(tiny_llama), progress=False, dtype="float32", num_kv_blocks=64, max_model_len=64)
    try:
        scores = quality.score(llm, text_windows, [ids[:8], ids[8:16]], 4)
    finally:
        llm.close()
    model = load_hf_model(tiny_llama)
    nll, top1 = [], []
    with torch.inference_mode():
        for w in text_windows:
            logprobs = torch.log_softmax(model(torch.tensor([w])).logits[0, :-1].float(), dim=-1)
            nll += (-logprobs.gather(1, torch.tensor(w[1:])[:, None])[:, 0]).tolist()
            top1 += logprobs.argmax(-1).tolist()
    assert len(scores.nll) == len(ids) - len(text_windows)  # each window's first token is not scored
    torch.testing.assert_close(torch.tensor(scores.nll), torch.tensor(nll), atol=1e-4, rtol=0)
    assert scores.top1 == top1
    assert scores.perplexity == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)
    assert [len(g) for g in scores.greedy] == [4, 4]


@pytest.mark.slow
def test_a_run_over_a_folder_reports_the_reference_against_itself_and_a_written_format(
        tiny_checkpoint_factory, tmp_path, monkeypatch, capsys):
    # 4-bit groups of 64 need input sizes that are multiples of 64
    folder = tiny_checkpoint_factory("llama", hidden_size=128, intermediate_size=256, head_dim=32)
    monkeypatch.setenv("KUBELLM_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "quality.json"
    assert quality.main(["--model", str(folder), "--variants", "fp32,fp32,awq", "--window", "64", "--prompts", "2",
                         "--prompt-tokens", "8", "--new-tokens", "6", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.count("| float32 (dequantized weights) |") == 2 and "| AWQ 4-bit g64 |" in table
    rows = json.loads(out.read_text())["rows"]
    same, awq = rows[1], rows[2]
    assert same["perplexity"] == rows[0]["perplexity"]
    assert same["top1_agreement"] == same["greedy_prefix"] == same["greedy_tokens"] == 1.0
    assert awq["weight_mib"] < same["weight_mib"]  # served packed, not dequantized
    assert awq["perplexity"] != same["perplexity"]
    assert (tmp_path / "cache" / "quantized" / f"{folder.name}-awq" / "config.json").is_file()
