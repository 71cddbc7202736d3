"""Read a llama.cpp GGUF file as a :class:`Checkpoint` in Hugging Face terms.

A GGUF holds everything a model needs in one file: hyper-parameters and the tokenizer as metadata
under llama.cpp's key names, and the weights, often block-quantized, under llama.cpp's tensor
names. This module maps all three back to what a Hugging Face checkpoint would say, so the rest of
the runtime never needs to know which format a model came in:

* metadata -> a ``config.json``-style dict (``LlamaForCausalLM``, ``Qwen2ForCausalLM``...);
* tensors  -> ``(HF name, tensor)`` pairs, dequantized one at a time to the requested dtype, with
  llama.cpp's rotary row permutation of ``q_proj``/``k_proj`` undone;
* tokenizer metadata -> a ``tokenizers.Tokenizer`` plus a ``tokenizer_config.json``-style dict.

``packed_tensors()`` yields the same names with the decoder linears kept in their blocks
(``runtime/quantization/gguf.BlockForm``, q/k rows unpermuted) when every one of them is Q8_0, Q4_0, Q4_1, Q4_K, Q5_K
or Q6_K, a mixture of experts' stacked experts included (each expert's slice of the blocks becomes its own
BlockForm, as ``tensors()`` splits them), and the token embedding too when it is of one of those types
(``Checkpoint.packed_embedding``); the loader (runtime/quantization/loading.py) keeps them packed. Routers
(``ffn_gate_inp``) are served in the model dtype: one stored in a quantized type (Q8_0...) is dequantized by gguf's
own block math like any other tensor read whole, and a log line says how many were.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from kubellm.runtime.quantization import gguf as gguf_quant

from .checkpoint import Checkpoint, CheckpointError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Arch:
    hf_architecture: str
    model_type: str
    # llama.cpp's converter reorders q/k rows of llama-family models for its rotary kernel.
    rope_permuted: bool
    qkv_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over each head of q and k (Qwen3)
    # Per-layer GGUF tensor names whose meaning differs from the Llama layout (see _LAYER_TENSORS).
    layer_tensors: tuple[tuple[str, str], ...] = ()
    norm_offset: float = 0.0  # llama.cpp stores Gemma's (1 + w) norms as 1 + w: subtract it back
    # Stacked experts (blk.N.ffn_{gate,up,down}_exps) become <expert_block>.experts.E.<part>.weight.
    expert_block: str = "mlp"
    expert_parts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


_GEMMA = (("post_attention_norm", "post_attention_layernorm"), ("ffn_norm", "pre_feedforward_layernorm"),
          ("post_ffw_norm", "post_feedforward_layernorm"))
_EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")

# GGUF ``general.architecture`` -> what transformers calls it.
_ARCHS = {
    "llama": _Arch("LlamaForCausalLM", "llama", rope_permuted=True),
    "mistral": _Arch("MistralForCausalLM", "mistral", rope_permuted=True),
    "qwen2": _Arch("Qwen2ForCausalLM", "qwen2", rope_permuted=False, qkv_bias=True),
    # llama.cpp writes Mixtral as "llama" with stacked experts; its router is ffn_gate_inp.
    "mixtral": _Arch("MixtralForCausalLM", "mixtral", rope_permuted=True,
                     layer_tensors=(("ffn_gate_inp", "block_sparse_moe.gate"),), expert_block="block_sparse_moe",
                     expert_parts=("w1", "w3", "w2")),
    "qwen3": _Arch("Qwen3ForCausalLM", "qwen3", rope_permuted=False, qk_norm=True),
    # Mixture of experts: experts stacked per layer (blk.N.ffn_{gate,up,down}_exps), split per expert on read.
    "qwen3moe": _Arch("Qwen3MoeForCausalLM", "qwen3_moe", rope_permuted=False, qk_norm=True,
                      layer_tensors=(("ffn_gate_inp", "mlp.gate"),)),
    # Phi-3: q/k/v and gate/up fused, as in the Hugging Face checkpoint; LongRoPE factors as tensors.
    "phi3": _Arch("Phi3ForCausalLM", "phi3", rope_permuted=False,
                  layer_tensors=(("attn_qkv", "self_attn.qkv_proj"), ("ffn_up", "mlp.gate_up_proj"))),
    # Gemma: four norms per layer (ffn_norm is the one before the MLP), stored as 1 + w.
    "gemma2": _Arch("Gemma2ForCausalLM", "gemma2", rope_permuted=False, norm_offset=1.0, layer_tensors=_GEMMA),
    "gemma3": _Arch("Gemma3ForCausalLM", "gemma3_text", rope_permuted=False, qk_norm=True, norm_offset=1.0,
                    layer_tensors=_GEMMA),
}
SUPPORTED_ARCHITECTURES = tuple(_ARCHS)

# GGUF tensor names -> HF parameter names. Per-layer names are ``blk.{i}.<key>.{weight,bias}``.
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors llama.cpp adds that have no HF parameter; their content is folded into the config.
_NON_PARAMETER_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}

_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
# Quant types whose dequantization the tests cover; others gguf.quants can decode are tried too.
TESTED_QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

# llama.cpp token types (llama_token_type).
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4


def read_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """Open a GGUF file and describe it as a Hugging Face checkpoint.

    Only the header is parsed here (about a second for SmolLM2's 49k-token vocabulary); the
    weights stay memory-mapped and each call of ``tensors()`` dequantizes them one at a time to
    ``dtype``, in torch layout ``[out_features, in_features]`` (norms and biases are 1-D).

    Raises :class:`CheckpointError` if the file is not a readable GGUF, its architecture is not
    one of :data:`SUPPORTED_ARCHITECTURES`, or its tensors do not match its own metadata.
    """
    path = Path(path)
    reader = _open(path)
    meta = _Metadata(reader, path)
    arch = _architecture(meta)
    gguf_tensors = {t.name: t for t in reader.tensors}
    config = _config(meta, arch, gguf_tensors, dtype)
    _check_tensors(config, arch, gguf_tensors, path)
    tokenizer, tokenizer_config = _tokenizer(meta, config)

    def tensors(packed: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        # The closure keeps ``reader`` (and its memory map) alive as long as the Checkpoint is.
        routers: dict[str, int] = {}  # quantized routers by type, dequantized below
        for tensor in reader.tensors:
            if tensor.name.endswith(".ffn_gate_inp.weight") and tensor.tensor_type.name not in _FLOAT_TYPES:
                routers[tensor.tensor_type.name] = routers.get(tensor.tensor_type.name, 0) + 1
            if tensor.name in _NON_PARAMETER_TENSORS:
                continue
            if (m := _LAYER_NAME.fullmatch(tensor.name)) and m[2] in _EXPERT_TENSORS:  # [experts, out, in]
                part = arch.expert_parts[_EXPERT_TENSORS.index(m[2])]
                experts = (_expert_blocks(tensor) if packed and _packable_type(tensor)
                           else _decode(tensor, arch, config, dtype, path))
                for e, expert in enumerate(experts):
                    yield f"model.layers.{m[1]}.{arch.expert_block}.experts.{e}.{part}.weight", expert
            elif packed and (form := _blocks(tensor, arch, config)) is not None:
                yield _hf_name(tensor.name, arch), form
            else:
                yield _hf_name(tensor.name, arch), _decode(tensor, arch, config, dtype, path)
        if routers:
            logger.info("%s: %s mixture-of-experts routers stored quantized were dequantized at load (served in the "
                        "model dtype)", path.name, ", ".join(f"{n} {t}" for t, n in sorted(routers.items())))

    packable = _all_linears_packable(reader)
    return Checkpoint(
        config=config,
        tensors=tensors,
        tokenizer=tokenizer,
        tokenizer_config=tokenizer_config,
        generation_config=_generation_config(meta),
        source=str(path),
        packed_tensors=(lambda: tensors(packed=True)) if packable else None,
        packed_embedding=packable and _packable_type(gguf_tensors["token_embd.weight"]),
    )


# Decoder linears kept packed (GGUF names); stacked experts too, cut into one BlockForm per expert.
_PACKED_LINEARS = {"attn_q", "attn_k", "attn_v", "attn_output", "attn_qkv", "ffn_gate", "ffn_up", "ffn_down"}
_EMBEDDING = "token_embd.weight"  # kept packed too, where its type has a packed form


def _packable_type(tensor) -> bool:
    return tensor.tensor_type.name in gguf_quant.BLOCKS


def _all_linears_packable(reader) -> bool:
    """Whether every decoder linear, experts included, is in a type runtime/quantization/gguf.py reads (a file with
    some in F16 or an unread type is dequantized whole)."""
    linears = _PACKED_LINEARS.union(_EXPERT_TENSORS)
    types = [t.tensor_type.name for t in reader.tensors
             if (m := _LAYER_NAME.fullmatch(t.name)) and m[2] in linears and m[3] == "weight"]
    return bool(types) and all(t in gguf_quant.BLOCKS for t in types)


def _expert_blocks(tensor) -> Iterator:
    """A stacked expert tensor (``[experts, out, row bytes]`` as the reader maps it) as one BlockForm per expert,
    cut along the expert axis in its blocks (no dequantization), read one expert at a time."""
    in_features = int(tensor.shape[0])
    for raw in tensor.data:
        yield gguf_quant.unpack(tensor.tensor_type.name, torch.from_numpy(np.array(raw)), in_features)


def _blocks(tensor, arch: _Arch, config: dict):
    """A decoder linear or the token embedding in a type runtime/quantization/gguf.py reads, as its BlockForm (q/k rows
    back in HF order); None for anything else (dequantized as usual)."""
    m = _LAYER_NAME.fullmatch(tensor.name)
    linear = m is not None and m[2] in _PACKED_LINEARS and m[3] == "weight"
    if not (linear or tensor.name == _EMBEDDING) or not _packable_type(tensor):
        return None
    in_features = int(tensor.shape[0])
    form = gguf_quant.unpack(tensor.tensor_type.name, torch.from_numpy(np.array(tensor.data)), in_features)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}.get(m[2] if m else "")
    if arch.rope_permuted and heads:
        form = gguf_quant.BlockForm(*(None if t is None else _unpermute_rope_rows(t, heads)
                                       for t in (form.values, form.scales, form.zeros)), form.group_size, form.kernel)
    return form


# --------------------------------------------------------------------------------------- metadata


class _Reader(GGUFReader):
    """``GGUFReader`` slicing a plain ndarray view of its memory map instead of the ``np.memmap``.

    The reader cuts one small array per vocabulary string; ``np.memmap`` slices pay for a subclass
    hook each, which made opening SmolLM2 (49k tokens, 49k merges) take ~2.5 s instead of ~0.6 s.
    """

    @property
    def data(self) -> np.ndarray:
        return self._array

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._array = np.asarray(value)  # a view: the memory map stays open as its base


def _open(path: Path) -> GGUFReader:
    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    try:
        return _Reader(path)
    except Exception as exc:  # the reader signals bad input with ValueError, IndexError, KeyError...
        raise CheckpointError(
            f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}); "
            "it may be truncated or not GGUF at all - download it again"
        ) from exc


class _Metadata:
    """Typed access to GGUF key/values; ``{arch}`` in a key stands for the file's architecture."""

    def __init__(self, reader: GGUFReader, path: Path):
        self.fields = reader.fields
        self.path = path
        self.arch = ""  # read next; keys without "{arch}" do not need it
        self.arch = self.get("general.architecture")
        if not isinstance(self.arch, str):
            raise CheckpointError(f"{path} has no general.architecture metadata; is it a model GGUF?")

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key.replace("{arch}", self.arch))
        if field is None:
            return default
        value = field.contents()
        if field.types == [GGUFValueType.FLOAT32]:
            # Shortest decimal that round-trips the float32: 1e-05, not 9.999999747378752e-06.
            value = float(str(np.float32(value)))
        return value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"{self.path} lacks required metadata {key.replace('{arch}', self.arch)!r}")
        return value


