"""Mixture-of-experts MLP: a router picks ``top_k`` experts per token, each expert is a SiLU-gated MLP.

Each expert is a pair of linear layers (``gate_up_proj`` [2 * inter, hidden], gate rows first; ``down_proj``
[hidden, inter]), so the CPU prepacking and weight-only quantization of linear layers apply to experts too.
They run as one GEMM per expert over the tokens routed to it, gathered by a sort: no Python loop over
tokens, and only experts that received tokens are visited (a decode step of one sequence touches top_k of them).
With tensor parallelism every rank holds every expert's slice of the intermediate dimension (gate/up rows,
down columns) and the partial sums are all-reduced, as for the dense MLP; expert parallelism is not done.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from kubellm.kernels import cpu_layer_ops as ops
from kubellm.runtime.models.checkpoint import CheckpointError
from kubellm.runtime.models.config import ModelConfig
from kubellm.runtime.models.llama import LlamaMLP
from kubellm.runtime.tp_group import Group


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] → (weights [T, k] float32, expert ids [T, k]): softmax in float32, top-k, and the
    k weights rescaled to sum to 1 when the config says so."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)


class FusedMoE(nn.Module):
    """The experts of one layer and its router (``gate``); :meth:`load_expert` loads one checkpoint tensor."""

    native = False  # SiLU-and-mul through the fused CPU kernel

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, renormalize: bool, tp: Group):
        super().__init__()
        self.tp, self.top_k, self.renormalize, self.num_experts = tp, top_k, renormalize, num_experts
        self.inter = inter // tp.size
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router, replicated
        self.experts = nn.ModuleList(Expert(hidden, self.inter) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
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
                h = ops.silu_and_mul(gate_up)
            else:
                gate, up = gate_up.split(self.inter, dim=-1)
                h = nn.functional.silu(gate) * up
            out.index_add_(0, rows, expert.down_proj(h) * scale[start:start + n])
            start += n
        return self.tp.all_reduce(out)

    def load_expert(self, expert: int, kind: str, tensor: torch.Tensor) -> None:
        """Copy one expert's gate/up ([inter, hidden]) or down ([hidden, inter]) tensor, this rank's slice."""
        if kind == "down":
            dst, dim = self.experts[expert].down_proj.weight.data, 1
        else:
            dst = self.experts[expert].gate_up_proj.weight.data.narrow(0, 0 if kind == "gate" else self.inter, self.inter)
            dim = 0
        if self.tp.size > 1:
            tensor = tensor.narrow(dim, self.tp.rank * self.inter, self.inter)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise CheckpointError(f"expert tensor has shape {tuple(tensor.shape)}, the config implies {tuple(dst.shape)}")
        dst.copy_(tensor)


def expert_tensor_pattern(block: str, parts: tuple[str, ...]) -> re.Pattern:
    """``model.layers.{L}.{block}.experts.{E}.{part}.weight`` → groups (layer, expert, part)."""
    return re.compile(rf"^model\.layers\.(\d+)\.{re.escape(block)}\.experts\.(\d+)\.({'|'.join(parts)})\.weight$")


def moe_mlp(cfg: ModelConfig, tp: Group, layer: int) -> nn.Module:
    """The MLP of ``layer``: experts where the config makes the layer sparse, else the dense MLP."""
    moe = cfg.moe
    if moe is None or layer not in moe.sparse_layers:
        return LlamaMLP(cfg, tp)
    return FusedMoE(cfg.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k, moe.renormalize, tp)


class ExpertLoading:
    """Mixin for model classes whose layers hold :class:`FusedMoE` blocks: loads the per-expert checkpoint
    tensors (``model.layers.L.{moe_block}.experts.E.{part}.weight``); the block's router is ``mlp.gate``."""

    moe_block = "mlp"  # the checkpoint's name for the block (Mixtral: block_sparse_moe)
    moe_parts = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    def load_weights(self, weights, source: str = "") -> None:
        old, new = f".{self.moe_block}.", ".mlp."
        super().load_weights(((n.replace(old, new, 1), t) for n, t in weights), source)

    def load_special(self, name: str, tensor: torch.Tensor) -> str | None:
        if m := expert_tensor_pattern("mlp", tuple(self.moe_parts)).match(name):
            layer, expert, part = int(m[1]), int(m[2]), m[3]
            moe = self.model.layers[layer].mlp if layer < len(self.model.layers) else None
            if not isinstance(moe, FusedMoE) or expert >= moe.num_experts:
                return None  # reported as unexpected by the caller
            moe.load_expert(expert, self.moe_parts[part], tensor)
            return f"experts:{layer}:{expert}:{self.moe_parts[part]}"
        return None

    def loads_specially(self, param_name: str) -> bool:
        return ".mlp.experts." in param_name

    def special_keys(self) -> set[str]:
        keys = set()
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, FusedMoE):
                keys |= {f"experts:{i}:{e}:{k}" for e in range(layer.mlp.num_experts) for k in ("gate", "up", "down")}
        return keys
