"""benchmarks/train_eagle_head.py against the served EAGLE head: a head the script overfits on a tiny model's own
greedy sequence must draft that sequence through the engine (nearly every draft accepted). Any train/serve
mismatch (which hidden state, the token shift, positions, the chain feeding the head its own output, the LM
head) would make the served drafts miss what training taught."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import train_eagle_head as distillation  # noqa: E402

from kubellm.runtime.engine.llm_engine import LLM  # noqa: E402
from kubellm.runtime.sampling.params import SamplingParams  # noqa: E402

ARGS = dict(progress=False, dtype="float32", max_model_len=256, block_size=4, max_num_batched_tokens=256,
            max_num_seqs=4, num_kv_blocks=200)


@pytest.fixture(scope="module")
def overfit(tiny_llama, tmp_path_factory):
    """(prompt, the model's greedy answer, a head trained on exactly that sequence)."""
    torch.manual_seed(0)
    prompt = torch.randint(3, 500, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    llm = LLM(str(tiny_llama), enable_prefix_caching=False, **ARGS)
    answer = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
                          use_tqdm=False)[0].token_ids
    seq = prompt + answer
    data = [(torch.tensor(seq), f) for f in distillation.features(llm, [seq])]
    out = tmp_path_factory.mktemp("overfit-eagle") / "head"
    result = distillation.distill(tiny_llama, data, out, distillation.Training(steps=400, lr=3e-3, noise=0.05),
                                  progress=False)
    return prompt, answer, out, result


def test_the_script_overfits_a_head_on_one_sequence(overfit):
    assert overfit[3]["top1"] > 0.95


def test_a_head_trained_on_a_sequence_drafts_it_through_the_engine(tiny_llama, overfit):
    prompt, answer, head, _ = overfit
    assert len(set(answer)) > 10  # a varied answer, not one token repeated
    llm = LLM(str(tiny_llama), speculative_model=str(head), speculative_method="eagle", num_speculative_tokens=4,
              **ARGS)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True), use_tqdm=False)
    assert out[0].token_ids == answer
    stats = llm.engine.stats().speculation
    assert stats.num_draft_tokens >= 40
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens


def test_prompts_are_varied_and_stable():
    ps = distillation.prompts(500)
    assert ps == distillation.prompts(500) and len(set(ps)) == 500
