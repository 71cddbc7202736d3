"""The rollout guard end to end: the operator (kopf + handlers.py) against kmock, with the Deployment controller and
the scheduler simulated by writing the ReplicaSets, the pods (a surge pod Unschedulable for want of a GPU) and the
Deployment's status (see test_operator_kmock.py for what kmock is and is not).

kmock's PATCH is a plain merge, not server-side apply: an annotation render stops writing stays there. The tests
therefore check what the operator *sends* (its server-side applies) as well as what the objects end up holding.
"""

from __future__ import annotations

import copy
from typing import Any

import kmock
import pytest
import pytest_asyncio
import test_operator_kmock as t

from kubellm.operator.control import metrics
from kubellm.operator.render import deployment as deployment_mod
from kubellm.operator.testing import REPLICASETS, operator_running

pytestmark = pytest.mark.kmock(cls=t.ApiServer)

GPU_MESSAGE = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
AN_HOUR_AGO = "2020-01-01T00:00:00Z"  # long past any surgeTimeoutSeconds


@pytest_asyncio.fixture
async def server(kmock: kmock.KubernetesEmulator) -> kmock.KubernetesEmulator:
    t.declare_resources(kmock)
    return kmock


@pytest_asyncio.fixture
async def operator(server, tmp_path, monkeypatch):
    async with operator_running(server, tmp_path, monkeypatch, observe_interval=0.5) as memo:
        yield memo.kubellm


async def post(server, path: str, body: dict[str, Any]) -> None:
    async with server.post(path, json=body, headers=t.CLOSE) as resp:
        assert resp.status < 300, await resp.text()


def replicaset(deployment: dict[str, Any], template_hash: str, *, current: bool) -> dict[str, Any]:
    """The ReplicaSet the Deployment controller would make: the Deployment's template (an older one if not
    ``current``) with the pod-template-hash label."""
    template = copy.deepcopy(deployment["spec"]["template"])
    if not current:
        template["metadata"]["annotations"]["kubellm.io/spec-hash"] = "0ld0ld0ld0ld0ld0"
    template["metadata"]["labels"]["pod-template-hash"] = template_hash
    return {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {"name": f"{t.NAME}-{template_hash}", "namespace": t.NS,
                     "labels": {**deployment["spec"]["selector"]["matchLabels"], "pod-template-hash": template_hash},
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": t.NAME,
                                          "uid": "deployment-uid", "controller": True}]},
        "spec": {"selector": {"matchLabels": deployment["spec"]["selector"]["matchLabels"]}, "template": template},
    }  # fmt: skip


async def surge_pod_waits_for_a_gpu(server) -> dict[str, Any]:
    """Mid-rollout: two old pods serve, the new ReplicaSet's surge pod has been Unschedulable (insufficient
    nvidia.com/gpu) since long ago. Returns the Deployment."""
    await t.until(lambda: [d for d in t.live(server, t.DEPLOYMENTS).values() if t.owned_by_ld(d)], "the Deployment")
    deployment = t.the_deployment(server)
    labels = deployment["spec"]["selector"]["matchLabels"]
    await t.simulate_deployment_status(  # first: the pending pod below is what makes the rollout blocked
        server, deployment, replicas=3, updatedReplicas=1, readyReplicas=2, availableReplicas=2
    )
    await post(server, f"/apis/apps/v1/namespaces/{t.NS}/replicasets", replicaset(deployment, "old111", current=False))
    await post(server, f"/apis/apps/v1/namespaces/{t.NS}/replicasets", replicaset(deployment, "new222", current=True))
    for name in ("llama-old111-a", "llama-old111-b"):
        await post(server, f"/api/v1/namespaces/{t.NS}/pods", t.running_pod(name, {**labels, "pod-template-hash": "old111"}))
    pending = t.running_pod("llama-new222-c", {**labels, "pod-template-hash": "new222"})
    pending["status"] = {"phase": "Pending", "conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": GPU_MESSAGE,
        "lastTransitionTime": AN_HOUR_AGO,
    }]}  # fmt: skip
    await post(server, f"/api/v1/namespaces/{t.NS}/pods", pending)
    return deployment


def replicaset_lists(server) -> int:
    """How many times the operator listed ReplicaSets: once per observation of a rollout under way."""
    return sum(1 for r in list(server) if r.resource == REPLICASETS and r.method == "GET" and r.headers.get("Authorization"))


def deployment_applies(server) -> list[dict[str, Any]]:
    """The bodies of the operator's server-side applies to the Deployment, in order."""
    return [
        r.data for r in list(server)
        if r.resource == t.DEPLOYMENTS and r.method == "PATCH" and "apply-patch" in r.headers.get("Content-Type", "")
    ]  # fmt: skip


def rolling_update(server) -> dict[str, Any]:
    return t.the_deployment(server)["spec"]["strategy"]["rollingUpdate"]


