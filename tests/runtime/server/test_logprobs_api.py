"""Logprobs, echo and logit_bias through the official openai client against a real server, streaming and not."""

from __future__ import annotations

import openai
import pytest
import torch

from server_harness import MODEL_NAME
from tiny_checkpoints import load_hf_model

ATOL = 1e-4


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def _hf_logprobs(model_dir, ids):
    with torch.no_grad():
        return torch.log_softmax(load_hf_model(model_dir)(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_completion_echo_with_logprobs_scores_the_prompt_as_eval_harnesses_ask(client, server, tiny_llama):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs=1, max_tokens=1, temperature 0."""
    prompt = [7, 99, 250, 31, 402, 18, 77, 300, 12]
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, logprobs=1, echo=True,
                                    temperature=0)
    lp = out.choices[0].logprobs
    tk = server.state.tokenizer
    assert len(lp.tokens) == len(prompt) + 1 and lp.tokens[:-1] == [tk.token_text(t) for t in prompt]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _hf_logprobs(tiny_llama, prompt)
    for p in range(1, len(prompt)):
        assert abs(lp.token_logprobs[p] - ref[p - 1][prompt[p]].item()) < ATOL
        assert len(lp.top_logprobs[p]) == 1
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert out.choices[0].text.startswith(tk.decode(prompt))
    assert max(lp.top_logprobs[-1].values()) == pytest.approx(lp.token_logprobs[-1], abs=ATOL)  # greedy pick


def test_streamed_completion_logprobs_equal_the_whole_response(client):
    kw = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=10, logprobs=3, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    tokens, values, tops, offsets, text = [], [], [], [], ""
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            if c.logprobs:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
                tops += c.logprobs.top_logprobs
                offsets += c.logprobs.text_offset
    assert text == whole.text and tokens == whole.logprobs.tokens and len(tokens) == 10
    assert values == pytest.approx(whole.logprobs.token_logprobs, abs=1e-6)
    # keyed by token text, so tokens that print alike (partial UTF-8 bytes) share a key, as with OpenAI
    assert offsets == whole.logprobs.text_offset and all(1 <= len(t) <= 3 for t in tops)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_cover_every_token_with_bytes_and_top_logprobs(client, stream):
    kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Say something"}], max_tokens=8,
              temperature=0, logprobs=True, top_logprobs=4, extra_body={"ignore_eos": True})
    if stream:
        content, entries = "", []
        for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
            for c in chunk.choices:
                content += c.delta.content or ""
                entries += c.logprobs.content if c.logprobs else []
            usage = chunk.usage or None
    else:
        resp = client.chat.completions.create(**kw)
        content, entries, usage = resp.choices[0].message.content, resp.choices[0].logprobs.content, resp.usage
    assert len(entries) == usage.completion_tokens == 8
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", errors="replace") == content
    for e in entries:
        assert len(e.top_logprobs) == 4 and e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=ATOL)
        assert all(a.logprob >= b.logprob for a, b in zip(e.top_logprobs, e.top_logprobs[1:], strict=False))


def test_without_logprobs_the_field_is_null(client):
    resp = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=2)
    assert resp.choices[0].logprobs is None


def test_logit_bias_through_the_api(client):
    resp = client.completions.create(model=MODEL_NAME, prompt="Once", max_tokens=3, temperature=0,
                                     logit_bias={"123": 100}, extra_body={"ignore_eos": True}, logprobs=0)
    assert resp.choices[0].logprobs.tokens == [resp.choices[0].logprobs.tokens[0]] * 3
