"""Engine behaviour around the model: stopping, streaming deltas, aborts, seeds, bad requests."""

from __future__ import annotations

import pytest

from kubellm.runtime.engine.llm_engine import LLM
from kubellm.runtime.engine.scheduler import RequestTooLong
from kubellm.runtime.sampling.params import SamplingParams

PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def llm(tiny_checkpoint_factory):
    return LLM(str(tiny_checkpoint_factory("llama")), progress=False, dtype="float32", block_size=4,
               num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=32)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def _drain(engine) -> dict[str, list]:
    """Step until idle; every RequestOutput per request id, in order."""
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


def test_max_tokens_ends_with_length(llm):
    out = llm.generate(PROMPT, greedy(max_tokens=7, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    assert llm.engine.block_manager.num_used_blocks == 0


def test_stop_token_id_stops_and_reports_it(llm):
    ref = llm.generate(PROMPT, greedy(max_tokens=10, ignore_eos=True), use_tqdm=False)[0].token_ids
    stop_id = ref[4]
    out = llm.generate(PROMPT, greedy(max_tokens=10, stop_token_ids=[stop_id], ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == ref[: ref.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_min_tokens_defers_stop_token_ids(llm):
    ref = llm.generate(PROMPT, greedy(max_tokens=12, ignore_eos=True), use_tqdm=False)[0].token_ids
    stop_id = ref[0]
    out = llm.generate(PROMPT, greedy(max_tokens=12, min_tokens=3, stop_token_ids=[stop_id], ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.token_ids) >= 3


def test_stop_string_truncates_text_and_streams_no_part_of_it(llm):
    full = llm.generate(PROMPT, greedy(max_tokens=16, ignore_eos=True), use_tqdm=False)[0].text
    stop = full[5:8]
    assert stop and stop not in full[:5]
    for include in (False, True):
        engine = llm.engine
        rid = engine.add_request(PROMPT, greedy(max_tokens=16, ignore_eos=True, stop=[stop],
                                                include_stop_str_in_output=include))
        outs = _drain(engine)[rid]
        final = outs[-1]
        expected = full[: full.index(stop) + (len(stop) if include else 0)]
        assert final.text == expected and final.finish_reason == "stop" and final.stop_reason == stop
        assert "".join(o.new_text for o in outs) == expected  # deltas never leak the stop string
        assert sum(len(o.new_token_ids) for o in outs) == len(final.token_ids)


def test_streamed_deltas_concatenate_to_the_final_text(llm):
    engine = llm.engine
    rid = engine.add_request(PROMPT, greedy(max_tokens=20, ignore_eos=True))
    outs = _drain(engine)[rid]
    assert "".join(o.new_text for o in outs) == outs[-1].text
    assert [t for o in outs for t in o.new_token_ids] == outs[-1].token_ids
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])


def test_abort_frees_blocks_and_reports_abort(llm):
    engine = llm.engine
    rid = engine.add_request(PROMPT, greedy(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    out = engine.abort_request(rid)
    assert out.finished and out.finish_reason == "abort"
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()
    assert engine.abort_request(rid) is None  # unknown or finished ids are ignored


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPT, params, use_tqdm=False)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batch = llm.generate(["Hello there", PROMPT, "Why not"], [others, params, others], use_tqdm=False)
    assert batch[1].token_ids == alone
    different = SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=12, ignore_eos=True)
    assert llm.generate(PROMPT, different, use_tqdm=False)[0].token_ids != alone


def test_requests_that_can_never_fit_are_refused_and_nothing_is_queued(llm):
    engine = llm.engine
    with pytest.raises(RequestTooLong, match="context length"):
        engine.add_request(list(range(3, 200)), greedy(max_tokens=4))
    with pytest.raises(RequestTooLong, match="max_tokens"):
        engine.add_request(list(range(3, 100)), greedy(max_tokens=100))
    with pytest.raises(RequestTooLong, match="empty"):
        engine.add_request([], greedy(max_tokens=4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([5, 10**6], greedy(max_tokens=4))
    assert not engine.has_unfinished_requests() and engine.scheduler.num_unfinished == 0


def test_duplicate_request_id_is_refused(llm):
    engine = llm.engine
    engine.add_request(PROMPT, greedy(max_tokens=2), request_id="dup")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(PROMPT, greedy(max_tokens=2), request_id="dup")
    _drain(engine)
