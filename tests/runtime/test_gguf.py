"""read_gguf against tiny models written here with gguf.GGUFWriter, and against real SmolLM2 (slow)."""

from __future__ import annotations

import inspect
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kubellm.runtime.models.checkpoint import CheckpointError
from kubellm.runtime.models.gguf import read_gguf

transformers = pytest.importorskip("transformers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Numbers like 12345 and 3.14159 are split into single digits.",
    "Kubernetes operators reconcile the desired state of the cluster.",
    "héllo wörld, naïve café, ünïcode text with accents.",
] * 20
SAMPLES = [
    "What is the capital of France?",
    "The lazy fox paid 12345 dollars, or 3.14 each.",
    "<|im_start|>user\nhéllo wörld ✓<|im_end|>\n",
    "  leading spaces\n\nand\ttabs  ",
]

# HF module path -> llama.cpp tensor name, per layer (written out here, independently of the reader).
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}

# Every quant type the reader must handle, spread over one model's tensors.
MIXED_QUANTS = {
    "model.embed_tokens.weight": Q.Q8_0,
    "model.layers.0.self_attn.q_proj.weight": Q.F32,
    "model.layers.0.self_attn.k_proj.weight": Q.F32,
    "model.layers.0.self_attn.v_proj.weight": Q.Q4_0,
    "model.layers.0.self_attn.o_proj.weight": Q.Q4_1,
    "model.layers.0.mlp.gate_proj.weight": Q.Q8_0,
    "model.layers.0.mlp.up_proj.weight": Q.F16,
    "model.layers.0.mlp.down_proj.weight": Q.BF16,
    "model.layers.1.self_attn.q_proj.weight": Q.Q4_0,
    "model.layers.1.self_attn.k_proj.weight": Q.Q4_1,
    "model.layers.1.self_attn.v_proj.weight": Q.F16,
    "model.layers.1.self_attn.o_proj.weight": Q.Q8_0,
    "model.layers.1.mlp.gate_proj.weight": Q.Q4_1,
    "model.layers.1.mlp.up_proj.weight": Q.Q4_0,
    "model.layers.1.mlp.down_proj.weight": Q.Q8_0,
    "lm_head.weight": Q.F16,
}
# Worst-case error of each type relative to the largest |weight| of the tensor (half a step, rounded up).
QUANT_TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1 / 127, Q.Q4_0: 1 / 8, Q.Q4_1: 1 / 15}


# ------------------------------------------------------------------------------------ GGUF writing


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama q/k rows: interleave each head's halves."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_name(hf_name: str, arch: str = "llama", num_layers: int = 64) -> str:
    """The GGUF name of a transformers parameter: LAYER_NAMES for the Llama layout, gguf's own tensor map
    (what llama.cpp's converter uses) for the other families."""
    stem, _, suffix = hf_name.rpartition(".")
    if arch not in ("llama", "mistral", "qwen2", "qwen3") or stem.endswith("mlp.gate"):
        from gguf import MODEL_ARCH, get_tensor_name_map

        return f"{get_tensor_name_map(MODEL_ARCH[arch.upper()], num_layers).get_name(stem)}.{suffix}"
    fixed = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if stem in fixed:
        return f"{fixed[stem]}.{suffix}"
    _, _, layer, module = stem.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[module]}.{suffix}"


