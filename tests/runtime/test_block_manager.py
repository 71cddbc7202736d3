"""BlockManager: free list, reference counts, the chained-hash prefix cache and its LRU eviction.

No model is needed: a test "computes" tokens by advancing ``seq.num_computed_tokens`` and calling
``commit()``, exactly as ``Scheduler.postprocess`` does after a forward pass. The stateful test also
keeps a shadow KV cache (what each physical slot would hold: the full token prefix its K/V were
computed from) so a wrongly shared block shows up as wrong content, not just as bad bookkeeping.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kubellm.runtime.engine.block_manager as block_manager_mod
from kubellm.runtime.engine.block_manager import BlockManager, block_hash
from kubellm.runtime.engine.sequence import Sequence
from kubellm.runtime.sampling.params import SamplingParams


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence(list(tokens), SamplingParams(max_tokens=None))


def compute(bm: BlockManager, seq: Sequence, n: int) -> None:
    """Pretend the model ran on the next ``n`` tokens (whose blocks are already allocated)."""
    assert bm.blocks_needed(seq.num_computed_tokens + n) <= len(seq.block_table)
    seq.num_computed_tokens += n
    bm.commit(seq)


def admit_and_compute(bm: BlockManager, seq: Sequence, budget: int | None = None) -> int:
    """allocate_waiting + compute everything that was scheduled; returns the cached token count."""
    budget = len(seq) if budget is None else budget
    cached = bm.allocate_waiting(seq, budget)
    assert cached is not None
    seq.num_computed_tokens = cached
    compute(bm, seq, min(budget, len(seq) - cached))
    return cached


def free_order(bm: BlockManager) -> list[int]:
    return list(bm.free)


# =============================================================================================
# Stateful property test
# =============================================================================================

BLOCK_SIZE = 4
NUM_BLOCKS = 10
MAX_SEQ_LEN = 28  # sequences stop sampling here so they cannot outgrow the pool forever
VOCAB = st.integers(0, 3)  # tiny vocabulary: generated tokens collide, so suffixes get shared too
BASE_PREFIXES = [
    [7, 7, 1, 2, 3, 4, 5, 6, 9, 9, 9],
    [7, 7, 1, 2, 8, 8, 8, 8, 8, 1],
    [5, 4, 3, 2, 1, 0, 1, 2],
    [],
]


class BlockManagerMachine(RuleBasedStateMachine):
    """Random add / admit (random budget) / append+compute / sample / finish / preempt / reset."""

    @initialize(prefix_caching=st.sampled_from([True, True, True, False]))
    def setup(self, prefix_caching: bool) -> None:
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=prefix_caching)
        self.waiting: list[Sequence] = []  # no blocks
        self.running: list[Sequence] = []  # holds blocks
        self.pending: dict[int, int] = {}  # seq_id -> tokens allocated (scheduled) but not computed yet
        # Shadow KV cache: block id -> [prefix tuple per slot]; a slot's K/V depend on every token up to it.
        self.shadow: dict[int, list[tuple[int, ...] | None]] = {
            b: [None] * BLOCK_SIZE for b in range(NUM_BLOCKS)
        }

    # ---- helpers -------------------------------------------------------------------------------
    def _write_shadow(self, seq: Sequence, start: int, stop: int) -> None:
        bs = BLOCK_SIZE
        for p in range(start, stop):
            b = seq.block_table[p // bs]
            # Only a sequence's own, unshared blocks are ever written (shared blocks are full and frozen).
            assert self.bm.blocks[b].ref_count == 1, f"write into shared block {b}"
            self.shadow[b][p % bs] = tuple(seq.token_ids[: p + 1])

    def _compute_pending(self, seq: Sequence) -> None:
        n = self.pending.pop(seq.seq_id, 0)
        if n == 0:
            return
        self._write_shadow(seq, seq.num_computed_tokens, seq.num_computed_tokens + n)
        compute(self.bm, seq, n)

    # ---- rules ---------------------------------------------------------------------------------
    @rule(
        prefix=st.sampled_from(range(len(BASE_PREFIXES))),
        cut=st.integers(0, 11),
        suffix=st.lists(VOCAB, max_size=9),
    )
    def add_sequence(self, prefix: int, cut: int, suffix: list[int]) -> None:
        tokens = BASE_PREFIXES[prefix][:cut] + suffix
        if not tokens:
            tokens = [0]
        self.waiting.append(make_seq(tokens))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), budget=st.integers(1, 20))
    def allocate_waiting(self, data, budget: int) -> None:
        seq = data.draw(st.sampled_from(self.waiting))
        bm = self.bm
        free_before = free_order(bm)
        q_before, h_before = bm.prefix_queries, bm.prefix_hits
        expected_hits, _ = bm.cached_prefix(seq)
        cached = bm.allocate_waiting(seq, budget)
        if cached is None:
            assert free_order(bm) == free_before, "a failed allocation must take nothing"
            assert seq.block_table == []
            assert (bm.prefix_queries, bm.prefix_hits) == (q_before, h_before)
            return
        bs = BLOCK_SIZE
        assert cached == len(expected_hits) * bs
        assert cached % bs == 0 and cached < len(seq), "the last token is never served from the cache"
        if not bm.enable_prefix_caching:
            assert cached == 0
        assert seq.block_table[: len(expected_hits)] == expected_hits
        # The cached blocks really hold this sequence's tokens, computed from this sequence's prefix.
        for i, b in enumerate(seq.block_table[: cached // bs]):
            assert bm.blocks[b].token_ids == tuple(seq.token_ids[i * bs : (i + 1) * bs])
            for off in range(bs):
                assert self.shadow[b][off] == tuple(seq.token_ids[: i * bs + off + 1])
        assert (bm.prefix_queries, bm.prefix_hits) == (q_before + len(seq), h_before + cached)
        n = min(budget, len(seq) - cached)
        assert len(seq.block_table) == bm.blocks_needed(cached + n)
        seq.num_computed_tokens = cached
        self.waiting.remove(seq)
        self.running.append(seq)
        self.pending[seq.seq_id] = n

    @precondition(lambda self: any(self.pending.values()))
    @rule(data=st.data())
    def compute_scheduled(self, data) -> None:
        """The forward pass ran: K/V of the scheduled tokens are written, then commit()."""
        seq = data.draw(st.sampled_from([s for s in self.running if self.pending.get(s.seq_id)]))
        self._compute_pending(seq)

    @precondition(lambda self: any(s.num_computed_tokens == len(s) < MAX_SEQ_LEN for s in self.running))
    @rule(data=st.data(), token=VOCAB)
    def sample_token(self, data, token: int) -> None:
        """The last step reached the end of the sequence, so it sampled one more token."""
        cands = [s for s in self.running if s.num_computed_tokens == len(s) < MAX_SEQ_LEN]
        seq = data.draw(st.sampled_from(cands))
        seq.append_token(token)

    @precondition(
        lambda self: any(
            not self.pending.get(s.seq_id) and s.num_computed_tokens < len(s) for s in self.running
        )
    )
    @rule(data=st.data())
    def append(self, data) -> None:
        """Schedule the next chunk (or the single decode token) of a running sequence."""
        cands = [s for s in self.running if not self.pending.get(s.seq_id) and s.num_computed_tokens < len(s)]
        seq = data.draw(st.sampled_from(cands))
        n = data.draw(st.integers(1, len(seq) - seq.num_computed_tokens))
        bm = self.bm
        table_before, free_before = list(seq.block_table), free_order(bm)
        if bm.can_append(seq, n):
            bm.append(seq, n)
            assert seq.block_table[: len(table_before)] == table_before
            self.pending[seq.seq_id] = n
        else:
            with pytest.raises(RuntimeError, match="out of KV blocks"):
                bm.append(seq, n)
            assert seq.block_table == table_before and free_order(bm) == free_before

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data())
    def finish(self, data) -> None:
        seq = data.draw(st.sampled_from(self.running + self.waiting))
        self._compute_pending(seq)  # a step always completes before its sequences finish
        self.bm.free_seq(seq)
        assert seq.block_table == []
        (self.running if seq in self.running else self.waiting).remove(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data) -> None:
        """Preemption by recompute: free every block, start over (the prefix cache may help)."""
        seq = data.draw(st.sampled_from(self.running))
        self.pending.pop(seq.seq_id, None)
        self.bm.free_seq(seq)
        seq.num_computed_tokens = 0
        self.running.remove(seq)
        self.waiting.insert(0, seq)

    @precondition(lambda self: self.running)
    @rule(tokens=st.lists(VOCAB, min_size=8, max_size=8), chunk=st.integers(1, 8))
    def step_all_running(self, tokens: list[int], chunk: int) -> None:
        """One scheduler-like step: finish every pending computation, sample, schedule the next chunk."""
        for seq, tok in zip(list(self.running), tokens * 4, strict=False):
            self._compute_pending(seq)
            if seq.num_computed_tokens == len(seq):
                if len(seq) >= MAX_SEQ_LEN:
                    continue
                seq.append_token(tok)
            n = min(chunk, len(seq) - seq.num_computed_tokens)
            if self.bm.can_append(seq, n):
                self.bm.append(seq, n)
                self.pending[seq.seq_id] = n

    @rule(roll=st.integers(0, 4))
    def reset_prefix_cache(self, roll: int) -> None:
        if roll == 0:  # rarely: it throws away everything the other rules built up
            self.bm.reset_prefix_cache()

    # ---- invariants ----------------------------------------------------------------------------
    @invariant()
    def ref_counts_match_block_tables(self) -> None:
        counts = [0] * NUM_BLOCKS
        for s in self.running + self.waiting:
            for b in s.block_table:
                counts[b] += 1
        assert [b.ref_count for b in self.bm.blocks] == counts

    @invariant()
    def free_list_is_exactly_the_unreferenced_blocks(self) -> None:
        bm = self.bm
        free = list(bm.free)
        assert len(free) == len(set(free))
        assert set(free) == {b.block_id for b in bm.blocks if b.ref_count == 0}
        used = {b for s in self.running for b in s.block_table}
        assert bm.num_used_blocks == len(used)
        assert bm.num_used_blocks + bm.num_free_blocks == bm.num_blocks

    @invariant()
    def hash_table_is_consistent(self) -> None:
        bm = self.bm
        for h, b in bm.hash_to_block.items():
            block = bm.blocks[b]
            assert block.hash == h
            assert len(block.token_ids) == BLOCK_SIZE
            # The registered content is what the shadow cache holds (the block's own tokens).
            assert tuple(p[-1] for p in self.shadow[b]) == block.token_ids
        for block in bm.blocks:
            if block.hash is not None:
                assert bm.hash_to_block.get(block.hash) == block.block_id
            else:
                assert block.token_ids == ()
        if not bm.enable_prefix_caching:
            assert bm.hash_to_block == {}

    @invariant()
    def block_tables_are_well_formed(self) -> None:
        bm = self.bm
        for s in self.waiting:
            assert s.block_table == []
        for s in self.running:
            assert len(s.block_table) == len(set(s.block_table)), "a block twice in one table"
            scheduled = s.num_computed_tokens + self.pending.get(s.seq_id, 0)
            assert len(s.block_table) == bm.blocks_needed(scheduled)
            # Every computed slot holds K/V computed from exactly this sequence's prefix.
            for p in range(s.num_computed_tokens):
                b = s.block_table[p // BLOCK_SIZE]
                assert self.shadow[b][p % BLOCK_SIZE] == tuple(s.token_ids[: p + 1])
            if bm.enable_prefix_caching:
                hashes = bm.block_hashes[s.seq_id]
                assert len(hashes) == s.num_computed_tokens // BLOCK_SIZE
                parent = None
                for i, h in enumerate(hashes):
                    assert h == block_hash(parent, tuple(s.token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]))
                    parent = h
            # A block with a registered hash in this table is a full block of this sequence's tokens.
            for i, b in enumerate(s.block_table):
                block = bm.blocks[b]
                if block.hash is not None:
                    assert block.token_ids == tuple(s.token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for s in list(self.running):
            self.bm.free_seq(s)
        assert self.bm.num_used_blocks == 0
        assert self.bm.num_free_blocks == NUM_BLOCKS
        assert all(b.ref_count == 0 for b in self.bm.blocks)
        assert self.bm.block_hashes == {}


BlockManagerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=80, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_block_manager_random_operations_keep_invariants = BlockManagerMachine.TestCase


# =============================================================================================
# Unit tests
# =============================================================================================


def test_prefix_hit_returns_only_full_computed_blocks_and_never_the_last_tokens_block():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(10)))  # blocks [0-3] [4-7] [8,9]
    admit_and_compute(bm, a)
    assert len(bm.hash_to_block) == 2  # the partial third block is not registered

    # Same 10 tokens: two full blocks hit, the partial one never does.
    b = make_seq(list(range(10)))
    hits, _ = bm.cached_prefix(b)
    assert hits == a.block_table[:2]
    assert bm.allocate_waiting(b, 100) == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]

    # Exactly 2 * block_size tokens: all but the last block is reused (the last token must be computed).
    c = make_seq(list(range(8)))
    assert bm.allocate_waiting(c, 100) == 4
    assert c.block_table[0] == a.block_table[0] and c.block_table[1] not in a.block_table
    assert len(c.block_table) == 2

    # One block of tokens only: nothing can be served.
    d = make_seq(list(range(4)))
    assert bm.allocate_waiting(d, 100) == 0

    # Same first block, different second: only the first block hits.
    e = make_seq([0, 1, 2, 3, 99, 5, 6, 7, 8])
    assert bm.allocate_waiting(e, 100) == 4
    assert bm.blocks[a.block_table[0]].ref_count == 4


def test_prefix_hit_requires_computed_blocks_not_just_allocated_ones():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(12)))
    assert bm.allocate_waiting(a, 12) == 0  # allocated, K/V not computed yet
    b = make_seq(list(range(12)))
    assert bm.cached_prefix(b) == ([], [])
    a.num_computed_tokens = 6  # first chunk ran: one full block computed
    bm.commit(a)
    assert bm.cached_prefix(b)[0] == a.block_table[:1]


def test_partial_blocks_are_never_shared():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq([1, 2, 3, 4, 5, 6])
    admit_and_compute(bm, a)
    a.append_token(7)
    compute(bm, a, 1)  # 7 computed tokens: second block still partial
    assert len(bm.hash_to_block) == 1
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8])  # would match a's partial block if it were shared
    assert bm.allocate_waiting(b, 100) == 4
    assert b.block_table[1] != a.block_table[1]
    assert bm.blocks[a.block_table[1]].ref_count == 1
    assert bm.blocks[a.block_table[1]].hash is None
    # Once a's second block fills up and is computed, it becomes shareable.
    a.append_token(8)
    compute(bm, a, 1)
    assert len(bm.hash_to_block) == 2
    c = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.allocate_waiting(c, 100) == 8
    assert c.block_table[:2] == a.block_table[:2]


def test_hash_collision_with_different_tokens_is_caught_by_the_token_id_check(monkeypatch):
    monkeypatch.setattr(block_manager_mod, "block_hash", lambda parent, token_ids: 42)
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq([1, 2, 3, 4, 5])
    admit_and_compute(bm, a)
    assert bm.hash_to_block == {42: a.block_table[0]}
    b = make_seq([9, 9, 9, 9, 5])  # same (constant) hash, different tokens
    assert bm.allocate_waiting(b, 100) == 0
    assert a.block_table[0] not in b.block_table
    # A full block whose hash is taken by different content is not registered over it.
    compute(bm, b, 5)
    assert bm.hash_to_block == {42: a.block_table[0]}
    assert bm.blocks[b.block_table[0]].hash is None


def test_hash_collision_with_same_tokens_but_different_prefix_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(block_manager_mod, "block_hash", lambda parent, token_ids: 42)
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq([1, 1, 1, 1, 2])
    admit_and_compute(bm, a)
    b = make_seq([1, 1, 1, 1, 1, 1, 1, 1, 3])  # block 1 has block 0's tokens but another prefix
    cached = bm.allocate_waiting(b, 100)
    assert len(b.block_table) == len(set(b.block_table)), f"block table {b.block_table} repeats a block"
    assert cached == 4


def test_block_hash_is_not_pythons_int_hash_so_congruent_parents_do_not_collide():
    """Python's hash() reduces ints mod 2**61-1 unseeded; a prefix-cache key must not inherit that."""
    p1 = (12345).to_bytes(8, "little")
    p2 = (12345 + 2**61 - 1).to_bytes(8, "little")
    assert hash(12345) == hash(12345 + 2**61 - 1)
    assert block_hash(p1, (1, 2, 3, 4)) != block_hash(p2, (1, 2, 3, 4))


