"""What GitOps tools make of an LLMDeployment's status, as functions the tests call.

* :func:`kstatus`: kstatus's ``status.Compute`` for a custom resource, the health Flux (kustomize-controller's
  ``wait`` / ``healthChecks``, helm-controller), kpt and cli-utils assess. Written down from its source:
  fluxcd/cli-utils ``pkg/kstatus/status`` (``status.go`` ``Compute`` and ``checkReadyCondition``, ``generic.go``
  ``checkGenericProperties`` and ``checkGeneration``; kubernetes-sigs/cli-utils has the same generic rules) and
  the rules in its README ("Conditions", "The Ready Condition").
* :func:`argo_health`: the Argo CD health script the chart ships (charts/kubellm/files/argocd-health.lua), run by
  a real Lua interpreter (lupa) the way Argo CD runs it, with the resource as ``obj``.

And the status fixtures both test files feed them (:func:`observed`, :func:`settled`, :func:`resource`): statuses
the operator's own status code writes for an LLMDeployment, its Deployment and its pods.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import lupa.lua51 as lupa  # Argo CD runs health scripts with gopher-lua, a Lua 5.1

from kubellm.operator.api import LLMDeployment, LLMDeploymentStatus
from kubellm.operator.status import observe as status_mod

ROOT = Path(__file__).resolve().parents[1]
ARGOCD_LUA = ROOT / "charts" / "kubellm" / "files" / "argocd-health.lua"

# kstatus's statuses, and the Argo CD health each one corresponds to for an LLMDeployment.
CURRENT, IN_PROGRESS, FAILED, TERMINATING = "Current", "InProgress", "Failed", "Terminating"
ARGO_FOR_KSTATUS = {CURRENT: {"Healthy", "Suspended"}, IN_PROGRESS: {"Progressing"}, FAILED: {"Degraded"},
                    TERMINATING: {"Progressing"}}  # fmt: skip
# What Argo CD accepts from a health script; anything else it shows as Unknown ("invalid health status").
ARGO_STATUSES = {"Healthy", "Progressing", "Degraded", "Suspended", "Missing"}


def kstatus(obj: dict[str, Any]) -> tuple[str, str]:
    """(status, message) as kstatus computes them for a custom resource (no type-specific rule applies)."""
    metadata, status = obj.get("metadata") or {}, obj.get("status") or {}
    # 1. generic.go: deletion first.
    if metadata.get("deletionTimestamp"):
        return TERMINATING, "Resource scheduled for deletion"
    # 2. checkGeneration: a status for an older generation (only when observedGeneration is present at all).
    generation, observed = metadata.get("generation"), status.get("observedGeneration")
    if generation is not None and observed is not None and observed != generation:
        return IN_PROGRESS, f"{obj.get('kind')} generation is {generation}, but latest observed generation is {observed}"
    conditions = [c for c in status.get("conditions") or [] if isinstance(c, dict)]
    # 3. The abnormal-true pair, in list order: the first True one of Reconciling / Stalled decides.
    for c in conditions:
        if c.get("type") == "Reconciling" and c.get("status") == "True":
            return IN_PROGRESS, c.get("message", "")
        if c.get("type") == "Stalled" and c.get("status") == "True":
            return FAILED, c.get("message", "")
    # 4. checkReadyCondition: True is Current, False or Unknown is InProgress.
    for c in conditions:
        if c.get("type") == "Ready":
            if c.get("status") == "True":
                return CURRENT, "Resource is Ready"
            if c.get("status") in ("False", "Unknown"):
                return IN_PROGRESS, c.get("message", "")
    # 5. Nothing known: assumed current (also a resource the controller has not written a status to yet).
    return CURRENT, "Resource is current"


def argo_health(obj: dict[str, Any]) -> tuple[str, str]:
    """(status, message) as Argo CD computes them: the script's chunk run with the resource as ``obj``."""
    lua = lupa.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute(ARGOCD_LUA.read_text())
    return result["status"], result["message"]


# ---------------------------------------------------------------------------------------------------------------
# Status fixtures: an LLMDeployment, its Deployment and pods, and the status the operator's status code writes.
# ---------------------------------------------------------------------------------------------------------------

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def ld(generation: int = 1, **spec: Any) -> LLMDeployment:
    return LLMDeployment.model_validate({
        "metadata": {"name": "llm", "namespace": "ml", "uid": "u", "generation": generation},
        "spec": {"model": {"uri": "hf://org/llm"}, **spec},
    })  # fmt: skip


def deployment(desired: int, ready: int, *, updated: int | None = None, replicas: int | None = None,
               conditions: list[dict] | None = None) -> dict[str, Any]:  # fmt: skip
    updated = desired if updated is None else updated
    status = {"observedGeneration": 1, "replicas": max(desired, updated) if replicas is None else replicas,
              "readyReplicas": ready, "updatedReplicas": updated, "availableReplicas": ready}  # fmt: skip
    if conditions:
        status["conditions"] = conditions
    return {"metadata": {"name": "llm", "namespace": "ml", "generation": 1}, "spec": {"replicas": desired},
            "status": status}  # fmt: skip


def pod(name: str, *, ready: bool = True, started: bool | None = None, waiting: str | None = None,
        unschedulable: str | None = None) -> dict[str, Any]:  # fmt: skip
    container: dict[str, Any] = {"name": "runtime", "ready": ready, "restartCount": 0, "state": {"running": {}},
                                 "started": ready if started is None else started}  # fmt: skip
    if waiting:
        container.update(ready=False, started=False, state={"waiting": {"reason": waiting, "message": "back-off"}})
    status: dict[str, Any] = {"conditions": [], "containerStatuses": [container]}
    if unschedulable:
        status = {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                  "message": unschedulable}]}  # fmt: skip
    return {"metadata": {"name": name, "namespace": "ml", "labels": {"kubellm.io/llmdeployment": "llm"}},
            "status": status}  # fmt: skip


def observed(target: LLMDeployment, dep, pods, previous=None, *, after: float = 0, **kw) -> LLMDeploymentStatus:
    return status_mod.observe(target, dep, None, pods, previous, now=NOW + timedelta(seconds=after), **kw)[0]


def settled(target: LLMDeployment, dep, pods) -> LLMDeploymentStatus:
    """The status once the operator has seen this generation's rollout through (a second observation)."""
    return observed(target, dep, pods, observed(target, dep, pods), after=15)


def resource(target: LLMDeployment, status: LLMDeploymentStatus | None) -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": "kubellm.io/v1alpha1", "kind": "LLMDeployment",
                           "metadata": dict(target.metadata), "spec": {}}  # fmt: skip
    if status is not None:
        obj["status"] = status.to_k8s()
    return obj
