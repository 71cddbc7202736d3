"""Speculative decoding with a draft model: a smaller checkpoint with the same tokenizer proposes the drafts.

The draft runs in the engine's process with its own :class:`ModelRunner` and its own paged KV cache, kept by
its own :class:`BlockManager` (a second manager rather than a second pool of the main one: the draft's blocks
have another size in bytes, and the scheduler's accounting of the main pool stays what it is without a draft).
The pool has as many blocks as the main one, so whatever fits the main cache fits the draft's; its memory is
taken out of the KV-cache budget before the main pool is sized (``kv_block_bytes``, then ``allocate``).

Per decoding sequence the proposer keeps a *shadow* sequence in the draft cache. Each step it:

1. syncs the shadow with the sequence: the draft's K/V stay valid up to the longest common prefix of what it
   computed (verified tokens, then its own drafts) and the sequence's verified tokens, so accepted drafts
   keep their K/V and rejected ones are rolled back by lowering ``num_computed_tokens`` (their slots are
   rewritten later). Only then are full blocks hashed into the draft's prefix cache, so it never holds a
   draft token that was not accepted;
2. runs the draft ``k`` times over all sequences at once: the first forward computes what the draft missed
   (usually the one or two tokens the last verification added; a new sequence's prompt, in chunks of the
   step's token budget) and drafts one token; each further forward feeds the previous draft and drafts the
   next.

Greedy requests draft the draft's argmax (verification then accepts a draft iff it is the model's argmax, so
output is decoding without speculation). Sampled requests draw each draft from ``q``, the draft's
distribution after the request's temperature, top-k, top-p and min-p, and hand ``q`` on: verification applies
the rejection rule (``verification.verify_sampled_drafts``), so the output distribution is the model's.

EAGLE heads (drafting from the served model's hidden states) are in ``runtime/spec_decode/eagle.py``.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from kubellm.runtime.distributed.tp_group import Group
from kubellm.runtime.engine.block_manager import BlockManager
from kubellm.runtime.engine.model_runner import ModelRunner, kv_block_bytes
from kubellm.runtime.engine.scheduler import ScheduledSeq
from kubellm.runtime.engine.sequence import Sequence, SequenceStatus
from kubellm.runtime.layers import kernel_choice
from kubellm.runtime.models.config import ModelConfig
from kubellm.runtime.models.loader import build_model, read_checkpoint
from kubellm.runtime.sampling.sampler import Sampler
from kubellm.runtime.spec_decode.proposer import Draft, Proposer, draw_drafts
from kubellm.runtime.text.tokenizer import Tokenizer

log = logging.getLogger("kubellm.draft")


class DraftVocabularyMismatch(ValueError):
    """The draft model's tokenizer is not the served model's: its token ids would mean other tokens."""


@dataclasses.dataclass
class DraftModel:
    """A loaded draft model, before its KV cache exists."""

    path: Path
    model: torch.nn.Module
    config: ModelConfig
    kernels: kernel_choice.KernelChoice


def check_same_vocabulary(draft: Tokenizer, target: Tokenizer, draft_source: str) -> None:
    """Refuse a draft whose token ids mean other tokens than the served model's."""
    d, t = draft.tk.get_vocab(with_added_tokens=True), target.tk.get_vocab(with_added_tokens=True)
    if d == t:
        return
    differ = sorted(set(d.items()) ^ set(t.items()), key=lambda kv: kv[1])[:3]
    raise DraftVocabularyMismatch(
        f"--speculative-model {draft_source}: its tokenizer differs from the served model's ({len(d)} vs {len(t)} "
        f"tokens; first differences: {', '.join(f'{k!r}={v}' for k, v in differ)}); a draft model must share "
        "the served model's tokenizer (take a smaller model of the same family)")


def load_draft_model(name_or_path: str, target_tokenizer: Tokenizer, engine_config, max_model_len: int,
                     device: str, progress: bool = True) -> DraftModel:
    """Read and build the draft (unsharded, on ``device``), after checking it shares the target's tokenizer."""
    from kubellm.runtime.models.store import resolve

    path = resolve(name_or_path)
    ckpt = read_checkpoint(path)
    check_same_vocabulary(Tokenizer.from_checkpoint(ckpt), target_tokenizer, str(name_or_path))
    cfg = ModelConfig.from_hf(ckpt.config, ckpt.source)
    # The draft is never quantized by --quantization (that names the served model); a pre-quantized draft
    # checkpoint is served as it is.
    kernels = kernel_choice.for_engine(dataclasses.replace(engine_config, quantization="none"), cfg, 1)
    model, cfg = build_model(ckpt, engine_config.dtype, device, max_model_len, progress,
                             tp=Group(device=device), kernels=kernels)
    log.info("draft model %s: %d layers, vocabulary %d", path, cfg.num_layers, cfg.vocab_size)
    return DraftModel(path, model, cfg, kernels)


@dataclasses.dataclass
class _Shadow:
    seq: Sequence  # the draft cache's copy: verified tokens, then the last drafts
    verified: int  # tokens of the real sequence known verified at the last sync


