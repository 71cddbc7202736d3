"""CUDA graphs for decode steps: capture a decode step once per batch size, then replay it.

A decode step on a GPU launches hundreds of small kernels (per layer: norms, GEMMs, rotary, cache write,
attention); at small batches their launch overhead, not the work, sets the step time. A captured graph replays
all of them in one launch. A graph replays fixed addresses and shapes, hence:

* batches are padded up to the next captured size, a *bucket* (:func:`bucket_sizes`: 1, 2, 4, 8, then every 8);
* the inputs live in persistent buffers sized for the largest bucket (each bucket's graph reads the first rows):
  a step copies its batch in — token ids, positions, slot mapping, block tables, context lengths;
* padding rows are token 0 at position 0 writing its K/V into a *scratch block* that the block manager never
  hands out (the pool has one block more than the block manager owns), so a replay never writes a real block;
* block tables are as wide as ``max_model_len`` needs, so one graph serves every context length;
* each bucket's output (the final hidden states) is a fixed tensor of the graphs' shared memory pool, valid
  until the next replay (the runner samples from it before the next step).

Only pure decode steps of the served model replay (speculative verification too: each drafted position is a
decode row; a draft model's own forwards stay eager); steps with a prefill chunk, steps above the largest bucket,
tensor-parallel and MoE models run eagerly. Capture happens at
start-up behind a check (:meth:`DecodeGraphs.self_check`: one bucket captured, replayed on real rows and
compared with the eager pass); any failure is logged with its reason and the engine decodes eagerly.

The capture primitive is injectable (:data:`CAPTURE_PRIMITIVES`): :class:`CudaGraphCapture` on CUDA; the tests
use a stand-in that records the callable and calls it again on replay, so everything but the capture itself is
tested on CPU; benchmarks/gpu_check.py checks the capture on a real GPU (first run: H200, 2026-11-27, greedy
equal to eager, benchmarks/results/).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kubellm.runtime.layers.attention import AttentionMetadata, KernelAttentionBackend
from kubellm.runtime.layers.moe import FusedMoE

if TYPE_CHECKING:
    from kubellm.runtime.engine.config import EngineConfig
    from kubellm.runtime.engine.model_runner import ModelRunner

log = logging.getLogger("kubellm.cuda_graphs")

# Final hidden states of a replay against the eager pass, max |difference| / max |eager|: batch sizes differ
# (the replay's GEMMs see padded rows), so half precision may round differently; a broken capture is off by O(1).
CHECK_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def bucket_sizes(max_batch: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, then every 8 up to ``max_batch`` (itself included)."""
    if max_batch < 1:
        raise ValueError(f"the largest CUDA-graph batch must be >= 1, got {max_batch}")
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch] + list(range(16, max_batch + 1, 8))
    return sizes if sizes[-1] == max_batch else sizes + [max_batch]


class GraphCapture(Protocol):
    """Records the work of ``fn()`` once: returns a replay (redo that work on the same buffers, writing the same
    output tensor) and ``fn``'s output tensor."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]: ...


class CudaGraphCapture:
    """``torch.cuda.CUDAGraph``s sharing one memory pool: only one bucket's graph runs at a time, so their
    intermediate tensors may overlap (capture the largest first and the others fit in its memory)."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []  # replays need them alive

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        torch.cuda.synchronize()
        self.graphs.append(graph)
        return graph.replay, out


# Device type -> the capture primitive for it; devices not listed run every step eagerly.
CAPTURE_PRIMITIVES: dict[str, Callable[[], GraphCapture]] = {"cuda": CudaGraphCapture}


@dataclass(frozen=True)
class GraphPlan:
    """What start-up will try: the bucket sizes (empty: decode eagerly) and, when empty, why."""

    sizes: tuple[int, ...]
    note: str

    @property
    def scratch_blocks(self) -> int:
        """KV blocks the runner's pool needs beyond the block manager's: the padding rows' scratch block."""
        return 1 if self.sizes else 0


@dataclass(frozen=True)
class GraphStatus:
    """What the engine ended up with: the captured sizes (empty: every step eager) and a line saying why/what."""

    sizes: tuple[int, ...]
    note: str


