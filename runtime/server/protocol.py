"""OpenAI request/response shapes (plus the vLLM extensions benchmark tools send).

Requests are validated by pydantic; anything malformed becomes a 400 with an OpenAI-style error
body (see errors.py). Field policy (docs/api.md): a field that would change the output and that this server
does not implement is refused with a 400 naming it (as OpenAI refuses unrecognized arguments), so a client
never gets free text where it asked for something else. Only fields in ``IGNORED_FIELDS`` (bookkeeping that
cannot change the output) are accepted and ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from kubellm.runtime.sampling.params import MAX_LOGPROBS, SamplingParams
from kubellm.runtime.sampling.structured_output import GuidedDecoding
from kubellm.runtime.text.tokenizer import TEMPLATE_VARIABLES

MAX_N = 16
MAX_MESSAGES = 4096  # per chat request; more is a bug or an attack, not a conversation

# Accepted and ignored: they label or route a request and cannot change what is generated.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})


class UnsupportedField(ValueError):
    """A request field this server does not implement; the 400 names it."""

    def __init__(self, name: str):
        super().__init__(f"unsupported field `{name}`: kubellm does not implement it, so it would be silently "
                         "ignored; remove it from the request (see docs/api.md for the supported fields)")
        self.param = name


def _refuse_unknown(model: type[BaseModel], data: Any) -> Any:
    if isinstance(data, dict):
        for key in data:
            if key not in model.model_fields and key not in IGNORED_FIELDS:
                raise UnsupportedField(key)
    return data


class StreamOptions(BaseModel):
    include_usage: bool = False  # a last chunk with the request's usage
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # the output always follows the schema here, strict or not


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of these."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


def _template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """chat_template_kwargs may add template variables, not replace the ones the server sets."""
    if clash := sorted((TEMPLATE_VARIABLES | {"tools"}) & (kwargs or {}).keys()):
        raise ValueError(f"may not set {', '.join(clash)}: the server sets them from the request "
                         "(use the request's own fields: messages, add_generation_prompt, tools)")
    return kwargs


def _schema(value, param: str):
    """A JSON schema given as an object, or as JSON text (vLLM accepts both)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{param} is not valid JSON: {e.msg}") from e
    return value


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown keys are refused before validation (_refuse)
    _guided: GuidedDecoding | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data):
        return _refuse_unknown(cls, data)

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: int | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None  # torch takes 64 bits (seed + n - 1)
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    user: str | None = None
    # vLLM extensions
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    skip_special_tokens: bool = True
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: there is one backend (llguidance)

    @model_validator(mode="after")
    def _one_constraint(self):
        self._guided = None
        found = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(GuidedDecoding("json_object", None, "response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise ValueError("response_format.json_schema is required when type is json_schema")
            found.append(GuidedDecoding("json", rf.json_schema.schema_, "response_format.json_schema.schema"))
        so = self.structured_outputs
        if so is not None:
            given = {k: v for k, v in so.model_dump(by_alias=True).items() if v not in (None, False)}
            if len(given) != 1:
                raise ValueError("structured_outputs needs exactly one of json, json_object, regex, choice, grammar")
            (key, value), = given.items()
            kind = {"json": "json", "json_object": "json_object", "regex": "regex", "choice": "choice",
                    "grammar": "grammar"}[key]
            param = f"structured_outputs.{key}"
            found.append(GuidedDecoding(kind, _schema(value, param) if kind == "json" else
                                        (None if kind == "json_object" else value), param))
        for field_name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                                 ("guided_grammar", "grammar")):
            value = getattr(self, field_name)
            if value is not None:
                found.append(GuidedDecoding(kind, _schema(value, field_name) if kind == "json" else value,
                                            field_name))
        if len(found) > 1:
            raise ValueError("give one output constraint: " + ", ".join(g.param for g in found) + " were all set")
        self._guided = found[0] if found else None
        return self

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v):
        for key in v or {}:
            if not key.strip().isdigit():
                raise ValueError(f"keys must be token ids as strings, got {key!r}")
        return v

    def logprobs_k(self) -> int | None:
        """Top log-probabilities per generated token (None: no logprobs)."""
        return None

    def prompt_logprobs_k(self) -> int | None:
        return None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop sequences")
        return v

    def sampling_params(self, max_tokens: int | None, default_max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
            min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k in (None, 0) else self.top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=[s for s in stop if s],
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=self.logprobs_k(),
            prompt_logprobs=self.prompt_logprobs_k(),
            guided=self._guided,
            logit_bias={int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False  # the prompt is returned before the completion
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    def logprobs_k(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_k(self) -> int | None:
        return self.logprobs if self.echo else None  # echo + logprobs: what eval harnesses score prompts with

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # JSON text


class ToolCallIn(BaseModel):
    """A call an earlier assistant turn made, sent back in the conversation."""

    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # arguments always follow the schema under tool_choice required/named


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: which call this answers

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data):
        return _refuse_unknown(cls, data)

    @model_validator(mode="after")
    def _needs_content(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a `{self.role}` message needs `content`")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a `tool` message needs `tool_call_id`")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only `assistant` messages carry `tool_calls`")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # default: auto with tools
    parallel_tool_calls: bool = True

    _check_template_kwargs = field_validator("chat_template_kwargs")(_template_kwargs)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names `{self.tool_choice.function.name}`, which is not in `tools`")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice `required` needs `tools`")
        return self

    @property
    def tool_mode(self) -> str:
        """none | auto | required | named."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def called_tools(self) -> list[dict]:
        """The tools a constrained call may use, as the template and the grammar read them."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []]
        if isinstance(self.tool_choice, NamedToolChoice):
            tools = [t for t in tools if t["function"]["name"] == self.tool_choice.function.name]
        return tools

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = None
    return_token_strs: bool = False

    _check_template_kwargs = field_validator("chat_template_kwargs")(_template_kwargs)

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either `prompt` or `messages`")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
