"""Tiny Llama-family checkpoints in real Hugging Face format, built offline for parity tests.

Nothing here downloads anything: the tokenizer is a byte-level BPE trained on a generated corpus, the
weights are random from a fixed seed. ``build_checkpoint`` writes a folder that transformers'
``AutoModelForCausalLM`` / ``AutoTokenizer`` load as they would a Hub checkpoint (config.json,
safetensors, tokenizer.json, tokenizer_config.json with a ChatML template, generation_config.json).
``hf_greedy`` is the transformers reference the runtime is compared against.

Tests may import transformers; the runtime must not. transformers is imported lazily so that merely
importing this module (e.g. from conftest.py) stays cheap.
"""

from __future__ import annotations

import functools
import json
import random
import zlib
from pathlib import Path

import tokenizers
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers

__all__ = [
    "ARCHS",
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "arch_config",
    "build_checkpoint",
    "chatml",
    "hf_greedy",
    "load_hf_model",
    "make_corpus",
    "train_tokenizer",
]

# --------------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------------

# Ids 0, 1, 2 in that order, as in SmolLM2.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_TOKEN = "<|endoftext|>"  # not prepended by the tokenizer (no post-processor template), as in SmolLM2/Qwen
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2

# ChatML, as SmolLM2-Instruct / Qwen2 use it (without their default system prompt).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def chatml(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """What CHAT_TEMPLATE renders for ``messages``, written out by hand (the expected string in tests)."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


_SUBJECTS = [
    "the cat", "a small dog", "my neighbour", "the old teacher", "our team", "the robot", "a young girl",
    "the farmer", "every student", "the captain", "her brother", "the tired engineer", "a curious fox",
    "the bakery owner", "this model", "the cluster", "the operator", "a quiet server",
]  # fmt: skip
_VERBS = [
    "reads", "writes", "builds", "finds", "carries", "watches", "paints", "counts", "repairs", "sells",
    "schedules", "deploys", "remembers", "ignores", "explains", "measures", "cooks", "answers",
]  # fmt: skip
_ADJECTIVES = [
    "red", "heavy", "bright", "ancient", "strange", "quiet", "broken", "shiny", "wooden", "tiny", "huge",
    "careful", "green", "cold", "warm", "simple", "complex", "fast",
]  # fmt: skip
_NOUNS = [
    "book", "letter", "bridge", "apple", "river", "window", "garden", "machine", "pod", "container",
    "request", "token", "mountain", "song", "table", "lamp", "engine", "question", "answer", "node",
]  # fmt: skip
_PLACES = [
    "in the kitchen", "near the station", "at the market", "under the bridge", "on the roof",
    "in the data center", "by the river", "at school", "in Paris", "in Tokyo", "after lunch", "before dawn",
]  # fmt: skip
_ADVERBS = ["slowly", "quickly", "again", "carefully", "never", "always", "quietly", "happily"]
_CONNECTORS = ["and then", "but", "because", "so", "while", "although"]
_EXOTIC = [
    "café", "naïve", "Zürich", "señor", "crème brûlée", "日本語", "東京", "你好", "こんにちは", "😀", "🚀",
    "Ελλάδα", "Москва", "½", "€5", "→",
]  # fmt: skip
_QUESTIONS = ["What", "Why", "How", "Where", "When", "Who"]


def make_corpus(seed: int = 0, n_sentences: int = 400) -> list[str]:
    """A deterministic English-like corpus with punctuation, numbers, and a few non-ASCII words."""
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(n_sentences):
        kind = i % 6
        subj, verb = rng.choice(_SUBJECTS), rng.choice(_VERBS)
        obj = f"{rng.choice(['the', 'a', 'one', 'that'])} {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
        if kind == 0:
            s = f"{subj} {verb} {obj} {rng.choice(_PLACES)}."
        elif kind == 1:
            s = f"{subj} {rng.choice(_ADVERBS)} {verb} {rng.randint(0, 9999)} {rng.choice(_NOUNS)}s, {rng.choice(_CONNECTORS)} {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {obj}!"
        elif kind == 2:
            s = f"{rng.choice(_QUESTIONS)} does {subj} {verb.rstrip('s')} {obj}?"
        elif kind == 3:
            s = f'"{subj.capitalize()} {verb} {obj}," said {rng.choice(_SUBJECTS)}; it cost ${rng.randint(1, 500)}.{rng.randint(0, 99):02d} at {rng.randint(1, 12)}:{rng.randint(0, 59):02d}.'
        elif kind == 4:
            s = f"{subj} {verb} {rng.choice(_EXOTIC)} {rng.choice(_PLACES)} ({rng.choice(_EXOTIC)}) - {rng.randint(10, 99)}% {rng.choice(_ADJECTIVES)}."
        else:
            s = f"{subj}: {rng.choice(_ADJECTIVES)}, {rng.choice(_ADJECTIVES)} and {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}s\n\t{rng.choice(_ADVERBS)} {verb} {obj} {rng.choice(_PLACES)}..."
        out.append(s[0].upper() + s[1:])
    return out


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int, seed: int) -> str:
    tok = tokenizers.Tokenizer(models.BPE())
    # As in SmolLM2: digits split one by one, then GPT-2 byte-level pre-tokenization.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(make_corpus(seed), trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok.to_str()


