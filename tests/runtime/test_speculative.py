"""Prompt-lookup speculative decoding: greedy output identical to decoding without it, sampled output with the
same distribution (tested statistically), drafts rolled back without corrupting the KV or prefix cache, and
back-off when drafts do not pay."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from speculation_checks import CHI2_999, CYCLE, CYCLE_PROMPT, chi2, cycle_checkpoint, run_lengths

from kubellm.runtime.engine.config import EngineConfig
from kubellm.runtime.engine.llm_engine import LLM
from kubellm.runtime.engine.sequence import Sequence
from kubellm.runtime.sampling.params import SamplingParams
from kubellm.runtime.spec_decode.factory import make_proposer
from kubellm.runtime.spec_decode.ngram import NgramProposer, find_ngram_continuation
from kubellm.runtime.spec_decode.verification import accept


@pytest.fixture(scope="module")
def cycle_model(tiny_llama, tmp_path_factory):
    """Drafts copied from the history are often right, while sampling stays random."""
    return cycle_checkpoint(tiny_llama, tmp_path_factory.mktemp("cycle") / "m", 1.2)


def _llm(model, speculative: bool, **kw) -> LLM:
    args = dict(progress=False, dtype="float32", max_model_len=256, block_size=4, max_num_batched_tokens=64,
                max_num_seqs=8, num_kv_blocks=120)
    args.update(kw)
    return LLM(str(model), speculative_ngram=3 if speculative else 0, num_speculative_tokens=4, **args)


def test_ngram_lookup_prefers_the_longest_then_the_latest_match():
    seq = torch.tensor([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3]).numpy()
    assert find_ngram_continuation(seq, 3, 1, 2) == [7, 5]  # "2 3" last seen before "7 5"
    assert find_ngram_continuation(seq, 3, 3, 2) == []  # "5 2 3" never occurred before
    assert find_ngram_continuation(torch.tensor([4, 5, 6]).numpy(), 3, 1, 4) == []


def test_acceptance_keeps_the_matching_prefix_and_the_first_correction():
    assert accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted, plus the next token
    assert accept([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accept([5, 6, 7], [4, 6, 7, 8]) == [4]


def test_the_factory_builds_no_proposer_without_speculation_and_prompt_lookup_for_ngram():
    """The n-gram proposer needs no model: the served model's parts are not even looked at."""
    def make(**settings):
        return make_proposer(EngineConfig(model="m", device="cpu", **settings), target=None, target_config=None,
                             tokenizer=None, max_model_len=64, kernels=None, device="cpu")

    assert make() is None
    proposer = make(speculative_ngram=3, num_speculative_tokens=5)
    assert isinstance(proposer, NgramProposer)
    assert (proposer.max_ngram, proposer.min_ngram, proposer.k) == (3, 2, 5)
    assert proposer.kv_block_bytes() == 0 and not proposer.reads_hidden_states  # no pool, no hidden states


def test_a_sequence_whose_drafts_keep_failing_backs_off_longer_each_time():
    proposer = NgramProposer(3, 4, min_ngram=2)
    seq = Sequence([1, 2, 3, 1, 2, 3, 1, 2], SamplingParams())
    assert proposer.propose_one(seq, 10) == [3, 1, 2]
    pauses = []
    for _ in range(3):
        proposer.record(seq, 4, 0)
        proposer.record(seq, 4, 0)
        skipped = 0
        while not proposer.propose_one(seq, 10):
            skipped += 1
        pauses.append(skipped)
    assert pauses == [2, 4, 8]
    proposer.record(seq, 4, 2)  # a hit resets the back-off
    proposer.record(seq, 4, 0)
    assert proposer.propose_one(seq, 10)


