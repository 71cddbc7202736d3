"""Log-probabilities equal transformers' log-softmax on the same weights (fp32), for generated tokens and for
prompt tokens (echo), through chunked prefill and preemption; logit_bias moves them as it should."""

from __future__ import annotations

import random

import pytest
import torch

from kubellm.runtime.engine.llm_engine import LLM
from kubellm.runtime.sampling.params import InvalidSamplingParams, SamplingParams
from tiny_checkpoints import load_hf_model

ATOL = 1e-4  # fp32, as the issue asks


def _hf_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of ``ids``: row p predicts token p + 1."""
    model = load_hf_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    # A small token budget and pool: prompts prefill in chunks and sequences get preempted and recomputed.
    return LLM(str(tiny_llama), progress=False, dtype="float32", block_size=4, max_num_batched_tokens=16,
               max_num_seqs=4, num_kv_blocks=24, max_model_len=256)


def _prompts(n=6, seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def test_generated_and_prompt_logprobs_equal_transformers(llm, tiny_llama):
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "no preemption: the recompute path went untested"
    for prompt, out in zip(prompts, outs, strict=True):
        ref = _hf_logprobs(tiny_llama, prompt + out.token_ids)
        P = len(prompt)
        assert len(out.logprobs) == len(out.token_ids) == 12
        for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            row = ref[P - 1 + j]
            assert abs(entry.logprob - row[token].item()) < ATOL
            top_v, top_i = row.topk(5)
            assert [t for t, _ in entry.top] == top_i.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in entry.top]), top_v, atol=ATOL, rtol=0)
            assert entry.top[0][0] == token  # greedy: the chosen token is the most likely one
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == P
        for p in range(1, P):
            entry = out.prompt_logprobs[p]
            assert abs(entry.logprob - ref[p - 1][prompt[p]].item()) < ATOL, p
            assert [t for t, _ in entry.top] == ref[p - 1].topk(3).indices.tolist()
    assert llm.engine.block_manager.num_used_blocks == 0


def test_logprobs_zero_gives_only_the_chosen_token_and_sampling_reports_the_drawn_one(llm, tiny_llama):
    prompt = _prompts(1, seed=9)[0]
    out = llm.generate([prompt], SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True,
                                                logprobs=0), use_tqdm=False)[0]
    ref = _hf_logprobs(tiny_llama, prompt + out.token_ids)
    for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert entry.top == []
        # before temperature: the model's distribution, whatever was drawn from it
        assert abs(entry.logprob - ref[len(prompt) - 1 + j][token].item()) < ATOL


def test_logit_bias_forces_a_token_and_its_logprobs_are_of_the_biased_distribution(llm, tiny_llama):
    prompt = _prompts(1, seed=11)[0]
    forced = 123
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1,
                                                logit_bias={forced: 100.0}), use_tqdm=False)[0]
    assert out.token_ids == [forced] * 4
    assert all(e.logprob > -1e-3 for e in out.logprobs)  # +100 leaves ~all the mass on it
    banned = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=1), use_tqdm=False)[0]
    top = banned.token_ids[0]
    again = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logit_bias={top: -100.0}),
                         use_tqdm=False)[0]
    assert again.token_ids[0] != top


@pytest.mark.parametrize("kwargs, param", [({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"),
                                           ({"prompt_logprobs": 50}, "prompt_logprobs"),
                                           ({"logit_bias": {5: 101.0}}, "logit_bias"),
                                           ({"logit_bias": {-1: 1.0}}, "logit_bias")])
def test_out_of_range_logprob_settings_are_refused_by_name(kwargs, param):
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param
