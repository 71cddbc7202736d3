"""The Helm chart charts/kubellm, checked with the real helm (lint, schema, template) and offline schemas.

helm comes from `make` ($(VENV)/bin/helm, a pinned static build) or PATH. Without it these tests skip locally
and fail in CI (CI=true), so CI never passes by skipping them. Every rendered object of every values case goes
through kubernetes-validate --strict for the oldest and newest supported Kubernetes; the CRD and the
ServiceMonitor, which have no upstream schema there beyond the CRD kind itself, are also checked by structure.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kubellm.operator import api
from kubellm.operator.control import rbac
from kubellm.operator.render import autoscaling as autoscaling_mod
from kubellm.operator.render import cli as render_cli
from kubellm.runtime.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kubellm"
RELEASE, NAMESPACE = "kubellm", "kubellm-system"
K8S_VERSIONS = ("1.31", "1.37")  # as tests/operator/test_render.py: oldest supported, newest bundled
ADDON_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}

VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
CHART_META = yaml.safe_load((CHART / "Chart.yaml").read_text())

CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespaces": {"watchNamespaces": ["ml", "team-a"]},
    "service-monitor": {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}},
    "keda": {"rbac": {"keda": True}},
    "inference-pools": {"rbac": {"inferencePools": True}},
    "leader-worker-sets": {"rbac": {"leaderWorkerSets": True}},
    "everything": {
        "watchNamespaces": ["ml"],
        "rbac": {"keda": True, "serviceMonitors": True, "prometheusRules": True, "inferencePools": True,
                 "leaderWorkerSets": True},
        "metrics": {"port": 9100, "serviceMonitor": {"enabled": True, "interval": "15s", "scrapeTimeout": "5s"}},
        "operator": {
            "image": {"repository": "registry.example:5000/kubellm/operator", "tag": "dev", "pullPolicy": "Always"},
            "imagePullSecrets": [{"name": "registry"}],
            "logLevel": "debug",
            "logFormat": "text",
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "tolerations": [{"key": "ops", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "preference": {"matchExpressions": [
                    {"key": "node-role", "operator": "In", "values": ["ops"]}]}}]}},
            "priorityClassName": "system-cluster-critical",
            "podAnnotations": {"example.com/team": "ml"},
            "podLabels": {"team": "ml", "app.kubernetes.io/name": "not-this"},
        },
        "serviceAccount": {"annotations": {"example.com/role": "ops"}},
        "autoscaling": {"prometheusUrl": "http://prometheus.monitoring:9090"},
    },
    "own-rbac": {"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "ops-kubellm"}},
}  # fmt: skip


# --------------------------------------------------------------------------------------------------
# helm
# --------------------------------------------------------------------------------------------------


@cache
def helm_path() -> str | None:
    venv_helm = Path(sys.executable).parent / "helm"
    return str(venv_helm) if venv_helm.exists() else shutil.which("helm")


@pytest.fixture(scope="session")
def helm(tmp_path_factory) -> Any:
    """Runs helm with its caches in a temporary folder; returns (returncode, stdout, stderr)."""
    path = helm_path()
    if path is None:
        message = "helm not found: `make .venv/bin/helm` installs the pinned build"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    home = tmp_path_factory.mktemp("helm-home")
    env = {**os.environ, **{f"HELM_{k}_HOME": str(home / k.lower()) for k in ("CACHE", "CONFIG", "DATA")}}

    def run(*args: str, values: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
        cmd = [path, *args]
        if values is not None:
            values_file = home / "values.yaml"
            values_file.write_text(yaml.safe_dump(values))
            cmd += ["-f", str(values_file)]
        return subprocess.run(cmd, cwd=home, env=env, capture_output=True, text=True, timeout=120)

    return run


def template(helm, values: dict[str, Any], *extra: str) -> list[dict[str, Any]]:
    result = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--include-crds", *extra, values=values)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


@pytest.fixture(scope="module")
def rendered(helm) -> dict[str, list[dict[str, Any]]]:
    return {name: template(helm, values) for name, values in CASES.items()}


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def the(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = of_kind(docs, kind)
    return doc


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# --------------------------------------------------------------------------------------------------
# helm lint, the schema, and every rendered object
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_helm_lint_strict_passes(helm, case):
    result = helm("lint", "--strict", str(CHART), values=CASES[case])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("case", CASES)
def test_rendered_objects_are_valid(rendered, case):
    docs = rendered[case]
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key in ADDON_KINDS:
            continue  # no upstream schema: checked by test_service_monitor_scrapes_the_metrics_service
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
        if doc["kind"] not in ("CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"):
            expected = NAMESPACE if doc["kind"] not in ("Role", "RoleBinding") else doc["metadata"]["namespace"]
            assert doc["metadata"].get("namespace") == expected, doc["metadata"]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("Deployment") == 1 and kinds.count("CustomResourceDefinition") == 1


@pytest.mark.parametrize(
    "bad, complaint",
    [
        ({"watchNamespaces": "ml"}, "/watchNamespaces"),
        ({"watchNamespaces": ["team-*"]}, "/watchNamespaces/0"),
        ({"watchNamespaces": ["ml", "ml"]}, "/watchNamespaces"),
        ({"operator": {"imag": {"repository": "x"}}}, "'imag' not allowed"),
        ({"operator": {"image": {"pullPolicy": "Sometimes"}}}, "/operator/image/pullPolicy"),
        ({"operator": {"resources": {"limits": {"memory": "lots"}}}}, "/operator/resources/limits/memory"),
        ({"rbac": {"keda": "yes"}}, "/rbac/keda"),
        ({"rbac": {"inferencePools": 1}}, "/rbac/inferencePools"),
        ({"rbac": {"leaderWorkerSets": 1}}, "/rbac/leaderWorkerSets"),
        ({"metrics": {"port": 8080}}, "/metrics/port"),
        ({"metrics": {"port": 0}}, "/metrics/port"),
        ({"metrics": {"serviceMonitor": {"interval": "often"}}}, "/metrics/serviceMonitor/interval"),
        ({"autoscaling": {"prometheusUrl": "prometheus:9090"}}, "/autoscaling/prometheusUrl"),
        ({"replicas": 2}, "'replicas' not allowed"),
    ],
)
def test_helm_rejects_values_the_schema_forbids(helm, bad, complaint):
    result = helm("template", RELEASE, str(CHART), values=bad)
    assert result.returncode != 0
    assert "don't meet the specifications of the schema" in result.stderr and complaint in result.stderr, (
        result.stderr
    )
    with pytest.raises(jsonschema.ValidationError):  # the same verdict offline
        jsonschema.Draft7Validator(SCHEMA).validate(merged(VALUES, bad))


def test_an_existing_service_account_needs_its_name(helm):
    result = helm("template", RELEASE, str(CHART), values={"serviceAccount": {"create": False}})
    assert result.returncode != 0 and "serviceAccount.name is required" in result.stderr


def test_schema_is_draft_07_and_the_defaults_and_cases_satisfy_it():
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "http://json-schema.org/draft-07/schema#"
    for values in CASES.values():
        jsonschema.Draft7Validator(SCHEMA).validate(merged(VALUES, values))


def _resolve(schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = SCHEMA["definitions"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def test_schema_describes_every_value_and_closes_every_object():
    def walk(values: Any, schema: dict[str, Any], where: str) -> None:
        schema = _resolve(schema)
        if not isinstance(values, dict):
            return
        for key, value in values.items():
            props = schema.get("properties") or {}
            if key in props:
                walk(value, props[key], f"{where}.{key}")
            else:  # only maps with typed entries (resources, labels) may hold keys the schema does not name
                assert isinstance(schema.get("additionalProperties"), dict), f"values.schema.json lacks {where}.{key}"

    walk(VALUES, SCHEMA, "")

    def closed(schema: Any, where: str) -> None:
        if isinstance(schema, dict):
            if "properties" in schema:
                assert schema.get("additionalProperties") is False, f"{where} accepts unknown keys"
            for key, sub in schema.items():
                closed(sub, f"{where}.{key}")
        elif isinstance(schema, list):
            for i, sub in enumerate(schema):
                closed(sub, f"{where}[{i}]")

    closed(SCHEMA, "$")


def test_readme_documents_every_value():
    readme = (CHART / "README.md").read_text()

    def walk(values: Any, schema: dict[str, Any], path: str) -> None:
        schema = _resolve(schema)
        if isinstance(values, dict) and schema.get("properties"):
            for key, value in values.items():
                walk(value, schema["properties"][key], f"{path}.{key}" if path else key)
        else:
            assert f"`{path}`" in readme, f"charts/kubellm/README.md does not document {path}"

    walk(VALUES, SCHEMA, "")


# --------------------------------------------------------------------------------------------------
# The CRD, versions and defaults shared with the code
# --------------------------------------------------------------------------------------------------


def test_chart_crd_is_a_byte_identical_copy_of_the_generated_one():
    chart_crds = sorted(p.name for p in (CHART / "crds").iterdir())
    assert chart_crds == ["llmdeployments.kubellm.io.yaml"]
    generated = (ROOT / "crds" / "llmdeployments.kubellm.io.yaml").read_bytes()
    assert (CHART / "crds" / "llmdeployments.kubellm.io.yaml").read_bytes() == generated, (
        "charts/kubellm/crds/ drifted from crds/: run `make crds`"
    )


def test_rendered_crd_is_the_generated_one(rendered):
    generated = yaml.safe_load((ROOT / "crds" / "llmdeployments.kubellm.io.yaml").read_text())
    crd = the(rendered["defaults"], "CustomResourceDefinition")
    assert crd == generated
    assert crd["metadata"]["name"] == api.CRD_NAME
    assert [v["name"] for v in crd["spec"]["versions"]] == [api.VERSION]


def test_versions_agree_with_the_project():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert CHART_META["appVersion"] == project == api.RUNTIME_VERSION
    assert CHART_META["apiVersion"] == "v2" and CHART_META["name"] == "kubellm"


def test_defaults_agree_with_the_operator_cli():
    defaults = build_parser().parse_args(["operator", "-A"])
    assert VALUES["metrics"]["port"] == defaults.metrics_port
    assert VALUES["autoscaling"]["prometheusUrl"] == defaults.prometheus_url == autoscaling_mod.DEFAULT_PROMETHEUS_URL


def test_names_fit_with_the_longest_release_name(helm):
    release = "kubellm-" + "r" * 45  # helm allows release names of up to 53 characters
    result = helm("template", release, str(CHART), "--namespace", NAMESPACE, values=CASES["everything"])
    assert result.returncode == 0, result.stderr
    for doc in filter(None, yaml.safe_load_all(result.stdout)):
        assert len(doc["metadata"]["name"]) <= 63, doc["metadata"]["name"]


# --------------------------------------------------------------------------------------------------
# The operator Deployment
# --------------------------------------------------------------------------------------------------


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (c,) = the(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def operator_args(docs: list[dict[str, Any]]):
    c = container(docs)
    assert c["command"] == ["kubellm"]
    return build_parser().parse_args(c["args"])  # exits (fails the test) on a flag the CLI does not have


@pytest.mark.parametrize("case", CASES)
def test_deployment_runs_one_standalone_replica_the_cli_understands(rendered, case):
    docs, values = rendered[case], merged(VALUES, CASES[case])
    deployment = the(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    args = operator_args(docs)
    assert args.cmd == "operator" and args.standalone
    namespaces = values["watchNamespaces"]
    assert (args.namespaces or [], args.all_namespaces) == (namespaces, not namespaces)
    assert args.metrics_port == values["metrics"]["port"]
    assert args.prometheus_url == values["autoscaling"]["prometheusUrl"]
    assert (args.log_level, args.log_format) == (values["operator"]["logLevel"], values["operator"]["logFormat"])
    pod = deployment["spec"]["template"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["serviceAccountName"] == (values["serviceAccount"]["name"] or "kubellm-operator")


def test_default_image_is_the_operator_at_the_app_version(rendered):
    c = container(rendered["defaults"])
    assert c["image"] == f"ghcr.io/kubellm/operator:{CHART_META['appVersion']}"
    assert c["imagePullPolicy"] == "IfNotPresent"
    assert container(rendered["everything"])["image"] == "registry.example:5000/kubellm/operator:dev"


def test_liveness_probe_is_kopfs_endpoint(rendered):
    c = container(rendered["defaults"])
    probe = c["livenessProbe"]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert probe["path"] == "/healthz" and ports[probe["port"]] == 8080
    assert operator_args(rendered["defaults"]).liveness == "http://0.0.0.0:8080/healthz"


@pytest.mark.parametrize("case", CASES)
def test_pod_meets_the_restricted_pod_security_standard(rendered, case):
    pod = the(rendered[case], "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    assert all("hostPath" not in v for v in pod.get("volumes", []))
    for c in pod["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]} and not sc.get("privileged")
        assert set(c["resources"]) == {"requests", "limits"} and c["resources"]["limits"]["memory"]


# --------------------------------------------------------------------------------------------------
# RBAC: exactly operator/control/rbac.py
# --------------------------------------------------------------------------------------------------


def granted(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    out = set()
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule  # no resourceNames, no nonResourceURLs
        assert "*" not in rule["apiGroups"] + rule["resources"] + rule["verbs"], rule
        out |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return out


def bound_to_the_operator(binding: dict[str, Any], docs: list[dict[str, Any]]) -> None:
    service_account = the(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": service_account, "namespace": NAMESPACE}]


@pytest.mark.parametrize("case", CASES)
def test_rbac_grants_exactly_what_the_operator_uses(rendered, case):
    docs, values = rendered[case], merged(VALUES, CASES[case])
    if not values["rbac"]["create"]:
        assert not [d for d in docs if d["apiVersion"].startswith("rbac.authorization.k8s.io/")]
        assert not of_kind(docs, "ServiceAccount")
        return
    namespaced = rbac.namespaced_grants(keda=values["rbac"]["keda"], service_monitors=values["rbac"]["serviceMonitors"],
                                        prometheus_rules=values["rbac"]["prometheusRules"],
                                        inference_pools=values["rbac"]["inferencePools"],
                                        leader_worker_sets=values["rbac"]["leaderWorkerSets"])
    namespaces = values["watchNamespaces"]
    cluster_role, cluster_binding = the(docs, "ClusterRole"), the(docs, "ClusterRoleBinding")
    assert cluster_binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                          "name": cluster_role["metadata"]["name"]}  # fmt: skip
    bound_to_the_operator(cluster_binding, docs)
    cluster = rbac.cluster_grants(all_namespaces=not namespaces)
    if not namespaces:
        assert granted(cluster_role) == rbac.triples(cluster + namespaced)
        assert not of_kind(docs, "Role") and not of_kind(docs, "RoleBinding")
        return
    assert granted(cluster_role) == rbac.triples(cluster)
    roles = {r["metadata"]["namespace"]: r for r in of_kind(docs, "Role")}
    bindings = {b["metadata"]["namespace"]: b for b in of_kind(docs, "RoleBinding")}
    assert sorted(roles) == sorted(bindings) == sorted(namespaces)
    for namespace in namespaces:
        assert granted(roles[namespace]) == rbac.triples(namespaced)
        assert bindings[namespace]["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                                  "name": roles[namespace]["metadata"]["name"]}  # fmt: skip
        bound_to_the_operator(bindings[namespace], docs)


def test_optional_grants_follow_the_values(rendered):
    def resources(case: str) -> set[str]:
        docs = rendered[case]
        return {r for role in of_kind(docs, "ClusterRole") + of_kind(docs, "Role") for _, r, _ in granted(role)}

    optional = {"scaledobjects", "servicemonitors", "inferencepools", "leaderworkersets"}
    assert optional.isdisjoint(resources("defaults"))
    assert resources("keda") & optional == {"scaledobjects"}
    assert resources("inference-pools") & optional == {"inferencepools"}
    assert resources("leader-worker-sets") & optional == {"leaderworkersets"}
    assert optional <= resources("everything")


# --------------------------------------------------------------------------------------------------
# Metrics Service and ServiceMonitor
# --------------------------------------------------------------------------------------------------


def metrics_service(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (service,) = [s for s in of_kind(docs, "Service") if s["metadata"]["name"].endswith("-metrics")]
    return service


@pytest.mark.parametrize("case", CASES)
def test_metrics_service_reaches_the_operators_metrics_port(rendered, case):
    docs, values = rendered[case], merged(VALUES, CASES[case])
    service, pod = metrics_service(docs), the(docs, "Deployment")["spec"]["template"]
    (port,) = service["spec"]["ports"]
    assert port["name"] == "metrics" and port["port"] == values["metrics"]["port"]
    ports = {p["name"]: p["containerPort"] for p in container(docs)["ports"]}
    assert ports[port["targetPort"]] == values["metrics"]["port"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()


@pytest.mark.parametrize("case", CASES)
def test_service_monitor_scrapes_the_metrics_service(rendered, case):
    docs, values = rendered[case], merged(VALUES, CASES[case])
    monitors = of_kind(docs, "ServiceMonitor")
    if not values["metrics"]["serviceMonitor"]["enabled"]:
        assert not monitors
        return
    (monitor,) = monitors
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["metadata"]["namespace"] == NAMESPACE
    assert values["metrics"]["serviceMonitor"]["labels"].items() <= monitor["metadata"]["labels"].items()
    spec = monitor["spec"]
    assert set(spec) == {"selector", "namespaceSelector", "endpoints"}
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    service = metrics_service(docs)
    assert spec["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    # ...and selects no other Service of the chart
    others = [s for s in of_kind(docs, "Service") if s is not service]
    assert not any(spec["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items() for s in others)
    (endpoint,) = spec["endpoints"]
    assert set(endpoint) == {"port", "path", "interval", "scrapeTimeout"}
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    sm = values["metrics"]["serviceMonitor"]
    assert (endpoint["interval"], endpoint["scrapeTimeout"]) == (sm["interval"], sm["scrapeTimeout"])


# --------------------------------------------------------------------------------------------------
# Autoscaling plumbing: prometheus-adapter values
# --------------------------------------------------------------------------------------------------


def test_prometheus_adapter_values_serve_the_metric_the_hpas_target():
    adapter = yaml.safe_load((CHART / "files" / "prometheus-adapter-values.yaml").read_text())
    assert adapter["rules"]["custom"] == [autoscaling_mod.PROMETHEUS_ADAPTER_RULE]
    assert adapter["rules"]["default"] is False
    (rule,) = adapter["rules"]["custom"]
    # The adapter renames series with a Go regexp and ${1}-style references; do the same in Python.
    replacement = re.sub(r"\$\{(\d+)\}", r"\\\1", rule["name"]["as"])
    assert re.sub(rule["name"]["matches"], replacement, api.QUEUE_DEPTH_METRIC) == autoscaling_mod.HPA_METRIC_NAME
    assert rule["seriesQuery"].startswith(api.QUEUE_DEPTH_METRIC + "{")
    url = f"{adapter['prometheus']['url']}:{adapter['prometheus']['port']}"
    assert url == autoscaling_mod.DEFAULT_PROMETHEUS_URL  # the same Prometheus the KEDA backend queries by default


def test_hpa_asks_for_the_adapters_metric():
    ld = render_cli.load(yaml.safe_load((ROOT / "examples" / "llmdeployment-autoscaled.yaml").read_text()))
    hpa = autoscaling_mod.render_hpa(ld)
    assert hpa is not None
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == autoscaling_mod.HPA_METRIC_NAME
