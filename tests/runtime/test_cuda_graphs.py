"""CUDA graphs for decode steps (runtime/engine/cuda_graphs.py), everything but the capture itself, on CPU.

The capture primitive is swapped for tests/cuda_graph_stand_ins.py's ``RecordingCapture``, which "captures" by
recording the callable and "replays" by calling it again on the persistent buffers, writing the output tensor it
returned the first time (a real replay's contract). What that cannot show (that CUDA records the step faithfully) is the start-up check's
job on a GPU and benchmarks/gpu_check.py's.
"""

from __future__ import annotations

import logging

import pytest
import torch
from cuda_graph_stand_ins import RaisingCapture, RecordingCapture, StaleCapture

from kubellm.runtime.cli import build_parser, engine_kwargs
from kubellm.runtime.distributed.tp_group import Group
from kubellm.runtime.engine import cuda_graphs
from kubellm.runtime.engine.config import EngineConfig
from kubellm.runtime.engine.llm_engine import LLM
from kubellm.runtime.layers.moe import FusedMoE
from kubellm.runtime.sampling.params import SamplingParams

NUM_BLOCKS, BLOCK_SIZE = 96, 4
PROMPTS = ["the cat sat on the mat", "a", "one two three four five six seven eight nine ten", "hello there",
           "what is the capital of France?", "x y", "we the people", "of the", "so it goes", "and then there were"]


def _engine(checkpoint, capture=None, **kw) -> LLM:
    """A float32 engine on CPU whose device captures with ``capture`` (None: CPU as it is, no graphs)."""
    args = dict(progress=False, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS, max_model_len=96,
                max_num_seqs=16, max_num_batched_tokens=512, cuda_graph_max_batch_size=16, attention_backend="torch",
                layer_ops="torch", prepack_weights="off")  # the CPU extension only where a test asks for it
    with pytest.MonkeyPatch.context() as mp:
        if capture is not None:
            mp.setitem(cuda_graphs.CAPTURE_PRIMITIVES, "cpu", capture)
        return LLM(str(checkpoint), **(args | kw))


@pytest.fixture(scope="module", params=["torch", "cpu"])
def graphed(request, tiny_checkpoint_factory) -> LLM:
    """Graphs over the reference backend (gathers whole tables, masks with a bias) and over the native kernel
    (reads the pool in place): the two kinds of decode metadata the graphs feed."""
    return _engine(tiny_checkpoint_factory("llama"), RecordingCapture, attention_backend=request.param)


