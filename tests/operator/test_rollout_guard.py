"""The rollout guard (operator/status/rollout_guard.py) as pure functions over Deployment, ReplicaSet and pod fixtures,
its effect on render (the strategy a rollout replacing in place gets, and back) and on the status conditions,
Events and kstatus."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import test_render

import gitops_health
from kubellm.operator import api, render
from kubellm.operator.render import deployment as deployment_mod
from kubellm.operator.render import naming
from kubellm.operator.status import observe as status_mod
from kubellm.operator.status import rollout_guard

NOW = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)
GPU_MESSAGE = (
    "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available: "
    "3 No preemption victims found for incoming pod."
)
DEPLOYMENT_UID = "d-uid"


def ld_of(**rollout: Any) -> api.LLMDeployment:
    return api.LLMDeployment.model_validate({
        "metadata": {"name": "llama", "namespace": "ml", "uid": "u", "generation": 2},
        "spec": {"model": {"uri": "hf://org/llama"}, "replicas": 2, "rollout": rollout},
    })  # fmt: skip


def stamp(when: datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def deployment_of(
    ld: api.LLMDeployment, *, replace_in_place: str | None = None, updated: int = 1, replicas: int = 3,
    available: int = 2,
) -> dict[str, Any]:
    """The Deployment as the API server holds it mid-rollout: render's, plus the controller's status."""
    d = deployment_mod.render_deployment(ld, replace_in_place=replace_in_place)
    d["metadata"].update(uid=DEPLOYMENT_UID, generation=5)
    d["metadata"].setdefault("annotations", {})[rollout_guard.REVISION_ANNOTATION] = "2"
    d["status"] = {"observedGeneration": 5, "replicas": replicas, "updatedReplicas": updated,
                   "availableReplicas": available, "readyReplicas": available}  # fmt: skip
    return d


def replicaset(deployment: dict[str, Any], template_hash: str, revision: str, *, current: bool) -> dict[str, Any]:
    template = copy.deepcopy(deployment["spec"]["template"])
    if not current:
        template["spec"]["containers"][0]["image"] = "old-image"
    template["metadata"]["labels"]["pod-template-hash"] = template_hash
    return {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {
            "name": f"llama-{template_hash}",
            "labels": {**deployment["spec"]["selector"]["matchLabels"], "pod-template-hash": template_hash},
            "annotations": {rollout_guard.REVISION_ANNOTATION: revision},
            "ownerReferences": [{"kind": "Deployment", "name": "llama", "uid": DEPLOYMENT_UID, "controller": True}],
        },
        "spec": {"template": template},
    }


def pod(name: str, template_hash: str, *, pending: str | None = None, since: datetime | None = None) -> dict[str, Any]:
    """A running pod, or one Unschedulable with the scheduler's message ``pending`` since ``since``."""
    p: dict[str, Any] = {
        "metadata": {"name": name, "labels": {"pod-template-hash": template_hash},
                     "creationTimestamp": stamp(NOW - timedelta(hours=1))},
        "status": {"phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"}]},
    }  # fmt: skip
    if pending is not None:
        p["status"] = {"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": pending,
            "lastTransitionTime": stamp(since or NOW),
        }]}  # fmt: skip
    return p


def surge_rollout(ld: api.LLMDeployment, *, waited: float, message: str = GPU_MESSAGE, replace_in_place=None):
    """Two old pods serving, the new ReplicaSet's surge pod Unschedulable for ``waited`` seconds."""
    d = deployment_of(ld, replace_in_place=replace_in_place)
    rs = [replicaset(d, "old111", "1", current=False), replicaset(d, "new222", "2", current=True)]
    pods = [pod("llama-old111-a", "old111"), pod("llama-old111-b", "old111"),
            pod("llama-new222-c", "new222", pending=message, since=NOW - timedelta(seconds=waited))]  # fmt: skip
    return d, rs, pods


# --------------------------------------------------------------------------------------------------
# decide
# --------------------------------------------------------------------------------------------------


