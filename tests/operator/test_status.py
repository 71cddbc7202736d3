"""status.observe / invalid_spec_status: children (plain dicts) and the previous status in, status and Events out."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import jsonschema
import pytest

from kubellm.operator.api import LLMDeployment, LLMDeploymentStatus
from kubellm.operator.crd import schema as crd
from kubellm.operator.status.observe import (
    Event,
    current_queue_depth,
    invalid_spec_status,
    observe,
    quantity_to_float,
)

T0 = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def make_ld(generation: int = 1, **spec: Any) -> LLMDeployment:
    return LLMDeployment.model_validate(
        {
            "metadata": {"name": "llama", "namespace": "ml", "uid": "uid-1", "generation": generation},
            "spec": {"model": {"uri": "hf://org/llama"}, **spec},
        }
    )


def make_deployment(
    desired: int = 2,
    *,
    replicas: int | None = None,
    ready: int | None = None,
    updated: int | None = None,
    available: int | None = None,
    generation: int | None = None,
    observed: int | None = None,
    conditions: list[dict] | None = None,
) -> dict:
    status: dict[str, Any] = {
        "replicas": desired if replicas is None else replicas,
        "readyReplicas": desired if ready is None else ready,
        "updatedReplicas": desired if updated is None else updated,
        "availableReplicas": desired if available is None else available,
    }
    if observed is not None:
        status["observedGeneration"] = observed
    if conditions:
        status["conditions"] = conditions
    meta: dict[str, Any] = {"name": "llama", "namespace": "ml"}
    if generation is not None:
        meta["generation"] = generation
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {"replicas": desired, "selector": {"matchLabels": {"kubellm.io/llmdeployment": "llama"}}},
        "status": status,
    }


def make_pod(
    name: str = "llama-abc",
    *,
    started: bool = True,
    ready: bool = True,
    waiting: tuple[str, str] | None = None,
    last_terminated: tuple[str, datetime] | None = None,
    not_ready_since: datetime | None = None,
    terminating: bool = False,
    unschedulable: str | None = None,
) -> dict:
    container: dict[str, Any] = {"name": "runtime", "ready": ready, "started": started, "restartCount": 0}
    if waiting:
        container["state"] = {"waiting": {"reason": waiting[0], "message": waiting[1]}}
        container["started"] = False
        container["ready"] = False
    else:
        container["state"] = {"running": {"startedAt": iso(T0 - timedelta(hours=1))}}
    if last_terminated:
        container["lastState"] = {
            "terminated": {"reason": last_terminated[0], "finishedAt": iso(last_terminated[1])}
        }
        container["restartCount"] = 3
    conditions = []
    if not_ready_since is not None:
        conditions.append({"type": "Ready", "status": "False", "lastTransitionTime": iso(not_ready_since)})
    if unschedulable:
        conditions.append(
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": unschedulable}
        )
    meta: dict[str, Any] = {"name": name, "namespace": "ml", "labels": {"kubellm.io/llmdeployment": "llama"}}
    if terminating:
        meta["deletionTimestamp"] = iso(T0)
    status: dict[str, Any] = {"conditions": conditions}
    if not unschedulable:
        status["containerStatuses"] = [container]
    return {"metadata": meta, "status": status}


def make_hpa(
    current: int, desired: int, depth: str | None = "1500m", *, conditions: list[dict] | None = None
) -> dict:
    status: dict[str, Any] = {
        "currentReplicas": current,
        "desiredReplicas": desired,
        "lastScaleTime": iso(T0),
    }
    if depth is not None:
        status["currentMetrics"] = [
            {
                "type": "Pods",
                "pods": {
                    "metric": {"name": "kubellm:num_requests_waiting"},
                    "current": {"averageValue": depth},
                },
            }
        ]
    status["conditions"] = (
        conditions
        if conditions is not None
        else [
            {"type": "AbleToScale", "status": "True", "reason": "ReadyForNewScale"},
            {"type": "ScalingActive", "status": "True", "reason": "ValidMetricFound"},
            {"type": "ScalingLimited", "status": "False", "reason": "DesiredWithinRange"},
        ]
    )
    return {"metadata": {"name": "llama", "namespace": "ml"}, "status": status}


def cond(status: LLMDeploymentStatus, type_: str) -> tuple[str, str]:
    c = status.get_condition(type_)
    assert c is not None, f"no {type_} condition"
    return c.status.value, c.reason


def steady(ld: LLMDeployment | None = None, **kwargs: Any) -> LLMDeploymentStatus:
    """The status after a completed rollout of generation 1 with 2 ready pods."""
    ld = ld or make_ld(replicas=2)
    status, _ = observe(ld, make_deployment(2), None, [make_pod("a"), make_pod("b")], None, now=T0, **kwargs)
    status, _ = observe(ld, make_deployment(2), None, [make_pod("a"), make_pod("b")], status, now=T0)
    return status


def status_schema_errors(status: LLMDeploymentStatus) -> list[str]:
    def convert(node: Any) -> Any:
        if isinstance(node, list):
            return [convert(n) for n in node]
        if not isinstance(node, dict):
            return node
        out = {k: convert(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
        for key, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if out.get(key) is True:
                out[key] = out.pop(bound)
        return out

    schema = convert(crd.crd_schema()["properties"]["status"])
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    return [e.message for e in validator.iter_errors(status.to_k8s())]


# --------------------------------------------------------------------------------------------------


def test_healthy_deployment_is_ready_with_all_fields():
    status = steady()
    assert cond(status, "Ready") == ("True", "Available")
    assert cond(status, "Progressing") == ("False", "Complete")
    assert cond(status, "Degraded") == ("False", "Healthy")
    assert cond(status, "ModelLoaded") == ("True", "Loaded")
    assert cond(status, "ScalingActive") == ("False", "AutoscalingDisabled")
    assert cond(status, "Draining") == ("False", "NoTerminatingPods")
    assert cond(status, "Reconciling") == ("False", "Reconciled")
    assert cond(status, "Stalled") == ("False", "NotStalled")
    assert [c.type for c in status.conditions] == [
        "Ready", "Progressing", "Degraded", "ModelLoaded", "ScalingActive", "Draining", "Reconciling", "Stalled",
    ]  # fmt: skip
    assert (status.replicas, status.ready_replicas, status.updated_replicas) == (2, 2, 2)
    assert status.ready_text == "2/2"
    assert status.selector == "kubellm.io/llmdeployment=llama"
    assert status.endpoint == "http://llama.ml.svc:80/v1"
    assert status.observed_generation == 1
    assert status.autoscaling is None
    assert all(c.observed_generation == 1 for c in status.conditions)
    assert status_schema_errors(status) == []


def test_selector_comes_from_the_deployment_and_endpoint_from_the_service():
    ld = make_ld(service={"port": 8080})
    deployment = make_deployment(1)
    deployment["spec"]["selector"]["matchLabels"] = {"b": "2", "a": "1"}
    status, _ = observe(ld, deployment, None, [], None, now=T0, service_name="llama-svc")
    assert status.selector == "a=1,b=2"
    assert status.endpoint == "http://llama-svc.ml.svc:8080/v1"


def test_last_transition_time_only_moves_when_the_status_changes():
    ld = make_ld(replicas=2)
    pods = [make_pod("a"), make_pod("b")]
    first, _ = observe(ld, make_deployment(2), None, pods, None, now=at(0))  # starts the rollout
    first, _ = observe(ld, make_deployment(2), None, pods, first, now=at(0))  # completes it
    second, events = observe(ld, make_deployment(2), None, pods, first, now=at(60))
    assert second == first  # identical observation, identical status (timestamps included)
    assert events == []
    assert {c.last_transition_time for c in second.conditions} == {at(0)}

    # Readiness drops: only Ready transitions (message changes elsewhere keep their timestamps).
    third, _ = observe(ld, make_deployment(2, ready=0, available=0), None, pods, second, now=at(120))
    assert cond(third, "Ready") == ("False", "NoReadyReplicas")
    times = {c.type: c.last_transition_time for c in third.conditions}
    assert times["Ready"] == at(120)
    assert times["Degraded"] == times["ModelLoaded"] == times["Draining"] == at(0)
    assert times["Progressing"] == at(120)  # Complete -> Scaling (pods unavailable)
    assert cond(third, "Progressing") == ("True", "Scaling")


def test_previous_status_may_be_a_dict_and_is_not_mutated():
    previous = steady().to_k8s()
    snapshot = {**previous}
    status, _ = observe(
        make_ld(replicas=2), make_deployment(2, ready=1), None, [make_pod()], previous, now=at(5)
    )
    assert previous == snapshot
    assert status.ready_text == "1/2"


@pytest.mark.parametrize(
    "reason", ["ImagePullBackOff", "ErrImagePull", "CrashLoopBackOff", "CreateContainerConfigError"]
)
def test_waiting_containers_make_it_degraded_with_the_container_reason(reason):
    ld = make_ld(replicas=1)
    previous = steady(make_ld(replicas=1))
    bad = make_pod("llama-7f9-xk2", waiting=(reason, "details from the kubelet"))
    status, events = observe(ld, make_deployment(1, ready=0, available=0), None, [bad], previous, now=at(30))
    c = status.get_condition("Degraded")
    assert (c.status.value, c.reason) == ("True", reason)
    assert "llama-7f9-xk2" in c.message and "runtime" in c.message and reason in c.message
    assert "details from the kubelet" in c.message
    assert cond(status, "ModelLoaded") == ("False", reason)
    assert cond(status, "Ready") == ("False", "NoReadyReplicas")
    assert reason in status.get_condition("Ready").message
    assert Event("Warning", reason, c.message) in events
    # The same problem seen again posts nothing new.
    _, again = observe(ld, make_deployment(1, ready=0, available=0), None, [bad], status, now=at(60))
    assert again == []


def test_oom_killed_recently_is_degraded_but_old_history_is_not():
    ld = make_ld(replicas=1)
    oom = make_pod("llama-oom", ready=False, last_terminated=("OOMKilled", at(-30)))
    status, events = observe(ld, make_deployment(1, ready=0, available=0), None, [oom], None, now=T0)
    assert cond(status, "Degraded") == ("True", "OOMKilled")
    assert "llama-oom" in status.get_condition("Degraded").message
    assert any(e.type == "Warning" and e.reason == "OOMKilled" for e in events)

    healed = make_pod("llama-oom", ready=True, last_terminated=("OOMKilled", at(-3600)))
    status, _ = observe(ld, make_deployment(1), None, [healed], status, now=T0)
    assert cond(status, "Degraded") == ("False", "Healthy")


def test_readiness_failing_for_long_is_degraded():
    ld = make_ld(replicas=1)
    short = make_pod("p", ready=False, not_ready_since=at(-30))
    status, _ = observe(ld, make_deployment(1, ready=0, available=0), None, [short], None, now=T0)
    assert cond(status, "Degraded") == ("False", "Healthy")
    assert cond(status, "ModelLoaded") == ("True", "Loaded")  # it started: the model is in memory

    long = make_pod("p", ready=False, not_ready_since=at(-600))
    status, _ = observe(ld, make_deployment(1, ready=0, available=0), None, [long], status, now=T0)
    assert cond(status, "Degraded") == ("True", "ReadinessProbeFailing")
    assert "pod p: container runtime" in status.get_condition("Degraded").message


def test_unschedulable_pod_is_degraded():
    ld = make_ld(replicas=1)
    pod = make_pod("p", unschedulable="0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")
    status, _ = observe(ld, make_deployment(1, ready=0, available=0), None, [pod], None, now=T0)
    assert cond(status, "Degraded") == ("True", "Unschedulable")
    assert "Insufficient nvidia.com/gpu" in status.get_condition("Degraded").message


def test_the_most_severe_problem_names_degraded_and_all_are_listed():
    ld = make_ld(replicas=2)
    pods = [make_pod("a", waiting=("CrashLoopBackOff", "")), make_pod("b", waiting=("ImagePullBackOff", ""))]
    status, _ = observe(ld, make_deployment(2, ready=0, available=0), None, pods, None, now=T0)
    c = status.get_condition("Degraded")
    assert c.reason == "ImagePullBackOff"
    assert "pod a" in c.message and "pod b" in c.message


def test_model_loaded_waits_for_a_started_container():
    ld = make_ld(replicas=1)
    loading = make_pod("p", started=False, ready=False)
    status, events = observe(ld, make_deployment(1, ready=0, available=0), None, [loading], None, now=T0)
    assert cond(status, "ModelLoaded") == ("False", "ModelLoading")
    assert not any(e.reason == "ModelLoaded" for e in events)
    status, events = observe(ld, make_deployment(1), None, [make_pod("p")], status, now=at(10))
    assert cond(status, "ModelLoaded") == ("True", "Loaded")
    assert Event("Normal", "ModelLoaded", "hf://org/llama is loaded and serving") in events
    status, _ = observe(ld, make_deployment(1), None, [], None, now=T0)
    assert cond(status, "ModelLoaded") == ("False", "ModelLoading")


def test_terminating_pods_mean_draining():
    ld = make_ld(replicas=1, rollout={"drainTimeoutSeconds": 60})
    pods = [make_pod("new"), make_pod("old", terminating=True)]
    status, _ = observe(ld, make_deployment(1), None, pods, None, now=T0)
    c = status.get_condition("Draining")
    assert (c.status.value, c.reason) == ("True", "PodsTerminating")
    assert "old" in c.message and "60s" in c.message
    assert cond(status, "ModelLoaded") == ("True", "Loaded")


def test_rollout_started_and_complete_events():
    previous = steady(make_ld(1, replicas=2))
    ld2 = make_ld(2, replicas=2, dtype="float16")
    # A new generation: the rollout starts, even though the Deployment's status has not caught up yet.
    status, events = observe(
        ld2, make_deployment(2), None, [make_pod("a"), make_pod("b")], previous, now=at(10)
    )
    assert [e.reason for e in events] == ["RolloutStarted"]
    assert "generation 2" in events[0].message
    assert cond(status, "Progressing") == ("True", "Rolling")
    assert cond(status, "Ready") == ("True", "Rolling")  # maxUnavailable 0: full capacity throughout
    assert status.observed_generation == 2

    # Mid-rollout: one surge pod up, both old pods still there.
    mid = make_deployment(2, replicas=3, updated=1, available=2, ready=2)
    status, events = observe(
        ld2, mid, None, [make_pod("a"), make_pod("b"), make_pod("c")], status, now=at(20)
    )
    assert events == []
    assert cond(status, "Progressing") == ("True", "Rolling")
    assert "2 old pods left" in status.get_condition("Progressing").message

    # Capacity below desired during the rollout: not Ready.
    low = make_deployment(2, replicas=2, updated=1, available=1, ready=1)
    status, _ = observe(ld2, low, None, [make_pod("a"), make_pod("c")], status, now=at(25))
    assert cond(status, "Ready") == ("False", "Rolling")

    # Done.
    status, events = observe(
        ld2, make_deployment(2), None, [make_pod("c"), make_pod("d")], status, now=at(30)
    )
    assert [e.reason for e in events] == ["RolloutComplete"]
    assert cond(status, "Progressing") == ("False", "Complete")
    assert cond(status, "Ready") == ("True", "Available")


def test_a_deployment_controller_that_has_not_caught_up_is_not_complete():
    previous = steady(make_ld(1, replicas=1))
    ld2 = make_ld(2, replicas=1, dtype="float16")
    stale = make_deployment(1, generation=5, observed=4)
    status, _ = observe(ld2, stale, None, [make_pod()], previous, now=at(5))
    status, events = observe(ld2, stale, None, [make_pod()], status, now=at(10))
    assert cond(status, "Progressing") == ("True", "Rolling") and events == []
    status, events = observe(
        ld2, make_deployment(1, generation=5, observed=5), None, [make_pod()], status, now=at(15)
    )
    assert [e.reason for e in events] == ["RolloutComplete"]


def test_a_replicas_only_change_is_a_scale_not_a_rollout():
    previous = steady(make_ld(1, replicas=1))
    ld2 = make_ld(2, replicas=2)
    scaling = make_deployment(2, replicas=2, updated=2, available=1, ready=1)
    status, events = observe(ld2, scaling, None, [make_pod("a"), make_pod("b", started=False, ready=False)],
                             previous, now=at(5), template_changed=False)  # fmt: skip
    assert events == []
    assert cond(status, "Progressing") == ("True", "Scaling")
    assert cond(status, "Ready") == ("True", "Available")
    assert status.ready_text == "1/2"


def test_first_observation_without_a_deployment():
    status, events = observe(make_ld(1), None, None, [], None, now=T0)
    assert cond(status, "Ready") == ("False", "NoReadyReplicas")
    assert cond(status, "Progressing") == ("True", "Creating")
    assert [e.reason for e in events] == ["RolloutStarted"]
    assert (status.replicas, status.ready_text) == (0, "0/1")
    status, events = observe(make_ld(1), make_deployment(1), None, [make_pod()], status, now=at(30))
    assert "RolloutComplete" in [e.reason for e in events]
    assert cond(status, "Ready") == ("True", "Available")


def test_scaled_to_zero_is_ready_with_no_model_loaded():
    """Zero pods is the state asked for: Ready says so (kstatus and `kubectl wait` read a False Ready as "not
    there yet"), ModelLoaded says nothing serves."""
    ld = make_ld(1, replicas=0)
    status, _ = observe(ld, make_deployment(0), None, [], None, now=T0)
    status, _ = observe(ld, make_deployment(0), None, [], status, now=T0)
    assert cond(status, "Ready") == ("True", "ScaledToZero")
    assert cond(status, "Reconciling") == ("False", "Reconciled")
    assert cond(status, "ModelLoaded") == ("False", "ScaledToZero")


def test_progress_deadline_exceeded():
    ld = make_ld(1, replicas=1)
    dep = make_deployment(
        1, ready=0, available=0,
        conditions=[{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                     "message": 'ReplicaSet "llama-1" has timed out progressing.'}],
    )  # fmt: skip
    status, _ = observe(ld, dep, None, [make_pod(started=False, ready=False)], None, now=T0)
    assert cond(status, "Progressing") == ("False", "ProgressDeadlineExceeded")
    assert cond(status, "Degraded") == ("True", "ProgressDeadlineExceeded")
    assert cond(status, "ModelLoaded") == ("False", "ModelLoading")


AUTOSCALED = {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 8, "targetQueueDepth": 4}}