def test_lru_evicts_freed_cached_blocks_oldest_first_tail_before_head():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])  # 2 full blocks + partial
    admit_and_compute(bm, a)
    b = make_seq([6, 7, 8, 9, 10])
    admit_and_compute(bm, b)
    assert bm.num_free_blocks == 0
    a_full, b_full = a.block_table[:2], b.block_table[:2]
    a_partial, b_partial = a.block_table[2], b.block_table[2]
    bm.free_seq(a)  # freed first: older in LRU
    bm.free_seq(b)
    # Uncached (partial) blocks are reused first, then cached ones oldest-freed first, tail before head.
    assert free_order(bm) == [b_partial, a_partial, a_full[1], a_full[0], b_full[1], b_full[0]]

    c = make_seq([20, 21, 22, 23, 24, 25, 26])  # needs 4 blocks, nothing cached
    admit_and_compute(bm, c)
    assert c.block_table == [b_partial, a_partial, a_full[1], a_full[0]]
    # Taking a cached block evicts its hash; c's computed full blocks are registered with c's tokens.
    assert bm.blocks[a_full[0]].hash is None  # now c's partial last block
    assert bm.blocks[b_partial].token_ids == (20, 21)
    # a's prefix is gone from the cache, b's survived.
    assert bm.cached_prefix(make_seq([1, 2, 3, 4, 5]))[0] == []
    assert bm.cached_prefix(make_seq([6, 7, 8, 9, 10]))[0] == b_full


