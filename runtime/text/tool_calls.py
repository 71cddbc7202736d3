"""Tool calling: tools go into the chat template, the model's tool-call syntax comes back as OpenAI tool_calls.

A model family writes calls in its own syntax; three are supported, chosen from the chat template (or by
``--tool-call-parser``):

- ``hermes`` (Hermes, Qwen 2.5/3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, repeated;
- ``llama3_json`` (Llama 3.1-3.3): ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``,
  several separated by ``;``);
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (or ``[TOOL_CALLS]name[ARGS]{...}``).

``tool_choice``: ``auto`` lets the model choose and parses what it wrote; ``required`` and a named function
are enforced with the grammar engine (the output can only be well-formed calls of the given tools, their
arguments valid against each tool's schema); ``none`` renders no tools and parses nothing.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from kubellm.runtime.sampling.structured_output import JSON_OPTIONS, GuidedDecoding

PARSERS = ("hermes", "llama3_json", "mistral")


class ToolCallingUnavailable(ValueError):
    """The model's chat template cannot take tools, or its call syntax is unknown."""


def detect_parser(chat_template: str | None) -> str | None:
    """The call syntax a chat template teaches, or None."""
    t = chat_template or ""
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or ("ipython" in t and "parameters" in t):
        return "llama3_json"
    return None


def choose_parser(configured: str, chat_template: str | None, constrained: bool = False) -> str:
    """``configured`` ('auto' or a parser name) resolved against the template; raises ToolCallingUnavailable.

    ``constrained`` (tool_choice required or named): the grammar writes the calls, so any syntax serves, even
    where the template cannot show the model the tools (it then calls them without having seen their
    definitions, as vLLM does): the template's syntax if it teaches one, else hermes.
    """
    if constrained:
        return configured if configured != "auto" else detect_parser(chat_template) or "hermes"
    if not chat_template or "tools" not in chat_template:
        raise ToolCallingUnavailable("this model's chat template does not render tools, so it cannot call them")
    if configured != "auto":
        return configured
    found = detect_parser(chat_template)
    if found is None:
        raise ToolCallingUnavailable("this model's chat template uses a tool-call syntax kubellm does not recognise; "
                                     f"start the server with --tool-call-parser ({', '.join(PARSERS)})")
    return found


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


# ---- constraining grammar (tool_choice required / named) --------------------------------------------
def call_schema(tools: list[dict], parser: str) -> dict:
    """One call of any of ``tools`` as a JSON schema, in the parser's key names."""
    args_key = "parameters" if parser == "llama3_json" else "arguments"
    options = [{"type": "object", "additionalProperties": False, "required": ["name", args_key],
                "properties": {"name": {"const": t["function"]["name"]},
                               args_key: t["function"].get("parameters") or {"type": "object"}}}
               for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def required_grammar(tools: list[dict], parser: str, parallel: bool) -> GuidedDecoding:
    """A grammar whose every sentence is one call (or several, with ``parallel``) of ``tools``."""
    schema = {**call_schema(tools, parser), "x-guidance": JSON_OPTIONS}
    body = "%json " + json.dumps(schema, separators=(",", ":"))
    if parser == "mistral":
        array = {"type": "array", "items": call_schema(tools, parser), "minItems": 1,
                 **({} if parallel else {"maxItems": 1}), "x-guidance": JSON_OPTIONS}
        lark = f'start: "[TOOL_CALLS]" calls\ncalls: %json {json.dumps(array, separators=(",", ":"))}\n'
    elif parser == "llama3_json":
        more = ' ("; " call)*' if parallel else ""
        lark = f"start: call{more}\ncall: {body}\n"
    else:
        more = ' ("\\n" call)*' if parallel else ""
        lark = f'start: call{more}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: {body}\n'
    return GuidedDecoding("lark", lark, "tools")


# ---- parsing ----------------------------------------------------------------------------------------
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}


