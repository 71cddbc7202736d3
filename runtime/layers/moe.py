"""Mixture-of-experts MLP: a router picks ``top_k`` experts per token, each expert is a SiLU-gated MLP.

Each expert is a pair of linear layers (``gate_up_proj`` [2 * inter, hidden], gate rows first; ``down_proj``
[hidden, inter]), so the CPU prepacking and weight-only quantization of linear layers apply to experts too,
and a checkpoint quantized elsewhere swaps them for ``QuantizedLinear`` layers (runtime/quantization/loading.py).
They run as one GEMM per expert over the tokens routed to it, gathered by a sort: no Python loop over
tokens, and only experts that received tokens are visited (a decode step of one sequence touches top_k of them).
With tensor parallelism every rank holds every expert's slice of the intermediate dimension: each expert's
gate/up is column-parallel and its down row-parallel (the layer types of runtime/layers/parallel_linear.py,
which load their own slices), and the block all-reduces once over all experts; the router is replicated.
Expert parallelism is not done.

On CPUs with AVX512-BF16 serving bfloat16 without quantization, :func:`pack_experts` (the model runner calls
it when the kernel choice says ``moe native``) moves every layer's experts into the packed form of
kernels/cpu_moe.py, whose kernel routes and runs all hit experts of a layer in one call: with 128 experts and
top-8 a decode step visits ~110 experts per layer, and the per-expert path spends ~10 PyTorch dispatches on each.
Experts loaded as native 4-bit or 8-bit ``QuantizedLinear`` layers (AWQ, GPTQ without act-order, W4A16, W8A16,
``--quantization int4``, GGUF Q4_0/Q4_1/Q4_K/Q8_0/Q5_K/Q6_K) are stacked the same way into kernels/cpu_moe.py's
:class:`QuantizedExperts` and run by its quantized kernel, each linear in its own width (GGUF Q4_K_M: 4-bit
gate/up, 6-bit down); act-order and FP8 experts keep the per-expert path.
"""

from __future__ import annotations

import torch
from torch import nn

from kubellm.kernels import cpu_moe
from kubellm.runtime.distributed.tp_group import Group
from kubellm.runtime.layers.layer_ops import CPU_OPS
from kubellm.runtime.layers.linear import NativeLinear
from kubellm.runtime.layers.parallel_linear import MergedColumnParallelLinear, RowParallelLinear
from kubellm.runtime.layers.quantized_linear import QuantizedLinear


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] → (weights [T, k] float32, expert ids [T, k]): softmax in float32, top-k, and the
    k weights rescaled to sum to 1 when the config says so."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Expert(nn.Module):
    """One expert; ``inter`` is the unsharded intermediate size. ``down_proj``'s partial sums are not reduced
    here: :class:`FusedMoE` reduces the sum over all experts once."""

    def __init__(self, hidden: int, inter: int, tp: Group):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, dict.fromkeys((0, 1), inter), False, tp)
        self.down_proj = RowParallelLinear(inter, hidden, False, tp)


