"""Speculative decoding with a draft model: greedy output identical to decoding without it whatever the draft,
sampled output with the model's distribution (the rejection rule, tested statistically, and shown able to fail),
the draft's own KV cache kept in step with accepted tokens, and refusal of a draft with another tokenizer."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from speculation_checks import CHI2_999, CYCLE, CYCLE_PROMPT, chi2, cycle_checkpoint, run_lengths

from kubellm.runtime.engine.config import EngineConfig
from kubellm.runtime.engine.llm_engine import LLM
from kubellm.runtime.engine.sequence import Sequence
from kubellm.runtime.sampling.params import SamplingParams
from kubellm.runtime.sampling.sampler import Sampler
from kubellm.runtime.spec_decode import verification
from kubellm.runtime.spec_decode.draft_model import DraftModelProposer, DraftVocabularyMismatch
from kubellm.runtime.spec_decode.proposer import SpeculationStats
from kubellm.runtime.spec_decode.verification import rejection_sample, sampling_probs


@pytest.fixture(scope="module")
def cycle_model(tiny_llama, tmp_path_factory):
    return cycle_checkpoint(tiny_llama, tmp_path_factory.mktemp("cycle") / "m", 1.2)  # p(next) ≈ 0.7 at T=1


@pytest.fixture(scope="module")
def sharp_cycle_draft(tiny_llama, tmp_path_factory):
    """A draft that is surer of the cycle than the model (q ≈ 0.95 where p ≈ 0.7): often accepted, not always."""
    return cycle_checkpoint(tiny_llama, tmp_path_factory.mktemp("sharp") / "m", 2.0)


@pytest.fixture(scope="module")
def other_random_draft(tiny_checkpoint_factory):
    """Another random tiny Llama with the same tokenizer: its drafts are almost never the model's choice."""
    return tiny_checkpoint_factory("llama", seed=7, num_hidden_layers=1)


def _llm(model, draft=None, **kw) -> LLM:
    args = dict(progress=False, dtype="float32", max_model_len=256, block_size=4, max_num_batched_tokens=64,
                max_num_seqs=8, num_kv_blocks=120)
    args.update(kw)
    return LLM(str(model), speculative_model=str(draft) if draft else None, num_speculative_tokens=4, **args)


@pytest.mark.parametrize("draft", ["same", "other"])
def test_greedy_output_is_decoding_without_speculation_whatever_the_draft(draft, tiny_llama, other_random_draft):
    rng = torch.Generator().manual_seed(0)
    prompts = [CYCLE_PROMPT, [7, 8, 9, 10] * 6, torch.randint(3, 500, (30,), generator=rng).tolist(),
               list(range(100, 170)), [100, 200, 300] * 4]  # the 70-token prompt: the draft catches up in chunks
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = _llm(tiny_llama).generate(prompts, params, use_tqdm=False)
    spec = _llm(tiny_llama, tiny_llama if draft == "same" else other_random_draft, num_kv_blocks=70,
                max_num_batched_tokens=48)  # a small pool and budget: chunked prefill and preemption with drafts
    fast = spec.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    stats = spec.engine.stats().speculation
    assert stats.num_drafts > 0
    if draft == "same":
        assert stats.num_accepted_tokens > 0.95 * stats.num_draft_tokens
        assert spec.engine.scheduler.num_preemptions > 0
    else:
        assert stats.num_accepted_tokens < 0.2 * stats.num_draft_tokens
        assert stats.num_drafts < 0.5 * sum(len(o.token_ids) for o in plain)  # it backed off
    assert spec.engine.block_manager.num_used_blocks == 0
    assert isinstance(spec.engine.speculator.proposer, DraftModelProposer)
    assert spec.engine.speculator.proposer.block_manager.num_used_blocks == 0  # the draft's pool too


def test_the_drafts_prefix_cache_holds_only_verified_tokens(cycle_model, sharp_cycle_draft):
    """Sampling makes drafts come and go; every block the draft's cache registered must hold tokens the sequence
    really has at that place, and a follow-up request reuses them."""
    spec = _llm(cycle_model, sharp_cycle_draft)
    torch.manual_seed(0)
    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    first = spec.generate([CYCLE_PROMPT], params, use_tqdm=False)[0]
    stats = spec.engine.stats().speculation
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # some drafts were rolled back
    final = CYCLE_PROMPT + first.token_ids
    bm = spec.engine.speculator.proposer.block_manager
    chunks = {tuple(final[i : i + 4]) for i in range(0, len(final) - 3, 4)}
    registered = [bm.blocks[b].token_ids for b in bm.hash_to_block.values()]
    assert len(registered) >= len(CYCLE_PROMPT) // 4
    assert all(tokens in chunks for tokens in registered)
    spec.generate([final], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert bm.prefix_hits >= len(final) // 4 * 4 - 4


def test_a_draft_with_another_tokenizer_is_refused_at_start_up(tiny_llama, tiny_checkpoint_factory):
    other = tiny_checkpoint_factory("llama", vocab_size=300)
    with pytest.raises(DraftVocabularyMismatch, match="tokenizer differs from the served model's"):
        _llm(tiny_llama, other)


def test_ngram_and_draft_model_speculation_are_exclusive():
    with pytest.raises(ValueError, match="--speculative-ngram or --speculative-model, not both"):
        EngineConfig(model="m", speculative_ngram=3, speculative_model="draft")


def test_a_draft_model_with_tensor_parallelism_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="--speculative-model with --tensor-parallel-size > 1 is not supported"):
        EngineConfig(model="m", device="cpu", speculative_model="draft", tensor_parallel_size=2)


