"""The LLMDeployment status the operator writes: conditions, counts, autoscaling, activation, InferencePool.

Status models ignore unknown fields (a newer operator may have written more).
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import Field

from kubellm.operator.api.rules import StatusModel


class ConditionType(StrEnum):
    """The condition types the operator writes to ``status.conditions``."""

    READY = "Ready"  # enough replicas pass the inference readiness probe to serve
    PROGRESSING = "Progressing"  # a rollout or scale is under way
    DEGRADED = "Degraded"  # something needs a human (crash loops, unschedulable, model load failures)
    MODEL_LOADED = "ModelLoaded"  # at least one pod has the model in memory
    SCALING_ACTIVE = "ScalingActive"  # the autoscaler is computing replica counts from the queue depth
    DRAINING = "Draining"  # old pods are finishing in-flight requests
    # kstatus's abnormal-true pair (Flux health checks, kpt, cli-utils): derived from the conditions above.
    RECONCILING = "Reconciling"  # the operator is still working towards the spec (rollout, scale, loading)
    STALLED = "Stalled"  # no progress without a change (invalid spec, crash loop, progress deadline)


class ConditionStatus(StrEnum):
    """The status of a condition: True, False or Unknown."""

    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


def parse_time(value: Any) -> datetime | None:
    """A Kubernetes timestamp (``2024-05-01T12:00:00Z``) as an aware datetime; None if absent or unparsable."""
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def utc_now() -> datetime:
    """Now, in UTC, to the second (condition times; status.py uses it too)."""
    return datetime.now(UTC).replace(microsecond=0)


class Condition(StatusModel):
    """An observation of one aspect of the deployment (the metav1.Condition shape)."""

    type: str = Field(max_length=316, pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$")  # fmt: skip
    """Ready, Progressing, Degraded, ModelLoaded, ScalingActive, Draining, Reconciling or Stalled."""

    status: ConditionStatus
    """True, False or Unknown."""

    reason: str = Field(min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    """Why the condition has this status, in CamelCase (also the STATUS column for Ready)."""

    message: str = Field(default="", max_length=32768)
    """Details for humans."""

    last_transition_time: datetime
    """When the status last changed."""

    observed_generation: int | None = Field(default=None, ge=0)
    """The metadata.generation the condition was computed from."""


class ActivationStatus(StatusModel):
    """Where the Service of a deployment that scales to zero sends requests (docs/autoscaling.md)."""

    route: Literal["Pods", "Activator"]
    """Pods: the Service's own endpoints (the ready pods). Activator: no pod is ready, so an EndpointSlice of
    the operator adds the activator's pods, which hold requests, wake the deployment and forward them."""

    activator_endpoints: int = Field(default=0, ge=0)
    """Ready activator pods the Service routes to (0 unless route is Activator)."""

    last_activation_time: datetime | None = None
    """When the deployment last left zero replicas."""

    message: str = ""
    """Why the route is what it is, e.g. that no activator is ready."""


class AutoscalingStatus(StatusModel):
    """What the autoscaler sees and does."""

    current_queue_depth: float | None = Field(default=None, ge=0)
    """Requests waiting per pod, averaged over the ready pods (the QUEUE column)."""

    target_queue_depth: int | None = Field(default=None, ge=1)
    """The target it scales towards (spec.autoscaling.targetQueueDepth)."""

    current_replicas: int | None = Field(default=None, ge=0)
    """Replicas now."""

    desired_replicas: int | None = Field(default=None, ge=0)
    """Replicas the autoscaler last asked for."""

    last_scale_time: datetime | None = None
    """When the autoscaler last changed the replica count."""

    blocked_reason: str | None = None
    """Why the autoscaler cannot act (e.g. the custom-metrics API is missing); empty when it can."""

    scaled_to_zero_since: datetime | None = None
    """When the deployment last reached zero replicas; absent while it has any."""

    activation: ActivationStatus | None = None
    """Scale from zero (minReplicas 0): where the Service sends requests and the last wake-up."""


