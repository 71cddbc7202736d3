"""Tensor parallelism on CPU (gloo): shards are exact slices of the checkpoint, TP=2 generates what TP=1 and
transformers generate, bad sizes are refused before any process starts, and no worker process outlives its
engine or server."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_engine_parity import _engine, _prompts, _run_and_compare, tiny_phi3, tiny_qwen3_moe  # noqa: F401 (fixtures)

from kubellm.runtime.distributed.parallel import Group
from kubellm.runtime.layers.parallel_linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from kubellm.runtime.layers.vocab_parallel import PAD, ParallelLMHead, VocabParallelEmbedding
from kubellm.runtime.models.loader import build_model, read_checkpoint
from kubellm.runtime.sampling.params import SamplingParams
from server_harness import free_port, wait_ready


def _tp_children() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("kubellm-tp")]


def test_each_rank_holds_its_slice_of_every_split_layer(tiny_qwen2):
    """Rows of q/k/v (and their biases) and gate/up by whole heads / channels, columns of o/down; the rest
    replicated. Concatenating the two ranks' shards gives back the unsharded model's tensors."""
    ckpt = read_checkpoint(tiny_qwen2)
    full, cfg = build_model(ckpt, torch.float32, "cpu", 256, False)
    ranks = [build_model(ckpt, torch.float32, "cpu", 256, False, tp=Group(rank=r, size=2))[0] for r in (0, 1)]
    h, kv, d = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
    for i, layer in enumerate(full.model.layers):
        shards = [m.model.layers[i] for m in ranks]
        for name in ("weight", "bias"):
            whole = getattr(layer.self_attn.qkv_proj, name)
            q, k, v = whole.split([h, kv, kv])
            parts = [getattr(s.self_attn.qkv_proj, name).split([h // 2, kv // 2, kv // 2]) for s in shards]
            for j, t in enumerate((q, k, v)):
                torch.testing.assert_close(torch.cat([p[j] for p in parts]), t, atol=0, rtol=0)
        torch.testing.assert_close(torch.cat([s.self_attn.o_proj.weight for s in shards], dim=1),
                                   layer.self_attn.o_proj.weight, atol=0, rtol=0)
        gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
        halves = [s.mlp.gate_up_proj.weight.chunk(2) for s in shards]
        torch.testing.assert_close(torch.cat([g for g, _ in halves]), gate, atol=0, rtol=0)
        torch.testing.assert_close(torch.cat([u for _, u in halves]), up, atol=0, rtol=0)
        torch.testing.assert_close(torch.cat([s.mlp.down_proj.weight for s in shards], dim=1),
                                   layer.mlp.down_proj.weight, atol=0, rtol=0)
        assert shards[0].self_attn.num_heads == cfg.num_heads // 2 and d == shards[1].self_attn.head_dim
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rule, whole = _put_back(ranks[0].get_submodule(name.rpartition(".")[0]), name,
                                [m.get_parameter(name) for m in ranks])
        assert rule == "vocab rows" and torch.equal(whole, full.get_parameter(name))


def _put_back(module, name: str, shards: list[torch.Tensor]) -> tuple[str, torch.Tensor]:
    """The unsharded tensor from the ranks' shards of one parameter, by the rule of the layer type holding it."""
    if isinstance(module, (VocabParallelEmbedding, ParallelLMHead)):  # rows by token id, the padding zero
        whole = torch.cat(shards)
        assert not whole[module.vocab_size :].any()
        return "vocab rows", whole[: module.vocab_size]
    if isinstance(module, MergedColumnParallelLinear):  # each part sliced by rows, parts one after the other
        rows = [r // len(shards) for r in module.part_rows.values()]  # the unsharded module's part sizes
        parts = [s.split(rows) for s in shards]
        return "fused parts", torch.cat([torch.cat([p[j] for p in parts]) for j in range(len(rows))])
    if isinstance(module, ColumnParallelLinear):
        return "rows", torch.cat(shards)
    if isinstance(module, RowParallelLinear) and name.endswith("weight"):
        return "columns", torch.cat(shards, dim=1)
    if isinstance(module, RowParallelLinear):  # the bias, added once by rank 0
        assert all(not s.any() for s in shards[1:])
        return "rank 0", shards[0]
    assert all(torch.equal(s, shards[0]) for s in shards)
    return "replicated", shards[0]


@pytest.mark.parametrize("fixture", ["tiny_phi3", "tiny_qwen3_moe"])
def test_fused_checkpoints_and_experts_shard_by_their_layer_types(fixture, request):
    """Phi-3's checkpoint stores q/k/v and gate/up fused: each part is sliced on its own, so a rank gets whole
    heads. Experts: every expert's gate/up by rows, its down by columns; routers and q/k norms replicated. Every
    parameter of the two ranks, put back together by its layer's rule, is the unsharded model's."""
    ckpt = read_checkpoint(request.getfixturevalue(fixture))
    full, cfg = build_model(ckpt, torch.float32, "cpu", 256, False)
    ranks = [build_model(ckpt, torch.float32, "cpu", 256, False, tp=Group(rank=r, size=2))[0] for r in (0, 1)]
    modules, rules = dict(full.named_modules()), set()
    for name, whole in full.named_parameters():
        rule, put_back = _put_back(modules[name.rpartition(".")[0]], name, [m.get_parameter(name) for m in ranks])
        assert torch.equal(put_back, whole), f"{name} ({rule})"
        rules.add(rule)
    assert rules == {"fused parts", "columns", "replicated", "vocab rows"}
    if cfg.moe is not None:
        expert = ranks[1].model.layers[0].mlp.experts[3]
        assert expert.gate_up_proj.weight.shape == (cfg.moe.intermediate_size, cfg.hidden_size)
        assert expert.down_proj.weight.shape == (cfg.hidden_size, cfg.moe.intermediate_size // 2)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_tp2_generates_what_transformers_generates(fixture, request):
    """The engine's hard paths (chunked prefill, preemption, prefix hits) with two ranks: greedy tokens equal
    to transformers' and logits within the fp32 parity tolerance (the all-reduce only reorders sums)."""
    model_dir = request.getfixturevalue(fixture)
    llm = _engine(model_dir, tensor_parallel_size=2)
    try:
        assert len(_tp_children()) == 1
        _run_and_compare(llm, model_dir, _prompts())
        assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.block_manager.prefix_hits > 0
        assert llm.engine.block_manager.num_used_blocks == 0
    finally:
        llm.close()
    assert _tp_children() == []


ODD_VOCAB = 509  # divisible neither by 2 nor by the padding multiple: rank 1's slice ends in padding rows


@pytest.mark.parametrize(("arch", "tied"), [("qwen3", True), ("qwen3", False), ("qwen3_moe", False)])
def test_each_rank_holds_a_padded_slice_of_the_vocabulary(arch, tied, tiny_checkpoint_factory):
    """Embedding and LM head rows by token id, round_up(ceil(509 / 2), 64) = 256 per rank, the last 3 of rank 1
    zero; a tied LM head is the embedding's own parameter on each rank."""
    ckpt = read_checkpoint(tiny_checkpoint_factory(arch, vocab_size=ODD_VOCAB, tie_word_embeddings=tied))
    full, cfg = build_model(ckpt, torch.float32, "cpu", 256, False)
    assert cfg.vocab_size == ODD_VOCAB
    ranks = [build_model(ckpt, torch.float32, "cpu", 256, False, tp=Group(rank=r, size=2))[0] for r in (0, 1)]
    rows = 256
    assert rows % PAD == 0 and rows * 2 >= ODD_VOCAB
    for m in ranks:
        assert m.model.embed_tokens.weight.shape == m.lm_head.weight.shape == (rows, cfg.hidden_size)
        assert (m.lm_head.weight is m.model.embed_tokens.weight) == tied
    assert not ranks[1].model.embed_tokens.weight[ODD_VOCAB - rows :].any()
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        _, whole = _put_back(ranks[0].get_submodule(name.rpartition(".")[0]), name,
                             [m.get_parameter(name) for m in ranks])
        assert torch.equal(whole, full.get_parameter(name))


@pytest.mark.parametrize(("arch", "tied"), [("qwen3", True), ("qwen3", False), ("qwen3_moe", False)])
def test_tp2_with_an_odd_vocabulary_generates_what_transformers_generates(arch, tied, tiny_checkpoint_factory):
    """Token ids on both ranks' slices (and next to the padding) in the prompts: the masked lookups summed by
    the all-reduce are the embedding, the gathered logits (padding dropped) transformers' logits."""
    model_dir = tiny_checkpoint_factory(arch, vocab_size=ODD_VOCAB, tie_word_embeddings=tied)
    prompts = _prompts(vocab=ODD_VOCAB)[:5] + [[ODD_VOCAB - 1, 255, 256, 0, ODD_VOCAB - 2]]
    llm = _engine(model_dir, tensor_parallel_size=2)
    try:
        _run_and_compare(llm, model_dir, prompts)
    finally:
        llm.close()


def test_tp2_prompt_logprobs_over_an_odd_vocabulary_equal_one_rank(tiny_checkpoint_factory):
    """Prompt logprobs take logits of rows other than the sampled ones: the ranks are asked for those too."""
    model_dir = tiny_checkpoint_factory("qwen3", vocab_size=ODD_VOCAB, tie_word_embeddings=True)
    prompts = _prompts(vocab=ODD_VOCAB)[5:7]  # 23 and 40 tokens
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    one = _engine(model_dir).generate(prompts, params, use_tqdm=False)
    llm = _engine(model_dir, tensor_parallel_size=2)
    try:
        two = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.close()
    for a, b in zip(one, two, strict=True):
        assert a.token_ids == b.token_ids and len(a.prompt_logprobs) == len(b.prompt_logprobs) > 20
        for x, y in zip(a.prompt_logprobs[1:] + a.logprobs, b.prompt_logprobs[1:] + b.logprobs, strict=True):
            assert [t for t, _ in x.top] == [t for t, _ in y.top] and abs(x.logprob - y.logprob) < 1e-4


def test_sizes_that_do_not_divide_the_model_are_refused_before_spawning(tiny_mistral):
    """Mistral's tiny checkpoint has one kv head: it cannot be split in two."""
    with pytest.raises(ValueError, match="tensor_parallel_size 2 does not divide the model's 1 kv heads"):
        _engine(tiny_mistral, tensor_parallel_size=2)
    assert _tp_children() == []


def test_a_lost_worker_fails_the_step_instead_of_hanging(tiny_llama):
    llm = _engine(tiny_llama, tensor_parallel_size=2)
    try:
        [worker] = _tp_children()
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        assert not llm.engine.workers_alive()
        with pytest.raises(RuntimeError):
            llm.generate([[5, 6, 7]], use_tqdm=False)
    finally:
        llm.close()


def _children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_serve_with_two_ranks_answers_and_drains_cleanly(tiny_llama, tmp_path):
    """`kubellm serve --tensor-parallel-size 2`: the OpenAI client gets what one rank generates, SIGTERM to the
    whole process group drains and exits 0 (the worker rank ignores it and leaves when rank 0 says so), and the
    worker rank is gone with the server."""
    import openai

    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kubellm.runtime.cli", "serve", "--model", str(tiny_llama), "--host",
             "127.0.0.1", "--admin-port", "0", "--port", str(port), "--dtype", "float32", "--kv-cache-memory", "16MiB",
             "--max-model-len", "256", "--served-model-name", "tiny", "--tensor-parallel-size", "2"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, [proc], log_path.read_text, 180)
        workers = _children_of(proc.pid)
        assert any(_running(w) for w in workers), "no worker rank process"
        prompt = _prompts()[4]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 8
        single = _engine(tiny_llama).generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                              use_tqdm=False)[0]
        assert out.choices[0].text == single.text  # TP=1, offline (equal to transformers by the tests above)
        # A stream in flight, then SIGTERM to the whole process group (as a Ctrl-C or systemd would): the worker
        # rank must stay until the drain is over, so the stream still runs to its length.
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=96, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = [next(iter(stream))]
        os.killpg(proc.pid, signal.SIGTERM)
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason == "length", log_path.read_text()
        assert proc.wait(timeout=60) == 0, log_path.read_text()
        assert "drain complete" in log_path.read_text()
        deadline = time.monotonic() + 10
        while any(_running(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_running(w) for w in workers), "a worker rank outlived the server"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _serve_cmd(model_dir, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kubellm.runtime.cli", "serve", "--model", str(model_dir), "--dtype", "float32",
            "--kv-cache-memory", "16MiB", "--max-model-len", "256", "--num-threads", "1", *extra]


def test_two_nodes_on_loopback_generate_what_one_rank_generates(tiny_llama, tmp_path):
    """Multi-node tensor parallelism as a LeaderWorkerSet runs it, with two processes on loopback as the two
    pods: the worker node starts first and waits for the leader's rendezvous (pods start in any order), the
    leader serves what TP=1 generates through one group spanning both, and when the leader drains and exits the
    worker node leaves with exit code 0."""
    import openai

    port, rendezvous = free_port(), free_port()
    nodes = ["--tensor-parallel-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{rendezvous}"]
    worker_log, leader_log = tmp_path / "node1.log", tmp_path / "node0.log"
    with open(worker_log, "w") as wlog, open(leader_log, "w") as llog:
        worker = subprocess.Popen(_serve_cmd(tiny_llama, *nodes, "--node-rank", "1"), stdout=wlog,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        time.sleep(2)  # the worker node is up before any leader exists
        assert worker.poll() is None, worker_log.read_text()
        leader = subprocess.Popen(
            _serve_cmd(tiny_llama, *nodes, "--host", "127.0.0.1", "--port", str(port), "--admin-port", "0",
                       "--served-model-name", "tiny"),
            stdout=llog, stderr=subprocess.STDOUT, start_new_session=True)
    logs = lambda: f"leader:\n{leader_log.read_text()}\nworker node:\n{worker_log.read_text()}"  # noqa: E731
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, [leader, worker], logs, 180)
        assert not [w for w in _children_of(leader.pid) if _running(w)], "node 0 must hold rank 0 only"
        prompts = _prompts()[3:6]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        single = _engine(tiny_llama).generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                              use_tqdm=False)
        for prompt, expected in zip(prompts, single, strict=True):
            out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].text == expected.text, logs()
        os.killpg(leader.pid, signal.SIGTERM)  # a rollout deletes the group's pods: the leader drains first
        os.killpg(worker.pid, signal.SIGTERM)  # ignored: the worker node leaves when rank 0 ends the group
        assert leader.wait(timeout=60) == 0, logs()
        assert worker.wait(timeout=60) == 0, logs()
    finally:
        for proc in (leader, worker):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_a_worker_node_whose_leader_is_gone_exits_non_zero(tiny_llama, tmp_path):
    """Node 1 of a group whose rank 0 dies mid-serving must not hang: it exits 1 with one clear line, so the
    LeaderWorkerSet restarts the group."""
    port, rendezvous = free_port(), free_port()
    nodes = ["--tensor-parallel-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{rendezvous}"]
    log_path = tmp_path / "node1.log"
    with open(log_path, "w") as log:
        leader = subprocess.Popen(_serve_cmd(tiny_llama, *nodes, "--host", "127.0.0.1", "--port", str(port),
                                             "--admin-port", "0"), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)
        worker = subprocess.Popen(_serve_cmd(tiny_llama, *nodes, "--node-rank", "1"), stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", [leader], log_path.read_text, 180)
        os.killpg(leader.pid, signal.SIGKILL)
        assert worker.wait(timeout=60) == 1, log_path.read_text()
        assert "node 1 left the tensor-parallel group" in log_path.read_text()
    finally:
        for proc in (leader, worker):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tensor_parallel_size": 3, "nnodes": 2, "dist_init_addr": "h:1"}, "must be a multiple of nnodes"),
    ({"tensor_parallel_size": 2, "nnodes": 2}, "needs dist_init_addr HOST:PORT"),
    ({"tensor_parallel_size": 2, "nnodes": 2, "dist_init_addr": "leader"}, "needs dist_init_addr HOST:PORT"),
    ({"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "node_rank must be in"),
])
def test_bad_node_settings_are_refused_with_the_reason(kwargs, message):
    from kubellm.runtime.engine.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(model="unused", device="cpu", **kwargs)
