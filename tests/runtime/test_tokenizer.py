"""Our tokenizer wrapper against transformers' AutoTokenizer on the same files."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from kubellm.runtime.models.hf import read_hf_folder
from kubellm.runtime.text.tokenizer import ChatTemplateError, Tokenizer

TEXTS = ["Hello world", "What is the capital of France? 1234 apples, café", "  spaces\tand\nnewlines  ", "日本 🙂"]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"}],
]


@pytest.fixture(params=["tiny_llama", "tiny_qwen2"])
def pair(request):
    path = request.getfixturevalue(request.param)
    return Tokenizer.from_checkpoint(read_hf_folder(path)), AutoTokenizer.from_pretrained(path)


def test_encode_and_decode_match_transformers(pair):
    ours, ref = pair
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"]
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_template_matches_transformers(pair, conversation):
    ours, ref = pair
    assert ours.apply_chat_template(conversation) == ref.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=False)
    ref_ids = ref.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    ref_ids = ref_ids["input_ids"] if isinstance(ref_ids, dict) or hasattr(ref_ids, "keys") else ref_ids
    assert ours.encode_chat(conversation) == list(ref_ids)


def test_eos_ids_merge_generation_config_and_tokenizer_config(tiny_qwen2):
    tok = Tokenizer.from_checkpoint(read_hf_folder(tiny_qwen2))
    assert tok.eos_token_ids == {0, 2}  # generation_config lists both <|im_end|> and <|endoftext|>


def test_missing_chat_template_is_a_clear_error(tiny_llama):
    ckpt = read_hf_folder(tiny_llama)
    ckpt.tokenizer_config.pop("chat_template")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer.from_checkpoint(ckpt).apply_chat_template(CONVERSATIONS[0])


def test_template_raise_exception_becomes_chat_template_error(tiny_llama):
    ckpt = read_hf_folder(tiny_llama)
    ckpt.tokenizer_config["chat_template"] = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        Tokenizer.from_checkpoint(ckpt).apply_chat_template(CONVERSATIONS[0])


@pytest.mark.parametrize("name", ["messages", "add_generation_prompt", "bos_token", "eos_token"])
def test_template_kwargs_may_not_replace_what_the_tokenizer_sets(tiny_llama, name):
    tk = Tokenizer.from_checkpoint(read_hf_folder(tiny_llama))
    with pytest.raises(ChatTemplateError, match=name):
        tk.apply_chat_template(CONVERSATIONS[0], **{name: "x"})


def test_a_template_failing_on_client_values_is_a_chat_template_error(tiny_llama):
    ckpt = read_hf_folder(tiny_llama)
    ckpt.tokenizer_config["chat_template"] = "{{ strftime_now('%Y') }}{{ messages[0]['content'] }}"
    tk = Tokenizer.from_checkpoint(ckpt)
    assert tk.apply_chat_template(CONVERSATIONS[0]).endswith("France?")
    with pytest.raises(ChatTemplateError, match="TypeError"):  # the client's string is called
        tk.apply_chat_template(CONVERSATIONS[0], strftime_now="not a function")


def test_no_token_stands_for_more_characters_than_the_longest_piece(tiny_llama, tokenizer_corpus):
    tk = Tokenizer.from_checkpoint(read_hf_folder(tiny_llama))
    text = " ".join(tokenizer_corpus)
    assert len(text) <= len(tk.encode(text, add_special_tokens=False)) * tk.max_chars_per_token
    assert all(len(tk.decode([i], skip_special_tokens=False)) <= tk.max_chars_per_token
               for i in range(tk.vocab_size))