class PoolParentStatus(StatusModel):
    """How one parent of the InferencePool (a Gateway) takes it, copied from the pool's status.parents."""

    parent: str
    """Kind, namespace and name of the parent, e.g. Gateway ml/inference-gateway."""

    accepted: bool | None = None
    """Its Accepted condition: whether the gateway routes to the pool (unset while Unknown)."""

    resolved_refs: bool | None = None
    """Its ResolvedRefs condition: whether the gateway found the endpoint picker (unset while Unknown)."""

    reason: str | None = None
    """Reason of the first of those two that is False."""

    message: str | None = None
    """Message of the first of those two that is False."""


class InferencePoolStatus(StatusModel):
    """The InferencePool as the gateways report it (with spec.gateway.inferencePool.enabled)."""

    name: str | None = None
    """The InferencePool's name (an HTTPRoute's backendRef)."""

    parents: list[PoolParentStatus] | None = Field(
        default=None, max_length=32, json_schema_extra={"x-kubernetes-list-type": "atomic"}
    )
    """The gateways that use the pool; empty until an HTTPRoute attached to a Gateway names it."""


class LLMDeploymentStatus(StatusModel):
    """The observed state of an LLMDeployment, written by the operator."""

    observed_generation: int | None = Field(default=None, ge=0)
    """The metadata.generation this status describes."""

    replicas: int | None = Field(default=None, ge=0)
    """Pods that exist (the scale subresource's status.replicas)."""

    ready_replicas: int | None = Field(default=None, ge=0)
    """Pods that pass the inference readiness probe."""

    updated_replicas: int | None = Field(default=None, ge=0)
    """Pods running the current spec."""

    ready_text: str | None = None
    """Ready pods over desired pods, e.g. 1/2 (the READY column)."""

    selector: str | None = None
    """Label selector of the pods, as a string (the scale subresource's selector, used by autoscalers)."""

    endpoint: str | None = None
    """In-cluster base URL of the OpenAI-compatible API: http://<service>.<namespace>.svc:<port>/v1."""

    autoscaling: AutoscalingStatus | None = None
    """Autoscaler state (when spec.autoscaling.enabled)."""

    inference_pool: InferencePoolStatus | None = None
    """The InferencePool and the gateways that take it (when spec.gateway.inferencePool.enabled)."""

    conditions: list[Condition] | None = Field(
        default=None,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    """Ready, Progressing, Degraded, ModelLoaded, ScalingActive, Draining, and kstatus's Reconciling and Stalled."""

    def get_condition(self, type: str) -> Condition | None:
        return next((c for c in self.conditions or () if c.type == type), None)

    def is_condition_true(self, type: str) -> bool:
        c = self.get_condition(type)
        return c is not None and c.status == ConditionStatus.TRUE

    def set_condition(
        self,
        type: str,
        status: ConditionStatus | str | bool,
        reason: str,
        message: str = "",
        observed_generation: int | None = None,
        now: datetime | None = None,
    ) -> bool:
        """Add or update a condition, like apimachinery's meta.SetStatusCondition.

        ``lastTransitionTime`` moves only when the status changes. ``status`` may be a bool. Returns whether
        anything changed (so callers can skip a no-op status patch).
        """
        if isinstance(status, bool):
            status = ConditionStatus.TRUE if status else ConditionStatus.FALSE
        status = ConditionStatus(status)
        existing = self.get_condition(type)
        if existing is None:
            self.conditions = [*(self.conditions or ()), Condition(
                type=type, status=status, reason=reason, message=message,
                last_transition_time=now or utc_now(), observed_generation=observed_generation,
            )]  # fmt: skip
            return True
        before = existing.model_dump()
        if existing.status != status:
            existing.status = status
            existing.last_transition_time = now or utc_now()
        existing.reason, existing.message, existing.observed_generation = reason, message, observed_generation
        return existing.model_dump() != before

    def remove_condition(self, type: str) -> bool:
        before = len(self.conditions or ())
        self.conditions = [c for c in self.conditions or () if c.type != type] or None
        return len(self.conditions or ()) != before


def ready_text(ready: int, desired: int) -> str:
    """The READY column: ``"1/2"``."""
    return f"{ready}/{desired}"
