"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2): one module, variations from the config.

Inputs are flat: all tokens of a step in one ``[num_tokens]`` tensor, no padding. q/k/v and
gate/up projections are fused into one matmul each. The projections are the tensor-parallel layer types of
runtime/layers/parallel_linear.py, which load and slice their own weights; ``load_weights`` only maps Hugging
Face names onto parameters and shard ids (``packed_modules_mapping``), so every family shares one loading path.
The embedding and the LM head are vocabulary-parallel (runtime/layers/vocab_parallel.py).
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import nn

from kubellm.runtime.distributed.tp_group import Group
from kubellm.runtime.layers import fused_decode
from kubellm.runtime.layers.attention import (
    Attention,
    AttentionMetadata,
    LayerOptions,
    NativeCpuAttentionBackend,
)
from kubellm.runtime.layers.layer_ops import CPU_OPS, RMSNorm, on_cpu_ops
from kubellm.runtime.layers.moe import FusedMoE
from kubellm.runtime.layers.parallel_linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    ShardId,
    replicated_loader,
)
from kubellm.runtime.layers.rotary import RotaryEmbedding
from kubellm.runtime.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding, gather_logits
from kubellm.runtime.models.checkpoint import CheckpointError
from kubellm.runtime.models.config import ModelConfig