def test_a_surge_pod_waiting_for_a_gpu_past_the_timeout_blocks_the_rollout():
    ld = ld_of()
    verdict = rollout_guard.decide(ld.spec, *surge_rollout(ld, waited=301), NOW)
    assert verdict.blocked and verdict.pod == "llama-new222-c" and verdict.message == GPU_MESSAGE
    assert verdict.since == NOW - timedelta(seconds=301)
    assert verdict.resource == "nvidia.com/gpu" and verdict.replace_in_place is None  # Wait is the default


def test_before_the_timeout_the_rollout_is_not_blocked_yet():
    ld = ld_of(surgeTimeoutSeconds=600)
    verdict = rollout_guard.decide(ld.spec, *surge_rollout(ld, waited=599), NOW)
    assert not verdict.blocked and verdict.pod == "llama-new222-c"
    assert rollout_guard.decide(ld.spec, *surge_rollout(ld, waited=600), NOW).blocked


def test_an_old_replicaset_pod_waiting_for_a_gpu_blocks_nothing():
    ld = ld_of()
    d, rs, pods = surge_rollout(ld, waited=3600)
    pods[2] = pod("llama-new222-c", "new222")
    pods[1] = pod("llama-old111-b", "old111", pending=GPU_MESSAGE, since=NOW - timedelta(hours=1))
    assert rollout_guard.decide(ld.spec, d, rs, pods, NOW) == rollout_guard.Verdict()


@pytest.mark.parametrize(
    "message",
    [
        "0/3 nodes are available: 3 node(s) had untolerated taint {dedicated: infra}.",
        "0/3 nodes are available: 3 Insufficient cpu.",
        "0/3 nodes are available: 3 Insufficient amd.com/gpu.",  # not the resource this spec asks for
    ],
)
def test_unschedulable_for_another_reason_is_not_a_gpu_block(message):
    ld = ld_of()
    verdict = rollout_guard.decide(ld.spec, *surge_rollout(ld, waited=3600, message=message), NOW)
    assert not verdict.blocked and verdict.pod is None


def test_the_gpu_resource_is_the_one_the_spec_asks_for():
    ld = api.LLMDeployment.model_validate({
        "metadata": {"name": "llama", "namespace": "ml"},
        "spec": {"model": {"uri": "hf://org/llama"}, "resources": {"gpu": {"resourceName": "amd.com/gpu"}}},
    })  # fmt: skip
    message = "0/2 nodes are available: 2 Insufficient amd.com/gpu."
    verdict = rollout_guard.decide(ld.spec, *surge_rollout(ld, waited=400, message=message), NOW)
    assert verdict.blocked and verdict.resource == "amd.com/gpu"
    assert not rollout_guard.decide(ld.spec, *surge_rollout(ld, waited=400), NOW).blocked  # nvidia.com/gpu


def test_a_nominated_node_means_a_preemption_is_making_room():
    ld = ld_of()
    d, rs, pods = surge_rollout(ld, waited=3600)
    pods[2]["status"]["nominatedNodeName"] = "gpu-node-1"
    assert not rollout_guard.decide(ld.spec, d, rs, pods, NOW).blocked


def test_a_finished_rollout_is_never_blocked():
    ld = ld_of()
    d, rs, pods = surge_rollout(ld, waited=3600)
    d["status"].update(replicas=2, updatedReplicas=2, availableReplicas=2)
    assert rollout_guard.decide(ld.spec, d, rs, pods, NOW) == rollout_guard.Verdict()


def test_without_old_pods_it_is_a_scale_up_not_a_blocked_rollout():
    ld = ld_of()
    d, rs, pods = surge_rollout(ld, waited=3600)
    assert not rollout_guard.decide(ld.spec, d, rs, pods[2:], NOW).blocked


def test_a_cpu_deployment_is_never_blocked_on_gpus():
    ld = api.LLMDeployment.model_validate({
        "metadata": {"name": "llama", "namespace": "ml"},
        "spec": {"model": {"uri": "smollm2"}, "resources": {"gpu": {"count": 0}}},
    })  # fmt: skip
    assert not rollout_guard.decide(ld.spec, *surge_rollout(ld, waited=3600), NOW).blocked


