"""The children of an LLMDeployment as the operator writes and reads them through :class:`.kube.Kube`.

:func:`apply_children` applies what :func:`.render.render` produced with server-side apply and deletes the
owned children that are no longer rendered; :func:`read_children` reads what :func:`.observe.observe` needs,
:func:`read_replicasets` what :func:`.rollout_guard.decide` needs besides.
Children are found by the ``kubellm.io/llmdeployment`` label and kept only when they carry the
LLMDeployment's owner reference. An object of a child's name that exists without that reference is never
taken over (:func:`check_not_foreign`): the reconcile fails with :class:`ForeignObject` (ReconcileFailed naming
it, and a Warning Event) until it is removed, or its owner hands it over with the annotation
``kubellm.io/adopt: <LLMDeployment name>`` on it (docs/operations.md, "Objects the operator does not own").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from kubellm.operator import api
from kubellm.operator.control.kube import ApiError, Kube, owned_by
from kubellm.operator.render import multinode, naming

logger = logging.getLogger(__name__)

ADOPT_ANNOTATION = f"{api.GROUP}/adopt"  # on an existing object: the LLMDeployment that may take it over


class ForeignObject(ApiError):
    """A child's name is taken by an object the LLMDeployment does not own (answered as a 409 conflict)."""

    def __init__(self, kind: str, namespace: str, name: str, owners: str, ld_name: str) -> None:
        super().__init__(409, "AlreadyExists", (
            f"{kind} {namespace}/{name} already exists and is not owned by this LLMDeployment ({owners}): "
            f"refusing to take it over. Delete or rename it, rename the LLMDeployment, or let it be adopted by "
            f"annotating it {ADOPT_ANNOTATION}={ld_name}"), "PATCH", f"{kind} {name}")  # fmt: skip