def _call_from(obj, args_keys=("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _json_values(text: str, sep: str = ";") -> tuple[list, str]:
    """Consecutive JSON values in ``text`` (separated by whitespace or ``sep``) and what could not be read."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == sep):
            i += 1
        if i >= len(text):
            return values, ""
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return values, text[i:]
        values.append(value)


def parse_calls(parser: str, text: str, final: bool = True) -> tuple[str | None, list[ToolCall], bool]:
    """Split model output into (content, complete calls, whether a call syntax started).

    ``final=False`` (streaming) returns only calls that can no longer change.
    """
    if parser == "llama3_json":
        body = text.lstrip()
        body = body.removeprefix("<|python_tag|>")
        if not body.startswith("{"):
            return text, [], False
        values, rest = _json_values(body)
        calls = [c for v in values if (c := _call_from(v)) is not None]
        if not final and rest:
            return None, calls, True
        if len(calls) != len(values) or (final and rest.strip()):
            return (text, [], False) if final else (None, calls, True)  # not tool calls after all
        return None, calls, True
    marker = _MARKERS[parser]
    start = text.find(marker)
    if start < 0:
        return text, [], False
    content = text[:start].strip() or None
    tail = text[start:]
    if parser == "hermes":
        calls = [c for m in _HERMES.finditer(tail) if (c := _call_from(_loads(m.group(1)))) is not None]
        if final:  # an unclosed last call (stopped by max_tokens or EOS) still counts when its JSON is whole
            last = tail.rfind("<tool_call>")
            if last >= 0 and "</tool_call>" not in tail[last:]:
                c = _call_from(_loads(tail[last + len("<tool_call>"):].strip()))
                calls += [c] if c else []
        return content, calls, True
    # mistral
    rest = tail[len(marker):]
    values, _ = _json_values(rest)
    if values and isinstance(values[0], list):
        calls = [c for v in values[0] if (c := _call_from(v)) is not None]
        return content, calls, True
    calls = []
    for m in re.finditer(r"\[TOOL_CALLS\]\s*([\w.-]+)\[ARGS\]", tail):
        vals, _ = _json_values(tail[m.end():])
        if vals:
            calls.append(ToolCall(m.group(1), json.dumps(vals[0], ensure_ascii=False)))
    return content, calls if final or calls else [], True


_CUT_CALL = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)(?:"\s*,\s*"(?:arguments|parameters)"\s*:\s*(.*))?',
                       re.DOTALL)


def cut_calls(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of ``text``, output stopped by max_tokens: the complete calls, then the one it cut short
    if a call was under way (its name and its arguments' JSON as far as they were written, maybe nothing yet,
    not even the whole call marker)."""
    marker = _MARKERS.get(parser)
    if marker is not None and marker not in text:  # cut inside the marker itself?
        stripped = text.rstrip()
        k = next((k for k in range(len(marker) - 1, 0, -1) if stripped.endswith(marker[:k])), 0)
        if not k:
            return text, []
        return stripped[:-k].strip() or None, [ToolCall("", "")]
    content = None
    if parser == "hermes":
        content, calls, _ = parse_calls(parser, text)
        start = text.rfind("<tool_call>")
        under_way = "</tool_call>" not in text[start:]
        unfinished = text[start + len("<tool_call>"):].strip() if under_way else ""
        under_way = under_way and _loads(unfinished) is None  # else parse_calls took it as complete
    elif parser == "llama3_json":
        values, unfinished = _json_values(text.lstrip().removeprefix("<|python_tag|>"))
        calls = [c for v in values if (c := _call_from(v)) is not None]
        under_way = unfinished.startswith("{")
        if not calls and not under_way:
            return text, []
    else:
        start = text.find("[TOOL_CALLS]")
        content, body = text[:start].strip() or None, text[start + len("[TOOL_CALLS]"):].lstrip()
        if not body.startswith("[") and (named := list(re.finditer(r"\[TOOL_CALLS\]\s*([\w.-]+)\[ARGS\]", text))):
            calls = parse_calls(parser, text)[1]  # the name[ARGS]{...} form
            if len(calls) < len(named):
                calls.append(ToolCall(named[-1].group(1), text[named[-1].end():]))
            return content, calls
        values, unfinished = _json_values(body[1:], sep=",") if body else ([], "")
        calls = [c for v in values if (c := _call_from(v)) is not None]
        under_way = not unfinished.startswith("]")
    if under_way:
        m = _CUT_CALL.match(unfinished)
        calls.append(ToolCall(m.group(1), m.group(2) or "") if m else ToolCall("", ""))
    return content, calls


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


class ToolCallStream:
    """Turns one choice's streamed text into OpenAI deltas: content while it is prose, then one delta per call
    (its id, name and arguments) as soon as the call is complete. Text that may begin the call syntax is held
    back until it is clear."""

    def __init__(self, parser: str):
        self.parser = parser
        self.text = ""
        self.sent_content = 0  # chars of self.text sent as content
        self.in_calls = False
        self.sent_calls = 0

    def feed(self, new_text: str, final: bool = False) -> list[dict]:
        self.text += new_text
        deltas = []
        if not self.in_calls:
            start = self._call_start()
            if start is None:  # prose: send all but what could still become the start of a call
                end = len(self.text) if final else self._safe_end()
                if end > self.sent_content:
                    deltas.append({"content": self.text[self.sent_content:end]})
                    self.sent_content = end
                return deltas
            if start > self.sent_content and self.text[self.sent_content:start].strip():
                deltas.append({"content": self.text[self.sent_content:start]})
            self.sent_content = start
            self.in_calls = True
        _, calls, _ = parse_calls(self.parser, self.text[self.sent_content:], final)
        for i, call in enumerate(calls[self.sent_calls:], start=self.sent_calls):
            deltas += _call_deltas(i, call)
        self.sent_calls = max(self.sent_calls, len(calls))
        return deltas

    def cut(self, new_text: str) -> list[dict]:
        """The last feed when max_tokens stopped the output: a call it cut short still comes out as a call, even
        when only the start of its marker (held back so far) was written."""
        deltas = self.feed(new_text)
        _, calls = cut_calls(self.parser, self.text[self.sent_content:])
        if not calls:
            return deltas + self.feed("", final=True)
        self.in_calls = True
        for i, call in enumerate(calls[self.sent_calls:], start=self.sent_calls):
            deltas += _call_deltas(i, call)
        self.sent_calls = max(self.sent_calls, len(calls))
        return deltas

    @property
    def called(self) -> bool:
        return self.sent_calls > 0

    def _call_start(self) -> int | None:
        if self.parser == "llama3_json":
            stripped = self.text.lstrip()
            if not stripped:
                return None
            return len(self.text) - len(stripped) if stripped[0] in "{<" else None
        i = self.text.find(_MARKERS[self.parser])
        return i if i >= 0 else None

    def _safe_end(self) -> int:
        if self.parser == "llama3_json":
            return len(self.text) if self.text.strip() else self.sent_content
        marker = _MARKERS[self.parser]
        for k in range(min(len(marker) - 1, len(self.text)), 0, -1):
            if marker.startswith(self.text[-k:]):
                return len(self.text) - k
        return len(self.text)


def _call_deltas(index: int, call: ToolCall) -> list[dict]:
    """A call as OpenAI streams it: its id and name, then its arguments."""
    return [{"tool_calls": [{"index": index, "id": call.id, "type": "function",
                             "function": {"name": call.name, "arguments": ""}}]},
            {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]


def template_messages(messages: list) -> list[dict]:
    """Messages as chat templates read them: tool-call arguments as objects (templates `tojson` them)."""
    out = []
    for m in messages:
        d = {"role": m.role, "content": m.text() if m.content is not None else None}
        if m.name:
            d["name"] = m.name
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _loads(c.function.arguments)
                                             if _loads(c.function.arguments) is not None else c.function.arguments}}
                               for c in m.tool_calls]
        out.append(d)
    return out
