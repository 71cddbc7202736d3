"""The operator's API requests against :mod:`kubellm.operator.control.rbac`, the permissions the Helm chart grants.

The operator (kopf + handlers.py, in-process, scanning on as in production) runs through a life cycle against
kmock (see test_operator_kmock.py) that makes it use every kind it may own: create with KEDA, a
ServiceMonitor, a PrometheusRule and an InferencePool, switch to the HPA backend without monitoring or pool (those
four are deleted),
spread over two nodes (a LeaderWorkerSet replaces the Deployment), clean up stale owned children of every kind,
delete. Every recorded request (kopf's and the operator's own
client's) is turned into the RBAC check the API server would make; each must be granted, and each grant must
have been needed, in both watch modes (every namespace, a list of namespaces).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import kmock
import kubernetes.config.kube_config
import pytest
import pytest_asyncio
import test_operator_kmock as t
from kmock._internal import parsing as kmock_parsing

from kubellm.operator import api, render
from kubellm.operator.control import children, handlers, rbac
from kubellm.operator.control.children import apply_children
from kubellm.operator.control.kube import ApiError, Kube
from kubellm.operator.render import naming
from kubellm.operator.testing import LEADER_WORKER_SETS, declare_leader_worker_sets

pytestmark = pytest.mark.kmock(cls=t.ApiServer)

SCALED_OBJECTS = kmock.resource("keda.sh", "v1alpha1", "scaledobjects")
SERVICE_MONITORS = kmock.resource("monitoring.coreos.com", "v1", "servicemonitors")
PROMETHEUS_RULES = kmock.resource("monitoring.coreos.com", "v1", "prometheusrules")
INFERENCE_POOLS = kmock.resource("inference.networking.k8s.io", "v1", "inferencepools")
APPLY = "application/apply-patch+yaml"


@dataclass(frozen=True)
class Check:
    """One authorization check of the API server: ``namespace`` None means cluster scope."""

    namespace: str | None
    group: str
    resource: str  # plural or plural/subresource
    verb: str


def checks(method: str, path: str, params: dict[str, str], content_type: str) -> list[Check]:
    """The RBAC checks a request needs ([] for discovery), following the API server's request-info rules."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 3:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 4:
        group, rest = parts[1], parts[3:]
    else:
        return []  # /api, /api/v1, /apis, /apis/<group>[/<version>], /version: discovery
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    plural, name, sub = rest[0], rest[1] if len(rest) > 1 else None, rest[2] if len(rest) > 2 else None
    resource = f"{plural}/{sub}" if sub else plural
    method = method.upper()
    if method == "GET":
        verbs = ["watch"] if params.get("watch") in ("true", "1") else ["get"] if name else ["list"]
    elif method == "POST":
        verbs = ["create"]
    elif method == "PUT":
        verbs = ["update"]
    elif method == "PATCH":  # server-side apply may create the object, which needs create as well
        verbs = ["patch", "create"] if content_type.startswith(APPLY) else ["patch"]
    elif method == "DELETE":
        verbs = ["delete"] if name else ["deletecollection"]
    else:
        raise AssertionError(f"unexpected request {method} {path}")
    return [Check(namespace, group, resource, verb) for verb in verbs]


def recorded_checks(server) -> set[Check]:
    """The checks of the operator's requests: those with its kubeconfig's token (the test sends none)."""
    out: set[Check] = set()
    for request in list(server):
        if not request.headers.get("Authorization"):
            continue
        out |= set(
            checks(request.method.value, request.url.path, dict(request.params),
                   request.headers.get("Content-Type", ""))
        )  # fmt: skip
    return out


def test_checks_follow_the_api_servers_rules():
    assert checks("GET", "/apis/kubellm.io/v1alpha1/llmdeployments", {"watch": "true"}, "") == [
        Check(None, "kubellm.io", "llmdeployments", "watch")
    ]
    assert checks("GET", "/api/v1/namespaces", {}, "") == [Check(None, "", "namespaces", "list")]
    assert checks("GET", "/api/v1/namespaces/ml", {}, "") == [Check(None, "", "namespaces", "get")]
    assert checks("PATCH", "/apis/kubellm.io/v1alpha1/namespaces/ml/llmdeployments/x/status", {},
                  "application/merge-patch+json") == [Check("ml", "kubellm.io", "llmdeployments/status", "patch")]
    assert {c.verb for c in checks("PATCH", "/api/v1/namespaces/ml/services/x", {}, APPLY)} == {"patch", "create"}
    assert checks("DELETE", "/apis/apps/v1/namespaces/ml/deployments", {}, "")[0].verb == "deletecollection"
    assert checks("GET", "/apis/monitoring.coreos.com/v1", {}, "") == []
    assert checks("GET", "/version", {}, "") == []


