"""The operator's docs stay true to the code: docs/crd-reference.md is the generated reference, and
docs/operations.md explains every condition reason and Event reason the operator can write.

The reasons are not listed by hand here: they are read out of the operator's modules (string literals in the
places a reason is written, followed through the helpers they are passed to), so a new reason in the code fails
this test until the operations guide explains it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from kubellm.operator import api
from kubellm.operator.crd import reference
from kubellm.operator.crd import schema as crd
from kubellm.operator.status import observe as status_mod

ROOT = Path(__file__).resolve().parents[2]
REFERENCE_FILE = ROOT / "docs" / "crd-reference.md"
OPERATIONS_FILE = ROOT / "docs" / "operations.md"
OPERATOR_DIR = ROOT / "operator"
_REASON = re.compile(r"^[A-Z][A-Za-z0-9]*$")  # CamelCase, as condition reasons must be


# --------------------------------------------------------------------------------------------------
# The generated reference
# --------------------------------------------------------------------------------------------------


def test_committed_reference_is_up_to_date():
    assert REFERENCE_FILE.exists(), "docs/crd-reference.md is missing: run `make crds`"
    assert REFERENCE_FILE.read_text() == reference.render_reference(), (
        "docs/crd-reference.md is stale: run `make crds` (or `kubellm crd --reference -o docs/crd-reference.md`) "
        "and commit the result"
    )


def _leaf_paths(node: dict, path: str) -> list[str]:
    out = []
    for name, child in (node.get("properties") or {}).items():
        out.append(f"{path}.{name}")
        out += _leaf_paths(child, f"{path}.{name}")
        if isinstance(child.get("items"), dict):
            out += _leaf_paths(child["items"], f"{path}.{name}[]")
    return out


def test_reference_lists_every_field_of_the_crd_schema():
    schema = crd.crd_schema()
    text = reference.render_reference()
    paths = _leaf_paths(schema["properties"]["spec"], "spec") + _leaf_paths(
        schema["properties"]["status"], "status"
    )
    assert len(paths) > 60
    missing = [p for p in paths if f"| `{p}` |" not in text]
    assert not missing, f"fields without a row: {missing}"


def test_reference_states_every_rule_with_its_message():
    text = reference.render_reference()
    rules = [r for model_rules in api.all_rules().values() for r in model_rules]
    assert len(rules) >= 10
    for rule in rules:
        assert f"rule: `{rule.rule}`" in text
        assert reference._text(rule.message) in text
        if rule.message_expression:
            assert rule.message_expression in text


def test_reference_names_every_printer_column_and_condition_type():
    text = reference.render_reference()
    for col in crd.PRINTER_COLUMNS:
        assert f"| {col['name'].upper()} |" in text and col["jsonPath"] in text
    for ctype in api.ConditionType:
        assert f"| `{ctype.value}` |" in text
    assert all(meaning for _, meaning in reference.condition_types()), "every ConditionType needs a # comment"


def test_reference_shows_defaults_and_required_fields():
    text = reference.render_reference()
    assert "| `spec.model` | `object` | **required** |" in text
    assert "| `spec.engine.maxNumSeqs` | `integer` | `256` | >= 1 |" in text
    assert f"| `spec.image` | `string` | `{api.DEFAULT_IMAGE}` |" in text
    assert "| `spec.engine.kvCacheMemoryFraction` | `number` | `0.9` | > 0; <= 1 |" in text


@pytest.mark.parametrize(
    ("node", "expected"),
    [
        ({"type": "string"}, "string"),
        ({"type": "array", "items": {"type": "object", "properties": {}}}, "[]object"),
        ({"type": "object", "additionalProperties": {"type": "string"}}, "map[string]string"),
        ({"type": "object", "x-kubernetes-preserve-unknown-fields": True}, "object (free-form)"),
        (
            {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True},
            "int or string",
        ),
        ({"type": "string", "format": "date-time"}, "string (date-time)"),
    ],
)
def test_type_names(node, expected):
    assert reference.type_name(node) == expected


def test_table_text_escapes_pipes_and_tag_like_brackets():
    assert reference._text("a | b <org> 0 < x") == "a \\| b &lt;org> 0 < x"


def test_main_writes_the_reference(tmp_path, capsys):
    out = tmp_path / "ref.md"
    assert reference.main(["-o", str(out)]) == 0
    assert out.read_text() == reference.render_reference()
    assert reference.main([]) == 0
    assert capsys.readouterr().out == reference.render_reference()


def test_kubellm_crd_reference_flag_writes_the_reference_and_plain_crd_still_writes_yaml(tmp_path):
    from kubellm.runtime import cli

    ref, crd_file = tmp_path / "ref.md", tmp_path / "crd.yaml"
    assert cli.main(["crd", "--reference", "-o", str(ref)]) == 0
    assert ref.read_text() == reference.render_reference()
    assert cli.main(["crd", "-o", str(crd_file)]) == 0
    assert crd_file.read_text() == crd.render_crd_yaml()


# --------------------------------------------------------------------------------------------------
# Reasons the operator writes, read from its source
# --------------------------------------------------------------------------------------------------


def _strings(
    expr: ast.AST | None, assignments: dict[str, list[ast.AST]], seen: frozenset = frozenset()
) -> set[str]:
    """String literals ``expr`` can evaluate to: constants, both arms of ``a if c else b``, every operand of
    ``a or b``, and local variables through their assignments (``reason = x.get("reason") or "Default"``)."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return {expr.value}
    if isinstance(expr, ast.IfExp):
        return _strings(expr.body, assignments, seen) | _strings(expr.orelse, assignments, seen)
    if isinstance(expr, ast.BoolOp):
        return set().union(*(_strings(v, assignments, seen) for v in expr.values))
    if isinstance(expr, ast.Name) and expr.id not in seen:
        return set().union(
            *(_strings(v, assignments, seen | {expr.id}) for v in assignments.get(expr.id, ()))
        )
    return set()


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _is_condition_status(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "ConditionStatus"
    )