def test_lru_revived_block_leaves_the_free_list_and_refreeing_makes_it_most_recent():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    admit_and_compute(bm, a)
    a_full = a.block_table[:2]
    bm.free_seq(a)
    assert set(a_full) <= set(bm.free)
    b = make_seq([1, 2, 3, 4, 9])
    assert bm.allocate_waiting(b, 100) == 4  # revives both cached blocks
    for blk in a_full:
        assert blk not in bm.free
        assert bm.blocks[blk].ref_count == 1
    assert bm.num_used_blocks == 3
    # Add another cached prefix, free it, then free b: b's blocks are now the most recently used.
    c = make_seq([7, 8, 9, 10, 11])
    admit_and_compute(bm, c)
    bm.free_seq(c)
    b.num_computed_tokens = 4
    compute(bm, b, 1)
    bm.free_seq(b)
    cached_order = [x for x in free_order(bm) if bm.blocks[x].hash is not None]
    assert cached_order[-2:] == [a_full[1], a_full[0]]


def test_free_seq_twice_is_a_no_op_and_a_stale_block_table_is_a_double_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(list(range(9)))
    admit_and_compute(bm, a)
    table = list(a.block_table)
    bm.free_seq(a)
    free_after = free_order(bm)
    bm.free_seq(a)  # the table was cleared: nothing to free again
    assert free_order(bm) == free_after and all(b.ref_count == 0 for b in bm.blocks)
    # Freeing the same blocks again through a stale copy of the table is caught.
    a.block_table = table
    with pytest.raises(RuntimeError, match="double free"):
        bm.free_seq(a)
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_allocate_waiting_returns_none_and_takes_nothing_when_blocks_are_short():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_seq(list(range(9)))
    admit_and_compute(bm, a)  # 3 blocks: 2 cached full ones + 1 partial
    bm.free_seq(a)
    hog = make_seq([50] * 16)
    assert bm.allocate_waiting(hog, 16) == 0  # 4 blocks: 3 never-cached ones, then evicts a's tail block
    assert bm.num_free_blocks == 2
    # b hits a's first block (free: it would be revived) and needs 2 more blocks: 3 > 2 free.
    b = make_seq([0, 1, 2, 3, 77, 77, 77, 77, 77, 77, 77, 77])
    hits, _ = bm.cached_prefix(b)
    assert len(hits) == 1

    def snapshot():
        return (
            free_order(bm),
            [x.ref_count for x in bm.blocks],
            [(x.hash, x.token_ids) for x in bm.blocks],
            dict(bm.hash_to_block),
            bm.prefix_queries,
            bm.prefix_hits,
        )

    before = snapshot()
    assert bm.allocate_waiting(b, 12) is None
    assert b.block_table == [] and b.seq_id not in bm.block_hashes
    assert snapshot() == before
    # A smaller budget (the cached block + one new block) fits.
    assert bm.allocate_waiting(b, 4) == 4
    assert b.block_table[0] == hits[0] and len(b.block_table) == 2
    assert bm.num_free_blocks == 0


