"""The tiny checkpoint builders themselves: deterministic, real HF format, and usable as a greedy reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tiny_checkpoints import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    _trained_tokenizer_json,
    build_checkpoint,
    chatml,
    hf_greedy,
    load_hf_model,
    make_corpus,
    train_tokenizer,
)

transformers = pytest.importorskip("transformers")

PROMPT_TEXTS = [
    "The cat reads a book in the kitchen.",
    "Hello",
    "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n",
    "Zürich 東京 😀 -> 42%",
]


def _all_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        part = load_file(f)
        assert not set(part) & set(out), f"tensor stored twice: {set(part) & set(out)}"
        out.update(part)
    return out


def _prompts(tok) -> list[list[int]]:
    return [tok.encode(t).ids for t in PROMPT_TEXTS]


# ---------------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_training_is_deterministic():
    a = _trained_tokenizer_json.__wrapped__(512, 0)
    b = _trained_tokenizer_json.__wrapped__(512, 0)
    assert a == b
    ta, tb = train_tokenizer(), train_tokenizer()
    assert ta.get_vocab() == tb.get_vocab()
    assert ta is not tb
    assert train_tokenizer(seed=1).get_vocab() != ta.get_vocab()
    assert make_corpus(0) == make_corpus(0) and make_corpus(0) != make_corpus(1)


def test_tokenizer_specials_and_size(tiny_tokenizer):
    assert tiny_tokenizer.get_vocab_size() == 512
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tiny_tokenizer.token_to_id(t) == i
    specials = {t.content for t in tiny_tokenizer.get_added_tokens_decoder().values() if t.special}
    assert specials == set(SPECIAL_TOKENS)
    enc = tiny_tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert enc.ids[0] == 1 and enc.ids[-1] == 2
    assert tiny_tokenizer.decode(enc.ids, skip_special_tokens=True) == "user\nhi"


def test_tokenizer_round_trips_and_splits_digits(tiny_tokenizer, tokenizer_corpus):
    texts = [
        *tokenizer_corpus[:50],
        "  two leading spaces",
        "tab\tnew\nline\n\n",
        "ünïcödé 한국어 🤖🤖 ∑",
        "",
    ]
    for text in texts:
        ids = tiny_tokenizer.encode(text).ids
        assert tiny_tokenizer.decode(ids) == text
    # Individual digits, as SmolLM2 does.
    assert tiny_tokenizer.encode("12345").tokens == list("12345")
    # Merges were learned (not just bytes), and unseen characters still encode through byte tokens.
    assert len(tiny_tokenizer.encode(tokenizer_corpus[0]).ids) < len(tokenizer_corpus[0])
    assert len(tiny_tokenizer.encode("한").ids) == 3


# ---------------------------------------------------------------------------------------------- checkpoints


def test_build_is_deterministic(tmp_path):
    a = build_checkpoint(tmp_path / "a", "qwen2", num_shards=2)
    b = build_checkpoint(tmp_path / "b", "qwen2", num_shards=2)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    c = build_checkpoint(tmp_path / "c", "qwen2", seed=1)
    ta, tc = _all_tensors(a), _all_tensors(c)
    assert ta.keys() == tc.keys()
    assert not torch.equal(ta["model.embed_tokens.weight"], tc["model.embed_tokens.weight"])


def test_rebuild_in_place_replaces_old_shards(tmp_path):
    build_checkpoint(tmp_path, "llama", num_shards=3)
    build_checkpoint(tmp_path, "llama")
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_expected_files(tiny_checkpoint):
    for name in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ]:
        assert (tiny_checkpoint / name).is_file(), name
    tc = json.loads((tiny_checkpoint / "tokenizer_config.json").read_text())
    assert tc["chat_template"] == CHAT_TEMPLATE
    assert (tc["bos_token"], tc["eos_token"], tc["pad_token"]) == (
        "<|endoftext|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert tc["model_max_length"] == 512
    assert tc["add_bos_token"] is False


def test_sharded_index_covers_every_tensor_once(tiny_llama_sharded, tiny_llama):
    index = json.loads((tiny_llama_sharded / "model.safetensors.index.json").read_text())
    weight_map: dict[str, str] = index["weight_map"]
    shard_files = sorted(tiny_llama_sharded.glob("model-*-of-*.safetensors"))
    assert [f.name for f in shard_files] == [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(set(weight_map.values())) == [f.name for f in shard_files]
    seen: dict[str, str] = {}
    total = 0
    for f in shard_files:
        with safe_open(f, "pt") as sf:
            assert sf.metadata() == {"format": "pt"}
            for key in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                assert key not in seen, f"{key} in {seen.get(key)} and {f.name}"
                seen[key] = f.name
                t = sf.get_tensor(key)
                total += t.numel() * t.element_size()
    assert seen == weight_map
    assert index["metadata"]["total_size"] == total
    # Same weights as the single-file checkpoint, and a layer's tensors may straddle shards.
    single, sharded = _all_tensors(tiny_llama), _all_tensors(tiny_llama_sharded)
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[k], sharded[k]) for k in single)


def test_config_dims(tiny_llama, tiny_llama3, tiny_qwen2, tiny_mistral):
    def cfg(d):
        return json.loads((d / "config.json").read_text())

    llama, llama3, qwen2, mistral = cfg(tiny_llama), cfg(tiny_llama3), cfg(tiny_qwen2), cfg(tiny_mistral)
    assert llama["architectures"] == ["LlamaForCausalLM"] and llama["vocab_size"] == 512
    assert (llama["hidden_size"], llama["num_attention_heads"], llama["num_key_value_heads"]) == (64, 4, 2)
    assert llama["rope_theta"] == 10000.0 and llama["rope_scaling"] is None
    assert not llama["tie_word_embeddings"] and llama["torch_dtype"] == "float32"
    assert llama3["rope_scaling"]["rope_type"] == "llama3" and llama3["rope_theta"] == 500000.0
    assert qwen2["architectures"] == ["Qwen2ForCausalLM"] and qwen2["tie_word_embeddings"] is True
    assert mistral["architectures"] == ["MistralForCausalLM"] and mistral["sliding_window"] is None
    assert (mistral["num_key_value_heads"], mistral["head_dim"]) == (1, 32)
    gen = json.loads((tiny_qwen2 / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 0]


def test_overrides_and_bf16(tmp_path, tiny_llama):
    d = build_checkpoint(tmp_path, "llama", dtype=torch.bfloat16, num_hidden_layers=2)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["torch_dtype"] == "bfloat16"
    t = _all_tensors(d)
    assert {v.dtype for v in t.values()} == {torch.bfloat16}
    assert not any(k.startswith("model.layers.2.") for k in t)
    # Per-tensor seeding: the layers that remain have tiny_llama's weights (rounded).
    ref = _all_tensors(tiny_llama)
    assert torch.equal(
        t["model.layers.1.mlp.up_proj.weight"], ref["model.layers.1.mlp.up_proj.weight"].bfloat16()
    )


def test_qwen2_biases_nonzero_and_tied(tiny_qwen2):
    t = _all_tensors(tiny_qwen2)
    assert "lm_head.weight" not in t
    for proj in ("q_proj", "k_proj", "v_proj"):
        bias = t[f"model.layers.0.self_attn.{proj}.bias"]
        assert bias.abs().min() > 0 and bias.std() > 0.05
    model = load_hf_model(tiny_qwen2)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.model.layers[0].self_attn.q_proj.bias, t["model.layers.0.self_attn.q_proj.bias"])


def test_norm_weights_are_not_ones(tiny_llama):
    t = _all_tensors(tiny_llama)
    for k in ("model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert not torch.allclose(t[k], torch.ones_like(t[k]))


@pytest.mark.parametrize(
    "fixture", ["tiny_llama", "tiny_llama3", "tiny_qwen2", "tiny_mistral", "tiny_llama_sharded"]
)
def test_loads_in_transformers(fixture, request, tiny_tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d: Path = request.getfixturevalue(fixture)
    cfg = json.loads((d / "config.json").read_text())
    model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert type(model).__name__ == cfg["architectures"][0]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    # Every parameter came from the file (none left at transformers' own init).
    stored = _all_tensors(d)
    for name, p in model.state_dict().items():
        src = stored.get(name, stored["model.embed_tokens.weight"] if name == "lm_head.weight" else None)
        assert src is not None and torch.equal(p, src), name
    assert model.config.rope_parameters["rope_theta"] == cfg["rope_theta"]

    tok = AutoTokenizer.from_pretrained(d)
    msgs = [{"role": "user", "content": "hi"}]
    expected = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert chatml(msgs) == expected
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == expected
    convo = [{"role": "system", "content": "Be brief."}, *msgs, {"role": "assistant", "content": "Hello 42!"}]
    assert tok.apply_chat_template(convo, tokenize=False) == chatml(convo, add_generation_prompt=False)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|endoftext|>", "<|im_end|>", "<|endoftext|>")
    assert (tok.eos_token_id, tok.pad_token_id) == (2, 0)
    for text in [*PROMPT_TEXTS, expected]:
        assert tok(text).input_ids == tiny_tokenizer.encode(text).ids  # no BOS added, same BPE


def test_transformers5_rope_format_loads_the_same(tmp_path, tiny_llama3):
    from transformers import AutoConfig

    d = build_checkpoint(tmp_path, "llama3", rope_format="transformers5")
    cfg = json.loads((d / "config.json").read_text())
    assert "rope_scaling" not in cfg and cfg["rope_parameters"]["rope_type"] == "llama3"
    assert (
        AutoConfig.from_pretrained(d).rope_parameters
        == AutoConfig.from_pretrained(tiny_llama3).rope_parameters
    )
    assert _all_tensors(d).keys() == _all_tensors(tiny_llama3).keys()


# ---------------------------------------------------------------------------------------------- reference


def test_hf_greedy_shapes_argmax_and_variety(tiny_checkpoint, tiny_tokenizer):
    prompts = _prompts(tiny_tokenizer)
    tokens, logits = hf_greedy(tiny_checkpoint, prompts, 20)
    assert len(tokens) == len(logits) == len(prompts)
    for toks, lg in zip(tokens, logits, strict=True):
        assert len(toks) == 20
        assert lg.shape == (20, 512) and lg.dtype == torch.float32
        assert lg.argmax(-1).tolist() == toks
        assert len(set(toks)) >= 3, toks  # random weights must not collapse to one repeated token
        # The argmax is clear enough that fp reordering in another implementation will not flip it often.
        top2 = lg.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).median() > 1e-3
    # The same prompts again come from the cached model and agree exactly.
    again, _ = hf_greedy(tiny_checkpoint, prompts[:1], 20)
    assert again[0] == tokens[0]


def test_hf_greedy_matches_manual_forward(tiny_llama, tiny_tokenizer):
    """generate() output is plain argmax decoding over full forwards (no processors changed the logits)."""
    prompt = _prompts(tiny_tokenizer)[0]
    tokens, logits = hf_greedy(tiny_llama, [prompt], 8)
    model = load_hf_model(tiny_llama)
    with torch.inference_mode():
        full = model(torch.tensor([prompt + tokens[0]])).logits[0, len(prompt) - 1 : -1]
    torch.testing.assert_close(full, logits[0], rtol=1e-4, atol=1e-4)


def test_hf_greedy_does_not_stop_on_eos(tmp_path, tiny_llama, tiny_tokenizer):
    prompts = _prompts(tiny_tokenizer)
    ref, _ = hf_greedy(tiny_llama, prompts, 12)
    # Same weights, but the EOS id (config + generation_config) is the first token greedy emits.
    d = build_checkpoint(tmp_path, "llama", eos_token_id=ref[0][0])
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == ref[0][0]
    got, _ = hf_greedy(d, prompts, 12)
    assert got == ref


def test_llama3_rope_scaling_matters(tmp_path, tiny_llama3, tiny_tokenizer):
    """At these sizes the llama3 frequency remapping changes the logits, so a runtime that ignores it fails."""
    prompt = tiny_tokenizer.encode(" ".join(make_corpus(7, 4))).ids[:60]
    unscaled = build_checkpoint(tmp_path, "llama3", rope_scaling=None)
    _, scaled_logits = hf_greedy(tiny_llama3, [prompt], 5)
    _, unscaled_logits = hf_greedy(unscaled, [prompt], 5)
    assert (scaled_logits[0] - unscaled_logits[0]).abs().max() > 1e-2


def test_hf_greedy_bf16(tiny_llama_bf16, tiny_tokenizer):
    tokens, logits = hf_greedy(tiny_llama_bf16, _prompts(tiny_tokenizer)[:2], 10, dtype=torch.bfloat16)
    assert load_hf_model(tiny_llama_bf16, torch.bfloat16).dtype == torch.bfloat16
    assert all(len(t) == 10 for t in tokens)
    assert all(
        lg.dtype == torch.float32 and lg.argmax(-1).tolist() == t
        for lg, t in zip(logits, tokens, strict=True)
    )
