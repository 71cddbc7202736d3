"""The v1 Services: the one clients call, and for a deployment that scales to zero the activator's upstream."""

from __future__ import annotations

from typing import Any

from kubellm.operator import api
from kubellm.operator.render.naming import (
    LABEL_COMPONENT,
    PORT_NAME,
    child_metadata,
    pods_service_name,
    scales_to_zero,
    serving_selector,
)

PODS_SERVICE_COMPONENT = "activator-upstream"


def render_service(ld: api.LLMDeployment) -> dict[str, Any]:
    """The v1 Service clients call (OpenAI API); /metrics is on the same port, which the ServiceMonitor scrapes."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(ld),
        "spec": {
            "type": ld.spec.service.type,
            "selector": serving_selector(ld),
            "ports": [
                {
                    "name": PORT_NAME,
                    "port": ld.spec.service.port,
                    "targetPort": PORT_NAME,
                    "protocol": "TCP",
                    "appProtocol": "http",
                }
            ],
        },
    }


def render_pods_service(ld: api.LLMDeployment) -> dict[str, Any] | None:
    """``<name>-pods``: the pods alone, on the client-facing Service's port (None unless it scales to zero).

    The activator forwards to ``http://<name>-pods.<namespace>.svc:<port>``, the port the client called."""
    if not scales_to_zero(ld):
        return None
    service = render_service(ld)
    service["metadata"]["name"] = pods_service_name(ld)
    # Not the runtime component's labels: the ServiceMonitor selects Services by those and would scrape every
    # pod twice, doubling the sums the autoscalers read.
    service["metadata"]["labels"][LABEL_COMPONENT] = PODS_SERVICE_COMPONENT
    service["spec"]["type"] = "ClusterIP"  # only the activator calls it
    return service