def test_allocate_waiting_counts_revived_cached_blocks_against_the_free_list():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    admit_and_compute(bm, a)
    bm.free_seq(a)
    b = make_seq([1, 2, 3, 4, 6])  # 2 cached (revived from the free list) + 1 new = all 3 free blocks
    assert bm.allocate_waiting(b, 10) == 4
    assert bm.num_free_blocks == 0
    c = make_seq([1, 2, 3, 4, 7])  # shares b's (now live) cached blocks: needs just 1 new block
    assert bm.allocate_waiting(c, 10) is None
    bm.free_seq(b)
    assert bm.allocate_waiting(c, 10) == 4


def test_prefix_caching_disabled_never_hits_or_registers():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    a = make_seq(list(range(10)))
    admit_and_compute(bm, a)
    assert bm.hash_to_block == {}
    assert all(b.hash is None for b in bm.blocks)
    b = make_seq(list(range(10)))
    assert bm.cached_prefix(b) == ([], [])
    assert bm.allocate_waiting(b, 100) == 0
    assert set(a.block_table).isdisjoint(b.block_table)
    assert bm.prefix_hits == 0 and bm.prefix_queries == 20


def test_prefix_query_and_hit_counters():
    bm = BlockManager(num_blocks=16, block_size=4)
    assert (bm.prefix_queries, bm.prefix_hits) == (0, 0)
    a = make_seq(list(range(10)))
    admit_and_compute(bm, a)
    assert (bm.prefix_queries, bm.prefix_hits) == (10, 0)
    b = make_seq(list(range(9)))
    admit_and_compute(bm, b)
    assert (bm.prefix_queries, bm.prefix_hits) == (19, 8)
    # A failed allocation counts nothing.
    small = BlockManager(num_blocks=1, block_size=4)
    assert small.allocate_waiting(make_seq(list(range(9))), 9) is None
    assert (small.prefix_queries, small.prefix_hits) == (0, 0)