def declare_everything(server: kmock.KubernetesEmulator) -> None:
    """test_operator_kmock's resources plus KEDA, the Prometheus operator, the InferencePool, LWS and CRDs (kopf
    watches them)."""
    t.declare_resources(server)
    declare_leader_worker_sets(server)
    info = kmock.ResourceInfo
    server.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = info(
        kind="CustomResourceDefinition", namespaced=False, verbs=t.VERBS
    )
    server.resources["keda.sh/v1alpha1/scaledobjects"] = info(kind="ScaledObject", namespaced=True, verbs=t.VERBS)
    server.resources["monitoring.coreos.com/v1/servicemonitors"] = info(
        kind="ServiceMonitor", namespaced=True, verbs=t.VERBS
    )
    server.resources["monitoring.coreos.com/v1/prometheusrules"] = info(
        kind="PrometheusRule", namespaced=True, verbs=t.VERBS
    )
    server.resources["inference.networking.k8s.io/v1/inferencepools"] = info(
        kind="InferencePool", namespaced=True, verbs=t.VERBS
    )


def _parse_path_with_namespaces(parse_path):
    """kmock 0.8 reads /api/v1/namespaces[/name] as a namespaced path without a resource (and fails); the
    operator lists and watches namespaces when it serves a list of them, so parse that as the API server does."""

    def parse(path: str):
        parts = path.strip("/").split("/")
        if parts[:3] == ["api", "v1", "namespaces"] and len(parts) <= 4:
            name = parts[3] if len(parts) == 4 else None
            return kmock_parsing.ParsedPath("", "v1", "namespaces", None, name, None)
        return parse_path(path)

    return parse


@pytest_asyncio.fixture
async def server(kmock: kmock.KubernetesEmulator, monkeypatch) -> kmock.KubernetesEmulator:
    monkeypatch.setattr(kmock_parsing, "parse_path", _parse_path_with_namespaces(kmock_parsing.parse_path))
    declare_everything(kmock)
    async with kmock.post("/api/v1/namespaces", json={"apiVersion": "v1", "kind": "Namespace",
                                                     "metadata": {"name": t.NS}}, headers=t.CLOSE) as resp:
        assert resp.status < 300, await resp.text()
    return kmock


async def run_operator(server, tmp_path, monkeypatch, scenario, *, clusterwide: bool) -> None:
    # CRD and namespace scanning on, as `kubellm operator` runs it
    async with t.operator_running(server, tmp_path, monkeypatch, observe_interval=1.0, clusterwide=clusterwide,
                                  namespaces=[] if clusterwide else [t.NS], scanning=True):
        await scenario(server)


def stale_child(api_version: str, kind: str) -> dict[str, Any]:
    """An object the LLMDeployment owns under a name render no longer uses: the operator must delete it."""
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {
            "name": "stale",
            "namespace": t.NS,
            "labels": {children.LABEL: t.NAME},
            "ownerReferences": [{"apiVersion": api.API_VERSION, "kind": api.KIND, "name": t.NAME, "uid": t.UID,
                                 "controller": True}],
        },
    }  # fmt: skip


def exists(server, resource, name: str | None = None) -> bool:
    return any(t.owned_by_ld(obj) and (name is None or n == name) for n, obj in t.live(server, resource).items())


def collection_path(server, api_version: str, kind: str) -> str:
    """The path of a kind's objects in NS, from the resources the emulated API server serves."""
    (resource,) = [r for r, info in server.resources.items()
                   if info.kind == kind and (f"{r.group}/{r.version}" if r.group else r.version) == api_version]
    prefix = f"/apis/{api_version}" if resource.group else f"/api/{api_version}"
    return f"{prefix}/namespaces/{t.NS}/{resource.plural}"  # fmt: skip


