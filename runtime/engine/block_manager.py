"""KV-cache block accounting: free list, reference counts and the prefix cache.

A block holds ``block_size`` consecutive tokens of one sequence's K/V. A block becomes shareable
once it is full *and* its K/V have been computed: it is then registered under a chained hash
(parent block's hash + its token ids), so another sequence with the same prefix reuses it instead of
recomputing. Shared blocks are full and never written again, so no copy-on-write is needed.

Freed blocks keep their hash and go to the back of an LRU free list; allocation takes from the
front, evicting the hash of whatever it takes. A hit on a freed block revives it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from kubellm.runtime.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "parent", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.parent: bytes | None = None  # hash of the block before it: a hit must match the whole chain
        self.token_ids: tuple[int, ...] = ()


def block_hash(parent: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """SHA-256 over the parent's hash and this block's token ids.

    Python's built-in hash is not collision-resistant (ints reduce mod 2**61-1, with no seed), and a
    collision here would serve one request's K/V to another. The hit check also compares tokens and
    parent, so even a collision cannot return the wrong block.
    """
    return hashlib.sha256((parent or b"") + array("q", token_ids).tobytes()).digest()


class BlockManager:
    """Owns every block id in ``[0, num_blocks)``; sequences only hold them in ``seq.block_table``."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 recompute_last_hit_block: bool = False):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        # An EAGLE head's K/V at a block's last position depend on the next block's first token, which the hash
        # does not cover: serving every hit but the last makes the model recompute that block (runtime/spec_decode/eagle.py).
        self.recompute_last_hit_block = recompute_last_hit_block
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front = evict first
        self.hash_to_block: dict[bytes, int] = {}
        self.block_hashes: dict[int, list[bytes]] = {}  # seq_id -> hashes of its computed full blocks
        # Counters for metrics: prompt tokens looked up in / served from the prefix cache.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, seq: Sequence) -> tuple[list[int], list[bytes]]:
        """Block ids (and their hashes) of the longest computed prefix already in the cache.

        The last token is never served from the cache: the model must run on at least one token to
        produce the logits for the next one.
        """
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return [], []  # prompt logprobs need the logits of every prompt position: compute them all
        ids, hashes, parent = [], [], None
        tokens = seq.token_ids
        bs = self.block_size
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(parent, chunk)
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != chunk or block.parent != parent:  # a hash collision, not a hit
                break
            ids.append(block_id)
            hashes.append(h)
            parent = h
        if self.recompute_last_hit_block and ids:
            return ids[:-1], hashes[:-1]
        return ids, hashes

    # ---- allocation ----------------------------------------------------------------------------
    def allocate_waiting(self, seq: Sequence, num_new_tokens: int) -> int | None:
        """Give a sequence without blocks its cached prefix plus room for ``num_new_tokens`` more.

        Returns the number of prefix tokens served from the cache, or None (nothing taken) when
        there are not enough free blocks.
        """
        assert not seq.block_table, f"sequence {seq.seq_id} already holds blocks"
        hit_ids, hit_hashes = self.cached_prefix(seq)
        num_cached = len(hit_ids) * self.block_size
        num_new_tokens = min(num_new_tokens, len(seq) - num_cached)
        new_blocks = self.blocks_needed(num_cached + num_new_tokens) - len(hit_ids)
        revived = sum(1 for b in hit_ids if self.blocks[b].ref_count == 0)  # those come off the free list too
        if new_blocks + revived > len(self.free):
            return None
        for b in hit_ids:
            self._take(b)
        seq.block_table = hit_ids + [self._take_free() for _ in range(new_blocks)]
        self.block_hashes[seq.seq_id] = hit_hashes
        self.prefix_queries += len(seq)
        self.prefix_hits += num_cached
        return num_cached

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= len(self.free)

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend a running sequence's block table to hold ``num_new_tokens`` more computed tokens."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > len(self.free):
            raise RuntimeError(f"out of KV blocks: need {needed}, {len(self.free)} free (call can_append first)")
        seq.block_table.extend(self._take_free() for _ in range(needed))

    def commit(self, seq: Sequence) -> None:
        """Register blocks whose K/V are now fully computed so later requests can reuse them."""
        hashes = self.block_hashes.setdefault(seq.seq_id, [])
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(hashes), seq.num_computed_tokens // bs):
            chunk = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent = hashes[-1] if hashes else None
            h = block_hash(parent, chunk)
            hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.hash_to_block:
                block.hash, block.parent, block.token_ids = h, parent, chunk
                self.hash_to_block[h] = block.block_id

    def free_seq(self, seq: Sequence) -> None:
        """Release every block of a finished or preempted sequence (tail first, so tails evict first)."""
        for b in reversed(seq.block_table):
            block = self.blocks[b]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of KV block {b} by sequence {seq.seq_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self.free[b] = None
                    self.free.move_to_end(b, last=False)  # nothing cached in it: reuse it first
                else:
                    self.free[b] = None
        seq.block_table = []
        self.block_hashes.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> None:
        for block_id in self.hash_to_block.values():
            block = self.blocks[block_id]
            block.hash, block.parent, block.token_ids = None, None, ()
        self.hash_to_block.clear()

    # ---- internals -----------------------------------------------------------------------------
    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict the cached content it held
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.parent, block.token_ids = None, None, ()
        block.ref_count = 1
        return block_id