def test_hpa_status_change_gives_scaled_up_event_and_autoscaling_status():
    ld = make_ld(1, replicas=1, **AUTOSCALED)
    status, _ = observe(ld, make_deployment(1), make_hpa(1, 1, "0"), [make_pod()], None, now=T0)
    assert status.autoscaling.desired_replicas == 1
    assert cond(status, "ScalingActive") == ("True", "ValidMetricFound")

    status, events = observe(
        ld, make_deployment(1), make_hpa(1, 3, "1500m"), [make_pod()], status, now=at(15)
    )
    assert Event("Normal", "ScaledUp", "from 1 to 3, queue depth 1.5 (target 4)") in events
    auto = status.autoscaling
    assert (auto.current_replicas, auto.desired_replicas, auto.target_queue_depth) == (1, 3, 4)
    assert auto.current_queue_depth == pytest.approx(1.5)
    assert auto.last_scale_time == T0
    assert auto.blocked_reason is None
    assert status_schema_errors(status) == []

    # The pods arrive: current catches up with desired, no second event.
    status, events = observe(ld, make_deployment(3), make_hpa(3, 3, "1"), [make_pod()], status, now=at(30))
    assert not any(e.reason.startswith("Scaled") for e in events)

    status, events = observe(ld, make_deployment(3), make_hpa(3, 2, "250m"), [make_pod()], status, now=at(45))
    assert Event("Normal", "ScaledDown", "from 3 to 2, queue depth 0.25 (target 4)") in events


