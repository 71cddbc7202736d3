"""The operator (kopf + handlers.py) running in-process against kmock, the kopf author's Kubernetes API emulator.

kmock keeps objects in memory and streams watch events, but it is not an API server: it has no
resourceVersions, label/field selectors (the operator also filters client-side, so that is fine), status
subresource split, generation bumps, uids, defaulting, CRD schema validation, garbage collection or
server-side-apply semantics (a PATCH is a plain recursive merge and 404s on a missing object). The emulator
(operator/testing.py) adds just two behaviours every API server has: server-side apply creates a missing
object, and ``generateName`` gets a name (kopf's Events use it). The tests set ``uid`` and ``generation`` themselves
and simulate the Deployment and HPA controllers by patching their status in.
"""

from __future__ import annotations

import asyncio
from typing import Any

import kmock
import kubernetes.config.kube_config
import pydantic
import pytest
import pytest_asyncio

from kubellm.operator import api, render
from kubellm.operator.control import handlers, metrics
from kubellm.operator.control import kube as kube_mod
from kubellm.operator.control.children import as_deployment, replicas_handover, template_id
from kubellm.operator.control.kube import Kube, merge_patch_diff
from kubellm.operator.render import deployment as deployment_mod
from kubellm.operator.render import naming
from kubellm.operator.status import observe as status_mod
from kubellm.operator.testing import (  # noqa: F401  (re-exported: test_operator_rbac.py reads them here)
    CLOSE,
    DEPLOYMENTS,
    EVENTS,
    HPAS,
    LD_PATH,
    LD_RESOURCE,
    LEADER_WORKER_SETS,
    NAME,
    NS,
    PDBS,
    PODS,
    SERVICES,
    UID,
    VERBS,
    ApiServer,
    create,
    declare_leader_worker_sets,
    declare_resources,
    operator_running,
    start_operator,
    until,
    write_kubeconfig,
)

pytestmark = pytest.mark.kmock(cls=ApiServer)


# ---------------------------------------------------------------------------------------------------
# Fixtures and helpers
# ---------------------------------------------------------------------------------------------------


@pytest_asyncio.fixture
async def server(kmock: kmock.KubernetesEmulator) -> kmock.KubernetesEmulator:
    declare_resources(kmock)
    return kmock


@pytest_asyncio.fixture
async def lws_installed(server) -> kmock.KubernetesEmulator:
    """The LeaderWorkerSet CRD served from the start (ask for it before ``operator``: discovery is cached)."""
    declare_leader_worker_sets(server)
    return server


@pytest_asyncio.fixture
async def operator(server, tmp_path, monkeypatch):
    """kopf running the handlers in this event loop, logged in to kmock through a kubeconfig."""
    async with operator_running(server, tmp_path, monkeypatch) as memo:
        yield memo.kubellm


def live(server, resource) -> dict[str, dict]:
    """The existing objects of a resource in NS by name."""
    return {
        name: dict(obj.raw)
        for (res, ns, name), obj in list(server.objects.items())
        if res == resource and ns == NS and not obj.deleted
    }


def ld_object(server) -> dict:
    return dict(server.objects[LD_RESOURCE, NS, NAME].raw)


def condition(server, type_: str) -> dict | None:
    for c in (ld_object(server).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c
    return None


def events(server, reason: str | None = None) -> list[dict]:
    found = [
        obj for obj in live(server, EVENTS).values() if obj.get("involvedObject", {}).get("name") == NAME
    ]
    return [e for e in found if reason is None or e.get("reason") == reason]


def owned_by_ld(obj: dict) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(r.get("uid") == UID and r.get("kind") == api.KIND and r.get("controller") for r in refs)


def llmdeployment(generation: int = 1, **spec: Any) -> dict:
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {
            "name": NAME,
            "namespace": NS,
            "uid": UID,
            "generation": generation,
            "resourceVersion": "1",
        },
        "spec": {"model": {"uri": "hf://org/llama"}, **spec},
    }


async def patch(server, path: str, body: dict) -> None:
    async with server.patch(
        path, json=body, headers={**CLOSE, "Content-Type": "application/merge-patch+json"}
    ) as resp:
        assert resp.status < 300, await resp.text()


def child_path(group_version: str, plural: str, name: str, sub: str = "") -> str:
    prefix = "/api/" if "/" not in group_version else "/apis/"
    return f"{prefix}{group_version}/namespaces/{NS}/{plural}/{name}" + (f"/{sub}" if sub else "")


def the_deployment(server) -> dict:
    deployments = [d for d in live(server, DEPLOYMENTS).values() if owned_by_ld(d)]
    assert len(deployments) == 1, deployments
    return deployments[0]


async def create_and_wait_for_children(server) -> dict:
    await create(server, llmdeployment(replicas=2))
    await until(lambda: any(owned_by_ld(d) for d in live(server, DEPLOYMENTS).values()), "the Deployment")
    await until(lambda: any(owned_by_ld(s) for s in live(server, SERVICES).values()), "the Service")
    await until(lambda: any(owned_by_ld(p) for p in live(server, PDBS).values()), "the PodDisruptionBudget")
    return the_deployment(server)


