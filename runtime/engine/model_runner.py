"""Turns a scheduled batch into tensors, runs the model over the paged KV cache, samples.

Owns the KV-cache pool: per layer, K and V of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from kubellm.runtime.distributed.tp_group import LOGITS
from kubellm.runtime.engine import step_timer
from kubellm.runtime.engine.scheduler import ScheduledSeq
from kubellm.runtime.layers.attention import (
    AttentionMetadata,
    KernelAttentionBackend,
    PrefillSpan,
    attention_backend,
)
from kubellm.runtime.layers.kernel_choice import KernelChoice
from kubellm.runtime.layers.layer_ops import use_native_ops
from kubellm.runtime.layers.linear import pack_linears
from kubellm.runtime.layers.moe import pack_experts
from kubellm.runtime.models.config import ModelConfig
from kubellm.runtime.models.llama import LlamaForCausalLM, use_fused_decode
from kubellm.runtime.sampling.sampler import token_logprobs
from kubellm.runtime.spec_decode.verification import verify_sampled_drafts

if TYPE_CHECKING:
    from kubellm.runtime.engine.cuda_graphs import DecodeGraphs
    from kubellm.runtime.sampling.sampler import Sampler, TokenLogprobs
    from kubellm.runtime.sampling.structured_output import StructuredOutputs

log = logging.getLogger("kubellm.runner")


def _is_decode(s: ScheduledSeq) -> bool:
    return s.num_tokens == 1 or s.seq.num_draft_tokens > 0


def chunk_starts(batch: list[ScheduledSeq]) -> list[int]:
    """Where each batch entry's tokens start in the flat input: decodes first, then prefills (as prepare lays
    them out)."""
    starts, offset = [0] * len(batch), 0
    for want_decode in (True, False):
        for i, s in enumerate(batch):
            if _is_decode(s) == want_decode:
                starts[i], offset = offset, offset + s.num_tokens
    return starts


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes one block takes across all layers, K and V, on one rank (each holds 1/tp_size of the kv heads)."""
    return 2 * cfg.num_layers * block_size * (cfg.num_kv_heads // tp_size) * cfg.head_dim * dtype.itemsize


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """``torch.zeros(shape)``, but on CPU without writing it: calloc hands large blocks out as fresh mmap pages,
    which the kernel zero-fills on first touch, so a GiB-sized KV pool costs nothing at start-up (``torch.zeros``
    memsets it: 3.7 s for 4 GiB on a loaded 2-core host) and pages in as blocks are used. The first write into
    each page then pays its zeroing once, inside a step (a KV write into fresh pages: ~10-15 us instead of 9 us
    per layer, measured on a loaded host): no more in total than the memset, and only for the pages ever used.
    64-byte aligned, as torch's own CPU allocator aligns (the kernels' vector loads never straddle a line)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.from_numpy(np.zeros(nbytes + 64, dtype=np.uint8))
    skip = -raw.data_ptr() % 64
    return raw[skip : skip + nbytes].view(dtype).view(shape)


def to_device(lists: list[list[int]], device: str) -> list[torch.Tensor]:
    """int64 tensors of ``lists`` on ``device`` in one host-to-device copy: the lists laid end to end in one
    host buffer (pinned on CUDA, so the copy is asynchronous), each list's tensor a view of the device copy.
    Five copies from pageable memory, one per input, took 0.25 ms of a decode step's host time on an H200, one copy
    0.11-0.16 ms (2026-11-28, Llama-3-8B shape at batch 1, where the GPU idles meanwhile). Views start at multiples
    of 16 bytes (Triton specializes kernels on pointer alignment)."""
    starts, total = [], 0
    for values in lists:
        starts.append(total)
        total += -(-len(values) // 2) * 2
    pinned = torch.device(device).type == "cuda"
    host = torch.empty(total, dtype=torch.int64, pin_memory=pinned)
    flat = host.numpy()
    for start, values in zip(starts, lists, strict=True):
        flat[start : start + len(values)] = values
    dev = host.to(device, non_blocking=pinned)
    return [dev[start : start + len(values)] for start, values in zip(starts, lists, strict=True)]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: str, sampler: Sampler, kernels: KernelChoice):
        self.model, self.cfg, self.block_size, self.device = model, cfg, block_size, device
        self.sampler = sampler
        self.structured: StructuredOutputs | None = None  # rank 0 of an engine with grammar requests sets it
        self.tp = model.tp  # tensor parallelism: rank 0 broadcasts each step's inputs to the other ranks
        num_heads, num_kv_heads = cfg.num_heads // self.tp.size, cfg.num_kv_heads // self.tp.size
        shape = (num_blocks, block_size, num_kv_heads, cfg.head_dim)
        # Zeroed, not empty: padded gathers read slot 0, and 0 * NaN garbage would poison outputs.
        self.k_caches = [zeroed_pool(shape, dtype, device) for _ in range(cfg.num_layers)]
        self.v_caches = [zeroed_pool(shape, dtype, device) for _ in range(cfg.num_layers)]
        self.kernels = kernels
        self.decode_graphs: DecodeGraphs | None = None  # set by cuda_graphs.start: decode steps replay a graph
        # An EAGLE head reads every computed position's final hidden state: run() then keeps (hidden, where
        # each batch entry's rows start) of its last step in last_hidden.
        self.keep_hidden = False
        self.last_hidden: tuple[torch.Tensor, list[int]] | None = None
        self.step_timer: step_timer.StepTimer | None = None  # a profiler's; the engine's step reads it too
        self.backend = attention_backend(kernels.attention, num_heads, num_kv_heads, cfg.head_dim)
        self.gathers = not isinstance(self.backend, KernelAttentionBackend)  # needs decode_bias (prepare)
        for layer, k, v in zip(model.model.layers, self.k_caches, self.v_caches, strict=True):
            attn = layer.self_attn.attn
            attn.k_cache, attn.v_cache, attn.backend = k, v, self.backend
        if kernels.layer_ops == "triton":
            from kubellm.kernels import triton_layer_ops  # imports triton: only where its check passed

            use_native_ops(model, True, triton_layer_ops)
        else:
            use_native_ops(model, kernels.layer_ops == "native")
        if kernels.moe == "native":  # before prepacking, which would take the experts' linears
            log.info("packed the experts of %d layers for the CPU kernel", pack_experts(model))
        if kernels.prepack != "off":  # weights packed once for the GEMM instead of reordered inside every call
            log.info("packed %d linear layers for the %s", pack_linears(model, kernels.prepack), kernels.dense_linears)
        if use_fused_decode(model):
            log.info("decode steps run one native call per layer")

    # ---- batch → tensors -----------------------------------------------------------------------
    def prepare(self, batch: list[ScheduledSeq]):
        """Decodes (one new token, or a token and its drafts: a decode row each, so a drafted position is
        computed exactly as plain decoding would compute it) first, then prefill chunks. Returns model inputs
        and the flat indices of the tokens whose logits are sampled, in batch order."""
        bs = self.block_size
        decodes = [i for i, s in enumerate(batch) if _is_decode(s)]
        prefills = [i for i, s in enumerate(batch) if not _is_decode(s)]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        last_index = [0] * len(batch)

        for i in decodes:
            seq = batch[i].seq
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + batch[i].num_tokens):
                ids.append(seq.token_ids[p])
                positions.append(p)
                slots.append(seq.block_table[p // bs] * bs + p % bs)
                tables.append(seq.block_table)
            last_index[i] = len(ids) - 1
        meta = AttentionMetadata(slot_mapping=torch.empty(0))
        timer = self.step_timer
        ctx: list[int] = [p + 1 for p in positions]
        # The width from the host's list: int(ctx.max()) of a device tensor would wait for the GPU.
        width = -(-(max(positions) + 1) // bs) if decodes else 0
        block_ids = [b for t in tables for b in (t[:width] + [0] * (width - len(t)))]
        if timer is not None:
            timer.mark(step_timer.PREPARE)  # a prefill chunk's context tensors count here
        for i in prefills:
            s = batch[i]
            seq, c, n = s.seq, s.seq.num_computed_tokens, s.num_tokens
            start = len(ids)
            ids.extend(seq.token_ids[c : c + n])
            table = np.asarray(seq.block_table, dtype=np.int64)
            pos = np.arange(c + n, dtype=np.int64)
            all_slots = table[pos // bs] * bs + pos % bs
            positions.extend(range(c, c + n))
            slots.extend(all_slots[c:].tolist())
            span = PrefillSpan(start=start, num_tokens=n, context_len=c + n, context_slots=None, mask=None)
            if c > 0:  # earlier chunk or prefix-cache hit: attend over cached context too
                span.context_slots = torch.from_numpy(all_slots).to(self.device)
                q_pos = torch.arange(c, c + n, device=self.device)
                span.mask = torch.arange(c + n, device=self.device)[None, :] <= q_pos[:, None]
            meta.prefills.append(span)
            last_index[i] = start + n - 1

        # A sampling entry samples at its last token; one with drafts at each draft's position too.
        sample_at = [j for i, s in enumerate(batch) if s.samples
                     for j in range(last_index[i] - s.seq.num_draft_tokens, last_index[i] + 1)]
        if timer is not None:
            timer.mark(step_timer.H2D)
        input_ids, pos_t, meta.slot_mapping, ctx_t, block_ids_t = to_device(
            [ids, positions, slots, ctx, block_ids], self.device)
        if decodes:
            meta.num_decodes = len(tables)
            meta.decode_block_ids = block_ids_t
            meta.decode_block_tables = block_ids_t.view(len(tables), width).to(torch.int32)
            meta.decode_context_lens = ctx_t.to(torch.int32)
            if self.gathers:  # only the reference backend's gathers read the bias; kernels take the lengths
                pad = torch.arange(width * bs, device=self.device)[None, :] >= ctx_t[:, None]
                meta.decode_bias = torch.zeros(pad.shape, dtype=torch.float32, device=self.device).masked_fill_(
                    pad, float("-inf")).unsqueeze(-1)
        return input_ids, pos_t, meta, sample_at

    # ---- run -----------------------------------------------------------------------------------
    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.tp.size > 1:
            self.tp.broadcast(("step", input_ids, positions, meta))
        if (timer := self.step_timer) is not None:
            timer.mark(step_timer.FORWARD)
            timer.forward_started()
        hidden = None
        if self.decode_graphs is not None:
            hidden = self.decode_graphs.forward(input_ids, positions, meta)
        replayed = hidden is not None
        if not replayed:
            hidden = self.model(input_ids, positions, meta)
        if timer is not None:
            timer.forward_done(replayed)
        return hidden

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """float32 logits of ``hidden``'s ``rows``. With tensor parallelism each rank holds a slice of the
        vocabulary: the other ranks are told the rows (they hold the same hidden states) and join the gather."""
        if self.tp.size > 1:
            self.tp.broadcast((LOGITS, rows))
        if rows and rows == list(range(rows[0], rows[0] + len(rows))):  # a slice (every decode step): no index tensor,
            return self.model.compute_logits(hidden[rows[0] : rows[0] + len(rows)])  # whose copy would wait for the GPU
        return self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.long, device=self.device)])

    @torch.inference_mode()
    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Ranks 1..N-1: rank 0's forward pass on this rank's shards (its all-reduces need every rank); the
        hidden states stay for the logits rank 0 asks for next (:meth:`replay_logits`)."""
        self._replayed = self.model(input_ids, positions, meta)

    @torch.inference_mode()
    def replay_logits(self, rows: list[int]) -> None:
        """Ranks 1..N-1: this rank's vocabulary slice of the logits of ``rows`` that rank 0 computes."""
        self.model.compute_logits(self._replayed[torch.tensor(rows, dtype=torch.long, device=self.device)])

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> tuple[list[int], list[TokenLogprobs | None], list[tuple]]:
        """One forward pass. Returns, for each batch entry that samples, in order, its token and (when asked)
        its logprobs; and ``(seq, first prompt index, [TokenLogprobs])`` for the prompt tokens this step
        computed of sequences that asked for prompt logprobs."""
        if (timer := self.step_timer) is not None:
            timer.mark(step_timer.PREPARE)
        input_ids, positions, meta, sample_at = self.prepare(batch)
        seqs = [s.seq for s in batch if s.samples for _ in range(1 + s.seq.num_draft_tokens)]  # a row each
        masks = self.structured.start_masks(seqs) if self.structured is not None else None  # beside the forward
        hidden = self._forward(input_ids, positions, meta)
        if self.keep_hidden:  # the layout before resolve() trims drafts off num_tokens
            self.last_hidden = (hidden, chunk_starts(batch))
        if not sample_at:
            if timer is not None:
                timer.mark(step_timer.POSTPROCESS)
            return [], [], self._prompt_logprobs(batch, hidden, sample_at)
        if timer is not None:
            timer.mark(step_timer.LOGITS)
        logits = self._logits(hidden, sample_at)
        if timer is not None:
            timer.mark(step_timer.SAMPLE)
        tokens, logprobs = self.sampler.sample(logits, seqs, masks.result().to(logits.device) if masks else None)
        if any(s.draft_probs is not None for s in seqs):  # a draft model's sampled drafts: the rejection rule
            tokens = verify_sampled_drafts(logits, seqs, tokens)
        if timer is not None:
            timer.mark(step_timer.D2H)
        token_ids = tokens.tolist()
        if timer is not None:
            timer.mark(step_timer.POSTPROCESS)
        return token_ids, logprobs, self._prompt_logprobs(batch, hidden, sample_at)

    def _prompt_logprobs(self, batch: list[ScheduledSeq], hidden: torch.Tensor, sample_at: list[int]) -> list[tuple]:
        """Raw-logit logprobs of prompt tokens 1.. as this step's chunk predicts them (position p → token p+1)."""
        out = []
        if all(s.seq.sampling_params.prompt_logprobs is None for s in batch):
            return out  # the usual step: nothing to compute
        starts = chunk_starts(batch)
        for i, s in enumerate(batch):
            seq, c = s.seq, s.seq.num_computed_tokens
            k = seq.sampling_params.prompt_logprobs
            n = min(s.num_tokens, seq.num_prompt_tokens - 1 - c)  # the prompt's last position predicts output
            if k is None or n <= 0:
                continue
            logits = self._logits(hidden, list(range(starts[i], starts[i] + n)))
            targets = torch.tensor(seq.token_ids[c + 1 : c + 1 + n], device=logits.device)
            out.append((seq, c + 1, token_logprobs(logits, targets, [k] * n)))
        return out

    @torch.inference_mode()
    def logits(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Same forward pass, returning the float32 logits that would be sampled (tests, tools, a draft model)."""
        input_ids, positions, meta, sample_at = self.prepare(batch)
        hidden = self._forward(input_ids, positions, meta)
        return self._logits(hidden, sample_at)