def test_hpa_that_cannot_get_metrics_blocks_scaling():
    ld = make_ld(1, replicas=1, **AUTOSCALED)
    blocked = make_hpa(
        1, 1, None,
        conditions=[
            {"type": "AbleToScale", "status": "True", "reason": "SucceededGetScale"},
            {"type": "ScalingActive", "status": "False", "reason": "FailedGetPodsMetric",
             "message": "unable to get metric kubellm:num_requests_waiting: no custom metrics API"},
        ],
    )  # fmt: skip
    status, events = observe(ld, make_deployment(1), blocked, [make_pod()], None, now=T0)
    assert cond(status, "ScalingActive") == ("False", "FailedGetPodsMetric")
    assert "no custom metrics API" in status.autoscaling.blocked_reason
    assert status.autoscaling.current_queue_depth is None
    assert any(e.type == "Warning" and e.reason == "AutoscalingBlocked" for e in events)
    _, again = observe(ld, make_deployment(1), blocked, [make_pod()], status, now=at(15))
    assert not any(e.reason == "AutoscalingBlocked" for e in again)


def test_hpa_limited_missing_and_keda_at_zero():
    ld = make_ld(1, replicas=1, **AUTOSCALED)
    limited = make_hpa(8, 8, "9", conditions=[
        {"type": "AbleToScale", "status": "True", "reason": "ReadyForNewScale"},
        {"type": "ScalingActive", "status": "True", "reason": "ValidMetricFound"},
        {"type": "ScalingLimited", "status": "True", "reason": "TooManyReplicas",
         "message": "the desired replica count is more than the maximum replica count"},
    ])  # fmt: skip
    status, _ = observe(ld, make_deployment(8), limited, [], None, now=T0)
    assert cond(status, "ScalingActive") == ("True", "ScalingLimited")

    status, _ = observe(ld, make_deployment(1), None, [], None, now=T0)
    assert cond(status, "ScalingActive") == ("False", "AutoscalerMissing")
    assert status.autoscaling.target_queue_depth == 4

    keda = make_ld(1, replicas=0, autoscaling={"enabled": True, "minReplicas": 0, "backend": "keda"})
    at_zero = make_hpa(0, 0, None, conditions=[
        {"type": "ScalingActive", "status": "False", "reason": "ScalingDisabled",
         "message": "scaling is disabled since the replica count of the target is zero"},
    ])  # fmt: skip
    status, _ = observe(keda, make_deployment(0), at_zero, [], None, now=T0)
    assert cond(status, "ScalingActive") == ("True", "ScaledToZero")
    assert status.autoscaling.blocked_reason is None