def _decode_batch(llm: LLM, n: int):
    """Prefill ``n`` prompts in one step, then schedule the next: a decode batch of ``n`` rows."""
    engine = llm.engine
    for i in range(n):
        engine.add_request(PROMPTS[i % len(PROMPTS)] + " " + "z " * (i // len(PROMPTS)),
                           SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.step()
    batch = engine.scheduler.schedule()
    assert len(batch) == n and all(s.num_tokens == 1 for s in batch)
    return batch


def _caches(llm: LLM) -> list[torch.Tensor]:
    return llm.engine.runner.k_caches + llm.engine.runner.v_caches


def _eager_logits(runner, batch) -> torch.Tensor:
    graphs, runner.decode_graphs = runner.decode_graphs, None
    try:
        return runner.logits(batch)
    finally:
        runner.decode_graphs = graphs


# ------------------------------------------------------------------------------------------ buckets and plan


def test_buckets_are_1_2_4_8_then_every_8_up_to_the_largest():
    assert cuda_graphs.bucket_sizes(1) == [1]
    assert cuda_graphs.bucket_sizes(8) == [1, 2, 4, 8]
    assert cuda_graphs.bucket_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert cuda_graphs.bucket_sizes(20) == [1, 2, 4, 8, 16, 20]  # the largest always has a graph
    with pytest.raises(ValueError, match="must be >= 1"):
        cuda_graphs.bucket_sizes(0)


@pytest.mark.parametrize("kw,sizes", [
    (dict(max_num_seqs=256), (1, 2, 4, 8, 16, 24, 32)),  # --cuda-graph-max-batch-size 32
    (dict(max_num_seqs=6), (1, 2, 4, 6)),
    (dict(max_num_seqs=6, speculative_ngram=3, num_speculative_tokens=3), (1, 2, 4, 8, 16, 24)),  # 6 x (1 + 3) rows
    (dict(max_num_seqs=256, max_num_batched_tokens=12), (1, 2, 4, 8, 12)),
])
def test_the_plan_caps_the_largest_bucket_by_the_rows_a_decode_step_can_hold(kw, sizes, monkeypatch):
    monkeypatch.setitem(cuda_graphs.CAPTURE_PRIMITIVES, "cpu", RecordingCapture)
    config = EngineConfig(model="x", device="cpu", cuda_graph_max_batch_size=32, **kw)
    p = cuda_graphs.plan(config, torch.nn.Linear(2, 2), 128)
    assert (p.sizes, p.scratch_blocks) == (sizes, 1)


def test_the_plan_says_why_it_captures_nothing(monkeypatch):
    def why(model=None, **kw):
        p = cuda_graphs.plan(EngineConfig(model="x", device="cpu", **kw), model or torch.nn.Linear(2, 2), 128)
        assert (p.sizes, p.scratch_blocks) == ((), 0)
        return p.note

    assert why() == "--cuda-graphs has no effect on cpu: CUDA graphs are a CUDA feature, decode runs eagerly"
    monkeypatch.setitem(cuda_graphs.CAPTURE_PRIMITIVES, "cpu", RecordingCapture)
    assert why(cuda_graphs=False).startswith("off (--no-cuda-graphs)")
    assert why(tensor_parallel_size=2).startswith("not with tensor parallelism yet")
    moe = torch.nn.Sequential(FusedMoE(8, 16, 4, 2, True, Group()))
    assert why(model=moe).startswith("not for mixture-of-experts models yet")


# ------------------------------------------------------------------------------------------ replay == eager


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 7, 8, 9, 15, 16])  # 1, and bucket - 1, bucket, bucket + 1
def test_a_padded_decode_batch_gives_the_eager_logits(graphed, rows):
    """The same logits and greedy tokens. Bit for bit where the batch fills its bucket and the kernel reads the
    pool in place; otherwise the last place may round differently: padded rows change the GEMMs' row count, and
    the reference backend softmaxes over the graph's full-width block tables (masked keys included)."""
    runner = graphed.engine.runner
    batch = _decode_batch(graphed, rows)
    size = runner.decode_graphs.bucket(rows)
    replay, _ = runner.decode_graphs.graphs[size]
    before = replay.replays
    try:
        eager = _eager_logits(runner, batch)
        replayed = runner.logits(batch)
    finally:
        graphed.engine.abort_all()
    assert replay.replays == before + 1, "the step did not replay its bucket's graph"
    assert size >= rows and replayed.shape == eager.shape == (rows, graphed.engine.vocab_size)
    torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
    if size == rows and not runner.decode_graphs.gathers:
        assert torch.equal(replayed, eager)


def test_padding_and_stale_rows_never_write_a_real_kv_block(graphed):
    """A batch of 7 (bucket 8) replays first, then 3 of its rows (bucket 4): rows 3..6 still hold the 7's data
    until the step pads them. Every block outside the 3 sequences' tables is filled with a marker first; after the
    replay only the scratch block may differ, and the 3 sequences' blocks equal the eager pass's bytes."""
    engine = graphed.engine
    runner = engine.runner
    batch = _decode_batch(graphed, 7)
    try:
        runner.logits(batch)
        small = batch[:3]
        own = {b for s in small for b in s.seq.block_table}
        others = torch.tensor([b for b in range(NUM_BLOCKS) if b not in own])
        for cache in _caches(graphed):
            cache[others] = 0.5
            cache[NUM_BLOCKS] = 0.5  # the scratch block: what padding rows write shows
        start = [c.clone() for c in _caches(graphed)]
        _eager_logits(runner, small)
        eager = [c.clone() for c in _caches(graphed)]
        for cache, saved in zip(_caches(graphed), start, strict=True):
            cache.copy_(saved)
        runner.logits(small)
        after = _caches(graphed)
    finally:
        engine.abort_all()
    assert runner.decode_graphs.bucket(3) == 4 and runner.decode_graphs.scratch_block == NUM_BLOCKS
    for cache, before, want in zip(after, start, eager, strict=True):
        assert cache.shape[0] == NUM_BLOCKS + 1  # the pool's extra block is the scratch block
        assert torch.equal(cache[others], before[others]), "a replay wrote a block no row of the batch owns"
        torch.testing.assert_close(cache[:NUM_BLOCKS], want[:NUM_BLOCKS], rtol=1e-5, atol=1e-5)  # see above: rounding
    assert not torch.equal(after[0][NUM_BLOCKS], start[0][NUM_BLOCKS]), "padding rows should write the scratch block"