def _gguf_tensors(model, arch: str, norm_offset: float) -> tuple[dict, dict]:
    """(GGUF name -> array as llama.cpp writes it, reader name -> float32 HF weight) for ``model``: Gemma's
    norms stored as 1 + w, stacked experts (transformers keeps gate and up fused) split into gate/up/down."""
    config = model.config
    out, hf = {}, {}
    for name, t in model.state_dict().items():
        w = t.detach().float().numpy()
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            layer = name.split(".")[2]
            gate, up = np.split(w, 2, axis=1)
            out[f"blk.{layer}.ffn_gate_exps.weight"], out[f"blk.{layer}.ffn_up_exps.weight"] = gate, up
            for e in range(w.shape[0]):
                hf[f"model.layers.{layer}.mlp.experts.{e}.gate_proj.weight"] = gate[e]
                hf[f"model.layers.{layer}.mlp.experts.{e}.up_proj.weight"] = up[e]
            continue
        if name.endswith("mlp.experts.down_proj"):
            layer = name.split(".")[2]
            out[f"blk.{layer}.ffn_down_exps.weight"] = w
            for e in range(w.shape[0]):
                hf[f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight"] = w[e]
            continue
        stored = w + norm_offset if norm_offset and name.endswith("norm.weight") else w
        out[gguf_name(name, arch, config.num_hidden_layers)] = stored
        hf[name] = w
    return out, hf


def train_byte_level_tokenizer(vocab_size: int = 320) -> Tokenizer:
    """A SmolLM2-shaped tokenizer: digits split one by one, then GPT-2 byte-level BPE."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def byte_level_metadata(tokenizer: Tokenizer) -> dict:
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return {
        "model": "gpt2",
        "pre": "smollm",
        "tokens": tokens,
        "types": [3 if t in SPECIALS else 1 for t in tokens],
        "merges": [" ".join(m) if isinstance(m, list) else m for m in merges],
        "bos": 1,
        "eos": 2,
        "unk": 0,
        "add_bos": False,
    }


def tiny_config(vocab_size: int, **overrides) -> dict:
    config = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab_size,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    return config | overrides


def tiny_model(config: dict, cls_name: str = "LlamaForCausalLM", seed: int = 0):
    torch.manual_seed(seed)
    config_name = {"Gemma3ForCausalLM": "Gemma3TextConfig"}.get(cls_name, cls_name.replace("ForCausalLM", "Config"))
    config_cls = getattr(transformers, config_name)
    model = getattr(transformers, cls_name)(config_cls(**config)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # ones by default; random values catch a swapped norm
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0, 0.5)
    return model


def write_gguf(
    path: Path,
    model,
    tokenizer_meta: dict,
    *,
    arch: str = "llama",
    quants: dict | None = None,
    permute: bool = True,
    name: str = "tiny",
    skip: tuple[str, ...] = (),
    extra_tensors: dict | None = None,
    key_length: int | None = None,
    extra_kv: dict | None = None,
    norm_offset: float = 0.0,
) -> dict[str, np.ndarray]:
    """Write ``model`` like llama.cpp's converter would; return the float32 HF weights written."""
    config = model.config
    writer = GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope.get("rope_theta") or rope["full_attention"]["rope_theta"])
    writer.add_rope_dimension_count(key_length or config.hidden_size // config.num_attention_heads)
    if key_length:
        writer.add_key_length(key_length)
        writer.add_value_length(key_length)
    writer.add_vocab_size(config.vocab_size)
    meta = tokenizer_meta
    writer.add_tokenizer_model(meta["model"])
    if "pre" in meta:
        writer.add_tokenizer_pre(meta["pre"])
    writer.add_token_list(meta["tokens"])
    writer.add_token_types(meta["types"])
    if "merges" in meta:
        writer.add_token_merges(meta["merges"])
    if "scores" in meta:
        writer.add_token_scores(meta["scores"])
    writer.add_bos_token_id(meta["bos"])
    writer.add_eos_token_id(meta["eos"])
    writer.add_unk_token_id(meta["unk"])
    writer.add_add_bos_token(meta["add_bos"])
    writer.add_chat_template(CHAT_TEMPLATE)
    for key, value in (extra_kv or {}).items():  # family metadata: (key without the arch prefix, value)
        full = f"{arch}.{key}"
        if isinstance(value, bool):
            writer.add_bool(full, value)
        elif isinstance(value, int):
            writer.add_uint32(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        else:
            writer.add_string(full, value)

    stored, weights = _gguf_tensors(model, arch, norm_offset)
    for gname, weight in stored.items():
        if gname in skip:
            continue
        if permute and ".attn_q." in gname:
            weight = llama_cpp_permute(weight, config.num_attention_heads)
        elif permute and ".attn_k." in gname:
            weight = llama_cpp_permute(weight, config.num_key_value_heads)
        qtype = _quant_type(quants or {}, gname)
        if qtype == Q.F32:
            writer.add_tensor(gname, weight.astype(np.float32))
        elif qtype == Q.F16:
            writer.add_tensor(gname, weight.astype(np.float16))
        elif qtype in K_QUANTS:  # gguf cannot quantize to these: random blocks of the weight's shape instead
            writer.add_tensor(gname, random_blocks(weight.shape, qtype, seed=len(gname)), raw_dtype=qtype)
        else:
            writer.add_tensor(gname, quantize(weight, qtype), raw_dtype=qtype)
    for gname, array in (extra_tensors or {}).items():
        writer.add_tensor(gname, array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def _quant_type(quants: dict, gname: str):
    """The type ``quants`` gives a GGUF tensor, keyed by its GGUF name (stacked experts) or its HF name."""
    if gname in quants:
        return quants[gname]
    return next((q for n, q in quants.items() if not n.startswith("blk.") and gguf_name(n) == gname), Q.F32)


# K-quants gguf can read but not write; their fp16 fields (offsets in the block) get small random values.
K_QUANTS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(shape: tuple[int, ...], qtype, seed: int) -> np.ndarray:
    """Random ``qtype`` blocks for a tensor of ``shape`` (rows of bytes, as gguf stores it): every bit pattern of
    the quantized values and sub-scales is a valid block; fp16 scales near 1e-4 keep the weights below ~0.1."""
    per, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // per, nbytes), dtype=np.uint8)
    for off in K_QUANTS[qtype]:
        d = (rng.standard_normal((*raw.shape[:-1], 1)) * 1e-4).astype(np.float16)
        raw[..., off:off + 2] = d.view(np.uint8)
    return raw.reshape(*shape[:-1], -1)


def quant_roundtrip(weight: np.ndarray, qtype) -> torch.Tensor:
    """The weight as the file stores it. Quantization works row by row, so it commutes with the
    q/k row permutation: the un-permuted result must equal quantizing the HF weight directly."""
    if qtype == Q.F32:
        return torch.from_numpy(weight)
    if qtype == Q.F16:
        return torch.from_numpy(weight.astype(np.float16).astype(np.float32))
    return torch.from_numpy(dequantize(quantize(weight, qtype), qtype).reshape(weight.shape))


# -------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def byte_tokenizer() -> Tokenizer:
    return train_byte_level_tokenizer()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, byte_tokenizer):
    """A tiny untied Llama written with every supported quant type."""
    meta = byte_level_metadata(byte_tokenizer)
    model = tiny_model(tiny_config(len(meta["tokens"])))
    path = tmp_path_factory.mktemp("gguf") / "mixed.gguf"
    weights = write_gguf(path, model, meta, quants=MIXED_QUANTS)
    return path, model, weights


@pytest.fixture(scope="module")
def exact(tmp_path_factory, byte_tokenizer):
    """The same shape of model, all float32 and with tied embeddings: must load bit-exactly."""
    meta = byte_level_metadata(byte_tokenizer)
    model = tiny_model(tiny_config(len(meta["tokens"]), tie_word_embeddings=True), seed=1)
    path = tmp_path_factory.mktemp("gguf") / "exact.gguf"
    weights = write_gguf(path, model, meta)
    return path, model, weights


# ----------------------------------------------------------------------------------------- config


def test_config_fields(mixed, byte_tokenizer):
    path, model, _ = mixed
    config = read_gguf(path).config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    expected = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 256,
        "vocab_size": byte_tokenizer.get_vocab_size(),
        "rms_norm_eps": 1e-5,  # stored as float32, read back as the decimal it was
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "rope_scaling": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    assert {k: config[k] for k in expected} == expected


def test_tied_embeddings_have_no_lm_head(exact):
    checkpoint = read_gguf(exact[0])
    assert checkpoint.config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in dict(checkpoint.tensors())


def test_mistral_is_recognised_by_name(tmp_path, byte_tokenizer):
    meta = byte_level_metadata(byte_tokenizer)
    model = tiny_model(tiny_config(len(meta["tokens"])))
    write_gguf(tmp_path / "m.gguf", model, meta, name="Mistral 7B Instruct v0.3")
    assert read_gguf(tmp_path / "m.gguf").config["architectures"] == ["MistralForCausalLM"]


# ---------------------------------------------------------------------------------------- tensors


def test_every_tensor_matches_the_dequantized_original(mixed):
    path, _, weights = mixed
    checkpoint = read_gguf(path)
    loaded = dict(checkpoint.tensors())
    assert set(loaded) == set(weights)
    for name, weight in weights.items():
        qtype = MIXED_QUANTS.get(name, Q.F32)
        got = loaded[name]
        assert got.dtype == torch.float32 and tuple(got.shape) == weight.shape, name
        # Exactly what the file holds, q/k rows back in HF order...
        assert torch.equal(got, quant_roundtrip(weight, qtype)), f"{name} ({qtype.name})"
        # ...which is within the quant's error of the original weight.
        bound = QUANT_TOLERANCE[qtype] * float(np.abs(weight).max()) + 1e-7
        assert (got - torch.from_numpy(weight)).abs().max().item() <= bound, f"{name} ({qtype.name})"


def test_float32_q_k_unpermutation_is_exact(exact):
    path, model, weights = exact
    loaded = dict(read_gguf(path).tensors())
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        assert torch.equal(loaded[name], torch.from_numpy(weights[name]))
        # The file really was permuted, so equality above is the reader undoing it.
        heads = 4 if "q_proj" in name else 2
        assert not np.array_equal(llama_cpp_permute(weights[name], heads), weights[name])


def test_loaded_weights_reproduce_the_logits(exact):
    path, model, _ = exact
    checkpoint = read_gguf(path)
    config = transformers.LlamaConfig(**checkpoint.config)
    clone = transformers.LlamaForCausalLM(config).eval()
    missing, unexpected = clone.load_state_dict(dict(checkpoint.tensors()), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to embed_tokens
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(clone(ids).logits, model(ids).logits)


def test_tensors_are_lazy_and_repeatable(mixed):
    checkpoint = read_gguf(mixed[0])
    stream = checkpoint.tensors()
    assert inspect.isgenerator(stream)
    first_name, first = next(stream)
    again = dict(checkpoint.tensors())
    assert torch.equal(again[first_name], first)


def test_dtype_conversion(mixed):
    path, _, _ = mixed
    as_f32 = dict(read_gguf(path).tensors())
    checkpoint = read_gguf(path, dtype=torch.bfloat16)
    assert checkpoint.config["torch_dtype"] == "bfloat16"
    for name, tensor in checkpoint.tensors():
        assert tensor.dtype == torch.bfloat16 and tensor.is_contiguous()
        assert torch.equal(tensor, as_f32[name].to(torch.bfloat16)), name


def test_qwen2_has_biases_and_no_permutation(tmp_path, byte_tokenizer):
    meta = byte_level_metadata(byte_tokenizer) | {"pre": "qwen2"}
    model = tiny_model(tiny_config(len(meta["tokens"])), "Qwen2ForCausalLM")
    weights = write_gguf(tmp_path / "q.gguf", model, meta, arch="qwen2", permute=False)
    checkpoint = read_gguf(tmp_path / "q.gguf")
    assert checkpoint.config["architectures"] == ["Qwen2ForCausalLM"]
    assert checkpoint.config["attention_bias"] is True
    loaded = dict(checkpoint.tensors())
    assert "model.layers.1.self_attn.k_proj.bias" in loaded
    assert set(loaded) == set(weights)
    for name, weight in weights.items():
        assert torch.equal(loaded[name], torch.from_numpy(weight)), name
    clone = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**checkpoint.config)).eval()
    clone.load_state_dict(loaded)
    ids = torch.arange(20).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(clone(ids).logits, model(ids).logits)


def test_qwen3_has_head_norms_a_wider_head_and_no_permutation(tmp_path, byte_tokenizer):
    """Qwen3 as llama.cpp writes it: attn_q_norm/attn_k_norm per layer, head_dim from key_length (wider than
    hidden / heads, as in Qwen3-0.6B), rotary rows not permuted."""
    meta = byte_level_metadata(byte_tokenizer) | {"pre": "qwen2"}
    model = tiny_model(tiny_config(len(meta["tokens"]), head_dim=32), "Qwen3ForCausalLM")
    path = tmp_path / "q3.gguf"
    weights = write_gguf(path, model, meta, arch="qwen3", permute=False, key_length=32)
    checkpoint = read_gguf(path)
    assert checkpoint.config["architectures"] == ["Qwen3ForCausalLM"] and checkpoint.config["head_dim"] == 32
    loaded = dict(checkpoint.tensors())
    assert "model.layers.1.self_attn.q_norm.weight" in loaded and set(loaded) == set(weights)
    clone = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**checkpoint.config)).eval()
    clone.load_state_dict(loaded)
    ids = torch.arange(20).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(clone(ids).logits, model(ids).logits)
    # And kubellm serving the file generates what transformers generates from the original.
    from kubellm.runtime.engine.llm_engine import LLM
    from kubellm.runtime.sampling.params import SamplingParams

    llm = LLM(str(path), dtype="float32", max_model_len=64, num_kv_blocks=16, block_size=16, progress=False)
    out = llm.generate([list(range(3, 20))], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0]
    with torch.no_grad():
        ref = model.generate(torch.tensor([list(range(3, 20))]), max_new_tokens=6, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, 17:].tolist()
    assert out.token_ids == ref


