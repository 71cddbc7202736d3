"""Scheduler: token budget, running-first then FCFS admission, chunked prefill, preemption, limits.

No model: a test plays the engine. It calls ``schedule()``, picks the "sampled" token for every
entry whose ``samples`` is true, hands them to ``postprocess()`` and finishes sequences that reached
``max_tokens`` with ``finish()``, exactly as ``LLMEngine.step`` does.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kubellm.runtime.engine.block_manager import BlockManager
from kubellm.runtime.engine.scheduler import RequestTooLong, ScheduledSeq, Scheduler
from kubellm.runtime.engine.sequence import FinishReason, Sequence, SequenceStatus
from kubellm.runtime.sampling.params import SamplingParams


def make_sched(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 16,
    max_model_len: int = 64,
    prefix_caching: bool = True,
    chunked: bool = True,
) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(bm, max_num_seqs, max_num_batched_tokens, max_model_len, enable_chunked_prefill=chunked)


def make_seq(prompt_len: int | list[int], max_tokens: int | None = 4, first: int = 0) -> Sequence:
    tokens = list(range(first, first + prompt_len)) if isinstance(prompt_len, int) else list(prompt_len)
    return Sequence(tokens, SamplingParams(max_tokens=max_tokens))


_token = itertools.count(1000)


class Entry(NamedTuple):
    """A ScheduledSeq as it was at schedule time (``samples`` depends on num_computed_tokens)."""

    seq: Sequence
    num_tokens: int
    samples: bool


def step(sched: Scheduler, check: bool = True, shadow: dict | None = None) -> list[Entry]:
    """One engine step: schedule, 'run the model', postprocess, finish what hit max_tokens.

    With ``shadow`` (block id -> slot -> token prefix its K/V were computed from) the "model" also
    checks that it reads correct K/V for every computed position and writes only unshared blocks.
    """
    batch = sched.schedule()
    if check:
        check_batch(sched, batch)
    if shadow is not None:
        simulate_kv(sched.block_manager, batch, shadow)
    entries = [(s.seq, s.num_tokens, s.seq.num_computed_tokens, s.samples) for s in batch]
    snapshot = [Entry(s.seq, s.num_tokens, s.samples) for s in batch]
    sampled = [next(_token) for s in batch if s.samples]
    updated = sched.postprocess(batch, sampled)
    assert updated == [seq for seq, _, _, samples in entries if samples]
    for seq, n, before, _ in entries:
        assert seq.num_computed_tokens == before + n
    for seq in updated:
        if seq.num_output_tokens >= seq.sampling_params.max_tokens:
            sched.finish(seq, FinishReason.LENGTH)
    return snapshot


def check_batch(sched: Scheduler, batch: list[ScheduledSeq]) -> None:
    bm = sched.block_manager
    assert sum(s.num_tokens for s in batch) <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    assert len({id(s.seq) for s in batch}) == len(batch), "a sequence scheduled twice in one step"
    running_ids = {id(s) for s in sched.running}
    for s in batch:
        seq = s.seq
        assert id(seq) in running_ids and seq.status == SequenceStatus.RUNNING
        assert 1 <= s.num_tokens <= len(seq) - seq.num_computed_tokens
        assert len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens + s.num_tokens)
    for seq in sched.waiting:
        assert seq.status == SequenceStatus.WAITING and seq.block_table == []
    counts = [0] * bm.num_blocks
    for seq in sched.running:
        for b in seq.block_table:
            counts[b] += 1
    assert [b.ref_count for b in bm.blocks] == counts
    assert set(bm.free) == {b.block_id for b in bm.blocks if b.ref_count == 0}


def simulate_kv(bm: BlockManager, batch: list[ScheduledSeq], shadow: dict) -> None:
    bs = bm.block_size
    for s in batch:
        seq = s.seq
        for p in range(seq.num_computed_tokens):  # attention reads these: cached or computed earlier
            slot = shadow.get(seq.block_table[p // bs], {}).get(p % bs)
            assert slot == tuple(seq.token_ids[: p + 1]), f"wrong K/V at position {p} of seq {seq.seq_id}"
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + s.num_tokens):
            b = seq.block_table[p // bs]
            assert bm.blocks[b].ref_count == 1, f"seq {seq.seq_id} writes into shared block {b}"
            shadow.setdefault(b, {})[p % bs] = tuple(seq.token_ids[: p + 1])


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[list[Entry]]:
    steps = []
    while sched.num_unfinished:
        assert len(steps) < max_steps, "the scheduler stopped making progress"
        steps.append(step(sched))
    return steps


# =============================================================================================
# Token budget and ordering
# =============================================================================================


@settings(max_examples=300, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    extra_blocks=st.integers(0, 8),
    max_num_seqs=st.integers(1, 5),
    budget=st.integers(1, 24),
    prefix_caching=st.booleans(),
    requests=st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 14), st.integers(1, 6), st.integers(0, 8)),
        min_size=1,
        max_size=8,
    ),
)
def test_random_workloads_respect_budget_and_max_num_seqs_and_finish_with_zero_used_blocks(
    block_size, extra_blocks, max_num_seqs, budget, prefix_caching, requests
):
    max_model_len = 20
    num_blocks = -(-max_model_len // block_size) + extra_blocks  # small pools: preemption is common
    sched = make_sched(num_blocks, block_size, max_num_seqs, budget, max_model_len, prefix_caching)
    shadow: dict[int, dict[int, tuple[int, ...]]] = {}
    bases = [[5] * 14, list(range(14)), [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 1, 2, 3, 4]]
    seqs = []
    for base, plen, max_tokens, add_at_step in requests:
        seqs.append((add_at_step, Sequence(bases[base][:plen], SamplingParams(max_tokens=max_tokens))))
    accepted = []
    for n in itertools.count():
        for at, seq in seqs:
            if at == n:
                try:
                    sched.add(seq)
                    accepted.append(seq)
                except RequestTooLong:
                    assert seq not in sched.waiting
        if n > 8 and not sched.num_unfinished:
            break
        assert n < 2000, "no progress"
        step(sched, shadow=shadow)
    for seq in accepted:
        assert seq.is_finished and seq.finish_reason == FinishReason.LENGTH
        assert seq.num_output_tokens == seq.sampling_params.max_tokens
        assert seq.block_table == []
    assert sched.block_manager.num_used_blocks == 0
    assert not sched.running and not sched.waiting
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"prefix hits: {sched.block_manager.prefix_hits > 0}")
    event(f"accepted: {len(accepted)}")


def test_step_never_schedules_more_than_max_num_batched_tokens():
    sched = make_sched(max_num_batched_tokens=10)
    for i, plen in enumerate((7, 7, 7, 3)):
        sched.add(make_seq(plen, max_tokens=5, first=100 * i))  # no shared prefixes
    totals = [sum(s.num_tokens for s in b) for b in run_to_completion(sched)]
    assert max(totals) == 10
    assert all(t <= 10 for t in totals)
    assert sum(totals) == 4 * 5 - 4 + 7 + 7 + 7 + 3  # every prompt token + every non-final output once


def test_running_decodes_are_scheduled_before_new_prefills():
    sched = make_sched(max_num_batched_tokens=6)
    a, b = make_seq(3, max_tokens=8), make_seq(3, max_tokens=8)
    sched.add(a)
    sched.add(b)
    step(sched)  # a: 3-token prefill, b: 3-token prefill
    late = make_seq(10, max_tokens=2, first=100)
    sched.add(late)
    batch = step(sched)
    # Both decodes first (oldest first), then the new prompt gets what is left of the budget.
    assert [(s.seq, s.num_tokens) for s in batch] == [(a, 1), (b, 1), (late, 4)]
    assert not batch[2].samples


def test_a_full_budget_of_running_work_admits_nothing_new():
    sched = make_sched(max_num_batched_tokens=4)
    a = make_seq(12, max_tokens=2)
    sched.add(a)
    step(sched)
    b = make_seq(2, first=50)
    sched.add(b)
    batch = step(sched)
    assert [(s.seq, s.num_tokens) for s in batch] == [(a, 4)]
    assert list(sched.waiting) == [b]


def test_max_num_seqs_caps_running():
    sched = make_sched(max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [make_seq(3, max_tokens=3, first=10 * i) for i in range(5)]
    for s in seqs:
        sched.add(s)
    batch = step(sched)
    assert [s.seq for s in batch] == seqs[:2]
    assert sched.running == seqs[:2] and list(sched.waiting) == seqs[2:]
    for b in run_to_completion(sched):
        assert len(b) <= 2
    assert all(s.is_finished for s in seqs)


# =============================================================================================
# Chunked prefill
# =============================================================================================


def test_chunked_prefill_splits_a_long_prompt_and_only_the_last_chunk_samples():
    sched = make_sched(max_num_batched_tokens=4)
    seq = make_seq(10, max_tokens=2)
    sched.add(seq)
    chunks = []
    for _ in range(3):
        (entry,) = sched.schedule()
        chunks.append((entry.num_tokens, seq.num_computed_tokens, entry.samples))
        sched.postprocess([entry], [7] if entry.samples else [])
    assert chunks == [(4, 0, False), (4, 4, False), (2, 8, True)]
    assert seq.num_computed_tokens == 10
    assert seq.token_ids[-1] == 7 and seq.num_output_tokens == 1
    (entry,) = sched.schedule()  # decode
    assert (entry.num_tokens, entry.samples) == (1, True)


def test_chunked_prefill_mixes_a_prefill_chunk_with_decodes_in_one_step():
    sched = make_sched(max_num_batched_tokens=5)
    a, b = make_seq(2, max_tokens=10), make_seq(2, max_tokens=10, first=20)
    sched.add(a)
    sched.add(b)
    step(sched)
    long = make_seq(11, max_tokens=1, first=40)
    sched.add(long)
    seen = []
    while not long.is_finished:
        batch = step(sched)
        seen.append([(s.seq, s.num_tokens, s.samples) for s in batch])
    assert seen == [
        [(a, 1, True), (b, 1, True), (long, 3, False)],
        [(a, 1, True), (b, 1, True), (long, 3, False)],
        [(a, 1, True), (b, 1, True), (long, 3, False)],
        [(a, 1, True), (b, 1, True), (long, 2, True)],
    ]


def test_chunked_prefill_off_admits_whole_prompts_only():
    sched = make_sched(max_num_batched_tokens=8, chunked=False)
    a = make_seq(6, max_tokens=3)
    b = make_seq(5, max_tokens=3, first=30)
    sched.add(a)
    sched.add(b)
    batch = step(sched)
    assert [(s.seq, s.num_tokens) for s in batch] == [(a, 6)]  # b does not fit the 2 left
    batch = step(sched)
    assert [(s.seq, s.num_tokens) for s in batch] == [(a, 1), (b, 5)]
    run_to_completion(sched)
    assert sched.block_manager.num_used_blocks == 0


def test_chunked_prefill_off_a_preempted_sequence_longer_than_the_budget_is_still_recomputed():
    sched = make_sched(num_blocks=4, block_size=4, max_num_batched_tokens=8, max_model_len=32, chunked=False)
    a = make_seq(1, max_tokens=15)  # 16 tokens at most = the whole 4-block cache
    b = make_seq(6, max_tokens=10, first=50)  # prompt 6 <= budget 8: accepted
    sched.add(a)
    sched.add(b)
    c = make_seq(2, max_tokens=1, first=90)
    for _ in range(200):
        if not sched.num_unfinished:
            break
        step(sched)
        if b.num_preemptions and c.status != SequenceStatus.FINISHED and c not in sched.waiting:
            sched.add(c)  # a later, tiny request queues up behind b
    assert b.num_preemptions >= 1
    assert a.is_finished
    assert b.is_finished and c.is_finished, (
        f"b is stuck in waiting with {len(b)} tokens > budget 8, c behind it"
    )


# =============================================================================================
# Preemption
# =============================================================================================


def test_when_blocks_run_out_the_newest_running_sequence_is_preempted_to_the_front_of_waiting():
    sched = make_sched(num_blocks=4, block_size=2, max_num_batched_tokens=16, max_model_len=16)
    old, new = make_seq(3, max_tokens=4), make_seq(3, max_tokens=4, first=10)
    sched.add(old)
    sched.add(new)
    step(sched)  # both prefilled: 2 blocks each, cache full
    step(sched)  # both decode into their second block
    assert sched.block_manager.num_free_blocks == 0
    later = make_seq(1, max_tokens=1, first=90)
    sched.add(later)
    new_blocks = list(new.block_table)

    batch = sched.schedule()  # old needs a third block: new is preempted
    assert [(s.seq, s.num_tokens) for s in batch] == [(old, 1)]
    assert sched.running == [old]
    assert list(sched.waiting) == [new, later]  # front of the queue, ahead of the later arrival
    assert new.status == SequenceStatus.WAITING
    assert new.block_table == [] and new.num_computed_tokens == 0
    assert new.num_preemptions == 1 and sched.num_preemptions == 1
    for b in new_blocks:  # freed; old may have taken one of them for its new block
        assert sched.block_manager.blocks[b].ref_count == (1 if b in old.block_table else 0)
    assert sched.block_manager.num_free_blocks == 1
    sched.postprocess(batch, [1])

    run_to_completion(sched)
    for seq in (old, new, later):
        assert seq.is_finished and seq.num_output_tokens == seq.sampling_params.max_tokens
    assert sched.block_manager.num_used_blocks == 0


def test_nothing_is_admitted_in_a_step_that_had_to_preempt_even_if_the_victim_would_fit_again():
    sched = make_sched(
        num_blocks=5, block_size=2, max_num_batched_tokens=3, max_model_len=16, prefix_caching=False
    )
    old, new = make_seq(2, max_tokens=6), make_seq(5, max_tokens=2, first=10)
    sched.add(old)
    sched.add(new)
    for _ in range(3):
        step(sched)
    assert sched.block_manager.num_free_blocks == 0 and len(new.block_table) == 3
    batch = step(sched)  # old needs a block: new (3 blocks) is preempted, 2 blocks and 2 tokens are left
    assert [(s.seq, s.num_tokens) for s in batch] == [(old, 1)]
    assert sched.block_manager.num_free_blocks == 2
    assert list(sched.waiting) == [new]
    batch = step(sched)  # the next step admits it again
    assert [s.seq for s in batch] == [old, new]
    run_to_completion(sched)
    assert old.is_finished and new.is_finished


def test_preemption_frees_newest_first_and_keeps_the_oldest_running():
    sched = make_sched(num_blocks=6, block_size=2, max_num_batched_tokens=32, max_model_len=16)
    s1, s2, s3 = (make_seq(3, max_tokens=6, first=10 * i) for i in range(3))
    for s in (s1, s2, s3):
        sched.add(s)
    step(sched)
    step(sched)  # all three hold 2 blocks each, cache full
    batch = sched.schedule()
    # s1 needs a block: s3 (newest) goes; then s2 needs one too and takes one of s3's freed blocks.
    assert [s.seq for s in batch] == [s1, s2]
    assert sched.running == [s1, s2] and list(sched.waiting) == [s3]
    assert s3.num_preemptions == 1 and s1.num_preemptions == s2.num_preemptions == 0
    sched.postprocess(batch, [1, 2])
    run_to_completion(sched)
    assert all(s.is_finished for s in (s1, s2, s3))
    assert s1.num_preemptions == 0
    assert sched.block_manager.num_used_blocks == 0


def test_preempted_sequences_return_in_their_original_order():
    sched = make_sched(num_blocks=6, block_size=2, max_num_batched_tokens=32, max_model_len=16)
    s1, s2, s3 = (make_seq(3, max_tokens=6, first=10 * i) for i in range(3))
    for s in (s1, s2, s3):
        sched.add(s)
    step(sched)
    step(sched)
    # Make s1 need two more blocks at once: its recompute-free chunk is blocked by s2 and s3.
    s1.token_ids.extend([77, 77])
    batch = sched.schedule()
    assert [s.seq for s in batch] == [s1]
    assert list(sched.waiting) == [s2, s3]
    assert sched.num_preemptions == 2


def test_a_tiny_pool_with_heavy_preemption_still_completes_every_request():
    sched = make_sched(num_blocks=5, block_size=2, max_num_seqs=4, max_num_batched_tokens=6, max_model_len=10)
    seqs = [make_seq([1, 2, 3, i], max_tokens=6) for i in range(6)]  # 10 tokens = the whole cache
    for s in seqs:
        sched.add(s)
    run_to_completion(sched)
    assert sched.num_preemptions > 0
    assert all(s.is_finished and s.num_output_tokens == 6 for s in seqs)
    assert sched.block_manager.num_used_blocks == 0


def test_preempted_sequence_reuses_its_computed_prefix_from_the_cache():
    sched = make_sched(num_blocks=6, block_size=2, max_num_batched_tokens=16, max_model_len=16)
    old = make_seq(3, max_tokens=3)  # at most 6 tokens: 3 blocks
    new = make_seq(7, max_tokens=4, first=10)  # at most 11 tokens: 6 blocks
    sched.add(old)
    sched.add(new)
    step(sched)
    step(sched)  # 2 + 4 blocks: the cache is full; new's 4 blocks are all full and registered
    new_blocks = list(new.block_table)
    batch = step(sched)  # old needs a third block: new is preempted (old then finishes)
    assert [s.seq for s in batch] == [old] and new.num_preemptions == 1 and old.is_finished
    assert len(new) == 9
    batch = step(sched)
    # Recompute: the 3 cached blocks that survived come back, old took (evicted) the 4th.
    assert new.num_cached_tokens == 6 and new.block_table[:3] == new_blocks[:3]
    assert [(s.seq, s.num_tokens) for s in batch] == [(new, 3)]
    run_to_completion(sched)
    assert new.is_finished and new.num_output_tokens == 4
    assert sched.block_manager.num_used_blocks == 0


# =============================================================================================
# Requests that can never fit
# =============================================================================================


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "kwargs", "match"),
    [
        (0, 4, {}, "prompt is empty"),
        (32, 1, {}, "context length is 32"),
        (40, 1, {}, "shorten the prompt to at most 31 tokens"),
        (30, 3, {}, r"lower max_tokens to at most 2"),
        (10, 30, {}, r"prompt \(10 tokens\) \+ max_tokens \(30\) = 40 exceeds the context length 32"),
        (10, 10, {"num_blocks": 4}, r"needs up to 5 KV blocks \(20 tokens\) but the cache holds 4"),
        (10, None, {"num_blocks": 7}, r"needs up to 8 KV blocks \(32 tokens\)"),
        (20, 2, {"chunked": False}, "chunked prefill is off"),
    ],
    ids=[
        "empty-prompt",
        "prompt-equals-context-length",
        "prompt-over-context-length",
        "prompt-plus-max-tokens-over-context-length",
        "prompt-plus-max-tokens-message",
        "more-blocks-than-the-whole-cache",
        "max-tokens-none-needs-context-length-worth-of-blocks",
        "prompt-over-budget-without-chunked-prefill",
    ],
)
def test_requests_that_can_never_fit_raise_request_too_long_and_are_not_queued(
    prompt_len, max_tokens, kwargs, match
):
    params = {"num_blocks": 64, "block_size": 4, "max_num_batched_tokens": 16, "max_model_len": 32} | kwargs
    sched = make_sched(**params)
    seq = make_seq(prompt_len, max_tokens=max_tokens)
    with pytest.raises(RequestTooLong, match=match):
        sched.check_fits(seq)
    with pytest.raises(RequestTooLong, match=match):
        sched.add(seq)
    assert not sched.waiting and not sched.running
    assert issubclass(RequestTooLong, ValueError)
    assert sched.schedule() == []


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "kwargs"),
    [
        (1, 1, {}),
        (31, 1, {}),  # the longest prompt: one token of room
        (16, 16, {}),  # prompt + max_tokens == context length
        (10, 10, {"num_blocks": 5}),  # needs exactly the whole cache
        (31, None, {"num_blocks": 8}),  # until the context length: 32 tokens = 8 blocks
        (16, 2, {"chunked": False}),  # prompt == max_num_batched_tokens
    ],
    ids=["tiny", "longest-prompt", "fills-context", "fills-cache", "max-tokens-none", "whole-prompt-budget"],
)
def test_requests_at_the_limits_are_accepted_and_complete(prompt_len, max_tokens, kwargs):
    params = {"num_blocks": 64, "block_size": 4, "max_num_batched_tokens": 16, "max_model_len": 32} | kwargs
    sched = make_sched(**params)
    seq = make_seq(prompt_len, max_tokens=max_tokens)  # None: until the context length
    sched.check_fits(seq)
    sched.add(seq)
    assert list(sched.waiting) == [seq]
    # The test's engine loop stops at max_tokens; the real engine stops at max_model_len for None.
    seq.sampling_params.max_tokens = max_tokens or 32 - prompt_len
    run_to_completion(sched)
    assert seq.is_finished and len(seq) == prompt_len + seq.sampling_params.max_tokens
    assert sched.block_manager.num_used_blocks == 0


# =============================================================================================
# FCFS admission
# =============================================================================================


def test_fcfs_admission_order_equals_arrival_order():
    sched = make_sched(max_num_seqs=3, max_num_batched_tokens=7)
    seqs = [make_seq(plen, max_tokens=3, first=10 * i) for i, plen in enumerate([5, 2, 9, 1, 4, 6, 3])]
    for s in seqs:
        sched.add(s)
    first_scheduled: list[Sequence] = []
    for batch in run_to_completion(sched):
        for s in batch:
            if s.seq not in first_scheduled:
                first_scheduled.append(s.seq)
    assert first_scheduled == seqs
    assert sched.num_preemptions == 0


def test_fcfs_policy_no_skipping_a_big_waiting_request_blocks_later_small_ones_when_blocks_are_short():
    sched = make_sched(num_blocks=4, block_size=4, max_num_batched_tokens=16, max_model_len=32)
    a = make_seq(11, max_tokens=4)  # 3 blocks after prefill, 4 by the end
    sched.add(a)
    step(sched)
    big = make_seq(8, max_tokens=4, first=100)  # needs 2 blocks for its prompt, 1 is free
    small = make_seq(2, max_tokens=1, first=200)  # would fit in the free block
    sched.add(big)
    sched.add(small)
    assert sched.block_manager.num_free_blocks == 1
    batch = step(sched)
    assert [s.seq for s in batch] == [a]
    assert list(sched.waiting) == [big, small]  # chosen policy: strict FCFS, small is not let past
    admitted = []
    for b in run_to_completion(sched):
        admitted += [s.seq for s in b if s.seq is not a and s.seq not in admitted]
    assert admitted == [big, small]


def test_fcfs_policy_no_skipping_a_prompt_larger_than_the_leftover_budget_blocks_smaller_ones():
    sched = make_sched(max_num_batched_tokens=8, chunked=False)
    a = make_seq(2, max_tokens=5)
    sched.add(a)
    step(sched)
    big, small = make_seq(8, max_tokens=1, first=100), make_seq(1, max_tokens=1, first=200)
    sched.add(big)
    sched.add(small)
    batch = step(sched)  # a's decode leaves 7 tokens: big (8) does not fit, small is not let past
    assert [s.seq for s in batch] == [a]
    assert list(sched.waiting) == [big, small]


# =============================================================================================
# finish()
# =============================================================================================


class FreeSpy:
    def __init__(self, bm: BlockManager):
        self.calls: list[int] = []
        self._free = bm.free_seq
        bm.free_seq = self

    def __call__(self, seq: Sequence) -> None:
        self.calls.append(seq.seq_id)
        self._free(seq)


def test_finish_a_running_sequence_frees_its_blocks_once_and_is_idempotent():
    sched = make_sched()
    seq = make_seq(9, max_tokens=4)
    sched.add(seq)
    step(sched)
    spy = FreeSpy(sched.block_manager)
    assert sched.block_manager.num_used_blocks == 3
    sched.finish(seq, FinishReason.ABORT)
    assert spy.calls == [seq.seq_id]
    assert sched.block_manager.num_used_blocks == 0 and seq.block_table == []
    assert seq.status == SequenceStatus.FINISHED and seq.finish_reason == FinishReason.ABORT
    assert sched.running == [] and sched.num_unfinished == 0
    sched.finish(seq, FinishReason.STOP, "x")  # already finished: nothing happens
    assert spy.calls == [seq.seq_id]
    assert seq.finish_reason == FinishReason.ABORT and seq.stop_reason is None
    assert all(b.ref_count == 0 for b in sched.block_manager.blocks)


def test_finish_a_waiting_sequence_removes_it_from_the_queue_without_freeing_anything():
    sched = make_sched(max_num_seqs=1)
    running, waiting = make_seq(5), make_seq(5, first=50)
    sched.add(running)
    sched.add(waiting)
    step(sched)
    spy = FreeSpy(sched.block_manager)
    used = sched.block_manager.num_used_blocks
    sched.finish(waiting, FinishReason.ABORT)
    sched.finish(waiting, FinishReason.ABORT)
    assert spy.calls == []
    assert list(sched.waiting) == [] and sched.running == [running]
    assert sched.block_manager.num_used_blocks == used
    assert waiting.is_finished


def test_finish_a_preempted_sequence_waiting_for_recompute_frees_nothing_twice():
    sched = make_sched(num_blocks=4, block_size=2, max_num_batched_tokens=16, max_model_len=16)
    old, new = make_seq(3, max_tokens=4), make_seq(3, max_tokens=4, first=10)
    sched.add(old)
    sched.add(new)
    step(sched)
    step(sched)
    step(sched)  # new is preempted: its blocks are already free
    assert new.status == SequenceStatus.WAITING and new.num_preemptions == 1
    spy = FreeSpy(sched.block_manager)
    sched.finish(new, FinishReason.ABORT)
    assert spy.calls == [] and new not in sched.waiting
    run_to_completion(sched)
    assert sched.block_manager.num_used_blocks == 0


def test_finish_a_sequence_sharing_prefix_blocks_releases_only_its_own_references():
    sched = make_sched(max_num_batched_tokens=32)
    a = make_seq(9, max_tokens=8)
    sched.add(a)
    step(sched)
    b = make_seq(9, max_tokens=8)
    sched.add(b)
    step(sched)
    assert b.num_cached_tokens == 8
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared
    assert [sched.block_manager.blocks[x].ref_count for x in shared] == [2, 2]
    sched.finish(b, FinishReason.ABORT)
    assert [sched.block_manager.blocks[x].ref_count for x in shared] == [1, 1]
    sched.finish(b, FinishReason.ABORT)
    assert [sched.block_manager.blocks[x].ref_count for x in shared] == [1, 1]
    sched.finish(a, FinishReason.ABORT)
    assert sched.block_manager.num_used_blocks == 0
