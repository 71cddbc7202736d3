"""Tool calling through the official openai client against a real server whose model's chat template renders
tools (Qwen 2.5 style, Hermes syntax): required and named choices are enforced by the grammar engine, auto is
parsed, streaming gives OpenAI's tool-call deltas, and tool results go back into the conversation."""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import openai
import pytest

from server_harness import MODEL_NAME, ServerThread

TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Reply with <tool_call>
{"name": <name>, "arguments": <args>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% for tc in message.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 8},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["tz"],
        "properties": {"tz": {"enum": ["UTC", "CET", "PST"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_model(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tool-model") / "m"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOL_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    model_config = json.loads((folder / "config.json").read_text())
    model_config["max_position_embeddings"] = 2048  # the tools' JSON takes ~600 tokens of this tiny tokenizer
    (folder / "config.json").write_text(json.dumps(model_config))
    return folder


@pytest.fixture(scope="module")
def tool_server(tool_model):
    srv = ServerThread(tool_model, engine_kwargs={"max_model_len": 2048, "num_kv_blocks": 640}).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(tool_server):
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused")


def _valid(name, arguments):
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_returns_valid_calls_of_the_given_tools(client):
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MSG, tools=TOOLS, tool_choice="required",
                                          n=3, seed=4, temperature=1.0, max_tokens=200)
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            _valid(call.function.name, call.function.arguments)


def test_a_named_function_is_the_one_called_once(client):
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MSG, tools=TOOLS, max_tokens=200,
                                          tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = resp.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    _valid("get_time", calls[0].function.arguments)


def test_required_streams_openai_tool_call_deltas(client):
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=MSG, tools=TOOLS, tool_choice="required",
                                                stream=True, seed=8, temperature=1.0, max_tokens=200):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.id or call["id"]
                call["name"] += (tc.function.name or "") if tc.function else ""
                call["arguments"] += (tc.function.arguments or "") if tc.function else ""
    assert finish == "tool_calls" and calls
    for call in calls.values():
        assert call["id"].startswith("call_")
        _valid(call["name"], call["arguments"])


def test_parallel_tool_calls_false_gives_one_call(client):
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MSG, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, n=3, seed=1, temperature=1.0, max_tokens=200)
    assert all(len(c.message.tool_calls) == 1 for c in resp.choices)


FORCED = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_what_the_model_wrote(client, stream):
    # The tiny random model never calls a tool by itself: a regex makes it write a call, which auto must parse.
    kw = dict(model=MODEL_NAME, messages=MSG, tools=TOOLS, tool_choice="auto", max_tokens=200,
              extra_body={"guided_regex": FORCED.replace("{", "\\{").replace("}", "\\}").replace(".", "\\.")})
    if not stream:
        msg = client.chat.completions.create(**kw).choices[0].message
        content, calls = msg.content, [(c.function.name, c.function.arguments) for c in msg.tool_calls]
    else:
        content, parts = "", {}
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                content += c.delta.content or ""
                for tc in c.delta.tool_calls or []:
                    entry = parts.setdefault(tc.index, ["", ""])
                    entry[0] += tc.function.name or ""
                    entry[1] += tc.function.arguments or ""
        calls = [tuple(v) for v in parts.values()]
    assert content.strip() == "Let me check."
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris", "days": 2})]


def test_tool_results_go_back_into_the_conversation(client, tool_server):
    history = [*MSG, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]
    resp = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, max_tokens=4)
    assert resp.usage.prompt_tokens > 0
    from kubellm.runtime.server.protocol import ChatCompletionRequest
    from kubellm.runtime.text.tool_calls import template_messages

    req = ChatCompletionRequest.model_validate({"messages": history})
    text = tool_server.state.tokenizer.apply_chat_template(template_messages(req.messages), tools=TOOLS)
    # the arguments were handed to the template as an object (tojson), not as a quoted string
    assert '"arguments": {"city": "Paris", "days": 2}' in text and "sunny, 21C" in text and '"get_time"' in text


@pytest.mark.parametrize("body, needle", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tools": TOOLS + TOOLS[:1]}, "unique"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tool_choice": "required"}, "needs `tools`"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "tool_calls"),
])
def test_bad_tool_requests_are_400s(tool_server, body, needle):
    resp = httpx.post(tool_server.url + "/v1/chat/completions", json={"messages": MSG, **body}, timeout=30)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert needle in err["message"] or needle == err["param"], err


def test_a_model_whose_template_has_no_tools_refuses_auto(server):
    resp = httpx.post(server.url + "/v1/chat/completions", json={"messages": MSG, "tools": TOOLS}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "tools_unsupported"
    ok = httpx.post(server.url + "/v1/chat/completions", json={"messages": MSG, "tools": TOOLS,
                                                                "tool_choice": "none", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_model_whose_template_has_no_tools_serves_constrained_calls(server, choice):
    # The grammar writes the call, so the model needs no sight of the definitions to make a valid one.
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MSG, tools=TOOLS, tool_choice=choice,
                                          parallel_tool_calls=False, seed=3, temperature=1.0, max_tokens=300)
    choice_ = resp.choices[0]
    assert choice_.finish_reason == "tool_calls" and choice_.message.content is None, choice_
    [call] = choice_.message.tool_calls
    assert choice == "required" or call.function.name == "get_weather"
    _valid(call.function.name, call.function.arguments)


def _streamed_calls(stream) -> tuple[dict[int, dict], str | None, str]:
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                call["name"] += (tc.function.name or "") if tc.function else ""
                call["arguments"] += (tc.function.arguments or "") if tc.function else ""
    return calls, finish, content


@pytest.mark.parametrize("fraction", [0.1, 0.4, 0.8])
def test_a_call_cut_by_max_tokens_is_the_same_cut_call_streamed_or_not(client, fraction):
    kwargs = dict(model=MODEL_NAME, messages=MSG, tools=TOOLS, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kwargs, max_tokens=300)
    assert whole.choices[0].finish_reason == "tool_calls"
    kwargs["max_tokens"] = max(1, int(whole.usage.completion_tokens * fraction))
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.content  # never the raw <tool_call> markup
    [call] = choice.message.tool_calls
    assert "get_weather".startswith(call.function.name)
    assert "<tool_call>" not in call.function.arguments
    calls, finish, content = _streamed_calls(client.chat.completions.create(**kwargs, stream=True))
    assert finish == "length" and not content
    assert calls == {0: {"name": call.function.name, "arguments": call.function.arguments}}
