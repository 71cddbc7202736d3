"""Prompt-lookup speculative decoding: greedy output identical to decoding without it, sampled output with the
same distribution (tested statistically), drafts rolled back without corrupting the KV or prefix cache, and
back-off when drafts do not pay."""

from __future__ import annotations

import shutil
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

from kubellm.runtime.engine import LLM
from kubellm.runtime.sampling_params import SamplingParams
from kubellm.runtime.sequence import Sequence
from kubellm.runtime.speculative import NgramProposer, accept, find_ngram_continuation

CYCLE = list(range(10, 40))
CYCLE_PROMPT = CYCLE * 2 + CYCLE[:3]


@pytest.fixture(scope="module")
def cycle_model(tiny_llama, tmp_path_factory):
    """The tiny Llama made to continue a 30-token cycle (token t → the next on the cycle, p ≈ 0.7 at T=1):
    attention and MLP outputs scaled down to 5%, and lm_head rows pointed at the predecessor's embedding. Drafts
    copied from the history are then often right, while sampling stays random."""
    dst = tmp_path_factory.mktemp("cycle") / "m"
    shutil.copytree(tiny_llama, dst)
    w = load_file(str(dst / "model.safetensors"))
    for k in w:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            w[k] = w[k] * 0.05
        if k.endswith("norm.weight"):
            w[k] = torch.ones_like(w[k])
    lm = w["lm_head.weight"].clone()
    for i, t in enumerate(CYCLE):
        lm[CYCLE[(i + 1) % len(CYCLE)]] = 1.2 * w["model.embed_tokens.weight"][t]
    w["lm_head.weight"] = lm
    save_file(w, str(dst / "model.safetensors"))
    return dst


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


def test_a_sequence_whose_drafts_keep_failing_backs_off_longer_each_time():
    proposer = NgramProposer(3, 4, min_ngram=2)
    seq = Sequence([1, 2, 3, 1, 2, 3, 1, 2], SamplingParams())
    assert proposer.propose(seq, 10) == [3, 1, 2]
    pauses = []
    for _ in range(3):
        proposer.record(seq, 4, 0)
        proposer.record(seq, 4, 0)
        skipped = 0
        while not proposer.propose(seq, 10):
            skipped += 1
        pauses.append(skipped)
    assert pauses == [2, 4, 8]
    proposer.record(seq, 4, 2)  # a hit resets the back-off
    proposer.record(seq, 4, 0)
    assert proposer.propose(seq, 10)


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


def _run_lengths(outs) -> Counter:
    """How many output tokens in a row continue the cycle after the prompt (0..max_tokens)."""
    counts = Counter()
    for o in outs:
        expected, n = CYCLE_PROMPT[-1], 0
        for t in o.token_ids:
            expected = CYCLE[(CYCLE.index(expected) + 1) % len(CYCLE)] if expected in CYCLE else -1
            if t != expected:
                break
            n += 1
        counts[n] += 1
    return counts


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
    for stat in (_run_lengths, lambda outs: Counter(o.token_ids[2] if o.token_ids[2] in CYCLE else -1
                                                    for o in outs)):
        a, b = stat(runs[False]), stat(runs[True])
        chi2, df = _chi2(a, b)
        assert chi2 < _CHI2_999[df], (dict(a), dict(b), chi2)


def _chi2(a: Counter, b: Counter) -> tuple[float, int]:
    """Two-sample chi-square over the categories with at least 5 expected counts (the rest pooled)."""
    na, nb = sum(a.values()), sum(b.values())
    cats = sorted(set(a) | set(b), key=lambda c: -(a[c] + b[c]))
    big = [c for c in cats if (a[c] + b[c]) * min(na, nb) / (na + nb) >= 5]
    rows = [(a[c], b[c]) for c in big] + [(sum(a[c] for c in cats if c not in big),
                                          sum(b[c] for c in cats if c not in big))]
    rows = [r for r in rows if sum(r)]
    chi2 = 0.0
    for x, y in rows:
        ex, ey = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
        chi2 += (x - ex) ** 2 / ex + (y - ey) ** 2 / ey
    return chi2, len(rows) - 1


_CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88, 10: 29.59,
             11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70, 16: 39.25, 17: 40.79, 18: 42.31, 19: 43.82,
             20: 45.31, 21: 46.80, 22: 48.27, 23: 49.73, 24: 51.18, 25: 52.62, 26: 54.05, 27: 55.48, 28: 56.89,
             29: 58.30, 30: 59.70}  # chi-square quantiles at 0.999


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
