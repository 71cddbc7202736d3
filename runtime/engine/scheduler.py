"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step has a token budget (``max_num_batched_tokens``). Running sequences go first, oldest
first: a decode costs one token, an unfinished prefill takes the next chunk. Waiting sequences are
admitted FCFS with whatever budget is left (chunked prefill), so prefills and decodes share a step.
When the KV cache runs dry, the newest running sequence is preempted: its blocks are freed and it
is recomputed later (its computed prefix usually comes back from the prefix cache).
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass

from kubellm.runtime.engine.block_manager import BlockManager
from kubellm.runtime.engine.sequence import FinishReason, Sequence, SequenceStatus


class RequestTooLong(ValueError):
    """The request can never fit this engine (context length or KV-cache size); retrying won't help."""


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed for it this step: token_ids[num_computed : num_computed + num_tokens]

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence, so its logits give the next token."""
        return self.seq.num_computed_tokens + self.num_tokens == len(self.seq)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- admission -----------------------------------------------------------------------------
    def check_fits(self, seq: Sequence) -> None:
        """Raise RequestTooLong for a request that could never complete, instead of queueing it forever."""
        self.check_request(seq.num_prompt_tokens, seq.sampling_params.max_tokens)

    def check_request(self, prompt_len: int, max_tokens: int | None) -> None:
        """The same check from lengths alone; pure, so the HTTP layer may call it from any thread."""
        if prompt_len == 0:
            raise RequestTooLong("the prompt is empty; send at least one token")
        if prompt_len >= self.max_model_len:
            raise RequestTooLong(
                f"the prompt has {prompt_len} tokens but this model's context length is {self.max_model_len}; "
                f"shorten the prompt to at most {self.max_model_len - 1} tokens")
        total = prompt_len + (max_tokens or self.max_model_len)
        if max_tokens is not None and total > self.max_model_len:
            raise RequestTooLong(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} exceeds the context "
                f"length {self.max_model_len}; lower max_tokens to at most {self.max_model_len - prompt_len}")
        total = min(total, self.max_model_len)
        if not self.enable_chunked_prefill and prompt_len > self.max_num_batched_tokens:
            raise RequestTooLong(
                f"the prompt has {prompt_len} tokens but max_num_batched_tokens is {self.max_num_batched_tokens} "
                "and chunked prefill is off")
        bm = self.block_manager
        if bm.blocks_needed(total) > bm.num_blocks:
            raise RequestTooLong(
                f"the request needs up to {bm.blocks_needed(total)} KV blocks ({total} tokens) but the cache holds "
                f"{bm.num_blocks}; lower max_tokens or give the engine more KV-cache memory")

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledSeq]:
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        preempted = False

        # Running sequences first, oldest first; preempt from the newest end when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq) - seq.num_computed_tokens, budget)
            while not bm.can_append(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                bm.append(seq, n)
                batch.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
                continue
            break  # seq itself was preempted; everything after it is gone too

        # Then admit waiting sequences FCFS, unless this step already had to preempt.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            # Without chunked prefill a new prompt must fit the budget whole; a preempted sequence is
            # recomputed in chunks regardless, or it could outgrow the budget and block the queue forever.
            if not self.enable_chunked_prefill and seq.num_preemptions == 0 and len(seq) > budget:
                break
            num_cached = bm.allocate_waiting(seq, budget)
            if num_cached is None:
                break
            self.waiting.popleft()
            seq.num_computed_tokens = num_cached
            seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            n = min(len(seq) - num_cached, budget)
            self.running.append(seq)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        return batch

    def postprocess(self, batch: list[ScheduledSeq], sampled: list[int]) -> list[Sequence]:
        """Record a step's results: advance computed counts, append sampled tokens.

        ``sampled`` holds one token per entry of ``batch`` whose ``samples`` is true, in order.
        Returns the sequences that received a new token.
        """
        out = []
        it = iter(sampled)
        for s in batch:
            seq = s.seq
            samples = s.samples
            seq.num_computed_tokens += s.num_tokens
            self.block_manager.commit(seq)
            if samples:
                seq.append_token(next(it))
                out.append(seq)
        return out

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """End a sequence (any state) and free its blocks. Idempotent."""
        if seq.status == SequenceStatus.FINISHED:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)
        if seq.block_table:
            self.block_manager.free_seq(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
