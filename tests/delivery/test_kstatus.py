"""kstatus (Flux, kpt) and Argo CD read the statuses the operator's own status code writes the same way.

Each fixture is a status produced by :mod:`kubellm.operator.status` for one situation (never written by hand);
:func:`gitops_health.kstatus` is kstatus's ``Compute`` written down from its source, and
:func:`gitops_health.argo_health` runs the chart's Lua health script.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gitops_health import (
    ARGO_FOR_KSTATUS,
    CURRENT,
    FAILED,
    IN_PROGRESS,
    NOW,
    TERMINATING,
    argo_health,
    deployment,
    kstatus,
    ld,
    observed,
    pod,
    resource,
    settled,
)
from kubellm.operator.status import observe as status_mod

SERVING = [pod("llm-a"), pod("llm-b")]
DEADLINE = {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
            "message": 'ReplicaSet "llm-7f9" has timed out progressing.'}  # fmt: skip


def fresh():
    """The first status: no Deployment yet."""
    return resource(ld(), observed(ld(), None, []))


def loading():
    return resource(ld(), observed(ld(), deployment(1, 0), [pod("llm-a", ready=False, started=False)]))


def rolling():
    before = settled(ld(replicas=2), deployment(2, 2), SERVING)
    target = ld(generation=2, replicas=2, dtype="float16")
    pods = [*SERVING, pod("llm-c", ready=False, started=False)]
    return resource(target, observed(target, deployment(2, 2, updated=1, replicas=3), pods, before,
                                     after=30, template_changed=True))  # fmt: skip


def ready():
    return resource(ld(replicas=2), settled(ld(replicas=2), deployment(2, 2), SERVING))


def scaled_to_zero():
    return resource(ld(replicas=0), settled(ld(replicas=0), deployment(0, 0), []))


def invalid_spec():
    before = settled(ld(replicas=2), deployment(2, 2), SERVING)
    target = ld(generation=2, replicas=2)
    return resource(target, status_mod.invalid_spec_status(target, "spec.model.uri: bad", before, now=NOW)[0])


def crash_loop():
    target = ld(replicas=1)
    return resource(target, observed(target, deployment(1, 0), [pod("llm-a", waiting="CrashLoopBackOff")]))


def progress_deadline():
    target = ld(replicas=1)
    dep = deployment(1, 0, conditions=[DEADLINE])
    return resource(target, observed(target, dep, [pod("llm-a", ready=False, started=False)]))


def reconcile_failed():
    before = settled(ld(replicas=2), deployment(2, 2), SERVING)
    target = ld(generation=2, replicas=2, dtype="float16")
    return resource(target, observed(target, deployment(2, 2), SERVING, before, reconcile_error="422: refused"))


def unschedulable_for_now():
    """A pod waiting for a node (a cluster autoscaler may add one): still in progress, not failed."""
    target = ld(replicas=1)
    pods = [pod("llm-a", unschedulable="0/3 nodes are available: 3 Insufficient memory.")]
    return resource(target, observed(target, deployment(1, 0), pods))


def status_older_than_the_spec():
    obj = ready()
    obj["metadata"]["generation"] = 2
    return obj


SITUATIONS: dict[str, tuple[Callable[[], dict], str]] = {
    "fresh": (fresh, IN_PROGRESS),
    "loading": (loading, IN_PROGRESS),
    "rolling": (rolling, IN_PROGRESS),
    "ready": (ready, CURRENT),
    "scaled_to_zero": (scaled_to_zero, CURRENT),
    "invalid_spec": (invalid_spec, FAILED),
    "crash_loop": (crash_loop, FAILED),
    "progress_deadline": (progress_deadline, FAILED),
    "reconcile_failed": (reconcile_failed, IN_PROGRESS),
    "unschedulable_for_now": (unschedulable_for_now, IN_PROGRESS),
    "status_older_than_the_spec": (status_older_than_the_spec, IN_PROGRESS),
}


@pytest.mark.parametrize("situation", SITUATIONS)
def test_kstatus_reads_each_situation_as_expected(situation):
    build, expected = SITUATIONS[situation]
    obj = build()
    assert kstatus(obj)[0] == expected, obj["status"]["conditions"]


@pytest.mark.parametrize("situation", SITUATIONS)
def test_argo_cd_agrees_with_kstatus(situation):
    obj = SITUATIONS[situation][0]()
    assert argo_health(obj)[0] in ARGO_FOR_KSTATUS[kstatus(obj)[0]]


@pytest.mark.parametrize("situation", SITUATIONS)
def test_every_status_write_carries_its_generation_and_at_most_one_abnormal_condition(situation):
    obj = SITUATIONS[situation][0]()
    if situation != "status_older_than_the_spec":
        assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]
    true = {c["type"] for c in obj["status"]["conditions"] if c["status"] == "True"}
    assert len(true & {"Reconciling", "Stalled"}) <= 1  # kstatus takes whichever comes first


def test_failed_says_why_and_in_progress_says_what_is_under_way():
    assert kstatus(crash_loop()) == (FAILED, "pod llm-a: container runtime CrashLoopBackOff: back-off")
    assert kstatus(invalid_spec()) == (FAILED, "spec.model.uri: bad")
    status, message = kstatus(rolling())
    assert status == IN_PROGRESS and message.startswith("1/2 pods updated")
    assert kstatus(reconcile_failed()) == (IN_PROGRESS, "retrying: 422: refused")


def test_the_kstatus_rules_in_their_order():
    """The rules as kstatus applies them, on one operator-written status bent each way."""
    obj = crash_loop()
    obj["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:00Z"
    assert kstatus(obj)[0] == TERMINATING
    obj = crash_loop()
    obj["metadata"]["generation"] = 2  # the generation check comes before the conditions
    assert kstatus(obj)[0] == IN_PROGRESS
    obj = crash_loop()
    for c in obj["status"]["conditions"]:
        if c["type"] in ("Stalled", "Reconciling"):
            c["status"] = "False"
    assert kstatus(obj)[0] == IN_PROGRESS  # then Ready=False
    del obj["status"]
    assert kstatus(obj)[0] == CURRENT  # kstatus's known gap: no status yet reads as current


def test_argo_cd_reads_a_status_from_an_operator_without_stalled_as_kstatus_does():
    """An older operator wrote Degraded, not Stalled: kstatus reads Ready=False (in progress), so Argo CD does
    too, and says what is wrong in its message."""
    obj = crash_loop()
    obj["status"]["conditions"] = [c for c in obj["status"]["conditions"] if c["type"] not in ("Stalled", "Reconciling")]
    assert kstatus(obj)[0] == IN_PROGRESS
    status, message = argo_health(obj)
    assert status == "Progressing" and message.startswith("CrashLoopBackOff: pod llm-a")
