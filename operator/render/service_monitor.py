"""The monitoring.coreos.com/v1 ServiceMonitor that has the Prometheus operator scrape the runtime's /metrics."""

from __future__ import annotations

from typing import Any

from kubellm.operator import api
from kubellm.operator.render.naming import LABEL_LLMDEPLOYMENT, PORT_NAME, child_metadata, selector_labels

SCRAPE_INTERVAL = "15s"
SCRAPE_TIMEOUT = "10s"


def wants_service_monitor(ld: api.LLMDeployment, service_monitor_available: bool) -> bool:
    mode = ld.spec.monitoring.service_monitor
    return mode == "Enabled" or (mode == "Auto" and service_monitor_available)


def render_service_monitor(
    ld: api.LLMDeployment, *, service_monitor_available: bool = False
) -> dict[str, Any] | None:
    """The monitoring.coreos.com/v1 ServiceMonitor scraping /metrics, or None when monitoring asks for none
    (Disabled, or Auto without the CRD). It copies the pod label kubellm.io/llmdeployment onto the series."""
    if not wants_service_monitor(ld, service_monitor_available):
        return None
    spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(ld)},
        "endpoints": [
            {
                "port": PORT_NAME,
                "path": "/metrics",
                "interval": SCRAPE_INTERVAL,
                "scrapeTimeout": SCRAPE_TIMEOUT,
            }
        ],
        "podTargetLabels": [LABEL_LLMDEPLOYMENT],
    }
    if ld.namespace:
        spec["namespaceSelector"] = {"matchNames": [ld.namespace]}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": child_metadata(ld),
        "spec": spec,
    }