def owners_of(obj: Mapping[str, Any]) -> str:
    """Who owns ``obj``, in words: its owner references, or "no owner"."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return "owned by " + ", ".join(f"{r.get('kind')} {r.get('name')}" for r in refs) if refs else "no owner"


async def check_not_foreign(kube: Kube, ld: api.LLMDeployment, child: Mapping[str, Any]) -> None:
    """Raise :class:`ForeignObject` if an object of ``child``'s kind and name exists that the LLMDeployment
    neither owns nor was handed with :data:`ADOPT_ANNOTATION`. Only for children not found owned: one list
    call (by name) when a child is first created."""
    meta = child["metadata"]
    namespace = meta.get("namespace") or ld.namespace or "default"
    try:
        found = await kube.find(child["apiVersion"], child["kind"], namespace, meta["name"])
    except ApiError as e:
        if e.status == 403 and child["kind"] in OPTIONAL_KINDS:
            return  # not granted: applying it fails with what to do (addon_hint)
        raise
    if found is None or owned_by(found, ld.metadata.get("uid")):
        return
    if ((found.get("metadata") or {}).get("annotations") or {}).get(ADOPT_ANNOTATION) == ld.name:
        logger.info("adopting %s %s/%s (annotated %s=%s)", child["kind"], namespace, meta["name"], ADOPT_ANNOTATION,
                    ld.name)  # fmt: skip
        return
    raise ForeignObject(child["kind"], namespace, meta["name"], owners_of(found), ld.name)

LABEL = naming.LABEL_LLMDEPLOYMENT
# Every kind the operator may own, so that a kind render stops producing is still found and deleted.
MANAGED_KINDS: tuple[tuple[str, str], ...] = tuple(naming.CHILD_KINDS)
# Kinds from add-ons (KEDA, the Prometheus operator, the Gateway API Inference Extension, LWS) whose permissions
# the Helm chart grants only on request: a forbidden listing of them means "none of ours to clean up".
# Per kind: (what installs its CRD, the chart value granting it, the spec change that does without it).
ADDONS: dict[str, tuple[str, str, str]] = {
    "ScaledObject": ("KEDA", "rbac.keda", "autoscaling.backend: hpa"),
    "ServiceMonitor": ("the Prometheus operator", "rbac.serviceMonitors", "monitoring.serviceMonitor: Auto"),
    "PrometheusRule": ("the Prometheus operator", "rbac.prometheusRules", "monitoring.alerts.enabled: false"),
    "InferencePool": ("the Gateway API Inference Extension CRDs (v1.0 or later)", "rbac.inferencePools",
                      "gateway.inferencePool.enabled: false"),
    naming.LWS_KIND: (f"the LWS controller ({multinode.INSTALL_URL})", "rbac.leaderWorkerSets",
                     "parallelism.nodes: 1"),
}  # fmt: skip
OPTIONAL_KINDS = frozenset(ADDONS)
# What runs the pods: a Deployment, or a LeaderWorkerSet for multi-node replicas.
WORKLOAD_KINDS = frozenset({"Deployment", naming.LWS_KIND})


def addon_hint(kind: str, error: ApiError) -> str | None:
    """What to do when applying an add-on kind failed because its CRD is absent (404) or the operator may not
    manage it (403); None for other kinds and errors."""
    if kind not in ADDONS or error.status not in (403, 404):
        return None
    installer, value, instead = ADDONS[kind]
    if error.status == 404:
        return f"the {kind} CRD is not installed: install {installer}, or set {instead}"
    return f"the operator may not manage {kind}s: install the chart with {value}=true, or set {instead}"


def as_deployment(workload: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The workload in the shape the status code reads from a Deployment (a Deployment is returned as it is).

    A LeaderWorkerSet counts groups where a Deployment counts pods, and a group is ready when all its pods are
    (the leader's readiness probe runs a generation through every rank): replicas, readyReplicas and
    updatedReplicas carry over, availableReplicas is readyReplicas (the LWS keeps no separate count). The pod
    template is the leader's (it moves with every spec change, as the worker's does), the selector picks the
    leaders (as the LWS's scale subresource does), and the conditions carry over (LWS's Available, Progressing
    and UpdateInProgress; the status code looks for the Deployment reasons only).
    """
    if workload is None or workload.get("kind") != naming.LWS_KIND:
        return dict(workload) if workload is not None else None
    spec, status = workload.get("spec") or {}, workload.get("status") or {}
    group = spec.get("leaderWorkerTemplate") or {}
    metadata = workload.get("metadata") or {}
    labels = ((group.get("leaderTemplate") or {}).get("metadata") or {}).get("labels") or {}
    selector = {k: v for k, v in labels.items() if k in (naming.LABEL_NAME, naming.LABEL_INSTANCE,
                                                         naming.LABEL_COMPONENT)}  # fmt: skip
    out_spec: dict[str, Any] = {"template": group.get("leaderTemplate") or {}}
    if selector:
        out_spec["selector"] = {"matchLabels": {**selector, naming.WORKER_INDEX_LABEL: "0"}}
    if "replicas" in spec:
        out_spec["replicas"] = spec["replicas"]
    out_status = {k: status[k] for k in ("replicas", "readyReplicas", "updatedReplicas", "conditions") if k in status}
    if "readyReplicas" in status:
        out_status["availableReplicas"] = status["readyReplicas"]
    if "observedGeneration" in status:
        out_status["observedGeneration"] = status["observedGeneration"]
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": dict(metadata), "spec": out_spec,
            "status": out_status}  # fmt: skip


def template_id(workload: Mapping[str, Any]) -> Any:
    """What identifies a workload's pod template: render's spec-hash annotation, else the template itself."""
    template = ((as_deployment(workload) or {}).get("spec") or {}).get("template") or {}
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    return annotations.get(naming.SPEC_HASH_ANNOTATION) or template


REPLICAS_HANDOVER_MANAGER = "kubellm-operator-replicas-handover"