def test_multi_node_replicas_are_not_guarded():
    ld = ld_of()
    d, rs, pods = surge_rollout(ld, waited=3600)
    multi = api.LLMDeployment.model_validate({
        "metadata": {"name": "llama", "namespace": "ml"},
        "spec": {"model": {"uri": "hf://org/llama"}, "parallelism": {"tensor": 2, "nodes": 2}},
    })  # fmt: skip
    assert not rollout_guard.decide(multi.spec, d, rs, pods, NOW).blocked
    assert rollout_guard.decide(ld.spec, d, rs, pods, NOW).blocked


def test_the_new_replicaset_is_found_by_template_then_by_revision():
    ld = ld_of()
    d, rs, _ = surge_rollout(ld, waited=0)
    assert rollout_guard.new_replicaset(d, rs)["metadata"]["name"] == "llama-new222"
    # Templates that differ in defaulted fields: the Deployment's revision names the new one...
    rs[1]["spec"]["template"]["spec"]["dnsPolicy"] = "ClusterFirst"
    assert rollout_guard.new_replicaset(d, rs)["metadata"]["name"] == "llama-new222"
    # ...but only once the controller has seen the latest spec (else its revision is the old one's).
    d["status"]["observedGeneration"] = 4
    assert rollout_guard.new_replicaset(d, rs) is None
    # Another Deployment's ReplicaSet is never ours.
    rs[1]["metadata"]["ownerReferences"][0]["uid"] = "someone-else"
    d["status"]["observedGeneration"] = 5
    assert rollout_guard.new_replicaset(d, rs) is None


# --------------------------------------------------------------------------------------------------
# ReplaceInPlace: the strategy render gets, and back
# --------------------------------------------------------------------------------------------------


def spec_hash(ld: api.LLMDeployment) -> str:
    return deployment_mod.render_deployment(ld)["spec"]["template"]["metadata"]["annotations"][naming.SPEC_HASH_ANNOTATION]