class LlamaAttention(nn.Module):
    """With tensor parallelism this rank's share of the heads; o_proj's partial sums are all-reduced."""

    native = False  # rotary embedding through the in-place kernel of ops
    ops = CPU_OPS

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: Group):
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp.size, cfg.num_kv_heads // tp.size
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          cfg.attention_bias, tp)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, False, tp)
        self.rotary = rotary
        opts = LayerOptions(window=cfg.attention_window)  # Mistral v0.1, Phi-3 4k: every layer windowed
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, opts)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] → q [T, heads, D], k and v [T, kv heads, D] (before rotary; families add norms here)."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim),
                v.view(t, self.num_kv_heads, self.head_dim))

    def rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary embedding of q [T, H, D] and k [T, KVH, D] (in place with the native kernel)."""
        if self.native:
            self.ops.rotary_embedding_(positions, q, k, self.rotary.cos, self.rotary.sin)
            return q, k
        return self.rotary(positions, q, k)

    def fused_qk_norms(self) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """The q and k norm weights the fused decode layer applies before rotary ((None, None): none), or None if
        this block does more than the fused layer does (a subclass that adds to it)."""
        return (None, None) if type(self) is LlamaAttention else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x)
        q, k = self.rotate(positions, q, k)
        o = self.attn(q, k, v, meta)
        return self.tp.all_reduce(self.o_proj(o.reshape(t, self.q_size)))


class LlamaMLP(nn.Module):
    native = False  # SiLU-and-mul through the fused kernel of ops
    ops = CPU_OPS

    def __init__(self, cfg: ModelConfig, tp: Group):
        super().__init__()
        self.tp = tp
        self.intermediate = cfg.intermediate_size // tp.size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, dict.fromkeys((0, 1), cfg.intermediate_size),
                                                       False, tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, tp)

    def fused_decode_args(self) -> tuple | None:
        """This MLP's arguments of the fused decode layer (runtime/layers/fused_decode.py's
        :func:`~kubellm.runtime.layers.fused_decode.dense_mlp_args`), or None unless it is this plain MLP on
        native linears without biases and the native SiLU-and-mul."""
        if type(self) is not LlamaMLP or not on_cpu_ops(self) or self.tp.size > 1:
            return None
        return fused_decode.dense_mlp_args(self.gate_up_proj, self.down_proj, self.intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.native:
            return self.tp.all_reduce(self.down_proj(self.ops.silu_and_mul(gate_up)))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.tp.all_reduce(self.down_proj(nn.functional.silu(gate) * up))


def dense_mlp(cfg: ModelConfig, tp: Group, layer: int) -> nn.Module:
    return LlamaMLP(cfg, tp)


def moe_mlp(cfg: ModelConfig, tp: Group, layer: int) -> nn.Module:
    """The MLP of ``layer`` in a mixture-of-experts family: experts where the config makes the layer sparse, else
    the dense MLP."""
    moe = cfg.moe
    if moe is None or layer not in moe.sparse_layers:
        return LlamaMLP(cfg, tp)
    return FusedMoE(cfg.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k, moe.renormalize, tp)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: Group, attention_cls=LlamaAttention,
                 mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention_cls(cfg, rotary, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp if mlp is not None else LlamaMLP(cfg, tp)

    def forward(self, positions, hidden, residual, meta):
        """Returns this layer's MLP output and the residual stream before it is added (the next norm adds it)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def fused_decode_args(self) -> tuple | None:
        """``(fn, args)`` of the fused decode layer (runtime/layers/fused_decode.py's
        :func:`~kubellm.runtime.layers.fused_decode.decode_layer_call`), or None unless it is a Llama layer running
        entirely on the native CPU kernels whose attention (Llama's, Qwen3's q/k norms) and MLP (dense, or packed
        experts) each give their part (other families add norms, scales or layer types)."""
        attn = self.self_attn
        qk_norms = attn.fused_qk_norms() if isinstance(attn, LlamaAttention) else None
        mlp = getattr(self.mlp, "fused_decode_args", lambda: None)()
        qkv, o = (fused_decode.fused_linear(getattr(attn, name, None)) for name in ("qkv_proj", "o_proj"))
        norms = (self.input_layernorm, self.post_attention_layernorm)
        if (type(self) is not LlamaDecoderLayer or qk_norms is None or mlp is None or attn.tp.size > 1
                or qkv is None or o is None or o[-1] is not None or not on_cpu_ops(attn, *norms)
                or not all(type(n) is RMSNorm for n in norms)
                or not isinstance(attn.attn.backend, NativeCpuAttentionBackend)
                or attn.attn.k_cache.dtype != torch.bfloat16):
            return None
        opts = attn.attn.opts
        rest = (attn.rotary.cos, attn.rotary.sin, attn.attn.k_cache, attn.attn.v_cache, attn.num_heads,
                attn.num_kv_heads, attn.attn.backend.scale, opts.window or 0, opts.softcap or 0.0, *qk_norms)
        return fused_decode.decode_layer_call((norms[0].weight, norms[1].weight, norms[0].eps), qkv, o, mlp, rest)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int, tp: Group,
                 attention_cls=LlamaAttention, mlp_factory=dense_mlp):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        # One table shared by every layer (registered once here, referenced by each attention).
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, self.rotary, tp, attention_cls, mlp_factory(cfg, tp, i))
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fused_layers: list[tuple] | None = None  # each layer's (fn, args), set by use_fused_decode

    def forward(self, input_ids, positions, meta):
        hidden, residual = self.embed_tokens(input_ids), None
        if self.fused_layers is not None and meta.num_decodes == hidden.shape[0] and not meta.prefills:
            # A pure decode step: one native call per layer (zeros make the first add a copy).
            residual = torch.zeros_like(hidden)
            for fn, args in self.fused_layers:
                hidden = fn(hidden, residual, positions, meta.slot_mapping, meta.decode_block_tables,
                            meta.decode_context_lens, *args)
            return self.norm(hidden, residual)[0]
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    # Families that change only the attention block (Qwen3) or the MLP (mixtures of experts) swap these.
    attention_cls = LlamaAttention
    mlp_factory = staticmethod(dense_mlp)  # (cfg, tp, layer index) -> the layer's MLP module
    # Checkpoint name component -> (our component, part of the fused layer it fills, or None for a rename).
    # Checkpoints that store the fused tensors (Phi-3's qkv_proj, gate_up_proj) need no entry: the fused
    # layer loads them whole.
    packed_modules_mapping: dict[str, tuple[str, ShardId]] = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int | None = None,
                 tp: Group | None = None):
        super().__init__()
        self.config = cfg
        self.tp = tp or Group()
        self.model = LlamaModel(cfg, dtype, max_positions or cfg.max_position_embeddings, self.tp, self.attention_cls,
                                self.mlp_factory)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, self.tp)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when the config says so; redo after to_empty()/to(). A quantized
        embedding (GGUF) is tied by the loader, which makes its table the LM head."""
        if self.config.tie_word_embeddings and isinstance(self.model.embed_tokens, nn.Embedding):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] → final hidden states [T, hidden]."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] → float32 logits [N, vocab] (with tensor parallelism every rank must call it:
        the ranks' vocabulary slices are gathered)."""
        return gather_logits(self.lm_head(hidden).float(), self.tp, self.config.vocab_size)

    def parameter_of(self, name: str) -> tuple[str, ShardId]:
        """Checkpoint tensor name → (our parameter name, shard id), by ``packed_modules_mapping``."""
        parts, shard_id = name.split("."), None
        for i, part in enumerate(parts):
            if (mapped := self.packed_modules_mapping.get(part)) is not None:
                parts[i] = mapped[0]
                shard_id = mapped[1] if mapped[1] is not None else shard_id
        return ".".join(parts), shard_id

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "") -> None:
        """Hand each checkpoint tensor to the ``weight_loader`` of the module owning its parameter (this rank's
        slice with tensor parallelism; replicated where the module has none); complain about any gap."""
        source = source or "checkpoint"
        params = dict(self.named_parameters(remove_duplicate=False))
        modules = dict(self.named_modules(remove_duplicate=False))
        tied = self.config.tie_word_embeddings
        loaded: dict[str, set[ShardId]] = defaultdict(set)
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or name == "lm_head.weight" and tied:
                continue  # rotary tables are computed; a tied head is the embedding
            target, shard_id = self.parameter_of(name)
            param = params.get(target)
            if param is None:
                raise CheckpointError(f"unexpected tensor {name!r} in {source}")
            loader = getattr(modules[target.rpartition(".")[0]], "weight_loader", replicated_loader)
            try:
                loader(param, tensor, shard_id)
            except CheckpointError as e:
                raise CheckpointError(f"tensor {name!r} {e} ({source})") from None
            loaded[target].add(shard_id)
        missing = []
        for pname in params:
            if pname == "lm_head.weight" and tied:
                continue
            got = loaded.get(pname, set())
            if None in got:
                continue  # loaded whole
            parts = getattr(modules[pname.rpartition(".")[0]], "shard_ids", None)
            missing += [pname] if parts is None else [f"{pname} (part {p!r})" for p in parts if p not in got]
        if missing:
            shown = ", ".join(missing[:5])
            raise CheckpointError(f"{source} is missing {len(missing)} tensors, e.g. {shown}")


FUSED_DECODE_ENV = "KUBELLM_FUSED_DECODE"  # 0: decode steps run the module tree (A/B benchmarks)


def use_fused_decode(model: nn.Module) -> bool:
    """Run pure decode steps one native call per layer (:func:`LlamaDecoderLayer.fused_decode_args`) when every
    layer can; call after the caches, backend, native ops and packed weights are in place. Returns whether it
    does (never with ``KUBELLM_FUSED_DECODE=0``)."""
    body = getattr(model, "model", None)
    if not isinstance(body, LlamaModel) or os.environ.get(FUSED_DECODE_ENV, "1") == "0":
        return False
    args = [layer.fused_decode_args() for layer in body.layers]
    body.fused_layers = args if args and all(a is not None for a in args) else None
    return body.fused_layers is not None

