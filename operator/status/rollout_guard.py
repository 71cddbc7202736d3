"""Rollouts that cannot deadlock on GPUs: is a rollout blocked for want of a spare GPU, and which strategy
should its Deployment have now? Pure functions over the objects the observer read; no API calls, no clock.

With ``maxSurge: 1, maxUnavailable: 0`` (the default) a rollout first starts a surge pod next to the old ones.
On a cluster whose GPUs are all taken that pod stays Pending ("0/3 nodes are available: 3 Insufficient
nvidia.com/gpu") and the rollout never ends. :func:`decide` calls a rollout *blocked* when a pod of the new
ReplicaSet (the Deployment's current template) has been Unschedulable for insufficient
``spec.resources.gpu.resourceName`` for ``rollout.surgeTimeoutSeconds`` (from its PodScheduled condition's
lastTransitionTime) while old pods still run and the rollout is not complete. An old-ReplicaSet pod that is
pending, a pod unschedulable for another reason (taints, CPU, memory) or one the scheduler has nominated a node
for (preemption under way) blocks nothing: those are reported as Unschedulable, as before.

With ``rollout.onNoSpareGPU: ReplaceInPlace`` the verdict names the pod template (its ``kubellm.io/spec-hash``)
whose rollout switches to ``maxSurge: 0`` (:func:`kubellm.operator.render.deployment.in_place_strategy`).
Render takes that as an input (``render_deployment(ld, replace_in_place=...)``) and marks the Deployment with
``IN_PLACE_ANNOTATION``, so the switch outlives an operator restart (:func:`carried_in_place`) and ends by
itself with that template: once the rollout completes, or when a new template starts a new rollout, render
writes the spec's strategy again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kubellm.operator import api
from kubellm.operator.render.deployment import IN_PLACE_ANNOTATION, in_place_strategy, spec_strategy
from kubellm.operator.render.naming import SPEC_HASH_ANNOTATION

REVISION_ANNOTATION = "deployment.kubernetes.io/revision"
TEMPLATE_HASH_LABEL = "pod-template-hash"


@dataclass(frozen=True)
class Verdict:
    """What :func:`decide` concluded about one Deployment's rollout."""

    blocked: bool = False  # a new pod has waited past surgeTimeoutSeconds for a GPU
    pod: str | None = None  # the new pod waiting longest for a GPU (also before the timeout)
    since: datetime | None = None  # when that pod became Unschedulable
    message: str = ""  # the scheduler's message, e.g. "0/3 nodes are available: 3 Insufficient nvidia.com/gpu"
    resource: str = api.DEFAULT_GPU_RESOURCE  # the GPU resource the pods ask for
    replace_in_place: str | None = None  # spec-hash of the template rolling out in place; None: the spec's strategy

    def strategy(self, rollout: api.RolloutSpec) -> dict[str, Any]:
        """The rollingUpdate the Deployment should have now."""
        return in_place_strategy(rollout) if self.replace_in_place else spec_strategy(rollout)


NOT_BLOCKED = Verdict()


