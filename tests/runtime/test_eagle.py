"""Speculative decoding with an EAGLE-1 head: greedy output identical to decoding without it whatever the head
(through chunked prefill, preemption and prefix-cache hits), the head's KV cache kept exactly in step with the
served model's (its drafts depend on the token history only), sampled output with the model's distribution,
and heads that do not fit refused at start-up with what differs."""

from __future__ import annotations

import pytest
import torch
from speculation_checks import CYCLE, CYCLE_PROMPT, cycle_checkpoint, eagle_head
from test_draft_model import _largest_chi2_ratio

from kubellm.runtime.engine.config import EngineConfig
from kubellm.runtime.engine.llm_engine import LLM
from kubellm.runtime.sampling.params import SamplingParams
from kubellm.runtime.spec_decode.eagle import EagleHeadError, EagleProposer


@pytest.fixture(scope="module")
def cycle_model(tiny_llama, tmp_path_factory):
    return cycle_checkpoint(tiny_llama, tmp_path_factory.mktemp("eagle-cycle") / "m", 1.2)


@pytest.fixture(scope="module")
def echo_head(cycle_model, tmp_path_factory):
    """Drafts the cycle, surer of it than the model (q ≈ 0.9 where p ≈ 0.7): often accepted, not always."""
    return eagle_head(cycle_model, tmp_path_factory.mktemp("echo") / "h", echo=1.7)


@pytest.fixture(scope="module")
def random_head(cycle_model, tmp_path_factory):
    return eagle_head(cycle_model, tmp_path_factory.mktemp("random") / "h", seed=3, fmt="bin")


def _llm(model, head=None, **kw) -> LLM:
    args = dict(progress=False, dtype="float32", max_model_len=256, block_size=4, max_num_batched_tokens=64,
                max_num_seqs=8, num_kv_blocks=120)
    args.update(kw)
    if head is not None:
        args.update(speculative_model=str(head), speculative_method="eagle")
    return LLM(str(model), num_speculative_tokens=4, **args)


def _prompts() -> list[list[int]]:
    rng = torch.Generator().manual_seed(0)
    return [CYCLE_PROMPT, [7, 8, 9, 10] * 6, torch.randint(3, 500, (30,), generator=rng).tolist(),
            list(range(100, 170)), CYCLE[5:] + CYCLE * 2]  # the 70-token prompt is prefilled in chunks


@pytest.mark.parametrize("which", ["echo", "random"])
def test_greedy_output_is_decoding_without_speculation_whatever_the_head(which, cycle_model, echo_head,
                                                                           random_head):
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = _llm(cycle_model).generate(prompts, params, use_tqdm=False)
    # A small pool and budget: chunked prefill and preemption with drafts; the second round hits the prefix cache.
    spec = _llm(cycle_model, echo_head if which == "echo" else random_head, num_kv_blocks=70,
                max_num_batched_tokens=48)
    for _ in range(2):
        fast = spec.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    engine = spec.engine
    stats = engine.stats().speculation
    assert stats.num_drafts > 0
    assert engine.block_manager.prefix_hits > 0 and engine.scheduler.num_preemptions > 0
    assert isinstance(engine.speculator.proposer, EagleProposer) and engine.block_manager.recompute_last_hit_block
    if which == "echo":
        assert stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens
    else:
        assert stats.num_accepted_tokens < 0.2 * stats.num_draft_tokens
    assert engine.block_manager.num_used_blocks == 0


def _drafts_by_history(llm: LLM, prompts, params, run: int = 0) -> dict[tuple[int, int], list[int]]:
    """Every draft the head made, keyed by (prompt index, sequence length when drafted); back-off off so it
    drafts at every step."""
    proposer = llm.engine.speculator.proposer
    proposer.backoff.give_up_after = 10**9
    seen: dict[tuple[int, int], list[int]] = {}
    propose = proposer.propose

    def recording(seqs, rooms):
        drafts = propose(seqs, rooms)
        for seq, d in zip(seqs, drafts, strict=True):
            if d.tokens:
                seen[(int(seq.request_id.split("-")[1]), len(seq))] = d.tokens
        return drafts

    proposer.propose = recording
    for rid, p in enumerate(prompts):
        llm.engine.add_request(p, params, request_id=f"{run}-{rid}")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    return seen


