"""Every model family of issue 11 served: a real uvicorn server on loopback over each tiny checkpoint (written by
transformers' own classes), asked through the official openai client, answers what transformers' greedy
decoding of the same prompt reads as."""

from __future__ import annotations

import openai
import pytest

from server_harness import MODEL_NAME, ServerThread
from tiny_checkpoints import hf_greedy

PROMPT = [5, 17, 42, 99, 7, 256, 311, 64, 12, 480, 3, 77, 150, 9, 201]  # longer than gemma's 12-token windows
NEW = 8


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma2", "gemma3", "qwen3_moe", "mixtral"])
def test_the_served_family_answers_what_transformers_generates(arch, tiny_checkpoint_factory):
    model_dir = tiny_checkpoint_factory(arch)
    ref_tokens, _ = hf_greedy(model_dir, [PROMPT], NEW)
    server = ServerThread(model_dir).start()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        resp = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=NEW, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert resp.usage.prompt_tokens == len(PROMPT) and resp.usage.completion_tokens == NEW
        assert resp.choices[0].text == server.state.tokenizer.decode(ref_tokens[0])
        server.wait_idle()
    finally:
        server.stop()
