"""A tensor-parallel group: this process's rank and the collectives the sharded layers call.

Collectives run on process groups built directly on a TCP store (no ``torch.distributed`` global state, so
several engines can live in one process): gloo on CPU; on CUDA, NCCL for the all-reduce and gloo for the step
broadcast. :mod:`kubellm.runtime.distributed.parallel` starts the ranks; the models take a :class:`Group` (size 1 without
tensor parallelism).
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("kubellm.parallel")

# Collectives wait this long: an idle server's workers sit in the step broadcast for as long as it is idle.
# A dead peer breaks the connection and fails the waiting collective at once; a wedged one is the liveness
# probe's to catch.
_COLLECTIVE_TIMEOUT = timedelta(days=365)
EXIT = "exit"  # the step broadcast that ends the ranks
LOGITS = "logits"  # the broadcast that asks the ranks for their vocabulary slices of the last step's logits


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
    workers: list = dataclasses.field(default_factory=list)  # rank 0: the processes of ranks 1..N-1
    _store: object = None
    _closed: bool = False  # rank 0 has ended the group

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

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension, in rank order, on every rank."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._reduce.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

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

    def workers_alive(self) -> bool:
        """Rank 0: whether every rank process it started is still running (always, without tensor parallelism)."""
        return all(p.is_alive() for p in self.workers)

    def shutdown(self) -> None:
        """Rank 0: tell every other rank to exit (other nodes' too) and wait for this node's (then make sure)."""
        if self.rank != 0 or self.size == 1 or self._closed:
            return
        self._closed = True
        try:
            self.broadcast((EXIT,))
        except Exception as e:  # noqa: BLE001 - a worker already gone: terminate the rest below
            log.warning("tensor-parallel shutdown: %s", e)
        for p in self.workers:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()  # the ranks ignore SIGTERM
                p.join(timeout=5)
        self.workers = []


def _to_device(obj, device: str):
    if isinstance(obj, torch.Tensor):
        return obj if obj.device.type == torch.device(device).type else obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, device) for o in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _to_device(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def _rank_device(device: str, local_rank: int) -> str:
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        return f"cuda:{local_rank}"
    return device


def join_group(store, rank: int, size: int, device: str, local_rank: int | None = None) -> Group:
    """Join as ``rank`` of ``size``; ``local_rank`` (default: ``rank``) picks this node's GPU."""
    local = rank if local_rank is None else local_rank
    group = Group(rank=rank, size=size, device=_rank_device(device, local), _store=store)
    group._objects = dist.ProcessGroupGloo(dist.PrefixStore("objects", store), rank, size, _COLLECTIVE_TIMEOUT)
    if device.startswith("cuda"):
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = _COLLECTIVE_TIMEOUT
        group._reduce = dist.ProcessGroupNCCL(dist.PrefixStore("reduce", store), rank, size, options)
    else:
        group._reduce = dist.ProcessGroupGloo(dist.PrefixStore("reduce", store), rank, size, _COLLECTIVE_TIMEOUT)
    return group
