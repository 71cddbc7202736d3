"""The apps/v1 Deployment running ``kubellm serve`` (single-node replicas; :mod:`.multinode` renders the rest).

* Replicas: with autoscaling enabled the Deployment has no ``spec.replicas`` at all, so under server-side
  apply the HPA (or KEDA's HPA) is its only owner.
* Strategy: the spec's rollingUpdate (:func:`spec_strategy`), or, while the rollout guard
  (:mod:`kubellm.operator.status.rollout_guard`) has switched the current template's rollout to replacing pods
  in place, :func:`in_place_strategy`, with :data:`IN_PLACE_ANNOTATION` on the Deployment.
"""

from __future__ import annotations

from typing import Any

from kubellm.operator import api
from kubellm.operator.render.naming import SPEC_HASH_ANNOTATION, child_metadata, selector_labels
from kubellm.operator.render.pods import pod_template

REVISION_HISTORY_LIMIT = 3

# progressDeadlineSeconds = startupTimeoutSeconds + this (scheduling, image pull), so a slow model load is not
# reported as a stalled rollout.
PROGRESS_DEADLINE_MARGIN_SECONDS = 600
# On the Deployment (written by render, the operator's field manager owns it): the kubellm.io/spec-hash of the
# pod template whose rollout replaces pods in place. Server-side apply drops it once render stops writing it.
IN_PLACE_ANNOTATION = f"{api.GROUP}/replacing-in-place"


def in_place_strategy(rollout: api.RolloutSpec) -> dict[str, Any]:
    """The rollingUpdate of a rollout that replaces in place: no surge; the spec's maxUnavailable, 1 when it is 0."""
    unavailable = rollout.max_unavailable if str(rollout.max_unavailable) not in ("0", "0%") else 1
    return {"maxSurge": 0, "maxUnavailable": unavailable}


def spec_strategy(rollout: api.RolloutSpec) -> dict[str, Any]:
    """The rollingUpdate the spec asks for."""
    return {"maxSurge": rollout.max_surge, "maxUnavailable": rollout.max_unavailable}


def render_deployment(ld: api.LLMDeployment, *, replace_in_place: str | None = None) -> dict[str, Any]:
    """The apps/v1 Deployment running ``kubellm serve``.

    ``replace_in_place``: the spec-hash of a pod template whose rollout :mod:`kubellm.operator.status.rollout_guard` switched to
    replacing pods in place (no spare GPU for a surge pod). When it is this template's, the strategy is
    :func:`in_place_strategy` and the Deployment carries the hash in
    ``kubellm.io/replacing-in-place``; any other value (a new template: a new rollout) renders the spec's strategy.
    """
    spec = ld.spec
    template = pod_template(ld)
    in_place = replace_in_place is not None and replace_in_place == template["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
    rolling_update = (
        in_place_strategy(spec.rollout) if in_place else spec_strategy(spec.rollout)
    )
    dep_spec: dict[str, Any] = {}
    if not spec.autoscaling.enabled:  # else the HPA / KEDA owns replicas: leave the field out entirely
        dep_spec["replicas"] = spec.replicas
    dep_spec.update(
        {
            "selector": {"matchLabels": selector_labels(ld)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling_update},
            "revisionHistoryLimit": REVISION_HISTORY_LIMIT,
            "progressDeadlineSeconds": spec.probes.startup_timeout_seconds + PROGRESS_DEADLINE_MARGIN_SECONDS,
            "template": template,
        }
    )
    metadata = child_metadata(ld)
    if in_place:
        metadata["annotations"] = {IN_PLACE_ANNOTATION: replace_in_place}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata, "spec": dep_spec}