async def simulate_deployment_status(server, deployment: dict, **status: int) -> None:
    path = child_path("apps/v1", "deployments", deployment["metadata"]["name"], "status")
    await patch(server, path, {"status": status})


def written_paths(patch: Any, prefix: str = "") -> list[str]:
    """The JSON-pointer paths a merge patch (a dict) or JSON patch (a list of operations) writes."""
    if isinstance(patch, list) and not prefix:
        return [op["path"] for op in patch if op.get("op") != "test"]
    if isinstance(patch, dict) and patch:
        escaped = ((k.replace("~", "~0").replace("/", "~1"), v) for k, v in patch.items())
        return [p for k, v in escaped for p in written_paths(v, f"{prefix}/{k}")]
    return [prefix]


def running_pod(name: str, labels: dict[str, str]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {**labels, "kubellm.io/llmdeployment": NAME}},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {
                    "name": "runtime",
                    "ready": True,
                    "started": True,
                    "state": {"running": {}},
                    "restartCount": 0,
                }
            ],
        },
    }


# ---------------------------------------------------------------------------------------------------
# Scenarios
# ---------------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_create_applies_owned_children_and_reports_status(server, operator):
    deployment = await create_and_wait_for_children(server)
    assert deployment["metadata"]["labels"]["kubellm.io/llmdeployment"] == NAME
    assert deployment["spec"]["replicas"] == 2

    # Server-side apply: PATCH with the apply content type, our field manager, forced.
    applies = [r for r in server if "apply-patch" in r.headers.get("Content-Type", "")]
    assert applies, "no server-side apply request"
    assert {r.params.get("fieldManager") for r in applies} == {"kubellm-operator"}
    assert {r.params.get("force") for r in applies} == {"true"}

    # kopf's bookkeeping lives in kubellm.io annotations, and the daemon's finalizer is ours.
    await until(
        lambda: any(
            k.startswith("kubellm.io/") for k in ld_object(server)["metadata"].get("annotations", {})
        ),
        "kopf's kubellm.io annotations",
    )
    assert "kubellm.io/finalizer" in ld_object(server)["metadata"].get("finalizers", [])
    assert not any(k.startswith("kopf.zalando.org/") for k in ld_object(server)["metadata"]["annotations"])

    await until(
        lambda: ld_object(server).get("status", {}).get("observedGeneration") == 1, "observedGeneration 1"
    )
    status = ld_object(server)["status"]
    assert status["selector"] == ",".join(
        f"{k}={v}" for k, v in sorted(deployment["spec"]["selector"]["matchLabels"].items())
    )
    assert status["endpoint"].startswith("http://") and status["endpoint"].endswith(f".{NS}.svc:80/v1")
    assert status["readyText"] == "0/2"
    assert condition(server, "Ready")["status"] == "False"
    await until(lambda: events(server, "RolloutStarted"), "a RolloutStarted Event")