def _params(scope: ast.AST) -> list[str]:
    args = getattr(scope, "args", None)
    return [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)] if args else []


def _reason_args(node: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """``("condition" | "event", expression)`` for each reason ``node`` writes."""
    if isinstance(node, ast.Tuple) and len(node.elts) == 3 and _is_condition_status(node.elts[0]):
        yield "condition", node.elts[1]
    elif isinstance(node, ast.Call):
        name, args = _callee(node), node.args
        if name == "Problem" and args:
            yield "condition", args[0]
        elif name == "set_condition" and len(args) >= 3:
            yield "condition", args[2]
        elif name == "Event" and len(args) >= 2:
            yield "event", args[1]


def _argument(call: ast.Call, function: ast.AST, param: str) -> ast.AST | None:
    """The expression ``call`` passes for ``function``'s parameter ``param`` (None when it passes none)."""
    for keyword in call.keywords:
        if keyword.arg == param:
            return keyword.value
    positional = [a.arg for a in (*function.args.posonlyargs, *function.args.args)]
    index = positional.index(param) if param in positional else len(call.args)
    return call.args[index] if index < len(call.args) else None


def reasons_in_source(source: str) -> tuple[set[str], set[str]]:
    """``(condition reasons, event reasons)`` a module writes as literals.

    Condition reasons: the middle of every ``(ConditionStatus.X, reason, message)`` triple, the first argument
    of ``Problem(reason, message)`` (Degraded), the third of ``set_condition(type, status, reason, ...)``.
    Event reasons: the second argument of ``Event(type, reason, message)``. Only CamelCase strings count
    (a fallback message such as ``x.get("message") or "at the bounds"`` is not a reason). A reason that is a
    parameter of the function writing it (a helper such as ``fail(status, reason, message)``) is read from
    what the module's calls of that function pass for it."""
    found: dict[str, set[str]] = {"condition": set(), "event": set()}
    tree = ast.parse(source)
    scopes = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)] or [tree]
    functions = {s.name: s for s in scopes if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef)}
    local: dict[int, dict[str, list[ast.AST]]] = {}
    for scope in scopes:
        assignments = local[id(scope)] = {}
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        assignments.setdefault(target.id, []).append(node.value)

    # (function, parameter, kind): reasons that arrive as arguments, followed to every call of the function.
    passed: list[tuple[str, str, str]] = []
    for scope in scopes:
        params = _params(scope)
        for node in ast.walk(scope):
            for kind, expr in _reason_args(node):
                found[kind] |= _strings(expr, local[id(scope)])
                if isinstance(expr, ast.Name) and expr.id in params and expr.id not in local[id(scope)]:
                    passed.append((scope.name, expr.id, kind))
    done: set[tuple[str, str, str]] = set()
    while passed:
        function_name, param, kind = item = passed.pop()
        if item in done:
            continue
        done.add(item)
        for scope in scopes:
            params = _params(scope)
            for node in ast.walk(scope):
                if not (isinstance(node, ast.Call) and _callee(node) == function_name):
                    continue
                arg = _argument(node, functions[function_name], param)
                found[kind] |= _strings(arg, local[id(scope)])
                if isinstance(arg, ast.Name) and arg.id in params and arg.id not in local[id(scope)]:
                    passed.append((scope.name, arg.id, kind))  # passed on again by the caller's caller
    conditions, events = found["condition"], found["event"]
    return {r for r in conditions if _REASON.match(r)}, {r for r in events if _REASON.match(r)}


