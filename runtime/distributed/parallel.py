"""Tensor parallelism (``--tensor-parallel-size N``): one process per rank, each holding 1/N of every layer.

Megatron-style sharding by the layer types of runtime/layers/parallel_linear.py, which load their own slices:
q/k/v and gate/up are split by output (whole heads, whole intermediate channels), o_proj and down_proj by
input, and the two partial outputs per layer are summed with an all-reduce; the embedding and the LM head are
split by vocabulary rows (runtime/layers/vocab_parallel.py), norms replicated, so every rank ends a step with
the same hidden states; rank 0 then broadcasts which rows it needs logits for, every rank computes its
vocabulary slice, the slices are gathered and only rank 0 samples. Each rank's KV pool holds its own kv heads, in blocks numbered alike
on every rank, so one scheduler (rank 0's) serves them all.

Rank 0 is the engine's own process. It hosts the rendezvous (a TCP store) and spawns its node's other ranks
(:func:`worker_main`), which load their shards and then replay each step: rank 0 pickles the step's prepared
inputs (token ids, positions, attention metadata) and broadcasts them, every rank runs the forward pass. The
group and its collectives are :mod:`kubellm.runtime.distributed.tp_group`; this module starts the ranks and runs them.

Several nodes (``--nnodes N``, one pod each in a LeaderWorkerSet): node k holds ranks k*L..k*L+L-1 (L = size /
N). Node 0 is the server; nodes 1..N-1 run ``kubellm serve --node-rank k`` (:func:`run_node`), which starts
only their ranks, reaches node 0 at ``--dist-init-addr`` and exits when rank 0 ends the group. Nothing else
differs: one group, one scheduler, the same broadcast and all-reduce (over the network, which is why tensor
parallelism across nodes only pays on fast interconnects).

On CUDA a rank uses ``cuda:<its index on the node>``. The CUDA path has not yet run on GPUs; the CPU path is
tested (TP=2 equal to TP=1 and to transformers, on one node and as two "nodes" on loopback).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import signal
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from kubellm.runtime.distributed.tp_group import EXIT, LOGITS, Group, check_divisible, join_group
from kubellm.runtime.engine import host_malloc
from kubellm.runtime.engine.model_runner import ModelRunner
from kubellm.runtime.layers import kernel_choice
from kubellm.runtime.layers.kernel_choice import KernelChoice
from kubellm.runtime.models.loader import build_model, keeps_gguf_packed, read_checkpoint
from kubellm.runtime.quantization.registry import quantize_model
from kubellm.runtime.sampling.sampler import Sampler

__all__ = ["Group", "check_divisible", "start", "run_node", "worker_main", "build_rank_runner"]

log = logging.getLogger("kubellm.parallel")

# How long a rank keeps trying to reach the rendezvous: another node's pod may still be pulling its image or
# downloading the model.
RENDEZVOUS_TIMEOUT = timedelta(minutes=30)


def start(config, max_model_len: int, kernels: KernelChoice) -> Group:
    """Rank 0: host the rendezvous, spawn this node's other ranks and join the group with every rank (those of
    the other nodes too, with ``nnodes`` > 1); then hand every rank the served length and rank 0's ``kernels``.
    Fails (terminating this node's ranks) if one exits before it joined."""
    size, local = config.tensor_parallel_size, config.ranks_per_node
    _, port = config.rendezvous  # node 0 listens on every interface; its own ranks connect over loopback
    store = dist.TCPStore("127.0.0.1", port, size, is_master=True, wait_for_workers=False)
    workers = _spawn(config, range(1, local), "127.0.0.1", store.port)
    if config.nnodes > 1:
        log.info("tensor parallelism: waiting for %d rank(s) of %d other node(s) at port %d", size - local,
                 config.nnodes - 1, store.port)
    group = _join(store, 0, config, workers)
    group.workers = workers
    group.broadcast((max_model_len, kernels))
    torch.set_num_threads(_threads(config))
    log.info("tensor parallelism: %d ranks on %d node(s) (%s), this is rank 0", size, config.nnodes, config.device)
    return group


def run_node(config) -> int:
    """Nodes 1..N-1 (``--node-rank`` > 0): this node's ranks, and no server. Returns 0 when rank 0 ends the group
    (after its drain); raises when the group breaks (rank 0 gone), so the pod restarts with its leader."""
    from kubellm.runtime.models.store import resolve

    config = dataclasses.replace(config, model=str(resolve(config.model)))  # this node's own copy
    first = config.node_rank * config.ranks_per_node
    host, port = config.rendezvous
    log.info("tensor parallelism: node %d of %d, ranks %d..%d, rendezvous at %s:%d", config.node_rank,
             config.nnodes, first, first + config.ranks_per_node - 1, host, port)
    _ignore_stop_signals()
    workers = _spawn(config, range(first + 1, first + config.ranks_per_node), host, port)
    try:
        worker_main(config, first, host, port, _threads(config))
    finally:
        for p in workers:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return 0


def _spawn(config, ranks: range, host: str, port: int) -> list:
    ctx = mp.get_context("spawn")
    workers = [ctx.Process(target=worker_main, args=(config, rank, host, port, _threads(config)),
                           name=f"kubellm-tp{rank}", daemon=True) for rank in ranks]
    for p in workers:
        p.start()
    return workers


def _join(store, rank: int, config, workers: list) -> Group:
    """Join the group on a thread while watching this node's rank processes: one that dies before the group is
    complete fails the start instead of leaving it waiting forever."""
    joined: dict = {}

    def join() -> None:
        try:
            joined["group"] = join_group(store, rank, config.tensor_parallel_size, config.device,
                                         rank % config.ranks_per_node)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            joined["error"] = e

    t = threading.Thread(target=join, name="tp-join", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.2)
        dead = [p for p in workers if not p.is_alive()]
        if dead and t.is_alive():
            for p in workers:
                p.kill()  # the ranks ignore SIGTERM
            raise RuntimeError(f"tensor-parallel worker {dead[0].name} exited with code {dead[0].exitcode} "
                               "before joining the group")
    if "error" in joined:
        for p in workers:
            p.kill()  # the ranks ignore SIGTERM
        raise joined["error"]
    return joined["group"]


def _threads(config) -> int:
    """CPU threads per rank: the engine's budget shared out over this node's ranks, so they do not
    oversubscribe the cores."""
    total = config.num_threads or torch.get_num_threads()
    return max(1, total // config.ranks_per_node)


def _ignore_stop_signals() -> None:
    # Rank 0 decides when the ranks stop (after a drain): a Ctrl-C or a SIGTERM to the whole process group (or
    # to every pod of a multi-node group) must not take a rank away mid-drain. If rank 0 dies, the next
    # broadcast fails and the rank exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def worker_main(config, rank: int, host: str, port: int, threads: int) -> None:
    """Ranks 1..N-1: join, take the served length and kernels from rank 0, load this rank's shard, agree on the
    KV pool, then replay rank 0's steps."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s tp{rank} %(name)s: %(message)s")
    _ignore_stop_signals()
    torch.set_num_threads(threads)
    # Another node's store may not be up yet (pods start in any order): the client retries until the timeout.
    store = dist.TCPStore(host, port, config.tensor_parallel_size, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
    group = join_group(store, rank, config.tensor_parallel_size, config.device, rank % config.ranks_per_node)
    max_model_len, kernels = group.broadcast()
    runner = build_rank_runner(config, group, max_model_len, kernels)
    while True:
        step = group.broadcast()
        if step[0] == EXIT:
            break
        if step[0] == LOGITS:
            runner.replay_logits(*step[1:])  # ("logits", rows of the last step's hidden states)
        else:
            runner.replay(*step[1:])  # ("step", input_ids, positions, meta)


def build_rank_runner(config, tp: Group, max_model_len: int, kernels: KernelChoice) -> ModelRunner:
    """Ranks 1..N-1 of tensor parallelism: this rank's shards and KV pool (rank 0 sizes it), no scheduler."""
    if config.device == "cpu":
        host_malloc.tune()
    kernel_choice.load(kernels)
    ckpt = read_checkpoint(config.model)
    model, cfg = build_model(ckpt, config.dtype, tp.device, max_model_len, False, tp=tp, kernels=kernels,
                             keep_packed=keeps_gguf_packed(config.quantization))
    quantize_model(model, config.quantization, kernels)
    num_blocks = tp.broadcast()
    return ModelRunner(model, cfg, num_blocks, config.block_size, config.dtype, tp.device, Sampler([]), kernels)