@pytest.mark.asyncio
async def test_simulated_deployment_status_becomes_conditions(server, operator):
    deployment = await create_and_wait_for_children(server)
    labels = deployment["spec"]["selector"]["matchLabels"]
    for pod in ("llama-a", "llama-b"):
        async with server.post(
            f"/api/v1/namespaces/{NS}/pods", headers=CLOSE, json=running_pod(pod, labels)
        ) as resp:
            assert resp.status < 300
    await simulate_deployment_status(
        server, deployment, replicas=2, readyReplicas=2, updatedReplicas=2, availableReplicas=2
    )
    await until(lambda: condition(server, "Ready")["reason"] == "Available", "Ready=True/Available")
    assert condition(server, "Ready")["status"] == "True"
    await until(lambda: condition(server, "Progressing")["reason"] == "Complete", "Progressing=Complete")
    assert condition(server, "ModelLoaded")["status"] == "True"
    status = ld_object(server)["status"]
    assert (status["replicas"], status["readyReplicas"], status["readyText"]) == (2, 2, "2/2")
    await until(lambda: events(server, "RolloutComplete"), "a RolloutComplete Event")

    # A crash-looping pod: Degraded names it, and a Warning Event says so.
    crashing = running_pod("llama-c", labels)
    crashing["status"]["containerStatuses"][0].update(
        ready=False,
        started=False,
        state={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 5m0s"}},
    )
    async with server.post(f"/api/v1/namespaces/{NS}/pods", headers=CLOSE, json=crashing) as resp:
        assert resp.status < 300
    await until(
        lambda: condition(server, "Degraded")["reason"] == "CrashLoopBackOff", "Degraded=CrashLoopBackOff"
    )
    assert "llama-c" in condition(server, "Degraded")["message"]
    warning = await until(lambda: events(server, "CrashLoopBackOff"), "a CrashLoopBackOff Event")
    assert warning[0]["type"] == "Warning"


@pytest.mark.asyncio
async def test_spec_change_updates_the_deployment_and_posts_rollout_started(server, operator):
    deployment = await create_and_wait_for_children(server)
    await until(lambda: events(server, "RolloutStarted"), "the first RolloutStarted Event")
    assert "float16" not in str(deployment["spec"]["template"])

    await patch(server, f"{LD_PATH}/{NAME}", {"metadata": {"generation": 2}, "spec": {"dtype": "float16"}})
    await until(
        lambda: "float16" in str(the_deployment(server)["spec"]["template"]), "the updated Deployment"
    )
    started = await until(
        lambda: [e for e in events(server, "RolloutStarted") if "generation 2" in e.get("message", "")],
        "RolloutStarted for generation 2",
    )
    assert started[0]["type"] == "Normal"
    await until(lambda: ld_object(server)["status"]["observedGeneration"] == 2, "observedGeneration 2")
    assert condition(server, "Progressing")["reason"] == "Rolling"


@pytest.mark.asyncio
async def test_hpa_status_change_posts_scaled_up_and_fills_autoscaling(server, operator):
    autoscaling = {"enabled": True, "minReplicas": 1, "maxReplicas": 8, "targetQueueDepth": 4}
    await create(server, llmdeployment(replicas=1, autoscaling=autoscaling))
    hpa = await until(lambda: [h for h in live(server, HPAS).values() if owned_by_ld(h)], "the HPA")
    hpa_status_path = child_path(
        "autoscaling/v2", "horizontalpodautoscalers", hpa[0]["metadata"]["name"], "status"
    )
    conditions = [
        {"type": "AbleToScale", "status": "True", "reason": "ReadyForNewScale"},
        {"type": "ScalingActive", "status": "True", "reason": "ValidMetricFound"},
    ]

    def hpa_status(current: int, desired: int, depth: str) -> dict:
        metric = {
            "type": "Pods",
            "pods": {"metric": {"name": api.QUEUE_DEPTH_METRIC}, "current": {"averageValue": depth}},
        }
        return {"status": {"currentReplicas": current, "desiredReplicas": desired, "currentMetrics": [metric],
                           "lastScaleTime": "2025-01-01T12:00:00Z", "conditions": conditions}}  # fmt: skip

    await patch(server, hpa_status_path, hpa_status(1, 1, "0"))
    await until(
        lambda: ld_object(server)["status"]["autoscaling"].get("desiredReplicas") == 1, "desiredReplicas 1"
    )
    await patch(server, hpa_status_path, hpa_status(1, 3, "1500m"))
    scaled = await until(lambda: events(server, "ScaledUp"), "a ScaledUp Event")
    assert scaled[0]["message"] == "from 1 to 3, queue depth 1.5 (target 4)"
    auto = ld_object(server)["status"]["autoscaling"]
    assert (auto["currentReplicas"], auto["desiredReplicas"], auto["targetQueueDepth"]) == (1, 3, 4)
    assert auto["currentQueueDepth"] == 1.5
    assert auto["lastScaleTime"].startswith("2025-01-01T12:00:00")
    assert condition(server, "ScalingActive")["status"] == "True"

    # Autoscaling turned off: the HPA is deleted, status.autoscaling goes away.
    await patch(
        server,
        f"{LD_PATH}/{NAME}",
        {"metadata": {"generation": 2}, "spec": {"autoscaling": {"enabled": False}}},
    )
    await until(
        lambda: not [h for h in live(server, HPAS).values() if owned_by_ld(h)], "the HPA to be deleted"
    )
    await until(lambda: "autoscaling" not in ld_object(server)["status"], "status.autoscaling to go")
    assert condition(server, "ScalingActive")["reason"] == "AutoscalingDisabled"


@pytest.mark.asyncio
async def test_invalid_spec_reports_and_touches_no_children(server, operator):
    env = [{"name": "HF_TOKEN", "value": "a"}, {"name": "HF_TOKEN", "value": "b"}]
    await create(server, llmdeployment(env=env))  # passes the CRD schema, fails the Python rule
    ready = await until(lambda: condition(server, "Ready"), "the Ready condition")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "HF_TOKEN appears more than once" in ready["message"]
    warning = await until(lambda: events(server, "InvalidSpec"), "an InvalidSpec Event")
    assert warning[0]["type"] == "Warning"
    assert "HF_TOKEN" in warning[0]["message"]
    await asyncio.sleep(0.5)  # give a wrongly retrying handler the chance to show itself
    assert len(events(server, "InvalidSpec")) == 1
    assert not live(server, DEPLOYMENTS) and not live(server, SERVICES) and not live(server, PDBS)

    # A pydantic-invalid body (kmock does not enforce the CRD schema) is handled the same way, and a fix applies.
    await patch(
        server, f"{LD_PATH}/{NAME}", {"metadata": {"generation": 2}, "spec": {"env": None, "replicas": -1}}
    )
    await until(lambda: "replicas" in condition(server, "Ready")["message"], "the new InvalidSpec message")
    assert not live(server, DEPLOYMENTS)
    await patch(server, f"{LD_PATH}/{NAME}", {"metadata": {"generation": 3}, "spec": {"replicas": 1}})
    await until(lambda: any(owned_by_ld(d) for d in live(server, DEPLOYMENTS).values()), "the Deployment")
    await until(lambda: condition(server, "Ready")["reason"] != "InvalidSpec", "InvalidSpec to clear")


@pytest.mark.asyncio
async def test_failing_apply_reports_reconcile_failed_and_recovers(server, operator):
    broken = {"on": True}
    server[
        lambda req: broken["on"] and req.method == "PATCH" and req.resource == PDBS
    ] << kmock.KubernetesError(status=500, reason="InternalError", message="etcdserver: request timed out")
    await create(server, llmdeployment(replicas=1))
    await until(lambda: condition(server, "Ready")["reason"] == "ReconcileFailed", "Ready=ReconcileFailed")
    ready = condition(server, "Ready")
    assert ready["status"] == "False" and "etcdserver: request timed out" in ready["message"]
    assert condition(server, "Degraded")["reason"] == "ReconcileFailed"
    warning = await until(lambda: events(server, "ReconcileFailed"), "a ReconcileFailed Event")
    assert warning[0]["type"] == "Warning"

    broken["on"] = False  # kopf retries after its backoff (1 s) and the reconcile goes through
    await until(lambda: condition(server, "Ready")["reason"] != "ReconcileFailed", "ReconcileFailed to clear")
    assert condition(server, "Degraded")["reason"] != "ReconcileFailed"
    await until(lambda: events(server, "RolloutStarted"), "the RolloutStarted Event after the recovery")


INFERENCE_POOLS = kmock.resource("inference.networking.k8s.io", "v1", "inferencepools")


@pytest.mark.asyncio
async def test_inference_pool_without_its_crd_says_what_to_install_and_is_applied_once_installed(
    server, operator, monkeypatch
):
    monkeypatch.setattr(kube_mod, "REDISCOVER_AFTER", 0.0)  # see the CRD at the next retry, not 30 s later
    pool = {"inferencePool": {"enabled": True, "endpointPickerRef": {"name": "llama-epp"}}}
    await create(server, llmdeployment(replicas=1, gateway=pool))
    await until(lambda: condition(server, "Ready")["reason"] == "ReconcileFailed", "Ready=ReconcileFailed")
    message = condition(server, "Ready")["message"]
    assert "the InferencePool CRD is not installed: install the Gateway API Inference Extension CRDs" in message
    assert "or set gateway.inferencePool.enabled: false" in message
    assert any(owned_by_ld(d) for d in live(server, DEPLOYMENTS).values())  # the pods are served all the same

    server.resources["inference.networking.k8s.io/v1/inferencepools"] = kmock.ResourceInfo(
        kind="InferencePool", namespaced=True, verbs=VERBS
    )
    await until(lambda: live(server, INFERENCE_POOLS).get(NAME), "the InferencePool")
    await until(lambda: condition(server, "Ready")["reason"] != "ReconcileFailed", "ReconcileFailed to clear")
    applied = live(server, INFERENCE_POOLS)[NAME]
    assert owned_by_ld(applied)
    assert applied["spec"]["selector"]["matchLabels"] == live(server, SERVICES)[NAME]["spec"]["selector"]
    assert applied["spec"]["endpointPickerRef"]["name"] == "llama-epp"
    await until(lambda: ld_object(server)["status"].get("inferencePool") == {"name": NAME}, "status.inferencePool")

    # A gateway reports that it cannot find the endpoint picker: the status and an Event say so.
    refusal = {"type": "ResolvedRefs", "status": "False", "reason": "InvalidExtensionRef",
               "message": "Service llama-epp not found", "lastTransitionTime": "2026-01-01T00:00:00Z"}
    await patch(server, f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools/{NAME}", {
        "status": {"parents": [{"parentRef": {"name": "inference-gateway"}, "conditions": [refusal]}]}})  # fmt: skip
    warning = await until(lambda: events(server, "InferencePoolNotAccepted"), "an InferencePoolNotAccepted Event")
    assert warning[0]["type"] == "Warning" and "Service llama-epp not found" in warning[0]["message"]
    assert ld_object(server)["status"]["inferencePool"]["parents"] == [
        {"parent": f"Gateway {NS}/inference-gateway", "resolvedRefs": False, "reason": "InvalidExtensionRef",
         "message": "Service llama-epp not found"}]  # fmt: skip

    # Turned off: the owned pool is deleted like any child no longer rendered, and the status forgets it.
    await patch(server, f"{LD_PATH}/{NAME}", {"metadata": {"generation": 2},
                                              "spec": {"gateway": {"inferencePool": {"enabled": False}}}})  # fmt: skip
    await until(lambda: NAME not in live(server, INFERENCE_POOLS), "the InferencePool to go")
    await until(lambda: "inferencePool" not in ld_object(server)["status"], "status.inferencePool to go")


