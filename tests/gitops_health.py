"""What GitOps tools make of an LLMDeployment's status, as functions the tests call.

* :func:`kstatus`: kstatus's ``status.Compute`` for a custom resource, the health Flux (kustomize-controller's
  ``wait`` / ``healthChecks``, helm-controller), kpt and cli-utils assess. Written down from its source:
  fluxcd/cli-utils ``pkg/kstatus/status`` (``status.go`` ``Compute`` and ``checkReadyCondition``, ``generic.go``
  ``checkGenericProperties`` and ``checkGeneration``; kubernetes-sigs/cli-utils has the same generic rules) and
  the rules in its README ("Conditions", "The Ready Condition").
* :func:`argo_health`: the Argo CD health script the chart ships (charts/kubellm/files/argocd-health.lua), run by
  a real Lua interpreter (lupa) the way Argo CD runs it, with the resource as ``obj``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lupa

ROOT = Path(__file__).resolve().parents[1]
ARGOCD_LUA = ROOT / "charts" / "kubellm" / "files" / "argocd-health.lua"

# kstatus's statuses, and the Argo CD health each one corresponds to for an LLMDeployment.
CURRENT, IN_PROGRESS, FAILED, TERMINATING = "Current", "InProgress", "Failed", "Terminating"
ARGO_FOR_KSTATUS = {CURRENT: {"Healthy", "Suspended"}, IN_PROGRESS: {"Progressing"}, FAILED: {"Degraded"}}


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
