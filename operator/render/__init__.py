"""Render an LLMDeployment into the Kubernetes objects that serve it: pure functions, no I/O, no API client.

:func:`render` checks the spec once (:func:`.validation.validate`) and returns every child manifest in apply
order: Service (and the activator's ``<name>-pods`` Service, :mod:`.service`), Deployment (:mod:`.deployment`,
its pods :mod:`.pods`) or, for multi-node replicas, LeaderWorkerSet (:mod:`.multinode`), PodDisruptionBudget
(:mod:`.disruption_budget`), the HorizontalPodAutoscaler or KEDA ScaledObject when autoscaling is enabled
(:mod:`.autoscaling`), the ServiceMonitor when monitoring asks for one (:mod:`.service_monitor`), the
PrometheusRule when monitoring.alerts does (:mod:`.alerts`), then the InferencePool when
gateway.inferencePool asks for one (:mod:`.inference_pool`). One module per child kind; each imports the
names, labels and owner reference from :mod:`.naming` and none imports :mod:`render` back. The optional
``render_<kind>`` functions return None when the spec does not call for that child, so the operator can delete
a child it owns that is no longer rendered (:data:`.naming.CHILD_KINDS` lists every kind it may own). Specs the
API server accepts but that cannot be rendered raise :class:`InvalidSpec` with a message for humans; the
operator turns it into a condition. ``kubellm render -f FILE`` (:mod:`.cli`) prints the same objects as
multi-document YAML.
"""

from __future__ import annotations

from typing import Any

from kubellm.operator import api
from kubellm.operator.render import (
    alerts,
    autoscaling,
    disruption_budget,
    inference_pool,
    multinode,
    service,
    service_monitor,
)
from kubellm.operator.render.deployment import render_deployment
from kubellm.operator.render.naming import InvalidSpec, is_multi_node
from kubellm.operator.render.validation import validate

__all__ = ["InvalidSpec", "render", "render_validated", "render_workload", "validate"]


def render(ld: api.LLMDeployment, **options: Any) -> list[dict[str, Any]]:
    """Every child manifest of ``ld``, in apply order. Pure: same input, same output; ``ld`` is not changed.

    Checks the spec once (:func:`validate`: raises :class:`InvalidSpec` when it cannot be rendered), then
    renders it with ``options``, those of :func:`render_validated`.
    """
    validate(ld)
    return render_validated(ld, **options)


def render_validated(
    ld: api.LLMDeployment,
    *,
    service_monitor_available: bool = False,
    prometheus_url: str = autoscaling.DEFAULT_PROMETHEUS_URL,
    replace_in_place: str | None = None,
    activator_url: str | None = None,
) -> list[dict[str, Any]]:
    """:func:`render` of an ``ld`` that already passed :func:`validate` (the reconcile checks it first, then
    reads what it renders with): the same manifests, without checking the spec again.

    ``service_monitor_available``: whether the monitoring.coreos.com ServiceMonitor CRD is installed (for
    monitoring.serviceMonitor Auto). ``prometheus_url``: the Prometheus the KEDA trigger queries.
    ``replace_in_place``: the rollout guard's decision (:func:`.deployment.render_deployment`).
    ``activator_url``: the activator's admin base URL (its activity counts feed KEDA), None without one.
    The activator's EndpointSlice depends on observed state and is not among these
    (:func:`.activation.render_routing`).
    """
    children = [
        service.render_service(ld),
        service.render_pods_service(ld),
        render_workload(ld, replace_in_place=replace_in_place),
        disruption_budget.render_pdb(ld),
        autoscaling.render_hpa(ld),
        autoscaling.render_scaled_object(ld, prometheus_url=prometheus_url, activator_url=activator_url),
        service_monitor.render_service_monitor(ld, service_monitor_available=service_monitor_available),
        alerts.render_prometheus_rule(ld),
        inference_pool.render_inference_pool(ld),
    ]
    return [c for c in children if c is not None]


def render_workload(ld: api.LLMDeployment, *, replace_in_place: str | None = None) -> dict[str, Any]:
    """What runs the pods: the Deployment, or with parallelism.nodes > 1 a LeaderWorkerSet whose groups of
    pods each hold one tensor-parallel group (:mod:`.multinode`; the rollout guard leaves those alone)."""
    if is_multi_node(ld):
        return multinode.render_leader_worker_set(ld)
    return render_deployment(ld, replace_in_place=replace_in_place)