@pytest.mark.parametrize("model", ["cycle_model", "tiny_llama"])
def test_greedy_output_is_exactly_decoding_without_speculation(model, request):
    model_dir = request.getfixturevalue(model)
    rng = torch.Generator().manual_seed(0)
    prompts = [CYCLE_PROMPT, [7, 8, 9, 10] * 6, torch.randint(3, 500, (30,), generator=rng).tolist(),
               CYCLE[5:] + CYCLE + CYCLE[:5], [100, 200, 300] * 4]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = _llm(model_dir, False).generate(prompts, params, use_tqdm=False)
    spec = _llm(model_dir, True, num_kv_blocks=60)  # small pool and budget: chunking, preemption with drafts
    fast = spec.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    stats = spec.engine.stats().speculation
    assert stats.num_drafts > 0
    if model == "cycle_model":
        assert stats.num_accepted_tokens > 0.8 * stats.num_draft_tokens
        assert spec.engine.scheduler.num_preemptions > 0
    assert spec.engine.block_manager.num_used_blocks == 0


def test_the_prefix_cache_holds_only_verified_tokens(cycle_model):
    spec = _llm(cycle_model, True)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = spec.generate([CYCLE_PROMPT], params, use_tqdm=False)[0]
    assert spec.engine.stats().speculation.num_accepted_tokens > 0
    follow_up = CYCLE_PROMPT + first.token_ids  # its blocks were registered while drafts came and went
    again = spec.generate([follow_up], params, use_tqdm=False)[0]
    assert spec.engine.block_manager.prefix_hits > len(CYCLE_PROMPT)
    reference = _llm(cycle_model, False, enable_prefix_caching=False).generate([follow_up], params, use_tqdm=False)
    assert again.token_ids == reference[0].token_ids


def test_sampling_with_speculation_has_the_models_distribution(cycle_model):
    """Two-sample chi-square on the cycle run length (0..5) and on the third token, 800 samples each: drafts
    are accepted often (checked), yet the distributions must not differ (p > 0.001)."""
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    runs = {}
    for speculative in (False, True):
        llm = _llm(cycle_model, speculative, num_kv_blocks=2400, max_num_seqs=64, max_num_batched_tokens=512)
        torch.manual_seed(1)
        outs = llm.generate([CYCLE_PROMPT] * 800, params, use_tqdm=False)
        runs[speculative] = outs
        if speculative:
            stats = llm.engine.stats().speculation
            assert stats.num_accepted_tokens > 0.3 * stats.num_draft_tokens > 300
    for stat in (run_lengths, lambda outs: Counter(o.token_ids[2] if o.token_ids[2] in CYCLE else -1
                                                    for o in outs)):
        a, b = stat(runs[False]), stat(runs[True])
        stat_value, df = chi2(a, b)
        assert stat_value < CHI2_999[df], (dict(a), dict(b), stat_value)


def test_requests_whose_output_drafts_would_change_never_speculate(cycle_model):
    spec = _llm(cycle_model, True)
    for p in (SamplingParams(temperature=1.0, seed=3, max_tokens=20), SamplingParams(max_tokens=20, logprobs=1),
              SamplingParams(max_tokens=20, repetition_penalty=1.2), SamplingParams(max_tokens=20, min_tokens=20)):
        spec.generate([CYCLE_PROMPT], p, use_tqdm=False)
    assert spec.engine.stats().speculation.num_drafts == 0


def test_served_with_speculation_the_metrics_count_drafts(cycle_model):
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from server_harness import ServerThread

    srv = ServerThread(cycle_model, engine_kwargs={"speculative_ngram": 3, "block_size": 4}).start()
    try:
        body = {"prompt": CYCLE_PROMPT, "max_tokens": 30, "temperature": 0, "ignore_eos": True}
        out = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
        assert out["usage"]["completion_tokens"] == 30
        samples = {s.name: s.value for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)
                   for s in f.samples}
        assert samples["kubellm:spec_decode_num_drafts_total"] > 0
        assert 0 < samples["kubellm:spec_decode_num_accepted_tokens_total"] <= \
            samples["kubellm:spec_decode_num_draft_tokens_total"]
    finally:
        srv.stop()
