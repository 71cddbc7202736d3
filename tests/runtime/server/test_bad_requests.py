"""A table of malformed requests: each gets its 4xx with an OpenAI error body, and nothing leaks."""

from __future__ import annotations

import httpx
import pytest

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]

# (name, method, path, raw body or JSON object, expected status, expected `param`/substring of message)
CASES = [
    ("malformed json", "POST", CHAT, b'{"messages": [', 400, "not valid JSON"),
    ("invalid utf-8", "POST", CHAT, b'{"messages": "\xff\xfe"}', 400, "UTF-8"),
    ("body is a list", "POST", CHAT, [1, 2], 400, "JSON object"),
    ("body is a string", "POST", COMP, "hello", 400, "JSON object"),
    ("empty body", "POST", COMP, b"", 400, "not valid JSON"),
    ("messages missing", "POST", CHAT, {"model": "tiny"}, 400, "messages"),
    ("messages empty", "POST", CHAT, {"messages": []}, 400, "messages"),
    ("messages not a list", "POST", CHAT, {"messages": "hi"}, 400, "messages"),
    ("message without role", "POST", CHAT, {"messages": [{"content": "hi"}]}, 400, "role"),
    ("unknown role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("content wrong type", "POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ("unknown model", "POST", CHAT, {"model": "gpt-9", "messages": MSG}, 404, "gpt-9"),
    ("max_tokens negative", "POST", CHAT, {"messages": MSG, "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens zero", "POST", COMP, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens a string", "POST", COMP, {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("max_tokens absurd", "POST", COMP, {"prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
    ("max_completion_tokens absurd", "POST", CHAT, {"messages": MSG, "max_completion_tokens": 10**7}, 400,
     "max_tokens"),
    ("temperature negative", "POST", CHAT, {"messages": MSG, "temperature": -0.5}, 400, "temperature"),
    ("temperature too high", "POST", CHAT, {"messages": MSG, "temperature": 7}, 400, "temperature"),
    ("top_p zero", "POST", CHAT, {"messages": MSG, "top_p": 0}, 400, "top_p"),
    ("top_p above one", "POST", COMP, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("top_k negative", "POST", COMP, {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    ("min_p above one", "POST", COMP, {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    ("n zero", "POST", CHAT, {"messages": MSG, "n": 0}, 400, "n"),
    ("n too large", "POST", CHAT, {"messages": MSG, "n": 1000}, 400, "n"),
    ("presence_penalty out of range", "POST", CHAT, {"messages": MSG, "presence_penalty": 3}, 400,
     "presence_penalty"),
    ("frequency_penalty out of range", "POST", COMP, {"prompt": "hi", "frequency_penalty": -9}, 400,
     "frequency_penalty"),
    ("repetition_penalty zero", "POST", COMP, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("stop wrong type", "POST", COMP, {"prompt": "hi", "stop": 5}, 400, "stop"),
    ("too many stop strings", "POST", COMP, {"prompt": "hi", "stop": [str(i) for i in range(20)]}, 400, "stop"),
    ("min_tokens above max_tokens", "POST", COMP, {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, 400,
     "min_tokens"),
    ("prompt missing", "POST", COMP, {"max_tokens": 3}, 400, "prompt"),
    ("prompt empty string", "POST", COMP, {"prompt": ""}, 400, "prompt"),
    ("prompt empty list", "POST", COMP, {"prompt": []}, 400, "prompt"),
    ("prompt token id out of vocabulary", "POST", COMP, {"prompt": [1, 2, 10**7]}, 400, "vocabulary"),
    ("prompt token id negative", "POST", COMP, {"prompt": [1, -3]}, 400, "vocabulary"),
    ("prompt longer than the context", "POST", COMP, {"prompt": [5] * 600}, 400, "context length"),
    ("prompt of mixed types", "POST", COMP, {"prompt": [1, "a"]}, 400, "prompt"),
    ("stream not a bool", "POST", CHAT, {"messages": MSG, "stream": "yes please"}, 400, "stream"),
    ("seed a string", "POST", CHAT, {"messages": MSG, "seed": "abc"}, 400, "seed"),
    ("stop_token_ids negative", "POST", COMP, {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("wrong method", "GET", CHAT, None, 405, "not allowed"),
    ("unknown route", "POST", "/v1/engines", {}, 404, "no route"),
    ("user message without content", "POST", CHAT, {"messages": [{"role": "user"}]}, 400, "content"),
    ("system message with null content", "POST", CHAT, {"messages": [{"role": "system", "content": None}, *MSG]},
     400, "content"),
    ("image part", "POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                                            "image_url": {"url": "x"}}]}]}, 400,
     "content"),
    ("unknown field", "POST", CHAT, {"messages": MSG, "frobnicate": 1}, 400, "frobnicate"),
    ("unknown field in a message", "POST", CHAT, {"messages": [{"role": "user", "content": "hi", "audio": {}}]}, 400,
     "messages.0.audio"),
    ("suffix (not implemented)", "POST", COMP, {"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    ("best_of (not implemented)", "POST", COMP, {"prompt": "hi", "best_of": 2}, 400, "best_of"),
    ("functions (deprecated, not implemented)", "POST", CHAT, {"messages": MSG, "functions": []}, 400, "functions"),
    ("too many messages", "POST", CHAT, {"messages": MSG * 5000}, 400, "messages"),
    ("logprobs over the cap", "POST", COMP, {"prompt": "hi", "logprobs": 10000}, 400, "logprobs"),
    ("logprobs negative", "POST", COMP, {"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    ("top_logprobs over the cap", "POST", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("top_logprobs without logprobs", "POST", CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    ("logprobs not a bool in chat", "POST", CHAT, {"messages": MSG, "logprobs": 5}, 400, "logprobs"),
    ("logit_bias key not a token id", "POST", CHAT, {"messages": MSG, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("logit_bias value out of range", "POST", COMP, {"prompt": "hi", "logit_bias": {"5": 200}}, 400, "logit_bias"),
    ("logit_bias token outside the vocabulary", "POST", COMP, {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400,
     "logit_bias"),
    ("prompts x n over the per-request cap", "POST", COMP, {"prompt": ["a"] * 65, "n": 16}, 400, "n"),
    ("prompt tokens over what the server queues", "POST", COMP, {"prompt": [[5] * 400] * 24, "max_tokens": 1}, 400,
     "prompt"),
    ("seed over 64 bits", "POST", CHAT, {"messages": MSG, "seed": 2**80}, 400, "seed"),
    ("seed below 64 bits", "POST", COMP, {"prompt": "hi", "seed": -(2**70)}, 400, "seed"),
    ("a lone surrogate in content", "POST", CHAT,
     b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400, "messages.0.content"),
    ("a lone low surrogate in a prompt", "POST", COMP, b'{"prompt": "\\udc00"}', 400, "prompt"),
    ("a lone surrogate in /tokenize", "POST", "/tokenize", b'{"prompt": "x\\udbff"}', 400, "prompt"),
    ("a lone surrogate in a key", "POST", CHAT, b'{"messages": [], "\\ud800": 1}', 400, "surrogate"),
    ("a body nested 100k deep", "POST", CHAT, b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400,
     "nests too deeply"),
    ("chat_template_kwargs sets messages", "POST", CHAT,
     {"messages": MSG, "chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs"),
    ("chat_template_kwargs sets add_generation_prompt", "POST", CHAT,
     {"messages": MSG, "chat_template_kwargs": {"add_generation_prompt": False}}, 400, "chat_template_kwargs"),
    ("chat_template_kwargs sets bos_token", "POST", "/tokenize",
     {"messages": MSG, "chat_template_kwargs": {"bos_token": "x"}}, 400, "chat_template_kwargs"),
]


@pytest.mark.parametrize("name, method, path, body, status, needle", CASES, ids=[c[0] for c in CASES])
def test_malformed_request_gets_an_openai_error(server, name, method, path, body, status, needle):
    if body is None:
        resp = httpx.request(method, server.url + path, timeout=30)
    elif isinstance(body, bytes):
        resp = httpx.request(method, server.url + path, content=body, timeout=30,
                             headers={"content-type": "application/json"})
    else:
        resp = httpx.request(method, server.url + path, json=body, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert needle in error["message"] or needle == error["param"], error


def test_unsupported_fields_are_named_and_harmless_ones_are_ignored(server):
    refused = httpx.post(server.url + COMP, json={"prompt": "hi", "suffix": "x"}, timeout=30).json()["error"]
    assert refused["param"] == "suffix" and refused["code"] == "unsupported_field"
    assert "unsupported field `suffix`" in refused["message"]
    ok = httpx.post(server.url + CHAT, json={"messages": MSG, "max_tokens": 2, "user": "u-1", "store": False,
                                             "metadata": {"team": "a"}}, timeout=30)
    assert ok.status_code == 200, ok.text


def test_a_body_over_the_size_cap_is_refused_with_413(server):
    big = {"prompt": "a" * (server.options.max_request_bytes + 10)}
    resp = httpx.post(server.url + COMP, json=big, timeout=60)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    assert str(server.options.max_request_bytes) in resp.json()["error"]["message"]


def test_a_batch_of_128_prompts_is_served_as_lm_eval_sends_it(server):
    resp = httpx.post(server.url + COMP, json={"prompt": [f"item {i}" for i in range(128)], "max_tokens": 1,
                                               "echo": True, "logprobs": 1, "temperature": 0}, timeout=120)
    assert resp.status_code == 200, resp.text
    assert [c["index"] for c in resp.json()["choices"]] == list(range(128))


def test_streaming_request_with_bad_input_is_refused_before_streaming(server):
    resp = httpx.post(server.url + COMP, json={"prompt": [5] * 600, "stream": True}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"


def test_after_the_table_the_server_is_healthy_and_holds_no_blocks(server):
    assert len(CASES) >= 30
    for case in CASES:  # once more, back to back
        _, method, path, body, *_ = case
        kwargs = {"content": body} if isinstance(body, bytes) else ({"json": body} if body is not None else {})
        httpx.request(method, server.url + path, timeout=30, **kwargs)
    server.wait_idle()
    assert server.used_blocks() == 0
    assert httpx.get(server.url + "/health/live", timeout=10).status_code == 200
    ok = httpx.post(server.url + CHAT, json={"messages": MSG, "max_tokens": 3}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