# Families beyond the Llama layout, written with gguf's own tensor map and the metadata llama.cpp's converter
# writes for them: (transformers class, config overrides, GGUF metadata, norm offset, served context).
FAMILIES = {
    "phi3": ("Phi3ForCausalLM", {"original_max_position_embeddings": 64, "pad_token_id": 0,
                                 "rope_scaling": {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                                  "long_factor": [2.0 + 0.3 * i for i in range(8)]}},
             {"rope.scaling.original_context_length": 64}, 0.0, 64),
    "gemma2": ("Gemma2ForCausalLM", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
                                     "tie_word_embeddings": True, "pad_token_id": 0,
                                     "attn_logit_softcapping": 4.0, "final_logit_softcapping": 6.0,
                                     "hidden_activation": "gelu_pytorch_tanh"},
               {"attention.key_length": 16, "attention.sliding_window": 8, "attn_logit_softcapping": 4.0,
                "final_logit_softcapping": 6.0}, 1.0, 256),
    "gemma3": ("Gemma3ForCausalLM", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
                                     "tie_word_embeddings": True, "pad_token_id": 0,
                                     "layer_types": ["sliding_attention", "full_attention"], "rope_theta": 1e6,
                                     "hidden_activation": "gelu_pytorch_tanh"},
               {"attention.key_length": 16, "attention.sliding_window": 8, "attention.sliding_window_pattern": 2},
               1.0, 256),
    "qwen3moe": ("Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                         "norm_topk_prob": True, "head_dim": 16},
                 {"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 32}, 0.0, 256),
    # llama.cpp writes Mixtral as "llama" (rotary rows permuted) with expert metadata.
    "mixtral": ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
                {"expert_count": 4, "expert_used_count": 2}, 0.0, 256),
}  # fmt: skip