def _get(obj: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def _without_hash(template: Any) -> Any:
    """A pod template without the pod-template-hash label the Deployment controller adds to its ReplicaSets."""
    if not isinstance(template, Mapping):
        return template
    labels = {k: v for k, v in (_get(template, "metadata", "labels") or {}).items() if k != TEMPLATE_HASH_LABEL}
    return {**template, "metadata": {**(template.get("metadata") or {}), "labels": labels}}


def rollout_complete(deployment: Mapping[str, Any]) -> bool:
    """Every pod runs the current template and is available, the controller having seen the latest spec (as
    ``kubectl rollout status`` decides)."""
    status = deployment.get("status") or {}
    generation, observed = _get(deployment, "metadata", "generation"), status.get("observedGeneration")
    caught_up = generation is None or (isinstance(observed, int) and observed >= generation)
    desired = _get(deployment, "spec", "replicas")
    desired = 1 if desired is None else desired
    replicas, updated = status.get("replicas") or 0, status.get("updatedReplicas") or 0
    return caught_up and updated >= desired and replicas <= updated and (status.get("availableReplicas") or 0) >= updated


def new_replicaset(
    deployment: Mapping[str, Any], replicasets: Iterable[Mapping[str, Any]]
) -> Mapping[str, Any] | None:
    """The ReplicaSet of the Deployment's current template: the one whose template equals it (pod-template-hash
    aside), as the Deployment controller finds it; else, once the controller has seen the latest spec, the one
    carrying the Deployment's revision. None before the controller created it."""
    uid = _get(deployment, "metadata", "uid")
    owned = [
        rs for rs in replicasets
        if not uid or any(ref.get("uid") == uid for ref in _get(rs, "metadata", "ownerReferences") or ())
    ]  # fmt: skip
    template = _without_hash(_get(deployment, "spec", "template"))
    for rs in owned:
        if _without_hash(_get(rs, "spec", "template")) == template:
            return rs
    generation = _get(deployment, "metadata", "generation")
    observed = _get(deployment, "status", "observedGeneration")
    revision = (_get(deployment, "metadata", "annotations") or {}).get(REVISION_ANNOTATION)
    if revision is None or (generation is not None and not (isinstance(observed, int) and observed >= generation)):
        return None
    return next(
        (rs for rs in owned if (_get(rs, "metadata", "annotations") or {}).get(REVISION_ANNOTATION) == revision), None
    )


def _template_hash(rs: Mapping[str, Any]) -> str | None:
    return (
        (_get(rs, "metadata", "labels") or {}).get(TEMPLATE_HASH_LABEL)
        or (_get(rs, "spec", "selector", "matchLabels") or {}).get(TEMPLATE_HASH_LABEL)
    )


def waiting_for_gpu(pod: Mapping[str, Any], resource: str) -> tuple[datetime | None, str] | None:
    """(since when, the scheduler's message) when ``pod`` is Unschedulable for insufficient ``resource`` and no
    node has been nominated for it (a preemption would make room); else None."""
    if _get(pod, "status", "nominatedNodeName"):
        return None
    for c in _get(pod, "status", "conditions") or ():
        if isinstance(c, Mapping) and c.get("type") == "PodScheduled":
            message = c.get("message") or ""
            if c.get("status") == "False" and c.get("reason") == "Unschedulable" and f"Insufficient {resource}" in message:
                since = api.parse_time(c.get("lastTransitionTime")) or api.parse_time(
                    _get(pod, "metadata", "creationTimestamp"))
                return since, message
    return None


def may_replace_in_place(spec: api.LLMDeploymentSpec) -> bool:
    """Whether the spec lets a rollout switch to replacing in place (so there may be a switch to carry)."""
    return spec.rollout.on_no_spare_gpu == "ReplaceInPlace" and spec.gpu_count > 0


def carried_in_place(deployment: Mapping[str, Any] | None) -> str | None:
    """The template whose rollout the Deployment replaces in place now (its :data:`IN_PLACE_ANNOTATION`), for a
    reconcile to render the same strategy; None when it has none."""
    return (_get(deployment, "metadata", "annotations") or {}).get(IN_PLACE_ANNOTATION) or None


def decide(
    spec: api.LLMDeploymentSpec,
    deployment: Mapping[str, Any] | None,
    replicasets: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    now: datetime,
) -> Verdict:
    """Whether the Deployment's rollout is blocked for want of a spare GPU, and whether it replaces in place.

    ``replicasets`` and ``pods`` are those the Deployment selects (terminating pods are ignored); ``now`` is an
    aware datetime. See the module docstring for the rules.
    """
    resource = spec.resources.gpu.resource_name
    # parallelism.nodes > 1 runs a LeaderWorkerSet, whose rollouts (StatefulSets, not ReplicaSets) are not guarded.
    if deployment is None or spec.gpu_count == 0 or spec.parallelism.nodes > 1 or rollout_complete(deployment):
        return Verdict(resource=resource)
    template = _get(deployment, "spec", "template", "metadata", "annotations") or {}
    spec_hash = template.get(SPEC_HASH_ANNOTATION)
    replacing = may_replace_in_place(spec) and spec_hash is not None
    in_place = spec_hash if replacing and carried_in_place(deployment) == spec_hash else None

    new_rs = new_replicaset(deployment, replicasets)
    new_hash = _template_hash(new_rs) if new_rs is not None else None
    live = [p for p in pods if isinstance(p, Mapping) and not _get(p, "metadata", "deletionTimestamp")]
    new = [p for p in live if new_hash and (_get(p, "metadata", "labels") or {}).get(TEMPLATE_HASH_LABEL) == new_hash]
    if not new or len(new) == len(live):  # no rollout seen (yet), or nothing old left to replace
        return Verdict(resource=resource, replace_in_place=in_place)

    waiting = []
    for pod in new:
        found = waiting_for_gpu(pod, resource)
        if found is not None:
            waiting.append((found[0] or now, str(_get(pod, "metadata", "name")), found[1]))
    if not waiting:
        return Verdict(resource=resource, replace_in_place=in_place)
    since, name, message = min(waiting)
    blocked = (now - since).total_seconds() >= spec.rollout.surge_timeout_seconds
    if blocked and replacing:
        in_place = spec_hash
    return Verdict(blocked=blocked, pod=name, since=since, message=message, resource=resource, replace_in_place=in_place)


def needs_apply(rollout: api.RolloutSpec, deployment: Mapping[str, Any] | None, verdict: Verdict) -> bool:
    """Whether the Deployment must be applied again for its strategy to follow ``verdict``."""
    if deployment is None:
        return False
    want = verdict.strategy(rollout)
    have = _get(deployment, "spec", "strategy", "rollingUpdate") or {}
    if {k: str(v) for k, v in want.items()} != {k: str(have.get(k)) for k in want}:  # 1 and "1" alike
        return True
    return verdict.replace_in_place is not None and carried_in_place(deployment) != verdict.replace_in_place
