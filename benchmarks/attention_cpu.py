"""Microbenchmark: CPU paged-attention decode; native kernel vs the runtime's torch path vs the reference.

For every (shape, dtype, batch, context) it builds a paged K/V pool with shuffled block ids, gives every
sequence the same context length, and times one decode-attention call (one layer) of:

* ``kernel``: ``kubellm.kernels.cpu_paged_attention.paged_decode_attention`` (C++, reads the pool in place);
* ``runtime``: ``TorchAttentionBackend._decode``, the torch path the runtime uses today (index_select the
  blocks, then per-kv-head bmm + softmax), with its metadata (block ids, bias) built outside the timing as
  the model runner does once per step;
* ``reference``: ``reference_paged_decode_attention`` (per-sequence gather + einsum; written for clarity).

Cache state: by default (``--cold``) each timed call reads a different copy of the pool, with enough copies
(at least ``--cold-mib`` MiB in all) that the pool is not in the CPU caches, as in a real decode step where
the other layers' weights and K/V pass through the caches in between. ``--warm`` re-reads one pool, which
measures the kernel's compute rate whenever the pool fits in L2/L3.

Times are medians (ms per call) over ``--repeats`` samples of several calls each. ``GB/s`` is the K/V bytes
the call must read divided by the kernel's time.

    python benchmarks/attention_cpu.py                       # the full grid
    python benchmarks/attention_cpu.py --shapes smollm2 --dtypes bfloat16 --batch-sizes 64 --contexts 256
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
from collections.abc import Callable

import torch

from kubellm.kernels import cpu_paged_attention as cpa
from kubellm.runtime.layers.attention import AttentionMetadata, TorchAttentionBackend

SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}  # num_heads, num_kv_heads, head_dim
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def time_calls(fns: list[Callable[[], object]], repeats: int, target_s: float) -> float:
    """Median seconds per call over ``repeats`` samples of enough calls (cycling through ``fns``) to last
    about ``target_s`` each."""
    calls = 0

    def call() -> None:
        nonlocal calls
        fns[calls % len(fns)]()
        calls += 1

    for _ in range(min(len(fns), 3)):  # warm-up
        call()
    start = time.perf_counter()
    call()
    once = time.perf_counter() - start
    inner = max(1, int(target_s / max(once, 1e-7)))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            call()
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def make_case(
    batch: int, context: int, shape: tuple[int, int, int], dtype: torch.dtype, block_size: int, seed: int
):
    """q, one K/V pool (shuffled block ids), block tables, context lens and the runtime path's metadata."""
    heads, kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq + 8
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq]
    block_tables = ids.view(batch, blocks_per_seq).to(torch.int32)
    context_lens = torch.full((batch,), context, dtype=torch.int32)
    # The runtime path's metadata, as ModelRunner builds it once per step.
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decodes=batch)
    meta.decode_block_ids = block_tables.long().flatten()
    pad = torch.arange(blocks_per_seq * block_size)[None, :] >= context_lens[:, None]
    meta.decode_bias = torch.zeros(pad.shape).masked_fill_(pad, float("-inf")).unsqueeze(-1)
    return q, k_cache, v_cache, block_tables, context_lens, meta


def bench_case(args, shape_name: str, dtype_name: str, batch: int, context: int, have_kernel: bool) -> str:
    shape, dtype = SHAPES[shape_name], DTYPES[dtype_name]
    backend = TorchAttentionBackend(*shape)
    scale = backend.scale
    q, kc, vc, bt, cl, meta = make_case(batch, context, shape, dtype, args.block_size, args.seed)
    kv_bytes = 2 * batch * context * shape[1] * shape[2] * kc.element_size()
    pool_bytes = 2 * kc.numel() * kc.element_size()
    copies = 1 if args.warm else max(1, math.ceil(args.cold_mib * 2**20 / pool_bytes))
    pools = [(kc, vc)] + [(kc.clone(), vc.clone()) for _ in range(copies - 1)]
    target = args.target_ms / 1e3

    t_run = time_calls(
        [lambda k=k, v=v: backend._decode(q, k, v, meta) for k, v in pools], args.repeats, target
    )
    t_ref = float("nan")
    if not args.no_reference:
        ref_fns = [
            lambda k=k, v=v: cpa.reference_paged_decode_attention(q, k, v, bt, cl, scale) for k, v in pools
        ]
        t_ref = time_calls(ref_fns, max(3, args.repeats // 2), target)
    t_ker, err, gbs = float("nan"), float("nan"), float("nan")
    if have_kernel:
        ker_fns = [lambda k=k, v=v: cpa.paged_decode_attention(q, k, v, bt, cl, scale) for k, v in pools]
        t_ker = time_calls(ker_fns, args.repeats, target)
        out = cpa.paged_decode_attention(q, kc, vc, bt, cl, scale).float()
        err = (
            (out - cpa.reference_paged_decode_attention(q, kc, vc, bt, cl, scale).float()).abs().max().item()
        )
        gbs = kv_bytes / t_ker / 1e9
    return (
        f"{shape_name:<8} {dtype_name:<9} {batch:>4} {context:>5} {kv_bytes / 2**20:>8.1f} | "
        f"{t_ker * 1e3:>9.3f} "
        f"{t_run * 1e3:>10.3f} {t_ref * 1e3:>9.3f} | {t_run / t_ker:>9.1f}x {t_ref / t_ker:>6.1f}x "
        f"{gbs:>6.1f} {err:>8.1e}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=list(DTYPES))
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32, 64, 256])
    ap.add_argument("--contexts", nargs="+", type=int, default=[64, 256, 1024])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--target-ms", type=float, default=30.0, help="length of one timing sample")
    cache = ap.add_mutually_exclusive_group()
    cache.add_argument("--cold", dest="warm", action="store_false", help="pool not in cache (default)")
    cache.add_argument("--warm", dest="warm", action="store_true", help="re-read one pool (cache-resident)")
    ap.set_defaults(warm=False)
    ap.add_argument("--cold-mib", type=float, default=256.0, help="total size of the rotated pool copies")
    ap.add_argument("--no-reference", action="store_true", help="skip the (slow) plain reference")
    ap.add_argument("--chunk", type=int, default=None, help="kernel tokens per chunk (tuning)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.chunk:
        cpa._CHUNK_TOKENS = args.chunk
    start = time.perf_counter()
    have_kernel = cpa.available()
    load_s = time.perf_counter() - start
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}, "
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}, "
        f"{'warm (one pool)' if args.warm else f'cold (pool copies rotated, >= {args.cold_mib:g} MiB)'}"
    )
    print(
        f"# kernel available: {have_kernel} (build/load {load_s:.1f}s, chunk {cpa._CHUNK_TOKENS})"
        + ("" if have_kernel else f": {cpa.build_info()['error']}")
    )
    header = (
        f"{'shape':<8} {'dtype':<9} {'B':>4} {'ctx':>5} {'KV MiB':>8} | {'kernel ms':>9} {'runtime ms':>10} "
        f"{'ref ms':>9} | {'vs runtime':>10} {'vs ref':>7} {'GB/s':>6} {'max err':>8}"
    )
    print(header)
    print("-" * len(header))
    for shape_name in args.shapes:
        for dtype_name in args.dtypes:
            for batch in args.batch_sizes:
                for context in args.contexts:
                    print(bench_case(args, shape_name, dtype_name, batch, context, have_kernel), flush=True)


if __name__ == "__main__":
    main()
