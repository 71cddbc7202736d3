"""Tensor parallelism (``--tensor-parallel-size N``): one process per rank, each holding 1/N of every layer.

Megatron-style sharding of the Llama layers: q/k/v and gate/up are split by output (whole heads, whole
intermediate channels), o_proj and down_proj by input, and the two partial outputs per layer are summed with
an all-reduce; embeddings, norms and the LM head are replicated, so every rank ends a step with the same
hidden states and only rank 0 samples. Each rank's KV pool holds its own kv heads, in blocks numbered alike
on every rank, so one scheduler (rank 0's) serves them all.

Rank 0 is the engine's own process. It spawns ranks 1..N-1 (:func:`worker_main`), which load their shards
and then replay each step: rank 0 pickles the step's prepared inputs (token ids, positions, attention
metadata) and broadcasts them, every rank runs the forward pass. The group and its collectives are
:mod:`kubellm.runtime.tp_group`; this module starts the ranks and runs them.

On CUDA rank r uses ``cuda:r``. The CUDA path has not yet run on GPUs; the CPU path is tested (TP=2 equal
to TP=1 and to transformers).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import threading

import torch
import torch.distributed as dist

from kubellm.runtime import host_malloc, kernel_choice
from kubellm.runtime.kernel_choice import KernelChoice
from kubellm.runtime.model_runner import ModelRunner
from kubellm.runtime.models.loader import build_model, read_checkpoint
from kubellm.runtime.quantization import quantize_model
from kubellm.runtime.sampler import Sampler
from kubellm.runtime.tp_group import EXIT, Group, check_divisible, join_group

__all__ = ["Group", "check_divisible", "start", "worker_main", "build_rank_runner"]

log = logging.getLogger("kubellm.parallel")


def start(config, max_model_len: int, kernels: KernelChoice) -> Group:
    """Rank 0: spawn the other ranks and join the group with them. Fails (terminating them) if one exits
    before it joined. Every rank serves ``max_model_len`` with rank 0's ``kernels``."""
    size = config.tensor_parallel_size
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    workers = [ctx.Process(target=worker_main, args=(config, max_model_len, kernels, rank, size, store.port, _threads(config, size)),
                           name=f"kubellm-tp{rank}", daemon=True) for rank in range(1, size)]
    for p in workers:
        p.start()
    joined: dict = {}

    def join() -> None:
        try:
            joined["group"] = join_group(store, 0, size, config.device)
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
    group = joined["group"]
    group.workers = workers
    torch.set_num_threads(_threads(config, size))
    log.info("tensor parallelism: %d ranks (%s), this is rank 0", size, config.device)
    return group


def _threads(config, size: int) -> int:
    """CPU threads per rank: the engine's budget shared out, so ranks do not oversubscribe the cores."""
    total = config.num_threads or torch.get_num_threads()
    return max(1, total // size)


def worker_main(config, max_model_len: int, kernels: KernelChoice, rank: int, size: int, port: int,
                threads: int) -> None:
    """Ranks 1..N-1: join, load this rank's shard, agree on the KV pool, then replay rank 0's steps."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s tp{rank} %(name)s: %(message)s")
    # Rank 0 decides when the ranks stop (after a drain): a Ctrl-C or a SIGTERM to the whole process group must
    # not take a rank away mid-drain. If rank 0 dies, the next broadcast fails and this process exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False)
    group = join_group(store, rank, size, config.device)
    runner = build_rank_runner(config, group, max_model_len, kernels)
    while True:
        step = group.broadcast()
        if step[0] == EXIT:
            break
        runner.replay(*step[1:])  # ("step", input_ids, positions, meta)


def build_rank_runner(config, tp: Group, max_model_len: int, kernels: KernelChoice) -> ModelRunner:
    """Ranks 1..N-1 of tensor parallelism: this rank's shards and KV pool (rank 0 sizes it), no scheduler."""
    if config.device == "cpu":
        host_malloc.tune()
    kernel_choice.load(kernels)
    ckpt = read_checkpoint(config.model)
    model, cfg = build_model(ckpt, config.dtype, tp.device, max_model_len, False, tp=tp)
    quantize_model(model, config.quantization, kernels)
    num_blocks = tp.broadcast()
    return ModelRunner(model, cfg, num_blocks, config.block_size, config.dtype, tp.device, Sampler([]), kernels)
