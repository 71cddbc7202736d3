"""What the gateways say about the InferencePool, as the LLMDeployment's status and Events (operator/status/gateway.py)."""

from __future__ import annotations

from typing import Any

from kubellm.operator import api
from kubellm.operator.status import gateway


def pool(*parents: dict[str, Any], namespace: str = "ml") -> dict[str, Any]:
    out: dict[str, Any] = {"metadata": {"name": "qwen", "namespace": namespace}, "spec": {}}
    if parents:
        out["status"] = {"parents": list(parents)}
    return out


def parent(name: str, *conditions: tuple[str, str, str], namespace: str | None = None) -> dict[str, Any]:
    ref = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": name}
    if namespace:
        ref["namespace"] = namespace
    return {"parentRef": ref, "controllerName": "example.com/gateway",
            "conditions": [{"type": t, "status": s, "reason": r, "message": f"{r} says so",
                            "lastTransitionTime": "2026-01-01T00:00:00Z"} for t, s, r in conditions]}  # fmt: skip


ACCEPTED = ("Accepted", "True", "Accepted")
RESOLVED = ("ResolvedRefs", "True", "ResolvedRefs")
NO_EPP = ("Accepted", "False", "EndpointPickerRefMissing")
BAD_EPP = ("ResolvedRefs", "False", "InvalidExtensionRef")


def test_parents_are_copied_with_the_first_failed_condition():
    status = gateway.pool_status(pool(
        parent("public", ACCEPTED, RESOLVED),
        parent("internal", ACCEPTED, BAD_EPP, namespace="infra"),
        parent("edge", NO_EPP, ("ResolvedRefs", "Unknown", "Pending")),
        parent("new"),
    ))  # fmt: skip
    assert status.name == "qwen"
    assert [p.to_k8s() for p in status.parents] == [
        {"parent": "Gateway ml/public", "accepted": True, "resolvedRefs": True},
        {"parent": "Gateway infra/internal", "accepted": True, "resolvedRefs": False, "reason": "InvalidExtensionRef",
         "message": "InvalidExtensionRef says so"},
        {"parent": "Gateway ml/edge", "accepted": False, "reason": "EndpointPickerRefMissing",
         "message": "EndpointPickerRefMissing says so"},
        {"parent": "Gateway ml/new"},
    ]  # fmt: skip


def test_no_pool_or_no_parents():
    assert gateway.pool_status(None) is None
    assert gateway.pool_status(pool()).to_k8s() == {"name": "qwen"}
    assert gateway.pool_events(None, None) == []


def test_a_refusal_is_a_warning_once_and_a_recovery_a_normal_event():
    refused = gateway.pool_status(pool(parent("public", NO_EPP)))
    (warning,) = gateway.pool_events(None, refused)
    assert warning.type == "Warning" and warning.reason == "InferencePoolNotAccepted"
    assert warning.message == ("Gateway ml/public does not route to InferencePool qwen: Accepted=False "
                               "EndpointPickerRefMissing: EndpointPickerRefMissing says so")  # fmt: skip
    assert gateway.pool_events(refused, refused) == []  # the observer runs every few seconds: no repeats
    other = gateway.pool_status(pool(parent("public", ACCEPTED, BAD_EPP)))
    (again,) = gateway.pool_events(refused, other)  # refused for a new reason: said again
    assert again.reason == "InferencePoolNotAccepted" and "ResolvedRefs=False InvalidExtensionRef" in again.message
    fixed = gateway.pool_status(pool(parent("public", ACCEPTED, RESOLVED)))
    assert gateway.pool_events(other, fixed) == [
        ("Normal", "InferencePoolAccepted", "Gateway ml/public routes to InferencePool qwen")
    ]
    assert gateway.pool_events(fixed, fixed) == []


def test_a_gateway_that_takes_the_pool_from_the_start_is_announced_once():
    taken = gateway.pool_status(pool(parent("public", ACCEPTED)))
    assert [e.reason for e in gateway.pool_events(None, taken)] == ["InferencePoolAccepted"]
    assert [e.reason for e in gateway.pool_events(api.InferencePoolStatus(name="qwen"), taken)] == [
        "InferencePoolAccepted"
    ]
    assert gateway.pool_events(taken, taken) == []
    pending = gateway.pool_status(pool(parent("public")))
    assert gateway.pool_events(None, pending) == []  # Unknown: nothing to say yet