def replicas_handover(child: Mapping[str, Any], existing: Mapping[str, Any] | None, field_manager: str):
    """The apply that parks ``spec.replicas`` with a second field manager, or None if none is needed.

    When autoscaling is switched on, the rendered Deployment (or LeaderWorkerSet) stops carrying ``replicas``. If our field
    manager still owns the field, server-side apply would *remove* it and the Deployment would fall back
    to 1 replica until the autoscaler acts. Applying the current value under another manager first keeps
    it; the HPA's next scale update then takes the field over from that manager.
    """
    if child.get("kind") not in WORKLOAD_KINDS or "replicas" in (child.get("spec") or {}) or existing is None:
        return None
    owned = any(
        entry.get("manager") == field_manager and "f:replicas" in ((entry.get("fieldsV1") or {}).get("f:spec") or {})
        for entry in existing.get("metadata", {}).get("managedFields") or []
    )
    current = (existing.get("spec") or {}).get("replicas")
    if not owned or current is None:
        return None
    meta = child["metadata"]
    return {"apiVersion": child["apiVersion"], "kind": child["kind"],
            "metadata": {"name": meta["name"], "namespace": meta.get("namespace")}, "spec": {"replicas": current}}


async def apply_children(
    kube: Kube,
    ld: api.LLMDeployment,
    children: list[dict[str, Any]],
    note_template: Callable[[bool], None] | None = None,
) -> bool | None:
    """Apply ``children``, delete the owned ones no longer rendered; return whether the workload's (Deployment
    or LeaderWorkerSet) pod template changed (True for a new workload, None when none was rendered).
    ``note_template`` hears that answer as soon as the workload is applied, even if a later child fails."""
    namespace = ld.namespace or "default"
    uid = ld.metadata.get("uid")
    kinds = list(MANAGED_KINDS) + [
        (c["apiVersion"], c["kind"]) for c in children if (c["apiVersion"], c["kind"]) not in MANAGED_KINDS
    ]
    existing: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}
    for api_version, kind in kinds:
        try:
            found = await kube.list(api_version, kind, namespace, {LABEL: naming.label_value(ld)})
        except ApiError as e:
            if not (e.status == 403 and kind in OPTIONAL_KINDS):
                raise
            logger.debug("may not list %s in %s: none of them are ours", kind, namespace)
            found = []
        for obj in found:
            if owned_by(obj, uid):
                existing[(kind, obj["metadata"]["name"])] = (api_version, obj)

    children = [{**c, "metadata": {**c["metadata"], "namespace": c["metadata"].get("namespace") or namespace}}
                for c in children]  # fmt: skip
    # Every name is checked before anything is applied: a conflict leaves the children as they were.
    for child in children:
        if (child["kind"], child["metadata"]["name"]) not in existing:
            await check_not_foreign(kube, ld, child)

    template_changed: bool | None = None
    rendered: set[tuple[str, str]] = set()
    for child in children:
        kind, child_name = child["kind"], child["metadata"]["name"]
        rendered.add((kind, child_name))
        before = existing.get((kind, child_name))
        handover = replicas_handover(child, before[1] if before else None, kube.field_manager)
        if handover is not None:
            logger.info("handing spec.replicas of Deployment %s/%s to the autoscaler", namespace, child_name)
            await kube.apply(handover, field_manager=REPLICAS_HANDOVER_MANAGER)
        try:
            applied = await kube.apply(child)
        except ApiError as e:
            # monitoring.serviceMonitor Auto means "when the Prometheus operator is there": an operator not
            # allowed to manage ServiceMonitors (the chart's rbac.serviceMonitors off) counts as "not there".
            if e.status == 403 and kind == "ServiceMonitor" and ld.spec.monitoring.service_monitor == "Auto":
                logger.warning("not allowed to apply ServiceMonitor %s/%s, skipped: %s", namespace, child_name, e)
                continue
            if (hint := addon_hint(kind, e)) is not None:
                raise ApiError(e.status, e.reason, f"{e.message}; {hint}", "PATCH", f"{kind} {child_name}") from e
            raise
        if kind in WORKLOAD_KINDS:
            template_changed = before is None or template_id(before[1]) != template_id(applied or {})
            if note_template is not None:
                note_template(template_changed)

    for (kind, child_name), (api_version, _obj) in existing.items():
        if (kind, child_name) not in rendered:
            logger.info("deleting %s %s/%s: no longer rendered", kind, namespace, child_name)
            await kube.delete(api_version, kind, namespace, child_name)
    return template_changed