def plan(config: EngineConfig, model: torch.nn.Module, max_model_len: int) -> GraphPlan:
    """Whether to capture, and which sizes: the largest is ``cuda_graph_max_batch_size`` capped by the most
    decode rows a step can hold (sequences, times 1 + drafts with speculative decoding, within the token budget)."""
    device = torch.device(config.device).type
    if not config.cuda_graphs:
        return GraphPlan((), "off (--no-cuda-graphs): decode runs eagerly")
    if device not in CAPTURE_PRIMITIVES:
        return GraphPlan((), f"--cuda-graphs has no effect on {device}: CUDA graphs are a CUDA feature, decode "
                             "runs eagerly")
    if config.tensor_parallel_size > 1:
        return GraphPlan((), "not with tensor parallelism yet (the ranks' all-reduces are not captured): decode "
                             "runs eagerly")
    if any(isinstance(m, FusedMoE) for m in model.modules()):
        return GraphPlan((), "not for mixture-of-experts models yet (the expert dispatch reads per-expert token "
                             "counts on the host every layer, which a graph cannot capture): decode runs eagerly")
    speculating = config.speculative_ngram or config.speculative_model
    rows = config.max_num_seqs * (1 + config.num_speculative_tokens if speculating else 1)
    largest = min(config.cuda_graph_max_batch_size, rows, config.max_num_batched_tokens)
    return GraphPlan(tuple(bucket_sizes(largest)), "")


def start(runner: ModelRunner, graph_plan: GraphPlan, scratch_block: int, max_model_len: int) -> GraphStatus:
    """Check, then capture every planned size and hand the graphs to the runner; on any failure log why and
    leave the runner eager. ``scratch_block``: the pool's block that no sequence owns."""
    if not graph_plan.sizes:
        if not graph_plan.note.startswith("off"):
            log.info("CUDA graphs: %s", graph_plan.note)
        return GraphStatus((), graph_plan.note)
    device = torch.device(runner.device).type
    started = time.monotonic()
    try:
        graphs = DecodeGraphs(runner, list(graph_plan.sizes), scratch_block, max_model_len,
                              CAPTURE_PRIMITIVES[device]())
        if (failure := graphs.self_check()) is not None:
            raise RuntimeError(failure)
        graphs.capture_all()
    except Exception as e:  # noqa: BLE001 - whatever broke, eager decoding still works
        note = f"off: the start-up check failed ({type(e).__name__}: {e}); decode runs eagerly"
        log.warning("CUDA graphs %s", note)
        if device == "cuda":
            torch.cuda.empty_cache()
        return GraphStatus((), note)
    runner.decode_graphs = graphs
    sizes = tuple(graph_plan.sizes)
    note = f"captured {len(sizes)} decode batch sizes ({sizes[0]}..{sizes[-1]}) in {time.monotonic() - started:.1f} s"
    log.info("CUDA graphs: %s", note)
    return GraphStatus(sizes, note)


