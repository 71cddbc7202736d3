"""The official openai client against a real kubellm server on loopback."""

from __future__ import annotations

import asyncio

import openai
import pytest

from kubellm.runtime.engine.llm_engine import LLM
from kubellm.runtime.sampling.params import SamplingParams
from server_harness import MODEL_NAME

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_llama):
    """The offline engine on the same weights: the reference for what the server must return."""
    return LLM(str(tiny_llama), progress=False, dtype="float32", block_size=16, num_kv_blocks=128,
               max_model_len=512)


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_chat_completion_matches_offline_engine_and_counts_usage(client, offline, server):
    resp = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=12, temperature=0)
    ref = offline.chat(QUESTION, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.finish_reason == ref.finish_reason
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    server.wait_idle()


def test_chat_streaming_deltas_concatenate_to_the_full_answer(client):
    full = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens and not chunks[-1].choices


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client, kind):
    options = {"include_usage": True, "continuous_usage_stats": True}
    if kind == "chat":
        stream = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=10, temperature=0,
                                                stream=True, stream_options=options, extra_body={"ignore_eos": True})
    else:
        stream = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=10, n=2,
                                           temperature=0, stream=True, stream_options=options,
                                           extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    final = chunks[-1].usage
    assert not chunks[-1].choices and final.completion_tokens == (10 if kind == "chat" else 20)
    for index in (0, 1) if kind == "completion" else (0,):
        counts = [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].index == index]
        assert counts == sorted(counts) and counts[-1] == 10
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
        assert {c.usage.prompt_tokens for c in chunks} == {final.prompt_tokens}  # one prompt, counted once


def test_completion_with_token_ids_and_text_prompts(client, offline):
    ids = offline.tokenizer.encode("Once upon a time")
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    by_text = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    ref = offline.generate(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert by_ids.choices[0].text == by_text.choices[0].text == ref.text
    assert by_ids.choices[0].finish_reason == "length" and by_ids.usage.completion_tokens == 8


def test_completion_batch_of_prompts_with_n(client):
    resp = client.completions.create(model=MODEL_NAME, prompt=["a b c", "x y"], n=2, max_tokens=4,
                                     temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    assert resp.usage.completion_tokens == 16


def test_completion_streaming(client):
    stream = client.completions.create(model=MODEL_NAME, prompt="The sky", max_tokens=10, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    whole = client.completions.create(model=MODEL_NAME, prompt="The sky", max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices_are_distinct_samples_and_seed_is_reproducible(client):
    kw = dict(model=MODEL_NAME, messages=QUESTION, max_tokens=12, temperature=1.0, seed=42, n=3)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1  # seeds 42, 43, 44


def test_stop_string_ends_the_answer(client):
    full = client.completions.create(model=MODEL_NAME, prompt="Once", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[4:7]
    assert stop.strip() and stop not in full[:4]
    resp = client.completions.create(model=MODEL_NAME, prompt="Once", max_tokens=16, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].text == full[: full.index(stop)] and resp.choices[0].finish_reason == "stop"


def test_32_concurrent_streams_match_the_offline_engine(server, offline):
    """Greedy and seeded-sampled streams, all at once, each equal to the offline engine's answer."""
    aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = [f"Story number {i} begins with" for i in range(32)]

    def params(i):
        return dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.9, top_p=0.95, seed=1000 + i)

    async def one(i):
        stream = await aclient.completions.create(model=MODEL_NAME, prompt=prompts[i], max_tokens=20, stream=True,
                                                  extra_body={"ignore_eos": True}, **params(i))
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run_all():
        return await asyncio.gather(*(one(i) for i in range(32)))

    texts = asyncio.run(run_all())
    refs = offline.generate(prompts, [SamplingParams(max_tokens=20, ignore_eos=True, **params(i)) for i in range(32)],
                            use_tqdm=False)
    assert texts == [r.text for r in refs]
    server.wait_idle()


def test_tokenize_and_detokenize_round_trip_in_vllms_shapes(server):
    import httpx

    tk = server.state.tokenizer
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Once upon a time", "return_token_strs": True}).json()
    assert r["tokens"] == tk.encode("Once upon a time") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 512 and "".join(r["token_strs"]).endswith("time")
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == tk.encode_chat([{"role": "user", "content": "hi"}])
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": tk.decode(r["tokens"], skip_special_tokens=False)}
    for path, body in [("/tokenize", {}), ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}),
                       ("/detokenize", {"tokens": [10**8]}), ("/detokenize", {"tokens": [-1]})]:
        bad = httpx.post(server.url + path, json=body)
        assert bad.status_code == 400 and "error" in bad.json(), (path, body, bad.text)
