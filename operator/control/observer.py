"""The status writes of the operator, each made under the LLMDeployment's lock (:class:`.tracking.Tracked`).

:func:`observe_once` is one pass of the observer daemon: read the LLMDeployment afresh, observe it only when
its reconcile allows (:meth:`.tracking.Tracked.due`), read its children, compute the status
(:func:`.observe.observe`, or :func:`.observe.invalid_spec_status`), patch the status subresource when it changed
and post the Events; on the way :func:`observe_inference_pool` copies what the gateways say about the
InferencePool (:mod:`.gateway`) and :func:`guard_rollout` judges a rollout waiting for a GPU and steers the
Deployment's strategy (:mod:`.rollout_guard`). :func:`report_invalid` and :func:`report_failure` write the InvalidSpec and
ReconcileFailed statuses the same way. An object being deleted is left alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import kopf
from pydantic import ValidationError

from kubellm.operator import api, render
from kubellm.operator.control import metrics
from kubellm.operator.control.children import (
    LABEL,
    check_not_foreign,
    read_children,
    read_inference_pool,
    read_replicasets,
)
from kubellm.operator.control.kube import Kube, merge_patch_diff, owned_by
from kubellm.operator.control.tracking import Key, OperatorState, key_of
from kubellm.operator.render import activation, naming
from kubellm.operator.render import deployment as deployment_mod
from kubellm.operator.status import gateway, rollout_guard
from kubellm.operator.status import observe as status_mod

logger = logging.getLogger(__name__)

MAX_EVENT_MESSAGE = 1024


def post(body: Mapping[str, Any], events: list[status_mod.Event]) -> None:
    """Post ``events`` about ``body`` through kopf (which batches them with its own)."""
    for ev in events:
        kopf.event(body, type=ev.type, reason=ev.reason, message=ev.message[:MAX_EVENT_MESSAGE])


async def write_status(
    kube: Kube, body: Mapping[str, Any], new: api.LLMDeploymentStatus, events: list[status_mod.Event]
) -> bool:
    """Patch the status subresource if ``new`` differs from the body's status; then post ``events``."""
    try:
        before = api.LLMDeploymentStatus.model_validate(body.get("status") or {}).to_k8s()
    except ValidationError:
        before = dict(body.get("status") or {})
    after = new.to_k8s()
    changed = before != after
    if changed:
        patch = {"status": merge_patch_diff(before, after)}
        await kube.patch_status(api.API_VERSION, api.KIND, *key_of(body), patch)
    post(body, events)
    return changed


async def fresh(kube: Kube, key: Key) -> dict[str, Any] | None:
    """The LLMDeployment as the server has it now; None when it is gone or being deleted."""
    body = await kube.get(api.API_VERSION, api.KIND, *key)
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        return None
    return body


async def observe_once(state: OperatorState, key: Key) -> bool:
    """One observation of one LLMDeployment; returns whether the status changed."""
    tracked = state.track(key)
    async with tracked.lock:
        body = await fresh(state.kube, key)
        if body is None:
            return False
        due, rec = tracked.due(body["metadata"].get("generation"), time.monotonic(), 2 * state.observe_interval)
        if not due:
            return False
        previous = body.get("status")
        if rec is not None and rec.invalid is not None:
            new, events = status_mod.invalid_spec_status(body, rec.invalid, previous)
        else:
            try:
                ld = status_mod.parse(body)
            except ValidationError as e:
                new, events = status_mod.invalid_spec_status(body, status_mod.describe_invalid(e), previous)
            else:
                deployment, hpa, pods = await read_children(state.kube, ld)
                now = api.utc_now()
                guard = await guard_rollout(state, ld, deployment, pods, now, steer=rec is not None and rec.error is None)
                routing = await route(state, ld, deployment, previous)
                new, events = status_mod.observe(
                    ld, deployment, hpa, pods, previous, now=now,
                    template_changed=rec.template_changed if rec else None,
                    reconcile_error=rec.error if rec else None, guard=guard, routing=routing,
                )  # fmt: skip
                events += await observe_inference_pool(state.kube, ld, new, previous)
        return await write_status(state.kube, body, new, events)


async def observe_inference_pool(
    kube: Kube, ld: api.LLMDeployment, new: api.LLMDeploymentStatus, previous: Mapping[str, Any] | None
) -> list[status_mod.Event]:
    """Fill ``new.inferencePool`` from the owned pool (left out when the spec asks for none); the Events of
    gateways that newly take or refuse it."""
    if not ld.spec.gateway.inference_pool.enabled:
        new.inference_pool = None
        return []
    new.inference_pool = gateway.pool_status(await read_inference_pool(kube, ld))
    try:
        before = api.LLMDeploymentStatus.model_validate(previous or {}).inference_pool
    except ValidationError:
        before = None
    return gateway.pool_events(before, new.inference_pool)


