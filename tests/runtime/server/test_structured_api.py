"""Structured outputs through the official openai client: response_format (json_object, json_schema), vLLM's
structured_outputs and guided_* fields; streaming and not; n > 1; bad schemas are 400s naming the field."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from server_harness import MODEL_NAME

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
          "properties": {"city": {"type": "string", "maxLength": 8},
                         "population": {"type": "integer", "minimum": 0, "maximum": 99999}}}
MSG = [{"role": "user", "content": "Name a city as JSON"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def _format(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}


def test_json_schema_response_format_validates_for_every_choice(client):
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MSG, response_format=_format(), n=4, seed=5,
                                          temperature=1.0, max_tokens=100)
    assert len(resp.choices) == 4
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_schema_streamed(client):
    text = ""
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=MSG, response_format=_format(),
                                                stream=True, temperature=0.8, seed=1, max_tokens=100):
        for c in chunk.choices:
            text += c.delta.content or ""
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_mode_starts_an_object_and_is_valid_json_when_it_stops(client):
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MSG, response_format={"type": "json_object"},
                                          n=3, seed=2, max_tokens=40)
    for choice in resp.choices:
        assert choice.message.content.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"choice": ["alpha", "beta"]}}, lambda t: t in ("alpha", "beta")),
    ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
    ({"guided_regex": r"[0-9]{3}"}, lambda t: re.fullmatch(r"[0-9]{3}", t)),
    ({"structured_outputs": {"regex": r"[A-Z][a-z]{1,3}"}}, lambda t: re.fullmatch(r"[A-Z][a-z]{1,3}", t)),
    ({"guided_json": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"structured_outputs": {"grammar": 'root ::= "<" [a-c] [a-c]? ">"'}}, lambda t: re.fullmatch(r"<[a-c]{1,2}>", t)),
])
def test_vllm_fields_on_completions(client, extra, check):
    resp = client.completions.create(model=MODEL_NAME, prompt="Answer:", max_tokens=60, n=2, seed=9,
                                     temperature=1.0, extra_body=extra)
    for choice in resp.choices:
        assert choice.finish_reason == "stop" and check(choice.text), choice.text


@pytest.mark.parametrize("body, param", [
    ({"response_format": _format({"type": "bogus"})}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "exactly one"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "one output constraint"),
])
def test_bad_constraints_are_400s_that_name_the_field(server, body, param):
    resp = httpx.post(server.url + "/v1/chat/completions", json={"messages": MSG, **body}, timeout=30)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert param == err["param"] or param in err["message"], err
    server.wait_idle()


def test_text_response_format_is_unconstrained(client):
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MSG, response_format={"type": "text"},
                                          max_tokens=3)
    assert resp.choices[0].message.content is not None


@pytest.fixture
def tight_grammar_limits(server, monkeypatch):
    """Matchers built with a lexer-state limit that any JSON grammar passes at its first token, as a grammar
    hitting llguidance's real limits does later."""
    import llguidance

    grammars = server.engine.structured_outputs
    monkeypatch.setattr(grammars, "matcher", lambda spec: llguidance.LLMatcher(
        grammars.tokenizer, spec.grammar, limits=llguidance.LLParserLimits(max_lexer_states=5)))


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_hits_the_engines_limits_says_so(server, tight_grammar_limits, stream):
    body = {"messages": MSG, "response_format": _format(), "max_tokens": 50, "stream": stream}
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    if stream:  # the error comes as the stream's last event, after the status line went out
        events = [json.loads(line[6:]) for line in resp.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        error = events[-1]["error"]
    else:
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
    assert error["code"] == "grammar_error" and error["param"] == "response_format.json_schema.schema", error
    assert "too many states" in error["message"], error
    server.wait_idle()