PROMETHEUS_RULES = kmock.resource("monitoring.coreos.com", "v1", "prometheusrules")


@pytest.mark.asyncio
async def test_alerts_without_the_prometheus_operator_say_what_to_do_and_apply_once_it_is_installed(
    server, operator, monkeypatch
):
    monkeypatch.setattr(kube_mod, "REDISCOVER_AFTER", 0.0)  # see the CRD at the next retry, not 30 s later
    failing = {"llmdeployment_namespace": NS, "llmdeployment": NAME}
    await create(server, llmdeployment(replicas=1, monitoring={"alerts": {"enabled": True, "ttftP99SecondsSLO": 2}}))
    await until(lambda: condition(server, "Ready")["reason"] == "ReconcileFailed", "Ready=ReconcileFailed")
    message = condition(server, "Ready")["message"]
    assert "the PrometheusRule CRD is not installed: install the Prometheus operator" in message
    assert "or set monitoring.alerts.enabled: false" in message
    assert any(owned_by_ld(d) for d in live(server, DEPLOYMENTS).values())  # the pods are served all the same
    # the operator's own gauge, which the rule's KubellmReconcileFailing reads, says so for this object
    assert metrics.REGISTRY.get_sample_value("kubellm_operator_reconcile_failing", failing) == 1

    server.resources["monitoring.coreos.com/v1/prometheusrules"] = kmock.ResourceInfo(
        kind="PrometheusRule", namespaced=True, verbs=VERBS
    )
    await until(lambda: live(server, PROMETHEUS_RULES).get(NAME), "the PrometheusRule")
    await until(lambda: condition(server, "Ready")["reason"] != "ReconcileFailed", "ReconcileFailed to clear")
    assert metrics.REGISTRY.get_sample_value("kubellm_operator_reconcile_failing", failing) == 0
    applied = live(server, PROMETHEUS_RULES)[NAME]
    assert owned_by_ld(applied)
    (group,) = applied["spec"]["groups"]
    assert "KubellmSlowFirstToken" in {r["alert"] for r in group["rules"]}

    await patch(server, f"{LD_PATH}/{NAME}", {"metadata": {"generation": 2},
                                              "spec": {"monitoring": {"alerts": {"enabled": False}}}})  # fmt: skip
    await until(lambda: NAME not in live(server, PROMETHEUS_RULES), "the PrometheusRule to go")


