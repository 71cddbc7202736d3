"""One mixture-of-experts layer on CPU: the per-expert path (a oneDNN-prepacked GEMM per hit expert) against
the native kernel (kernels/cpu_moe.py, every hit expert in one call), at Qwen3-30B-A3B's layer shape. With
``--int4``, the same layer with 4-bit experts as a pre-quantized checkpoint loads them (groups of 128), two
ways: ``QuantizedLinear`` per expert linear on the native int4 GEMM, one GEMM per hit expert, and those
layers stacked for cpu_moe's fused int4 kernel (every hit expert in one call, as the engine runs them).

Random bfloat16 weights (hidden 2048, 128 experts of 768, top-8, softmax router renormalised), random inputs,
rows 1, 8, 32 (decode steps of that many sequences) and 512 (a prefill chunk). All paths run interleaved,
``--rounds`` times ``--calls`` calls each; the table gives the best round's milliseconds per call.

    python benchmarks/moe_cpu.py --threads 2 [--rows 1,8,32,512] [--int4 [--group 32] [--float-zeros]]
    python benchmarks/moe_cpu.py --threads 1 --int8 --rows 1,4,16 --fresh

``--int4 --group 32`` is how GGUF Q4_0 experts load (kept packed: zero points 8, float16 scales), with
``--float-zeros`` Q4_1/Q4_K (float32 scales and fractional zero points).

``--int8``: the layer with 8-bit experts as each 8-bit format loads them, every one stacked for cpu_moe's fused
quantized kernel, against the bf16 experts on their kernel: GGUF Q8_0 (int8, groups of 32, float16 scales),
GPTQ 8-bit (0..255 around 128, groups of 128: int8 values beside zero points of 0, as the loader shifts them) and
compressed-tensors W8A16 (int8, one float scale per output channel); ``--int8-forms`` adds GGUF Q6_K (-32..31,
groups of 16) and Q5_K (0..31, groups of 32, fractional float zero points). ``--fresh``: a new random input on every
call, so that the hit experts change and their weights come from memory as in decode (else one input repeated,
whose experts may stay in cache).
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
    p.add_argument("--int4", action="store_true",
                   help="add the 4-bit per-expert path and the fused int4 kernel (pre-quantized experts)")
    p.add_argument("--group", type=int, default=128, help="--int4's group size (GGUF's 4-bit types: 32)")
    p.add_argument("--int8", action="store_true",
                   help="add the 8-bit formats' experts (Q8_0, GPTQ 8-bit, W8A16) on the fused quantized kernel")
    p.add_argument("--int8-forms", default="Q8_0,GPTQ-8bit,W8A16", help=f"--int8's formats, of {', '.join(INT8_FORMS)}")
    p.add_argument("--fresh", action="store_true", help="a new random input on every call (other hit experts)")
    p.add_argument("--float-zeros", action="store_true",
                   help="--int4 with fractional float32 zero points and scales, as GGUF Q4_1/Q4_K experts load "
                        "(else zero points 8, which narrow to float16 as AWQ's and Q4_0's do)")
    args = p.parse_args(argv)
    previous = torch.get_default_dtype()  # restored: main() also runs inside a test process
    try:
        return _run(args)
    finally:
        torch.set_default_dtype(previous)


def _run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)

    from kubellm.kernels import cpu_int4_gemm, cpu_moe
    from kubellm.runtime.distributed.tp_group import Group
    from kubellm.runtime.layers.layer_ops import use_native_ops
    from kubellm.runtime.layers.linear import pack_linears
    from kubellm.runtime.layers.moe import FusedMoE, pack_experts

    if not cpu_moe.available() or (args.int4 or args.int8) and not cpu_int4_gemm.available():
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
    if args.int4:
        layers["int4"] = _int4_experts(layers["per-expert"], args.group, args.float_zeros)
        # the same values (same seed), stacked
        layers["int4 fused"] = _int4_experts(layers["per-expert"], args.group, args.float_zeros)
        assert pack_experts(layers["int4 fused"]) == 1
    int8 = {}
    if args.int8:
        for form in args.int8_forms.split(","):
            int8[form] = layers[form] = _int8_experts(layers["per-expert"], form)

    int4_head = ("| int4 per-expert (ms) | int4 fused (ms) | int4 per-expert vs kernel | fused vs int4 per-expert "
                 "| fused vs kernel ", "| ---: | ---: | ---: | ---: | ---: ") if args.int4 else ("", "")
    int8_head = ("".join(f"| {f} (ms) " for f in int8) + "".join(f"| {f} vs kernel " for f in int8),
                 "| ---: " * 2 * len(int8))
    print(f"| rows | per-expert (ms) | kernel (ms) | speed-up {int4_head[0]}{int8_head[0]}|\n"
          f"| ---: | ---: | ---: | ---: {int4_head[1]}{int8_head[1]}|")
    for rows in map(int, args.rows.split(",")):
        gen = torch.Generator().manual_seed(rows)
        xs = [torch.randn(rows, args.hidden, generator=gen).to(torch.bfloat16)
              for _ in range(args.calls if args.fresh else 1)]
        x = xs[0]
        best = {}
        with torch.inference_mode():
            for moe in layers.values():
                moe(x)  # warm-up
            for _ in range(args.rounds):
                for kind, moe in layers.items():
                    start = time.perf_counter()
                    for i in range(args.calls):
                        moe(xs[i % len(xs)])
                    ms = (time.perf_counter() - start) / args.calls * 1e3
                    best[kind] = min(best.get(kind, ms), ms)
        # Rows agree except where bfloat16 router logits tie at the k-th expert: torch.topk breaks such ties in
        # no fixed order, the kernel by the lower expert id.
        _check_agree(layers["per-expert"], layers["kernel"], x)
        if args.int4:
            _check_agree(layers["int4"], layers["int4 fused"], x)
        ref, got = best["per-expert"], best["kernel"]
        int4 = ""
        if args.int4:
            per, fused = best["int4"], best["int4 fused"]
            int4 = f" {per:.2f} | {fused:.2f} | {got / per:.2f}x | {per / fused:.2f}x | {got / fused:.2f}x |"
        int8_cols = "".join(f" {best[f]:.2f} |" for f in int8) + "".join(f" {got / best[f]:.2f}x |" for f in int8)
        print(f"| {rows} | {ref:.2f} | {got:.2f} | {ref / got:.2f}x |{int4}{int8_cols}", flush=True)
    return 0


def _check_agree(a, b, x) -> None:
    with torch.inference_mode():
        ya, yb = a(x).float(), b(x).float()
    # Per row, relative to its norm: bfloat16 rounding of weights and outputs is ~0.3% of the row (an element-wise
    # tolerance fails near-zero elements of rows as large as float zero points make them).
    agree = ((ya - yb).norm(dim=1) <= 2e-2 * ya.norm(dim=1)).float().mean().item()
    assert agree >= 0.75, f"the two paths disagree on {1 - agree:.0%} of the rows"


def _int4_experts(bf16_moe, group: int, float_zeros: bool):
    """A copy of ``bf16_moe`` whose expert linears are native int4 ``QuantizedLinear`` layers (random 4-bit values,
    groups of ``group``; the timing does not depend on the values), the router shared."""
    from kubellm.runtime.distributed.tp_group import Group
    from kubellm.runtime.layers.moe import FusedMoE
    from kubellm.runtime.layers.quantized_linear import QuantizedLinear
    from kubellm.runtime.layers.quantized_weight import QuantizedWeight

    hidden, inter = bf16_moe.gate.in_features, bf16_moe.inter
    with torch.device("meta"):  # its bf16 experts are replaced below: allocate none
        moe = FusedMoE(hidden, inter, bf16_moe.num_experts, bf16_moe.top_k, bf16_moe.renormalize, Group()).eval()
    moe.gate, moe.native, moe.experts = bf16_moe.gate, bf16_moe.native, torch.nn.ModuleList()
    gen = torch.Generator().manual_seed(0)

    def linear(out_f, in_f):
        groups = (out_f, in_f // group)
        zeros = torch.rand(groups, generator=gen) * 15 if float_zeros else torch.full(groups, 8.0)
        weight = QuantizedWeight(torch.randint(0, 16, (out_f, in_f), generator=gen, dtype=torch.uint8),
                                 torch.rand(groups, generator=gen) / 64, zeros, group)
        return QuantizedLinear(weight, 4, "native")

    for _ in range(bf16_moe.num_experts):
        expert = torch.nn.Module()
        expert.gate_up_proj, expert.down_proj = linear(2 * inter, hidden), linear(hidden, inter)
        moe.experts.append(expert)
    return moe


# --int8's formats: (values low, high, zero point (None: none; "float": fractional, per group), group size or -1
# for one per output channel, scales as the format stores them). GGUF Q6_K and Q5_K load as 8-bit experts too.
INT8_FORMS = {"Q8_0": (-127, 127, None, 32, torch.float16), "GPTQ-8bit": (0, 255, 128.0, 128, torch.float16),
              "W8A16": (-127, 127, None, -1, torch.float32), "Q6_K": (-32, 31, None, 16, torch.float32),
              "Q5_K": (0, 31, "float", 32, torch.float32)}


def _int8_experts(bf16_moe, form: str):
    """A copy of ``bf16_moe`` whose experts are native 8-bit ``QuantizedLinear`` layers of ``form`` (random values;
    the timing does not depend on them), stacked for the fused kernel after checking that the stack computes what the
    per-expert layers (one quantized GEMM per hit expert) compute on 4 rows."""
    from kubellm.runtime.distributed.tp_group import Group
    from kubellm.runtime.layers.moe import FusedMoE, pack_experts
    from kubellm.runtime.layers.quantized_linear import QuantizedLinear
    from kubellm.runtime.layers.quantized_weight import QuantizedWeight

    low, high, zero, group, scale_dtype = INT8_FORMS[form]
    hidden, inter = bf16_moe.gate.in_features, bf16_moe.inter
    with torch.device("meta"):
        moe = FusedMoE(hidden, inter, bf16_moe.num_experts, bf16_moe.top_k, bf16_moe.renormalize, Group()).eval()
    moe.gate, moe.native, moe.experts = bf16_moe.gate, bf16_moe.native, torch.nn.ModuleList()
    gen = torch.Generator().manual_seed(0)

    def linear(out_f, in_f):
        groups = (out_f, 1 if group < 0 else in_f // group)
        scales = (torch.rand(groups, generator=gen, dtype=torch.float32) / (64 * (high - low))).to(scale_dtype).float()
        values = torch.randint(low, high + 1, (out_f, in_f), generator=gen, dtype=torch.int16)
        zeros = None if zero is None else torch.rand(groups, generator=gen, dtype=torch.float32) * high \
            if zero == "float" else torch.full(groups, zero, dtype=torch.float32)
        weight = QuantizedWeight(values, scales, zeros, group)
        return QuantizedLinear(weight, 8, "native")

    for _ in range(bf16_moe.num_experts):
        expert = torch.nn.Module()
        expert.gate_up_proj, expert.down_proj = linear(2 * inter, hidden), linear(hidden, inter)
        moe.experts.append(expert)
    x = torch.randn(4, hidden, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        per_expert = moe(x)
    assert pack_experts(moe) == 1 and type(moe.packed).__name__ == "QuantizedExperts"
    _check_agree(lambda _: per_expert, moe, x)
    return moe


if __name__ == "__main__":
    sys.exit(main())