def test_autoscaling_status_disappears_when_autoscaling_is_turned_off():
    ld = make_ld(1, replicas=1, **AUTOSCALED)
    status, _ = observe(ld, make_deployment(1), make_hpa(1, 1), [make_pod()], None, now=T0)
    assert status.autoscaling is not None
    status, _ = observe(make_ld(2, replicas=1), make_deployment(1), None, [make_pod()], status, now=at(5))
    assert status.autoscaling is None
    assert cond(status, "ScalingActive") == ("False", "AutoscalingDisabled")


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1500m", 1.5), ("2", 2.0), (3, 3.0), ("250m", 0.25), ("1k", 1000.0), (None, None)],
)
def test_quantities(value, expected):
    assert quantity_to_float(value) == expected


def test_queue_depth_from_keda_external_metric():
    hpa = {
        "status": {
            "currentMetrics": [{"type": "External", "external": {"current": {"averageValue": "2500m"}}}]
        }
    }
    assert current_queue_depth(hpa) == 2.5
    assert current_queue_depth(None) is None


def test_invalid_spec_status():
    previous = steady()
    body = {
        "apiVersion": "kubellm.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "llama", "namespace": "ml", "generation": 4},
        "spec": {"model": {}},
    }
    status, events = invalid_spec_status(body, "spec.model.uri: Field required", previous, now=at(100))
    assert cond(status, "Ready") == ("False", "InvalidSpec")
    assert status.get_condition("Ready").message == "spec.model.uri: Field required"
    assert status.get_condition("Ready").last_transition_time == at(100)
    assert cond(status, "Progressing") == ("False", "InvalidSpec")
    assert cond(status, "Degraded") == ("True", "InvalidSpec")
    assert cond(status, "ModelLoaded") == ("True", "Loaded")  # the old pods are untouched
    assert status.observed_generation == 4
    assert (status.replicas, status.ready_text) == (2, "2/2")
    assert events == [Event("Warning", "InvalidSpec", "spec.model.uri: Field required")]
    # Reported once per generation and message.
    again, events = invalid_spec_status(body, "spec.model.uri: Field required", status, now=at(200))
    assert events == [] and again == status
    # From nothing, with a parsed object.
    status, events = invalid_spec_status(make_ld(1), "bad", None, now=T0)
    assert cond(status, "Ready") == ("False", "InvalidSpec") and len(events) == 1


def test_reconcile_error_is_reported_once_records_its_generation_and_announces_the_rollout_after():
    previous = steady()
    ld2 = make_ld(2, replicas=2, dtype="float16")
    pods = [make_pod("a"), make_pod("b")]
    status, events = observe(ld2, make_deployment(2), None, pods, previous, now=at(5), reconcile_error="boom")
    assert cond(status, "Ready") == ("False", "ReconcileFailed")
    assert cond(status, "Degraded") == ("True", "ReconcileFailed")
    assert [e.reason for e in events] == ["ReconcileFailed"]
    assert status.observed_generation == 2  # observed, not applied: the conditions say so
    assert cond(status, "Reconciling") == ("True", "ReconcileFailed")  # retried with backoff, not stalled
    assert cond(status, "Stalled") == ("False", "NotStalled")
    status, events = observe(ld2, make_deployment(2), None, pods, status, now=at(10), reconcile_error="boom")
    assert events == []
    # Fixed: the rollout of generation 2 is announced now.
    status, events = observe(ld2, make_deployment(2), None, pods, status, now=at(15))
    assert [e.reason for e in events] == ["RolloutStarted"]
    assert status.observed_generation == 2
