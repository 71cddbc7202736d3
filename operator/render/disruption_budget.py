"""The policy/v1 PodDisruptionBudget of the runtime pods.

``maxUnavailable: 1`` (never ``minAvailable``, which would leave a single-replica deployment with zero allowed
disruptions and block node drains forever) and ``unhealthyPodEvictionPolicy: AlwaysAllow`` (a pod still loading
or crash-looping never blocks a drain).
"""

from __future__ import annotations

from typing import Any

from kubellm.operator import api
from kubellm.operator.render.naming import child_metadata, selector_labels


def render_pdb(ld: api.LLMDeployment) -> dict[str, Any]:
    """The policy/v1 PodDisruptionBudget: voluntary evictions (node drains) take one pod at a time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(ld),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(ld)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
