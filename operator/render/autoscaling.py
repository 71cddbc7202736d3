"""Queue-depth autoscaling: the autoscaling/v2 HorizontalPodAutoscaler (backend hpa) or the keda.sh/v1alpha1
ScaledObject (backend keda, which can scale to zero).

The runtime exports the per-pod gauge api.QUEUE_DEPTH_METRIC (kubellm:num_requests_waiting). HPA:
prometheus-adapter serves it on the custom-metrics API under :data:`HPA_METRIC_NAME` (colon → underscore,
:data:`PROMETHEUS_ADAPTER_RULE`, which the Helm chart ships); the HPA targets its per-pod average. KEDA: a
Prometheus query summing the gauge over the LLMDeployment's pods, selected by
:data:`.naming.PROMETHEUS_LLMDEPLOYMENT_LABEL`.
"""

from __future__ import annotations

from typing import Any

from kubellm.operator import api
from kubellm.operator.render.naming import (
    LWS_API_VERSION,
    LWS_KIND,
    PROMETHEUS_LLMDEPLOYMENT_LABEL,
    child_metadata,
    child_name,
    is_multi_node,
    label_value,
    lws_name,
)

# Autoscaling. The runtime exports the per-pod gauge api.QUEUE_DEPTH_METRIC (kubellm:num_requests_waiting).
# HPA: prometheus-adapter serves it on the custom-metrics API under HPA_METRIC_NAME (colon → underscore, the
# adapter rule below, which the Helm chart ships); the HPA targets its per-pod average.
HPA_METRIC_NAME = "kubellm_num_requests_waiting"
PROMETHEUS_ADAPTER_RULE: dict[str, Any] = {
    "seriesQuery": f'{api.QUEUE_DEPTH_METRIC}{{namespace!="",pod!=""}}',
    "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
    "name": {"matches": "^kubellm:(.*)$", "as": "kubellm_${1}"},
    "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
}
DEFAULT_PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"
KEDA_POLLING_INTERVAL_SECONDS = 15

# Scale to zero: "in flight" is running plus waiting (a pod busy with requests can have an empty queue). The
# activity triggers' threshold is beyond any real count: they only tell KEDA "busy" (at most one pod).
IN_FLIGHT_METRICS = ("kubellm:num_requests_running", api.QUEUE_DEPTH_METRIC)
ACTIVITY_THRESHOLD = "1000000"

# HPA behaviour policies (the stabilisation windows come from the spec). Up: double or add 4 pods a minute,
# whichever is more. Down: one pod a minute; each one drains its requests first.
SCALE_UP_POLICIES = (
    {"type": "Percent", "value": 100, "periodSeconds": 60},
    {"type": "Pods", "value": 4, "periodSeconds": 60},
)
SCALE_DOWN_POLICIES = ({"type": "Pods", "value": 1, "periodSeconds": 60},)


def _behavior(autoscaling: api.AutoscalingSpec) -> dict[str, Any]:
    return {
        "scaleUp": {
            "stabilizationWindowSeconds": autoscaling.scale_up_stabilization_seconds,
            "selectPolicy": "Max",
            "policies": [dict(p) for p in SCALE_UP_POLICIES],
        },
        "scaleDown": {
            "stabilizationWindowSeconds": autoscaling.scale_down_stabilization_seconds,
            "selectPolicy": "Max",
            "policies": [dict(p) for p in SCALE_DOWN_POLICIES],
        },
    }


def _scale_target(ld: api.LLMDeployment) -> dict[str, str]:
    if is_multi_node(ld):  # the LWS has a scale subresource; its selector picks the leaders
        return {"apiVersion": LWS_API_VERSION, "kind": LWS_KIND, "name": lws_name(ld)}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": child_name(ld)}


def render_hpa(ld: api.LLMDeployment) -> dict[str, Any] | None:
    """The autoscaling/v2 HorizontalPodAutoscaler (backend hpa), or None when the spec needs none.

    Targets the per-pod average of :data:`HPA_METRIC_NAME` (a Pods metric from the custom-metrics API).
    """
    autoscaling = ld.spec.autoscaling
    if not autoscaling.enabled or autoscaling.backend != "hpa":
        return None
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": child_metadata(ld),
        "spec": {
            "scaleTargetRef": _scale_target(ld),
            "minReplicas": autoscaling.min_replicas,
            "maxReplicas": autoscaling.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": HPA_METRIC_NAME},
                        "target": {
                            "type": "AverageValue",
                            "averageValue": str(autoscaling.target_queue_depth),
                        },
                    },
                }
            ],
            "behavior": _behavior(autoscaling),
        },
    }


