"""Loading Hugging Face folders: what works, and the clear errors for what doesn't."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kubellm.runtime.models.checkpoint import CheckpointError
from kubellm.runtime.models.config import ModelConfig
from kubellm.runtime.models.loader import build_model, read_checkpoint


@pytest.fixture
def broken(tiny_llama, tmp_path):
    """A writable copy of the tiny Llama to damage."""
    dst = tmp_path / "model"
    shutil.copytree(tiny_llama, dst)
    return dst


def _load(path):
    ckpt = read_checkpoint(path)
    return build_model(ckpt, torch.float32, "cpu", 128, progress=False)


def test_sharded_and_single_file_checkpoints_load_identical_weights(tiny_llama, tiny_llama_sharded):
    single, _ = _load(tiny_llama)
    sharded, _ = _load(tiny_llama_sharded)
    for (name, a), (_, b) in zip(single.state_dict().items(), sharded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_tied_embeddings_share_one_tensor(tiny_qwen2):
    model, cfg = _load(tiny_qwen2)
    assert cfg.tie_word_embeddings and cfg.attention_bias
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_config_reads_transformers5_rope_parameters():
    cfg = ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}})
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"


_PHI3 = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 10, "hidden_size": 8,
         "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 4096,
         "original_max_position_embeddings": 1024}


def test_phi3_su_scaling_is_longrope_with_the_top_level_original_length():
    cfg = ModelConfig.from_hf({**_PHI3, "rope_scaling": {"type": "su", "short_factor": [1.0, 1.0],
                                                         "long_factor": [2.0, 3.0]}})
    assert cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.rope_scaling["original_max_position_embeddings"] == 1024 and cfg.rope_scaling["factor"] == 4.0


@pytest.mark.parametrize(("change", "message"), [
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0, 2.0]}},
     "short_factor has 1 entries, head_dim 4 needs 2"),
    ({"rope_scaling": {"type": "longrope", "long_factor": [1.0, 2.0]}}, "short_factor must be a list"),
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor=0.75 .* not supported"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}, "model_type": "qwen2"}, "'yarn' .* not supported"),
])  # fmt: skip
def test_unsupported_or_malformed_rope_is_a_clear_error(change, message):
    with pytest.raises(CheckpointError, match=message):
        ModelConfig.from_hf({**_PHI3, **change})


_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 4, "num_attention_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 6}


def test_moe_config_reads_sparse_layers_and_routing():
    cfg = ModelConfig.from_hf({**_MOE, "decoder_sparse_step": 2, "mlp_only_layers": [3], "norm_topk_prob": True})
    assert cfg.moe.sparse_layers == (1,) and cfg.moe.renormalize and cfg.moe.intermediate_size == 6
    mixtral = ModelConfig.from_hf({**_MOE, "architectures": ["MixtralForCausalLM"], "num_experts": None,
                                   "num_local_experts": 4})
    assert mixtral.moe.sparse_layers == (0, 1, 2, 3) and mixtral.moe.renormalize
    assert mixtral.moe.intermediate_size == 16  # Mixtral's experts use intermediate_size
    assert ModelConfig.from_hf({k: v for k, v in _MOE.items() if "expert" not in k}).moe is None
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts: still Qwen's expert width.
    v5 = {k: v for k, v in _MOE.items() if k != "num_experts"} | {"num_local_experts": 4}
    assert ModelConfig.from_hf(v5).moe.intermediate_size == 6


@pytest.mark.parametrize(("change", "message"), [
    ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 must be within 1..4"),
    ({"shared_expert_intermediate_size": 8}, "shared experts .* not supported"),
])  # fmt: skip
def test_malformed_or_unsupported_moe_is_a_clear_error(change, message):
    with pytest.raises(CheckpointError, match=message):
        ModelConfig.from_hf({**_MOE, **change})


_GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 7, "num_attention_heads": 2, "head_dim": 4, "sliding_window": 512,
           "max_position_embeddings": 32768}


def test_gemma3_layer_types_and_rotary_from_hub_and_transformers5_configs():
    from kubellm.runtime.models.gemma import FULL, SLIDING, GemmaSettings

    hub = GemmaSettings.from_config(ModelConfig.from_hf({
        **_GEMMA3, "sliding_window_pattern": 6, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}}))  # fmt: skip
    assert hub.layer_types == (SLIDING,) * 5 + (FULL, SLIDING) and hub.window == 512
    assert hub.rope == {FULL: (1e6, {"rope_type": "linear", "factor": 8.0}), SLIDING: (1e4, None)}
    v5 = GemmaSettings.from_config(ModelConfig.from_hf({**_GEMMA3, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}))  # fmt: skip
    assert v5.rope == hub.rope


@pytest.mark.parametrize(("change", "message"), [
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types must list .* each of the 7 layers"),
    ({"sliding_window": None}, "sliding layers need a positive sliding_window"),
])  # fmt: skip
def test_malformed_gemma_layout_is_a_clear_error(change, message):
    from kubellm.runtime.models.gemma import GemmaSettings

    with pytest.raises(CheckpointError, match=message):
        GemmaSettings.from_config(ModelConfig.from_hf({**_GEMMA3, **change}))


@pytest.mark.parametrize(("arch", "window", "expected"), [
    ("MistralForCausalLM", 4096, 4096),  # Mistral v0.1
    ("Phi3ForCausalLM", 2047, 2047),  # Phi-3-mini-4k: transformers masks 2047 keys, the query's own included
    ("MixtralForCausalLM", 4096, 4096),
    ("MistralForCausalLM", 32768, None),  # no shorter than the context: never hides a key (Phi-3-128k too)
    ("MistralForCausalLM", None, None),  # Mistral v0.2+
])  # fmt: skip
def test_every_layer_windows_of_mistral_phi3_and_mixtral_are_served(arch, window, expected):
    cfg = ModelConfig.from_hf({**_GEMMA3, "architectures": [arch], "sliding_window": window})
    assert cfg.attention_window == expected


@pytest.mark.parametrize(("change", "message"), [
    ({"architectures": ["LlamaForCausalLM"]}, "sliding_window=4096 shorter than the context .* for LlamaForCausalLM"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}, "not supported yet for Qwen2ForCausalLM"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 0}, "sliding_window must be a positive integer"),
])  # fmt: skip
def test_other_sliding_windows_are_still_refused(change, message):
    with pytest.raises(CheckpointError, match=message):
        ModelConfig.from_hf({**_GEMMA3, "sliding_window": 4096, **change})


def test_unknown_architecture_is_named_in_the_error(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="GPTNeoXForCausalLM.*LlamaForCausalLM"):
        _load(broken)


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "config.json").unlink(), "config.json not found"),
    (lambda d: (d / "config.json").write_text("{not json"), "not valid JSON"),
    (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json not found"),
    (lambda d: (d / "model.safetensors").unlink(), "no \\*.safetensors"),
    (lambda d: (d / "model.safetensors").write_bytes(b"garbage"), "cannot read weights"),
])
def test_malformed_checkpoints_fail_with_a_clear_error(broken, damage, message):
    damage(broken)
    with pytest.raises(CheckpointError, match=message):
        _load(broken)


def test_missing_tensor_is_reported(broken):
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing 1 tensors.*layers.1.mlp.down_proj"):
        _load(broken)


def test_a_missing_part_of_a_fused_layer_is_named(broken):
    """k_proj fills one part of the fused qkv_proj: without it, the parameter is only partly loaded."""
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight"], tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing 2 tensors, e\.g\. model\.layers\.0\.self_attn\.qkv_proj\.weight "
                                              r"\(part 'k'\), model\.layers\.1\.mlp\.gate_up_proj\.weight \(part 1\)"):
        _load(broken)


def test_unexpected_tensor_is_named(broken):
    tensors = load_file(broken / "model.safetensors")
    tensors["model.layers.0.mlp.experts.0.gate_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight'"):
        _load(broken)


def test_wrong_shape_names_the_tensor(broken):
    tensors = load_file(broken / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match="k_proj.weight.*shape"):
        _load(broken)


def test_missing_shard_listed_in_index(tiny_llama_sharded, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(tiny_llama_sharded, dst)
    next(dst.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="shards that are missing"):
        read_checkpoint(dst)


def test_neither_folder_nor_gguf(tmp_path):
    with pytest.raises(CheckpointError, match="neither a model folder nor a .gguf"):
        read_checkpoint(tmp_path / "nothing.bin")