def test_commit_registers_blocks_as_they_fill_during_decode():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq([1, 2, 3])
    admit_and_compute(bm, a)
    assert bm.hash_to_block == {}
    for tok in (4, 5, 6, 7, 8):
        a.append_token(tok)
        bm.append(a, 1)
        compute(bm, a, 1)
    # 8 computed tokens: both blocks registered, chained.
    h0 = block_hash(None, (1, 2, 3, 4))
    h1 = block_hash(h0, (5, 6, 7, 8))
    assert bm.hash_to_block == {h0: a.block_table[0], h1: a.block_table[1]}
    assert bm.block_hashes[a.seq_id] == [h0, h1]


def test_identical_blocks_computed_concurrently_keep_the_first_registration():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq(list(range(6))), make_seq(list(range(6)))
    assert bm.allocate_waiting(a, 6) == 0
    assert bm.allocate_waiting(b, 6) == 0  # admitted in the same step: no hit yet
    compute(bm, a, 6)
    compute(bm, b, 6)
    ((h, blk),) = bm.hash_to_block.items()
    assert blk == a.block_table[0]
    assert bm.blocks[b.block_table[0]].hash is None
    b_table = list(b.block_table)
    bm.free_seq(b)
    assert free_order(bm)[:2] == b_table  # never registered: reused first


def test_reset_prefix_cache_drops_all_hits():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(list(range(9)))
    admit_and_compute(bm, a)
    bm.reset_prefix_cache()
    assert bm.hash_to_block == {} and all(b.hash is None for b in bm.blocks)
    assert bm.allocate_waiting(make_seq(list(range(9))), 100) == 0


def test_needs_at_least_one_block():
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(num_blocks=0, block_size=4)
