"""The Argo CD health check shipped in the chart (charts/kubellm/files/argocd-health.lua), run by a real Lua
interpreter (lupa) against statuses the operator's own status code writes for each situation."""

from __future__ import annotations

import re

from gitops_health import ARGOCD_LUA as LUA
from gitops_health import NOW, ROOT, argo_health, deployment, ld, observed, pod, resource, settled
from kubellm.operator import status as status_mod


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
