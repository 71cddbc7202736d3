"""The status of an LLMDeployment, computed from its children: pure functions, no API calls.

:func:`observe` turns what the operator read (the Deployment, the HorizontalPodAutoscaler, the pods) and the
status it wrote last time into the new status and the Events to post, one function per condition.
:func:`invalid_spec_status` does the same for a spec the operator rejected, :func:`reconcile_failed_status`
for an object even observing failed on; all three report a failure through :func:`fail_conditions`. Nothing here talks to Kubernetes or reads the clock unless ``now`` is
left out, so every rule below is tested with plain dicts (tests/operator/test_status.py).

Conditions (``lastTransitionTime`` moves only when a condition's status changes, see
:meth:`LLMDeploymentStatus.set_condition`):

* **Ready**: True when at least one pod is ready and either no rollout is in progress or the rollout keeps
  ``availableReplicas >= desired`` (a rollout with ``maxUnavailable: 0`` stays Ready). Reasons: ``Available``
  (True, no rollout), ``Rolling`` (True while a rollout keeps full capacity, False while it runs below it),
  ``NoReadyReplicas`` (no pod ready, or no Deployment yet), ``ScaledToZero`` (True: desired replicas 0),
  ``InvalidSpec`` and ``ReconcileFailed`` (the spec could not be applied: whatever still runs is the old one).
* **Progressing**: True while a rollout (``Rolling``) or a scale (``Scaling``: pods not yet available) is
  under way, or before the Deployment exists (``Creating``); False with ``Complete`` when every pod runs the
  current template and is available, ``ProgressDeadlineExceeded`` when the Deployment gave up, or
  ``InvalidSpec``/``ReconcileFailed``. With the rollout guard's verdict (:mod:`.rollout_guard`): False with
  ``RolloutBlockedNoSpareGPU`` when a new pod has waited past ``rollout.surgeTimeoutSeconds`` for a GPU, True
  with ``ReplacingInPlace`` while that rollout replaces pods in place. A rollout starts when a new ``metadata.generation`` is observed whose
  change touched the pod template (``template_changed``; a replicas-only change is a scale, not a rollout)
  and ends when the Deployment reports every pod updated and available, as ``kubectl rollout status`` does.
* **Degraded**: True when something needs a human: a container waiting in ImagePullBackOff, ErrImagePull,
  CrashLoopBackOff, CreateContainerConfigError, CreateContainerError or InvalidImageName; a container
  OOMKilled recently; a started container failing its readiness probe for longer than
  :func:`readiness_grace_seconds`; an unschedulable pod; the Deployment's ProgressDeadlineExceeded or
  ReplicaFailure; or an invalid spec / failed reconcile. The reason is the most severe problem's; the message
  names the pod and the container.
* **ModelLoaded**: True when at least one live pod passed its startup probe (every container ``started``);
  False with ``ModelLoading`` while none has, with the Degraded reason when a pod problem is why, or
  ``ScaledToZero``.
* **ScalingActive**: from the HPA's AbleToScale / ScalingActive / ScalingLimited conditions (KEDA's HPA too);
  False with ``AutoscalingDisabled`` when spec.autoscaling is off. ``status.autoscaling.blockedReason`` says
  why the autoscaler cannot act.
* **Draining**: True while terminating pods (``deletionTimestamp`` set) finish their in-flight requests.
* **Stalled** and **Reconciling**, kstatus's abnormal-true pair (Flux health checks, kpt), derived from the
  conditions above by :func:`set_kstatus_conditions` on every status write: Stalled is True when Degraded (or
  Progressing) names a problem in :data:`STALLING_REASONS`, one that stays until something changes; Reconciling
  is True otherwise while anything is under way or wrong (a failed reconcile being retried, a rollout or scale,
  an unschedulable pod, pods loading). Both False: the object is settled.

Fields: ``replicas``/``readyReplicas``/``updatedReplicas`` from the Deployment's status; ``readyText`` is
ready/desired, desired being the Deployment's spec.replicas (the HPA's desiredReplicas, then spec.replicas,
when the Deployment has none); ``selector`` the Deployment's matchLabels (render's selector before it
exists); ``endpoint`` ``http://<service>.<namespace>.svc:<port>/v1``; ``observedGeneration`` the generation
the status describes, written by every path (observe, invalid spec, failed reconcile), so a waiter never reads a
status written for an older spec as an answer about this one.

Events: ``RolloutStarted`` / ``RolloutComplete``, ``RolloutBlockedNoSpareGPU`` (Warning) / ``RolloutReplacingInPlace``
(once, when Progressing turns to those reasons), ``ScaledUp`` / ``ScaledDown`` (the HPA's desired replicas
changed since the last status), ``ModelLoaded``, and Warnings when Degraded turns True or changes reason
(the reason is the problem's, e.g. ``ImagePullBackOff``), when autoscaling becomes blocked
(``AutoscalingBlocked``), for ``InvalidSpec`` and ``ReconcileFailed``; ``ScaledToZero`` once when a deployment
with minReplicas 0 reaches zero (:mod:`.activation`; the activator posts ``Activated`` when it wakes one).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, NamedTuple

from pydantic import ValidationError

from kubellm.operator import render
from kubellm.operator.api import (
    QUEUE_DEPTH_METRIC,
    AutoscalingStatus,
    ConditionStatus,
    ConditionType,
    LLMDeployment,
    LLMDeploymentStatus,
    parse_quantity,
    parse_time,
    ready_text,
    utc_now,
)
from kubellm.operator.render import activation, naming
from kubellm.operator.render import autoscaling as autoscaling_mod
from kubellm.operator.render import deployment as deployment_mod
from kubellm.operator.status import rollout_guard

LLMDEPLOYMENT_LABEL = naming.LABEL_LLMDEPLOYMENT  # kubellm.io/llmdeployment on every child and pod
# The queue-depth metric as the HPA names it: through prometheus-adapter (render's HPA), or the raw gauge.
QUEUE_DEPTH_METRIC_NAMES = (autoscaling_mod.HPA_METRIC_NAME, QUEUE_DEPTH_METRIC)

# Waiting reasons that do not fix themselves, most severe first (the first one found names Degraded).
DEGRADING_WAITING_REASONS = (
    "CreateContainerConfigError",
    "InvalidImageName",
    "ImagePullBackOff",
    "ErrImagePull",
    "CrashLoopBackOff",
    "CreateContainerError",
)
OOM_RECENT_SECONDS = 600  # an OOMKilled lastState older than this, on a ready container, is history
_SEVERITY = (
    "InvalidSpec",
    "ReconcileFailed",
    *DEGRADING_WAITING_REASONS,
    "OOMKilled",
    "ProgressDeadlineExceeded",
    "ReplicaFailure",
    "Unschedulable",
    "ReadinessProbeFailing",
)
_MAX_PROBLEMS_IN_MESSAGE = 5

_CONDITION_ORDER = (
    ConditionType.READY,
    ConditionType.PROGRESSING,
    ConditionType.DEGRADED,
    ConditionType.MODEL_LOADED,
    ConditionType.SCALING_ACTIVE,
    ConditionType.DRAINING,
    ConditionType.RECONCILING,
    ConditionType.STALLED,
)
# Degraded reasons that stay until someone changes the spec or the cluster: kstatus's Stalled (Flux and kpt report
# Failed at once instead of waiting out their timeout). Unschedulable and ReadinessProbeFailing can heal by
# themselves (a node is added, a backend comes back) and a failed reconcile is retried with backoff: those keep
# the object Reconciling.
# A rollout blocked for want of a spare GPU with onNoSpareGPU Wait is Stalled too: it may end by itself when a GPU
# frees up, but nothing the operator does will end it, and a GitOps wait should fail rather than time out.
STALLING_REASONS = frozenset(
    {"InvalidSpec", *DEGRADING_WAITING_REASONS, "OOMKilled", "ProgressDeadlineExceeded", "ReplicaFailure",
     "RolloutBlockedNoSpareGPU"}
)  # fmt: skip
# Progressing reasons of a rollout under way (remembered between observations, see _was_rolling).
ROLLING_REASONS = frozenset({"Rolling", "Creating", "RolloutBlockedNoSpareGPU", "ReplacingInPlace"})


class Event(NamedTuple):
    """A Kubernetes Event to post on the LLMDeployment."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class Problem:
    """Something that makes the deployment Degraded."""

    reason: str
    message: str