def test_replace_in_place_names_the_template_once_blocked_and_keeps_it_until_complete():
    ld = ld_of(onNoSpareGPU="ReplaceInPlace")
    assert rollout_guard.decide(ld.spec, *surge_rollout(ld, waited=10), NOW).replace_in_place is None
    blocked = rollout_guard.decide(ld.spec, *surge_rollout(ld, waited=300), NOW)
    assert blocked.blocked and blocked.replace_in_place == spec_hash(ld)

    # Switched: the surge pod got the GPU an old pod freed, nothing waits, the rollout goes on in place.
    d, rs, pods = surge_rollout(ld, waited=0, replace_in_place=spec_hash(ld))
    pods[2] = pod("llama-new222-c", "new222")
    going_on = rollout_guard.decide(ld.spec, d, rs, pods, NOW)
    assert not going_on.blocked and going_on.replace_in_place == spec_hash(ld)
    assert not rollout_guard.needs_apply(ld.spec.rollout, d, going_on)

    # Complete: the spec's strategy comes back.
    d["status"].update(replicas=2, updatedReplicas=2, availableReplicas=2)
    done = rollout_guard.decide(ld.spec, d, rs, pods, NOW)
    assert done.replace_in_place is None and rollout_guard.needs_apply(ld.spec.rollout, d, done)
    restored = deployment_mod.render_deployment(ld, replace_in_place=done.replace_in_place)
    assert restored["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert deployment_mod.IN_PLACE_ANNOTATION not in restored["metadata"].get("annotations", {})


def test_with_wait_a_blocked_rollout_keeps_the_specs_strategy():
    ld = ld_of()
    d, rs, pods = surge_rollout(ld, waited=3600)
    verdict = rollout_guard.decide(ld.spec, d, rs, pods, NOW)
    assert verdict.blocked and not rollout_guard.needs_apply(ld.spec.rollout, d, verdict)


def test_render_switches_the_strategy_only_for_the_template_it_was_decided_for():
    ld = ld_of(onNoSpareGPU="ReplaceInPlace")
    d = deployment_mod.render_deployment(ld, replace_in_place=spec_hash(ld))
    assert d["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    assert d["metadata"]["annotations"] == {deployment_mod.IN_PLACE_ANNOTATION: spec_hash(ld)}
    assert rollout_guard.carried_in_place(d) == spec_hash(ld)
    # A new template is a new rollout: it starts with the spec's strategy.
    changed = ld_of(onNoSpareGPU="ReplaceInPlace")
    changed.spec.dtype = "float16"
    other = deployment_mod.render_deployment(changed, replace_in_place=spec_hash(ld))
    assert other["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert "annotations" not in other["metadata"]
    # The pods are the same either way: the strategy is no part of the template.
    assert d["spec"]["template"] == deployment_mod.render_deployment(ld)["spec"]["template"]


def test_needs_apply_compares_what_the_api_server_holds():
    ld = ld_of(maxSurge="25%", maxUnavailable="10%", onNoSpareGPU="ReplaceInPlace")
    d = deployment_of(ld)
    assert not rollout_guard.needs_apply(ld.spec.rollout, d, rollout_guard.Verdict())
    d["spec"]["strategy"]["rollingUpdate"] = {"maxSurge": "25%", "maxUnavailable": "10%"}
    assert not rollout_guard.needs_apply(ld.spec.rollout, d, rollout_guard.Verdict())
    in_place = rollout_guard.Verdict(replace_in_place=spec_hash(ld))
    assert in_place.strategy(ld.spec.rollout) == {"maxSurge": 0, "maxUnavailable": "10%"}
    assert rollout_guard.needs_apply(ld.spec.rollout, d, in_place)
    # The strategy alone is not enough: the annotation carries the switch through a reconcile.
    d["spec"]["strategy"]["rollingUpdate"] = {"maxSurge": 0, "maxUnavailable": "10%"}
    assert rollout_guard.needs_apply(ld.spec.rollout, d, in_place)
    assert not rollout_guard.needs_apply(ld.spec.rollout, deployment_of(ld, replace_in_place=spec_hash(ld)), in_place)
    assert not rollout_guard.needs_apply(ld.spec.rollout, None, in_place)


@pytest.mark.parametrize(
    ("max_unavailable", "in_place"), [(0, 1), ("0%", 1), (2, 2), ("25%", "25%")]
)
def test_in_place_keeps_a_nonzero_max_unavailable(max_unavailable, in_place):
    rollout = api.RolloutSpec(max_unavailable=max_unavailable)
    assert deployment_mod.in_place_strategy(rollout) == {"maxSurge": 0, "maxUnavailable": in_place}


@pytest.mark.parametrize(("spec", "available"), [c[1:] for c in test_render.CASES], ids=[c[0] for c in test_render.CASES])
def test_the_render_matrix_replacing_in_place_stays_valid(spec, available):
    ld = test_render.make(spec)
    children = render.render(ld, service_monitor_available=available, replace_in_place=spec_hash(ld))
    test_render.check_all(ld, children)  # kubernetes-validate --strict, names, labels, owner references
    if ld.spec.parallelism.nodes > 1:  # a LeaderWorkerSet, which the guard leaves alone
        assert "Deployment" not in [c["kind"] for c in children]
        return
    (deployment,) = [c for c in children if c["kind"] == "Deployment"]
    assert deployment["spec"]["strategy"]["rollingUpdate"] == deployment_mod.in_place_strategy(ld.spec.rollout)


def test_the_spec_hash_annotation_is_renders():
    assert naming.SPEC_HASH_ANNOTATION == naming.SPEC_HASH_ANNOTATION


# --------------------------------------------------------------------------------------------------
# Status: Progressing, Events, kstatus
# --------------------------------------------------------------------------------------------------


def observe(ld, d, pods, previous, verdict):
    return status_mod.observe(ld, d, None, pods, previous, now=NOW, template_changed=True, guard=verdict)


def test_a_blocked_rollout_is_progressing_false_stalled_with_one_warning():
    ld = ld_of()
    d, rs, pods = surge_rollout(ld, waited=301)
    rolling, _ = observe(ld, d, pods, None, rollout_guard.decide(ld.spec, d, rs, pods, NOW - timedelta(seconds=2)))
    assert rolling.get_condition("Progressing").reason == "Rolling"

    verdict = rollout_guard.decide(ld.spec, d, rs, pods, NOW)
    status, events = observe(ld, d, pods, rolling, verdict)
    progressing = status.get_condition("Progressing")
    assert (progressing.status, progressing.reason) == ("False", "RolloutBlockedNoSpareGPU")
    assert GPU_MESSAGE in progressing.message and "llama-new222-c" in progressing.message
    assert "since 2026-05-01T11:54:59Z" in progressing.message  # a time: the message holds still
    assert "onNoSpareGPU: ReplaceInPlace" in progressing.message
    assert [e.reason for e in events if e.type == "Warning"].count("RolloutBlockedNoSpareGPU") == 1
    assert status.get_condition("Stalled").status == "True"
    assert status.get_condition("Stalled").reason == "RolloutBlockedNoSpareGPU"
    assert status.get_condition("Reconciling").status == "False"
    assert status.get_condition("Ready").status == "True"  # maxUnavailable 0: the old pods still serve

    again, events = observe(ld, d, pods, status, verdict)  # the next observation: no second Warning
    assert again.get_condition("Progressing").reason == "RolloutBlockedNoSpareGPU"
    assert not [e for e in events if e.reason == "RolloutBlockedNoSpareGPU"]

    # A GPU frees up: the pod schedules, the rollout goes on and its completion is announced.
    pods[2] = pod("llama-new222-c", "new222")
    d["status"].update(replicas=2, updatedReplicas=2, availableReplicas=2)
    done, events = observe(ld, d, pods, again, rollout_guard.decide(ld.spec, d, rs, pods, NOW))
    assert done.get_condition("Progressing").reason == "Complete"
    assert "RolloutComplete" in [e.reason for e in events]
    assert done.get_condition("Stalled").status == "False"


def test_past_the_deployments_progress_deadline_the_gpu_reason_still_names_progressing():
    ld = ld_of()
    d, rs, pods = surge_rollout(ld, waited=1300)
    d["status"]["conditions"] = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                                  "message": 'ReplicaSet "llama-new222" has timed out progressing.'}]  # fmt: skip
    status, _ = observe(ld, d, pods, None, rollout_guard.decide(ld.spec, d, rs, pods, NOW))
    assert status.get_condition("Progressing").reason == "RolloutBlockedNoSpareGPU"
    assert status.get_condition("Degraded").reason == "ProgressDeadlineExceeded"
    assert status.get_condition("Stalled").status == "True"


def test_replacing_in_place_is_progressing_true_reconciling_with_its_event():
    ld = ld_of(onNoSpareGPU="ReplaceInPlace")
    d, rs, pods = surge_rollout(ld, waited=301)
    verdict = rollout_guard.decide(ld.spec, d, rs, pods, NOW)
    status, events = observe(ld, d, pods, None, verdict)
    progressing = status.get_condition("Progressing")
    assert (progressing.status, progressing.reason) == ("True", "ReplacingInPlace")
    assert "maxSurge 0, maxUnavailable 1" in progressing.message and GPU_MESSAGE in progressing.message
    reasons = [(e.type, e.reason) for e in events]
    assert ("Warning", "RolloutBlockedNoSpareGPU") in reasons and ("Normal", "RolloutReplacingInPlace") in reasons
    assert status.get_condition("Stalled").status == "False"
    assert status.get_condition("Reconciling").status == "True"

    _, events = observe(ld, d, pods, status, verdict)
    assert not [e for e in events if e.reason in ("RolloutBlockedNoSpareGPU", "RolloutReplacingInPlace")]


def test_gitops_tools_read_a_blocked_wait_as_failed_and_replacing_in_place_as_in_progress():
    ld = ld_of()
    d, rs, pods = surge_rollout(ld, waited=301)
    blocked, _ = observe(ld, d, pods, None, rollout_guard.decide(ld.spec, d, rs, pods, NOW))
    ld = ld_of(onNoSpareGPU="ReplaceInPlace")
    replacing, _ = observe(ld, d, pods, None, rollout_guard.decide(ld.spec, d, rs, pods, NOW))

    def body(status):
        return {"kind": api.KIND, "metadata": {"generation": 2}, "status": status.to_k8s()}

    assert gitops_health.kstatus(body(blocked))[0] == gitops_health.FAILED
    assert gitops_health.argo_health(body(blocked))[0] == "Degraded"
    assert gitops_health.kstatus(body(replacing))[0] == gitops_health.IN_PROGRESS
    assert gitops_health.argo_health(body(replacing))[0] == "Progressing"