@pytest.mark.asyncio
async def test_the_operator_writes_only_status_finalizers_and_its_own_annotations(server, operator):
    """GitOps tools own spec, labels and their annotations: every write the operator makes to the LLMDeployment
    (create, update, an invalid spec, a failed apply, a recovery) touches status, the finalizer or kopf's
    kubellm.io/ bookkeeping only."""
    gitops_annotations = {
        "argocd.argoproj.io/tracking-id": "models:kubellm.io/LLMDeployment:ml/llama",
        "kustomize.toolkit.fluxcd.io/name": "models",
    }
    body = llmdeployment(replicas=1)
    body["metadata"].update(annotations=dict(gitops_annotations), labels={"team": "ml"})
    broken = {"on": False}
    server[
        lambda req: broken["on"] and req.method == "PATCH" and req.resource == PDBS
    ] << kmock.KubernetesError(status=500, reason="InternalError", message="etcdserver: request timed out")
    await create(server, body)
    deployment = await until(lambda: [d for d in live(server, DEPLOYMENTS).values() if owned_by_ld(d)], "the Deployment")
    await simulate_deployment_status(
        server, deployment[0], replicas=1, readyReplicas=1, updatedReplicas=1, availableReplicas=1
    )
    await until(lambda: condition(server, "Ready"), "a status")
    broken["on"] = True
    await patch(server, f"{LD_PATH}/{NAME}", {"metadata": {"generation": 2}, "spec": {"dtype": "float16"}})
    await until(lambda: condition(server, "Ready")["reason"] == "ReconcileFailed", "Ready=ReconcileFailed")
    broken["on"] = False
    await until(lambda: condition(server, "Ready")["reason"] != "ReconcileFailed", "the recovery")
    await patch(server, f"{LD_PATH}/{NAME}", {"metadata": {"generation": 3}, "spec": {"replicas": -1}})
    await until(lambda: condition(server, "Ready")["reason"] == "InvalidSpec", "Ready=InvalidSpec")
    await until(lambda: ld_object(server)["status"].get("observedGeneration") == 3, "observedGeneration 3")

    writes = [
        r for r in server
        if r.resource == LD_RESOURCE and r.method in ("POST", "PUT", "PATCH", "DELETE")
        and r.headers.get("Authorization")  # the operator logs in with a token; this test's own requests do not
    ]  # fmt: skip
    assert any(r.subresource == "status" for r in writes) and any(r.subresource is None for r in writes)
    allowed = ("/status/", "/metadata/finalizers", "/metadata/annotations/kubellm.io~1")
    for r in writes:
        assert r.method == "PATCH", (r.method, r.url)
        for path in written_paths(r.data):
            assert path.startswith(allowed[:1] if r.subresource == "status" else allowed[1:]), (path, r.url)
    final = ld_object(server)["metadata"]
    assert {k: v for k, v in final["annotations"].items() if not k.startswith("kubellm.io/")} == gitops_annotations
    assert final["labels"] == {"team": "ml"}
    assert ld_object(server)["spec"] == {"model": {"uri": "hf://org/llama"}, "replicas": -1, "dtype": "float16"}