def _mixtral_names(name: str) -> str:
    """The reader names Mixtral's tensors as its Hub checkpoints do (block_sparse_moe, experts w1/w3/w2)."""
    if ".mlp.gate." in name:
        return name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
    if ".mlp.experts." in name:
        name = name.replace(".mlp.experts.", ".block_sparse_moe.experts.")
        return name.replace(".gate_proj.", ".w1.").replace(".up_proj.", ".w3.").replace(".down_proj.", ".w2.")
    return name


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_other_families_load_and_generate_what_transformers_generates(arch, tmp_path, byte_tokenizer):
    """Phi-3 (fused projections, LongRoPE factors as tensors), Gemma 2/3 (norms stored as 1 + w, windows, caps)
    and Qwen3-MoE (stacked experts): every tensor comes back as the original, and kubellm's greedy output on
    the file equals transformers' on the original model."""
    from kubellm.runtime.engine.llm_engine import LLM
    from kubellm.runtime.sampling.params import SamplingParams

    cls, overrides, kv, norm_offset, served = FAMILIES[arch]
    meta = byte_level_metadata(byte_tokenizer) | {"pre": "qwen2"}
    model = tiny_model(tiny_config(len(meta["tokens"]), **overrides), cls)
    extra = {}
    if arch == "phi3":
        scaling = overrides["rope_scaling"]
        extra = {"rope_factors_long.weight": np.asarray(scaling["long_factor"]),
                 "rope_factors_short.weight": np.asarray(scaling["short_factor"])}
    path = tmp_path / f"{arch}.gguf"
    gguf_arch = "llama" if arch == "mixtral" else arch
    weights = write_gguf(path, model, meta, arch=gguf_arch, permute=arch == "mixtral", extra_tensors=extra,
                         extra_kv=kv, key_length=kv.get("attention.key_length"), norm_offset=norm_offset)
    if arch == "mixtral":
        weights = {_mixtral_names(n): w for n, w in weights.items()}
    loaded = dict(read_gguf(path).tensors())
    assert set(loaded) == set(weights)
    for name, weight in weights.items():
        torch.testing.assert_close(loaded[name], torch.from_numpy(weight), rtol=0, atol=1e-6, msg=name)
    llm = LLM(str(path), dtype="float32", max_model_len=served, num_kv_blocks=32, block_size=16, progress=False)
    prompts = [list(range(3, 20)), list(range(40, 45))]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref, arch
    llm.close()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_packed_file_keeps_its_q8_0_embedding_packed_and_a_tied_head_computes_from_it(tied, tmp_path,
                                                                                       byte_tokenizer):
    """Linears in Q4_0/Q4_1 and the embedding in Q8_0: the loader keeps them all in their blocks (the embedding
    behind a QuantizedEmbedding, whose table is the LM head when tied) and the engine's greedy output equals
    transformers' on the same file's dequantized weights."""
    from kubellm.runtime.engine.llm_engine import LLM
    from kubellm.runtime.layers.quantized_embedding import QuantizedEmbedding
    from kubellm.runtime.layers.quantized_linear import QuantizedLinear

    meta = byte_level_metadata(byte_tokenizer)
    model = tiny_model(tiny_config(len(meta["tokens"]), tie_word_embeddings=tied), seed=2)
    quants = {n: Q.Q4_1 if "mlp" in n else Q.Q4_0 for n in model.state_dict() if n.endswith("proj.weight")}
    path = tmp_path / "packed.gguf"
    write_gguf(path, model, meta, quants=quants | {"model.embed_tokens.weight": Q.Q8_0, "lm_head.weight": Q.Q8_0})
    checkpoint = read_gguf(path)
    assert checkpoint.packed_tensors is not None and checkpoint.packed_embedding
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**checkpoint.config)).eval()
    reference.load_state_dict(dict(checkpoint.tensors()), strict=not tied)

    llm = LLM(str(path), dtype="float32", max_model_len=64, num_kv_blocks=32, block_size=16, progress=False)
    served = llm.engine.runner.model
    embed = served.model.embed_tokens
    assert isinstance(embed, QuantizedEmbedding) and embed.table.bits == 8
    assert served.lm_head is embed.table if tied else not isinstance(served.lm_head, QuantizedLinear)
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    assert llm.engine.weight_bytes["int8"] == vocab * hidden  # the embedding's values, one byte each
    assert sum(isinstance(m, QuantizedLinear) for m in served.modules()) == 4 * 2 + 1
    _greedy_equals_transformers(llm, reference)


def _greedy_equals_transformers(llm, reference) -> None:
    """Eight greedy tokens for two prompts equal transformers' ``reference`` model's; closes ``llm``."""
    from kubellm.runtime.sampling.params import SamplingParams

    prompts = [list(range(3, 20)), list(range(40, 45))]
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    finally:
        llm.close()
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref


def _one_and_two_ranks_agree(path, prompts, params, max_model_len: int, inspect=None, dtype: str = "float32",
                             atol: float = 1e-4) -> tuple[dict, dict]:
    """Greedy on one rank and on two (gloo): equal tokens, logits within ``atol`` (float32: its rounding).
    ``inspect(llm, tp)`` looks at each engine before it generates. Returns each run's weight bytes by dtype."""
    from test_engine_parity import LogitRecorder

    from kubellm.runtime.engine.llm_engine import LLM

    runs = []
    for tp in (1, 2):
        llm = LLM(str(path), dtype=dtype, max_model_len=max_model_len, num_kv_blocks=32, block_size=16,
                  progress=False, tensor_parallel_size=tp)
        try:
            if inspect is not None:
                inspect(llm, tp)
            recorder = llm.engine.runner.sampler = LogitRecorder(llm.engine.runner.sampler)
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs.append(([o.token_ids for o in outs], [torch.stack(recorder.rows[o.request_id]) for o in outs],
                         dict(llm.engine.weight_bytes)))
        finally:
            llm.close()
    (tokens, logits, one), (tokens2, logits2, two) = runs
    assert tokens2 == tokens
    for a, b in zip(logits2, logits, strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=0)
    return one, two


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_tp2_keeps_a_packed_file_packed_and_generates_what_one_rank_generates(tied, tmp_path, byte_tokenizer):
    """Two ranks on gloo: each keeps its shards of the Q4_0/Q4_1 linears and its vocabulary rows of the Q8_0
    embedding in their blocks (the weight-bytes log shows int4 and int8 values at half of one rank's, no float
    copy of them), the tied LM head is that packed slice, and greedy tokens equal one rank's with logits
    within float32 rounding. 320 tokens: each rank holds 192 rows, rank 1's last 64 are padding."""
    from kubellm.runtime.layers.quantized_embedding import QuantizedEmbedding
    from kubellm.runtime.sampling.params import SamplingParams

    meta = byte_level_metadata(byte_tokenizer)
    model = tiny_model(tiny_config(len(meta["tokens"]), tie_word_embeddings=tied), seed=4)
    quants = {n: Q.Q4_1 if "mlp" in n else Q.Q4_0 for n in model.state_dict() if n.endswith("proj.weight")}
    path = tmp_path / "packed.gguf"
    write_gguf(path, model, meta, quants=quants | {"model.embed_tokens.weight": Q.Q8_0, "lm_head.weight": Q.F16})
    prompts = [list(range(3, 20)), list(range(40, 45)), list(range(250, 300))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    def packed_embedding(llm, tp):
        served = llm.engine.runner.model
        embed = served.model.embed_tokens
        assert isinstance(embed, QuantizedEmbedding) and embed.num_embeddings == (320 if tp == 1 else 192)
        assert (served.lm_head is embed.table) == tied

    one, two = _one_and_two_ranks_agree(path, prompts, params, 128, packed_embedding)
    hidden = model.config.hidden_size
    assert one["int8"] == 320 * hidden and two["int8"] == 192 * hidden  # the embedding's values, one byte each
    assert two["int4"] * 2 == one["int4"]
    head = 0 if tied else 192 * hidden * 4  # rank 0's rows of the untied F16 head, dequantized as stored
    float_copy = two["int4"] * 2 * 4  # what rank 0's linears would take in float32
    assert two["float32"] - head < 0.05 * float_copy  # only norms and Q4_1's float32 zero points


# Mixtures of experts kept packed: (family, expert types gate/up/down, attention type, config overrides). K-quants
# need 256 inputs per row, so their model is wider.
_K_SHAPE = {"hidden_size": 256, "moe_intermediate_size": 256}
PACKED_MOE = {
    "qwen3moe-q4_0": ("qwen3moe", (Q.Q4_0,) * 3, Q.Q8_0, {}),
    "mixtral-q8_0": ("mixtral", (Q.Q8_0,) * 3, Q.Q4_1, {}),
    "qwen3moe-q4_k": ("qwen3moe", (Q.Q4_K,) * 3, Q.Q8_0, _K_SHAPE),
    "qwen3moe-q4_k_m": ("qwen3moe", (Q.Q4_K, Q.Q4_K, Q.Q6_K), Q.Q8_0, _K_SHAPE),  # Q4_K_M's Q6_K down
    "qwen3moe-q6_k": ("qwen3moe", (Q.Q6_K,) * 3, Q.Q8_0, _K_SHAPE),
    "qwen3moe-q5_k": ("qwen3moe", (Q.Q5_K,) * 3, Q.Q8_0, _K_SHAPE),
}


def write_packed_moe(path: Path, case: str, byte_tokenizer, router=None, **overrides):
    """A tiny mixture of experts written as PACKED_MOE[case] says, its routers (``ffn_gate_inp``) in ``router``'s
    type (default F32); returns (model, its expert types)."""
    arch, experts, attention, shape = PACKED_MOE[case]
    cls, family, kv, _, _ = FAMILIES[arch]
    meta = byte_level_metadata(byte_tokenizer) | {"pre": "qwen2"}
    model = tiny_model(tiny_config(len(meta["tokens"]), **family | shape | overrides), cls, seed=5)
    quants = {n: attention for n in model.state_dict() if n.endswith("proj.weight")}
    quants |= {f"blk.{i}.{t}.weight": q for i in range(model.config.num_hidden_layers)
               for t, q in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), experts, strict=True)}
    if router is not None:
        quants |= {f"blk.{i}.ffn_gate_inp.weight": router for i in range(model.config.num_hidden_layers)}
    kv = kv | ({"expert_feed_forward_length": model.config.moe_intermediate_size} if arch == "qwen3moe" else {})
    write_gguf(path, model, meta, arch="llama" if arch == "mixtral" else arch, permute=arch == "mixtral",
               quants=quants, extra_kv=kv, key_length=getattr(model.config, "head_dim", None))
    return model, experts


def _transformers_state(tensors: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """The reader's per-expert tensors (Hub names) stacked back as transformers keeps them (gate_up_proj
    [E, 2I, H], down_proj [E, H, I] under mlp.experts)."""
    out = {}
    for name, t in tensors.items():
        name = name.replace(".block_sparse_moe.", ".mlp.").replace(".w1.", ".gate_proj.").replace(
            ".w3.", ".up_proj.").replace(".w2.", ".down_proj.")
        out[name] = t
    for i in range(num_layers):
        p = f"model.layers.{i}.mlp.experts."
        experts = sorted({int(n[len(p):].split(".")[0]) for n in out if n.startswith(p)})
        take = {part: [out.pop(f"{p}{e}.{part}.weight") for e in experts]
                for part in ("gate_proj", "up_proj", "down_proj")}
        out[p + "gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(take["gate_proj"], take["up_proj"],
                                                                           strict=True)])
        out[p + "down_proj"] = torch.stack(take["down_proj"])
    return out