async def whole_life(server) -> None:
    for api_version, kind in children.MANAGED_KINDS:
        collection = collection_path(server, api_version, kind)
        async with server.post(collection, json=stale_child(api_version, kind), headers=t.CLOSE) as resp:
            assert resp.status < 300, await resp.text()
    autoscaling = {"enabled": True, "backend": "keda", "minReplicas": 1, "maxReplicas": 3}
    monitoring = {"serviceMonitor": "Enabled", "alerts": {"enabled": True}}
    await t.create(server, t.llmdeployment(autoscaling=autoscaling, monitoring=monitoring,
                                           gateway={"inferencePool": {"enabled": True}}))  # fmt: skip
    await t.until(lambda: exists(server, SCALED_OBJECTS, t.NAME), "the ScaledObject")
    await t.until(lambda: exists(server, SERVICE_MONITORS, t.NAME), "the ServiceMonitor")
    await t.until(lambda: exists(server, PROMETHEUS_RULES, t.NAME), "the PrometheusRule")
    await t.until(lambda: exists(server, INFERENCE_POOLS, t.NAME), "the InferencePool")
    await t.until(lambda: not exists(server, t.DEPLOYMENTS, "stale"), "the stale children to go")
    await t.until(lambda: t.condition(server, "Ready"), "a status")

    await t.patch(server, f"{t.LD_PATH}/{t.NAME}", {
        "metadata": {"generation": 2},
        "spec": {"autoscaling": {"backend": "hpa"}, "monitoring": {"serviceMonitor": "Disabled", "alerts": {"enabled": False}},
                 "gateway": {"inferencePool": {"enabled": False}}},
    })  # fmt: skip
    await t.until(lambda: exists(server, t.HPAS, t.NAME), "the HPA")
    await t.until(lambda: not exists(server, SCALED_OBJECTS), "the ScaledObject to go")
    await t.until(lambda: not exists(server, SERVICE_MONITORS), "the ServiceMonitor to go")
    await t.until(lambda: not exists(server, PROMETHEUS_RULES), "the PrometheusRule to go")
    await t.until(lambda: not exists(server, INFERENCE_POOLS), "the InferencePool to go")
    await t.until(lambda: t.events(server), "an Event")

    await t.patch(server, f"{t.LD_PATH}/{t.NAME}", {
        "metadata": {"generation": 3}, "spec": {"parallelism": {"tensor": 2, "nodes": 2}},
    })  # fmt: skip
    await t.until(lambda: exists(server, LEADER_WORKER_SETS, f"{t.NAME}-group"), "the LeaderWorkerSet")
    await t.until(lambda: not exists(server, t.DEPLOYMENTS), "the Deployment to go")
    await t.until(lambda: t.ld_object(server)["status"].get("observedGeneration") == 3, "an observation of it")
    await delete(server)


async def short_life(server) -> None:
    await t.create(server, t.llmdeployment(replicas=1))
    await t.until(lambda: exists(server, t.DEPLOYMENTS, t.NAME), "the Deployment")
    await t.until(lambda: t.condition(server, "Ready"), "a status")
    await t.until(lambda: t.events(server), "an Event")
    assert t.condition(server, "Ready")["reason"] != "ReconcileFailed"
    await delete(server)


async def delete(server) -> None:
    async with server.delete(f"{t.LD_PATH}/{t.NAME}", headers=t.CLOSE) as resp:
        assert resp.status < 300
    await t.until(lambda: server.objects[t.LD_RESOURCE, t.NS, t.NAME].deleted, "the LLMDeployment to be gone")


def describe(items) -> str:
    return "\n  ".join(sorted(map(str, items)))


def authorize(server, namespaced: rbac.Grants, cluster: rbac.Grants, namespaces: set[str] | None) -> list[Check]:
    """Answer 403 to operator requests these grants do not allow, as the API server's RBAC would.

    ``namespaced`` hold in ``namespaces`` (None: everywhere, cluster scope included, as a ClusterRole's do);
    ``cluster`` hold cluster-wide. Returns the list the denied checks are appended to.
    """
    in_namespace, everywhere = rbac.triples(namespaced), rbac.triples(cluster)
    if namespaces is None:
        everywhere |= in_namespace
    denied: list[Check] = []

    def allowed(c: Check) -> bool:
        triple = (c.group, c.resource, c.verb)
        return triple in everywhere or (c.namespace in (namespaces or ()) and triple in in_namespace)

    def forbidden(request: kmock.Request) -> bool:
        if not request.headers.get("Authorization"):
            return False  # the test's own requests
        found = checks(request.method.value, request.url.path, dict(request.params),
                       request.headers.get("Content-Type", ""))  # fmt: skip
        refused = [c for c in found if not allowed(c)]
        denied.extend(refused)
        return bool(refused)

    server[forbidden] << kmock.KubernetesError(status=403, reason="Forbidden", message="denied by the test's RBAC")
    return denied


