"""The chart's activator (templates/activator.yaml, values activator.*): rendered with the real helm (the fixture
and helpers of test_chart.py), every object through kubernetes-validate --strict, the activator's and the
operator's flags parsed by the real CLI, RBAC equal to operator/control/rbac.py's tables, and the names the operator and
the activator find each other by."""

# ruff: noqa: F811  (the tests take test_chart's `helm` fixture, imported below, as a parameter)

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml
from test_chart import (  # noqa: F401  (helm is a fixture)
    CHART,
    K8S_VERSIONS,
    NAMESPACE,
    RELEASE,
    SCHEMA,
    VALUES,
    granted,
    helm,
    merged,
    of_kind,
    template,
)

from kubellm.operator.control import rbac
from kubellm.operator.render import activation
from kubellm.runtime.cli import activator_settings, build_parser

ON = {"activator": {"enabled": True}}
CASES: dict[str, dict[str, Any]] = {
    "activator": ON,
    "activator-namespaces": {
        "watchNamespaces": ["ml", "team-a"],
        "rbac": {"keda": True},
        "activator": {"enabled": True, "replicas": 3, "holdTimeoutSeconds": 120, "maxHeld": 50, "adminPort": 9100,
                      "namespaces": ["ml", "team-a"], "maxHeldTotal": 80, "maxBufferedMiB": 32,
                      "networkPolicy": {"proxyFrom": [{"namespaceSelector": {"matchLabels": {"team": "a"}}}],
                                        "adminFrom": []},
                      "resources": {"requests": {"cpu": "200m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}}},
        "operator": {"image": {"repository": "registry.example:5000/kubellm/operator", "tag": "dev"},
                     "imagePullSecrets": [{"name": "registry"}], "logLevel": "debug"},
    },
    "activator-scraped": {**ON, "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}},
    "activator-own-rbac": {**ON, "rbac": {"create": False},
                           "serviceAccount": {"create": False, "name": "ops-kubellm"}},
    "activator-cluster-wide": {"activator": {"enabled": True, "allNamespaces": True,
                                             "networkPolicy": {"enabled": False}}},
}  # fmt: skip
ACTIVATOR = "kubellm-activator"


@pytest.fixture(scope="module")
def rendered(helm) -> dict[str, list[dict[str, Any]]]:
    return {name: template(helm, values) for name, values in {**CASES, "defaults": {}}.items()}


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    return doc


def activator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (c,) = named(docs, "Deployment", ACTIVATOR)["spec"]["template"]["spec"]["containers"]
    return c


def operator_args(docs: list[dict[str, Any]]):
    (c,) = named(docs, "Deployment", "kubellm-operator")["spec"]["template"]["spec"]["containers"]
    return build_parser().parse_args(c["args"])


@pytest.mark.parametrize("case", CASES)
def test_helm_lint_strict_passes(helm, case):
    result = helm("lint", "--strict", str(CHART), values=CASES[case])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("case", CASES)
def test_rendered_objects_are_valid(rendered, case):
    for doc in rendered[case]:
        if doc["kind"] == "ServiceMonitor":
            continue  # no upstream schema: test_service_monitor_scrapes_the_activators_metrics
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
        if doc["kind"] not in ("CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding", "Role",
                               "RoleBinding"):  # fmt: skip
            assert doc["metadata"].get("namespace") == NAMESPACE
    jsonschema.Draft7Validator(SCHEMA).validate(merged(VALUES, CASES[case]))


def test_off_by_default(rendered):
    docs = rendered["defaults"]
    assert not [d for d in docs if d["metadata"]["name"].startswith(ACTIVATOR)]
    assert VALUES["activator"]["enabled"] is False
    args = operator_args(docs)
    assert (args.activator_service, args.activator_url) == (None, None)
    assert "endpointslices" not in {r for role in of_kind(docs, "ClusterRole") for _, r, _ in granted(role)}


@pytest.mark.parametrize("case", CASES)
def test_activator_runs_the_operator_image_with_the_values(rendered, case):
    docs, values = rendered[case], merged(VALUES, CASES[case])
    deployment = named(docs, "Deployment", ACTIVATOR)
    assert deployment["spec"]["replicas"] == values["activator"]["replicas"]
    c = activator_container(docs)
    operator_image = named(docs, "Deployment", "kubellm-operator")["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == operator_image["image"] and c["command"] == ["kubellm"]
    args = build_parser().parse_args(c["args"])  # exits (fails the test) on a flag the CLI does not have
    assert args.cmd == "activator"
    assert (args.hold_timeout, args.max_held) == (values["activator"]["holdTimeoutSeconds"], values["activator"]["maxHeld"])
    assert (args.max_held_total, args.max_buffered_mib) == (values["activator"]["maxHeldTotal"],
                                                            values["activator"]["maxBufferedMiB"])  # fmt: skip
    # The namespaces it serves: the release's by default, the listed ones, or all (never from a request).
    if values["activator"]["allNamespaces"]:
        assert args.all_namespaces and not args.namespaces
    else:
        assert not args.all_namespaces and args.namespaces == (values["activator"]["namespaces"] or [NAMESPACE])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": args.port, "admin": args.admin_port} and args.admin_port == values["activator"]["adminPort"]
    for probe in (c["readinessProbe"], c["livenessProbe"]):
        assert probe["httpGet"] == {"path": "/healthz", "port": "admin"}
    assert c["resources"] == values["activator"]["resources"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["seccompProfile"] == {
        "type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert pod.get("imagePullSecrets", []) == values["operator"]["imagePullSecrets"]


def test_defaults_agree_with_the_activator_cli():
    defaults = build_parser().parse_args(["activator"])
    limits, _ = activator_settings(defaults)  # a limit flag left out takes the activator's own default
    assert VALUES["activator"]["holdTimeoutSeconds"] == limits.hold_timeout
    assert VALUES["activator"]["maxHeld"] == limits.max_held
    assert VALUES["activator"]["maxHeldTotal"] == limits.max_held_total
    assert VALUES["activator"]["maxBufferedMiB"] == limits.max_buffered // 2**20
    assert VALUES["activator"]["adminPort"] == defaults.admin_port


@pytest.mark.parametrize("case", CASES)
def test_operator_finds_the_activators_pods_and_admin_port(rendered, case):
    """--activator-service names the Service whose slices list the activator pods under the port name the
    operator reads; --activator-url reaches the admin port through that Service."""
    docs = rendered[case]
    args = operator_args(docs)
    service = named(docs, "Service", ACTIVATOR)
    assert args.activator_service == f"{NAMESPACE}/{service['metadata']['name']}"
    pod_labels = named(docs, "Deployment", ACTIVATOR)["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    container_ports = {p["name"] for p in activator_container(docs)["ports"]}
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    # An EndpointSlice names a port by the Service port's name and carries the pod's port number.
    assert service_ports[activation.ACTIVATOR_PORT_NAME]["targetPort"] in container_ports
    url = urlsplit(args.activator_url)
    assert url.hostname == f"{service['metadata']['name']}.{NAMESPACE}.svc"
    assert url.port == service_ports["admin"]["port"] and service_ports["admin"]["targetPort"] == "admin"
    # The activator's pods must not be the operator's: its Service selects the activator only.
    operator_labels = named(docs, "Deployment", "kubellm-operator")["spec"]["template"]["metadata"]["labels"]
    assert not service["spec"]["selector"].items() <= operator_labels.items()


def test_rbac_grants_exactly_what_the_activator_and_the_operator_use(rendered):
    def bound(binding: dict[str, Any], role: dict[str, Any], service_account: str) -> None:
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": role["kind"],
                                      "name": role["metadata"]["name"]}  # fmt: skip
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": service_account, "namespace": NAMESPACE}]

    def activator_roles(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
        return [r for r in of_kind(docs, kind) if r["metadata"]["name"] == ACTIVATOR]

    # By default: a Role in the release's namespace only, even with an operator that watches every namespace.
    docs = rendered["activator"]
    assert named(docs, "ServiceAccount", ACTIVATOR)
    assert not activator_roles(docs, "ClusterRole") and not activator_roles(docs, "ClusterRoleBinding")
    (role,) = activator_roles(docs, "Role")
    assert role["metadata"]["namespace"] == NAMESPACE and granted(role) == rbac.triples(rbac.ACTIVATOR)
    (binding,) = activator_roles(docs, "RoleBinding")
    assert binding["metadata"]["namespace"] == NAMESPACE
    bound(binding, role, ACTIVATOR)
    operator_role = named(docs, "ClusterRole", "kubellm-operator")
    assert granted(operator_role) == rbac.triples(
        rbac.cluster_grants(all_namespaces=True) + rbac.namespaced_grants(keda=False, service_monitors=False,
                                                                           activator=True))  # fmt: skip
    assert rbac.triples(rbac.ACTIVATOR_ENDPOINTS) <= granted(operator_role)

    # Cluster-wide only when asked for.
    docs = rendered["activator-cluster-wide"]
    role = named(docs, "ClusterRole", ACTIVATOR)
    assert granted(role) == rbac.triples(rbac.ACTIVATOR)
    bound(named(docs, "ClusterRoleBinding", ACTIVATOR), role, ACTIVATOR)
    assert not activator_roles(docs, "Role")

    # Listed namespaces: Roles there, and one for the operator to read the activator's slices in its own.
    docs = rendered["activator-namespaces"]
    assert not activator_roles(docs, "ClusterRole")
    assert {r["metadata"]["namespace"] for r in activator_roles(docs, "Role")} == {"ml", "team-a"}
    for namespace in ("ml", "team-a"):
        (role,) = [r for r in activator_roles(docs, "Role") if r["metadata"]["namespace"] == namespace]
        assert granted(role) == rbac.triples(rbac.ACTIVATOR)
        (binding,) = [b for b in activator_roles(docs, "RoleBinding") if b["metadata"]["namespace"] == namespace]
        bound(binding, role, ACTIVATOR)
        (operator_role,) = [r for r in of_kind(docs, "Role") if r["metadata"]["namespace"] == namespace
                            and r["metadata"]["name"] == "kubellm-operator"]  # fmt: skip
        assert granted(operator_role) == rbac.triples(
            rbac.namespaced_grants(keda=True, service_monitors=False, activator=True))
    reader = named(docs, "Role", "kubellm-activator-view")
    assert reader["metadata"]["namespace"] == NAMESPACE
    assert granted(reader) == rbac.triples(rbac.ACTIVATOR_ENDPOINTS)
    bound(named(docs, "RoleBinding", "kubellm-activator-view"), reader, "kubellm-operator")

    # rbac.create false: none, but the activator still gets its own ServiceAccount to be granted to.
    docs = rendered["activator-own-rbac"]
    assert not [d for d in docs if d["apiVersion"].startswith("rbac.authorization.k8s.io/")]
    assert named(docs, "ServiceAccount", ACTIVATOR)


def test_network_policy_admits_clients_on_the_proxy_port_and_only_keda_and_prometheus_on_the_admin_port(rendered):
    docs = rendered["activator"]
    policy = named(docs, "NetworkPolicy", ACTIVATOR)
    pod_labels = named(docs, "Deployment", ACTIVATOR)["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    rules = {rule["ports"][0]["port"]: rule for rule in policy["spec"]["ingress"]}
    assert set(rules) == {p["name"] for p in activator_container(docs)["ports"]} == {"http", "admin"}
    assert all(len(rule["ports"]) == 1 for rule in rules.values())
    assert "from" not in rules["http"]  # as open as the LLMDeployments' own Services
    assert rules["admin"]["from"] == VALUES["activator"]["networkPolicy"]["adminFrom"]
    admitted = {p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for p in rules["admin"]["from"]}
    assert admitted == {"keda", "monitoring"}

    # Narrowed clients; no admin sources means no admin rule (an empty "from" would admit everyone).
    policy = named(rendered["activator-namespaces"], "NetworkPolicy", ACTIVATOR)
    (rule,) = policy["spec"]["ingress"]
    assert rule == {"ports": [{"port": "http", "protocol": "TCP"}],
                    "from": [{"namespaceSelector": {"matchLabels": {"team": "a"}}}]}  # fmt: skip
    assert not of_kind(rendered["activator-cluster-wide"], "NetworkPolicy")
    assert not of_kind(rendered["defaults"], "NetworkPolicy")


def test_names_fit_with_the_longest_release_name(helm):
    release = "kubellm-" + "r" * 45
    result = helm("template", release, str(CHART), "--namespace", NAMESPACE,
                  values=CASES["activator-namespaces"])  # fmt: skip
    assert result.returncode == 0, result.stderr
    docs = list(filter(None, yaml.safe_load_all(result.stdout)))
    assert [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-activator")]

    for doc in docs:
        assert len(doc["metadata"]["name"]) <= 63, doc["metadata"]["name"]


@pytest.mark.parametrize(
    "bad, complaint",
    [
        ({"activator": {"adminPort": 8000}}, "/activator/adminPort"),
        ({"activator": {"holdTimeoutSeconds": 0}}, "/activator/holdTimeoutSeconds"),
        ({"activator": {"maxHeld": "many"}}, "/activator/maxHeld"),
        ({"activator": {"enable": True}}, "'enable' not allowed"),
    ],
)
def test_helm_rejects_activator_values_the_schema_forbids(helm, bad, complaint):
    result = helm("template", RELEASE, str(CHART), values=bad)
    assert result.returncode != 0 and complaint in result.stderr, result.stderr
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(SCHEMA).validate(merged(VALUES, bad))


def test_service_monitor_scrapes_the_activators_metrics(rendered):
    assert not [m for m in of_kind(rendered["activator"], "ServiceMonitor")]  # metrics.serviceMonitor is off
    docs = rendered["activator-scraped"]
    monitor = named(docs, "ServiceMonitor", ACTIVATOR)
    service = named(docs, "Service", ACTIVATOR)
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    operator_metrics = [s for s in of_kind(docs, "Service") if s["metadata"]["name"].endswith("-metrics")]
    assert not any(monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
                   for s in operator_metrics)  # fmt: skip
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["port"] == "admin" and monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