@pytest.mark.parametrize("case", list(PACKED_MOE))
def test_a_moe_file_keeps_its_experts_packed_and_generates_what_its_dequantized_weights_do(case, tmp_path,
                                                                                          byte_tokenizer):
    """Stacked experts in Q4_0, Q8_0, Q4_K or Q4_K with a Q6_K down: the reader cuts them per expert in their
    blocks, every expert linear is a QuantizedLinear of the type's bits (the weight-bytes log holds each expert
    value once, 4-bit ones as half a byte, no float expert weight), routers stay float, and the engine's greedy
    output equals transformers' on the same file's dequantized weights."""
    from kubellm.runtime.engine.llm_engine import LLM
    from kubellm.runtime.layers.moe import FusedMoE
    from kubellm.runtime.layers.quantized_linear import QuantizedLinear

    path = tmp_path / f"{case}.gguf"
    model, experts = write_packed_moe(path, case, byte_tokenizer)
    checkpoint = read_gguf(path)
    assert checkpoint.packed_tensors is not None
    cfg = model.config
    reference = type(model)(type(cfg)(**cfg.to_dict())).eval()
    reference.load_state_dict(_transformers_state(dict(checkpoint.tensors()), cfg.num_hidden_layers))

    llm = LLM(str(path), dtype="float32", max_model_len=64, num_kv_blocks=32, block_size=16, progress=False)
    served = llm.engine.runner.model
    inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    n_experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    expert_layers = [m for n, m in served.named_modules() if ".experts." in n and isinstance(m, QuantizedLinear)]
    assert len(expert_layers) == layers * n_experts * 2  # gate_up and down of every expert
    assert not [n for n, p in served.named_parameters() if ".experts." in n]  # no float copy of any expert
    routers = [m.gate for m in served.modules() if isinstance(m, FusedMoE)]
    assert len(routers) == layers and not any(isinstance(r, QuantizedLinear) for r in routers)
    values = {4: 0, 8: 0}  # expert values per bits: gate and up (inter x hidden each), down (hidden x inter)
    for q in experts:
        values[4 if q in (Q.Q4_0, Q.Q4_1, Q.Q4_K) else 8] += layers * n_experts * inter * hidden
    attention = sum(m.in_features * m.out_features for n, m in served.named_modules()
                    if "self_attn" in n and isinstance(m, QuantizedLinear))
    attention_bits = 4 if case.startswith("mixtral") else 8
    values[attention_bits] += attention
    sizes = llm.engine.weight_bytes
    assert sizes.get("int4", 0) == values[4] // 2 and sizes.get("int8", 0) == values[8]
    _greedy_equals_transformers(llm, reference)


@pytest.mark.parametrize(("case", "router"), [("qwen3moe-q4_0", Q.Q8_0), ("mixtral-q8_0", Q.Q4_0)])
def test_a_quantized_gguf_router_is_dequantized_at_load(case, router, tmp_path, byte_tokenizer, caplog):
    """Some GGUF MoE files store ``ffn_gate_inp`` quantized: the reader dequantizes it by gguf's own block math
    (the format's), the engine serves it float with a log line saying so, and its greedy output equals
    transformers' on the file's dequantized weights. The stored router is not the float one written (so a
    router taken from anywhere else would route differently)."""
    from kubellm.runtime.engine.llm_engine import LLM
    from kubellm.runtime.layers.moe import FusedMoE

    path = tmp_path / f"{case}.gguf"
    model, _ = write_packed_moe(path, case, byte_tokenizer, router=router)
    checkpoint = read_gguf(path)
    tensors = dict(checkpoint.tensors())
    cfg = model.config
    routers = [n for n in tensors if n.endswith(".gate.weight")]
    assert len(routers) == cfg.num_hidden_layers
    for i, name in enumerate(sorted(routers)):
        written = model.state_dict()[f"model.layers.{i}.mlp.gate.weight"].float()
        torch.testing.assert_close(tensors[name], quant_roundtrip(written.numpy(), router), rtol=0, atol=0)
        assert not torch.allclose(tensors[name], written, rtol=0, atol=1e-4)
    reference = type(model)(type(cfg)(**cfg.to_dict())).eval()
    reference.load_state_dict(_transformers_state(tensors, cfg.num_hidden_layers))

    with caplog.at_level(logging.INFO, logger="kubellm"):
        llm = LLM(str(path), dtype="float32", max_model_len=64, num_kv_blocks=32, block_size=16, progress=False)
    assert f"{cfg.num_hidden_layers} {router.name} mixture-of-experts routers stored quantized were dequantized" \
        in caplog.text
    served = [m.gate for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE)]
    x = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for gate, name in zip(served, sorted(routers), strict=True):  # prepacked for oneDNN: compared by its output
        with torch.no_grad():
            torch.testing.assert_close(gate(x), x @ tensors[name].t(), rtol=1e-5, atol=1e-5)
    _greedy_equals_transformers(llm, reference)


