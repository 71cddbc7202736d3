"""CPU kernel micro-benchmark: each native kernel against the PyTorch path it replaces, at SmolLM2's shapes.

Rows (median of several timed repeats, after warm-up; one process, same threads for both columns):

* ``prefill attention T``: ``kubellm.kernels.cpu_prefill_attention`` vs ``F.scaled_dot_product_attention``
  (4-D, causal, ``enable_gqa``) for one prompt of T tokens, 9 query heads / 3 kv heads of 64.
* ``rms_norm`` / ``add_rms_norm`` / ``silu_and_mul`` / ``rotary`` at T rows: the fused ops vs their references.
* ``linear NxK, M rows``: a linear layer with oneDNN-prepacked weights vs ``F.linear``.
* ``int8 NxK, M rows`` (bfloat16, CPUs with AVX512-BF16): ``kubellm.kernels.cpu_int8_gemm`` vs PyTorch's
  int8 weight-only GEMM (``torch._weight_int8pack_mm``), and ``... vs bf16`` against the bf16 prepacked
  linear it stands in for under ``--quantization int8``.

    python benchmarks/cpu_kernels.py [--threads 2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from kubellm.kernels import cpu_int8_gemm
from kubellm.kernels import cpu_layer_ops as ops
from kubellm.kernels import cpu_prefill_attention as pa
from kubellm.runtime.engine import host_malloc
from kubellm.runtime.layers.linear import PackedLinear, can_pack
from kubellm.runtime.layers.rotary import RotaryEmbedding
from kubellm.runtime.quantization.int8 import quantize_int8

H, KVH, D, HIDDEN, INTER = 9, 3, 64, 576, 1536  # SmolLM2-135M


def timed(fn, budget_s: float = 0.3) -> float:
    """Median seconds per call over 5 repeats of as many calls as fit in budget_s / 5."""
    for _ in range(3):
        fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-6)
    calls = max(1, int(budget_s / 5 / once))
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def cases(dtype: torch.dtype):
    for t in (64, 150, 290, 512, 1024):
        q, k, v = (torch.randn(t, h, D).to(dtype) for h in (H, KVH, KVH))
        sdpa_in = [x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
        yield (f"prefill attention T={t}", lambda q=q, k=k, v=v: pa.prefill_attention(q, k, v, D**-0.5),
               lambda a=sdpa_in: F.scaled_dot_product_attention(*a, is_causal=True, enable_gqa=True))
    rope = RotaryEmbedding(D, 4096, 10000.0, None, dtype)
    for t in (32, 2048):
        x, res = torch.randn(t, HIDDEN).to(dtype), torch.randn(t, HIDDEN).to(dtype)
        w = torch.rand(HIDDEN).to(dtype)
        gate_up = torch.randn(t, 2 * INTER).to(dtype)
        qkv = torch.randn(t, (H + 2 * KVH) * D).to(dtype)
        qv, kv = qkv[:, : H * D].view(t, H, D), qkv[:, H * D : (H + KVH) * D].view(t, KVH, D)
        pos = torch.arange(t)
        yield (f"rms_norm T={t}", lambda x=x, w=w: ops.rms_norm(x, w, 1e-5),
               lambda x=x, w=w: ops.reference_rms_norm(x, w, 1e-5))
        yield (f"add_rms_norm T={t}", lambda x=x, r=res, w=w: ops.add_rms_norm_(x.clone(), r.clone(), w, 1e-5),
               lambda x=x, r=res, w=w: ops.reference_add_rms_norm_(x.clone(), r.clone(), w, 1e-5))
        yield (f"silu_and_mul T={t}", lambda g=gate_up: ops.silu_and_mul(g),
               lambda g=gate_up: ops.reference_silu_and_mul(g))
        yield (f"rotary T={t}", lambda p=pos, q=qv, k=kv: ops.rotary_embedding_(p, q, k, rope.cos, rope.sin),
               lambda p=pos, q=qv, k=kv: rope(p, q, k))
    if can_pack("cpu", dtype):
        for n, k_in in ((3 * D * 5, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)):
            linear = nn.Linear(k_in, n, bias=False).to(dtype)
            packed = PackedLinear(linear)
            for m in (1, 32, 2048):
                x = torch.randn(m, k_in).to(dtype)
                yield (f"linear {n}x{k_in}, M={m}", lambda p=packed, x=x: p(x), lambda x=x, w=linear.weight: F.linear(x, w))
    if dtype == torch.bfloat16 and cpu_int8_gemm.available():
        for n, k_in in ((3 * D * 5, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)):
            linear = nn.Linear(k_in, n, bias=False).to(dtype)
            bf16 = PackedLinear(linear) if can_pack("cpu", dtype) else linear
            q, scales = quantize_int8(linear.weight)
            packed_q, scales_bf16 = cpu_int8_gemm.pack(q), scales.to(dtype)
            for m in (1, 8, 32, 256):
                x = torch.randn(m, k_in).to(dtype)
                native = lambda x=x, pq=packed_q, s=scales: cpu_int8_gemm.int8_gemm(x, pq, s)  # noqa: E731
                yield (f"int8 {n}x{k_in}, M={m}", native,
                       lambda x=x, q=q, s=scales_bf16: torch._weight_int8pack_mm(x, q, s))
                yield (f"int8 {n}x{k_in}, M={m} vs bf16", native, lambda x=x, lin=bf16: lin(x))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not ops.available():
        p.error("the native CPU kernels are unavailable here; see `kubellm kernels info`")
    dtype = getattr(torch, args.dtype)
    host_malloc.tune()  # as the engine runs: without it, both columns time page faults on large outputs
    torch.manual_seed(0)
    rows = []
    with torch.inference_mode():
        all_cases = list(cases(dtype))
        for name, native, baseline in tqdm(all_cases, desc="benchmarking", unit="case"):
            rows.append((name, timed(native), timed(baseline)))
    print(f"\n{args.dtype}, {torch.get_num_threads()} threads, torch {torch.__version__}\n")
    print("| case | native µs | PyTorch µs | speed-up |")
    print("|---|---:|---:|---:|")
    for name, native_s, base_s in rows:
        print(f"| {name} | {native_s * 1e6:,.1f} | {base_s * 1e6:,.1f} | {base_s / native_s:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