def triples_of(checks_: set[Check] | list[Check]) -> set[tuple[str, str, str]]:
    return {(c.group, c.resource, c.verb) for c in checks_}


@pytest.mark.asyncio
async def test_watching_every_namespace_needs_exactly_the_cluster_role(server, tmp_path, monkeypatch):
    namespaced = rbac.namespaced_grants(keda=True, service_monitors=True, prometheus_rules=True,
                                        inference_pools=True, leader_worker_sets=True)
    cluster = rbac.cluster_grants(all_namespaces=True)
    denied = authorize(server, namespaced, cluster, namespaces=None)
    try:
        await run_operator(server, tmp_path, monkeypatch, whole_life, clusterwide=True)
    finally:
        assert not denied, "requests the chart's ClusterRole does not allow:\n  " + describe(set(denied))
    unused = rbac.triples(namespaced + cluster) - triples_of(recorded_checks(server))
    assert not unused, "grants no request needed:\n  " + describe(unused)


@pytest.mark.asyncio
async def test_watching_listed_namespaces_works_with_roles_there_and_little_cluster_wide(
    server, tmp_path, monkeypatch
):
    """Without the optional grants, even with KEDA, the Prometheus operator and the InferencePool CRD installed:
    the operator is refused only what the chart deliberately leaves out, and serves the LLMDeployment all the
    same."""
    namespaced = rbac.namespaced_grants(keda=False, service_monitors=False)
    cluster = rbac.cluster_grants(all_namespaces=False)
    denied = authorize(server, namespaced, cluster, namespaces={t.NS})
    await run_operator(server, tmp_path, monkeypatch, short_life, clusterwide=False)
    optional = rbac.triples(rbac.KEDA + rbac.SERVICE_MONITORS + rbac.PROMETHEUS_RULES + rbac.INFERENCE_POOLS + rbac.LEADER_WORKER_SETS)
    assert triples_of(denied) <= optional, describe(set(denied))
    assert {c.namespace for c in denied} == {t.NS}
    recorded = recorded_checks(server)
    assert {c.namespace for c in recorded} <= {None, t.NS}
    cluster_used = triples_of({c for c in recorded if c.namespace is None})
    assert cluster_used == rbac.triples(cluster), describe(cluster_used)


async def discovered_plurals(server, kinds) -> dict[str, str]:
    """The resource names the operator's client finds for ``kinds`` ((apiVersion, kind) pairs) by discovery."""
    kube = await Kube.connect(handlers.FIELD_MANAGER, kubernetes.client.Configuration(host=str(server.url)))
    try:
        found = {}
        for api_version, kind in kinds:  # discovery is synchronous: off the loop that runs kmock
            resource = await asyncio.to_thread(kube.client.resources.get, api_version=api_version, kind=kind)
            found[kind] = resource.name
        return found
    finally:
        kube.close()


@pytest.mark.asyncio
async def test_every_kind_the_operator_may_own_can_be_applied_listed_and_deleted(server):
    granted = rbac.triples(rbac.namespaced_grants(keda=True, service_monitors=True, prometheus_rules=True,
                                                  inference_pools=True, leader_worker_sets=True))
    plurals = await discovered_plurals(server, children.MANAGED_KINDS)
    for api_version, kind in children.MANAGED_KINDS:
        group = api_version.rpartition("/")[0]
        for verb in rbac.CHILD_VERBS:
            assert (group, plurals[kind], verb) in granted, (kind, verb)