# --------------------------------------------------------------------------------------------------
# The spec, and the message an invalid one gets
# --------------------------------------------------------------------------------------------------


def parse(body: Mapping[str, Any]) -> LLMDeployment:
    """The LLMDeployment in ``body`` (its status is left out: only the spec can make it invalid)."""
    return LLMDeployment.model_validate({k: v for k, v in body.items() if k != "status"})


def describe_invalid(error: Exception) -> str:
    """A one-line InvalidSpec message for ``error`` (pydantic errors as ``path: message``)."""
    if isinstance(error, ValidationError):
        parts = []
        for err in error.errors():
            loc = ".".join(str(p) for p in err.get("loc", ()))
            msg = str(err.get("msg", "")).removeprefix("Value error, ")
            parts.append(f"{loc}: {msg}" if loc else msg)
        return "; ".join(parts) or str(error)
    return str(error)


# --------------------------------------------------------------------------------------------------
# Small helpers over raw Kubernetes dicts
# --------------------------------------------------------------------------------------------------


def _get(obj: Mapping[str, Any] | None, *path: str, default: Any = None) -> Any:
    for key in path:
        if not isinstance(obj, Mapping) or key not in obj:
            return default
        obj = obj[key]
    return default if obj is None else obj


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def quantity_to_float(value: Any) -> float | None:
    """A Kubernetes quantity (``"1500m"``, ``"2"``, ``3``) as a float; None if absent or unparsable."""
    if value is None:
        return None
    try:
        return float(parse_quantity(value if isinstance(value, int) else str(value)))
    except (TypeError, ValueError):
        return None


def _condition(obj: Mapping[str, Any] | None, type_: str) -> Mapping[str, Any] | None:
    for c in _get(obj, "status", "conditions", default=[]) or []:
        if isinstance(c, Mapping) and c.get("type") == type_:
            return c
    return None


def _generation(metadata: Mapping[str, Any] | None) -> int | None:
    value = _get(metadata, "generation")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _as_status(previous: LLMDeploymentStatus | Mapping[str, Any] | None) -> LLMDeploymentStatus:
    if previous is None:
        return LLMDeploymentStatus()
    if isinstance(previous, LLMDeploymentStatus):
        return previous.model_copy(deep=True)
    try:
        return LLMDeploymentStatus.model_validate(dict(previous))
    except ValueError:  # a status we cannot read (hand-edited): start afresh rather than fail
        return LLMDeploymentStatus()


