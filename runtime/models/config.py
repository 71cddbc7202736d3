"""The subset of a Hugging Face config.json the Llama family needs, validated once at load time."""

from __future__ import annotations

from dataclasses import dataclass, field

from kubellm.runtime.models.checkpoint import CheckpointError
from kubellm.runtime.models.registry import MODEL_CLASSES

SUPPORTED_ARCHITECTURES = tuple(MODEL_CLASSES)  # what this runtime implements
WINDOWED_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")  # sliding-window layers implemented
# Architectures whose every layer applies config.json's sliding_window (transformers masks them all alike):
# Mistral v0.1 (4096), Phi-3-mini-4k (2047), Mixtral when its config sets one.
EVERY_LAYER_WINDOWED = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")

# Multimodal checkpoints whose text tower we serve: (architecture, text architecture, text config defaults).
# Hub configs of Gemma 3 list only what differs from transformers' Gemma3TextConfig defaults, copied here.
TEXT_TOWERS = {
    "Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", {
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "sliding_window_pattern": 6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "hidden_activation": "gelu_pytorch_tanh"}),
}  # fmt: skip


def text_tower_config(cfg: dict) -> dict:
    """The config of the text model inside a multimodal checkpoint (as a text-only config.json would be), or
    ``cfg`` itself."""
    arch = next((a for a in cfg.get("architectures") or [] if a in TEXT_TOWERS), None)
    if arch is None:
        return cfg
    text_arch, defaults = TEXT_TOWERS[arch]
    text = {**defaults, **(cfg.get("text_config") or {}), "architectures": [text_arch]}
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
    return text


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts MLPs: which layers have them, how many experts, how tokens are routed."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    renormalize: bool  # rescale the top-k router weights to sum to 1
    sparse_layers: tuple[int, ...]  # the others keep a dense MLP of ModelConfig.intermediate_size

    @classmethod
    def from_hf(cls, cfg: dict, arch: str, num_layers: int, where: str) -> MoEConfig | None:
        # Hub configs say num_experts (Qwen) or num_local_experts (Mixtral); transformers 5 saves both as the latter.
        experts = cfg.get("num_local_experts") or cfg.get("num_experts")
        if not experts:
            return None
        top_k = cfg.get("num_experts_per_tok")
        if not isinstance(top_k, int) or not 0 < top_k <= experts:
            raise CheckpointError(f"num_experts_per_tok={top_k!r} must be within 1..{experts}{where}")
        if cfg.get("shared_expert_intermediate_size") or cfg.get("n_shared_experts"):
            raise CheckpointError(f"shared experts{where} are not supported yet")
        step, dense = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or ())
        mixtral = arch == "MixtralForCausalLM"
        return cls(
            num_experts=experts,
            top_k=top_k,
            intermediate_size=cfg["intermediate_size"] if mixtral else cfg.get("moe_intermediate_size") or 0,
            renormalize=True if mixtral else bool(cfg.get("norm_topk_prob", False)),
            sparse_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
        )


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2)
    sliding_window: int | None
    moe: MoEConfig | None = None
    # The window every layer applies (EVERY_LAYER_WINDOWED with a window shorter than the context), or None.
    # A query at position p sees keys p - window < j <= p, as transformers masks them.
    attention_window: int | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)  # config.json, for family-specific fields

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "") -> ModelConfig:
        where = f" in {source}" if source else ""
        cfg = text_tower_config(cfg)
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise CheckpointError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}{where}; "
                f"kubellm runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if not isinstance(cfg.get(k), int) or cfg[k] <= 0]
        if missing:
            raise CheckpointError(f"config.json{where} lacks positive integer fields: {', '.join(missing)}")
        num_heads = cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        if num_heads % num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads ({num_kv_heads}){where}")
        if head_dim % 2:
            raise CheckpointError(f"head_dim must be even for rotary embeddings, got {head_dim}{where}")
        rope_scaling = _rope_scaling(cfg, where)
        if rope_scaling and rope_scaling["rope_type"] == "longrope":
            for key in ("short_factor", "long_factor"):
                if len(rope_scaling[key]) != head_dim // 2:
                    raise CheckpointError(f"rope_scaling {key} has {len(rope_scaling[key])} entries, head_dim "
                                          f"{head_dim} needs {head_dim // 2}{where}")
        if float(cfg.get("partial_rotary_factor") or 1.0) != 1.0:
            raise CheckpointError(f"partial_rotary_factor={cfg['partial_rotary_factor']}{where} is not supported yet "
                                  "(rotary over the whole head only)")
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch != "Qwen2ForCausalLM") else None
        max_pos = cfg.get("max_position_embeddings") or 2048
        windows_all = sliding is not None and sliding < max_pos and arch in EVERY_LAYER_WINDOWED
        if sliding is not None and sliding < max_pos and not windows_all and arch not in WINDOWED_ARCHITECTURES:
            raise CheckpointError(
                f"sliding_window={sliding} shorter than the context ({max_pos}){where} is not supported yet "
                f"for {arch} (served: {', '.join(EVERY_LAYER_WINDOWED + WINDOWED_ARCHITECTURES)})")
        if windows_all and not (isinstance(sliding, int) and sliding > 0):
            raise CheckpointError(f"sliding_window must be a positive integer, got {sliding!r}{where}")
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None and isinstance(cfg.get("rope_parameters"), dict):
            rope_theta = cfg["rope_parameters"].get("rope_theta")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch in WINDOWED_ARCHITECTURES)),  # Gemma ties
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            sliding_window=sliding,
            moe=MoEConfig.from_hf(cfg, arch, cfg["num_hidden_layers"], where),
            attention_window=sliding if windows_all else None,
            raw=dict(cfg),
        )


def _rope_scaling(cfg: dict, where: str) -> dict | None:
    """The rope scaling dict, normalised: None for plain RoPE; Phi-3's "su" is longrope, and longrope carries
    its original length and factor (transformers reads both from the top level when there)."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if scaling is None:
        return None
    scaling = dict(scaling)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "su" or (rope_type == "yarn" and cfg.get("model_type") == "phi3"):
        rope_type = "longrope"  # what transformers' Phi3Config does with the old names
    if rope_type not in ("default", "llama3", "linear", "longrope"):
        raise CheckpointError(
            f"rope_scaling type {rope_type!r}{where} is not supported (default, linear, llama3, longrope)")
    if rope_type == "default":
        return None
    scaling["rope_type"] = rope_type
    if rope_type == "longrope":
        max_pos = cfg.get("max_position_embeddings") or 2048
        original = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = original = original or max_pos
        if scaling.get("factor") is None:
            scaling["factor"] = max_pos / original
        for key in ("short_factor", "long_factor"):
            if not isinstance(scaling.get(key), list):
                raise CheckpointError(f"rope_scaling {key} must be a list of numbers{where}")
    return scaling
