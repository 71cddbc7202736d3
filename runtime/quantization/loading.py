"""Loading a checkpoint quantized elsewhere: its decoder linears become :class:`QuantizedLinear` layers built
straight from the stored tensors, never dequantized at load.

:func:`prepare` runs on the model while it is still on the meta device: it swaps every decoder linear
(q/k/v, o, gate/up, down; fused or not) for a placeholder that holds no weights, so materialising the model
allocates nothing for them. The loader then offers every checkpoint tensor to :meth:`QuantizedLoading.take`
before casting it to the model dtype; the quantized ones (``qweight``/``qzeros``/``scales``/``g_idx``,
``weight_packed``/``weight_scale``/``weight_zero_point``/``weight_shape``, FP8 ``weight`` with
``weight_scale``/``weight_scale_inv``) and their biases stay here, everything else (embeddings, norms, the
LM head, modules the config leaves unquantized) goes on to the model's own ``load_weights``. A layer is built
as soon as its last part arrives: q/k/v (gate/up) parts are read into :class:`QuantizedWeight` each and
concatenated along the outputs, which is exact since groups run along the inputs. :meth:`finish` names any
layer the checkpoint left incomplete.

GGUF files come the same way (``prepare(..., gguf=True)``, the checkpoint's ``packed_tensors()``): each
linear's ``weight`` is a ``runtime/quantization/gguf.BlockForm``, 4-bit or 8-bit per its type; fused parts of
different types join in the 8-bit form at the smaller group. With ``packed_embedding`` the token embedding
arrives as one too: it becomes a :class:`QuantizedLinear` ``[vocab, hidden]`` behind a
:class:`QuantizedEmbedding`, and with tied embeddings that same layer is the LM head.

Tensor parallelism: each part, once read, goes through the ``quantized_loader`` of the parallel linear the
placeholder stands for (runtime/layers/parallel_linear.py), which keeps this rank's outputs (q/k/v, gate/up)
or inputs in whole groups (o, down); then the parts are concatenated as without it. GGUF blocks shard the same
way once read into their grouped 4-/8-bit form, and a packed token embedding keeps this rank's vocabulary rows
(runtime/layers/vocab_parallel.py).

Mixtures of experts: every expert's gate/up and down are targets like a dense MLP's, their checkpoint names
found by inverting the model's ``packed_modules_mapping`` (Qwen3-MoE ``mlp.experts.E.gate_proj``, Mixtral
``block_sparse_moe.experts.E.w1``/``w3``/``w2``): each becomes a :class:`QuantizedLinear` inside the
unchanged :class:`~kubellm.runtime.layers.moe.FusedMoE`, which routes as for bf16 and runs one quantized GEMM
per hit expert over the tokens routed to it (native 4-bit and 8-bit experts without act-order are stacked
afterwards for kernels/cpu_moe.py's fused quantized kernel where the kernel choice says ``moe native``). Routers
(``mlp.gate``, ``block_sparse_moe.gate``) are served in the model dtype: AutoAWQ, GPTQModel and llm-compressor
usually leave them float, and a router a checkpoint stores quantized anyway (in the checkpoint's format) is
dequantized once at load by that format's reader (:meth:`QuantizedLoading.take`; ``(q - z) * s`` per group, FP8
times its scale), rounded to the model dtype and loaded as a float router (one log line counts them): a router is
tiny (experts x hidden), and its rounding is the checkpoint author's. GGUF's
stacked experts arrive cut per expert in their blocks (runtime/models/gguf.py) under the Hub names, so they load
the same way and stack for the fused kernel too, each linear in its own width: 4-bit Q4_0, Q4_1, Q4_K (float
zero points), 8-bit Q8_0, Q5_K, Q6_K, and Q4_K_M's 4-bit gate/up beside its Q6_K down. Under tensor
parallelism the experts shard as a dense MLP does, through the same loaders: gate/up column-parallel, down
row-parallel over the intermediate dimension.

Served: dense decoder layers and experts (every family of the registry), quantized routers dequantized. Refused
by name: a quantized LM head, q/k/v parts with different act-order maps, a row-parallel split that would cut a group
(``in_features / tensor_parallel_size`` not a multiple of the group size; experts' down and GGUF alike).
"""

from __future__ import annotations