MULTI_NODE = {"parallelism": {"tensor": 2, "nodes": 2}, "resources": {"gpu": {"count": 0}}, "replicas": 2}


def group_pod(name: str, worker_index: int, labels: dict[str, str]) -> dict:
    """A pod of a LeaderWorkerSet group as the LWS controller labels it."""
    return running_pod(name, {**labels, "leaderworkerset.sigs.k8s.io/worker-index": str(worker_index)})


@pytest.mark.asyncio
async def test_multi_node_applies_a_leader_worker_set_and_reads_its_status_back(server, lws_installed, operator):
    await create(server, llmdeployment(**MULTI_NODE))
    lws = await until(lambda: [w for w in live(server, LEADER_WORKER_SETS).values() if owned_by_ld(w)], "the LWS")
    (lws,) = lws
    assert lws["metadata"]["name"] == f"{NAME}-group"
    assert lws["spec"]["replicas"] == 2 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    service = await until(lambda: [s for s in live(server, SERVICES).values() if owned_by_ld(s)], "the Service")
    assert service[0]["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert not live(server, DEPLOYMENTS)
    await until(lambda: events(server, "RolloutStarted"), "a RolloutStarted Event")
    # Read back through as_deployment: the workload exists (no LWS read would leave it at Creating).
    await until(lambda: condition(server, "Progressing")["reason"] == "Rolling", "Progressing=Rolling")

    # The LWS controller's part, simulated: two groups of a leader and a worker, then the group counts.
    labels = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"]
    for group in range(2):
        for index in range(2):
            pod = group_pod(f"{NAME}-group-{group}" + (f"-{index}" if index else ""), index, labels)
            async with server.post(f"/api/v1/namespaces/{NS}/pods", headers=CLOSE, json=pod) as resp:
                assert resp.status < 300
    lws_status = child_path("leaderworkerset.x-k8s.io/v1", "leaderworkersets", lws["metadata"]["name"], "status")
    available = {"type": "Available", "status": "True", "reason": "AllGroupsReady", "message": "All replicas are ready",
                 "lastTransitionTime": "2026-01-01T00:00:00Z"}  # fmt: skip
    await patch(server, lws_status, {"status": {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2,
                                                "conditions": [available]}})  # fmt: skip
    await until(lambda: ld_object(server)["status"].get("readyText") == "1/2", "readyText 1/2")
    await patch(server, lws_status, {"status": {"readyReplicas": 2}})
    await until(lambda: condition(server, "Ready")["reason"] == "Available", "Ready=True/Available")
    await until(lambda: condition(server, "Progressing")["reason"] == "Complete", "Progressing=Complete")
    status = ld_object(server)["status"]
    assert (status["replicas"], status["readyReplicas"], status["readyText"]) == (2, 2, "2/2")
    assert status["selector"].endswith("leaderworkerset.sigs.k8s.io/worker-index=0")  # the leaders
    assert condition(server, "ModelLoaded")["message"] == "4/4 pods have the model loaded"
    await until(lambda: events(server, "RolloutComplete"), "a RolloutComplete Event")

    # A crash-looping worker degrades the deployment: the observer reads the workers' pods too.
    crashing = group_pod(f"{NAME}-group-1-1", 1, labels)
    crashing["status"]["containerStatuses"][0].update(
        ready=False, started=False, state={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}}
    )
    await patch(server, f"/api/v1/namespaces/{NS}/pods/{NAME}-group-1-1", {"status": crashing["status"]})
    await until(lambda: condition(server, "Degraded")["reason"] == "CrashLoopBackOff", "Degraded=CrashLoopBackOff")
    assert f"{NAME}-group-1-1" in condition(server, "Degraded")["message"]

    # Back to one node: the Deployment replaces the LWS.
    await patch(server, f"{LD_PATH}/{NAME}", {"metadata": {"generation": 2}, "spec": {"parallelism": {"tensor": 1, "nodes": 1}}})
    await until(lambda: any(owned_by_ld(d) for d in live(server, DEPLOYMENTS).values()), "the Deployment")
    await until(lambda: not live(server, LEADER_WORKER_SETS), "the LWS to be deleted")