def _fmt(value: float | None) -> str:
    return "unknown" if value is None else f"{value:g}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def readiness_grace_seconds(ld: LLMDeployment) -> int:
    """How long a started container may fail its readiness probe before the deployment is Degraded:
    three probe periods plus three timeouts (75 s with the defaults), at least 60 s."""
    probes = ld.spec.probes
    return max(60, 3 * (probes.readiness_period_seconds + probes.readiness_timeout_seconds))


def label_selector(deployment: Mapping[str, Any] | None, ld: LLMDeployment) -> str:
    """The pods' label selector as a string (status.selector, the scale subresource's labelSelectorPath):
    the Deployment's matchLabels, keys sorted; before the Deployment exists, the selector render gives it."""
    match_labels = _get(deployment, "spec", "selector", "matchLabels", default={})
    if isinstance(match_labels, Mapping) and match_labels:
        return ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))
    try:
        return naming.label_selector(ld)
    except render.InvalidSpec:
        return f"{LLMDEPLOYMENT_LABEL}={ld.name}"


def endpoint(ld: LLMDeployment, service_name: str | None = None) -> str:
    """The in-cluster base URL of the OpenAI API: ``http://<service>.<namespace>.svc:<port>/v1``; the
    Service is the one render names (:func:`.naming.child_name`) unless ``service_name`` says otherwise."""
    if service_name is None:
        try:
            service_name = naming.child_name(ld)
        except render.InvalidSpec:
            service_name = ld.name
    return f"http://{service_name}.{ld.namespace or 'default'}.svc:{ld.spec.service.port}/v1"


# --------------------------------------------------------------------------------------------------
# Pods
# --------------------------------------------------------------------------------------------------


def _pod_name(pod: Mapping[str, Any]) -> str:
    return str(_get(pod, "metadata", "name", default="?"))


def is_terminating(pod: Mapping[str, Any]) -> bool:
    return bool(_get(pod, "metadata", "deletionTimestamp"))