import itertools
import logging
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from kubellm.runtime.layers import kernel_choice
from kubellm.runtime.layers.checkpoint_error import CheckpointError
from kubellm.runtime.layers.kernel_choice import KernelChoice
from kubellm.runtime.layers.quantized_embedding import QuantizedEmbedding
from kubellm.runtime.layers.quantized_linear import QuantizedLinear
from kubellm.runtime.layers.quantized_weight import QuantizedWeight
from kubellm.runtime.quantization import registry
from kubellm.runtime.quantization.base import QuantizationFormat
from kubellm.runtime.quantization.gguf import GGUF

log = logging.getLogger("kubellm.loader")

# Our fused module -> the checkpoint's parts, in output order (each alternative is one way checkpoints write it).
_PARTS = {
    "qkv_proj": (("q_proj", "k_proj", "v_proj"), ("qkv_proj",)),
    "gate_up_proj": (("gate_proj", "up_proj"), ("gate_up_proj",)),
}
# Tensors of a quantized linear that serve nothing here: static activation scales (activations stay in the
# model dtype). Group maps without act-order are dropped in take().
_DROPPED = ("input_scale", "output_scale")
# A router's (``mlp.gate``, ``block_sparse_moe.gate``) tensors when a checkpoint stores it quantized, besides an FP8
# ``weight``: kept until complete, then dequantized into the float router (QuantizedLoading._take_router).
_ROUTER_QUANTIZED = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale", "weight_scale_inv",
                     "weight_zero_point", "weight_shape", "weight_g_idx")


