"""Gemma 2 and Gemma 3 (text): the Llama block rearranged, with the family's own numerics.

- embeddings scaled by sqrt(hidden) (rounded to the model dtype, as transformers does);
- RMSNorm with weights stored as offsets from 1, the product taken in float32;
- four norms per layer: before and after attention, before and after the MLP;
- GeGLU MLP (gelu, tanh approximation);
- query scale from ``query_pre_attn_scalar``, not the head size;
- sliding-window attention on the layers ``layer_types`` marks (Gemma 2: every other layer; Gemma 3: five of
  six), honoured by every attention backend (runtime/layers/attention.py: the window is a kernel argument);
- Gemma 2: attention logits and final logits soft-capped; Gemma 3: RMSNorm on each head of q and k, and
  separate rotary tables for local (``rope_local_base_freq``) and global layers (``rope_theta``, scaling).

The projections are Llama's layers (same names, fusions and tensor-parallel layer types), so loading and
sharding are theirs; the norms are replicated.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from kubellm.runtime.distributed.tp_group import Group
from kubellm.runtime.layers.attention import Attention, AttentionMetadata, LayerOptions
from kubellm.runtime.layers.rotary import RotaryEmbedding
from kubellm.runtime.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding, gather_logits
from kubellm.runtime.models.checkpoint import CheckpointError
from kubellm.runtime.models.config import ModelConfig
from kubellm.runtime.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class GemmaSettings:
    layer_types: tuple[str, ...]
    window: int | None
    attn_softcap: float | None
    final_softcap: float | None
    query_scale: float
    qk_norm: bool  # Gemma 3
    rope: dict[str, tuple[float, dict | None]]  # layer type -> (theta, scaling)

    @classmethod
    def from_config(cls, config: ModelConfig) -> GemmaSettings:
        raw, gemma3 = config.raw, config.architecture == "Gemma3ForCausalLM"
        n = config.num_layers
        types = raw.get("layer_types")
        if types is None:  # older configs: a pattern (Gemma 3 default 6: five local layers, then a global one)
            pattern = raw.get("sliding_window_pattern") or (6 if gemma3 else 2)
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
        if len(types) != n or set(types) - {SLIDING, FULL}:
            raise CheckpointError(f"layer_types must list {SLIDING!r}/{FULL!r} for each of the {n} layers")
        window = raw.get("sliding_window")
        if SLIDING in types and not (isinstance(window, int) and window > 0):
            raise CheckpointError(f"sliding layers need a positive sliding_window, got {window!r}")
        return cls(
            layer_types=tuple(types),
            window=window if SLIDING in types else None,
            attn_softcap=raw.get("attn_logit_softcapping"),
            final_softcap=raw.get("final_logit_softcapping"),
            query_scale=float(raw.get("query_pre_attn_scalar") or config.head_dim) ** -0.5,
            qk_norm=gemma3,
            rope=_rope(raw, config, gemma3),
        )


def _rope(raw: dict, config: ModelConfig, gemma3: bool) -> dict[str, tuple[float, dict | None]]:
    if not gemma3:
        return dict.fromkeys((SLIDING, FULL), (config.rope_theta, config.rope_scaling))
    params = raw.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:  # transformers 5 writes one dict per layer type
        out = {}
        for kind, default in ((FULL, 1_000_000.0), (SLIDING, 10_000.0)):
            p = dict(params.get(kind) or {})
            theta = float(p.pop("rope_theta", default))
            kind_of = p.get("rope_type", p.get("type", "default"))
            out[kind] = (theta, None if kind_of == "default" else p)
        return out
    scaling = raw.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return {FULL: (float(raw.get("rope_theta") or 1_000_000.0), scaling),
            SLIDING: (float(raw.get("rope_local_base_freq") or 10_000.0), None)}


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in float32, then back to the input dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: Group, settings: GemmaSettings, kind: str,
                 max_positions: int):
        super().__init__(cfg, rotary, tp)
        # A window no shorter than the served context never hides a key: plain attention, so the kernels run it.
        window = settings.window if kind == SLIDING and settings.window < max_positions else None
        opts = LayerOptions(window=window, softcap=settings.attn_softcap)
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, opts)
        if settings.qk_norm:
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        # The backends scale by head_dim ** -0.5; q carries the rest (rotary is linear, so before it is fine).
        self.q_mult = settings.query_scale / cfg.head_dim**-0.5

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().qkv(x)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if self.q_mult != 1.0:
            q = q * self.q_mult
        return q, k, v


class GemmaMLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.tp.all_reduce(self.down_proj(nn.functional.gelu(gate, approximate="tanh") * up))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: Group, settings: GemmaSettings, kind: str,
                 max_positions: int):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = GemmaAttention(cfg, rotary, tp, settings, kind, max_positions)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = GemmaMLP(cfg, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(hidden), meta))
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class GemmaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int, tp: Group, settings: GemmaSettings):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.normalizer = cfg.hidden_size**0.5
        # One rotary table per layer type (equal for Gemma 2), shared by the layers of that type.
        tables = {kind: RotaryEmbedding(cfg.head_dim, max_positions, theta, scaling, dtype)
                  for kind, (theta, scaling) in settings.rope.items()}
        self.rotary, self.rotary_local = tables[FULL], tables[SLIDING]
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, tables[kind], tp, settings, kind, max_positions)
                                    for kind in settings.layer_types)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * torch.tensor(self.normalizer, dtype=hidden.dtype)
        for layer in self.layers:
            hidden = layer(positions, hidden, meta)
        return self.norm(hidden)


class GemmaForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int | None = None,
                 tp: Group | None = None):
        nn.Module.__init__(self)
        self.config, self.tp = cfg, tp or Group()
        self.settings = GemmaSettings.from_config(cfg)
        self.model = GemmaModel(cfg, dtype, max_positions or cfg.max_position_embeddings, self.tp, self.settings)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, self.tp)
        self.tie_weights()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "") -> None:
        super().load_weights(text_tower(weights), source)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = gather_logits(self.lm_head(hidden).float(), self.tp, self.config.vocab_size)
        if (cap := self.settings.final_softcap) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


# Multimodal checkpoints (Gemma3ForConditionalGeneration): the text model's tensors under these prefixes
# (the Hub's layout, then transformers 5's in-memory one); the vision tower and projector are not loaded.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_tower(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name.startswith(_VISION_PREFIXES):
            continue
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                name = new + name.removeprefix(old)
                break
        yield name, tensor
