"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2): one module, variations from the config.

Inputs are flat: all tokens of a step in one ``[num_tokens]`` tensor, no padding. q/k/v and
gate/up projections are fused into one matmul each; ``load_weights`` maps Hugging Face names onto
the fused parameters, so every architecture shares one loading path.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kubellm.kernels import cpu_layer_ops as ops
from kubellm.runtime.layers.attention import Attention, AttentionMetadata, LayerOptions
from kubellm.runtime.layers.rotary import RotaryEmbedding
from kubellm.runtime.models.checkpoint import CheckpointError
from kubellm.runtime.models.config import ModelConfig
from kubellm.runtime.tp_group import Group


class RMSNorm(nn.Module):
    """Normalises in float32 like the Hugging Face implementation, then scales in the model dtype.

    With ``residual``, first folds ``x`` into the residual stream: returns ``(norm(residual + x), residual + x)``.
    ``native`` (set by :func:`use_native_ops`) runs the fused CPU kernel, which does both in place.
    """

    native = False

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            if self.native:
                return ops.rms_norm(x, self.weight, self.eps)
            return ops.reference_rms_norm(x, self.weight, self.eps)
        if self.native:
            ops.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return ops.reference_rms_norm(residual, self.weight, self.eps), residual


class LlamaAttention(nn.Module):
    """With tensor parallelism this rank's share of the heads; o_proj's partial sums are all-reduced."""

    native = False  # rotary embedding through the in-place CPU kernel

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: Group):
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp.size, cfg.num_kv_heads // tp.size
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.rotary = rotary
        opts = LayerOptions(window=cfg.attention_window)  # Mistral v0.1, Phi-3 4k: every layer windowed
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, opts)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] → q [T, heads, D], k and v [T, kv heads, D] (before rotary; families add norms here)."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim),
                v.view(t, self.num_kv_heads, self.head_dim))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x)
        if self.native:
            ops.rotary_embedding_(positions, q, k, self.rotary.cos, self.rotary.sin)
        else:
            q, k = self.rotary(positions, q, k)
        o = self.attn(q, k, v, meta)
        return self.tp.all_reduce(self.o_proj(o.reshape(t, self.q_size)))


class LlamaMLP(nn.Module):
    native = False  # SiLU-and-mul through the fused CPU kernel

    def __init__(self, cfg: ModelConfig, tp: Group):
        super().__init__()
        self.tp = tp
        self.intermediate = cfg.intermediate_size // tp.size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = nn.Linear(self.intermediate, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.native:
            return self.tp.all_reduce(self.down_proj(ops.silu_and_mul(gate_up)))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.tp.all_reduce(self.down_proj(nn.functional.silu(gate) * up))


def dense_mlp(cfg: ModelConfig, tp: Group, layer: int) -> nn.Module:
    return LlamaMLP(cfg, tp)


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


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int, tp: Group,
                 attention_cls=LlamaAttention, mlp_factory=dense_mlp):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # One table shared by every layer (registered once here, referenced by each attention).
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, self.rotary, tp, attention_cls, mlp_factory(cfg, tp, i))
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        return self.norm(hidden, residual)[0]


# HF parameter name fragment -> (our fused parameter, shard index)
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


# Tensor parallelism: HF weights split by output rows (whole heads, whole MLP channels; biases alike) or by
# input columns (o_proj, down_proj); everything else is replicated.
_SPLIT_ROWS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_SPLIT_COLUMNS = ("o_proj", "down_proj")


def tp_shard(name: str, tensor: torch.Tensor, tp: Group) -> torch.Tensor:
    """This rank's slice of the HF tensor ``name``."""
    if tp.size == 1:
        return tensor
    part = name.split(".")[-2] if "." in name else ""
    dim = 0 if part in _SPLIT_ROWS else 1 if part in _SPLIT_COLUMNS and name.endswith("weight") else None
    if dim is None:
        return tensor
    n = tensor.shape[dim] // tp.size
    return tensor.narrow(dim, tp.rank * n, n)


class LlamaForCausalLM(nn.Module):
    # Families that change only the attention block (Qwen3) or the MLP (mixtures of experts) swap these.
    attention_cls = LlamaAttention
    mlp_factory = staticmethod(dense_mlp)  # (cfg, tp, layer index) -> the layer's MLP module

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int | None = None,
                 tp: Group | None = None):
        super().__init__()
        self.config = cfg
        self.tp = tp or Group()
        self.model = LlamaModel(cfg, dtype, max_positions or cfg.max_position_embeddings, self.tp, self.attention_cls,
                                self.mlp_factory)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when the config says so; redo after to_empty()/to()."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] → final hidden states [T, hidden]."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] → float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()

    def shard_sizes(self, target: str) -> list[int]:
        """Rows of each part of the fused parameter ``target`` (q/k/v, or gate/up), on this rank."""
        module = self.get_submodule(target.rsplit(".", 2)[0])
        if isinstance(module, LlamaAttention):
            return [module.q_size, module.kv_size, module.kv_size]
        return [module.intermediate] * 2

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "") -> None:
        """Copy HF-named tensors into our (partly fused) parameters; complain about any gap."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding provides it
            if (key := self.load_special(name, tensor)) is not None:
                loaded.add(key)
                continue
            target, shard = name, None
            for part, (fused, idx) in _FUSED.items():
                if f".{part}." in name:
                    target, shard = name.replace(part, fused), idx
                    break
            param = params.get(target)
            if param is None:
                raise CheckpointError(f"unexpected tensor {name!r} in {source or 'checkpoint'}")
            tensor = tp_shard(name, tensor, self.tp)
            dst = param.data
            if shard is not None:
                sizes = self.shard_sizes(target)
                offset = sum(sizes[:shard])
                dst = dst.narrow(0, offset, sizes[shard])
            if tuple(dst.shape) != tuple(tensor.shape):
                raise CheckpointError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {tuple(dst.shape)}"
                    f" ({source or 'checkpoint'})")
            dst.copy_(tensor)
            loaded.add(f"{target}#{shard}")
        expected = self.special_keys()
        for pname in params:
            if pname == "lm_head.weight" and self.config.tie_word_embeddings or self.loads_specially(pname):
                continue
            fused = pname.split(".")[-2]
            if fused in ("qkv_proj", "gate_up_proj") and pname.endswith("weight") or (
                    fused == "qkv_proj" and pname.endswith("bias")):
                expected.update(f"{pname}#{i}" for i in range(3 if fused == "qkv_proj" else 2))
            else:
                expected.add(f"{pname}#None")
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(m.split("#")[0] for m in missing[:5])
            raise CheckpointError(f"{source or 'checkpoint'} is missing {len(missing)} tensors, e.g. {shown}")


    def load_special(self, name: str, tensor: torch.Tensor) -> str | None:
        """Load a tensor the generic mapping does not cover (experts); return its key, or None if not ours."""
        return None

    def special_keys(self) -> set[str]:
        """Keys :meth:`load_special` must have returned by the end of loading."""
        return set()

    def loads_specially(self, param_name: str) -> bool:
        """Whether :meth:`load_special` fills this parameter (so the generic check skips it)."""
        return False


def use_native_ops(model: nn.Module, enabled: bool) -> None:
    """Route RMSNorm, rotary and SiLU-and-mul through the fused CPU kernels (or back to the references): every
    module whose class declares a ``native`` switch."""
    for module in model.modules():
        if isinstance(getattr(type(module), "native", None), bool):
            module.native = enabled