@pytest.mark.asyncio
async def test_multi_node_without_the_lws_crd_reports_how_to_install_it_and_backs_off(server, operator):
    await create(server, llmdeployment(**MULTI_NODE))
    await until(lambda: condition(server, "Ready")["reason"] == "ReconcileFailed", "Ready=ReconcileFailed")
    message = condition(server, "Ready")["message"]
    assert "does not serve LeaderWorkerSet" in message, message
    assert ("the LeaderWorkerSet CRD is not installed: install the LWS controller "
            "(https://lws.sigs.k8s.io/docs/installation/), or set parallelism.nodes: 1") in message, message
    warning = await until(lambda: events(server, "ReconcileFailed"), "a ReconcileFailed Event")
    assert warning[0]["type"] == "Warning"
    assert [s for s in live(server, SERVICES).values() if owned_by_ld(s)]  # applied before the LWS
    # Retried with kopf's growing backoff (1, 2, 4 s...), not in a hot loop: each attempt applies the Service
    # first, so its applies count the attempts.
    await asyncio.sleep(3)
    attempts = [r for r in server if r.method == "PATCH" and r.resource == SERVICES and r.headers.get("Authorization")]
    assert 1 <= len(attempts) <= 5, len(attempts)

    # One node again: the Deployment is applied and the failure clears.
    await patch(server, f"{LD_PATH}/{NAME}", {"metadata": {"generation": 2}, "spec": {"parallelism": {"tensor": 1, "nodes": 1}}})
    await until(lambda: any(owned_by_ld(d) for d in live(server, DEPLOYMENTS).values()), "the Deployment")
    await until(lambda: condition(server, "Ready")["reason"] != "ReconcileFailed", "ReconcileFailed to clear")


@pytest.mark.asyncio
async def test_deletion_is_not_blocked_by_the_finalizer(server, operator):
    await create_and_wait_for_children(server)
    await until(
        lambda: "kubellm.io/finalizer" in ld_object(server)["metadata"].get("finalizers", []), "finalizer"
    )
    async with server.delete(f"{LD_PATH}/{NAME}", headers=CLOSE) as resp:
        assert resp.status < 300
    await until(lambda: server.objects[LD_RESOURCE, NS, NAME].deleted, "the LLMDeployment to be gone")
    await until(lambda: not operator.objects, "the observer to stop")


# ---------------------------------------------------------------------------------------------------
# Helpers of handlers.py (no operator needed)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_api_access_finds_every_kind_by_discovery(server):
    """No plural table: core, grouped, add-on and custom kinds resolve through the server's discovery, and the
    requests land on the paths the API server serves (apply as application/apply-patch+yaml, forced)."""
    server.resources["keda.sh/v1alpha1/scaledobjects"] = kmock.ResourceInfo(
        kind="ScaledObject", namespaced=True, verbs=VERBS
    )
    kube = await Kube.connect(handlers.FIELD_MANAGER, kubernetes.client.Configuration(host=str(server.url)))
    try:
        for api_version, kind, path in (
            ("v1", "Service", "/api/v1/namespaces/ml/services/x"),
            ("apps/v1", "Deployment", "/apis/apps/v1/namespaces/ml/deployments/x"),
            ("autoscaling/v2", "HorizontalPodAutoscaler", "/apis/autoscaling/v2/namespaces/ml/horizontalpodautoscalers/x"),
            ("keda.sh/v1alpha1", "ScaledObject", "/apis/keda.sh/v1alpha1/namespaces/ml/scaledobjects/x"),
            (api.API_VERSION, api.KIND, f"/apis/{api.GROUP}/{api.VERSION}/namespaces/ml/{api.PLURAL}/x"),
        ):  # fmt: skip
            # (discovery is lazy and synchronous: off the loop that runs kmock)
            resource = await asyncio.to_thread(kube.client.resources.get, api_version=api_version, kind=kind)
            assert resource.path(name="x", namespace="ml") == path
        assert await kube.serves("keda.sh/v1alpha1", "ScaledObject")
        assert not await kube.serves("monitoring.coreos.com/v1", "ServiceMonitor")
        assert await kube.list("monitoring.coreos.com/v1", "ServiceMonitor", NS, {}) == []  # not served: none

        service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x", "namespace": NS}}
        await kube.apply(service)
        assert (await kube.get("v1", "Service", NS, "x"))["metadata"]["name"] == "x"
        await create(server, llmdeployment())
        await kube.patch_status(api.API_VERSION, api.KIND, NS, NAME, {"status": {"readyText": "0/1"}})
        await kube.delete("v1", "Service", NS, "x")
        assert await kube.get("v1", "Service", NS, "x") is None
        await kube.delete("v1", "Service", NS, "x")  # gone already is fine
    finally:
        kube.close()
    requests = [(r.method.value.upper(), r.url.path, dict(r.params), r.headers.get("Content-Type", "")) for r in server]
    assert ("PATCH", f"/api/v1/namespaces/{NS}/services/x",
            {"fieldManager": handlers.FIELD_MANAGER, "force": "true"}, "application/apply-patch+yaml") in requests
    assert ("PATCH", f"{LD_PATH}/{NAME}/status", {}, "application/merge-patch+json") in requests
    assert [m for m, path, _, _ in requests if path == f"/api/v1/namespaces/{NS}/services/x"] == [
        "PATCH", "GET", "DELETE", "GET", "DELETE"
    ]  # fmt: skip