async def guard_rollout(
    state: OperatorState,
    ld: api.LLMDeployment,
    deployment: dict[str, Any] | None,
    pods: list[dict[str, Any]],
    now: datetime,
    *,
    steer: bool,
) -> rollout_guard.Verdict | None:
    """The rollout guard's verdict on the Deployment's rollout; with ``steer``, the Deployment is applied again
    when its strategy must follow the verdict (switched to replacing in place, or restored). The observer re-reads
    every OBSERVE_INTERVAL, so surgeTimeoutSeconds passing is noticed without any watch event."""
    if naming.is_multi_node(ld):  # it reads a Deployment's ReplicaSets; a LeaderWorkerSet rolls out groups
        metrics.note_rollout_blocked((ld.namespace or "default", ld.name or ""), False)
        return None
    if deployment is None or ld.spec.gpu_count == 0 or rollout_guard.rollout_complete(deployment):
        replicasets = []  # nothing to guard: spare the API server the list
    else:
        replicasets = await read_replicasets(state.kube, deployment)
    verdict = rollout_guard.decide(ld.spec, deployment, replicasets, pods, now)
    metrics.note_rollout_blocked((ld.namespace or "default", ld.name or ""), verdict.blocked)
    if steer and rollout_guard.needs_apply(ld.spec.rollout, deployment, verdict):
        try:
            render.validate(ld)
        except render.InvalidSpec:
            return verdict  # the reconcile reports it
        manifest = deployment_mod.render_deployment(ld, replace_in_place=verdict.replace_in_place)
        logger.info("Deployment %s/%s: %s", ld.namespace, manifest["metadata"]["name"],
                    "replacing pods in place" if verdict.replace_in_place else "restoring the spec's rollout strategy")  # fmt: skip
        await state.kube.apply(manifest)
    return verdict


async def route(
    state: OperatorState, ld: api.LLMDeployment, deployment: Mapping[str, Any] | None, previous: Any
) -> activation.Routing | None:
    """Point the Service at the activator while no pod is ready, back at the pods once one is
    (:func:`.activation.render_routing`): apply the activator's EndpointSlice or delete it. Nothing without an
    activator, or for a deployment that neither scales to zero nor was routed to the activator last time."""
    ready = int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)
    if state.activator_service is None:
        return activation.routing(ld, ready, None)
    was_routed = (((previous or {}).get("autoscaling") or {}).get("activation") or {}).get("route") == (
        activation.ROUTE_ACTIVATOR)
    if not (naming.scales_to_zero(ld) or was_routed):
        return None
    activator = None
    if naming.scales_to_zero(ld):
        namespace, name = state.activator_service
        activator = activation.activator_endpoints(await state.kube.list(
            "discovery.k8s.io/v1", "EndpointSlice", namespace, {activation.SERVICE_NAME_LABEL: name}))
    routing, slices = activation.render_routing(ld, ready, activator)
    namespace, uid = ld.namespace or "default", ld.metadata.get("uid")
    existing = [s for s in await state.kube.list("discovery.k8s.io/v1", "EndpointSlice", namespace,
                                                 {LABEL: naming.label_value(ld)}) if owned_by(s, uid)]
    current = {s["metadata"]["name"]: s for s in existing}
    for s in slices:
        now = current.get(s["metadata"]["name"]) or {}
        if any(now.get(k) != s[k] for k in ("addressType", "ports", "endpoints")):  # else nothing to apply
            s = {**s, "metadata": {**s["metadata"], "namespace": namespace}}
            if not now:
                await check_not_foreign(state.kube, ld, s)
            await state.kube.apply(s)
    wanted = {s["metadata"]["name"] for s in slices}
    for s in existing:
        # The Kubernetes controller's slices of the Service carry its labels too, but the Service as owner.
        if s["metadata"]["name"] not in wanted:
            logger.info("%s/%s: routing the Service back to its pods", namespace, ld.name)
            await state.kube.delete("discovery.k8s.io/v1", "EndpointSlice", namespace, s["metadata"]["name"])
    return routing


async def report_invalid(state: OperatorState, key: Key, message: str) -> None:
    """Ready=False/InvalidSpec with ``message`` (the reconcile handler rejected the spec)."""
    async with state.track(key).lock:
        body = await fresh(state.kube, key)
        if body is not None:
            new, events = status_mod.invalid_spec_status(body, message, body.get("status"))
            await write_status(state.kube, body, new, events)


async def report_failure(state: OperatorState, key: Key, message: str) -> None:
    """Best effort: Ready=False/ReconcileFailed when even observing failed (a bug or an unreadable object)."""
    try:
        async with state.track(key).lock:
            body = await fresh(state.kube, key)
            if body is not None:
                new, events = status_mod.reconcile_failed_status(body, message, body.get("status"))
                await write_status(state.kube, body, new, events)
    except Exception:  # noqa: BLE001 - reporting a failure must not fail in turn
        logger.exception("could not report the failure of %s/%s", *key)