class DecodeGraphs:
    """One captured decode step per bucket over persistent input buffers; :meth:`forward` replays the step
    for a pure decode batch that fits, padded to its bucket.

    Buffers (rows = the largest bucket, width = ``max_model_len`` in blocks): ``input_ids``, ``positions``,
    ``slot_mapping`` [rows] int64, ``block_tables`` [rows, width] int32, ``context_lens`` [rows] int32.
    """

    def __init__(self, runner: ModelRunner, sizes: list[int], scratch_block: int, max_model_len: int,
                 capture: GraphCapture):
        self.model, self.sizes, self.capture_primitive = runner.model, sizes, capture
        self.vocab_size, self.dtype = runner.cfg.vocab_size, runner.k_caches[0].dtype
        bs, device = runner.block_size, runner.device
        rows, width = sizes[-1], -(-max_model_len // bs)
        self.block_size, self.scratch_block = bs, scratch_block
        # The scratch block's last slot: the start-up check's rows use the ones before it.
        self.scratch_slot = scratch_block * bs + bs - 1
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(rows, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        # The reference backend gathers whole tables and masks with a bias; kernels read the pool in place.
        self.gathers = not isinstance(runner.backend, KernelAttentionBackend)
        self.key_index = torch.arange(width * bs, device=device) if self.gathers else None
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}

    # ---- the captured step -----------------------------------------------------------------------
    def _meta(self, rows: int) -> AttentionMetadata:
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:rows], num_decodes=rows,
                                 decode_block_tables=self.block_tables[:rows], decode_context_lens=self.context_lens[:rows])
        if self.gathers:  # derived inside the step, so the graph recomputes them from the buffers on replay
            meta.decode_block_ids = self.block_tables[:rows].reshape(-1).to(torch.int64)
            past = self.key_index[None, :] >= self.context_lens[:rows, None]
            meta.decode_bias = torch.zeros(past.shape, dtype=torch.float32, device=past.device).masked_fill_(
                past, float("-inf")).unsqueeze(-1)
        return meta

    def _step(self, rows: int) -> torch.Tensor:
        """The model over the first ``rows`` rows of the buffers: final hidden states [rows, hidden]."""
        return self.model(self.input_ids[:rows], self.positions[:rows], self._meta(rows))

    def _pad(self, start: int, end: int) -> None:
        """Rows [start, end) become padding: token 0 at position 0, K/V into the scratch slot, a one-token
        context inside the scratch block."""
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = self.scratch_slot
        self.block_tables[start:end] = self.scratch_block
        self.context_lens[start:end] = 1

    def _capture(self, size: int) -> None:
        self._pad(0, size)
        self._step(size)  # warm-up: first-call work (Triton compiles, allocator growth) stays out of the graph
        self.graphs[size] = self.capture_primitive.capture(lambda: self._step(size))

    @torch.inference_mode()  # as the runner's steps run
    def capture_all(self) -> None:
        """Every size not captured yet, largest first (the pool is sized by the first capture)."""
        for size in reversed(self.sizes):
            if size not in self.graphs:
                self._capture(size)

    # ---- a step ----------------------------------------------------------------------------------
    def bucket(self, rows: int) -> int:
        """The smallest captured size that holds ``rows``."""
        return self.sizes[bisect.bisect_left(self.sizes, rows)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The final hidden states [rows, hidden] of a pure decode batch from its bucket's graph (a view of the
        graph's output, valid until the next replay); None when the batch is not one a graph can run."""
        rows = input_ids.shape[0]
        if meta.prefills or meta.num_decodes != rows or not 0 < rows <= self.sizes[-1]:
            return None
        width = meta.decode_block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            return None
        size = self.bucket(rows)
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        self.slot_mapping[:rows].copy_(meta.slot_mapping)
        self.block_tables[:rows, :width].copy_(meta.decode_block_tables)
        self.block_tables[:rows, width:] = self.scratch_block  # past every context: never read
        self.context_lens[:rows].copy_(meta.decode_context_lens)
        self._pad(rows, size)  # rows a larger batch left behind would write its blocks again
        replay, out = self.graphs[size]
        replay()
        return out[:rows]

    # ---- start-up check --------------------------------------------------------------------------
    @torch.inference_mode()
    def self_check(self) -> str | None:
        """Capture one bucket, replay it with real rows plus padding and compare the rows with the eager pass.
        Returns what went wrong, or None. The rows live in the scratch block: row i is at position i and
        attends to the rows before it, all written in the same step, so nothing depends on earlier contents."""
        size = next((s for s in self.sizes if s >= 4), self.sizes[-1])
        if self.block_size == 1:  # no slot besides the padding's: check one row without padding
            size = self.sizes[0]
        rows = max(1, min(size - 1, self.block_size - 1))

        def load_rows() -> None:
            index = torch.arange(rows, device=self.input_ids.device)
            self.input_ids[:rows] = (index * 7919 + 13) % self.vocab_size
            self.positions[:rows] = index
            self.slot_mapping[:rows] = self.scratch_block * self.block_size + index
            self.block_tables[:rows] = self.scratch_block
            self.context_lens[:rows] = (index + 1).to(torch.int32)
            self._pad(rows, size)

        load_rows()
        eager = self._step(rows).clone()
        self._capture(size)
        load_rows()
        replay, out = self.graphs[size]
        replay()
        got = out[:rows]
        if not torch.isfinite(got).all():
            return f"the replay of batch size {size} produced non-finite hidden states"
        scale = float(eager.abs().max()) or 1.0
        error = float((got.float() - eager.float()).abs().max()) / scale
        tolerance = CHECK_TOLERANCE.get(self.dtype, 5e-2)
        if not error <= tolerance:
            return (f"the replay of batch size {size} ({rows} rows + padding) differs from the eager pass: max "
                    f"relative difference {error:.3g} > {tolerance:g}")
        return None