class _Pending(nn.Module):
    """Where a quantized linear will go; holds no weights, so materialising the model allocates none."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bias

    def forward(self, x):  # pragma: no cover - replaced before the model runs
        raise RuntimeError("quantized layer was never loaded")


@dataclass
class _Target:
    module: str  # our module's path
    out_features: int
    alternatives: tuple[tuple[str, ...], ...]  # the checkpoint prefixes of the parts, per alternative
    bias: bool
    layout: nn.Module  # the parallel linear it replaces: its quantized_loader takes this rank's shard
    got: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # prefix -> suffix -> tensor
    embedding: bool = False  # the token embedding (GGUF): installed behind a QuantizedEmbedding
    tied_head: bool = False  # ... and as the LM head too


def _ignored_patterns(config: dict) -> list[str]:
    qc = config.get("quantization_config") or config.get("compression_config") or {}
    return list(qc.get("modules_to_not_convert") or []) + list(qc.get("ignore") or [])


def _is_ignored(prefix: str, patterns: list[str]) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], prefix):
                return True
        elif p in prefix:  # AWQ's modules_to_not_convert are substrings; compressed-tensors' names
            return True
    return False


def prepare(model: nn.Module, config: dict, kernels: KernelChoice | None = None, source: str = "",
            gguf: bool = False, packed_embedding: bool = False) -> QuantizedLoading | None:
    """For a checkpoint whose config.json declares a quantization (or a GGUF file's blocks, ``gguf``): swap
    the decoder linears of ``model`` (on the meta device) for placeholders and return what loads them; None
    for a checkpoint that is not quantized. ``packed_embedding`` (GGUF): the token embedding too, and the LM
    head where it is tied to it."""
    where = f" in {source}" if source else ""
    fmt = GGUF() if gguf else registry.detect(config, where)
    if fmt is None:
        return None
    patterns = _ignored_patterns(config)
    targets: list[_Target] = []
    layers = model.get_submodule("model.layers")
    for name, m in list(layers.named_modules()):
        if not isinstance(m, nn.Linear):  # the parallel linears are nn.Linear subclasses
            continue
        if name.endswith(".gate"):
            continue  # a router: quantizers leave it in float (a rounded router picks other experts)
        path = f"model.layers.{name}"
        parent, _, leaf = path.rpartition(".")
        if ".experts." in name:  # GGUF's stacked experts come split per expert by gguf.py, named as on the Hub
            alternatives = _expert_alternatives(model, path, patterns, where)
            if alternatives is None:
                continue
        else:
            alternatives = tuple(tuple(f"{parent}.{p}" for p in alt) for alt in _PARTS.get(leaf, ((leaf,),)))
            ignored = [_is_ignored(p, patterns) for alt in alternatives for p in alt]
            if all(ignored):
                continue
            if any(ignored):
                raise CheckpointError(f"{path}{where}: the quantization config leaves some of its parts "
                                      "unquantized; fused layers must be quantized alike")
        targets.append(_Target(path, m.out_features, alternatives, m.bias is not None, m))
        setattr(model.get_submodule(parent), leaf, _Pending(m.in_features, m.out_features, m.bias is not None))
    if gguf and packed_embedding:
        targets.append(_packed_embedding(model, bool(config.get("tie_word_embeddings"))))
    return QuantizedLoading(fmt, targets, kernels, source)


def _packed_embedding(model: nn.Module, tied: bool) -> _Target:
    """Placeholders for the token embedding (and the tied LM head, which would else materialise a dense copy)."""
    embed = model.get_submodule("model.embed_tokens")
    vocab, hidden = embed.num_embeddings, embed.embedding_dim
    model.get_submodule("model").embed_tokens = _Pending(hidden, vocab, False)
    if tied:
        model.lm_head = _Pending(hidden, vocab, False)
    return _Target("model.embed_tokens", vocab, (("model.embed_tokens",),), False, embed, embedding=True,
                   tied_head=tied)


def _expert_alternatives(model: nn.Module, path: str, patterns: list[str], where: str
                         ) -> tuple[tuple[str, ...], ...] | None:
    """The checkpoint prefixes an expert linear's parts may have, one tuple per naming, found by inverting the
    model's ``packed_modules_mapping`` (Qwen3-MoE ``mlp.experts.E.gate_proj``/``up_proj``/``down_proj``, Mixtral
    ``block_sparse_moe.experts.E.w1``/``w3``/``w2``); None when the quantization config leaves the expert
    unquantized. Experts are stored split (gate and up apart), so only split namings are offered."""
    mapping: dict = model.packed_modules_mapping
    parts = path.split(".")
    names = [[p, *(k for k, (ours, shard) in mapping.items() if ours == p and shard is None)] for p in parts[:-1]]
    shards = sorted({s for ours, s in mapping.values() if ours == parts[-1] and s is not None})
    leaves = ([[k for k, (ours, s) in mapping.items() if ours == parts[-1] and s == shard] for shard in shards]
              if shards else [[parts[-1], *(k for k, (ours, _) in mapping.items() if ours == parts[-1])]])
    candidates = []
    for parent in itertools.product(*names):
        for leaf in itertools.product(*leaves):
            alt = tuple(".".join((*parent, p)) for p in leaf)
            if all(model.parameter_of(f"{p}.weight")[0] == f"{path}.weight" for p in alt):
                candidates.append(alt)
    ignored = [[_is_ignored(p, patterns) for p in alt] for alt in candidates]
    if any(all(i) for i in ignored):
        return None
    kept = tuple(alt for alt, i in zip(candidates, ignored, strict=True) if not any(i))
    if not kept:
        raise CheckpointError(f"{path}{where}: the quantization config leaves some of its parts unquantized; "
                              "an expert's gate and up must be quantized alike")
    return kept


class QuantizedLoading:
    """Collects the quantized tensors from the checkpoint stream and installs each layer once complete."""

    def __init__(self, fmt: QuantizationFormat, targets: list[_Target], kernels: KernelChoice | None, source: str):
        self.fmt, self.kernels, self.source = fmt, kernels, source
        self.required = fmt.tensor_names()
        self.pending = {t.module: t for t in targets}
        self.by_prefix = {p: t for t in targets for alt in t.alternatives for p in alt}
        self.model: nn.Module | None = None
        self.device, self.dtype = torch.device("cpu"), torch.bfloat16
        self.built = 0
        self.routers: dict[str, dict[str, torch.Tensor]] = {}  # quantized routers' parts, by prefix, until complete
        self.dequantized: list[tuple[str, torch.Tensor]] = []  # complete ones, for the model's load_weights
        self.routers_dequantized = 0

    def attach(self, model: nn.Module, device: str | torch.device, dtype: torch.dtype) -> None:
        """The materialised model the layers go into (after ``to_empty``), its device and dtype."""
        self.model, self.device, self.dtype = model, torch.device(device), dtype

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Keep ``name`` if it belongs to a quantized layer (True); False: the model loads it."""
        if name.endswith((".k_scale", ".v_scale")):
            return True  # FP8 KV-cache scales: the cache stays in the model dtype
        prefix, _, suffix = name.rpartition(".")
        target = self.by_prefix.get(prefix)
        if target is None:
            if name.startswith("lm_head.") and suffix in ("weight_packed", "qweight"):
                raise CheckpointError(f"a quantized LM head ({name}) is not supported{self._where()}")
            if prefix.endswith(".gate") and (suffix in _ROUTER_QUANTIZED or suffix == "weight" and (
                    prefix in self.routers or tensor.dtype.is_floating_point and tensor.element_size() == 1)):  # FP8
                self._take_router(prefix, suffix, tensor)
                return True
            return False
        if suffix == "weight_scale_inv":
            suffix = "weight_scale"
        if suffix == "weight" and suffix not in self.required:  # formats that store weight_packed, qweight...
            raise CheckpointError(f"{name}{self._where()} is not quantized, but the checkpoint's "
                                  f"quantization_config ({self.fmt.name}) says its layer is")
        if suffix in _DROPPED or suffix in ("g_idx", "weight_g_idx") and not self.fmt.act_order:
            return True
        self.fmt.check_tensor(name, tensor, self._where())
        if suffix not in self.required and suffix != "bias":
            raise CheckpointError(f"unexpected tensor {name!r} for a {self.fmt.name} layer{self._where()}")
        target.got.setdefault(prefix, {})[suffix] = tensor
        self._build_if_complete(target)
        return True

    def finish(self) -> None:
        """After the stream: every quantized layer must have been built."""
        if self.pending or self.routers:
            names = sorted(self.pending) + sorted(self.routers)
            raise CheckpointError(f"{self.source or 'checkpoint'} is missing quantized tensors of {len(names)} "
                                  f"layers, e.g. {', '.join(names[:3])} (expected {', '.join(sorted(self.required))})")
        log.info("%d layers loaded pre-quantized (%s)", self.built, self.fmt.describe())
        if self.routers_dequantized:
            log.info("%d mixture-of-experts routers stored quantized (%s) were dequantized at load and are served in "
                     "%s", self.routers_dequantized, self.fmt.name, str(self.dtype).removeprefix("torch."))

    def pop_dequantized(self) -> list[tuple[str, torch.Tensor]]:
        """The float tensors (``....gate.weight``, float32) of the quantized routers completed since the last call,
        for the model's own ``load_weights``."""
        out, self.dequantized = self.dequantized, []
        return out

    # ---------------------------------------------------------------------------------------------------
    def _where(self) -> str:
        return f" in {self.source}" if self.source else ""

    def _take_router(self, prefix: str, suffix: str, tensor: torch.Tensor) -> None:
        """Keep a part of a router stored quantized; once all are in, its weight dequantized by the format's
        reader (the same math as the quantized layers') joins :attr:`dequantized`. A router takes no kernel: it
        is ``experts x hidden``, and the expert choice should not differ from the stored weights' by more than
        one rounding to the model dtype."""
        if suffix in ("g_idx", "weight_g_idx") and not self.fmt.act_order:
            return
        parts = self.routers.setdefault(prefix, {})
        parts["weight_scale" if suffix == "weight_scale_inv" else suffix] = tensor
        if not self.required <= parts.keys():
            return
        weight, _ = self._read(parts, prefix)
        self.dequantized.append((f"{prefix}.weight", weight.dequantize(torch.float32)))
        del self.routers[prefix]
        self.routers_dequantized += 1

    def _build_if_complete(self, target: _Target) -> None:
        need = self.required | ({"bias"} if target.bias else set())
        for alt in target.alternatives:
            if all(need <= set(target.got.get(p, {})) for p in alt):
                break
        else:
            return
        assert self.model is not None, "attach() the model before streaming tensors"
        device = self.device
        parts, biases, bits = [], [], 0
        for p in alt:
            w, b = self._read(target.got[p], p)
            w, bias = self._shard(target, p, w, target.got[p]["bias"].float() if target.bias else None)
            parts.append(w)
            biases.append(bias)
            bits = max(bits, b)
        weight = _concatenate(parts, target.module, self._where())
        if weight.values.shape[0] != target.out_features:
            raise CheckpointError(f"{target.module}{self._where()}: the quantized parts have "
                                  f"{weight.values.shape[0]} outputs, the config implies {target.out_features}")
        bias = torch.cat(biases) if target.bias else None
        weight = QuantizedWeight(*(None if t is None else t.to(device) for t in
                                   (weight.values, weight.scales, weight.zeros)), weight.group_size,
                                 None if weight.g_idx is None else weight.g_idx.to(device))
        layer = QuantizedLinear(weight, bits, self._path(weight, bits, device),
                                None if bias is None else bias.to(device),
                                int8_activations=bits == 4 and self.kernels.int4_activations == "int8")
        parent, _, leaf = target.module.rpartition(".")
        module: nn.Module = layer
        if target.embedding:  # this rank's vocabulary rows, looked up as the VocabParallelEmbedding would
            module = QuantizedEmbedding(layer, self.dtype, target.layout.vocab_start, target.layout.tp)
        setattr(self.model.get_submodule(parent), leaf, module)
        if target.tied_head:
            self.model.lm_head = layer
        del self.pending[target.module]
        target.got.clear()
        self.built += 1

    def _shard(self, target: _Target, prefix: str, weight: QuantizedWeight, bias: torch.Tensor | None
               ) -> tuple[QuantizedWeight, torch.Tensor | None]:
        """This rank's part of one stored part, cut by the layer type it replaces (the model's name mapping
        says which part of a fused layer ``prefix`` fills; a checkpoint's fused tensor fills them all)."""
        loader = getattr(target.layout, "quantized_loader", None)
        tp = getattr(target.layout, "tp", None)
        if loader is None:
            if tp is not None and tp.size > 1:
                raise CheckpointError(f"{prefix}{self._where()} cannot be sharded: its layer "
                                      f"{type(target.layout).__name__} has no quantized loader")
            return weight, bias
        shard_id = self.model.parameter_of(f"{prefix}.weight")[1] if hasattr(self.model, "parameter_of") else None
        try:
            return loader(weight, bias, shard_id)
        except CheckpointError as e:
            raise CheckpointError(f"{prefix}{self._where()} {e}") from None

    def _path(self, weight: QuantizedWeight, bits: int, device: torch.device) -> str:
        out_features, in_features = weight.values.shape
        if self.kernels is None:  # alone (tests, tools): auto for the device, probed once
            self.kernels = kernel_choice.for_quantized_layer(device, self.dtype, self.fmt.name)
        kernels = self.kernels
        if self.fmt.float_weights:
            return kernels.fp8_path(in_features, weight.group_size)
        return kernels.grouped_path(bits, out_features, in_features, weight.group_size)

    def _read(self, t: dict[str, torch.Tensor], prefix: str) -> tuple[QuantizedWeight, int]:
        """One part's stored tensors in the readers' form, and the bits of its values."""
        try:
            return self.fmt.read(t)
        except (RuntimeError, IndexError, ValueError) as e:
            raise CheckpointError(f"cannot read the {self.fmt.name} tensors of {prefix}{self._where()}: {e}") from e


