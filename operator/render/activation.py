"""Scale from zero, the operator's side: where an LLMDeployment's Service sends requests while no pod is ready.

Pure functions of (spec, observed state); :mod:`.observer` applies what they return. The mechanism and the
alternatives it was chosen over are in docs/autoscaling.md, "Scale from zero".

* A deployment scales to zero when ``autoscaling.minReplicas`` is 0 (:func:`.naming.scales_to_zero`). It then gets a
  second Service, ``<name>-pods`` (:func:`.service.render_pods_service`, rendered with the other children): the
  activator forwards held requests there, never through the client-facing Service, which may be routed to
  the activator itself.
* The client-facing Service is never changed (same name, same ClusterIP, same selector). While it has no
  ready pod, :func:`render_activator_slice` adds one EndpointSlice of ours to it, labelled
  ``kubernetes.io/service-name: <name>``, listing the activator's ready pods. kube-proxy (and every
  EndpointSlice consumer) merges all slices of a Service, so the Service's traffic goes to the activator. Once
  a pod is ready the slice is deleted and the Service's own slice (the Kubernetes controller's, from the
  selector) is the only one again. Until the observer notices, both are used, which is harmless: the
  activator forwards to the same pods.
* The activator's addresses are observed, not configured: the ready endpoints of its own Service's slices
  (:func:`activator_endpoints`), in the operator's namespace.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kubellm.operator import api
from kubellm.operator.render.naming import PORT_NAME, child_metadata, child_name, scales_to_zero

SLICE_SUFFIX = "-activator"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"  # the Service an EndpointSlice belongs to
SLICE_MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
# Not the Kubernetes controller's value (endpointslice-controller.k8s.io), so that controller leaves it alone.
SLICE_MANAGER = "kubellm-operator.kubellm.io"
ACTIVATOR_PORT_NAME = "http"  # the port of the activator's Service that receives the held requests
ROUTE_PODS = "Pods"
ROUTE_ACTIVATOR = "Activator"


@dataclass(frozen=True)
class ActivatorEndpoints:
    """The activator's ready pods as its Service's EndpointSlices list them: addresses and their port."""

    address_type: str  # IPv4 or IPv6 (an EndpointSlice holds one family)
    addresses: tuple[str, ...]
    port: int


@dataclass(frozen=True)
class Routing:
    """The route chosen for one observation (for status.autoscaling.activation)."""

    route: str  # ROUTE_PODS or ROUTE_ACTIVATOR
    activator_endpoints: int
    message: str


def slice_name(ld: api.LLMDeployment) -> str:
    return child_name(ld) + SLICE_SUFFIX


def activator_endpoints(slices: Iterable[Mapping[str, Any]]) -> ActivatorEndpoints | None:
    """The ready addresses of the activator's Service, from its EndpointSlices (None when it has none).

    Terminating and not-ready endpoints are left out (``conditions.ready`` absent counts as ready, as the API
    defines it). One address family: the first slice's that has ready addresses."""
    for s in sorted(slices, key=lambda s: (s.get("metadata") or {}).get("name") or ""):
        ports = [p for p in s.get("ports") or () if p.get("name") == ACTIVATOR_PORT_NAME and p.get("port")]
        if not ports:
            continue
        addresses = sorted({
            a for e in s.get("endpoints") or () if (e.get("conditions") or {}).get("ready") is not False
            for a in e.get("addresses") or ()
        })  # fmt: skip
        if addresses:
            family = s.get("addressType") or "IPv4"
            same = tuple(a for a in addresses if _family(a) == family)
            if same:
                return ActivatorEndpoints(family, same, int(ports[0]["port"]))
    return None


def _family(address: str) -> str | None:
    try:
        return "IPv6" if ipaddress.ip_address(address).version == 6 else "IPv4"
    except ValueError:
        return None


def routing(ld: api.LLMDeployment, ready_replicas: int, activator: ActivatorEndpoints | None) -> Routing | None:
    """Where the Service should send requests now; None when the deployment does not scale to zero."""
    if not scales_to_zero(ld):
        return None
    if ready_replicas > 0:
        return Routing(ROUTE_PODS, 0, f"{ready_replicas} ready pod(s) serve the Service")
    if activator is None:
        return Routing(ROUTE_PODS, 0, "no pod is ready and no activator is ready to hold requests: they fail "
                       "until a pod is ready (install the chart with activator.enabled=true)")
    return Routing(ROUTE_ACTIVATOR, len(activator.addresses),
                   "no pod is ready: the activator holds requests, wakes the deployment and forwards them")


def render_activator_slice(ld: api.LLMDeployment, activator: ActivatorEndpoints) -> dict[str, Any]:
    """The discovery.k8s.io/v1 EndpointSlice that adds the activator's pods to the LLMDeployment's Service.

    Its port is named like the Service's port (``http``), which is how a Service port finds its endpoints."""
    meta = child_metadata(ld)
    meta["name"] = slice_name(ld)
    meta["labels"] = {
        **meta["labels"],
        SERVICE_NAME_LABEL: child_name(ld),
        SLICE_MANAGED_BY_LABEL: SLICE_MANAGER,
    }
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": meta,
        "addressType": activator.address_type,
        "ports": [{"name": PORT_NAME, "port": activator.port, "protocol": "TCP", "appProtocol": "http"}],
        "endpoints": [{"addresses": [a], "conditions": {"ready": True}} for a in activator.addresses],
    }


def render_routing(
    ld: api.LLMDeployment, ready_replicas: int, activator: ActivatorEndpoints | None
) -> tuple[Routing | None, list[dict[str, Any]]]:
    """The route and the EndpointSlices it needs (none unless the route is the activator)."""
    route = routing(ld, ready_replicas, activator)
    if route is None or route.route != ROUTE_ACTIVATOR or activator is None:
        return route, []
    return route, [render_activator_slice(ld, activator)]


def scale_to_zero_status(
    autoscaling: api.AutoscalingStatus,
    previous: api.AutoscalingStatus | None,
    desired_replicas: int,
    route: Routing | None,
    *,
    idle_seconds: int,
    now: datetime,
) -> list[tuple[str, str, str]]:
    """Fill ``autoscaling.scaledToZeroSince`` and ``.activation``; the Events (type, reason, message): one
    ``ScaledToZero`` when the desired replicas reach 0. (``Activated`` is the activator's to post.)"""
    before = previous.scaled_to_zero_since if previous else None
    last_activation = previous.activation.last_activation_time if previous and previous.activation else None
    events = []
    if desired_replicas == 0:
        autoscaling.scaled_to_zero_since = before or now
        if before is None:
            events.append(("Normal", "ScaledToZero",
                           f"no requests for {idle_seconds}s: scaled to zero; the next request wakes it "
                           "through the activator"))  # fmt: skip
    else:
        autoscaling.scaled_to_zero_since = None
        if before is not None:
            last_activation = now
    if route is not None:
        autoscaling.activation = api.ActivationStatus(
            route=route.route, activator_endpoints=route.activator_endpoints,
            last_activation_time=last_activation, message=route.message,
        )  # fmt: skip
    return events