def test_the_heads_drafts_depend_on_the_token_history_only(cycle_model, random_head):
    """Were a pair of the head's K/V stale or missing after a chunked prefill, a preemption or a prefix hit,
    the drafts at that point would differ from those of a run that computed everything in one go."""
    shared = list(range(200, 212))  # three whole blocks, then prompts that differ right after them
    prompts = _prompts() + [shared + [300 + 7 * i + j for j in range(5)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = _drafts_by_history(_llm(cycle_model, random_head, num_kv_blocks=400, max_num_batched_tokens=256,
                                    enable_prefix_caching=False), prompts, params)
    tight = _llm(cycle_model, random_head, num_kv_blocks=60, max_num_batched_tokens=24)
    _drafts_by_history(tight, prompts, params)  # fills the prefix cache
    again = _drafts_by_history(tight, prompts, params, run=1)
    assert tight.engine.scheduler.num_preemptions > 0 and tight.engine.block_manager.prefix_hits > 0
    common = roomy.keys() & again.keys()
    assert len(common) > 0.8 * len(roomy)
    assert {k: again[k] for k in common} == {k: roomy[k] for k in common}


def test_sampling_with_an_eagle_head_has_the_models_distribution(cycle_model, echo_head):
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    kw = dict(num_kv_blocks=2400, max_num_seqs=64, max_num_batched_tokens=512)
    outs = []
    for head in (None, echo_head):
        llm = _llm(cycle_model, head, **kw)
        torch.manual_seed(1)
        outs.append(llm.generate([CYCLE_PROMPT] * 800, params, use_tqdm=False))
    stats = llm.engine.stats().speculation  # drafts accepted and rejected alike (a chain of 4 accepts less)
    assert 0.25 * stats.num_draft_tokens < stats.num_accepted_tokens < 0.9 * stats.num_draft_tokens
    assert _largest_chi2_ratio(outs[0], outs[1]) < 1


# ---- heads that do not fit ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(fc_shape=(64, 64)), r"fc.weight has shape \[64, 64\], an EAGLE head for hidden size 64 needs \[64, 128\]"),
    (dict(hidden_size=32), "the head's hidden_size is 32 but the served model's is 64"),
    (dict(vocab_size=600), "the head's vocab_size is 600 but the served model's is 512"),
    (dict(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=128), "EAGLE-3 head"),
])
def test_a_head_that_does_not_fit_is_refused_at_start_up(kwargs, message, cycle_model, tmp_path):
    head = eagle_head(cycle_model, tmp_path / "h", fc_shape=kwargs.pop("fc_shape", None), **kwargs)
    with pytest.raises(EagleHeadError, match=message):
        _llm(cycle_model, head)


def test_a_head_with_a_wrongly_shaped_layer_is_refused_with_the_tensors_name(cycle_model, tmp_path):
    head = eagle_head(cycle_model, tmp_path / "h", intermediate_size=96)  # the config says 96, the tensors 128
    with pytest.raises(EagleHeadError, match=r"tensor 'layers.0.mlp.\w+_proj.weight' has shape"):
        _llm(cycle_model, head)


def test_eagle_needs_a_head():
    with pytest.raises(ValueError, match="--speculative-method eagle needs --speculative-model PATH"):
        EngineConfig(model="m", speculative_method="eagle")


def test_drafts_stop_at_the_context_length(cycle_model, echo_head):
    """Chained drafts near max_model_len would run past the rotary table: each row drafts only its room."""
    prompt = (CYCLE * 9)[:240]
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    plain = _llm(cycle_model).generate([prompt], params, use_tqdm=False)[0]
    spec = _llm(cycle_model, echo_head)
    fast = spec.generate([prompt], params, use_tqdm=False)[0]
    assert fast.token_ids == plain.token_ids and len(fast.token_ids) == 256 - 240
    assert spec.engine.stats().speculation.num_accepted_tokens > 0
