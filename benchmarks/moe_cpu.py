"""One mixture-of-experts layer on CPU: the per-expert path (a oneDNN-prepacked GEMM per hit expert) against
the native kernel (kernels/cpu_moe.py, every hit expert in one call), at Qwen3-30B-A3B's layer shape.

Random bfloat16 weights (hidden 2048, 128 experts of 768, top-8, softmax router renormalised), random inputs,
rows 1, 8, 32 (decode steps of that many sequences) and 512 (a prefill chunk). Both paths run interleaved,
``--rounds`` times ``--calls`` calls each; the table gives the best round's milliseconds per call.

    python benchmarks/moe_cpu.py --threads 2 [--rows 1,8,32,512]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rows", default="1,8,32,512")
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from kubellm.kernels import cpu_moe
    from kubellm.runtime.layers.linear import pack_linears
    from kubellm.runtime.layers.moe import FusedMoE
    from kubellm.runtime.models.llama import use_native_ops
    from kubellm.runtime.tp_group import Group

    if not cpu_moe.available():
        print("the native MoE kernel is not available here (needs AVX512-BF16)", file=sys.stderr)
        return 1
    torch.set_default_dtype(torch.bfloat16)  # built in bfloat16: a float32 layer would take 2.4 GB
    layers = {}
    for kind in ("per-expert", "kernel"):
        moe = FusedMoE(args.hidden, args.inter, args.experts, args.top_k, True, Group()).eval()
        torch.manual_seed(0)
        for param in moe.parameters():
            torch.nn.init.normal_(param, std=0.02)
        use_native_ops(moe, True)
        if kind == "kernel":
            moe.pack_for_cpu_kernel()
        pack_linears(moe)  # the router (and, per expert, the experts' linears)
        layers[kind] = moe

    print("| rows | per-expert (ms) | kernel (ms) | speed-up |\n| ---: | ---: | ---: | ---: |")
    for rows in map(int, args.rows.split(",")):
        x = torch.randn(rows, args.hidden).to(torch.bfloat16)
        best = {}
        with torch.inference_mode():
            for moe in layers.values():
                moe(x)  # warm-up
            for _ in range(args.rounds):
                for kind, moe in layers.items():
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        moe(x)
                    ms = (time.perf_counter() - start) / args.calls * 1e3
                    best[kind] = min(best.get(kind, ms), ms)
        # Rows agree except where bfloat16 router logits tie at the k-th expert: torch.topk breaks such ties in
        # no fixed order, the kernel by the lower expert id.
        close = torch.isclose(layers["per-expert"](x).float(), layers["kernel"](x).float(), atol=2e-2, rtol=2e-2)
        agree = close.all(dim=1).float().mean().item()
        assert agree >= 0.75, f"the two paths disagree on {1 - agree:.0%} of the rows"
        ref, got = best["per-expert"], best["kernel"]
        print(f"| {rows} | {ref:.2f} | {got:.2f} | {ref / got:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
