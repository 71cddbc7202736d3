"""Generate docs/crd-reference.md, the LLMDeployment API reference, from the schema the CRD carries.

``kubellm crd --reference`` prints it, ``-o PATH`` writes it, and ``make crds`` regenerates the committed
copy (tests/operator/test_crd_reference.py fails when it drifts). Every field, type, default, bound,
description and CEL rule comes from :func:`kubellm.operator.crd.schema.build_crd`, which comes from the pydantic
models in :mod:`kubellm.operator.api`; the condition types come from :class:`api.ConditionType` and their
one-line comments. Only headings and the notes on reading the tables are written here.
"""

from __future__ import annotations

import argparse
import inspect
import io
import json
import re
import sys
import tokenize
from collections.abc import Iterator
from typing import Any

from kubellm.operator import api
from kubellm.operator.crd import schema

TITLE = "LLMDeployment API reference"
GENERATED_NOTE = (
    "<!-- Generated from operator/api/ by `kubellm crd --reference` (make crds); do not edit by hand. -->"
)


# --------------------------------------------------------------------------------------------------
# Markdown helpers
# --------------------------------------------------------------------------------------------------


def _text(text: str) -> str:
    """Prose for Markdown: one line, pipes escaped (tables), ``<name>`` shown rather than taken as an HTML tag."""
    text = " ".join(text.split())
    return re.sub(r"<(?=[A-Za-z/!?])", "&lt;", text.replace("|", "\\|"))


def _code(text: str) -> str:
    """Inline code for a table cell (GitHub tables need pipes escaped even inside code spans)."""
    text = str(text).replace("|", "\\|")
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _anchor(path: str) -> str:
    """The anchor GitHub gives the heading ``## `path` ``: lower case, punctuation other than - and _ dropped."""
    return re.sub(r"[^a-z0-9_\- ]", "", path.lower()).replace(" ", "-")


# --------------------------------------------------------------------------------------------------
# Schema nodes → cells
# --------------------------------------------------------------------------------------------------


def _is_object(node: dict[str, Any]) -> bool:
    return node.get("type") == "object" and "properties" in node


def type_name(node: dict[str, Any]) -> str:
    """A short type for humans: ``string``, ``[]object``, ``map[string]string``, ``int or string``..."""
    if node.get("x-kubernetes-int-or-string"):
        return "int or string"
    kind = node.get("type")
    if kind == "array":
        return "[]" + type_name(node.get("items") or {})
    if kind == "object":
        if "properties" in node:
            return "object"
        if isinstance(node.get("additionalProperties"), dict):
            return "map[string]" + type_name(node["additionalProperties"])
        if node.get("x-kubernetes-preserve-unknown-fields"):
            return "object (free-form)"
        return "object"
    if node.get("format"):
        return f"{kind} ({node['format']})"
    return str(kind)


def default_cell(node: dict[str, Any], required: bool) -> str:
    if required:
        return "**required**"
    if "default" not in node:
        return "—"
    value = node["default"]
    if isinstance(value, str):
        return _code(value) if value else '`""`'
    return _code(json.dumps(value))


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def constraints_cell(node: dict[str, Any]) -> str:
    """Enum, bounds, lengths, patterns and list semantics, as the API server enforces them."""
    parts: list[str] = []
    if "enum" in node:
        parts.append("one of " + ", ".join(_code(v) for v in node["enum"]))
    low, high = node.get("minimum"), node.get("maximum")
    if node.get("x-kubernetes-int-or-string"):
        low = None  # the int branch's bound; the pattern below says the rest
    if low is not None:
        parts.append(f"{'>' if node.get('exclusiveMinimum') is True else '>='} {_number(low)}")
    if high is not None:
        parts.append(f"{'<' if node.get('exclusiveMaximum') is True else '<='} {_number(high)}")
    if "minLength" in node and "maxLength" in node:
        parts.append(f"length {node['minLength']}–{node['maxLength']}")
    elif "maxLength" in node:
        parts.append(f"length <= {node['maxLength']}")
    elif "minLength" in node:
        parts.append(f"length >= {node['minLength']}")
    pattern = node.get("pattern")
    if pattern == api.QUANTITY_PATTERN:
        parts.append("an integer or a Kubernetes quantity such as `500m`, `4` or `32Gi`")
    elif pattern == api.PERCENT_PATTERN:
        parts.append("an integer >= 0 or a percentage such as `25%`")
    elif pattern:
        parts.append("pattern " + _code(pattern))
    if "maxItems" in node:
        parts.append(f"at most {node['maxItems']} items")
    list_type = node.get("x-kubernetes-list-type")
    if list_type == "map":
        keys = ", ".join(node.get("x-kubernetes-list-map-keys") or ())
        parts.append(f"list keyed by `{keys}` (unique)")
    elif list_type:
        parts.append(f"{list_type} list (replaced as a whole on apply)")
    if node.get("x-kubernetes-preserve-unknown-fields"):
        parts.append("kept verbatim (not pruned)")
    return "; ".join(parts) or "—"