@pytest.mark.asyncio
async def test_optional_grants_are_the_optional_kinds(server):
    optional = {g.resource for g in rbac.KEDA + rbac.SERVICE_MONITORS + rbac.PROMETHEUS_RULES + rbac.INFERENCE_POOLS + rbac.LEADER_WORKER_SETS}
    kinds = [(v, k) for v, k in children.MANAGED_KINDS if k in children.OPTIONAL_KINDS]
    assert {k for _, k in kinds} == children.OPTIONAL_KINDS
    assert optional == set((await discovered_plurals(server, kinds)).values())


class RefusingKube:
    """Applies everything but ``refused`` kinds, which get 403 (lists too); records what it applied."""

    field_manager = handlers.FIELD_MANAGER

    def __init__(self, *refused: str) -> None:
        self.refused, self.applied = set(refused), []

    def _check(self, kind: str) -> None:
        if kind in self.refused:
            raise ApiError(403, "Forbidden", f"{kind} is not granted")

    async def list(self, api_version, kind, namespace, selector):
        self._check(kind)
        return []

    async def find(self, api_version, kind, namespace, name):
        self._check(kind)
        return None

    async def apply(self, obj, field_manager=None):
        self._check(obj["kind"])
        self.applied.append(obj["kind"])
        return dict(obj)


def _children(monitoring: str, autoscaling: dict[str, Any] | None = None):
    spec = {"model": {"uri": "hf://org/llama"}, "monitoring": {"serviceMonitor": monitoring}}
    if autoscaling:
        spec["autoscaling"] = autoscaling
    ld = api.LLMDeployment.model_validate({**t.llmdeployment(), "spec": spec})
    return ld, render.render(ld, service_monitor_available=True)


def test_without_service_monitor_grants_auto_skips_the_service_monitor_and_enabled_fails_visibly():
    kube = RefusingKube("ServiceMonitor", "ScaledObject")
    ld, children = _children("Auto")
    asyncio.run(apply_children(kube, ld, children))
    assert "Deployment" in kube.applied and "ServiceMonitor" not in kube.applied
    ld, children = _children("Enabled")
    with pytest.raises(ApiError, match="403"):
        asyncio.run(apply_children(kube, ld, children))


def test_without_keda_grants_a_keda_backend_fails_visibly_and_other_refusals_are_not_hidden():
    ld, children = _children("Disabled", {"enabled": True, "backend": "keda", "minReplicas": 1, "maxReplicas": 2})
    with pytest.raises(ApiError, match="ScaledObject"):
        asyncio.run(apply_children(RefusingKube("ScaledObject"), ld, children))
    ld, children = _children("Disabled")
    with pytest.raises(ApiError, match="Service"):
        asyncio.run(apply_children(RefusingKube("Service"), ld, children))


def test_without_inference_pool_grants_an_enabled_pool_fails_naming_the_chart_value():
    spec = {"model": {"uri": "hf://org/llama"}, "gateway": {"inferencePool": {"enabled": True}}}
    ld = api.LLMDeployment.model_validate({**t.llmdeployment(), "spec": spec})
    kube = RefusingKube("InferencePool")
    with pytest.raises(ApiError, match="install the chart with rbac.inferencePools=true, or set "
                                       "gateway.inferencePool.enabled: false"):  # fmt: skip
        asyncio.run(apply_children(kube, ld, render.render(ld)))
    assert "Deployment" in kube.applied  # listing the pools was refused too: read as "none of ours"


def test_without_leader_worker_set_grants_multi_node_fails_naming_the_chart_value_and_one_node_is_unaffected():
    spec = {"model": {"uri": "hf://org/llama"}, "parallelism": {"tensor": 2, "nodes": 2}}
    ld = api.LLMDeployment.model_validate({**t.llmdeployment(), "spec": spec})
    kube = RefusingKube(naming.LWS_KIND)
    with pytest.raises(ApiError, match=r"403 Forbidden: .*install the chart with rbac\.leaderWorkerSets=true, or set "
                                       r"parallelism\.nodes: 1"):  # fmt: skip
        asyncio.run(apply_children(kube, ld, render.render(ld)))
    assert kube.applied == ["Service"]  # the Service goes first; nothing after the refused LWS
    ld, children_ = _children("Disabled")
    kube = RefusingKube(naming.LWS_KIND)
    asyncio.run(apply_children(kube, ld, children_))  # the listing refused: none of ours to clean up
    assert "Deployment" in kube.applied
