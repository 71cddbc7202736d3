"""Structured outputs: every output matches its schema / regex / choice / grammar, whatever the sampling,
through preemption, beside unconstrained rows that stay exactly as they would be alone."""

from __future__ import annotations

import json
import re

import jsonschema
import lark
import pytest

from kubellm.runtime.engine.llm_engine import LLM
from kubellm.runtime.sampling.params import SamplingParams
from kubellm.runtime.sampling.structured_output import GuidedDecoding, InvalidGuidedDecoding

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "color", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}}
LARK = 'start: "(" NUMBER ("+" NUMBER)* ")"\n%import common.NUMBER\n'
GBNF = 'root ::= "[" digit digit? "]"\ndigit ::= [0-9]\n'
CHOICES = ["yes", "no", "maybe so"]
REGEX = r"[a-z]{2,4}-\d{2}"


def _check(spec: GuidedDecoding, text: str) -> None:
    if spec.kind == "json":
        jsonschema.validate(json.loads(text), spec.value)
    elif spec.kind == "choice":
        assert text in spec.value
    elif spec.kind == "regex":
        assert re.fullmatch(spec.value, text), text
    elif spec.value == LARK:
        lark.Lark(LARK).parse(text)
    else:
        assert re.fullmatch(r"\[[0-9]{1,2}\]", text), text


SPECS = [GuidedDecoding("json", SCHEMA), GuidedDecoding("choice", CHOICES), GuidedDecoding("regex", REGEX),
         GuidedDecoding("grammar", LARK), GuidedDecoding("grammar", GBNF)]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    # A small pool and budget: sequences get preempted and recomputed mid-grammar.
    return LLM(str(tiny_llama), progress=False, dtype="float32", block_size=4, max_num_batched_tokens=32,
               max_num_seqs=8, num_kv_blocks=40, max_model_len=256)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}")
def test_every_sampled_output_matches_its_constraint(llm, spec):
    params = [SamplingParams(temperature=1.2, seed=i, max_tokens=120, guided=spec) for i in range(6)]
    outs = llm.generate(["Give me data", "x" * 40, "Hello"] * 2, params, use_tqdm=False)
    for out in outs:
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        _check(spec, out.text)
    assert llm.engine.block_manager.num_used_blocks == 0
    assert llm.engine.scheduler.num_preemptions > 0, "no preemption: recompute mid-grammar went untested"


def test_greedy_constrained_rows_leave_unconstrained_neighbours_untouched(llm):
    free = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = llm.generate(["Once upon", "The cat"], free, use_tqdm=False)
    mixed = llm.generate(["Once upon", "Give", "The cat", "Data"],
                         [free, SamplingParams(temperature=0.0, max_tokens=60, guided=SPECS[0]), free,
                          SamplingParams(temperature=0.0, max_tokens=10, guided=SPECS[1])], use_tqdm=False)
    assert [mixed[0].token_ids, mixed[2].token_ids] == [alone[0].token_ids, alone[1].token_ids]
    _check(SPECS[0], mixed[1].text)
    _check(SPECS[1], mixed[3].text)


def test_truncation_by_max_tokens_or_a_stop_string_leaves_a_valid_prefix(llm):
    spec = GuidedDecoding("json_object")
    out = llm.generate(["x"], SamplingParams(temperature=1.0, seed=3, max_tokens=5, guided=spec), use_tqdm=False)[0]
    assert out.finish_reason == "length" and out.text.startswith("{")
    matcher = llm.engine.structured_outputs.matcher(spec)
    assert matcher.consume_tokens(out.token_ids) and not matcher.is_error()  # a prefix the grammar accepts
    stop = llm.generate(["x"], SamplingParams(temperature=0.0, max_tokens=120, guided=SPECS[0], stop=[","]),
                        use_tqdm=False)[0]
    assert stop.finish_reason == "stop" and stop.stop_reason == "," and stop.text.startswith('{"name":')


@pytest.mark.parametrize("spec, needle", [
    (GuidedDecoding("regex", "[a-z", "guided_regex"), "unclosed character class"),
    (GuidedDecoding("json", {"type": "nonsense"}, "response_format"), "nonsense"),
    (GuidedDecoding("json", "not a schema", "guided_json"), "must be an object"),
    (GuidedDecoding("grammar", "start: (", "guided_grammar"), "guided_grammar"),
    (GuidedDecoding("choice", [], "guided_choice"), "non-empty list"),
])
def test_a_spec_that_does_not_compile_is_refused_before_queueing(llm, spec, needle):
    with pytest.raises(InvalidGuidedDecoding) as e:
        llm.engine.add_request([5, 6, 7], SamplingParams(guided=spec))
    assert e.value.param == spec.param and needle in str(e.value)
    assert not llm.engine.has_unfinished_requests()