def _concatenate(parts: list[QuantizedWeight], module: str, where: str) -> QuantizedWeight:
    if len(parts) == 1:
        return parts[0]
    groups = {p.values.shape[1] if p.group_size <= 0 else p.group_size for p in parts}
    if len(groups) > 1:  # GGUF mixes types (Q4_K q, Q6_K v): repeat each scale down to the smallest group
        smallest = min(groups)
        if any(g % smallest for g in groups):
            raise CheckpointError(f"{module}{where}: its parts' group sizes {sorted(groups)} do not nest")
        parts = [_regroup(p, smallest) for p in parts]
    first = parts[0]
    maps = [p.g_idx for p in parts]
    if any(m is not None for m in maps) and not all(m is not None and torch.equal(m, maps[0]) for m in maps):
        raise CheckpointError(f"{module}{where}: its parts were quantized with different act-order group maps "
                              "(g_idx); fused layers need one")
    zeros = None
    if any(p.zeros is not None for p in parts):
        zeros = torch.cat([p.zeros if p.zeros is not None else torch.zeros_like(p.scales) for p in parts])
    values = [p.values for p in parts]
    if len({v.dtype for v in values}) > 1:  # 4-bit (uint8 0..15) beside 8-bit (int8) values: all fit int8
        values = [v.to(torch.int16) for v in values]
    return QuantizedWeight(torch.cat(values), torch.cat([p.scales for p in parts]), zeros, first.group_size, maps[0])


def _regroup(w: QuantizedWeight, group: int) -> QuantizedWeight:
    size = w.values.shape[1] if w.group_size <= 0 else w.group_size
    if size == group:
        return w
    r = size // group
    return QuantizedWeight(w.values, w.scales.repeat_interleave(r, 1),
                           None if w.zeros is None else w.zeros.repeat_interleave(r, 1), group, w.g_idx)
