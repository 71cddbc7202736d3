"""The Argo CD health check shipped in the chart (charts/kubellm/files/argocd-health.lua), run by a real Lua
interpreter (lupa) against statuses the operator's own status code writes for each situation, against
the status shapes it must survive (named cases that once broke it, and random ones), and beside kstatus."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gitops_health as gitops
from gitops_health import ARGOCD_LUA as LUA
from gitops_health import NOW, ROOT, argo_health, deployment, kstatus, ld, observed, pod, resource, settled
from kubellm.operator.status import observe as status_mod


def test_serving_is_healthy():
    target = ld(replicas=2)
    st = settled(target, deployment(2, 2), [pod("llm-a"), pod("llm-b")])
    assert argo_health(resource(target, st)) == ("Healthy", "2/2 replicas ready")


def test_a_rollout_is_progressing_until_complete():
    before = settled(ld(replicas=2), deployment(2, 2), [pod("llm-a"), pod("llm-b")])
    target = ld(generation=2, replicas=2)
    st = observed(target, deployment(2, 2, updated=1), [pod("llm-a"), pod("llm-b"), pod("llm-c", ready=False)],
                  before, template_changed=True)
    status, message = argo_health(resource(target, st))
    assert status == "Progressing" and "updated" in message


def test_loading_pods_are_progressing():
    target = ld(replicas=1)
    st = observed(target, deployment(1, 0), [pod("llm-a", ready=False)])
    assert argo_health(resource(target, st))[0] == "Progressing"


def test_a_crash_loop_is_degraded():
    target = ld(replicas=1)
    st = observed(target, deployment(1, 0), [pod("llm-a", ready=False, waiting="CrashLoopBackOff")])
    status, message = argo_health(resource(target, st))
    assert status == "Degraded" and message.startswith("CrashLoopBackOff: ")


def test_an_invalid_spec_is_degraded():
    target = ld(generation=3)
    st, _ = status_mod.invalid_spec_status(target, "spec.model.uri: bad", None, now=NOW)
    status, message = argo_health(resource(target, st))
    assert status == "Degraded" and "spec.model.uri: bad" in message


def test_scaled_to_zero_is_suspended():
    target = ld(replicas=0)
    st = settled(target, deployment(0, 0), [])
    assert argo_health(resource(target, st))[0] == "Suspended"


def test_a_status_older_than_the_spec_is_progressing_whatever_it_says():
    st = settled(ld(replicas=1), deployment(1, 1), [pod("llm-a")])
    newer = ld(generation=2, replicas=1)
    assert argo_health(resource(newer, st)) == ("Progressing", "waiting for the operator to observe generation 2")
    assert argo_health(resource(newer, None))[0] == "Progressing"


def test_docs_show_the_script_the_chart_ships():
    docs = (ROOT / "docs" / "gitops.md").read_text()
    block = re.search(r"resource\.customizations\.health\.kubellm\.io_LLMDeployment: \|\n((?:    .*\n|\n)+)", docs)
    assert block, "docs/gitops.md lacks the argocd-cm snippet"
    shown = "\n".join(line[4:] for line in block[1].splitlines()).strip()
    assert shown == LUA.read_text().strip()


def test_the_script_needs_nothing_outside_argo_cds_sandbox():
    """Argo CD runs health scripts without os, io or require."""
    assert not re.search(r"\b(os|io|require)\b\s*[.(]", LUA.read_text())


# ---------------------------------------------------------------------------------------------------------------
# Status shapes the script must read: the named cases that broke it, then random ones.
# ---------------------------------------------------------------------------------------------------------------


def _ready() -> dict[str, Any]:
    return resource(ld(replicas=2), settled(ld(replicas=2), deployment(2, 2), [pod("llm-a"), pod("llm-b")]))


def _crash_loop() -> dict[str, Any]:
    target = ld(replicas=1)
    return resource(target, observed(target, deployment(1, 0), [pod("llm-a", waiting="CrashLoopBackOff")]))


def _bent(build: Callable[[], dict[str, Any]], bend: Callable[[dict[str, Any]], Any]) -> Callable[[], dict]:
    def make() -> dict[str, Any]:
        obj = build()
        bend(obj)
        return obj

    return make


def _conditions(obj: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [c for c in obj["status"]["conditions"] if c["type"] == kind]


def _drop(obj: dict[str, Any], *kinds: str) -> None:
    obj["status"]["conditions"] = [c for c in obj["status"]["conditions"] if c["type"] not in kinds]


def _edit(kind: str, **fields: Any) -> Callable[[dict[str, Any]], None]:
    def edit(obj: dict[str, Any]) -> None:
        for c in _conditions(obj, kind):
            for key, value in fields.items():
                if value is _DELETE:
                    c.pop(key, None)
                else:
                    c[key] = value

    return edit


_DELETE = object()

# name: (the object, kstatus's reading, Argo CD's status, a part of Argo CD's message)
NAMED: dict[str, tuple[Callable[[], dict], str, str, str]] = {
    "stalled_without_reason": (_bent(_crash_loop, _edit("Stalled", reason=_DELETE)), gitops.FAILED, "Degraded",
                               "pod llm-a: container runtime CrashLoopBackOff"),
    "stalled_with_null_reason_and_message": (_bent(_crash_loop, _edit("Stalled", reason=None, message=None)),
                                             gitops.FAILED, "Degraded", "stalled"),
    "stalled_reason_of_another_type": (_bent(_crash_loop, _edit("Stalled", reason={"x": 1}, message=[1])),
                                       gitops.FAILED, "Degraded", "stalled"),
    "ready_without_observed_generation": (_bent(_ready, lambda o: o["status"].pop("observedGeneration")),
                                          gitops.CURRENT, "Healthy", "2/2 replicas ready"),
    "ready_without_metadata_generation": (_bent(_ready, lambda o: o["metadata"].pop("generation")),
                                          gitops.CURRENT, "Healthy", "2/2 replicas ready"),
    "observed_generation_newer_than_the_spec": (_bent(_ready, lambda o: o["status"].update(observedGeneration=5)),
                                                gitops.IN_PROGRESS, "Progressing", "generation 1"),
    "older_operator_degraded_without_stalled": (_bent(_crash_loop, lambda o: _drop(o, "Stalled", "Reconciling")),
                                                gitops.IN_PROGRESS, "Progressing", "CrashLoopBackOff: pod llm-a"),
    "older_operator_progressing_while_ready": (
        _bent(_ready, lambda o: (_drop(o, "Stalled", "Reconciling"), _edit("Progressing", status="True")(o))),
        gitops.CURRENT, "Healthy", "2/2 replicas ready"),
    "reconciling_listed_before_stalled": (
        _bent(_crash_loop, lambda o: (_edit("Reconciling", status="True")(o), o["status"]["conditions"].sort(
            key=lambda c: c["type"] != "Reconciling"))), gitops.IN_PROGRESS, "Progressing", ""),
    "ready_unknown": (_bent(_ready, lambda o: (_drop(o, "Stalled", "Reconciling"), _edit("Ready", status="Unknown")(o))),
                      gitops.IN_PROGRESS, "Progressing", "2/2 replicas ready"),
    "conditions_not_a_list": (_bent(_ready, lambda o: o["status"].update(conditions="Ready")), gitops.CURRENT,
                              "Progressing", "waiting for the Ready condition"),
    "being_deleted": (_bent(_crash_loop, lambda o: o["metadata"].update(deletionTimestamp="2026-01-01T12:00:00Z")),
                      gitops.TERMINATING, "Progressing", "deleted"),
}  # fmt: skip


@pytest.mark.parametrize("case", NAMED)
def test_named_status_shapes_read_as_kstatus_reads_them(case):
    build, expected_kstatus, expected_argo, says = NAMED[case]
    obj = build()
    status, message = argo_health(obj)
    assert (status, kstatus(obj)[0]) == (expected_argo, expected_kstatus) and says in message, (status, message)
    if kstatus(obj)[1] != "Resource is current":  # kstatus's gap: nothing known reads as current
        assert status in gitops.ARGO_FOR_KSTATUS[expected_kstatus]


_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)  # Kubernetes JSON has no lone surrogates
_SCALAR = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | _TEXT
_ANY = st.recursive(_SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
                    max_leaves=8)  # fmt: skip
_TYPES = ["Ready", "Progressing", "Reconciling", "Stalled", "Degraded", "ModelLoaded", "Draining"]
_STATUSES = ["True", "False", "Unknown"]


def _objects(field: Callable[[st.SearchStrategy], st.SearchStrategy]) -> st.SearchStrategy:
    """LLMDeployments whose every status field is drawn from ``field(usual values)``."""
    condition = st.fixed_dictionaries({}, optional={
        "type": field(st.sampled_from(_TYPES)), "status": field(st.sampled_from(_STATUSES)),
        "reason": field(_TEXT), "message": field(_TEXT)})  # fmt: skip
    status = st.fixed_dictionaries({}, optional={
        "observedGeneration": field(st.integers(0, 3)), "conditions": field(st.lists(field(condition), max_size=6))})
    metadata = st.fixed_dictionaries({"name": st.just("llm")}, optional={
        "generation": field(st.integers(0, 3)), "deletionTimestamp": field(st.just("2026-01-01T12:00:00Z"))})
    return st.fixed_dictionaries({"apiVersion": st.just("kubellm.io/v1alpha1"), "kind": st.just("LLMDeployment")},
                                 optional={"metadata": field(metadata), "status": field(status)})  # fmt: skip


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_objects(lambda usual: usual | _ANY))
def test_any_status_shape_gets_a_health_and_a_message(obj):
    """Missing, null or wrongly typed fields, arbitrary conditions: never an error, always a status Argo CD
    accepts with a message (a script error or a nil message would show the application as Unknown)."""
    status, message = argo_health(obj)
    assert status in gitops.ARGO_STATUSES and isinstance(message, str)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_objects(lambda usual: usual))
def test_argo_cd_agrees_with_kstatus_on_any_well_typed_status(obj):
    status, _ = argo_health(obj)
    verdict, message = kstatus(obj)
    if verdict == gitops.CURRENT and message == "Resource is current":
        assert status == "Progressing"  # no Ready condition yet: Argo CD waits where kstatus assumes current
    else:
        assert status in gitops.ARGO_FOR_KSTATUS[verdict], (verdict, message, obj)