@pytest.mark.asyncio
async def test_discovery_is_shared_by_threads_and_a_missing_kind_is_looked_for_again_later(server, monkeypatch):
    kube = await Kube.connect(handlers.FIELD_MANAGER, kubernetes.client.Configuration(host=str(server.url)))
    keda = ("keda.sh/v1alpha1", "ScaledObject")
    try:
        # Every miss re-reads discovery while other threads look kinds up: the cache must hold together.
        monkeypatch.setattr(kube_mod, "REDISCOVER_AFTER", 0.0)
        kinds = [("apps/v1", "Deployment"), ("v1", "Service"), keda, ("policy/v1", "PodDisruptionBudget")] * 8
        assert await asyncio.gather(*(kube.list(v, k, NS, {}) for v, k in kinds)) == [[]] * len(kinds)

        # A kind installed later is found once REDISCOVER_AFTER has passed since the last re-read, not before.
        monkeypatch.setattr(kube_mod, "REDISCOVER_AFTER", 3600.0)
        server.resources["keda.sh/v1alpha1/scaledobjects"] = kmock.ResourceInfo(
            kind="ScaledObject", namespaced=True, verbs=VERBS
        )
        requests = len(list(server))
        assert not await kube.serves(*keda)
        assert len(list(server)) == requests  # a known miss costs no request
        monkeypatch.setattr(kube_mod, "REDISCOVER_AFTER", 0.0)
        assert await kube.serves(*keda)
    finally:
        kube.close()


def test_merge_patch_diff_nulls_what_went_away():
    old = {"a": 1, "auto": {"x": 1, "blocked": "why"}, "gone": {"k": 1}, "same": [1]}
    new = {"a": 2, "auto": {"x": 1}, "same": [1], "added": True}
    assert merge_patch_diff(old, new) == {
        "a": 2,
        "auto": {"blocked": None},
        "gone": None,
        "added": True,
    }


def test_describe_invalid_names_the_field():
    with pytest.raises(pydantic.ValidationError) as e:
        api.LLMDeployment.model_validate(llmdeployment(replicas=-1))
    assert status_mod.describe_invalid(e.value).startswith("spec.replicas: ")


def test_run_needs_exactly_one_namespace_scope():
    with pytest.raises(ValueError, match="not both"):
        handlers.run(["ml"], True, None, True)
    with pytest.raises(ValueError, match="namespaces"):
        handlers.run(None, False, None, True)


def _deployment(replicas_in_spec: bool, manager: str = "kubellm-operator", owns: bool = True) -> tuple[dict, dict]:
    child = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "m", "namespace": "ns"},
             "spec": {"replicas": 2} if replicas_in_spec else {}}
    fields = {"f:spec": {"f:replicas": {}, "f:template": {}}} if owns else {"f:spec": {"f:template": {}}}
    existing = {"metadata": {"name": "m", "managedFields": [{"manager": manager, "operation": "Apply",
                                                             "fieldsV1": fields}]},
                "spec": {"replicas": 3}}
    return child, existing


def test_turning_autoscaling_on_parks_replicas_with_a_handover_manager_first():
    child, existing = _deployment(replicas_in_spec=False)
    handover = replicas_handover(child, existing, "kubellm-operator")
    assert handover == {"apiVersion": "apps/v1", "kind": "Deployment",
                        "metadata": {"name": "m", "namespace": "ns"}, "spec": {"replicas": 3}}


@pytest.mark.parametrize("case", ["replicas still rendered", "field owned by someone else", "new Deployment"])
def test_no_replicas_handover_when_nothing_would_be_lost(case):
    if case == "replicas still rendered":
        child, existing = _deployment(replicas_in_spec=True)
    elif case == "field owned by someone else":
        child, existing = _deployment(replicas_in_spec=False, manager="kube-controller-manager")
    else:
        child, existing = _deployment(replicas_in_spec=False)[0], None
    assert replicas_handover(child, existing, "kubellm-operator") is None


def test_as_deployment_reads_a_leader_worker_set_in_the_deployments_shape():
    spec = {"model": {"uri": "hf://org/llama"}, "parallelism": {"tensor": 2, "nodes": 2}, "replicas": 3}
    ld = api.LLMDeployment.model_validate({**llmdeployment(), "spec": spec})
    lws = render.render_workload(ld)
    lws["metadata"]["generation"] = 4
    available = {"type": "Available", "status": "True", "reason": "AllGroupsReady", "message": "",
                 "lastTransitionTime": "2026-01-01T00:00:00Z"}  # fmt: skip
    lws["status"] = {"replicas": 3, "readyReplicas": 2, "updatedReplicas": 3, "observedGeneration": 4,
                     "hpaPodSelector": "x", "conditions": [available]}  # fmt: skip
    shaped = as_deployment(lws)
    assert shaped["status"] == {"replicas": 3, "readyReplicas": 2, "availableReplicas": 2, "updatedReplicas": 3,
                                "observedGeneration": 4, "conditions": [available]}  # fmt: skip
    assert shaped["spec"]["replicas"] == 3 and shaped["metadata"]["generation"] == 4
    assert shaped["spec"]["selector"]["matchLabels"] == naming.serving_selector(ld)  # the leaders
    assert shaped["spec"]["template"] == lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    assert template_id(lws) == lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["annotations"][
        naming.SPEC_HASH_ANNOTATION]  # fmt: skip
    # A Deployment passes through as it is; no workload stays None.
    deployment = deployment_mod.render_deployment(ld)
    assert as_deployment(deployment) == deployment and as_deployment(None) is None