class FusedMoE(nn.Module):
    """The experts of one layer and its router (``gate``)."""

    native = False  # SiLU-and-mul through the fused kernel of ops (set with native by use_native_ops)
    ops = CPU_OPS

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, renormalize: bool, tp: Group):
        super().__init__()
        self.tp, self.top_k, self.renormalize, self.num_experts = tp, top_k, renormalize, num_experts
        self.inter = inter // tp.size
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router, replicated
        self.experts = nn.ModuleList(Expert(hidden, inter, tp) for _ in range(num_experts))

    # (w13, w2) of kernels/cpu_moe.py's bf16 kernel or its QuantizedExperts, set by pack_experts
    packed: tuple[torch.Tensor, torch.Tensor] | cpu_moe.QuantizedExperts | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        if isinstance(self.packed, cpu_moe.QuantizedExperts):  # routing included
            return self.tp.all_reduce(cpu_moe.moe_quantized_experts(x, logits, self.packed, self.top_k,
                                                                    self.renormalize))
        if self.packed is not None:
            return self.tp.all_reduce(cpu_moe.moe_experts(x, logits, *self.packed, self.top_k, self.renormalize))
        weights, ids = route(logits, self.top_k, self.renormalize)
        return self.tp.all_reduce(self.experts_one_by_one(x, weights, ids))

    def fused_decode_args(self) -> tuple | None:
        """This MLP's arguments of the fused decode layer (w13, w2, intermediate, router, top_k, renormalize) when
        it runs the bfloat16 experts kernel behind a native router linear (what :meth:`forward` then calls), else
        None (quantized experts too: a QuantizedExperts is a tuple, but not the bfloat16 kernel's pair)."""
        if (type(self.packed) is not tuple or self.tp.size > 1 or not isinstance(self.gate, NativeLinear)
                or self.gate.bias is not None):
            return None
        return *self.packed, self.inter, self.gate.packed_weight, self.top_k, self.renormalize

    def experts_one_by_one(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The experts' output for router ``weights``/``ids`` [T, k], this rank's partial sum: one GEMM per hit
        expert (any dtype, device, quantized or prepacked linears)."""
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        token_of = order // self.top_k  # source token of each (token, choice) pair, grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host sync per layer
        out = torch.zeros_like(x)
        scale = weights.flatten()[order].to(x.dtype).unsqueeze(1)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows, expert = token_of[start:start + n], self.experts[e]
            gate_up = expert.gate_up_proj(x[rows])
            if self.native:
                h = self.ops.silu_and_mul(gate_up)
            else:
                gate, up = gate_up.split(self.inter, dim=-1)
                h = nn.functional.silu(gate) * up
            out.index_add_(0, rows, expert.down_proj(h) * scale[start:start + n])
            start += n
        return out

    def pack_for_cpu_kernel(self) -> None:
        """Move the experts' weights (this rank's slices) into kernels/cpu_moe.py's packed form, one expert at a
        time (so the extra memory is one expert's), and drop the per-expert linears."""
        e, hidden, inter = self.num_experts, self.gate.in_features, self.inter
        w13 = torch.empty(e, inter // 16, 2, hidden // 2, 16, 2, dtype=torch.bfloat16)
        w2 = torch.empty(e, hidden // 16, inter // 2, 16, 2, dtype=torch.bfloat16)
        for i, expert in enumerate(self.experts):
            a, b = cpu_moe.pack(expert.gate_up_proj.weight.data[None], expert.down_proj.weight.data[None])
            w13[i], w2[i] = a[0], b[0]
            expert.gate_up_proj.weight = expert.down_proj.weight = None
        self.experts = nn.ModuleList()
        self.packed = (w13, w2)

    def packable_for_cpu_kernel(self) -> bool:
        """Plain bfloat16 expert layers (not replaced by quantized or prepacked ones) of sizes the kernel takes."""
        plain = bool(self.experts) and all(
            type(x.gate_up_proj) is MergedColumnParallelLinear and type(x.down_proj) is RowParallelLinear
            for x in self.experts)  # checked first: a prepacked router has no .weight
        return plain and cpu_moe.packable(self.gate.in_features, self.inter, self.experts[0].down_proj.weight.dtype)


    def stack_quantized_for_cpu_kernel(self) -> None:
        """Stack the experts' native 4-bit or 8-bit buffers into kernels/cpu_moe.py's :class:`QuantizedExperts`,
        one expert at a time (the extra memory is one expert's), and drop the per-expert layers. Scales and zero
        points stay float16 where every expert's are."""
        def stacked(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
            layers = [getattr(x, name) for x in self.experts]
            first = layers[0]
            def dtype(key: str) -> torch.dtype:
                half = all(getattr(m, key).dtype == torch.float16 for m in layers)
                return torch.float16 if half else torch.float32

            def shape(key: str) -> tuple[int, ...]:  # the kernel's scales and zero points: cpu_moe.block_params
                if key == "qweight":
                    return tuple(first.qweight.shape)
                groups, n = getattr(first, key).shape
                return n // 16, groups, 16

            out = [None if getattr(first, key) is None else
                   torch.empty(len(layers), *shape(key), dtype=first.qweight.dtype if key == "qweight" else dtype(key))
                   for key in ("qweight", "scales", "zeros")]
            for i, m in enumerate(layers):
                for key, dst, src in zip(("qweight", "scales", "zeros"), out, (m.qweight, m.scales, m.zeros),
                                         strict=True):
                    if dst is not None:
                        dst[i] = src if key == "qweight" else cpu_moe.block_params(src)
                m.qweight = m.scales = m.zeros = None
            return (*out, first.group_size)

        w13, s13, z13, group13 = stacked("gate_up_proj")
        w2, s2, z2, group2 = stacked("down_proj")
        self.experts = nn.ModuleList()
        self.packed = cpu_moe.QuantizedExperts(w13, s13, z13, group13, w2, s2, z2, group2, cpu_moe.table_low(w13),
                                               cpu_moe.table_low(w2))

    def quantized_stackable_for_cpu_kernel(self) -> bool:
        """Every expert linear a native 4-bit or 5..8-bit ``QuantizedLinear`` without act-order or bias, one width,
        group size and zero-point presence per linear across the experts, sizes the kernel takes."""
        layers = [[getattr(x, name) for x in self.experts] for name in ("gate_up_proj", "down_proj")]
        if not self.experts or not all(isinstance(m, QuantizedLinear) and m.path == "native" and
                                       not m.float_values and m.perm is None and m.g_idx is None and
                                       m.bias is None for linear in layers for m in linear):
            return False
        forms = [{(4 if m.bits == 4 else 8, m.group_size, m.zeros is None) for m in linear} for linear in layers]
        if any(len(f) != 1 for f in forms):
            return False
        (bits13, group13, _), (bits2, group2, _) = (f.pop() for f in forms)
        return cpu_moe.quantized_packable(self.gate.in_features, self.inter, ((bits13, group13), (bits2, group2)))


def pack_experts(model: nn.Module) -> int:
    """Pack the experts of every :class:`FusedMoE` of ``model`` that the CPU kernels take (plain bfloat16
    linears, or native 4-bit or 8-bit quantized ones; sizes multiples of 16); returns how many layers were
    packed."""
    layers = [m for m in model.modules() if isinstance(m, FusedMoE) and m.packed is None]
    packed = 0
    for moe in layers:
        if moe.packable_for_cpu_kernel():
            moe.pack_for_cpu_kernel()
        elif moe.quantized_stackable_for_cpu_kernel():
            moe.stack_quantized_for_cpu_kernel()
        else:
            continue
        packed += 1
    return packed

