"""The reconcile handler without a server: what it checks, renders and applies for one LLMDeployment.

:mod:`kubellm.operator.control.handlers` against the kmock API emulator is tests/operator/test_operator_kmock.py;
here its API calls are stand-ins, so the test can count what the handler does itself.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import kopf
import pytest
from test_render import count_spec_checks, make, manifest

from kubellm.operator import render
from kubellm.operator.control import handlers
from kubellm.operator.control.tracking import OperatorState
from kubellm.operator.render import deployment as deployment_mod
from kubellm.operator.render.naming import SPEC_HASH_ANNOTATION

SPEC = {"model": {"uri": "hf://a/b"}, "resources": {"gpu": {"count": 1}, "cpu": "4", "memory": "24Gi"},
        "rollout": {"onNoSpareGPU": "ReplaceInPlace"}}  # fmt: skip


@pytest.mark.asyncio
async def test_a_reconcile_checks_the_spec_once_and_renders_once(monkeypatch):
    """A rollout the guard switched to replacing in place is carried through the reconcile (the strategy read
    from the Deployment), with one validation of the spec and one render, whose children are the ones applied."""
    body = manifest(SPEC)
    body["metadata"]["generation"] = 2
    template_hash = render.render_workload(make(SPEC))["spec"]["template"]["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
    carried = {"metadata": {"annotations": {deployment_mod.IN_PLACE_ANNOTATION: template_hash}}}
    applied: list[list[dict[str, Any]]] = []
    renders: list[str | None] = []

    async def read_deployment(kube, ld):
        return carried

    async def apply_children(kube, ld, children, note_template):
        applied.append(children)

    def render_validated(ld, **kwargs):
        renders.append(kwargs["replace_in_place"])
        return real_render_validated(ld, **kwargs)

    real_render_validated = handlers.render_validated
    monkeypatch.setattr(handlers, "read_deployment", read_deployment)
    monkeypatch.setattr(handlers, "apply_children", apply_children)
    monkeypatch.setattr(handlers, "render_validated", render_validated)
    memo = types.SimpleNamespace(kubellm=OperatorState(kube=None))  # type: ignore[arg-type]
    checked = count_spec_checks(monkeypatch)

    await handlers.reconcile(body=body, old=None, reason=kopf.Reason.CREATE, memo=memo, retry=0,
                             logger=logging.getLogger(__name__))  # fmt: skip

    assert len(checked) == 1
    assert renders == [template_hash]
    (children,) = applied
    (workload,) = [c for c in children if c["kind"] == "Deployment"]
    assert workload["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert memo.kubellm.track(("team-a", "llm")).reconciled.error is None