def _container_statuses(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    init = _get(pod, "status", "initContainerStatuses", default=[]) or []
    main = _get(pod, "status", "containerStatuses", default=[]) or []
    return [c for c in (*init, *main) if isinstance(c, Mapping)]


def has_started(pod: Mapping[str, Any]) -> bool:
    """Every (main) container passed its startup probe: the runtime finished loading the model."""
    statuses = [
        c for c in _get(pod, "status", "containerStatuses", default=[]) or [] if isinstance(c, Mapping)
    ]
    return bool(statuses) and all(c.get("started") is True for c in statuses)


def pod_problems(pod: Mapping[str, Any], *, now: datetime, readiness_grace: float) -> list[Problem]:
    """What is wrong with one pod, for Degraded (an empty list for a healthy or merely starting pod)."""
    name = _pod_name(pod)
    problems: list[Problem] = []
    scheduled = _condition(pod, "PodScheduled")
    if scheduled and scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        detail = scheduled.get("message") or "no node fits it"
        problems.append(Problem("Unschedulable", f"pod {name} is unschedulable: {detail}"))
    ready_cond = _condition(pod, "Ready")
    not_ready_since = parse_time(ready_cond.get("lastTransitionTime")) if ready_cond else None
    for c in _container_statuses(pod):
        cname = c.get("name", "?")
        waiting = _get(c, "state", "waiting", default={})
        reason = waiting.get("reason") if isinstance(waiting, Mapping) else None
        if reason in DEGRADING_WAITING_REASONS:
            detail = waiting.get("message")
            text = f"pod {name}: container {cname} {reason}" + (f": {detail}" if detail else "")
            problems.append(Problem(reason, text))
            continue
        terminated_now = _get(c, "state", "terminated", default={})
        last_terminated = _get(c, "lastState", "terminated", default={})
        oom = None
        if isinstance(terminated_now, Mapping) and terminated_now.get("reason") == "OOMKilled":
            oom = terminated_now
        elif isinstance(last_terminated, Mapping) and last_terminated.get("reason") == "OOMKilled":
            finished = parse_time(last_terminated.get("finishedAt"))
            recent = finished is None or (now - finished).total_seconds() <= OOM_RECENT_SECONDS
            if recent or not c.get("ready"):
                oom = last_terminated
        if oom is not None:
            restarts = _int(c.get("restartCount"))
            text = f"pod {name}: container {cname} OOMKilled (out of memory; {_plural(restarts, 'restart')})"
            problems.append(Problem("OOMKilled", text))
            continue
        running = _get(c, "state", "running", default=None)
        if running is not None and c.get("started") is True and c.get("ready") is False:
            since = not_ready_since or parse_time(_get(running, "startedAt"))
            if since is not None and (now - since).total_seconds() > readiness_grace:
                seconds = int((now - since).total_seconds())
                text = f"pod {name}: container {cname} is running but has failed its readiness probe for {seconds}s"
                problems.append(Problem("ReadinessProbeFailing", text))
    return problems


def _summarize(problems: list[Problem]) -> Problem | None:
    if not problems:
        return None
    ranked = sorted(
        problems, key=lambda p: _SEVERITY.index(p.reason) if p.reason in _SEVERITY else len(_SEVERITY)
    )
    shown = [p.message for p in ranked[:_MAX_PROBLEMS_IN_MESSAGE]]
    if len(ranked) > _MAX_PROBLEMS_IN_MESSAGE:
        shown.append(f"and {len(ranked) - _MAX_PROBLEMS_IN_MESSAGE} more")
    return Problem(ranked[0].reason, "; ".join(shown))


# --------------------------------------------------------------------------------------------------
# Autoscaler
# --------------------------------------------------------------------------------------------------


def current_queue_depth(hpa: Mapping[str, Any] | None) -> float | None:
    """Requests waiting per pod as the HPA last measured it: the Pods metric kubellm_num_requests_waiting
    (kubellm:num_requests_waiting through prometheus-adapter; any Pods metric if it is named otherwise), else
    an External metric's average (KEDA's HPA)."""
    metrics = [m for m in _get(hpa, "status", "currentMetrics", default=[]) or [] if isinstance(m, Mapping)]
    pods = [m for m in metrics if m.get("type") == "Pods"]
    named = [m for m in pods if _get(m, "pods", "metric", "name") in QUEUE_DEPTH_METRIC_NAMES]
    for m in (*named, *pods):
        value = quantity_to_float(_get(m, "pods", "current", "averageValue"))
        if value is not None:
            return value
    for m in metrics:
        if m.get("type") == "External":
            value = quantity_to_float(_get(m, "external", "current", "averageValue"))
            if value is not None:
                return value
    return None


def _autoscaling(
    ld: LLMDeployment, hpa: Mapping[str, Any] | None
) -> tuple[AutoscalingStatus, tuple[ConditionStatus, str, str]]:
    """status.autoscaling and the ScalingActive condition (status, reason, message)."""
    auto = ld.spec.autoscaling
    kind = (
        "KEDA ScaledObject's HorizontalPodAutoscaler" if auto.backend == "keda" else "HorizontalPodAutoscaler"
    )
    out = AutoscalingStatus(target_queue_depth=auto.target_queue_depth)
    if hpa is None:
        out.blocked_reason = f"the {kind} does not exist yet"
        return out, (ConditionStatus.FALSE, "AutoscalerMissing", out.blocked_reason)
    hstatus = _get(hpa, "status", default={})
    out.current_replicas = _int(hstatus.get("currentReplicas")) if "currentReplicas" in hstatus else None
    out.desired_replicas = _int(hstatus.get("desiredReplicas")) if "desiredReplicas" in hstatus else None
    out.current_queue_depth = current_queue_depth(hpa)
    out.last_scale_time = parse_time(hstatus.get("lastScaleTime"))

    able = _condition(hpa, "AbleToScale")
    active = _condition(hpa, "ScalingActive")
    limited = _condition(hpa, "ScalingLimited")
    if able and able.get("status") == "False":
        reason = able.get("reason") or "NotAbleToScale"
        out.blocked_reason = f"{reason}: {able.get('message') or 'the autoscaler cannot scale the target'}"
        return out, (ConditionStatus.FALSE, reason, out.blocked_reason)
    if active and active.get("status") == "False":
        reason = active.get("reason") or "ScalingInactive"
        if auto.backend == "keda" and reason == "ScalingDisabled":  # KEDA's HPA at zero replicas: normal
            return out, (ConditionStatus.TRUE, "ScaledToZero", "KEDA scales up from zero when requests queue")
        out.blocked_reason = (
            f"{reason}: {active.get('message') or 'the autoscaler cannot compute a replica count'}"
        )
        return out, (ConditionStatus.FALSE, reason, out.blocked_reason)
    if active and active.get("status") == "True":
        if limited and limited.get("status") == "True":
            why = limited.get("message") or limited.get("reason") or "at the replica bounds"
            return out, (ConditionStatus.TRUE, "ScalingLimited", f"scaling on queue depth, limited: {why}")
        msg = f"scaling on queue depth {_fmt(out.current_queue_depth)} (target {auto.target_queue_depth})"
        return out, (ConditionStatus.TRUE, active.get("reason") or "ValidMetricFound", msg)
    return out, (ConditionStatus.UNKNOWN, "AutoscalerPending", f"the {kind} has not reported yet")


def _scale_events(previous: AutoscalingStatus | None, new: AutoscalingStatus) -> list[Event]:
    if previous is None:
        return []
    before = previous.desired_replicas if previous.desired_replicas is not None else previous.current_replicas
    after = new.desired_replicas if new.desired_replicas is not None else new.current_replicas
    if before is None or after is None or before == after:
        return []
    reason = "ScaledUp" if after > before else "ScaledDown"
    depth = _fmt(new.current_queue_depth)
    message = f"from {before} to {after}, queue depth {depth} (target {new.target_queue_depth})"
    return [Event("Normal", reason, message)]


# --------------------------------------------------------------------------------------------------
# observe
# --------------------------------------------------------------------------------------------------


def _set(
    status: LLMDeploymentStatus, type_: str, value: tuple, generation: int | None, now: datetime
) -> None:
    cstatus, reason, message = value
    status.set_condition(type_, cstatus, reason, message, observed_generation=generation, now=now)


def _order_conditions(status: LLMDeploymentStatus) -> None:
    order = {t.value: i for i, t in enumerate(_CONDITION_ORDER)}
    if status.conditions:
        status.conditions.sort(key=lambda c: order.get(c.type, len(order)))


def _degraded_events(previous: LLMDeploymentStatus, status: LLMDeploymentStatus) -> list[Event]:
    before, after = (
        previous.get_condition(ConditionType.DEGRADED),
        status.get_condition(ConditionType.DEGRADED),
    )
    if (
        after is None
        or after.status != ConditionStatus.TRUE
        or after.reason in ("InvalidSpec", "ReconcileFailed")
    ):
        return []  # those two post their own events
    if before is not None and before.status == ConditionStatus.TRUE and before.reason == after.reason:
        return []
    return [Event("Warning", after.reason, after.message)]


# One pure function per condition: each returns (status, reason, message).
ConditionValue = tuple[ConditionStatus, str, str]


@dataclass(frozen=True)
class Rollout:
    """What the Deployment says about the rollout, with the replica count the LLMDeployment wants."""

    exists: bool
    desired: int
    replicas: int
    ready: int
    updated: int
    available: int
    complete: bool  # every pod runs the current template and is available, as `kubectl rollout status` says
    deadline_message: str | None  # the Deployment's ProgressDeadlineExceeded message, when it gave up

    @property
    def old_pods(self) -> int:
        return max(self.replicas - self.updated, 0)


def read_rollout(
    ld: LLMDeployment, deployment: Mapping[str, Any] | None, hpa: Mapping[str, Any] | None
) -> Rollout:
    """Counts and completion from the Deployment; desired replicas from its spec, else the HPA (render leaves
    replicas to the autoscaler), else the LLMDeployment's spec."""
    dstatus = _get(deployment, "status", default={})
    spec_replicas = _get(deployment, "spec", "replicas")
    hpa_desired = _get(hpa, "status", "desiredReplicas")
    if deployment is not None and spec_replicas is not None:
        desired = _int(spec_replicas)
    elif ld.spec.autoscaling.enabled and hpa_desired is not None:
        desired = _int(hpa_desired)
    else:
        desired = ld.spec.replicas
    replicas, ready = _int(dstatus.get("replicas")), _int(dstatus.get("readyReplicas"))
    updated, available = _int(dstatus.get("updatedReplicas")), _int(dstatus.get("availableReplicas"))
    d_generation = _generation(_get(deployment, "metadata", default={}))
    d_observed = dstatus.get("observedGeneration")
    caught_up = d_generation is None or (isinstance(d_observed, int) and d_observed >= d_generation)
    complete = (
        deployment is not None and caught_up and updated >= desired and replicas <= updated and available >= updated
    )
    progressing = _condition(deployment, "Progressing")
    exceeded = bool(
        progressing and progressing.get("status") == "False" and progressing.get("reason") == "ProgressDeadlineExceeded"
    )
    return Rollout(
        exists=deployment is not None, desired=desired, replicas=replicas, ready=ready, updated=updated,
        available=available, complete=complete,
        deadline_message=(progressing.get("message") or "") if exceeded and progressing else None,
    )  # fmt: skip


def _was_rolling(previous: LLMDeploymentStatus) -> bool:
    """The Progressing condition remembers a rollout between observations (a blocked one is False)."""
    c = previous.get_condition(ConditionType.PROGRESSING)
    return c is not None and c.reason in ROLLING_REASONS and (
        c.status == ConditionStatus.TRUE or c.reason == "RolloutBlockedNoSpareGPU"
    )


def rollout_events(ld: LLMDeployment, rollout: Rollout, *, starting: bool, was_rolling: bool) -> list[Event]:
    generation, uri = _generation(ld.metadata), ld.spec.model.uri
    if starting:
        message = f"rolling out generation {generation}: {_plural(rollout.desired, 'replica')} of {uri}"
        return [Event("Normal", "RolloutStarted", message)]
    if was_rolling and rollout.complete:
        message = f"generation {generation}: {_plural(rollout.desired, 'replica')} updated and available"
        return [Event("Normal", "RolloutComplete", message)]
    return []


def degrading_problem(
    ld: LLMDeployment, deployment: Mapping[str, Any] | None, live: list[Mapping[str, Any]], now: datetime
) -> Problem | None:
    """The most severe problem of the pods and the Deployment (its message lists several), or None."""
    grace = readiness_grace_seconds(ld)
    problems = [p for pod in sorted(live, key=_pod_name) for p in pod_problems(pod, now=now, readiness_grace=grace)]
    progressing = _condition(deployment, "Progressing")
    if progressing and progressing.get("status") == "False" and progressing.get("reason") == "ProgressDeadlineExceeded":
        detail = progressing.get("message") or "progress deadline exceeded"
        problems.append(Problem("ProgressDeadlineExceeded", f"Deployment: {detail}"))
    replica_failure = _condition(deployment, "ReplicaFailure")
    if replica_failure and replica_failure.get("status") == "True":
        detail = replica_failure.get("message") or replica_failure.get("reason")
        problems.append(Problem("ReplicaFailure", f"Deployment: {detail}"))
    return _summarize(problems)


def progressing_condition(rollout: Rollout, rolling: bool) -> ConditionValue:
    if not rollout.exists:
        return ConditionStatus.TRUE, "Creating", "waiting for the Deployment to be created"
    if rollout.deadline_message is not None:
        return ConditionStatus.FALSE, "ProgressDeadlineExceeded", rollout.deadline_message
    if rolling:
        message = f"{rollout.updated}/{rollout.desired} pods updated, {rollout.available} available"
        if rollout.old_pods:
            message += f", {_plural(rollout.old_pods, 'old pod')} left"
        return ConditionStatus.TRUE, "Rolling", message
    if not rollout.complete:
        return ConditionStatus.TRUE, "Scaling", f"{rollout.available}/{rollout.desired} pods available"
    return ConditionStatus.FALSE, "Complete", f"{_plural(rollout.desired, 'pod')} up to date and available"


def guarded_progressing(ld: LLMDeployment, rollout: Rollout, verdict: rollout_guard.Verdict) -> ConditionValue | None:
    """Progressing while the rollout guard has something to say: replacing pods in place (True,
    ReplacingInPlace) or blocked for want of a spare GPU (False, RolloutBlockedNoSpareGPU); else None."""
    if not rollout.exists or rollout.complete:
        return None
    # A time, not a duration: the message stays the same between observations (no status write each time).
    since = verdict.since.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if verdict.since else "now"
    waited = f"pod {verdict.pod} of the new revision has waited for {verdict.resource} since {since}"
    if verdict.replace_in_place is not None:
        strategy = deployment_mod.in_place_strategy(ld.spec.rollout)
        message = (
            f"no spare {verdict.resource} for a surge pod: replacing pods in place (maxSurge 0, maxUnavailable "
            f"{strategy['maxUnavailable']}) until the rollout completes; {rollout.updated}/{rollout.desired} "
            f"pods updated, {rollout.available} available"
        )
        return ConditionStatus.TRUE, "ReplacingInPlace", message + (f"; {waited}: {verdict.message}" if verdict.pod else "")
    if verdict.blocked:
        message = (
            f"{waited}: {verdict.message}; free a GPU, add a node, or set rollout.onNoSpareGPU: ReplaceInPlace"
        )
        return ConditionStatus.FALSE, "RolloutBlockedNoSpareGPU", message
    return None


def guard_events(previous: LLMDeploymentStatus, progressing: ConditionValue) -> list[Event]:
    """A Warning when a rollout becomes blocked and a Normal Event when it starts replacing in place: on the
    change of Progressing's reason, so once per rollout rather than once per observation."""
    before = previous.get_condition(ConditionType.PROGRESSING)
    before_reason = before.reason if before is not None else None
    _, reason, message = progressing
    events = []
    if reason in ("RolloutBlockedNoSpareGPU", "ReplacingInPlace") and before_reason not in (
        "RolloutBlockedNoSpareGPU", "ReplacingInPlace"
    ):
        events.append(Event("Warning", "RolloutBlockedNoSpareGPU", message))
    if reason == "ReplacingInPlace" and before_reason != "ReplacingInPlace":
        events.append(Event("Normal", "RolloutReplacingInPlace", message))
    return events


def ready_condition(rollout: Rollout, rolling: bool, problem: Problem | None) -> ConditionValue:
    desired, ready = rollout.desired, rollout.ready
    if not rollout.exists:
        return ConditionStatus.FALSE, "NoReadyReplicas", "the Deployment does not exist yet"
    if desired == 0:  # True: zero pods is the state asked for (kstatus reads a False Ready as "in progress")
        return ConditionStatus.TRUE, "ScaledToZero", "scaled to zero replicas"
    if ready == 0:
        why = f": {problem.message}" if problem else ""
        return ConditionStatus.FALSE, "NoReadyReplicas", f"0/{desired} replicas ready{why}"
    if rolling and rollout.available < desired:
        message = f"rollout in progress with {rollout.available}/{desired} replicas available"
        return ConditionStatus.FALSE, "Rolling", message
    if rolling:
        return ConditionStatus.TRUE, "Rolling", f"{ready}/{desired} replicas ready, rollout in progress"
    return ConditionStatus.TRUE, "Available", f"{ready}/{desired} replicas ready"


def degraded_condition(problem: Problem | None) -> ConditionValue:
    if problem is None:
        return ConditionStatus.FALSE, "Healthy", ""
    return ConditionStatus.TRUE, problem.reason, problem.message


def model_loaded_condition(
    ld: LLMDeployment, live: list[Mapping[str, Any]], desired: int, problem: Problem | None
) -> ConditionValue:
    loaded = [p for p in live if has_started(p)]
    if loaded:
        return ConditionStatus.TRUE, "Loaded", f"{len(loaded)}/{len(live)} pods have the model loaded"
    if desired == 0 and not live:
        return ConditionStatus.FALSE, "ScaledToZero", "no pods"
    if problem and problem.reason not in ("ProgressDeadlineExceeded", "ReplicaFailure"):
        return ConditionStatus.FALSE, problem.reason, problem.message
    if live:
        return ConditionStatus.FALSE, "ModelLoading", f"{_plural(len(live), 'pod')} loading {ld.spec.model.uri}"
    return ConditionStatus.FALSE, "ModelLoading", "waiting for pods to be created"


def draining_condition(ld: LLMDeployment, terminating: list[Mapping[str, Any]]) -> ConditionValue:
    if not terminating:
        return ConditionStatus.FALSE, "NoTerminatingPods", ""
    names = ", ".join(sorted(_pod_name(p) for p in terminating))
    message = (
        f"{_plural(len(terminating), 'pod')} finishing in-flight requests "
        f"(up to {ld.spec.rollout.drain_timeout_seconds}s): {names}"
    )
    return ConditionStatus.TRUE, "PodsTerminating", message


def scaling(
    ld: LLMDeployment, hpa: Mapping[str, Any] | None, previous: AutoscalingStatus | None
) -> tuple[AutoscalingStatus | None, ConditionValue, list[Event]]:
    """status.autoscaling, the ScalingActive condition and the scale Events."""
    if not ld.spec.autoscaling.enabled:
        return None, (ConditionStatus.FALSE, "AutoscalingDisabled", "spec.autoscaling.enabled is false"), []
    autoscaling, condition = _autoscaling(ld, hpa)
    events = _scale_events(previous, autoscaling)
    prev_blocked = previous.blocked_reason if previous else None
    if autoscaling.blocked_reason and hpa is not None and autoscaling.blocked_reason != prev_blocked:
        events.append(Event("Warning", "AutoscalingBlocked", autoscaling.blocked_reason))
    return autoscaling, condition, events


def stalled_condition(status: LLMDeploymentStatus) -> ConditionValue:
    """kstatus's Stalled: True when Degraded (or Progressing) names a problem in :data:`STALLING_REASONS`."""
    for type_, bad in ((ConditionType.DEGRADED, ConditionStatus.TRUE), (ConditionType.PROGRESSING, ConditionStatus.FALSE)):
        c = status.get_condition(type_)
        if c is not None and c.status == bad and c.reason in STALLING_REASONS:
            return ConditionStatus.TRUE, c.reason, c.message
    return ConditionStatus.FALSE, "NotStalled", ""


def reconciling_condition(status: LLMDeploymentStatus, stalled: bool) -> ConditionValue:
    """kstatus's Reconciling: True while the operator is still getting to the spec (a failed reconcile being
    retried, a rollout or scale, a problem that may heal, pods loading); False once Stalled or done."""
    if stalled:
        return ConditionStatus.FALSE, "Stalled", "no progress without a change; see the Stalled condition"
    ready, progressing, degraded = (
        status.get_condition(t) for t in (ConditionType.READY, ConditionType.PROGRESSING, ConditionType.DEGRADED)
    )
    if ready is not None and ready.reason == "ReconcileFailed":
        return ConditionStatus.TRUE, "ReconcileFailed", f"retrying: {ready.message}"
    for c, busy in ((progressing, ConditionStatus.TRUE), (degraded, ConditionStatus.TRUE), (ready, ConditionStatus.FALSE)):
        if c is not None and c.status == busy:
            return ConditionStatus.TRUE, c.reason, c.message
    return ConditionStatus.FALSE, "Reconciled", ""


def set_kstatus_conditions(status: LLMDeploymentStatus, generation: int | None, now: datetime) -> None:
    """Reconciling and Stalled from the other conditions, so Flux, kpt and kstatus-based tools read the same
    answer as the conditions above (exactly one of the two is True unless the object is settled)."""
    stalled = stalled_condition(status)
    _set(status, ConditionType.STALLED, stalled, generation, now)
    _set(status, ConditionType.RECONCILING, reconciling_condition(status, stalled[0] == ConditionStatus.TRUE),
         generation, now)  # fmt: skip
    _order_conditions(status)


def fail_conditions(
    status: LLMDeploymentStatus,
    previous: LLMDeploymentStatus,
    reason: str,
    message: str,
    generation: int | None,
    now: datetime,
    *,
    progressing: str | None = None,
    once_per_generation: bool = False,
) -> list[Event]:
    """Ready=False and Degraded=True with ``reason`` (and Progressing=False when ``progressing`` gives its
    message); the Warning Event unless the previous status already reported this message (for this
    generation, with ``once_per_generation``)."""
    before = previous.get_condition(ConditionType.READY)
    already = before is not None and before.reason == reason and before.message == message
    if once_per_generation:
        already = already and previous.observed_generation == generation
    _set(status, ConditionType.READY, (ConditionStatus.FALSE, reason, message), generation, now)
    if progressing is not None:
        _set(status, ConditionType.PROGRESSING, (ConditionStatus.FALSE, reason, progressing), generation, now)
    _set(status, ConditionType.DEGRADED, (ConditionStatus.TRUE, reason, message), generation, now)
    _order_conditions(status)
    return [] if already else [Event("Warning", reason, message)]


def observe(
    ld: LLMDeployment,
    deployment: Mapping[str, Any] | None,
    hpa: Mapping[str, Any] | None,
    pods: Iterable[Mapping[str, Any]],
    previous_status: LLMDeploymentStatus | Mapping[str, Any] | None,
    *,
    now: datetime | None = None,
    template_changed: bool | None = None,
    reconcile_error: str | None = None,
    service_name: str | None = None,
    guard: rollout_guard.Verdict | None = None,
    routing: activation.Routing | None = None,
) -> tuple[LLMDeploymentStatus, list[Event]]:
    """The new status of ``ld`` and the Events to post, from its children and the status written last time.

    ``deployment`` and ``hpa`` are the owned children as the API returns them (None when absent; ``hpa`` is
    KEDA's HPA for backend keda), ``pods`` the pods the Deployment selects (terminating ones included).
    ``template_changed`` says whether the change that produced the current generation changed the pod
    template (None: unknown, assume it did); False makes a new generation a scale, not a rollout.
    ``reconcile_error`` is the message of the last failed attempt to apply the children (Ready and Progressing
    False, Degraded True, reason ReconcileFailed). ``service_name`` defaults to the LLMDeployment's name.
    ``guard`` is :func:`.rollout_guard.decide`'s verdict on the rollout (blocked for want of a GPU, replacing in
    place), which then names Progressing.
    ``routing``: where the Service sends requests now (:func:`.activation.routing`), for a deployment that
    scales to zero (status.autoscaling.activation; scaledToZeroSince and the ScaledToZero Event need none).
    """
    now = now or utc_now()
    previous = _as_status(previous_status)
    status = previous.model_copy(deep=True)
    generation = _generation(ld.metadata)
    pods = [p for p in pods if isinstance(p, Mapping)]
    live = [p for p in pods if not is_terminating(p)]
    terminating = [p for p in pods if is_terminating(p)]

    rollout = read_rollout(ld, deployment, hpa)
    was_rolling = _was_rolling(previous)
    # A failed reconcile records its generation too (observedGeneration, for kstatus); Progressing=ReconcileFailed
    # remembers that the rollout of that generation is still to be announced.
    unannounced = (c := previous.get_condition(ConditionType.PROGRESSING)) is not None and c.reason == "ReconcileFailed"
    new_generation = generation is not None and (generation != previous.observed_generation or unannounced)
    starting = new_generation and template_changed is not False and reconcile_error is None
    stalled = rollout.deadline_message is not None
    rolling = starting or (not rollout.complete and not stalled and (was_rolling or rollout.replicas > rollout.updated))
    events = [] if reconcile_error is not None else rollout_events(ld, rollout, starting=starting, was_rolling=was_rolling)

    problem = degrading_problem(ld, deployment, live, now)
    status.autoscaling, scaling_active, scale_events = scaling(ld, hpa, previous.autoscaling)
    events += scale_events
    progressing = progressing_condition(rollout, rolling)
    # The guard's reason is more specific than the Deployment's ProgressDeadlineExceeded, so it names Progressing
    # then too (Degraded and Stalled still say the deadline passed).
    under_way = rolling or rollout.deadline_message is not None
    if guard is not None and under_way and (guarded := guarded_progressing(ld, rollout, guard)) is not None:
        progressing = guarded
        if reconcile_error is None:
            events += guard_events(previous, progressing)
    if status.autoscaling is not None and naming.scales_to_zero(ld):
        events += [Event(*e) for e in activation.scale_to_zero_status(
            status.autoscaling, previous.autoscaling, rollout.desired, routing,
            idle_seconds=autoscaling_mod.idle_seconds(ld), now=now)]  # fmt: skip
    conditions = {
        ConditionType.READY: ready_condition(rollout, rolling, problem),
        ConditionType.PROGRESSING: progressing,
        ConditionType.DEGRADED: degraded_condition(problem),
        ConditionType.MODEL_LOADED: model_loaded_condition(ld, live, rollout.desired, problem),
        ConditionType.SCALING_ACTIVE: scaling_active,
        ConditionType.DRAINING: draining_condition(ld, terminating),
    }
    failed = (ConditionType.READY, ConditionType.PROGRESSING, ConditionType.DEGRADED) if reconcile_error is not None else ()
    for type_, value in conditions.items():
        if type_ not in failed:
            _set(status, type_, value, generation, now)
    if reconcile_error is not None:
        events += fail_conditions(
            status, previous, "ReconcileFailed", reconcile_error, generation, now, progressing=reconcile_error
        )
    set_kstatus_conditions(status, generation, now)

    loaded_before = previous.get_condition(ConditionType.MODEL_LOADED)
    if conditions[ConditionType.MODEL_LOADED][0] == ConditionStatus.TRUE and (
        loaded_before is None or loaded_before.status != ConditionStatus.TRUE
    ):
        events.append(Event("Normal", "ModelLoaded", f"{ld.spec.model.uri} is loaded and serving"))
    events.extend(_degraded_events(previous, status))

    if generation is not None:
        status.observed_generation = generation
    status.replicas, status.ready_replicas, status.updated_replicas = rollout.replicas, rollout.ready, rollout.updated
    status.ready_text = ready_text(rollout.ready, rollout.desired)
    status.selector = label_selector(deployment, ld)
    status.endpoint = endpoint(ld, service_name)
    return status, events


def _metadata_generation(ld: LLMDeployment | Mapping[str, Any]) -> int | None:
    return _generation(ld.metadata if isinstance(ld, LLMDeployment) else _get(ld, "metadata", default={}))


def invalid_spec_status(
    ld: LLMDeployment | Mapping[str, Any],
    message: str,
    previous: LLMDeploymentStatus | Mapping[str, Any] | None,
    *,
    now: datetime | None = None,
) -> tuple[LLMDeploymentStatus, list[Event]]:
    """The status of an LLMDeployment whose spec the operator rejected (its children are left as they were).

    ``ld`` may be the raw object (a spec that does not parse has no model). Ready and Progressing become False
    and Degraded True, all with reason InvalidSpec; the other conditions and counts keep their last values.
    A Warning Event InvalidSpec comes with it unless this generation was already reported with this message.
    """
    generation, now = _metadata_generation(ld), now or utc_now()
    prev = _as_status(previous)
    status = prev.model_copy(deep=True)
    events = fail_conditions(
        status, prev, "InvalidSpec", message, generation, now,
        progressing="the spec was rejected; nothing was changed", once_per_generation=True,
    )  # fmt: skip
    set_kstatus_conditions(status, generation, now)
    if generation is not None:
        status.observed_generation = generation
    return status, events


def reconcile_failed_status(
    ld: LLMDeployment | Mapping[str, Any],
    message: str,
    previous: LLMDeploymentStatus | Mapping[str, Any] | None,
    *,
    now: datetime | None = None,
) -> tuple[LLMDeploymentStatus, list[Event]]:
    """Ready=False and Degraded=True, reason ReconcileFailed, when even observing failed (a bug or an unreadable
    object); the rest of the status is kept. A Warning Event unless this message was already reported."""
    prev = _as_status(previous)
    status = prev.model_copy(deep=True)
    generation, now = _metadata_generation(ld), now or utc_now()
    events = fail_conditions(status, prev, "ReconcileFailed", message, generation, now)
    set_kstatus_conditions(status, generation, now)
    if generation is not None:
        status.observed_generation = generation
    return status, events
