"""A request's token sequence and its life-cycle state, as the scheduler and runner see it."""

from __future__ import annotations

import enum
import itertools

import torch

from kubellm.runtime.sampling.params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks and is in the running batch
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop string or a stop token id
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # cancelled by the client, drain timeout or an error


_ids = itertools.count()


class Sequence:
    """Token ids (prompt then output) plus the bookkeeping the engine needs.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache (prefix-cache hits included);
    the next step computes ``token_ids[num_computed_tokens:]`` or a chunk of it.
    ``block_table`` lists the KV-cache block ids that hold this sequence, in order; the block
    manager owns them.
    """

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None):
        self.seq_id = next(_ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = params
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None  # the stop string or token id that ended it
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at last admission
        self.block_table: list[int] = []
        self.num_preemptions = 0
        self.num_draft_tokens = 0  # speculative tokens at the end of token_ids, unverified (within one step)
        self.draft_probs: torch.Tensor | None = None  # [num_draft_tokens, V]: the draft model's q, when sampled
        self.grammar = None  # an llguidance LLMatcher when sampling_params.guided is set (the engine makes it)
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