def _architecture(meta: _Metadata) -> _Arch:
    if meta.arch not in _ARCHS:
        raise CheckpointError(
            f"{meta.path}: GGUF architecture {meta.arch!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    arch = _ARCHS[meta.arch]
    # llama.cpp writes Mistral models as "llama"; only the model name tells them apart.
    names = f"{meta.get('general.name', '')} {meta.get('general.basename', '')}".lower()
    if meta.arch == "llama" and meta.get("llama.expert_count"):
        arch = _ARCHS["mixtral"]
    elif meta.arch == "llama" and "mistral" in names:
        arch = _ARCHS["mistral"]
    return arch


def _config(meta: _Metadata, arch: _Arch, gguf_tensors: dict, dtype: torch.dtype) -> dict:
    """The ``config.json`` transformers would write for this model."""
    hidden = meta.require("{arch}.embedding_length")
    heads = meta.require("{arch}.attention.head_count")
    head_dim = meta.get("{arch}.attention.key_length")
    if head_dim is None and arch.rope_permuted:
        head_dim = meta.get("{arch}.rope.dimension_count")  # llama rotates the whole head
    embed = gguf_tensors.get("token_embd.weight")
    if embed is None:
        raise CheckpointError(f"{meta.path} has no token_embd.weight tensor")
    has_qkv_bias = "blk.0.attn_q.bias" in gguf_tensors
    config = {
        "architectures": [arch.hf_architecture],
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "intermediate_size": meta.get("{arch}.feed_forward_length") or meta.require("{arch}.expert_feed_forward_length"),
        "num_hidden_layers": meta.require("{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get("{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim or hidden // heads,
        "hidden_act": "silu",
        "rms_norm_eps": meta.get("{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta.get("{arch}.rope.freq_base", 10000.0),
        "rope_scaling": None,
        "max_position_embeddings": meta.get("{arch}.context_length", 2048),
        # The embedding's row count is the truth; metadata vocab_size is optional and sometimes stale.
        "vocab_size": int(embed.shape[-1]),
        "tie_word_embeddings": "output.weight" not in gguf_tensors,
        "attention_bias": arch.qkv_bias or has_qkv_bias,
        "mlp_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        config["pad_token_id"] = meta.get("tokenizer.ggml.padding_token_id")
    if arch.model_type in ("qwen2", "qwen3", "qwen3_moe"):
        config["use_sliding_window"] = False
    config["rope_scaling"] = _rope_scaling(meta, config, gguf_tensors.get("rope_freqs.weight"))
    config |= _family_config(meta, arch, config, gguf_tensors)
    return config


def _family_config(meta: _Metadata, arch: _Arch, config: dict, gguf_tensors: dict) -> dict:
    """What a family adds to config.json, from its own metadata keys (as llama.cpp's converter writes them)."""
    kind = arch.model_type
    if kind == "mixtral":
        return {"num_local_experts": meta.require("{arch}.expert_count"),
                "num_experts_per_tok": meta.require("{arch}.expert_used_count"), "router_jitter_noise": 0.0}
    if kind == "qwen3_moe":
        return {"num_experts": meta.require("{arch}.expert_count"),
                "num_experts_per_tok": meta.require("{arch}.expert_used_count"),
                "moe_intermediate_size": meta.require("{arch}.expert_feed_forward_length"),
                "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}  # fmt: skip
    if kind == "phi3":
        out = {"sliding_window": meta.get("{arch}.attention.sliding_window")}
        long, short = gguf_tensors.get("rope_factors_long.weight"), gguf_tensors.get("rope_factors_short.weight")
        if long is not None and short is not None:
            original = meta.require("{arch}.rope.scaling.original_context_length")
            out["original_max_position_embeddings"] = original
            out["rope_scaling"] = {
                "rope_type": "longrope",
                "long_factor": np.asarray(dequantize(long.data, long.tensor_type), dtype=np.float64).ravel().tolist(),
                "short_factor": np.asarray(dequantize(short.data, short.tensor_type), dtype=np.float64).ravel().tolist(),
                "original_max_position_embeddings": original,
            }
            if (factor := meta.get("{arch}.rope.scaling.attn_factor")) is not None:
                out["rope_scaling"]["attention_factor"] = factor
        return out
    if kind in ("gemma2", "gemma3_text"):
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        # llama.cpp scales queries by 1/sqrt(hidden / heads) for the 27B models (query_pre_attn_scalar 144 and
        # 168 there) and by 1/sqrt(head_dim) otherwise; the file carries no scalar, so the same rule applies.
        big = config["num_hidden_layers"] in (46, 62)
        out = {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
               "query_pre_attn_scalar": hidden // heads if big else config["head_dim"],
               "sliding_window": meta.require("{arch}.attention.sliding_window")}  # fmt: skip
        if kind == "gemma2":
            out["attn_logit_softcapping"] = meta.get("{arch}.attn_logit_softcapping")
            out["final_logit_softcapping"] = meta.get("{arch}.final_logit_softcapping")
        else:
            pattern = meta.get("{arch}.attention.sliding_window_pattern")
            if isinstance(pattern, list):  # newer files: one flag per layer, true = sliding
                out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
            else:
                out["sliding_window_pattern"] = pattern or 6
            out["rope_local_base_freq"] = 10000.0  # llama.cpp's fixed base for Gemma 3's local layers
        return out
    return {}


def _rope_scaling(meta: _Metadata, config: dict, rope_freqs) -> dict | None:
    """HF ``rope_scaling`` from metadata (linear, yarn) or from llama.cpp's ``rope_freqs`` (llama3)."""
    kind = meta.get("{arch}.rope.scaling.type")
    factor = meta.get("{arch}.rope.scaling.factor")
    if kind in ("linear", "yarn") and factor:
        scaling = {"rope_type": kind, "factor": factor}
        original = meta.get("{arch}.rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = original
        return scaling
    if rope_freqs is not None:
        factors = np.asarray(dequantize(rope_freqs.data, rope_freqs.tensor_type), dtype=np.float64).ravel()
        return _llama3_rope_scaling(factors, config["rope_theta"], config["head_dim"], meta.path)
    if kind not in (None, "none"):
        raise CheckpointError(
            f"{meta.path}: rope scaling type {kind!r} is not supported (linear, yarn, llama3)"
        )
    return None


def _llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int, path: Path) -> dict | None:
    """Recover Llama 3 ``rope_scaling`` from the per-frequency divisors llama.cpp stores.

    llama.cpp keeps only the divisors ``r_i`` (``[head_dim / 2]``): 1 for short wavelengths,
    ``factor`` for long ones, and in between ``1 / r = (1 - s) / factor + s`` where the smoothing
    ``s = (orig_ctx / wavelen - low) / (high - low)`` is linear in ``1 / wavelen``. A line has two
    parameters, so (orig_ctx, low, high) are only known up to that line; we pin ``low = 1`` and solve
    for the others, which gives transformers exactly the same inverse frequencies.
    """
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if factors.shape != inv_freq.shape:
        raise CheckpointError(
            f"{path}: rope_freqs has {factors.size} entries, expected head_dim/2 = {inv_freq.size}"
        )
    factor = float(factors.max())
    if factor <= 1 + 1e-6:
        return None  # all ones: the file scales nothing
    x = inv_freq / (2 * math.pi)  # 1 / wavelength
    medium = (factors > 1 + 1e-4) & (factors < factor * (1 - 1e-4))
    # Llama 3.x defaults, used when too few frequencies fall in the smoothed band to fit a line.
    scaling = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if medium.sum() >= 2:
        smooth = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(x[medium], smooth, 1)
        high = 1 - 1 / intercept
        scaling = {
            "low_freq_factor": 1.0,
            "high_freq_factor": round(float(high), 4),
            "original_max_position_embeddings": round(float(-slope / intercept)),
        }
    scaling = {"rope_type": "llama3", "factor": round(factor, 4), **scaling}
    if not np.allclose(_llama3_divisors(inv_freq, scaling), factors, rtol=1e-3):
        raise CheckpointError(
            f"{path}: rope_freqs does not follow the Llama 3 rope scaling formula; unsupported"
        )
    return scaling


def _llama3_divisors(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
    """Per-frequency divisors for Llama 3 scaling (the inverse of the fit above)."""
    orig, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = np.clip((orig / wavelen - low) / (high - low), 0.0, 1.0)
    return 1 / ((1 - smooth) / factor + smooth)


def _generation_config(meta: _Metadata) -> dict:
    eos = meta.get("tokenizer.ggml.eos_token_id")
    # Chat models often end a turn with a token other than EOS (Llama 3's <|eot_id|>).
    extra = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    stops = [t for t in [eos, *extra] if t is not None]
    stops = list(dict.fromkeys(stops))
    config = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id")}
    if stops:
        config["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        config["pad_token_id"] = meta.get("tokenizer.ggml.padding_token_id")
    return {k: v for k, v in config.items() if v is not None}


# ---------------------------------------------------------------------------------------- tensors


def _hf_name(gguf_name: str, arch: _Arch) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; KeyError if unknown. Stacked
    experts keep a placeholder name (``mlp.experts.ffn_gate_exps``), split per expert by the reader."""
    if m := _LAYER_NAME.fullmatch(gguf_name):
        layer, key, suffix = m.groups()
        if key in _EXPERT_TENSORS:
            return f"model.layers.{layer}.{arch.expert_block}.experts.{key}.{suffix}"
        module = dict(arch.layer_tensors).get(key) or _LAYER_TENSORS[key]
        return f"model.layers.{layer}.{module}.{suffix}"
    base, _, suffix = gguf_name.rpartition(".")
    return f"{_GLOBAL_TENSORS[base]}.{suffix}"


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every parameter name the reader yields for a model with this config (stacked experts under their
    placeholder names), with its torch shape."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kind, head = config["model_type"], config["head_dim"]
    q_rows = config["num_attention_heads"] * head
    kv_rows = config["num_key_value_heads"] * head
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.o_proj.weight": (hidden, q_rows),
        }
        if kind == "phi3":
            shapes |= {p + "self_attn.qkv_proj.weight": (q_rows + 2 * kv_rows, hidden),
                       p + "mlp.gate_up_proj.weight": (2 * inter, hidden)}
        else:
            shapes |= {p + "self_attn.q_proj.weight": (q_rows, hidden),
                       p + "self_attn.k_proj.weight": (kv_rows, hidden),
                       p + "self_attn.v_proj.weight": (kv_rows, hidden)}
        if kind in ("qwen3_moe", "mixtral"):
            block = "block_sparse_moe" if kind == "mixtral" else "mlp"
            experts = config.get("num_experts") or config["num_local_experts"]
            expert_inter = config.get("moe_intermediate_size") or inter
            shapes |= {f"{p}{block}.gate.weight": (experts, hidden),
                       f"{p}{block}.experts.ffn_gate_exps.weight": (experts, expert_inter, hidden),
                       f"{p}{block}.experts.ffn_up_exps.weight": (experts, expert_inter, hidden),
                       f"{p}{block}.experts.ffn_down_exps.weight": (experts, hidden, expert_inter)}
        elif kind != "phi3":
            shapes |= {p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden)}
        if kind not in ("qwen3_moe", "mixtral"):
            shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        if kind in ("qwen3", "qwen3_moe", "gemma3_text"):
            shapes |= {p + "self_attn.q_norm.weight": (head,), p + "self_attn.k_norm.weight": (head,)}
        if kind in ("gemma2", "gemma3_text"):
            shapes |= {p + "pre_feedforward_layernorm.weight": (hidden,),
                       p + "post_feedforward_layernorm.weight": (hidden,)}
        if config["attention_bias"]:
            shapes |= {
                p + "self_attn.q_proj.bias": (q_rows,),
                p + "self_attn.k_proj.bias": (kv_rows,),
                p + "self_attn.v_proj.bias": (kv_rows,),
            }
    return shapes


def _check_tensors(config: dict, arch: _Arch, gguf_tensors: dict, path: Path) -> None:
    """Fail at open time, not half-way through loading, if names or shapes do not fit the config."""
    expected = expected_shapes(config)
    found, unknown = {}, []
    for name, tensor in gguf_tensors.items():
        if name in _NON_PARAMETER_TENSORS:
            continue
        try:
            found[_hf_name(name, arch)] = tuple(int(d) for d in reversed(tensor.shape))
        except KeyError:
            unknown.append(name)
    problems = []
    if unknown:
        problems.append(f"tensors this loader does not know: {', '.join(sorted(unknown)[:8])}")
    if missing := sorted(set(expected) - set(found)):
        problems.append(f"missing tensors: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if wrong := [
        f"{n} is {found[n]}, expected {s}" for n, s in expected.items() if n in found and found[n] != s
    ]:
        problems.append("; ".join(wrong[:4]))
    if problems:
        raise CheckpointError(
            f"{path} does not match its own metadata ({config['model_type']}): " + "; ".join(problems)
        )


def _decode(tensor, arch: _Arch, config: dict, dtype: torch.dtype, path: Path) -> torch.Tensor:
    """Dequantize one GGUF tensor into a fresh torch tensor ``[out_features, in_features]`` of ``dtype``."""
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    try:
        if tensor.tensor_type == GGMLQuantizationType.BF16:
            # Exact and cheaper than gguf's float32 detour: reinterpret the bytes.
            out = torch.from_numpy(np.array(tensor.data).view(np.int16)).view(torch.bfloat16)
        else:
            array = dequantize(tensor.data, tensor.tensor_type)
            if not array.flags.writeable:  # F32 comes back as a view of the read-only memory map
                array = array.copy()
            out = torch.from_numpy(array)
        out = out.reshape(shape)
    except NotImplementedError as exc:
        raise CheckpointError(
            f"{path}: tensor {tensor.name} uses quantization {tensor.tensor_type.name}, which gguf "
            f"cannot dequantize; use a file quantized as one of {', '.join(TESTED_QUANT_TYPES)}"
        ) from exc
    except ValueError as exc:
        raise CheckpointError(f"{path}: tensor {tensor.name} is corrupt or truncated ({exc})") from exc
    if arch.rope_permuted and tensor.name.startswith("blk."):
        kind = tensor.name.split(".")[2]
        if kind == "attn_q":
            out = _unpermute_rope_rows(out, config["num_attention_heads"])
        elif kind == "attn_k":
            out = _unpermute_rope_rows(out, config["num_key_value_heads"])
    if arch.norm_offset and tensor.name.endswith("norm.weight"):
        out = out - arch.norm_offset
    return out.to(dtype).contiguous()


def _unpermute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row reordering (weight ``[n_heads * head_dim, ...]`` or bias).

    HF rotates the two halves of each head (``rotate_half``); llama.cpp's kernel rotates adjacent
    pairs, so its converter reorders each head's rows from ``[x0..x(d/2-1), y0..y(d/2-1)]`` to
    ``[x0, y0, x1, y1, ...]``. Reading that back as ``[d/2, 2]`` and transposing restores HF order.
    """
    rows, rest = weight.shape[0], weight.shape[1:]
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *rest).transpose(1, 2).reshape(rows, *rest)


# -------------------------------------------------------------------------------------- tokenizer

# Split patterns llama.cpp applies per ``tokenizer.ggml.pre``; each is the Hugging Face tokenizer's
# own pre-tokenization for that family.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRE = {"llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"}
_QWEN2_PRE = {"qwen2", "deepseek-r1-qwen"}
# GPT-2's regex after splitting every digit apart (SmolLM, StarCoder): Digits + ByteLevel in HF.
_DIGITS_PRE = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva-7b"}
_GPT2_PRE = {None, "default", "gpt-2", "gpt2"}


def _tokenizer(meta: _Metadata, config: dict) -> tuple[tokenizers.Tokenizer, dict]:
    """Build the tokenizer and its ``tokenizer_config.json`` dict from ``tokenizer.ggml.*``."""
    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise CheckpointError(f"{meta.path} has no tokenizer.ggml.tokens; cannot build a tokenizer")
    types = meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(f"{meta.path}: {len(tokens)} tokens but {len(types)} token types")
    if model == "gpt2":
        tokenizer = _byte_level_bpe(meta, tokens)
        add_bos_default = False
    elif model == "llama":
        tokenizer = _sentencepiece_bpe(meta, tokens, types)
        add_bos_default = True  # llama.cpp's default for sentencepiece vocabularies
    else:
        raise CheckpointError(
            f"{meta.path}: tokenizer model {model!r} is not supported; supported: 'gpt2' (byte-level BPE), "
            "'llama' (sentencepiece BPE)"
        )
    _add_special_tokens(tokenizer, tokens, types)

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    tokenizer_config = {
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "chat_template": meta.get("tokenizer.chat_template"),
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    tokenizer_config = {k: v for k, v in tokenizer_config.items() if v is not None}
    _set_post_processor(tokenizer, tokenizer_config)
    return tokenizer, tokenizer_config


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)  # a duplicate spelling keeps its first id, as llama.cpp does
    return vocab


def _byte_level_bpe(meta: _Metadata, tokens: list[str]) -> tokenizers.Tokenizer:
    """GPT-2 style BPE: tokens and merges are spelled in the byte-to-unicode alphabet."""
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise CheckpointError(f"{meta.path}: a 'gpt2' tokenizer needs tokenizer.ggml.merges, and it has none")
    pre = meta.get("tokenizer.ggml.pre")
    bpe = models.BPE(
        vocab=_vocab(tokens),
        merges=[tuple(m.split(" ", 1)) for m in merges],
        # Llama 3 looks a whole word up in the vocabulary before merging; llama.cpp does too.
        ignore_merges=pre in _LLAMA3_PRE,
    )
    tokenizer = tokenizers.Tokenizer(bpe)
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(pre, meta.path)
    if pre in _QWEN2_PRE:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _byte_level_pre_tokenizer(pre: str | None, path: Path) -> pre_tokenizers.PreTokenizer:
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    pattern = _LLAMA3_PATTERN if pre in _LLAMA3_PRE else _QWEN2_PATTERN if pre in _QWEN2_PRE else None
    if pattern is not None:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in _GPT2_PRE:
        logger.warning(
            "%s: unknown tokenizer.ggml.pre %r; splitting words like GPT-2, ids may differ", path, pre
        )
    return gpt2


def _sentencepiece_bpe(meta: _Metadata, tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    """Sentencepiece-style BPE (Llama 1/2, Mistral): ``▁`` for spaces, byte fallback for the rest."""
    vocab = _vocab(tokens)
    merges = meta.get("tokenizer.ggml.merges")
    if merges:
        merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if not scores:
            raise CheckpointError(f"{meta.path}: a 'llama' tokenizer needs tokenizer.ggml.scores or merges")
        merge_pairs = _merges_from_scores(tokens, scores, types)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tokenizer = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merge_pairs, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    add_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Sentencepiece stores no merges: it merges the adjacent pair whose result scores highest.

    BPE ranks merges instead, so rank every split ``(left, right)`` of every normal token by that
    token's score, best first (ties by id, like llama.cpp's left-most choice is by position).
    """
    normal = {t: i for i, t in enumerate(tokens) if types[i] == _TOKEN_NORMAL}
    ranked = []
    for token, index in normal.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[index], index, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(tokenizer: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens (``<|im_start|>``) become special added tokens, user-defined ones plain added
    tokens, so both are matched whole in text instead of being split into pieces. Their ids are the
    GGUF ids: the spellings are already in the vocabulary."""
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(tokens, types, strict=True)
        if k == _TOKEN_CONTROL
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(tokens, types, strict=True)
        if k == _TOKEN_USER_DEFINED
    ]
    if special:
        tokenizer.add_special_tokens(special)
    if user:
        tokenizer.add_tokens(user)


def _set_post_processor(tokenizer: tokenizers.Tokenizer, tokenizer_config: dict) -> None:
    """Like an HF ``tokenizer.json``: ``encode(text)`` adds BOS/EOS exactly when the config says so."""
    bos = tokenizer_config.get("bos_token") if tokenizer_config["add_bos_token"] else None
    eos = tokenizer_config.get("eos_token") if tokenizer_config["add_eos_token"] else None
    if bos is None and eos is None:
        return

    def template(seq: str, type_id: int) -> list[str]:
        return [f"{t}:{type_id}" for t in (bos, seq, eos) if t is not None]

    tokenizer.post_processor = processors.TemplateProcessing(
        single=template("$A", 0),
        pair=template("$A", 0) + template("$B", 1),
        special_tokens=[(t, tokenizer.token_to_id(t)) for t in (bos, eos) if t is not None],
    )
