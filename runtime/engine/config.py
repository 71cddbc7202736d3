"""Engine configuration: one dataclass, its fields the settings table's rows (plus a few engine-only ones)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from kubellm.runtime.engine.settings import (
    ATTENTION_BACKENDS,
    CPU_INT4_ACTIVATIONS,
    ENGINE_SETTINGS,
    LAYER_OPS,
    PREPACK_WEIGHTS,
    SPECULATIVE_METHODS,
    EngineSetting,
)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    try:
        return _DTYPES[value.lower()]
    except KeyError:
        raise ValueError(f"dtype: unknown {value!r}; use one of float32, bfloat16, float16") from None


def parse_size(value: str | int) -> int:
    """'4GiB', '512MB', '1.5G' or plain bytes → bytes (K/M/G/T are powers of 1024)."""
    if isinstance(value, int):
        return value
    m = _SIZE.match(value)
    if not m:
        raise ValueError(f"size: cannot parse {value!r}; write e.g. 4GiB, 512MiB or a byte count")
    scale = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[(m.group(2) or "")[:1].lower()]
    return int(float(m.group(1)) * scale)


def with_settings(table: tuple[EngineSetting, ...]):
    """Class decorator: one dataclass field per row of ``table``, after the class's own fields, typed by the
    row's ``type`` (``| None`` when its default is None) and defaulting to the row's ``default``; then the class
    is made a dataclass. A name both declared in the class and in the table is refused (one declaration)."""

    def add_fields(cls: type) -> type:
        annotations = cls.__dict__.get("__annotations__", {})
        cls.__annotations__ = annotations
        for s in table:
            if s.name in annotations:
                raise TypeError(f"{cls.__name__}.{s.name} is declared both in the class and in the settings table")
            annotations[s.name] = s.type | None if s.default is None else s.type
            setattr(cls, s.name, s.default)
        return dataclass(cls)

    return add_fields


@with_settings(ENGINE_SETTINGS)
class EngineConfig:
    """Everything the engine needs besides the checkpoint itself.

    Fields: the engine-only ones below, then one per row of ``ENGINE_SETTINGS`` (runtime/engine/settings.py:
    name, type, default and meaning), added by :func:`with_settings`. ``__post_init__`` resolves ``auto``
    device and dtype, turns ``dtype`` into a ``torch.dtype`` and ``kv_cache_memory`` into bytes, and checks the rest.

    KV-cache size: ``num_kv_blocks`` if given; else ``kv_cache_memory`` bytes; else
    ``kv_cache_memory_fraction`` of the device memory still free after the weights are loaded
    (on CPU at most 4 GiB by default, the way vLLM's CPU build sizes it).
    """

    # Engine-only: not user settings (no CLI flag, no CRD field).
    model: str
    num_kv_blocks: int | None = None  # a fixed KV-cache size (tests, tools): overrides the memory budget
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_size(self.kv_cache_memory)
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.dtype == "auto":
            self.dtype = torch.bfloat16 if (self.device == "cuda" or _cpu_has_fast_bf16()) else torch.float32
        self.dtype = parse_dtype(self.dtype)
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "cuda_graph_max_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.speculative_ngram < 0 or self.num_speculative_tokens < 1:
            raise ValueError(f"speculative_ngram must be >= 0 and num_speculative_tokens >= 1, got "
                             f"{self.speculative_ngram} and {self.num_speculative_tokens}")
        if self.speculative_ngram and self.speculative_model:
            raise ValueError("speculative decoding takes one proposer: --speculative-ngram or --speculative-model, "
                             "not both")
        if self.speculative_model and self.tensor_parallel_size > 1:
            raise ValueError("--speculative-model with --tensor-parallel-size > 1 is not supported; use "
                             "--speculative-ngram, or serve without tensor parallelism")
        if self.speculative_method == "eagle" and not self.speculative_model:
            raise ValueError("--speculative-method eagle needs --speculative-model PATH: the EAGLE head's folder")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        for name, choices in (("attention_backend", ATTENTION_BACKENDS), ("layer_ops", LAYER_OPS),
                              ("prepack_weights", PREPACK_WEIGHTS), ("speculative_method", SPECULATIVE_METHODS),
                              ("cpu_int4_activations", CPU_INT4_ACTIVATIONS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}: unknown {getattr(self, name)!r}; use {', '.join(choices)}")
        from kubellm.runtime.quantization.registry import check_method

        check_method(self.quantization)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        self._check_nodes()
        if self.device.startswith("cuda") and self.tensor_parallel_size > 1:
            count, local = torch.cuda.device_count(), self.ranks_per_node
            if count < local:
                raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} over {self.nnodes} node(s) needs "
                                 f"{local} GPUs on each; {count} visible")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    def _check_nodes(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes); got node_rank {self.node_rank}, nnodes {self.nnodes}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} must be a multiple of nnodes "
                             f"{self.nnodes}: every node holds the same number of ranks")
        if self.nnodes > 1:
            host, _, port = (self.dist_init_addr or "").rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"nnodes {self.nnodes} needs dist_init_addr HOST:PORT (node 0's rendezvous), got "
                                 f"{self.dist_init_addr!r}")

    @property
    def rendezvous(self) -> tuple[str, int]:
        """Where the ranks meet: node 0's HOST:PORT with several nodes, else a free port on loopback (0)."""
        if self.nnodes == 1:
            return "127.0.0.1", 0
        host, _, port = self.dist_init_addr.rpartition(":")
        return host.strip("[]"), int(port)


def _cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 (AMX CPUs have it too), as capped by KUBELLM_CPU_ISA."""
    from kubellm.kernels.cpu_extension import supported_levels

    return "x86-64-v4-bf16" in supported_levels()


def available_memory_bytes(device: str, cgroup_root: str = "/sys/fs/cgroup") -> int:
    """Bytes free on the device now: CUDA's mem_get_info; on CPUs the smaller of the host's MemAvailable and
    what the container's cgroup memory limit still allows (a pod sees the whole node in /proc/meminfo, so
    sizing from it alone gets the pod OOM-killed)."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
        return free
    host = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    host = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if host is None:
        host = (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")) if hasattr(os, "sysconf") else 8 * 2**30
    container = cgroup_memory_headroom(cgroup_root)
    return host if container is None else min(host, container)


def cgroup_memory_headroom(root: str = "/sys/fs/cgroup") -> int | None:
    """Limit minus current usage of this process's memory cgroup (v2, else v1); None when unlimited/unknown."""
    candidates = (("memory.max", "memory.current"),  # cgroup v2 (the container's own cgroup is mounted at root)
                  ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"))  # cgroup v1
    for limit_name, usage_name in candidates:
        try:
            with open(os.path.join(root, limit_name)) as f:
                limit_text = f.read().strip()
            with open(os.path.join(root, usage_name)) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max":
            return None
        try:
            limit = int(limit_text)
        except ValueError:
            continue
        if limit >= 2**60:  # cgroup v1 spells "unlimited" as a huge page-aligned number
            return None
        return max(0, limit - usage)
    return None
