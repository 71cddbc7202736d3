"""The tool-call syntaxes of the families we serve, parsed whole and streamed piece by piece (pure functions)."""

from __future__ import annotations

import json

import pytest

from kubellm.runtime.text.tool_calls import ToolCallStream, detect_parser, parse_calls

HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"tz": "CET"}}'
MISTRAL = 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"tz": "CET"}}]'
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}'
EXPECTED = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]


@pytest.mark.parametrize("parser, text, content", [("hermes", HERMES, "Let me look."), ("llama3_json", LLAMA, None),
                                                   ("mistral", MISTRAL, "Sure."), ("mistral", MISTRAL_V11, None)])
def test_whole_outputs_parse_into_calls_and_content(parser, text, content):
    got_content, calls, started = parse_calls(parser, text)
    assert started and got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("parser, text", [("hermes", "Just prose, no calls."), ("llama3_json", "Paris is nice."),
                                          ("llama3_json", '{"answer": 42}'), ("mistral", "No tools [needed].")])
def test_prose_and_json_that_is_not_a_call_stay_content(parser, text):
    content, calls, _ = parse_calls(parser, text)
    assert content == text and calls == []


def test_an_unclosed_last_hermes_call_counts_when_its_json_is_whole():
    _, calls, _ = parse_calls("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": 1}}')
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}')]
    _, calls, _ = parse_calls("hermes", '<tool_call>\n{"name": "f", "argu')
    assert calls == []


@pytest.mark.parametrize("parser, text, content", [("hermes", HERMES, "Let me look.\n"), ("llama3_json", LLAMA, ""),
                                                   ("mistral", MISTRAL, "Sure.")])
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streaming_yields_the_same_content_and_calls_in_openai_delta_shape(parser, text, content, step):
    stream, deltas = ToolCallStream(parser), []
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for k, piece in enumerate(pieces):
        deltas += stream.feed(piece, final=k == len(pieces) - 1)
    assert "".join(d.get("content", "") for d in deltas) == content
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            call["name"] += tc.get("function", {}).get("name", "")
            call["arguments"] += tc["function"]["arguments"]
            assert "id" not in tc or tc["type"] == "function"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == EXPECTED
    assert stream.called


def test_streaming_holds_back_a_marker_split_across_pieces_and_releases_prose():
    stream = ToolCallStream("hermes")
    assert stream.feed("Hello <tool") == [{"content": "Hello "}]
    assert stream.feed("tip> done", final=True) == [{"content": "<tooltip> done"}]
    assert not stream.called


@pytest.mark.parametrize("template, parser", [
    ("{% for tool in tools %}{{ tool }}{% endfor %}<tool_call>", "hermes"),
    ("{{ '[TOOL_CALLS]' }}{{ tools }}", "mistral"),
    ("{% if tools %}<|python_tag|>{% endif %}", "llama3_json"),
    ("{{ messages }}", None),
])
def test_the_syntax_is_read_from_the_chat_template(template, parser):
    assert detect_parser(template) == parser