# ---- the rejection rule ------------------------------------------------------------------------------------
P = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
Q = torch.tensor([0.1, 0.5, 0.05, 0.05, 0.1, 0.2])


def _residual_from_p(p, q, drafts, generator=None):
    """A broken rule (the mutation the test must catch): corrections drawn from p instead of max(0, p - q)."""
    rows = torch.arange(p.shape[0])
    accepted = torch.rand(p.shape[0], generator=generator) * q[rows, drafts] < p[rows, drafts]
    return torch.where(accepted, drafts, torch.multinomial(p, 1, generator=generator).squeeze(1))


def _goodness_of_fit(rule, n: int = 20000) -> float:
    """Chi-square of the rule's output tokens (drafts drawn from Q) against P, df = 4 (the zero cell must stay
    empty: asserted)."""
    g = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(Q.expand(n, -1), 1, replacement=True, generator=g).squeeze(1)
    out = rule(P.expand(n, -1).contiguous(), Q.expand(n, -1).contiguous(), drafts, generator=g)
    counts = torch.bincount(out, minlength=len(P)).float()
    assert counts[5] == 0
    expected = P[:5] * n
    return float(((counts[:5] - expected) ** 2 / expected).sum())


def test_the_rejection_rule_outputs_p_whatever_q_proposes():
    assert _goodness_of_fit(rejection_sample) < CHI2_999[4]


def test_the_goodness_of_fit_check_catches_a_wrongly_sampled_residual():
    assert _goodness_of_fit(_residual_from_p) > 10 * CHI2_999[4]


@pytest.mark.parametrize("params", [
    dict(temperature=0.7), dict(top_k=3), dict(top_p=0.6), dict(min_p=0.2, temperature=1.3),
    dict(top_k=4, top_p=0.8, temperature=0.5), dict(top_k=5),  # top_k=5 cuts inside a tie: both tied stay
])
def test_draft_distributions_are_what_the_sampler_draws_from(params):
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.5, 0.5, -1.0, -3.0]])
    probs = sampling_probs(logits, [SamplingParams(**params)])[0]
    torch.manual_seed(0)
    n = 8000
    seq = Sequence([1], SamplingParams(**params))
    drawn = Sampler(()).sample(logits.expand(n, -1).contiguous(), [seq] * n)[0]
    counts = torch.bincount(drawn, minlength=8).float()
    assert torch.equal(counts > 0, probs > 0)  # the same support, ties included
    keep = probs > 0
    stat = float(((counts[keep] - probs[keep] * n) ** 2 / (probs[keep] * n)).sum())
    assert stat < CHI2_999[int(keep.sum()) - 1], (counts, probs * n)


# ---- end to end, sampled -----------------------------------------------------------------------------------
def _sampled_runs(cycle_model, draft) -> tuple[list, list, SpeculationStats]:
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    kw = dict(num_kv_blocks=2400, max_num_seqs=64, max_num_batched_tokens=512)
    outs = []
    for d in (None, draft):
        llm = _llm(cycle_model, d, **kw)
        torch.manual_seed(1)
        outs.append(llm.generate([CYCLE_PROMPT] * 800, params, use_tqdm=False))
    return outs[0], outs[1], llm.engine.stats().speculation


def _largest_chi2_ratio(plain, spec) -> float:
    """The larger, over the cycle run length and the third token, of chi-square / its 0.999 quantile."""
    worst = 0.0
    for stat in (run_lengths, lambda outs: Counter(o.token_ids[2] if o.token_ids[2] in CYCLE else -1 for o in outs)):
        value, df = chi2(stat(plain), stat(spec))
        worst = max(worst, value / CHI2_999[df])
    return worst


def test_sampling_with_a_draft_model_has_the_models_distribution(cycle_model, sharp_cycle_draft):
    plain, spec, stats = _sampled_runs(cycle_model, sharp_cycle_draft)
    assert 0.4 * stats.num_draft_tokens < stats.num_accepted_tokens < 0.95 * stats.num_draft_tokens
    assert _largest_chi2_ratio(plain, spec) < 1


def test_the_end_to_end_check_catches_a_wrongly_sampled_residual(cycle_model, sharp_cycle_draft, monkeypatch):
    monkeypatch.setattr(verification, "rejection_sample", _residual_from_p)
    plain, spec, _ = _sampled_runs(cycle_model, sharp_cycle_draft)
    assert _largest_chi2_ratio(plain, spec) > 1