def _series_matchers(ld: api.LLMDeployment) -> str:
    """PromQL label matchers selecting the LLMDeployment's pods' series."""
    matchers = []
    if ld.namespace:
        matchers.append(f'namespace="{ld.namespace}"')
    matchers.append(f'{PROMETHEUS_LLMDEPLOYMENT_LABEL}="{label_value(ld)}"')
    return ",".join(matchers)


def queue_depth_query(ld: api.LLMDeployment) -> str:
    """PromQL: requests waiting over all the LLMDeployment's pods (0 when none report, e.g. at zero replicas)."""
    return f"sum({api.QUEUE_DEPTH_METRIC}{{{_series_matchers(ld)}}}) or vector(0)"


def in_flight_query(ld: api.LLMDeployment) -> str:
    """PromQL: requests running or waiting over all the LLMDeployment's pods (0 when none report)."""
    matchers = _series_matchers(ld)
    return f"sum({IN_FLIGHT_METRICS[0]}{{{matchers}}} + {IN_FLIGHT_METRICS[1]}{{{matchers}}}) or vector(0)"


def activity_url(ld: api.LLMDeployment, activator_url: str) -> str:
    """The activator's count of requests it holds or forwards for ``ld`` (JSON ``{"requests": n, ...}``)."""
    return f"{activator_url.rstrip('/')}/activity/{ld.namespace or 'default'}/{child_name(ld)}"


def _activity_triggers(ld: api.LLMDeployment, prometheus_url: str, activator_url: str | None) -> list[dict]:
    """KEDA triggers that keep a deployment with minReplicas 0 awake while any request is in flight (none
    unless it scales to zero). Their threshold is beyond any real count, so they ask for one pod at most and
    the queue-depth trigger alone sizes the deployment above that."""
    if ld.spec.autoscaling.min_replicas != 0:
        return []
    triggers: list[dict[str, Any]] = [{
        "type": "prometheus",
        "name": "in-flight",
        "metricType": "AverageValue",
        "metadata": {"serverAddress": prometheus_url, "query": in_flight_query(ld),
                     "threshold": ACTIVITY_THRESHOLD, "activationThreshold": "0"},
    }]  # fmt: skip
    if activator_url:
        triggers.append({
            "type": "metrics-api",
            "name": "activator",
            "metricType": "AverageValue",
            "metadata": {"url": activity_url(ld, activator_url), "valueLocation": "requests", "format": "json",
                         "targetValue": ACTIVITY_THRESHOLD, "activationTargetValue": "0"},
        })  # fmt: skip
    return triggers


def idle_seconds(ld: api.LLMDeployment) -> int:
    """How long a deployment that scales to zero must be idle before its last pod goes (KEDA's cooldownPeriod)."""
    auto = ld.spec.autoscaling
    after = auto.scale_to_zero_after_seconds
    return after if after is not None else auto.scale_down_stabilization_seconds


def render_scaled_object(
    ld: api.LLMDeployment, *, prometheus_url: str = DEFAULT_PROMETHEUS_URL, activator_url: str | None = None
) -> dict[str, Any] | None:
    """The keda.sh/v1alpha1 ScaledObject (backend keda), or None when the spec needs none.

    A Prometheus trigger on the summed queue depth with metricType AverageValue and threshold
    targetQueueDepth, i.e. the same per-pod target as the HPA backend. With minReplicas 0, triggers that say
    whether any request is in flight (:func:`_activity_triggers`) and cooldownPeriod from
    scaleToZeroAfterSeconds; ``activator_url`` is the activator's admin base URL, None without an activator.
    """
    autoscaling = ld.spec.autoscaling
    if not autoscaling.enabled or autoscaling.backend != "keda":
        return None
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": child_metadata(ld),
        "spec": {
            "scaleTargetRef": _scale_target(ld),
            "minReplicaCount": autoscaling.min_replicas,
            "maxReplicaCount": autoscaling.max_replicas,
            "pollingInterval": KEDA_POLLING_INTERVAL_SECONDS,
            # Only used for the last step to zero (minReplicaCount 0): idle this long, every trigger inactive.
            "cooldownPeriod": idle_seconds(ld),
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(autoscaling)}},
            "triggers": [
                {
                    "type": "prometheus",
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": prometheus_url,
                        "query": queue_depth_query(ld),
                        "threshold": str(autoscaling.target_queue_depth),
                    },
                },
                *_activity_triggers(ld, prometheus_url, activator_url),
            ],
        },
    }