def train_tokenizer(vocab_size: int = 512, seed: int = 0) -> tokenizers.Tokenizer:
    """Train (offline, deterministically) a GPT-2/SmolLM2-style byte-level BPE on ``make_corpus(seed)``.

    The special tokens <|endoftext|>, <|im_start|>, <|im_end|> get ids 0, 1, 2. No BOS is prepended.
    Every byte is in the vocabulary, so any text (CJK, emoji...) encodes. Returns a fresh object each call.
    """
    return tokenizers.Tokenizer.from_str(_trained_tokenizer_json(vocab_size, seed))


# --------------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------------

ARCHS = ("llama", "llama3", "qwen2", "mistral", "qwen3", "phi3", "phi3_long", "qwen3_moe", "mixtral", "gemma2", "gemma3")

_COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "initializer_range": 0.15,
    "attention_dropout": 0.0,
    "use_cache": True,
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": IM_END_ID,
    "pad_token_id": ENDOFTEXT_ID,
}

_ARCH_CONFIGS: dict[str, dict] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "rope_scaling": None,
        "tie_word_embeddings": False,
    },
    "llama3": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "rope_theta": 500000.0,
        # A small original length, so that the llama3 frequency remapping matters at these tiny sizes.
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "tie_word_embeddings": False,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "rope_scaling": None,
        "sliding_window": None,
        "use_sliding_window": False,
        "max_window_layers": 3,
        "tie_word_embeddings": True,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "rope_scaling": None,
        "sliding_window": None,
        "use_sliding_window": False,
        "max_window_layers": 3,
        "tie_word_embeddings": False,
    },
    # Phi-3: fused qkv_proj and gate_up_proj in the checkpoint. LongRoPE with a tiny original length, so a test
    # context passes it; factors differ per pair and between the sets, so using the wrong set fails parity.
    "phi3": {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "rope_scaling": None,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    "phi3_long": {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "original_max_position_embeddings": 48,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(8)],
            "long_factor": [1.5 + 0.4 * i for i in range(8)],
        },
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    # Mixtures of experts, written by transformers' own save_pretrained (per-expert tensors, as on the Hub).
    # Eight experts, two per token: a short prompt already routes to most of them. Layer 1 of qwen3_moe is dense.
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "rope_scaling": None,
        "sliding_window": None,
        "use_sliding_window": False,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "tie_word_embeddings": False,
    },
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 48,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    # Gemma: a 12-token window (three 4-token KV blocks in the tests) so prompts cross it; caps small enough
    # to bite at these logit sizes; query_pre_attn_scalar unlike head_dim (Gemma 2 27B), so a runtime that
    # scales by head_dim fails parity.
    "gemma2": {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 24,
        "sliding_window": 12,
        "attn_logit_softcapping": 4.0,
        "final_logit_softcapping": 6.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
    },
    "gemma3": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 16,
        "sliding_window": 12,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "tie_word_embeddings": True,
    },
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        # MQA, and head_dim * heads != hidden_size (as in Mistral-Nemo): q_proj is 64 -> 128.
        "num_key_value_heads": 1,
        "head_dim": 32,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
}

# What generation_config.json says per arch; Qwen2.5-Instruct lists two EOS ids, the others one.
_GEN_EOS = {"qwen2": [IM_END_ID, ENDOFTEXT_ID]}


def arch_config(arch: str, vocab_size: int, **overrides) -> dict:
    """The config.json dict (Hub-style: ``rope_theta`` + ``rope_scaling``) for one of ARCHS."""
    if arch not in _ARCH_CONFIGS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    cfg = {**_COMMON, **_ARCH_CONFIGS[arch], "vocab_size": vocab_size}
    cfg.update(overrides)
    if arch == "qwen2" and "max_window_layers" not in overrides:
        cfg["max_window_layers"] = cfg["num_hidden_layers"]
    return cfg