# --------------------------------------------------------------------------------------------------
# Walking the schema
# --------------------------------------------------------------------------------------------------


def object_sections(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(path, node)`` for every object with properties, depth first in field order (arrays as ``path[]``)."""
    if _is_object(node):
        yield path, node
        for name, child in node["properties"].items():
            yield from object_sections(child, f"{path}.{name}")
    elif node.get("type") == "array" and isinstance(node.get("items"), dict):
        yield from object_sections(node["items"], f"{path}[]")


def _child_object_path(child: dict[str, Any], path: str) -> str | None:
    if _is_object(child):
        return path
    if child.get("type") == "array" and _is_object(child.get("items") or {}):
        return f"{path}[]"
    return None


def _field_table(path: str, node: dict[str, Any]) -> list[str]:
    required = set(node.get("required") or ())
    lines = [
        "| Field | Type | Default | Constraints | Description |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, child in node["properties"].items():
        field = f"{path}.{name}"
        description = _text(child.get("description", ""))
        target = _child_object_path(child, field)
        if target is not None:
            description += f" See [`{target}`](#{_anchor(target)})."
        lines.append(
            f"| {_code(field)} | {_code(type_name(child))} | {default_cell(child, name in required)} | "
            f"{constraints_cell(child)} | {description.strip()} |"
        )
    return lines


def _rules(path: str, node: dict[str, Any]) -> list[str]:
    rules = node.get("x-kubernetes-validations") or []
    if not rules:
        return []
    lines = [
        "",
        "Validation rules (CEL, enforced by the API server; the operator checks the same in Python):",
        "",
    ]
    for rule in rules:
        where = path + rule.get("fieldPath", "")
        when = " (on updates only: compares with the stored object)" if "oldSelf" in rule["rule"] else ""
        lines.append(f"- `{where}`{when}: {_text(rule['message'])}")
        lines.append(f"  - rule: `{rule['rule']}`")
        if "messageExpression" in rule:
            lines.append(f"  - messageExpression (names the offending values): `{rule['messageExpression']}`")
    return lines


def _section(path: str, node: dict[str, Any]) -> list[str]:
    lines = [f"### `{path}`", ""]
    if node.get("description"):
        lines += [_text(node["description"]), ""]
    lines += _field_table(path, node)
    lines += _rules(path, node)
    return [*lines, ""]


# --------------------------------------------------------------------------------------------------
# Conditions and printer columns
# --------------------------------------------------------------------------------------------------


def condition_types() -> list[tuple[str, str]]:
    """``(type, meaning)`` for every :class:`api.ConditionType`, the meaning being its source comment."""
    source = inspect.getsource(api.ConditionType)
    comments: dict[str, str] = {}
    pending: str | None = None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.STRING and pending is None:
            pending = tok.string.strip("\"'")
        elif tok.type == tokenize.COMMENT and pending is not None:
            comments[pending] = tok.string.lstrip("# ").strip()
        if tok.type in (tokenize.NEWLINE, tokenize.NL):
            pending = None
    return [(t.value, comments.get(t.value, "")) for t in api.ConditionType]


def _printer_columns(columns: list[dict[str, Any]]) -> list[str]:
    lines = ["| Column | Type | JSONPath | Shown by |", "| --- | --- | --- | --- |"]
    for col in columns:
        shown = "`kubectl get -o wide`" if col.get("priority", 0) > 0 else "`kubectl get`"
        lines.append(f"| {col['name'].upper()} | {col['type']} | {_code(col['jsonPath'])} | {shown} |")
    return lines


# --------------------------------------------------------------------------------------------------
# The document
# --------------------------------------------------------------------------------------------------


def render_reference() -> str:
    """The whole Markdown reference (the text committed as docs/crd-reference.md)."""
    definition = schema.build_crd()
    names = definition["spec"]["names"]
    (version,) = definition["spec"]["versions"]
    root = version["schema"]["openAPIV3Schema"]
    scale = version["subresources"]["scale"]
    spec, status = root["properties"]["spec"], root["properties"]["status"]

    out: list[str] = [
        f"# {TITLE}",
        "",
        GENERATED_NOTE,
        "",
        "Generated from the pydantic models in `operator/api/` (the source of truth) by "
        "`kubellm crd --reference`; `make crds` regenerates it with the CRD, and a test fails when the two "
        "disagree. `kubectl explain llmdeployment.spec` prints the same descriptions from the installed CRD.",
        "",
        "| | |",
        "| --- | --- |",
        f"| API version | `{api.API_VERSION}` |",
        f"| Kind | `{names['kind']}` (list: `{names['listKind']}`) |",
        f"| Resource | `{names['plural']}` (singular `{names['singular']}`, short name "
        + ", ".join(f"`{n}`" for n in names["shortNames"])
        + ", category "
        + ", ".join(f"`{c}`" for c in names["categories"])
        + ") |",
        f"| Scope | {definition['spec']['scope']} |",
        f"| CRD | `{definition['metadata']['name']}` (`crds/{definition['metadata']['name']}.yaml`) |",
        "| Subresources | `status`; `scale` (spec replicas `{}`, status replicas `{}`, selector `{}`) |".format(
            scale["specReplicasPath"], scale["statusReplicasPath"], scale["labelSelectorPath"]
        ),
        "",
        _text(root.get("description", "")),
        "",
        "How to read the tables: **Default** is filled in by the API server when the field is absent "
        "(`kubectl get llmd NAME -o yaml` shows every defaulted field); an object defaulted to `{}` then "
        "receives its own fields' defaults. **required** fields must be given. **Constraints** are "
        "checked by the API server's schema validation before the operator sees the object. Cross-field "
        "rules are listed under the object they are attached to.",
        "",
        "## Contents",
        "",
        "- [Printer columns](#printer-columns)",
    ]
    spec_sections = list(object_sections(spec, "spec"))
    status_sections = list(object_sections(status, "status"))
    out += [f"- [`{p}`](#{_anchor(p)})" for p, _ in spec_sections]
    out += ["- [Checks the CRD cannot express](#checks-the-crd-cannot-express)"]
    out += [f"- [`{p}`](#{_anchor(p)})" for p, _ in status_sections]
    out += ["- [Condition types](#condition-types)", ""]

    out += ["## Printer columns", "", "`kubectl get llmd` shows:", ""]
    out += _printer_columns(version["additionalPrinterColumns"])
    out += [""]

    out += ["## Spec fields", ""]
    for path, node in spec_sections:
        out += _section(path, node)

    out += [
        "### Checks the CRD cannot express",
        "",
        "The operator refuses these specs itself. The API server accepts them, so they show up as "
        "`Ready=False` with reason `InvalidSpec` and a Warning Event, and the operator leaves the children "
        "as they were (see [operations.md](operations.md#invalidspec)):",
        "",
        "- `spec.env`: a name that appears more than once.",
        "- `spec.resources.limits.cpu` / `.memory` below the matching request.",
        "- `metadata.name` that is not a DNS subdomain name.",
        "- `spec.podLabels`, `spec.podAnnotations`, `spec.nodeSelector`: keys or values that are not valid "
        "label syntax; labels, the `kubellm.io/spec-hash` annotation or the `KUBELLM_CACHE` variable that the "
        "operator sets itself.",
        "- `spec.nodeSelector[nvidia.com/gpu.product]` that contradicts `spec.resources.gpu.product`.",
        "- `spec.model.uri`: a `pvc://` path with a `..` element, or a `file://` path under `/cache`, `/tmp` "
        "or `/dev/shm` (the pod mounts empty volumes there).",
        "",
    ]

    out += [
        "## Status fields",
        "",
        "Written by the operator through the status subresource; never set it yourself.",
        "",
    ]
    for path, node in status_sections:
        out += _section(path, node)

    out += [
        "### Condition types",
        "",
        "`status.conditions` holds one entry of each type. Their reasons, what each means and what to do "
        "about it are in [operations.md](operations.md#conditions).",
        "",
        "| Type | Meaning when True |",
        "| --- | --- |",
    ]
    out += [f"| `{t}` | {_text(meaning)} |" for t, meaning in condition_types()]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kubellm crd --reference", description="Print the LLMDeployment API reference (Markdown)."
    )
    parser.add_argument("-o", "--output", help="write to this file instead of stdout")
    args = parser.parse_args(argv)
    return schema.emit(render_reference(), args.output)


if __name__ == "__main__":
    sys.exit(main())
