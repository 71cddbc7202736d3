"""The generated LLMDeployment CRD: committed copy up to date, structural, examples valid, CEL rules and their
Python twins agreeing on a table of invalid specs.

CEL rules are evaluated with cel-python (core CEL only), schema validation is done with jsonschema after
applying the schema's defaults the way the API server does; neither needs a cluster.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import pytest
import yaml
from pydantic import ValidationError

from kubellm.operator import api
from kubellm.operator.crd import schema as crd

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / f"{api.CRD_NAME}.yaml"
EXAMPLES = ROOT / "examples"
MY_EXAMPLES = ("cpu", "7b-bf16", "int4", "tp2", "autoscaled", "api-keys", "inferencepool", "multinode",
               "scale-to-zero")


@functools.cache
def generated() -> dict[str, Any]:
    return crd.build_crd()


def version() -> dict[str, Any]:
    (v,) = generated()["spec"]["versions"]
    return v


def root_schema() -> dict[str, Any]:
    return version()["schema"]["openAPIV3Schema"]


# --------------------------------------------------------------------------------------------------
# CEL evaluation (cel-python) and schema validation (jsonschema)
# --------------------------------------------------------------------------------------------------

_ENV = celpy.Environment()


@functools.cache
def _program(expr: str):
    return _ENV.program(_ENV.compile(expr))


def _eval(expr: str, activation: dict[str, Any]) -> Any:
    result = _program(expr).evaluate({k: celpy.json_to_cel(v) for k, v in activation.items()})
    if isinstance(result, celpy.CELEvalError):
        raise AssertionError(f"CEL {expr!r} failed to evaluate: {result}")
    return result


def cel_violations(
    schema: dict[str, Any], obj: Any, old: Any = None, path: str = ""
) -> list[tuple[str, str, str]]:
    """(path, rule, message) for every x-kubernetes-validations rule ``obj`` breaks, the way the API server walks
    the schema: each rule with ``self`` bound to the value at its level; transition rules (oldSelf) only when
    an old value exists there."""
    out: list[tuple[str, str]] = []
    for rule in schema.get("x-kubernetes-validations", ()):
        activation = {"self": obj}
        if "oldSelf" in rule["rule"]:
            if old is None:
                continue
            activation["oldSelf"] = old
        if not bool(_eval(rule["rule"], activation)):
            message = (
                str(_eval(rule["messageExpression"], activation)) if "messageExpression" in rule else None
            )
            out.append((path + rule.get("fieldPath", ""), rule["rule"], message or rule["message"]))
    if isinstance(obj, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key in obj:
                old_value = old.get(key) if isinstance(old, dict) else None
                out += cel_violations(sub, obj[key], old_value, f"{path}.{key}")
    elif isinstance(obj, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, value in obj.items():
            out += cel_violations(schema["additionalProperties"], value, None, f"{path}[{key}]")
    elif isinstance(obj, list) and "items" in schema:
        keys = schema.get("x-kubernetes-list-map-keys")
        old_items = {tuple(i.get(k) for k in keys): i for i in old} if keys and isinstance(old, list) else {}
        for i, item in enumerate(obj):
            old_item = old_items.get(tuple(item.get(k) for k in keys)) if keys else None
            out += cel_violations(schema["items"], item, old_item, f"{path}[{i}]")
    return out


def to_json_schema(node: Any) -> Any:
    """The CRD schema as JSON Schema 2020-12 for jsonschema: OpenAPI 3.0's boolean exclusiveMinimum rewritten,
    and unknown fields refused (the API server would prune them; here they are typos we want to see)."""
    if isinstance(node, list):
        return [to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: to_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    for key, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if out.get(key) is True:
            out[key] = out.pop(bound)
    if "properties" in out and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@functools.cache
def _validator() -> jsonschema.Draft202012Validator:
    schema = to_json_schema(root_schema())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def schema_errors(obj: dict[str, Any]) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in _validator().iter_errors(obj)]


def defaulted(obj: dict[str, Any]) -> dict[str, Any]:
    return crd.apply_defaults(root_schema(), copy.deepcopy(obj))


def admit(obj: dict[str, Any], old: dict[str, Any] | None = None) -> tuple[list[str], list[str]]:
    """What the API server would say: (schema errors, CEL messages) for ``obj`` after defaulting."""
    obj = defaulted(obj)
    old = defaulted(old) if old is not None else None
    return schema_errors(obj), [m for _, _, m in cel_violations(root_schema(), obj, old)]


def pydantic_errors(obj: dict[str, Any]) -> str | None:
    try:
        api.LLMDeployment.model_validate(obj)
    except ValidationError as e:
        return str(e)
    return None


def deployment(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": "test", "namespace": "default"},
        "spec": {"model": {"uri": "hf://Qwen/Qwen2.5-7B-Instruct"}, **spec},
    }


# --------------------------------------------------------------------------------------------------
# The committed file
# --------------------------------------------------------------------------------------------------


def test_committed_crd_is_up_to_date():
    assert CRD_FILE.exists(), f"{CRD_FILE.relative_to(ROOT)} is missing: run `make crds`"
    assert CRD_FILE.read_text() == crd.render_crd_yaml(), (
        f"{CRD_FILE.relative_to(ROOT)} is stale: run `make crds` "
        f"(or `kubellm crd > crds/{CRD_FILE.name}`) and commit the result"
    )


def test_rendered_yaml_parses_back_to_the_crd():
    assert yaml.safe_load(crd.render_crd_yaml()) == generated()


def test_main_prints_and_writes(tmp_path, capsys):
    assert crd.main([]) == 0
    assert capsys.readouterr().out == crd.render_crd_yaml()
    out = tmp_path / "crd.yaml"
    assert crd.main(["-o", str(out)]) == 0
    assert out.read_text() == crd.render_crd_yaml()


# --------------------------------------------------------------------------------------------------
# Structure
# --------------------------------------------------------------------------------------------------


def test_names_scope_and_version():
    spec = generated()["spec"]
    assert generated()["metadata"]["name"] == "llmdeployments.kubellm.io"
    assert spec["group"] == "kubellm.io" and spec["scope"] == "Namespaced"
    assert spec["names"] == {
        "kind": "LLMDeployment",
        "listKind": "LLMDeploymentList",
        "plural": "llmdeployments",
        "singular": "llmdeployment",
        "shortNames": ["llmd"],
        "categories": ["kubellm"],
    }
    assert version()["name"] == "v1alpha1" and version()["served"] and version()["storage"]


def test_subresources():
    assert version()["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    props = root_schema()["properties"]
    assert props["spec"]["properties"]["replicas"]["type"] == "integer"
    assert props["status"]["properties"]["replicas"]["type"] == "integer"
    assert props["status"]["properties"]["selector"]["type"] == "string"


def test_printer_columns():
    columns = {c["name"]: c for c in version()["additionalPrinterColumns"]}
    assert list(columns)[:7] == ["Model", "Quant", "TP", "Ready", "Queue", "Status", "Age"]
    expected = {
        "Model": ("string", ".spec.model.uri"),
        "Quant": ("string", ".spec.quantization"),
        "TP": ("integer", ".spec.parallelism.tensor"),
        "Ready": ("string", ".status.readyText"),
        "Queue": ("number", ".status.autoscaling.currentQueueDepth"),
        "Status": ("string", '.status.conditions[?(@.type=="Ready")].reason'),
        "Age": ("date", ".metadata.creationTimestamp"),
    }
    for name, (type_, path) in expected.items():
        assert (columns[name]["type"], columns[name]["jsonPath"]) == (type_, path), name
    # every column's path (up to a filter) exists in the schema
    for c in columns.values():
        if c["jsonPath"].startswith(".metadata."):
            continue
        node = root_schema()
        for part in c["jsonPath"].lstrip(".").split("[")[0].split("."):
            node = node["properties"][part]
            node = node.get("items", node)


def _walk(node: dict[str, Any], path: str = "$"):
    yield path, node
    for key, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    for path, node in _walk(root_schema()):
        for bad in ("$ref", "$defs", "definitions", "allOf", "oneOf", "not", "nullable", "const", "title"):
            assert bad not in node, f"{path}: {bad} is not allowed in a structural schema"
        int_or_string = node.get("x-kubernetes-int-or-string") is True
        if "anyOf" in node:
            assert int_or_string and node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
            assert "type" not in node, path
        assert "type" in node or int_or_string or node.get("x-kubernetes-preserve-unknown-fields"), (
            f"{path}: every node needs a type"
        )
        if "type" in node:
            assert node["type"] in ("object", "array", "string", "integer", "number", "boolean"), path
        if "properties" in node:
            assert "additionalProperties" not in node, (
                f"{path}: properties and additionalProperties exclude each other"
            )
        if node.get("type") == "array":
            assert isinstance(node.get("items"), dict), f"{path}: arrays need items"
        if node.get("x-kubernetes-list-type") == "map":
            keys = node["x-kubernetes-list-map-keys"]
            item = node["items"]
            for key in keys:
                assert key in item.get("required", []) or "default" in item["properties"][key], (
                    f"{path}: list-map key {key} must be required"
                )
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, (
                f"{path}: OpenAPI 3.0 exclusiveMinimum"
            )
        for rule in node.get("x-kubernetes-validations", ()):
            assert set(rule) <= {"rule", "message", "messageExpression", "fieldPath", "reason"}, path
            assert rule["message"] and "\n" not in rule["message"], f"{path}: messages must be one line"
    assert root_schema()["properties"]["metadata"] == {"type": "object"}


def test_every_spec_field_is_described_and_defaults_match_the_models():
    spec_schema = root_schema()["properties"]["spec"]
    for path, node in _walk(spec_schema, "spec"):
        if path != "spec" and not path.endswith(("[]", "{}")):
            assert node.get("description"), f"{path} has no description (kubectl explain shows it)"
    # the schema's defaults are the models' defaults: default a minimal object both ways and compare
    minimal = deployment()
    assert api.LLMDeployment.model_validate(minimal).to_k8s() == defaulted(minimal)


def test_defaults_are_valid():
    # The API server checks defaults against the schema and the CEL rules when the CRD is created.
    obj = defaulted(deployment())
    assert schema_errors(obj) == []
    assert cel_violations(root_schema(), obj) == []


def test_optional_fields_have_no_null_default():
    for path, node in _walk(root_schema()):
        assert node.get("default", ...) is not None, f"{path}: null default"


def test_every_model_rule_is_in_the_crd():
    in_crd = [r["rule"] for _, node in _walk(root_schema()) for r in node.get("x-kubernetes-validations", ())]
    in_models = [r.rule for rules in api.all_rules().values() for r in rules]
    assert sorted(in_crd) == sorted(in_models)


def test_every_cel_rule_compiles_in_core_cel():
    for _, node in _walk(root_schema()):
        for rule in node.get("x-kubernetes-validations", ()):
            _program(rule["rule"])
            if "messageExpression" in rule:
                _program(rule["messageExpression"])


def test_structural_conversion_refuses_unstructural_models():
    from pydantic import BaseModel

    class Union(BaseModel):
        x: int | list[int]

    with pytest.raises(crd.SchemaError, match="unions"):
        crd.openapi_schema(Union)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# Examples
# --------------------------------------------------------------------------------------------------


def _example_docs() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if isinstance(doc, dict) and doc.get("kind") == api.KIND:
                docs.append((f"{path.name}#{i}", doc))
    return docs


def test_my_examples_exist():
    names = {p.name for p in EXAMPLES.glob("*.yaml")}
    for suffix in MY_EXAMPLES:
        assert f"llmdeployment-{suffix}.yaml" in names


@pytest.mark.parametrize(("name", "doc"), _example_docs(), ids=[n for n, _ in _example_docs()])
def test_example_is_admitted(name, doc):
    assert doc["apiVersion"] == api.API_VERSION
    schema_errs, cel_errs = admit(doc)
    assert schema_errs == [], f"{name}: {schema_errs}"
    assert cel_errs == [], f"{name}: {cel_errs}"
    model = api.LLMDeployment.model_validate(doc)
    assert model.to_k8s() == defaulted(doc), f"{name}: pydantic and schema defaults disagree"
    # an update that changes nothing passes the transition rules too
    assert admit(doc, old=doc) == ([], [])


# --------------------------------------------------------------------------------------------------
# Invalid specs: refused by CEL (the API server) and by the pydantic twin, with the same message
# --------------------------------------------------------------------------------------------------

GPU_COUNT_MSG = "resources.gpu.count must be 0 (CPU) or a multiple of the ranks in each pod, parallelism.tensor / parallelism.nodes; omit it to get that many GPUs"  # noqa: E501
TENSOR_MSG = "more than one tensor-parallel rank per pod (parallelism.tensor / parallelism.nodes) needs resources.gpu.count >= that many (one GPU per rank)"  # noqa: E501

ALERT_LABELS_MSG = "monitoring.alerts.labels: names must be Prometheus label names ([a-zA-Z_][a-zA-Z0-9_]*), not start with __ and not be alertname"  # noqa: E501

INVALID = [
    ("gpu count not a multiple of tensor", {"parallelism": {"tensor": 2}, "resources": {"gpu": {"count": 3}}},
     GPU_COUNT_MSG),
    ("gpu count 4 with tensor 3", {"parallelism": {"tensor": 3}, "resources": {"gpu": {"count": 4}}}, GPU_COUNT_MSG),
    ("tensor parallelism on CPU", {"parallelism": {"tensor": 2}, "resources": {"gpu": {"count": 0}}}, TENSOR_MSG),
    ("fewer GPUs than shards", {"parallelism": {"tensor": 4}, "resources": {"gpu": {"count": 2}}}, TENSOR_MSG),
    ("min above max", {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}},
     "autoscaling.minReplicas must be <= autoscaling.maxReplicas"),
    ("min above default max", {"autoscaling": {"minReplicas": 6}},
     "autoscaling.minReplicas must be <= autoscaling.maxReplicas"),
    ("scale to zero with the HPA", {"autoscaling": {"enabled": True, "minReplicas": 0}},
     "autoscaling.minReplicas 0 (scale to zero) needs backend keda; the HPA cannot scale to zero"),
    ("tensor not a multiple of nodes", {"parallelism": {"tensor": 6, "nodes": 4}, "resources": {"gpu": {"count": 8}}},
     "parallelism.tensor 6 must be a multiple of parallelism.nodes 4: every pod of a group holds the same number "
     "of tensor-parallel ranks"),
    ("fewer shards than nodes", {"parallelism": {"nodes": 2}},
     "parallelism.tensor 1 must be a multiple of parallelism.nodes 2: every pod of a group holds the same number "
     "of tensor-parallel ranks"),
    ("gpu count not a multiple of the ranks per pod",
     {"parallelism": {"tensor": 8, "nodes": 2}, "resources": {"gpu": {"count": 6}}}, GPU_COUNT_MSG),
    ("fewer GPUs per pod than ranks per pod",
     {"parallelism": {"tensor": 16, "nodes": 2}, "resources": {"gpu": {"count": 4}}}, TENSOR_MSG),
    ("two ranks per pod on CPU", {"parallelism": {"tensor": 4, "nodes": 2}, "resources": {"gpu": {"count": 0}}},
     TENSOR_MSG),
    ("rendezvous on the API port", {"parallelism": {"tensor": 2, "nodes": 2, "rendezvousPort": 8000}},
     "parallelism.rendezvousPort must differ from the runtime's API port 8000"),
    ("idle time without scale to zero",
     {"autoscaling": {"enabled": True, "backend": "keda", "minReplicas": 1, "scaleToZeroAfterSeconds": 600}},
     "autoscaling.scaleToZeroAfterSeconds needs minReplicas 0: it is the idle time before the last pod goes"),
    ("s3 uri", {"model": {"uri": "s3://bucket/llama"}}, api.MODEL_URI_MESSAGE),
    ("hf uri without org", {"model": {"uri": "hf://llama"}}, api.MODEL_URI_MESSAGE),
    ("relative file uri", {"model": {"uri": "file://models/llama.gguf"}}, api.MODEL_URI_MESSAGE),
    ("pvc uri with bad claim", {"model": {"uri": "pvc://My_Claim/llama"}}, api.MODEL_URI_MESSAGE),
    ("revision on a pvc model", {"model": {"uri": "pvc://models/llama", "revision": "main"}},
     "model.revision applies to hf:// models only"),
    ("draft model and ngram", {"engine": {"speculative": {"ngram": 3, "model": {"uri": "hf://Qwen/Qwen2.5-0.5B"}}}},
     "engine.speculative takes one proposer: set ngram (prompt lookup) or model (a draft model), not both"),
    ("draft model with tensor parallelism",
     {"parallelism": {"tensor": 2}, "engine": {"speculative": {"model": {"uri": "hf://Qwen/Qwen2.5-0.5B"}}}},
     "engine.speculative.model runs the draft beside an unsharded model; it needs parallelism.tensor 1 (use "
     "engine.speculative.ngram with tensor parallelism)"),
    ("eagle without a head", {"engine": {"speculative": {"method": "eagle"}}},
     "engine.speculative.method eagle drafts with an EAGLE head: set engine.speculative.model to the head's uri"),
    ("s3 draft uri", {"engine": {"speculative": {"model": {"uri": "s3://bucket/draft"}}}},
     "engine.speculative." + api.MODEL_URI_MESSAGE),
    ("revision on a pvc draft", {"engine": {"speculative": {"model": {"uri": "pvc://models/d", "revision": "main"}}}},
     "engine.speculative.model.revision applies to hf:// models only"),
    ("rollout that cannot progress", {"rollout": {"maxSurge": 0, "maxUnavailable": 0}},
     "rollout.maxSurge and rollout.maxUnavailable cannot both be 0: the rollout could never replace a pod"),
    ("rollout 0% and 0", {"rollout": {"maxSurge": "0%"}},
     "rollout.maxSurge and rollout.maxUnavailable cannot both be 0: the rollout could never replace a pod"),
    ("gpu product on CPU", {"resources": {"gpu": {"count": 0, "product": "NVIDIA-L4"}}},
     "resources.gpu.product selects GPU nodes, so it needs resources.gpu.count > 0"),
    ("env value and valueFrom", {"env": [{"name": "A", "value": "x", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]},
     "env: set value or valueFrom, not both"),
    ("api key both from auth and env",
     {"auth": {"apiKeySecretRef": {"name": "keys"}}, "env": [{"name": "KUBELLM_API_KEY", "value": "k"}]},
     "env: KUBELLM_API_KEY is set from auth.apiKeySecretRef; remove one of them"),
    ("toleration Exists with value", {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]},
     "a toleration with operator Exists must not set value"),
    ("toleration without key", {"tolerations": [{"operator": "Equal", "value": "v"}]},
     "a toleration without key must use operator Exists"),
    ("tolerationSeconds without NoExecute",
     {"tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 5}]},
     "tolerationSeconds applies to effect NoExecute only"),
    ("alert label with a dash", {"monitoring": {"alerts": {"enabled": True, "labels": {"team-name": "ml"}}}},
     ALERT_LABELS_MSG),
    ("alert label alertname", {"monitoring": {"alerts": {"labels": {"alertname": "x"}}}}, ALERT_LABELS_MSG),
    ("alert label reserved", {"monitoring": {"alerts": {"labels": {"__name__": "x"}}}}, ALERT_LABELS_MSG),
]  # fmt: skip


def test_int4_is_admitted_on_cpu():
    """The native CPU int4 kernel is about level with bf16 or faster from one row to 256 (benchmarks/README.md)."""
    obj = deployment()
    obj["spec"] = _merge(obj["spec"], {"quantization": "int4", "resources": {"gpu": {"count": 0}}})
    assert admit(obj) == ([], [])
    assert pydantic_errors(obj) is None


MULTI_NODE_VALID = [
    ("2 nodes, a GPU per pod", {"parallelism": {"tensor": 2, "nodes": 2}}),
    ("4 nodes, 8 GPUs per pod", {"parallelism": {"tensor": 32, "nodes": 4}, "resources": {"gpu": {"count": 8}}}),
    ("2 nodes, twice the GPUs per pod", {"parallelism": {"tensor": 8, "nodes": 2}, "resources": {"gpu": {"count": 8}}}),
    ("2 nodes on CPU", {"parallelism": {"tensor": 2, "nodes": 2, "rendezvousPort": 12345},
                        "resources": {"gpu": {"count": 0}}}),
    ("4 nodes on CPU", {"parallelism": {"tensor": 4, "nodes": 4}, "resources": {"gpu": {"count": 0}}}),
]  # fmt: skip


@pytest.mark.parametrize(("case", "patch"), MULTI_NODE_VALID, ids=[c for c, _ in MULTI_NODE_VALID])
def test_multi_node_specs_are_admitted(case, patch):
    obj = deployment()
    obj["spec"] = _merge(obj["spec"], patch)
    assert admit(obj) == ([], []), case
    assert pydantic_errors(obj) is None, case


def _merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


@pytest.mark.parametrize(("case", "patch", "message"), INVALID, ids=[c for c, _, _ in INVALID])
def test_invalid_spec_refused_by_cel_and_pydantic(case, patch, message):
    obj = deployment()
    obj["spec"] = _merge(obj["spec"], patch)
    schema_errs, cel_errs = admit(obj)
    assert schema_errs == [], f"{case}: the schema alone should accept it: {schema_errs}"
    assert message in cel_errs, f"{case}: CEL said {cel_errs}"
    errors = pydantic_errors(obj)
    assert errors is not None and message in errors, f"{case}: pydantic said {errors}"


def test_invalid_table_covers_every_rule():
    broken = set()
    for _, patch, _ in INVALID:
        obj = deployment()
        obj["spec"] = _merge(obj["spec"], patch)
        broken |= {rule for _, rule, _ in cel_violations(root_schema(), defaulted(obj))}
    for rules in api.all_rules().values():
        for rule in rules:
            assert rule.transition or rule.rule in broken, f"no invalid case exercises {rule.rule!r}"


SCHEMA_INVALID = [
    ("unknown dtype", {"dtype": "int3"}),
    ("unknown quantization", {"quantization": "int2"}),
    ("block size 12", {"engine": {"kvCacheBlockSize": 12}}),
    ("memory fraction 0", {"engine": {"kvCacheMemoryFraction": 0}}),
    ("memory fraction above 1", {"engine": {"kvCacheMemoryFraction": 1.5}}),
    ("readiness timeout within the runtime deadline", {"probes": {"readinessTimeoutSeconds": 10}}),
    ("negative replicas", {"replicas": -1}),
    ("tensor 0", {"parallelism": {"tensor": 0}}),
    ("nodes 0", {"parallelism": {"nodes": 0}}),
    ("nodes above 64", {"parallelism": {"tensor": 65, "nodes": 65}}),
    ("rendezvous port 0", {"parallelism": {"rendezvousPort": 0}}),
    ("maxSurge not a percentage", {"rollout": {"maxSurge": "lots"}}),
    ("negative maxUnavailable", {"rollout": {"maxUnavailable": -1}}),
    ("cpu not a quantity", {"resources": {"cpu": "2 cores"}}),
    ("negative memory", {"resources": {"memory": "-1Gi"}}),
    ("unknown backend", {"autoscaling": {"backend": "vpa"}}),
    ("idle time below a minute",
     {"autoscaling": {"enabled": True, "backend": "keda", "minReplicas": 0, "scaleToZeroAfterSeconds": 30}}),
    ("service port 0", {"service": {"port": 0}}),
    ("unknown service monitor mode", {"monitoring": {"serviceMonitor": "Yes"}}),
    ("unknown pull policy", {"imagePullPolicy": "Sometimes"}),
    ("typo in a field name", {"replica": 2}),
    ("typo in a nested field name", {"engine": {"maxNumSeq": 2}}),
    ("secret name not a DNS name", {"auth": {"apiKeySecretRef": {"name": "Keys_1"}}}),
    ("secret ref without a name", {"auth": {"apiKeySecretRef": {"key": "k"}}}),
    ("toleration with unknown effect", {"tolerations": [{"key": "k", "effect": "NoRun"}]}),
    ("endpoint picker without a name", {"gateway": {"inferencePool": {"enabled": True, "endpointPickerRef": {}}}}),
    ("endpoint picker name not a Service name",
     {"gateway": {"inferencePool": {"endpointPickerRef": {"name": "EPP.svc"}}}}),
    ("endpoint picker port 0", {"gateway": {"inferencePool": {"endpointPickerRef": {"name": "e", "port": 0}}}}),
    ("unknown failure mode", {"gateway": {"inferencePool": {"endpointPickerRef": {"name": "e", "failureMode": "Open"}}}}),
    ("inferencePool as a boolean", {"gateway": {"inferencePool": True}}),
    ("alert duration without a unit", {"monitoring": {"alerts": {"queueAtMaxFor": "10"}}}),
    ("alert duration in words", {"monitoring": {"alerts": {"queueAtMaxFor": "ten minutes"}}}),
    ("kv cache usage above 1", {"monitoring": {"alerts": {"kvCacheUsage": 1.5}}}),
    ("error ratio 0", {"monitoring": {"alerts": {"errorRatio": 0}}}),
    ("ttft slo 0", {"monitoring": {"alerts": {"ttftP99SecondsSLO": 0}}}),
    ("alert label value not a string", {"monitoring": {"alerts": {"labels": {"team": 1}}}}),
]

ALERTS_VALID = [
    ("every knob", {"monitoring": {"alerts": {
        "enabled": True, "ttftP99SecondsSLO": 0.5, "errorRatio": 0.01, "kvCacheUsage": 0.9,
        "queueAtMaxFor": "1h30m", "labels": {"team": "ml", "severity": "page", "_x9": "y"}}}}),
    ("enabled alone", {"monitoring": {"alerts": {"enabled": True}}}),
]  # fmt: skip


@pytest.mark.parametrize(("case", "patch"), ALERTS_VALID, ids=[c for c, _ in ALERTS_VALID])
def test_alert_specs_are_admitted(case, patch):
    obj = deployment()
    obj["spec"] = _merge(obj["spec"], patch)
    assert admit(obj) == ([], []), case
    assert pydantic_errors(obj) is None, case


@pytest.mark.parametrize(("case", "patch"), SCHEMA_INVALID, ids=[c for c, _ in SCHEMA_INVALID])
def test_schema_invalid_spec_refused_by_schema_and_pydantic(case, patch):
    obj = deployment()
    obj["spec"] = _merge(obj["spec"], patch)
    assert schema_errors(defaulted(obj)), f"{case}: the schema accepted it"
    assert pydantic_errors(obj) is not None, f"{case}: pydantic accepted it"


def test_spec_is_required():
    obj = deployment()
    del obj["spec"]
    assert schema_errors(obj)
    assert pydantic_errors(obj) is not None


# --------------------------------------------------------------------------------------------------
# The replicas/autoscaling transition rule
# --------------------------------------------------------------------------------------------------


def _autoscaled(replicas: int | None, **autoscaling: Any) -> dict[str, Any]:
    obj = deployment(autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 4, **autoscaling})
    if replicas is not None:
        obj["spec"]["replicas"] = replicas
    return obj


def _transition(old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str]]:
    _, cel = admit(new, old=old)
    python = api.validate_update(
        api.LLMDeploymentSpec.model_validate(old["spec"]), api.LLMDeploymentSpec.model_validate(new["spec"])
    )
    return cel, python


def test_scaling_out_of_range_while_autoscaling_is_refused():
    cel, python = _transition(_autoscaled(2), _autoscaled(10))
    expected = (
        "replicas 10 is outside autoscaling [1, 4]: autoscaling is enabled, so the autoscaler owns spec.replicas; "
        "remove replicas from your manifest"
    )
    assert cel == [expected] and python == [expected]


def test_autoscaler_writes_within_range_are_accepted():
    assert _transition(_autoscaled(2), _autoscaled(4)) == ([], [])
    assert _transition(_autoscaled(None), _autoscaled(3)) == ([], [])


def test_lowering_max_below_current_replicas_never_gets_stuck():
    # scaled out to 4, then the manifest lowers maxReplicas to 2: replicas is unchanged, so it is accepted
    # and the autoscaler brings replicas into the new range
    assert _transition(_autoscaled(4), _autoscaled(4, maxReplicas=2)) == ([], [])
    assert _transition(_autoscaled(1), _autoscaled(1, minReplicas=2)) == ([], [])


def test_create_with_defaulted_replicas_below_min_is_accepted():
    # replicas defaults to 1; with minReplicas 2 a non-transition range rule would refuse every manifest
    # that (correctly) leaves replicas out
    obj = _autoscaled(None, minReplicas=2)
    assert admit(obj) == ([], [])
    assert pydantic_errors(obj) is None


def test_replicas_are_free_without_autoscaling():
    old, new = deployment(replicas=1), deployment(replicas=10)
    assert _transition(old, new) == ([], [])