def random_tensors(cfg: dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Deterministic random weights for every parameter transformers' model for ``cfg`` (a config.json dict) has."""
    std = float(cfg.get("initializer_range", 0.02))
    return {name: _init_tensor(cfg["model_type"], name, shape, seed, std).to(dtype).contiguous()
            for name, shape in _param_names_and_shapes(cfg)}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _param_names_and_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The persistent parameters transformers' model for ``cfg`` has, in its state_dict order.

    Read off a meta-device instance, so the names and shapes are transformers' own.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("architectures",)})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    names = [(n, tuple(t.shape)) for n, t in model.state_dict().items()]
    if cfg.get("tie_word_embeddings"):
        names = [(n, s) for n, s in names if n != "lm_head.weight"]
    return names


def _init_tensor(family: str, name: str, shape: tuple[int, ...], seed: int, std: float) -> torch.Tensor:
    """Deterministic per (seed, model_type, name): other tensors, the layer count or the shard count
    leave it alone, so "llama" and "llama3" share weights and differ only in RoPE."""
    gen = torch.Generator().manual_seed(
        (seed * 1_000_003 + zlib.crc32(f"{family}/{name}".encode())) % (2**63)
    )
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * noise  # non-trivial RMSNorm gains, so a runtime that ignores them fails parity
    if name.endswith(".bias"):
        return std * noise  # transformers zeroes biases by default; make Qwen2's q/k/v biases matter
    return std * noise


def _split_shards(names: list[str], sizes: dict[str, int], num_shards: int) -> list[list[str]]:
    """Cut ``names`` (in order) into ``num_shards`` non-empty contiguous groups of roughly equal bytes."""
    if num_shards > len(names):
        raise ValueError(f"num_shards={num_shards} > {len(names)} tensors")
    total = sum(sizes.values())
    groups: list[list[str]] = [[]]
    acc = 0
    for i, n in enumerate(names):
        to_open = num_shards - len(groups)
        full = acc * num_shards >= total * len(groups)
        if groups[-1] and to_open > 0 and (full or len(names) - i <= to_open):
            groups.append([])
        groups[-1].append(n)
        acc += sizes[n]
    assert len(groups) == num_shards and all(groups), [len(g) for g in groups]
    return groups


def build_checkpoint(
    out_dir: Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    num_shards: int = 1,
    vocab_size: int = 512,
    rope_format: str = "hub",
    **overrides,
) -> Path:
    """Write a complete Hugging Face checkpoint folder for a tiny random ``arch`` model; return ``out_dir``.

    ``overrides`` update config.json (e.g. ``num_hidden_layers=2``). ``num_shards > 1`` writes
    ``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json``, else ``model.safetensors``.
    ``rope_format="hub"`` writes ``rope_theta``/``rope_scaling`` like real Hub checkpoints;
    ``"transformers5"`` writes the ``rope_parameters`` dict transformers 5's ``save_pretrained`` writes.
    The same arguments give byte-identical files.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab_size=vocab_size, seed=0)
    cfg = arch_config(arch, tok.get_vocab_size(), **overrides)
    cfg["torch_dtype"] = _dtype_name(dtype)

    tensors = random_tensors(cfg, seed, dtype)

    # Weights.
    for old in [*out_dir.glob("model*.safetensors"), out_dir / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    meta = {"format": "pt"}
    if arch in _SAVED_BY_TRANSFORMERS:
        if num_shards > 1:
            raise ValueError(f"{arch} checkpoints are written by save_pretrained in one file")
        _save_with_transformers(cfg, tensors, out_dir)
    elif num_shards <= 1:
        save_file(tensors, str(out_dir / "model.safetensors"), metadata=meta)
    else:
        sizes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
        weight_map: dict[str, str] = {}
        groups = _split_shards(list(tensors), sizes, num_shards)
        for i, group in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
            save_file({n: tensors[n] for n in group}, str(out_dir / fname), metadata=meta)
            weight_map.update(dict.fromkeys(group, fname))
        index = {
            "metadata": {"total_size": sum(sizes.values())},
            "weight_map": dict(sorted(weight_map.items())),
        }
        _write_json(out_dir / "model.safetensors.index.json", index)

    # config.json
    if rope_format == "transformers5":
        rope = dict(cfg.pop("rope_scaling", None) or {"rope_type": "default"})
        rope["rope_theta"] = cfg.pop("rope_theta")
        cfg["rope_parameters"] = rope
        cfg["dtype"] = cfg.pop("torch_dtype")
    elif rope_format != "hub":
        raise ValueError(f"rope_format must be 'hub' or 'transformers5', not {rope_format!r}")
    _write_json(out_dir / "config.json", dict(sorted(cfg.items())))

    # generation_config.json: only token ids, so nothing changes how greedy decoding behaves.
    gen_eos = (
        _GEN_EOS.get(arch, cfg["eos_token_id"]) if "eos_token_id" not in overrides else cfg["eos_token_id"]
    )
    _write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": gen_eos, "pad_token_id": cfg["pad_token_id"]},
    )

    # Tokenizer.
    (out_dir / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [
            t for t in SPECIAL_TOKENS if t not in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
        ],
        "bos_token": BOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "model_max_length": cfg["max_position_embeddings"],
        "pad_token": PAD_TOKEN,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(
        out_dir / "special_tokens_map.json",
        {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN},
    )
    return out_dir


# transformers 5 keeps experts stacked in memory and splits them per expert on save: its own save_pretrained
# writes the layout real checkpoints have.
_SAVED_BY_TRANSFORMERS = ("qwen3_moe", "mixtral")


def _save_with_transformers(cfg: dict, tensors: dict[str, torch.Tensor], out_dir: Path) -> None:
    import tempfile

    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")})
    model = AutoModelForCausalLM.from_config(hf_cfg)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight" or not cfg.get("tie_word_embeddings")]:
        raise AssertionError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        (Path(tmp) / "model.safetensors").replace(out_dir / "model.safetensors")


def wrap_in_gemma3_multimodal(text_dir: Path, out_dir: Path) -> Path:
    """A Gemma3ForConditionalGeneration checkpoint (tiny random vision tower and projector) whose text model has
    the weights of the Gemma 3 text checkpoint ``text_dir``, written by transformers' save_pretrained; the
    tokenizer and generation files are copied."""
    import shutil

    from safetensors.torch import load_file
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text_cfg = json.loads((text_dir / "config.json").read_text())
    text_cfg = {k: v for k, v in text_cfg.items() if k not in ("architectures", "torch_dtype", "model_type")}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}  # fmt: skip
    config = Gemma3Config(text_config=text_cfg, vision_config=vision, mm_tokens_per_image=4)
    model = Gemma3ForConditionalGeneration(config)
    text = load_file(str(text_dir / "model.safetensors"))
    state = {f"model.language_model.{k.removeprefix('model.')}": v for k, v in text.items() if k != "lm_head.weight"}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if "language_model" in m]:
        raise AssertionError(f"text weights did not fit: missing {missing}, unexpected {unexpected}")
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(text_dir / name, out_dir / name)
    return out_dir


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------------------
# transformers reference
# --------------------------------------------------------------------------------------------------------

_MODEL_CACHE: dict[tuple, object] = {}


def _files_stamp(model_dir: Path) -> tuple:
    return tuple(sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in model_dir.iterdir()))


def load_hf_model(model_dir: Path, dtype: torch.dtype = torch.float32):
    """transformers' model for ``model_dir`` in eval mode, cached per (folder, dtype, files' mtimes)."""
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir).resolve()
    key = (str(model_dir), dtype, _files_stamp(model_dir))
    model = _MODEL_CACHE.get(key)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
        model.eval()
        # No stopping on EOS: generate() fills unset (None) values from the model's generation_config,
        # so the EOS has to go from there, not just from the config passed to generate().
        model.generation_config.eos_token_id = None
        _MODEL_CACHE[key] = model
    return model


@torch.inference_mode()
def hf_greedy(
    model_dir: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers greedy decoding of each prompt alone (no padding), never stopping on EOS.

    Returns, per prompt, exactly ``max_new_tokens`` new token ids and the raw float32 logits
    ``[max_new_tokens, vocab]`` they were the argmax of.
    """
    from transformers import GenerationConfig

    model = load_hf_model(model_dir, dtype)
    gen_cfg = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=ENDOFTEXT_ID,
        output_logits=True,
        return_dict_in_generate=True,
        use_cache=True,
    )
    all_tokens: list[list[int]] = []
    all_logits: list[torch.Tensor] = []
    for prompt in prompts:
        if not prompt:
            raise ValueError("empty prompt")
        input_ids = torch.tensor([prompt], dtype=torch.long)
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=gen_cfg,
        )
        new = out.sequences[0, len(prompt) :].tolist()
        logits = torch.stack([step[0] for step in out.logits]).float()
        if len(new) != max_new_tokens or logits.shape[0] != max_new_tokens:
            raise AssertionError(f"generate() returned {len(new)} tokens, expected {max_new_tokens}")
        if logits.argmax(-1).tolist() != new:
            raise AssertionError("generate() tokens are not the argmax of its raw logits")
        all_tokens.append(new)
        all_logits.append(logits)
    return all_tokens, all_logits
