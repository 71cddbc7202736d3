"""Generate the LLMDeployment CustomResourceDefinition from the pydantic models in :mod:`kubellm.operator.api`.

``python -m kubellm.operator.crd.schema`` (or ``kubellm crd``) prints it as YAML; ``-o PATH`` writes it.

Pydantic emits JSON Schema 2020-12; a CRD wants a *structural* OpenAPI v3.0 schema, so this module:

* inlines every ``$ref`` (a structural schema has no references) and drops ``title``;
* turns ``Optional[X]`` (``anyOf: [X, {type: null}]``) into ``X`` with no default: Kubernetes expresses
  "unset" by absence, never ``null``;
* drops ``additionalProperties: false`` (``extra="forbid"``): the API server prunes unknown fields anyway,
  and structural schemas forbid it beside ``properties``;
* rewrites ``exclusiveMinimum: 0`` into OpenAPI v3.0's ``minimum: 0, exclusiveMinimum: true``;
* keeps the one union structural schemas allow, int-or-string (``x-kubernetes-int-or-string`` with
  ``anyOf: [{type: integer}, {type: string}]``), and refuses any other.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

from kubellm.operator import api

_INT_OR_STRING_ANYOF = [{"type": "integer"}, {"type": "string"}]
HEADER = (
    "# Generated from kubellm/operator/api/ by `kubellm crd` (python -m kubellm.operator.crd.schema); do not edit.\n"
    "# Regenerate with `make crds`.\n"
)


class SchemaError(ValueError):
    """The models use a construct a structural CRD schema cannot express."""


def _clean_text(text: str) -> str:
    return " ".join(text.split())


def _structural(node: dict[str, Any], defs: dict[str, Any], path: str) -> dict[str, Any]:
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        node = {**target, **node}  # the field's own keys (description, default) win over the model's
    if "allOf" in node and len(node["allOf"]) == 1:  # older pydantic wraps a described $ref in allOf
        node = {**_structural(node.pop("allOf")[0], defs, path), **node}
    if "anyOf" in node:
        if node.get("x-kubernetes-int-or-string"):
            if node["anyOf"] != _INT_OR_STRING_ANYOF:
                raise SchemaError(
                    f"{path}: int-or-string must be anyOf [integer, string], got {node['anyOf']}"
                )
        else:
            variants = [v for v in node.pop("anyOf") if v != {"type": "null"}]
            if len(variants) != 1:
                raise SchemaError(
                    f"{path}: unions other than Optional[X] and int-or-string are not structural"
                )
            if node.get("default", ...) is None:
                del node["default"]
            node = {**_structural(variants[0], defs, path), **node}
    node.pop("title", None)
    if node.get("default", ...) is None:
        del node["default"]
    if node.get("additionalProperties") is False:
        del node["additionalProperties"]
    for key, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        value = node.get(key)
        if not isinstance(value, bool) and isinstance(value, int | float):
            node[bound], node[key] = value, True
    if "description" in node:
        node["description"] = _clean_text(node["description"])
    if "properties" in node:
        node["properties"] = {k: _structural(v, defs, f"{path}.{k}") for k, v in node["properties"].items()}
    if isinstance(node.get("items"), dict):
        node["items"] = _structural(node["items"], defs, f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = _structural(node["additionalProperties"], defs, f"{path}{{}}")
    elif node.get("additionalProperties") is True:
        raise SchemaError(
            f"{path}: free-form maps must use api.FreeForm (x-kubernetes-preserve-unknown-fields)"
        )
    for bad in ("$ref", "$defs", "allOf", "oneOf", "not", "const", "nullable"):
        if bad in node:
            raise SchemaError(f"{path}: {bad} is not allowed in a structural schema")
    if (
        "type" not in node
        and not node.get("x-kubernetes-int-or-string")
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        raise SchemaError(f"{path}: every node needs a type")
    return _ordered(node)


_KEY_ORDER = ("description", "type", "format", "default", "enum")


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    """Stable, readable key order: description/type/... first, the rest alphabetical, properties last."""
    head = [k for k in _KEY_ORDER if k in node]
    tail = [k for k in ("properties", "items", "additionalProperties") if k in node]
    middle = sorted(k for k in node if k not in head and k not in tail)
    return {k: node[k] for k in (*head, *middle, *tail)}


def openapi_schema(model: type[api.KubeModel]) -> dict[str, Any]:
    """The structural OpenAPI v3.0 schema of one model, everything inlined."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _structural(raw, defs, model.__name__)


def crd_schema() -> dict[str, Any]:
    """The CRD's ``openAPIV3Schema``: the LLMDeployment object with its spec and status."""
    return {
        "description": _clean_text(api.LLMDeployment.__doc__ or ""),
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {
                "description": "APIVersion defines the versioned schema of this representation of an object.",
                "type": "string",
            },
            "kind": {
                "description": "Kind is a string value representing the REST resource this object represents.",
                "type": "string",
            },
            "metadata": {"type": "object"},
            "spec": openapi_schema(api.LLMDeploymentSpec),
            "status": openapi_schema(api.LLMDeploymentStatus),
        },
    }


PRINTER_COLUMNS = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.uri"},
    {"name": "Quant", "type": "string", "jsonPath": ".spec.quantization"},
    {"name": "TP", "type": "integer", "jsonPath": ".spec.parallelism.tensor"},
    {"name": "Ready", "type": "string", "jsonPath": ".status.readyText"},
    {"name": "Queue", "type": "number", "jsonPath": ".status.autoscaling.currentQueueDepth"},
    {"name": "Status", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason'},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint", "priority": 1},
]


def build_crd() -> dict[str, Any]:
    """The whole CustomResourceDefinition (apiextensions.k8s.io/v1) as a dict."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": api.CRD_NAME,
            "labels": {"app.kubernetes.io/name": "kubellm", "app.kubernetes.io/component": "crd"},
        },
        "spec": {
            "group": api.GROUP,
            "names": {
                "kind": api.KIND,
                "listKind": api.LIST_KIND,
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": list(api.SHORT_NAMES),
                "categories": list(api.CATEGORIES),
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": crd_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": copy.deepcopy(PRINTER_COLUMNS),
                }
            ],
        },
    }


def render_crd_yaml() -> str:
    """The CRD as the YAML text committed in crds/llmdeployments.kubellm.io.yaml."""
    body = yaml.safe_dump(
        build_crd(), sort_keys=False, width=110, allow_unicode=True, default_flow_style=False
    )
    return HEADER + body


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """Apply a structural schema's defaults to ``obj`` (in place, also returned) the way the API server does:
    absent properties get a copy of their default, then defaulting recurses into every present value."""
    if isinstance(obj, dict):
        props = schema.get("properties")
        if props is not None:
            for key, prop in props.items():
                if key not in obj and "default" in prop:
                    obj[key] = copy.deepcopy(prop["default"])
            for key, value in obj.items():
                if key in props:
                    apply_defaults(props[key], value)
        elif isinstance(schema.get("additionalProperties"), dict):
            for value in obj.values():
                apply_defaults(schema["additionalProperties"], value)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for item in obj:
            apply_defaults(schema["items"], item)
    return obj


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kubellm crd", description="Print the LLMDeployment CRD (YAML).")
    parser.add_argument("-o", "--output", help="write to this file instead of stdout")
    args = parser.parse_args(argv)
    return emit(render_crd_yaml(), args.output)


def emit(text: str, output: str | None) -> int:
    """Write generated text to ``output``, or to stdout without one (the generators' CLI tail)."""
    if output:
        Path(output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
