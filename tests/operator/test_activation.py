"""Scale from zero, the pure parts (operator/render/activation.py, and what render/status do for minReplicas 0):
the <name>-pods Service, the activator's EndpointSlice at zero and none above it (validated with
kubernetes-validate --strict), the activator's addresses read from its Service's slices, the KEDA activity
triggers, status.autoscaling.scaledToZeroSince / activation and the ScaledToZero Event."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kubellm.operator import api, render
from kubellm.operator.render import InvalidSpec, activation, naming
from kubellm.operator.render import autoscaling as autoscaling_mod
from kubellm.operator.render import cli as render_cli
from kubellm.operator.render import service as service_mod
from kubellm.operator.status import observe as status

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSIONS = ("1.31", "1.37")
UID = "6f1c2a8e-3b5d-4c7e-9f10-2a3b4c5d6e7f"
ACTIVATOR_URL = "http://kubellm-activator.kubellm-system.svc:9090"
ACTIVATOR = activation.ActivatorEndpoints("IPv4", ("10.0.3.7", "10.0.4.2"), 8000)
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def make(name: str = "llm", min_replicas: int = 0, **autoscaling: Any) -> api.LLMDeployment:
    spec = {"model": {"uri": "smollm2"},
            "autoscaling": {"enabled": True, "backend": "keda", "minReplicas": min_replicas, **autoscaling}}
    return render_cli.load({"apiVersion": api.API_VERSION, "kind": api.KIND,
                        "metadata": {"name": name, "namespace": "team-a", "uid": UID}, "spec": spec})  # fmt: skip


def validate(manifest: dict[str, Any]) -> None:
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(manifest, version, strict=True)


def slice_of(addresses: list[tuple[str, bool | None]], port: int = 8000, port_name: str = "http",
             name: str = "kubellm-activator-abcde", address_type: str = "IPv4") -> dict[str, Any]:
    endpoints = []
    for address, ready in addresses:
        endpoint: dict[str, Any] = {"addresses": [address]}
        if ready is not None:
            endpoint["conditions"] = {"ready": ready}
        endpoints.append(endpoint)
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": address_type,
            "metadata": {"name": name, "labels": {activation.SERVICE_NAME_LABEL: "kubellm-activator"}},
            "ports": [{"name": port_name, "port": port, "protocol": "TCP"}], "endpoints": endpoints}  # fmt: skip


# --------------------------------------------------------------------------------------------------
# The <name>-pods Service
# --------------------------------------------------------------------------------------------------


def test_pods_service_selects_the_pods_on_the_clients_port_and_escapes_the_service_monitor():
    ld = make()
    children = render.render(ld, service_monitor_available=True)
    client, pods = [c for c in children if c["kind"] == "Service"]
    assert (client["metadata"]["name"], pods["metadata"]["name"]) == ("llm", "llm-pods")
    assert pods["spec"]["selector"] == client["spec"]["selector"] == naming.selector_labels(ld)
    assert pods["spec"]["ports"] == client["spec"]["ports"] and pods["spec"]["type"] == "ClusterIP"
    assert pods["metadata"]["ownerReferences"] == [naming.owner_reference(ld)]
    # The ServiceMonitor selects Services by labels: it must find the client Service only, or every pod would be
    # scraped twice and the autoscalers' sums doubled.
    (sm,) = [c for c in children if c["kind"] == "ServiceMonitor"]
    selector = sm["spec"]["selector"]["matchLabels"].items()
    assert selector <= client["metadata"]["labels"].items()
    assert not selector <= pods["metadata"]["labels"].items()
    assert pods["metadata"]["labels"][naming.LABEL_LLMDEPLOYMENT] == naming.label_value(ld)  # found for pruning
    validate(pods)


def test_no_pods_service_without_scale_to_zero():
    for ld in (make(min_replicas=1), render_cli.load({"apiVersion": api.API_VERSION, "kind": api.KIND,
                                                  "metadata": {"name": "x"}, "spec": {"model": {"uri": "smollm2"}}})):
        assert [c["metadata"]["name"] for c in render.render(ld) if c["kind"] == "Service"] == [naming.child_name(ld)]


def test_activator_upstream_is_the_pods_service_on_the_rendered_port():
    from kubellm.operator.activator import Catalog

    ld = make(name="qwen")
    obj = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "qwen", "namespace": "team-a"},
           "spec": {**ld.spec.model_dump(by_alias=True, exclude_none=True), "service": {"port": 8080}}}  # fmt: skip
    target = Catalog(None, ["team-a"]).target_of(obj)
    (pods_service,) = [c for c in render.render(render_cli.load(obj)) if c["metadata"]["name"].endswith("-pods")]
    assert target.upstream == f"http://{pods_service['metadata']['name']}.team-a.svc:8080"
    assert pods_service["spec"]["ports"][0]["port"] == 8080
    assert Catalog(None, ["team-a"]).target_of({**obj, "spec": {**obj["spec"], "autoscaling": {"enabled": False}}}) is None


def test_a_name_too_long_for_the_pods_service_is_refused_with_the_limit():
    with pytest.raises(InvalidSpec, match="shorten metadata.name to at most 58 characters"):
        render.render(make(name="a" * 59))
    assert [c["metadata"]["name"] for c in render.render(make(name="a" * 58)) if c["kind"] == "Service"][1] == (
        "a" * 58 + "-pods")


# --------------------------------------------------------------------------------------------------
# Routing: the activator's EndpointSlice at zero, none once a pod is ready
# --------------------------------------------------------------------------------------------------


def test_at_zero_an_endpoint_slice_adds_the_activator_to_the_service():
    ld = make()
    route, slices = activation.render_routing(ld, 0, ACTIVATOR)
    assert route.route == activation.ROUTE_ACTIVATOR and route.activator_endpoints == 2
    (s,) = slices
    validate(s)
    service = service_mod.render_service(ld)
    # kube-proxy joins a slice to its Service by this label, and a slice port to a Service port by name.
    assert s["metadata"]["labels"][activation.SERVICE_NAME_LABEL] == service["metadata"]["name"]
    assert [p["name"] for p in s["ports"]] == [p["name"] for p in service["spec"]["ports"]]
    assert s["ports"][0]["port"] == 8000
    # Not the Kubernetes controller's: it leaves slices with another manager alone.
    assert s["metadata"]["labels"][activation.SLICE_MANAGED_BY_LABEL] != "endpointslice-controller.k8s.io"
    assert s["metadata"]["ownerReferences"] == [naming.owner_reference(ld)]  # deleted with the LLMDeployment
    assert s["metadata"]["labels"][naming.LABEL_LLMDEPLOYMENT] == naming.label_value(ld)
    assert [e["addresses"] for e in s["endpoints"]] == [["10.0.3.7"], ["10.0.4.2"]]
    assert all(e["conditions"] == {"ready": True} for e in s["endpoints"])
    assert s["metadata"]["name"] != service["metadata"]["name"]  # never the controller's own slice name


def test_the_service_itself_never_changes_with_the_route():
    ld = make()
    before = render.render(ld)
    activation.render_routing(ld, 0, ACTIVATOR)
    assert render.render(ld) == before


@pytest.mark.parametrize("ready", [1, 3])
def test_with_a_ready_pod_the_service_routes_to_its_pods(ready):
    route, slices = activation.render_routing(make(), ready, ACTIVATOR)
    assert (route.route, route.activator_endpoints, slices) == (activation.ROUTE_PODS, 0, [])


def test_without_a_ready_activator_the_service_stays_on_its_pods_and_says_why():
    route, slices = activation.render_routing(make(), 0, None)
    assert (route.route, slices) == (activation.ROUTE_PODS, [])
    assert "no activator is ready" in route.message and "activator.enabled=true" in route.message


def test_no_routing_for_deployments_that_do_not_scale_to_zero():
    assert activation.render_routing(make(min_replicas=1), 0, ACTIVATOR) == (None, [])


def test_activator_endpoints_are_the_ready_addresses_on_the_http_port():
    slices = [
        slice_of([("10.0.4.2", True), ("10.0.3.7", None), ("10.0.9.9", False)], name="b"),
        slice_of([("10.0.5.5", True)], port_name="admin", port=9090, name="a"),  # no http port: not this one
    ]
    assert activation.activator_endpoints(slices) == activation.ActivatorEndpoints(
        "IPv4", ("10.0.3.7", "10.0.4.2"), 8000)
    assert activation.activator_endpoints([slice_of([("10.0.9.9", False)])]) is None
    assert activation.activator_endpoints([]) is None
    six = activation.activator_endpoints([slice_of([("fd00::7", True)], address_type="IPv6")])
    assert six == activation.ActivatorEndpoints("IPv6", ("fd00::7",), 8000)
    validate(activation.render_activator_slice(make(), six))


# --------------------------------------------------------------------------------------------------
# KEDA: idle means no request anywhere
# --------------------------------------------------------------------------------------------------


def test_scale_to_zero_waits_for_no_request_anywhere():
    ld = make(scaleToZeroAfterSeconds=900, scaleDownStabilizationSeconds=300)
    so = autoscaling_mod.render_scaled_object(ld, prometheus_url="http://prom:9090", activator_url=ACTIVATOR_URL)
    assert so["spec"]["cooldownPeriod"] == 900  # the idle time, not the scale-down window
    queue, in_flight, held = so["spec"]["triggers"]
    assert queue["metadata"]["threshold"] == "4"  # the queue alone sizes the deployment
    assert "kubellm:num_requests_running" in in_flight["metadata"]["query"]
    assert "kubellm:num_requests_waiting" in in_flight["metadata"]["query"]
    assert held["type"] == "metrics-api" and held["metadata"]["valueLocation"] == "requests"
    assert held["metadata"]["url"] == f"{ACTIVATOR_URL}/activity/team-a/llm"
    # Activity triggers wake (activation above 0) but never ask for a second pod.
    for t in (in_flight, held):
        threshold = t["metadata"].get("threshold") or t["metadata"]["targetValue"]
        assert float(threshold) >= 1e6
    assert (in_flight["metadata"]["activationThreshold"], held["metadata"]["activationTargetValue"]) == ("0", "0")


@pytest.mark.asyncio
async def test_activity_url_matches_the_activators_route():
    from aiohttp.test_utils import make_mocked_request

    from kubellm.operator.activator import Activator

    path = autoscaling_mod.activity_url(make(name="qwen"), ACTIVATOR_URL).removeprefix(ACTIVATOR_URL)
    activator = Activator(lambda r: None, None)
    match = await activator.admin_app().router.resolve(make_mocked_request("GET", path))
    assert dict(match) == {"namespace": "team-a", "name": "qwen"}
    response = await match.handler(make_mocked_request("GET", path, match_info=dict(match)))
    assert json.loads(response.body) == {"requests": 0, "held": 0, "forwarding": 0}


def test_without_scale_to_zero_the_cooldown_and_triggers_are_as_before():
    ld = make(min_replicas=1, scaleDownStabilizationSeconds=600)
    so = autoscaling_mod.render_scaled_object(ld, activator_url=ACTIVATOR_URL)
    assert so["spec"]["cooldownPeriod"] == 600 and len(so["spec"]["triggers"]) == 1


def test_scale_to_zero_example_renders_with_the_activity_triggers():
    doc = yaml.safe_load((ROOT / "examples" / "llmdeployment-scale-to-zero.yaml").read_text())
    ld = render_cli.load({**doc, "metadata": {**doc["metadata"], "namespace": "ml"}})
    children = render.render(ld, service_monitor_available=True, activator_url=ACTIVATOR_URL)
    assert [c["kind"] for c in children] == ["Service", "Service", "Deployment", "PodDisruptionBudget",
                                             "ScaledObject", "ServiceMonitor"]  # fmt: skip
    (so,) = [c for c in children if c["kind"] == "ScaledObject"]
    assert so["spec"]["cooldownPeriod"] == 900 and len(so["spec"]["triggers"]) == 3
    for c in children:
        if c["kind"] == "Service":
            validate(c)


# --------------------------------------------------------------------------------------------------
# Status: scaledToZeroSince, activation, the ScaledToZero Event
# --------------------------------------------------------------------------------------------------


def deployment(replicas: int, ready: int) -> dict[str, Any]:
    return {"metadata": {"name": "llm", "generation": 1},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"a": "b"}}},
            "status": {"observedGeneration": 1, "replicas": ready, "readyReplicas": ready, "updatedReplicas": ready,
                       "availableReplicas": ready}}  # fmt: skip


def keda_hpa(desired: int) -> dict[str, Any]:
    return {"status": {"currentReplicas": desired, "desiredReplicas": desired}}


def observe(ld, replicas, ready, previous, now, route=None):
    return status.observe(ld, deployment(replicas, ready), keda_hpa(replicas), [], previous, now=now,
                          template_changed=False, routing=route)  # fmt: skip


def test_reaching_zero_is_announced_once_and_dated():
    ld = make(scaleToZeroAfterSeconds=600)
    ld.metadata["generation"] = 1
    up, _ = observe(ld, 1, 1, None, T0, activation.routing(ld, 1, ACTIVATOR))
    assert up.autoscaling.scaled_to_zero_since is None and up.autoscaling.activation.route == "Pods"

    zero, events = observe(ld, 0, 0, up, T0 + timedelta(minutes=11), activation.routing(ld, 0, ACTIVATOR))
    assert zero.autoscaling.scaled_to_zero_since == T0 + timedelta(minutes=11)
    assert zero.autoscaling.activation.route == "Activator" and zero.autoscaling.activation.activator_endpoints == 2
    (event,) = [e for e in events if e.reason == "ScaledToZero"]
    assert event.type == "Normal" and "600s" in event.message
    assert zero.get_condition("Ready").reason == "ScaledToZero"

    later, events = observe(ld, 0, 0, zero, T0 + timedelta(hours=2), activation.routing(ld, 0, ACTIVATOR))
    assert later.autoscaling.scaled_to_zero_since == T0 + timedelta(minutes=11)  # since then, not since now
    assert not [e for e in events if e.reason == "ScaledToZero"]


def test_waking_records_the_activation_and_clears_the_zero_time():
    ld = make()
    ld.metadata["generation"] = 1
    zero, _ = observe(ld, 0, 0, None, T0, activation.routing(ld, 0, ACTIVATOR))
    # The activator scaled it to 1; the pod is still loading: requests stay with the activator.
    waking, events = observe(ld, 1, 0, zero, T0 + timedelta(seconds=5), activation.routing(ld, 0, ACTIVATOR))
    assert waking.autoscaling.scaled_to_zero_since is None
    assert waking.autoscaling.activation.last_activation_time == T0 + timedelta(seconds=5)
    assert waking.autoscaling.activation.route == "Activator"
    assert not [e for e in events if e.reason == "ScaledToZero"]
    served, _ = observe(ld, 1, 1, waking, T0 + timedelta(seconds=90), activation.routing(ld, 1, ACTIVATOR))
    assert served.autoscaling.activation.route == "Pods"
    assert served.autoscaling.activation.last_activation_time == T0 + timedelta(seconds=5)
    # The status round-trips through the CRD's shape.
    assert api.LLMDeploymentStatus.model_validate(copy.deepcopy(served.to_k8s())) == served


def test_no_scale_to_zero_status_for_deployments_that_keep_a_pod():
    ld = make(min_replicas=1)
    ld.metadata["generation"] = 1
    new, events = observe(ld, 1, 1, None, T0)
    assert new.autoscaling.scaled_to_zero_since is None and new.autoscaling.activation is None
    assert not [e for e in events if e.reason == "ScaledToZero"]


def test_kubellm_render_takes_the_operators_activator_url(capsys):
    path = str(ROOT / "examples" / "llmdeployment-scale-to-zero.yaml")
    assert render_cli.main(["-f", path, "--activator-url", ACTIVATOR_URL]) == 0
    (so,) = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d and d["kind"] == "ScaledObject"]
    assert so["spec"]["triggers"][-1]["metadata"]["url"] == f"{ACTIVATOR_URL}/activity/default/smollm2-on-demand"
    assert render_cli.main(["-f", path]) == 0  # without an activator: no trigger polling one
    (so,) = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d and d["kind"] == "ScaledObject"]
    assert [t["type"] for t in so["spec"]["triggers"]] == ["prometheus", "prometheus"]