@pytest.mark.asyncio
async def test_a_surge_pod_without_a_gpu_blocks_the_rollout_with_one_warning(server, operator):
    await t.create(server, t.llmdeployment(replicas=2))
    await surge_pod_waits_for_a_gpu(server)

    progressing = await t.until(
        lambda: (c := t.condition(server, "Progressing")) and c["reason"] == "RolloutBlockedNoSpareGPU" and c,
        "Progressing=False/RolloutBlockedNoSpareGPU",
    )
    assert progressing["status"] == "False"
    assert GPU_MESSAGE in progressing["message"] and "llama-new222-c" in progressing["message"]
    assert t.condition(server, "Stalled")["status"] == "True"
    assert t.condition(server, "Ready")["status"] == "True"  # maxUnavailable 0: the old pods serve on

    # Several more observations (each lists the ReplicaSets) post no second Warning.
    seen = replicaset_lists(server)
    await t.until(lambda: replicaset_lists(server) >= seen + 3, "three more observations")
    warnings = t.events(server, "RolloutBlockedNoSpareGPU")
    assert len(warnings) == 1 and warnings[0]["type"] == "Warning"
    assert metrics.REGISTRY.get_sample_value("kubellm_operator_rollouts_blocked") == 1
    assert GPU_MESSAGE in warnings[0]["message"]
    # With Wait the strategy stays the spec's.
    assert rolling_update(server) == {"maxSurge": 1, "maxUnavailable": 0}
    assert not t.events(server, "RolloutReplacingInPlace")


@pytest.mark.asyncio
async def test_replace_in_place_switches_the_strategy_by_apply_and_restores_it_after_completion(server, operator):
    await t.create(server, t.llmdeployment(replicas=2, rollout={"onNoSpareGPU": "ReplaceInPlace"}))
    deployment = await surge_pod_waits_for_a_gpu(server)
    spec_hash = deployment["spec"]["template"]["metadata"]["annotations"]["kubellm.io/spec-hash"]

    await t.until(lambda: rolling_update(server) == {"maxSurge": 0, "maxUnavailable": 1}, "the in-place strategy")
    switch = deployment_applies(server)[-1]
    assert switch["metadata"]["annotations"] == {deployment_mod.IN_PLACE_ANNOTATION: spec_hash}
    assert switch["spec"]["template"] == deployment["spec"]["template"]  # the pods are left as they are
    progressing = await t.until(
        lambda: (c := t.condition(server, "Progressing")) and c["reason"] == "ReplacingInPlace" and c,
        "Progressing=True/ReplacingInPlace",
    )
    assert progressing["status"] == "True" and GPU_MESSAGE in progressing["message"]
    normal = await t.until(lambda: t.events(server, "RolloutReplacingInPlace"), "a RolloutReplacingInPlace Event")
    assert normal[0]["type"] == "Normal" and len(t.events(server, "RolloutBlockedNoSpareGPU")) == 1
    assert t.condition(server, "Stalled")["status"] == "False"
    assert t.condition(server, "Reconciling")["status"] == "True"

    # An old pod goes, the surge pod gets its GPU: the rollout goes on in place, with nothing pending.
    running = t.running_pod("llama-new222-c", {**deployment["spec"]["selector"]["matchLabels"],
                                               "pod-template-hash": "new222"})  # fmt: skip
    await t.patch(server, t.child_path("v1", "pods", "llama-new222-c", "status"), {"status": running["status"]})
    async with server.delete(t.child_path("v1", "pods", "llama-old111-b"), headers=t.CLOSE) as resp:
        assert resp.status < 300
    # A reconcile meanwhile (a replicas change; an operator restart resumes likewise) keeps the in-place strategy.
    await t.patch(server, f"{t.LD_PATH}/{t.NAME}", {"metadata": {"generation": 2}, "spec": {"replicas": 3}})
    reconciled = await t.until(
        lambda: [a for a in deployment_applies(server) if a["spec"].get("replicas") == 3], "the reconcile's apply"
    )
    assert reconciled[0]["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}

    # Complete: the next apply renders the spec's strategy, without the annotation.
    await t.simulate_deployment_status(
        server, deployment, replicas=3, updatedReplicas=3, readyReplicas=3, availableReplicas=3
    )
    await t.until(lambda: rolling_update(server) == {"maxSurge": 1, "maxUnavailable": 0}, "the spec's strategy")
    restore = deployment_applies(server)[-1]
    assert "annotations" not in restore["metadata"]
    await t.until(lambda: t.condition(server, "Progressing")["reason"] == "Complete", "Progressing=Complete")
    assert metrics.REGISTRY.get_sample_value("kubellm_operator_rollouts_blocked") == 0
    await t.until(lambda: t.events(server, "RolloutComplete"), "a RolloutComplete Event")