def test_greedy_generation_with_graphs_equals_eager_including_speculative_rows(tiny_checkpoint_factory):
    """Whole runs with continuous batching (prefills mixed in, batches shrinking as requests end): tokens and
    logprobs equal to an engine without graphs; with prompt-lookup speculation (drafted positions are decode rows;
    requests with logprobs are not speculated) the tokens are equal too."""
    checkpoint = tiny_checkpoint_factory("llama")
    prompts = [p + " " + p for p in PROMPTS] + ["abc abc abc abc abc abc"]
    for speculative, logprobs in ((0, 1), (3, None)):
        params = [SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, ignore_eos=True, logprobs=logprobs)
                  for i in range(len(prompts))]
        outputs = []
        for capture in (None, RecordingCapture):
            llm = _engine(checkpoint, capture, speculative_ngram=speculative, num_speculative_tokens=2)
            assert bool(llm.engine.cuda_graphs.sizes) == (capture is not None)
            outputs.append([(o.token_ids, o.logprobs and [lp.logprob for lp in o.logprobs])
                            for o in llm.generate(prompts, params, use_tqdm=False)])
            if capture is not None:
                assert sum(replay.replays for replay, _ in llm.engine.runner.decode_graphs.graphs.values()) > 0
                if speculative:
                    assert llm.engine.stats().speculation.num_accepted_tokens > 0
        (eager, replayed) = outputs
        assert [tokens for tokens, _ in replayed] == [tokens for tokens, _ in eager]
        for (_, got), (_, want) in zip(replayed, eager, strict=True):
            assert got == (want and pytest.approx(want, abs=1e-5))


# ------------------------------------------------------------------------------------------ start-up check


@pytest.mark.parametrize("capture,reason", [
    (StaleCapture, "differs from the eager pass"),
    (RaisingCapture, "RuntimeError: operation not permitted when stream is capturing"),
])
def test_a_failing_start_up_check_logs_why_and_the_engine_decodes_eagerly(capture, reason, tiny_checkpoint_factory,
                                                                           caplog):
    checkpoint = tiny_checkpoint_factory("llama")
    with caplog.at_level(logging.WARNING, logger="kubellm.cuda_graphs"):
        llm = _engine(checkpoint, capture)
    status = llm.engine.cuda_graphs
    assert status.sizes == () and reason in status.note and "decode runs eagerly" in status.note
    assert any(reason in r.getMessage() for r in caplog.records)
    assert llm.engine.runner.decode_graphs is None
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    eager = _engine(checkpoint)
    got = [o.token_ids for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)]
    assert got == [o.token_ids for o in eager.generate(PROMPTS[:3], params, use_tqdm=False)]


def test_the_start_up_check_passes_a_faithful_capture(graphed):
    graphs = graphed.engine.runner.decode_graphs
    assert graphs.self_check() is None
    assert graphed.engine.cuda_graphs.sizes == (1, 2, 4, 8, 16)


# ------------------------------------------------------------------------------------------ the setting


def test_cli_takes_cuda_graphs_on_and_off_and_the_largest_batch():
    parse = build_parser().parse_args
    assert engine_kwargs(parse(["serve"]))["cuda_graphs"] is True
    assert engine_kwargs(parse(["serve", "--no-cuda-graphs"]))["cuda_graphs"] is False
    assert engine_kwargs(parse(["serve", "--no-cuda-graphs", "--cuda-graphs"]))["cuda_graphs"] is True
    assert engine_kwargs(parse(["serve", "--cuda-graph-max-batch-size", "64"]))["cuda_graph_max_batch_size"] == 64
    with pytest.raises(ValueError, match="cuda_graph_max_batch_size must be >= 1"):
        EngineConfig(model="x", device="cpu", cuda_graph_max_batch_size=0)


def test_on_cpu_the_setting_is_a_no_op_that_says_so(tiny_checkpoint_factory, caplog):
    with caplog.at_level(logging.INFO, logger="kubellm.cuda_graphs"):
        llm = _engine(tiny_checkpoint_factory("llama"))
    assert llm.engine.cuda_graphs.sizes == () and llm.engine.runner.decode_graphs is None
    assert llm.engine.runner.k_caches[0].shape[0] == NUM_BLOCKS  # no scratch block
    assert "--cuda-graphs has no effect on cpu" in caplog.text
