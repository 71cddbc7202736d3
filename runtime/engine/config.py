"""Engine configuration: one dataclass, filled from CLI flags or keyword arguments."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from kubellm.runtime.engine.settings import (
    ATTENTION_BACKENDS,
    CPU_INT4_ACTIVATIONS,
    LAYER_OPS,
    PREPACK_WEIGHTS,
    SPECULATIVE_METHODS,
    default,
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


@dataclass
class EngineConfig:
    """Everything the engine needs besides the checkpoint itself.

    KV-cache size: ``num_kv_blocks`` if given; else ``kv_cache_memory`` bytes; else
    ``kv_cache_memory_fraction`` of the device memory still free after the weights are loaded
    (on CPU at most 4 GiB by default, the way vLLM's CPU build sizes it).
    """

    model: str
    dtype: str | torch.dtype = default("dtype")  # auto: bfloat16 on CUDA and on CPUs with AMX/avx512-bf16, else float32
    device: str = default("device")
    max_model_len: int | None = default("max_model_len")  # default: the checkpoint's max_position_embeddings
    max_num_seqs: int = default("max_num_seqs")
    max_num_batched_tokens: int = default("max_num_batched_tokens")
    block_size: int = default("block_size")
    num_kv_blocks: int | None = None
    kv_cache_memory: int | str | None = default("kv_cache_memory")
    kv_cache_memory_fraction: float = default("kv_cache_memory_fraction")
    enable_prefix_caching: bool = default("enable_prefix_caching")
    enable_chunked_prefill: bool = True
    # Kernels (runtime/layers/kernel_choice.py decides what auto means here): each setting chooses only what it names.
    attention_backend: str = default("attention_backend")  # auto | torch | cpu (native CPU kernels) | triton
    layer_ops: str = default("layer_ops")  # auto | native (fused CPU RMSNorm/rotary/SiLU-and-mul) | triton | torch
    prepack_weights: str = default("prepack_weights")  # auto | native | onednn | on | off: dense linear weights packed once
    cpu_int4_activations: str = default("cpu_int4_activations")  # auto | bf16 | int8: the native int4 GEMM's activations
    quantization: str = default("quantization")  # runtime/quantization/registry.py METHODS (one module per format)
    tensor_parallel_size: int = default("tensor_parallel_size")  # processes (ranks) each holding 1/N of every layer (runtime/distributed/parallel.py)
    nnodes: int = default("nnodes")  # nodes (pods) the ranks span, tensor_parallel_size / nnodes on each
    node_rank: int = default("node_rank")  # this node: 0 serves; the others only run their ranks
    dist_init_addr: str | None = default("dist_init_addr")  # HOST:PORT of node 0's rendezvous (nnodes > 1)
    num_threads: int | None = default("num_threads")  # CPU intra-op threads; default: all cores torch sees
    speculative_ngram: int = default("speculative_ngram")  # prompt-lookup speculation: longest n-gram matched (0 = off; runtime/spec_decode/speculative.py)
    speculative_model: str | None = default("speculative_model")  # draft-model speculation: the draft's path (runtime/spec_decode/draft_model.py)
    speculative_method: str = default("speculative_method")  # draft_model | eagle: what speculative_model is (runtime/spec_decode/eagle.py)
    num_speculative_tokens: int = default("num_speculative_tokens")  # draft tokens verified per step, with speculation on
    cuda_graphs: bool = default("cuda_graphs")  # decode steps replayed from CUDA graphs (CUDA only; runtime/engine/cuda_graphs.py)
    cuda_graph_max_batch_size: int = default("cuda_graph_max_batch_size")  # largest captured decode batch (rows)
    seed: int = default("seed")

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
