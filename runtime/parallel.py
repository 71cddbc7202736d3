"""Tensor parallelism (``--tensor-parallel-size N``): one process per rank, each holding 1/N of every layer.

Megatron-style sharding of the Llama layers: q/k/v and gate/up are split by output (whole heads, whole
intermediate channels), o_proj and down_proj by input, and the two partial outputs per layer are summed with
an all-reduce; embeddings, norms and the LM head are replicated, so every rank ends a step with the same
hidden states and only rank 0 samples. Each rank's KV pool holds its own kv heads, in blocks numbered alike
on every rank, so one scheduler (rank 0's) serves them all.

Rank 0 is the engine's own process. It spawns ranks 1..N-1 (:func:`worker_main`), which load their shards
and then replay each step: rank 0 pickles the step's prepared inputs (token ids, positions, attention
metadata) and broadcasts them, every rank runs the forward pass. Collectives run on process groups built
directly on a TCP store (no ``torch.distributed`` global state, so several engines can live in one
process): gloo on CPU; on CUDA, NCCL for the all-reduce and gloo for the step broadcast.

On CUDA rank r uses ``cuda:r``. The CUDA path has not yet run on GPUs; the CPU path is tested (TP=2 equal
to TP=1 and to transformers).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import pickle
import signal
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("kubellm.parallel")

# Collectives wait this long: an idle server's workers sit in the step broadcast for as long as it is idle.
# A dead peer breaks the connection and fails the waiting collective at once; a wedged one is the liveness
# probe's to catch.
_COLLECTIVE_TIMEOUT = timedelta(days=365)
_EXIT = "exit"


def check_divisible(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int) -> None:
    """Every rank must get whole heads and an equal share of the MLP."""
    for what, n in (("attention heads", num_heads), ("kv heads", num_kv_heads),
                    ("MLP channels (intermediate_size)", intermediate_size)):
        if n % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide the model's {n} {what}")


@dataclasses.dataclass
class Group:
    """This process's rank in a tensor-parallel group, and the group's collectives (None when size is 1)."""

    rank: int = 0
    size: int = 1
    device: str = "cpu"
    _reduce: object = None  # the process group of the all-reduce
    _objects: object = None  # the gloo group of the step broadcast
    _workers: list = dataclasses.field(default_factory=list)
    _store: object = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (float32 sums for bf16/fp16 on CPU: gloo's own are slower)."""
        if self.size == 1:
            return x
        if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
            wide = x.float()
            self._reduce.allreduce([wide]).wait()
            x.copy_(wide)
        else:
            self._reduce.allreduce([x]).wait()
        return x

    def broadcast(self, obj: object = None) -> object:
        """Rank 0 sends ``obj``; every rank returns it. Tensors travel on the CPU and land on this rank's device."""
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(_to_device(obj, "cpu"))), dtype=torch.uint8)
            length = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        self._objects.broadcast(length, 0).wait()
        if self.rank != 0:
            payload = torch.empty(int(length), dtype=torch.uint8)
        self._objects.broadcast(payload, 0).wait()
        return obj if self.rank == 0 else _to_device(pickle.loads(payload.numpy().tobytes()), self.device)

    def shutdown(self) -> None:
        """Rank 0: tell the workers to exit and wait for them (then make sure)."""
        if self.rank != 0 or self.size == 1 or not self._workers:
            return
        try:
            self.broadcast((_EXIT,))
        except Exception as e:  # noqa: BLE001 - a worker already gone: terminate the rest below
            log.warning("tensor-parallel shutdown: %s", e)
        for p in self._workers:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()  # the ranks ignore SIGTERM
                p.join(timeout=5)
        self._workers = []


def _to_device(obj, device: str):
    if isinstance(obj, torch.Tensor):
        return obj if obj.device.type == torch.device(device).type else obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, device) for o in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _to_device(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def _rank_device(device: str, rank: int) -> str:
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
        return f"cuda:{rank}"
    return device


def _join(store, rank: int, size: int, device: str) -> Group:
    group = Group(rank=rank, size=size, device=_rank_device(device, rank), _store=store)
    group._objects = dist.ProcessGroupGloo(dist.PrefixStore("objects", store), rank, size, _COLLECTIVE_TIMEOUT)
    if device.startswith("cuda"):
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = _COLLECTIVE_TIMEOUT
        group._reduce = dist.ProcessGroupNCCL(dist.PrefixStore("reduce", store), rank, size, options)
    else:
        group._reduce = dist.ProcessGroupGloo(dist.PrefixStore("reduce", store), rank, size, _COLLECTIVE_TIMEOUT)
    return group


def start(config) -> Group:
    """Rank 0: spawn the other ranks and join the group with them. Fails (terminating them) if one exits
    before it joined."""
    size = config.tensor_parallel_size
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    workers = [ctx.Process(target=worker_main, args=(config, rank, size, store.port, _threads(config, size)),
                           name=f"kubellm-tp{rank}", daemon=True) for rank in range(1, size)]
    for p in workers:
        p.start()
    joined: dict = {}

    def join() -> None:
        try:
            joined["group"] = _join(store, 0, size, config.device)
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
    group._workers = workers
    torch.set_num_threads(_threads(config, size))
    log.info("tensor parallelism: %d ranks (%s), this is rank 0", size, config.device)
    return group


def _threads(config, size: int) -> int:
    """CPU threads per rank: the engine's budget shared out, so ranks do not oversubscribe the cores."""
    total = config.num_threads or torch.get_num_threads()
    return max(1, total // size)


def worker_main(config, rank: int, size: int, port: int, threads: int) -> None:
    """Ranks 1..N-1: join, load this rank's shard, agree on the KV pool, then replay rank 0's steps."""
    from kubellm.runtime.engine import build_rank_runner

    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s tp{rank} %(name)s: %(message)s")
    # Rank 0 decides when the ranks stop (after a drain): a Ctrl-C or a SIGTERM to the whole process group must
    # not take a rank away mid-drain. If rank 0 dies, the next broadcast fails and this process exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False)
    group = _join(store, rank, size, config.device)
    runner = build_rank_runner(config, group)
    while True:
        step = group.broadcast()
        if step[0] == _EXIT:
            break
        runner.replay(*step[1:])  # ("step", input_ids, positions, meta)