async def read_deployment(kube: Kube, ld: api.LLMDeployment) -> dict[str, Any] | None:
    """The owned Deployment (the one render names when several carry the label), or None."""
    namespace, name = ld.namespace or "default", naming.child_name(ld)
    own = {LABEL: naming.label_value(ld)}
    uid = ld.metadata.get("uid")
    deployments = [d for d in await kube.list("apps/v1", "Deployment", namespace, own) if owned_by(d, uid)]
    deployments.sort(key=lambda d: (d["metadata"]["name"] != name, d["metadata"]["name"]))
    return deployments[0] if deployments else None


async def read_workload(kube: Kube, ld: api.LLMDeployment) -> dict[str, Any] | None:
    """The owned workload the spec calls for: the Deployment (:func:`read_deployment`), or with
    parallelism.nodes > 1 the LeaderWorkerSet through :func:`as_deployment`; None when there is none."""
    if not naming.is_multi_node(ld):
        return await read_deployment(kube, ld)
    namespace, name = ld.namespace or "default", naming.lws_name(ld)
    own = {LABEL: naming.label_value(ld)}
    uid = ld.metadata.get("uid")
    try:
        found = [w for w in await kube.list(naming.LWS_API_VERSION, naming.LWS_KIND, namespace, own) if owned_by(w, uid)]
    except ApiError as e:
        if e.status != 403:
            raise
        return None  # not granted: the reconcile's ReconcileFailed says what to do
    found.sort(key=lambda w: (w["metadata"]["name"] != name, w["metadata"]["name"]))
    return as_deployment(found[0]) if found else None


async def read_children(
    kube: Kube, ld: api.LLMDeployment
) -> tuple[dict[str, Any] | None, dict[str, Any] | None, list[dict[str, Any]]]:
    """The owned workload the spec calls for (:func:`read_workload`), the autoscaler's HPA and the workload's
    pods (terminating ones, and a multi-node group's workers, included)."""
    namespace, name = ld.namespace or "default", naming.child_name(ld)
    own = {LABEL: naming.label_value(ld)}
    deployment = await read_workload(kube, ld)

    hpa = None
    if ld.spec.autoscaling.enabled:
        # The HPA backend's HPA is ours; KEDA's belongs to the ScaledObject but carries its labels.
        hpas = await kube.list("autoscaling/v2", "HorizontalPodAutoscaler", namespace, own)
        hpas.sort(key=lambda h: h["metadata"]["name"])
        hpa = hpas[0] if hpas else None
        if hpa is None and ld.spec.autoscaling.backend == "keda":
            hpa = await kube.get("autoscaling/v2", "HorizontalPodAutoscaler", namespace, f"keda-hpa-{name}")

    if naming.is_multi_node(ld):  # the workers too: a crash-looping or unschedulable one holds its group back
        selector = naming.selector_labels(ld)
    else:
        selector = (deployment or {}).get("spec", {}).get("selector", {}).get("matchLabels") or own
    pods = await kube.list("v1", "Pod", namespace, selector)
    return deployment, hpa, pods


async def read_inference_pool(kube: Kube, ld: api.LLMDeployment) -> dict[str, Any] | None:
    """The owned InferencePool; None when there is none yet, its CRD is absent or the operator may not list it
    (the reconcile reports those)."""
    own = {LABEL: naming.label_value(ld)}
    try:
        pools = await kube.list(naming.INFERENCE_POOL_API_VERSION, "InferencePool", ld.namespace or "default", own)
    except ApiError as e:
        if e.status != 403:
            raise
        return None
    name = naming.child_name(ld)
    return next((p for p in pools if owned_by(p, ld.metadata.get("uid")) and p["metadata"]["name"] == name), None)


async def read_replicasets(kube: Kube, deployment: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The ReplicaSets the Deployment owns (the rollout guard tells its new pods from the old ones by them)."""
    meta = deployment.get("metadata") or {}
    selector = ((deployment.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    found = await kube.list("apps/v1", "ReplicaSet", meta.get("namespace") or "default", selector)
    return [rs for rs in found if owned_by(rs, meta.get("uid"))]
