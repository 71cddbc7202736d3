"""The InferencePool of the Gateway API Inference Extension (gateway.inferencePool)."""

from __future__ import annotations

from typing import Any

from kubellm.operator import api
from kubellm.operator.render.naming import INFERENCE_POOL_API_VERSION, child_metadata, serving_selector


def render_inference_pool(ld: api.LLMDeployment) -> dict[str, Any] | None:
    """The inference.networking.k8s.io/v1 InferencePool of the serving pods, or None unless
    gateway.inferencePool.enabled.

    It selects the pods the Service selects and targets the runtime's port, where the endpoint picker
    also scrapes /metrics (docs/gateway.md maps the metric names it reads). v1, not v1alpha2
    (inference.networking.x-k8s.io): v1 is the API every conformant gateway serves since the extension's
    v1.0, and v1alpha2 is deprecated and gone from its CRDs.
    """
    pool = ld.spec.gateway.inference_pool
    if not pool.enabled:
        return None
    spec: dict[str, Any] = {
        "selector": {"matchLabels": serving_selector(ld)},
        "targetPorts": [{"number": api.RUNTIME_PORT}],
        "appProtocol": "http",
    }
    if pool.endpoint_picker_ref is not None:
        epp = pool.endpoint_picker_ref
        spec["endpointPickerRef"] = {
            "group": "",
            "kind": "Service",
            "name": epp.name,
            "port": {"number": epp.port},
            "failureMode": epp.failure_mode,
        }
    return {
        "apiVersion": INFERENCE_POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": child_metadata(ld),
        "spec": spec,
    }