def operator_reasons() -> tuple[set[str], set[str]]:
    conditions: set[str] = set(status_mod.DEGRADING_WAITING_REASONS)  # Problem(reason, ...) with a variable
    events: set[str] = set()
    for module in sorted(OPERATOR_DIR.rglob("*.py")):  # status/observe.py writes them all today
        c, e = reasons_in_source(module.read_text())
        conditions |= c
        events |= e
    # A Warning Event accompanies every Degraded reason (status._degraded_events posts the condition's reason).
    events |= conditions & set(status_mod._SEVERITY)
    return conditions, events


def test_reason_extraction_follows_literals_variables_and_fallbacks():
    source = """
def f(x, hpa):
    reason = hpa.get("reason") or "DefaultReason"
    other = "Up" if x else "Down"
    a = (ConditionStatus.TRUE, "Literal", "a message")
    b = (ConditionStatus.FALSE, reason, "msg")
    c = (ConditionStatus.UNKNOWN, x.get("message") or "not a reason", "m")
    Problem("ProblemReason", "text")
    status.set_condition("Ready", False, "SetReason", "m")
    events = [Event("Normal", other, "m"), status_mod.Event("Warning", "WarnReason", "m")]
    untouched = ("Something", "Else")

def fail(status, reason, message, *, event=True):
    status.set_condition("Ready", False, reason, message)
    return [Event("Warning", reason, message)] if event else []

def warn(status, why):
    return fail(status, why, "m")

def g(status, ok):
    fail(status, "PassedReason", "m")
    fail(status, message="m", reason="KeywordReason")
    warn(status, "WarnedReason" if ok else "OtherWarnedReason")
    fail(status, "m", "not a reason either")
"""
    conditions, events = reasons_in_source(source)
    passed = {"PassedReason", "KeywordReason", "WarnedReason", "OtherWarnedReason"}
    assert conditions == {"DefaultReason", "Literal", "ProblemReason", "SetReason"} | passed
    assert events == {"Up", "Down", "WarnReason"} | passed


def test_reason_extraction_finds_the_operators_reasons():
    conditions, events = operator_reasons()
    # A sample of each way a reason is written; if one goes missing the extractor has stopped working.
    assert {"Available", "NoReadyReplicas", "Complete", "Healthy", "Loaded", "PodsTerminating"} <= conditions
    assert {"OOMKilled", "ReadinessProbeFailing", "Unschedulable", "ImagePullBackOff"} <= conditions
    assert {"ValidMetricFound", "NotAbleToScale", "AutoscalerMissing", "AutoscalingDisabled"} <= conditions
    assert {"RolloutStarted", "RolloutComplete", "ScaledUp", "ScaledDown", "ModelLoaded"} <= events
    assert {"AutoscalingBlocked", "InvalidSpec", "ReconcileFailed", "OOMKilled"} <= events
    assert len(conditions) >= 30


def test_operations_guide_explains_every_condition_reason_and_event_reason():
    text = OPERATIONS_FILE.read_text()
    conditions, events = operator_reasons()
    missing_conditions = sorted(r for r in conditions if f"`{r}`" not in text)
    missing_events = sorted(r for r in events if f"`{r}`" not in text)
    assert not missing_conditions, (
        f"docs/operations.md does not mention condition reasons {missing_conditions}"
    )
    assert not missing_events, f"docs/operations.md does not mention Event reasons {missing_events}"


def test_operations_guide_names_every_condition_type_and_runtime_metric():
    text = OPERATIONS_FILE.read_text()
    for ctype in api.ConditionType:
        assert f"`{ctype.value}`" in text
    metrics_doc = (ROOT / "docs" / "metrics.md").read_text()
    metrics = set(re.findall(r"`(kubellm:[a-z_]+)", metrics_doc))
    assert len(metrics) >= 15
    missing = sorted(m for m in metrics if m not in text)
    assert not missing, f"docs/operations.md does not summarise metrics {missing}"