class DraftModelProposer(Proposer):
    """Proposes ``k`` tokens per sequence with a draft model, all sequences batched in each of ``k`` forwards."""

    def __init__(self, draft: DraftModel, block_size: int, dtype: torch.dtype, device: str,
                 num_speculative_tokens: int, vocab_size: int, max_num_batched_tokens: int,
                 enable_prefix_caching: bool = True, give_up_after: int = 2):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.draft, self.block_size, self.dtype, self.device = draft, block_size, dtype, device
        self.enable_prefix_caching = enable_prefix_caching
        self.k, self.vocab_size, self.token_budget = num_speculative_tokens, vocab_size, max_num_batched_tokens
        super().__init__(give_up_after)
        self.runner: ModelRunner | None = None  # the draft's KV pool and its manager: allocate()
        self.block_manager: BlockManager | None = None
        self._shadows: dict[int, _Shadow] = {}

    def kv_block_bytes(self) -> int:
        return kv_block_bytes(self.draft.config, self.block_size, self.dtype)

    def allocate(self, num_blocks: int) -> None:
        d = self.draft
        self.runner = ModelRunner(d.model, d.config, num_blocks, self.block_size, self.dtype, self.device,
                                  Sampler(()), d.kernels)
        self.block_manager = BlockManager(num_blocks, self.block_size, self.enable_prefix_caching)

    def forget(self, seq: Sequence) -> None:
        super().forget(seq)
        self._free(seq.seq_id)

    # ---- proposing ----------------------------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[Draft]:
        """Drafts for decoding sequences ``seqs`` (at most ``rooms[i]`` tokens each); [] for those backing off,
        still catching up a long prompt, or that found no room in the draft cache."""
        live = {seq.seq_id for seq in seqs}
        for seq_id in [s for s in self._shadows if s not in live]:  # preempted or finished: recomputed if back
            self._free(seq_id)
        out = [Draft([]) for _ in seqs]
        batch: list[ScheduledSeq] = []
        drafting: list[tuple[int, _Shadow, int]] = []  # (index in seqs, shadow, tokens to draft)
        budget = self.token_budget
        for i, (seq, room) in enumerate(zip(seqs, rooms, strict=True)):
            k = min(self.k, room)
            if k < 1 or budget < 1 or self.backoff.paused(seq):
                continue
            shadow = self._sync(seq)
            if shadow is None:
                continue
            s = shadow.seq
            n = min(len(s) - s.num_computed_tokens, budget)
            if n < 1 or not self.block_manager.can_append(s, n + k - 1):
                continue  # its drafts' slots do not fit: no drafts this step
            self.block_manager.append(s, n + k - 1)
            budget -= n
            entry = ScheduledSeq(s, n)
            batch.append(entry)
            if entry.samples:  # caught up: it drafts
                drafting.append((i, shadow, k))
        drafted: dict[int, tuple[list[int], list[torch.Tensor]]] = {i: ([], []) for i, _, _ in drafting}
        step = 0
        while batch:
            logits = self.runner.logits(batch)  # rows: the entries that sample (drafting), in order
            for entry in batch:
                entry.seq.num_computed_tokens += entry.num_tokens
            if not drafting:
                break
            tokens, probs = draw_drafts(logits, [seqs[i].sampling_params for i, _, _ in drafting], self.vocab_size)
            for row, (i, shadow, _) in enumerate(drafting):
                shadow.seq.token_ids.append(tokens[row])
                drafted[i][0].append(tokens[row])
                if probs is not None and probs[row] is not None:
                    drafted[i][1].append(probs[row])
            step += 1
            drafting = [d for d in drafting if d[2] > step]
            batch = [ScheduledSeq(shadow.seq, 1) for _, shadow, _ in drafting]
        for i, (tokens, probs) in drafted.items():
            out[i] = Draft(tokens, torch.stack(probs) if probs else None)
        return out

    def _sync(self, seq: Sequence) -> _Shadow | None:
        """The shadow of ``seq`` with its K/V rolled back to what ``seq`` verified, or None without room."""
        bm = self.block_manager
        shadow = self._shadows.get(seq.seq_id)
        if shadow is None:
            s = Sequence(list(seq.token_ids), seq.sampling_params)
            cached = bm.allocate_waiting(s, 0)  # only the prefix-cache hits; the rest is appended as it runs
            if cached is None:
                return None
            s.num_computed_tokens, s.status = cached, SequenceStatus.RUNNING
            shadow = self._shadows[seq.seq_id] = _Shadow(s, len(seq))
            return shadow
        s, tokens = shadow.seq, seq.token_ids
        common = min(shadow.verified, s.num_computed_tokens)
        limit = min(s.num_computed_tokens, len(tokens))
        while common < limit and s.token_ids[common] == tokens[common]:
            common += 1  # accepted drafts: their K/V are the draft's for these very tokens
        del s.token_ids[common:]
        s.token_ids.extend(tokens[common:])
        s.num_computed_tokens = common
        shadow.verified = len(tokens)
        bm.commit(s)  # every computed token is verified now: full blocks may enter the prefix cache
        return shadow

    def _free(self, seq_id: int) -> None:
        shadow = self._shadows.pop(seq_id, None)
        if shadow is not None and shadow.seq.block_table:
            self.block_manager.free_seq(shadow.seq)