def _fused_moes(served, count: int) -> list:
    """The model's MoE layers, asserting that all ``count`` stacked their experts for the fused quantized kernel."""
    from kubellm.kernels import cpu_moe
    from kubellm.runtime.layers.moe import FusedMoE

    moes = [m for m in served.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == count and all(isinstance(m.packed, cpu_moe.QuantizedExperts) and not m.experts for m in moes)
    return moes


@pytest.mark.parametrize("case", list(PACKED_MOE))
@torch.inference_mode()
def test_packed_gguf_experts_stack_for_the_fused_moe_kernel(case, tmp_path, byte_tokenizer, native_moe):
    """Experts of every packed type loaded in bfloat16 on the native GEMMs (4-bit: Q4_0's zero point 8, Q4_K's
    fractional float zero points; 8-bit: Q8_0, Q6_K's groups of 16, Q5_K's float zero points; Q4_K_M's 4-bit
    gate/up beside a 6-bit down) stack into kernels/cpu_moe.py's QuantizedExperts, each linear in its own width
    (Q6_K's and Q5_K's values with a value table), and the fused kernel's layer output equals the per-expert path's
    on the same packed weights."""
    from kubellm.runtime.layers.moe import FusedMoE, pack_experts
    from kubellm.runtime.models.loader import build_model

    path = tmp_path / f"{case}.gguf"
    _, experts = write_packed_moe(path, case, byte_tokenizer)
    served = build_model(read_gguf(path), torch.bfloat16, "cpu", 64, progress=False)[0]
    moes = [m for m in served.modules() if isinstance(m, FusedMoE)]
    x = torch.randn(5, moes[0].gate.in_features, generator=torch.Generator().manual_seed(0)).bfloat16()
    per_expert = [m(x) for m in moes]
    assert pack_experts(served) == len(moes) == 2
    for m, want in zip(_fused_moes(served, 2), per_expert, strict=True):
        width = {Q.Q4_0: torch.uint8, Q.Q4_1: torch.uint8, Q.Q4_K: torch.uint8}.get(experts[2], torch.int8)
        assert m.packed.w2.dtype == width  # the down projection's own width (Q4_K_M: 6-bit)
        assert (m.packed.low2 is not None) == (experts[2] in (Q.Q6_K, Q.Q5_K))  # 6- and 5-bit: widened by table
        # bfloat16 rounding of the outputs' sum (per expert path) against float32 (kernel), scaled as the outputs
        # are (Q6_K's random blocks make them larger than 1)
        torch.testing.assert_close(m(x), want, atol=2e-2 * max(1.0, want.abs().max().item()), rtol=2e-2)


@pytest.mark.parametrize("case", ["mixtral-q8_0", "qwen3moe-q6_k", "qwen3moe-q4_k_m"])
def test_fused_8bit_gguf_experts_generate_what_the_dequantized_file_does(case, tmp_path, byte_tokenizer,
                                                                         native_moe):
    """bfloat16 end to end: the packed file (8-bit or Q4_K_M-mixed experts on the fused quantized kernel) greedily
    generates the tokens of the same file dequantized on load (a bfloat16 folder: what such a file ran as before
    its experts stayed packed, on the bfloat16 MoE kernel)."""
    from kubellm.runtime.engine.llm_engine import LLM
    from kubellm.runtime.models.store import export_hf
    from kubellm.runtime.sampling.params import SamplingParams

    path = tmp_path / f"{case}.gguf"
    write_packed_moe(path, case, byte_tokenizer)
    folder = export_hf(path, tmp_path / "hf", torch.bfloat16, pull_missing=False)
    prompts = [list(range(3, 20)), list(range(40, 45))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = []
    for source in (path, folder):
        llm = LLM(str(source), dtype="bfloat16", max_model_len=64, num_kv_blocks=32, block_size=16, progress=False)
        try:
            if source == path:
                _fused_moes(llm.engine.runner.model, 2)
            tokens.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.close()
    assert tokens[0] == tokens[1]


def test_tp2_keeps_gguf_moe_experts_packed_and_generates_what_one_rank_generates(tmp_path, byte_tokenizer):
    """Qwen3-MoE with Q4_0 experts (intermediate 64: each rank's down keeps whole groups of 32) on two gloo ranks:
    every expert's gate/up column-parallel and down row-parallel in their blocks (half of one rank's 4-bit
    values each), greedy tokens equal to one rank's, logits within float32 rounding."""
    from kubellm.runtime.sampling.params import SamplingParams

    path = tmp_path / "moe.gguf"
    write_packed_moe(path, "qwen3moe-q4_0", byte_tokenizer, moe_intermediate_size=64)
    prompts = [list(range(3, 20)), list(range(40, 45))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    one, two = _one_and_two_ranks_agree(path, prompts, params, 64)
    assert one["int4"] == 2 * 4 * 3 * 64 * 64 // 2 and two["int4"] * 2 == one["int4"]


def test_tp2_runs_fused_8bit_gguf_experts_on_each_ranks_slices(tmp_path, byte_tokenizer, native_moe):
    """Mixtral with Q8_0 experts in bfloat16 on two gloo ranks: each rank stacks its shards (gate/up's 32 of the
    64 intermediate channels, down's inputs one whole group of 32) for the fused quantized kernel, and greedy
    tokens equal one rank's, logits within bfloat16 rounding of the two ranks' partial sums."""
    from kubellm.runtime.sampling.params import SamplingParams

    path = tmp_path / "moe.gguf"
    _, experts = write_packed_moe(path, "mixtral-q8_0", byte_tokenizer, intermediate_size=64)
    prompts = [list(range(3, 20)), list(range(40, 45))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def fused(llm, tp):
        assert all(m.inter == 64 // tp for m in _fused_moes(llm.engine.runner.model, 2))

    one, two = _one_and_two_ranks_agree(path, prompts, params, 64, fused, dtype="bfloat16", atol=0.1)
    assert two["int8"] * 2 == one["int8"]  # each rank holds half of the experts' int8 values


def llama3_rope_divisors(theta, head_dim, factor, low, high, original_context):
    """llama.cpp's convert_hf_to_gguf.py rope_freqs for Llama 3 scaling (the reference formula)."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original_context / high:
            out.append(1.0)
        elif wavelen > original_context / low:
            out.append(factor)
        else:
            smooth = (original_context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize(
    "factor, low, high, original",
    [(8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (16.0, 2.0, 8.0, 16384)],
)
def test_llama3_rope_scaling_from_rope_freqs(tmp_path, byte_tokenizer, factor, low, high, original):
    theta, head_dim = 500000.0, 64
    meta = byte_level_metadata(byte_tokenizer)
    config = tiny_config(
        len(meta["tokens"]), hidden_size=256, num_attention_heads=4, num_hidden_layers=1, rope_theta=theta
    )
    model = tiny_model(config)
    divisors = llama3_rope_divisors(theta, head_dim, factor, low, high, original)
    write_gguf(tmp_path / "r.gguf", model, meta, extra_tensors={"rope_freqs.weight": divisors})
    checkpoint = read_gguf(tmp_path / "r.gguf")
    scaling = checkpoint.config["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == factor
    assert "rope_freqs.weight" not in dict(checkpoint.tensors())
    # transformers must derive the same frequencies as from the original parameters.
    reference = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }
    ours = transformers.LlamaForCausalLM(transformers.LlamaConfig(**checkpoint.config)).model.rotary_emb
    theirs = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**config, rope_scaling=reference)
    ).model.rotary_emb
    torch.testing.assert_close(ours.inv_freq, theirs.inv_freq, rtol=1e-5, atol=0)


# -------------------------------------------------------------------------------------- tokenizer


def test_byte_level_tokenizer_matches_source(mixed, byte_tokenizer):
    checkpoint = read_gguf(mixed[0])
    tokenizer = checkpoint.tokenizer
    assert tokenizer.get_vocab() == byte_tokenizer.get_vocab()
    for text in SAMPLES:
        ids = tokenizer.encode(text).ids
        assert ids == byte_tokenizer.encode(text).ids, text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    # SmolLM's pre-tokenizer: every digit on its own, control tokens whole and special.
    digits = tokenizer.encode("2024").tokens
    assert digits == ["2", "0", "2", "4"]
    assert tokenizer.encode("<|im_end|>").ids == [2]
    assert tokenizer.decode([1, 2], skip_special_tokens=True) == ""


def test_tokenizer_config(mixed):
    config = read_gguf(mixed[0]).tokenizer_config
    assert config["chat_template"] == CHAT_TEMPLATE
    assert config["bos_token"] == "<|im_start|>"
    assert config["eos_token"] == "<|im_end|>"
    assert config["unk_token"] == "<|endoftext|>"
    assert config["add_bos_token"] is False
    generation = read_gguf(mixed[0]).generation_config
    assert generation == {"bos_token_id": 1, "eos_token_id": 2}


def sentencepiece_metadata() -> tuple[dict, Tokenizer]:
    """A Llama-2-style vocabulary: ``▁`` words, scores instead of merges, 256 byte-fallback tokens."""
    source = Tokenizer(models.BPE(unk_token="<unk>"))
    source.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    source.train_from_iterator(CORPUS, trainer)
    vocab = source.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    types = [2, 3, 3] + [1] * (len(tokens) - 3)
    # Sentencepiece scores: a later merge scores lower, so -id ranks tokens in merge order.
    scores = [0.0, 0.0, 0.0] + [-float(i) for i in range(3, len(tokens))]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    meta = {
        "model": "llama",
        "tokens": tokens + byte_tokens,
        "types": types + [6] * 256,
        "scores": scores + [0.0] * 256,
        "bos": 1,
        "eos": 2,
        "unk": 0,
        "add_bos": True,
    }
    return meta, source


def test_sentencepiece_tokenizer_matches_transformers(tmp_path):
    meta, _ = sentencepiece_metadata()
    model = tiny_model(tiny_config(len(meta["tokens"])))
    write_gguf(tmp_path / "spm.gguf", model, meta)
    checkpoint = read_gguf(tmp_path / "spm.gguf")
    assert checkpoint.tokenizer_config["add_bos_token"] is True
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in ["What is the capital of France?", "The lazy fox ✓ jumps", "héllo wörld\nline two"]:
        ids = checkpoint.tokenizer.encode(text).ids
        assert ids[0] == 1  # BOS added, as add_bos_token says
        assert ids == reference.encode(text), text
        assert checkpoint.tokenizer.decode(ids, skip_special_tokens=True) == text
    # Characters outside the vocabulary fall back to their UTF-8 bytes, not <unk>.
    assert checkpoint.tokenizer.encode("✓", add_special_tokens=False).tokens[-3:] == [
        "<0xE2>",
        "<0x9C>",
        "<0x93>",
    ]


# ----------------------------------------------------------------------------------------- errors


def test_unknown_architecture_is_named(tmp_path):
    writer = GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"'falcon'.*supported: llama"):
        read_gguf(tmp_path / "falcon.gguf")


def test_garbage_truncated_and_missing_files(tmp_path, mixed):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        read_gguf(garbage)
    data = mixed[0].read_bytes()
    for cut in (len(data) // 2, 2000, 10):
        truncated = tmp_path / f"cut{cut}.gguf"
        truncated.write_bytes(data[:cut])
        with pytest.raises(CheckpointError):
            read_gguf(truncated)
    with pytest.raises(CheckpointError, match="no such GGUF file"):
        read_gguf(tmp_path / "absent.gguf")


def test_missing_tensor_is_reported(tmp_path, byte_tokenizer):
    meta = byte_level_metadata(byte_tokenizer)
    model = tiny_model(tiny_config(len(meta["tokens"])))
    write_gguf(tmp_path / "m.gguf", model, meta, skip=("blk.1.ffn_up.weight",))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        read_gguf(tmp_path / "m.gguf")


def test_unsupported_tokenizer_model(tmp_path, byte_tokenizer):
    meta = byte_level_metadata(byte_tokenizer) | {"model": "bert"}
    model = tiny_model(tiny_config(len(meta["tokens"])))
    write_gguf(tmp_path / "t.gguf", model, meta)
    with pytest.raises(CheckpointError, match="tokenizer model 'bert' is not supported"):
        read_gguf(tmp_path / "t.gguf")


def test_export_hf_folder_loads_in_transformers(exact, tmp_path):
    from kubellm.runtime.models.store import export_hf

    path, model, _ = exact
    out = export_hf(path, tmp_path / "hf", dtype=torch.float32)
    clone = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(clone).__name__ == "LlamaForCausalLM"
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(clone(ids).logits, model(ids).logits)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    checkpoint = read_gguf(path)
    for text in SAMPLES:
        assert tokenizer.encode(text) == checkpoint.tokenizer.encode(text).ids, text
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n"
    )


# -------------------------------------------------------------------------------------- real model


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from kubellm.runtime.models.store import pull

    return pull("smollm2", progress=False)  # $KUBELLM_CACHE or ~/.cache/kubellm: downloads once


def transformers_gguf_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The weights transformers loads from a GGUF (``from_pretrained(..., gguf_file=...)``).

    ``from_pretrained`` insists on accelerate for GGUF files; for llama-arch files it then runs
    exactly ``load_gguf_checkpoint``, so without accelerate we call that directly.
    """
    try:
        import accelerate  # noqa: F401
    except ImportError:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        with torch.device("meta"):  # only its parameter names are used
            skeleton = transformers.AutoModelForCausalLM.from_config(config)
        return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.state_dict()


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_path):
    checkpoint = read_gguf(smollm2_path)
    config = checkpoint.config
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert checkpoint.tokenizer_config["eos_token"] == "<|im_end|>"

    reference_tokenizer = transformers.AutoTokenizer.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name
    )
    for text in [
        "What is the capital of France?",
        "In 2024, 17 + 25 = 42.",
        "<|im_start|>user\nhi<|im_end|>",
    ]:
        assert checkpoint.tokenizer.encode(text).ids == reference_tokenizer.encode(text), text

    reference = transformers_gguf_tensors(smollm2_path)
    ours = dict(checkpoint.tensors())
    assert set(ours) <= set(reference)
    torch.testing.assert_close(
        ours["model.layers.0.self_attn.q_proj.weight"],
        reference["model.layers.0.self_attn.q_proj.weight"],
        rtol=0,
        atol=1e-6,
    )
    for name, tensor in ours.items():
        if not torch.equal(tensor, reference[name]):  # equal in practice; assert_close is slow on 135M values
            torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)
