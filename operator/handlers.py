"""kopf wiring of the LLMDeployment operator: thin glue between the API server, :mod:`.render` and :mod:`.status`.

* **Reconcile** (``@kopf.on.create/update/resume``): parse the object, render its children and apply each
  with server-side apply (field manager ``kubellm-operator``, ``force=true``), then delete the owned children
  that are no longer rendered (e.g. the HPA once autoscaling is turned off). An invalid spec (a pydantic
  error, a transition rule, or render's ``InvalidSpec``) touches no child: the status says InvalidSpec, a
  Warning Event says why, and the handler returns (no retry: the next spec change runs it again). API errors
  raise ``kopf.TemporaryError`` with a backoff; anything unexpected is logged and retried the same way, and
  the status says ReconcileFailed.
* **Observe** (``@kopf.daemon`` per LLMDeployment): reads the owned Deployment, the HPA and the pods, calls
  :func:`.status.observe` and patches the status subresource when it changed, then posts the Events. It runs
  every ``OBSERVE_INTERVAL`` seconds and at once (debounced) when an owned Deployment, HPA or pod changes
  (``@kopf.on.event`` handlers poke it) or a reconcile finishes. It observes a new generation only after the
  reconcile of that generation finished, so ``observedGeneration`` means "the children reflect this spec".

kopf stores its progress and last-handled configuration in ``kubellm.io/*`` annotations (the status schema is
structural, so kopf's default ``status.kopf`` would be pruned) and, because daemons need it, the finalizer
``kubellm.io/finalizer``. Only warnings and errors of kopf's own logs become Events.

API access: the official ``kubernetes`` client supplies the configuration (in-cluster or kubeconfig, TLS,
tokens); :class:`Kube` sends raw JSON requests through its connection pool, off the event loop
(``asyncio.to_thread``). It maps apiVersion/kind to resource paths itself, so one small helper serves every
kind (core, apps, policy, autoscaling, KEDA, Prometheus operator) and it works across client versions.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf
import kubernetes
import urllib3
from pydantic import ValidationError

from kubellm.operator import api, metrics
from kubellm.operator import render as render_mod
from kubellm.operator import status as status_mod
from kubellm.operator.render import InvalidSpec, render

logger = logging.getLogger(__name__)

FIELD_MANAGER = "kubellm-operator"
ANNOTATION_PREFIX = api.GROUP  # kubellm.io/... annotations for kopf's bookkeeping
FINALIZER = f"{api.GROUP}/finalizer"
LABEL = status_mod.LLMDEPLOYMENT_LABEL
OBSERVE_INTERVAL = 15.0  # seconds between observations without a child event
OBSERVE_DEBOUNCE = 0.5  # child events arriving within this window trigger one observation
MAX_EVENT_MESSAGE = 1024
REQUEST_TIMEOUT = urllib3.Timeout(connect=10.0, read=60.0)

# Every kind the operator may own, so that a kind render stops producing is still found and deleted.
MANAGED_KINDS: tuple[tuple[str, str], ...] = tuple(render_mod.CHILD_KINDS)
# Kinds from add-ons (KEDA, the Prometheus operator) whose permissions the Helm chart grants only on request
# (rbac.keda, rbac.serviceMonitors): a forbidden listing of them means "none of ours to clean up".
OPTIONAL_KINDS = frozenset({"ScaledObject", "ServiceMonitor"})
_PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "ScaledObject": "scaledobjects",
    "ServiceMonitor": "servicemonitors",
    "Pod": "pods",
    "Event": "events",
    api.KIND: api.PLURAL,
}


# --------------------------------------------------------------------------------------------------
# A thin API client
# --------------------------------------------------------------------------------------------------


class ApiError(Exception):
    """A failed API request (``status`` 0: the server could not be reached)."""

    def __init__(self, status: int, reason: str, message: str, method: str = "", path: str = "") -> None:
        self.status, self.reason, self.message = status, reason, message
        where = f"{method} {path}: " if method else ""
        super().__init__(f"{where}{status} {reason}: {message}" if status else f"{where}{reason}: {message}")

    @property
    def not_found(self) -> bool:
        return self.status == 404


def plural(kind: str) -> str:
    """The resource name of a kind (the common ones are listed; others take the usual lower-case + s)."""
    return _PLURALS.get(kind) or kind.lower() + "s"


def resource_path(
    api_version: str,
    kind: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """``/api/v1/namespaces/ns/services/x``, ``/apis/apps/v1/namespaces/ns/deployments/x/status``, ..."""
    parts = ["api" if "/" not in api_version else "apis", api_version]
    if namespace:
        parts += ["namespaces", namespace]
    parts.append(plural(kind))
    if name:
        parts.append(name)
    if subresource:
        parts.append(subresource)
    return "/" + "/".join(urllib.parse.quote(p, safe="/.") for p in parts)


def load_configuration() -> kubernetes.client.Configuration:
    """The client configuration: in-cluster (service account) first, else the kubeconfig."""
    cfg = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=cfg)
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(client_configuration=cfg)
    return cfg


class Kube:
    """JSON requests to the API server with the official client's configuration and connection pool."""

    def __init__(
        self, configuration: kubernetes.client.Configuration, field_manager: str = FIELD_MANAGER
    ) -> None:
        self.configuration = configuration
        self.field_manager = field_manager
        self._pool = kubernetes.client.ApiClient(configuration).rest_client.pool_manager

    def _headers(self) -> dict[str, str]:
        cfg = self.configuration
        headers = {"Accept": "application/json", "User-Agent": FIELD_MANAGER}
        token = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
        if token:
            headers["Authorization"] = token
        elif cfg.username or cfg.password:
            headers.update(urllib3.make_headers(basic_auth=f"{cfg.username}:{cfg.password}"))
        return headers

    def request_sync(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Any:
        url = self.configuration.host.rstrip("/") + path
        if query:
            url += "?" + urllib.parse.urlencode(query)
        headers = self._headers()
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body).encode()
        try:
            resp = self._pool.request(
                method, url, body=data, headers=headers, timeout=REQUEST_TIMEOUT, retries=False
            )
        except urllib3.exceptions.HTTPError as e:
            metrics.count_api_error(method, 0)
            raise ApiError(0, type(e).__name__, str(e), method, path) from e
        if resp.status >= 400:
            reason, message = resp.reason or "Error", resp.data.decode(errors="replace")[:500]
            try:
                payload = json.loads(resp.data)
                reason, message = payload.get("reason") or reason, payload.get("message") or message
            except (ValueError, AttributeError):
                pass
            metrics.count_api_error(method, resp.status)
            raise ApiError(resp.status, str(reason), str(message), method, path)
        return json.loads(resp.data) if resp.data else None

    def close(self) -> None:
        """Close the pooled connections."""
        self._pool.clear()

    async def request(self, method: str, path: str, **kwargs: Any) -> Any:
        return await asyncio.to_thread(self.request_sync, method, path, **kwargs)

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", path)
        except ApiError as e:
            if e.not_found:
                return None
            raise

    async def list(
        self, api_version: str, kind: str, namespace: str, selector: Mapping[str, str]
    ) -> list[dict]:
        """Objects of a kind in a namespace whose labels match ``selector`` ([] when the kind is not served).
        The selector is also checked here, so a server that ignores labelSelector gives the same answer."""
        query = {"labelSelector": ",".join(f"{k}={v}" for k, v in sorted(selector.items()))}
        try:
            result = await self.request("GET", resource_path(api_version, kind, namespace), query=query)
        except ApiError as e:
            if e.not_found:
                return []
            raise
        items = (result or {}).get("items") or []
        return [i for i in items if matches(i, selector)]

    async def apply(self, obj: Mapping[str, Any], field_manager: str | None = None) -> dict[str, Any]:
        """Server-side apply: the object is what this field manager wants; conflicts are forced."""
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        query = {"fieldManager": field_manager or self.field_manager, "force": "true"}
        return await self.request(
            "PATCH", path, query=query, body=obj, content_type="application/apply-patch+yaml"
        )

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        try:
            await self.request("DELETE", resource_path(api_version, kind, namespace, name), body=body)
        except ApiError as e:
            if not e.not_found:
                raise

    async def merge_patch(self, path: str, patch: Mapping[str, Any]) -> Any:
        return await self.request("PATCH", path, body=patch, content_type="application/merge-patch+json")


def matches(obj: Mapping[str, Any], selector: Mapping[str, str]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def owned_by(obj: Mapping[str, Any], uid: str | None) -> bool:
    """Whether ``obj`` has an owner reference to ``uid`` (True when the owner has no uid to compare)."""
    if not uid:
        return True
    return any(ref.get("uid") == uid for ref in (obj.get("metadata") or {}).get("ownerReferences") or [])


def merge_patch_diff(old: Any, new: Any) -> Any:
    """The JSON merge patch (RFC 7386) that turns ``old`` into ``new`` (removed keys become null)."""
    if not (isinstance(old, Mapping) and isinstance(new, Mapping)):
        return new
    out: dict[str, Any] = {k: None for k in old if k not in new}
    for k, v in new.items():
        if k not in old:
            out[k] = v
        elif old[k] != v:
            out[k] = merge_patch_diff(old[k], v)
    return out


# --------------------------------------------------------------------------------------------------
# Operator state (kept in kopf's memo, shared by all handlers)
# --------------------------------------------------------------------------------------------------

Key = tuple[str, str]  # (namespace, name)


@dataclass
class Reconciled:
    """The outcome of the last reconcile of one LLMDeployment."""

    generation: int | None
    template_changed: bool | None = None
    invalid: str | None = None  # the spec was rejected (InvalidSpec)
    error: str | None = None  # applying the children failed (ReconcileFailed)


@dataclass
class OperatorState:
    kube: Kube
    service_monitor_available: bool = False
    prometheus_url: str = render_mod.DEFAULT_PROMETHEUS_URL  # what KEDA triggers query
    observe_interval: float = OBSERVE_INTERVAL
    debounce: float = OBSERVE_DEBOUNCE
    reconciled: dict[Key, Reconciled] = field(default_factory=dict)
    pokes: dict[Key, asyncio.Event] = field(default_factory=dict)
    locks: dict[Key, asyncio.Lock] = field(default_factory=dict)
    waiting_since: dict[Key, tuple[int | None, float]] = field(default_factory=dict)
    label_keys: dict[tuple[str, str], Key] = field(default_factory=dict)  # (namespace, label value) -> key

    def poke(self, key: Key) -> None:
        self.pokes.setdefault(key, asyncio.Event()).set()

    def lock(self, key: Key) -> asyncio.Lock:
        return self.locks.setdefault(key, asyncio.Lock())

    def forget(self, key: Key) -> None:
        for table in (self.reconciled, self.pokes, self.locks, self.waiting_since):
            table.pop(key, None)
        for label_key in [k for k, v in self.label_keys.items() if v == key]:
            del self.label_keys[label_key]


def _state(memo: Any) -> OperatorState:
    state = getattr(memo, "kubellm", None)
    if state is None:
        raise kopf.TemporaryError("the operator has not finished starting up", delay=5)
    return state


# --------------------------------------------------------------------------------------------------
# Parsing and messages
# --------------------------------------------------------------------------------------------------


def describe_invalid(error: Exception) -> str:
    """A one-line message for an invalid spec (pydantic errors as ``path: message``)."""
    if isinstance(error, ValidationError):
        parts = []
        for err in error.errors():
            loc = ".".join(str(p) for p in err.get("loc", ()))
            msg = str(err.get("msg", "")).removeprefix("Value error, ")
            parts.append(f"{loc}: {msg}" if loc else msg)
        return "; ".join(parts) or str(error)
    return str(error)


def parse(body: Mapping[str, Any]) -> api.LLMDeployment:
    """The LLMDeployment in ``body`` (its status is left out: only the spec can make it invalid)."""
    return api.LLMDeployment.model_validate({k: v for k, v in body.items() if k != "status"})


def _plain(body: Any) -> dict[str, Any]:
    return json.loads(json.dumps(dict(body), default=str))


def _key(body: Mapping[str, Any]) -> Key:
    meta = body.get("metadata") or {}
    return meta.get("namespace") or "default", meta.get("name") or ""


def _post(body: Mapping[str, Any], events: list[status_mod.Event]) -> None:
    for ev in events:
        kopf.event(body, type=ev.type, reason=ev.reason, message=ev.message[:MAX_EVENT_MESSAGE])


async def _write_status(
    kube: Kube, body: Mapping[str, Any], new: api.LLMDeploymentStatus, events: list[status_mod.Event]
) -> bool:
    """Patch the status subresource if ``new`` differs from the body's status; then post ``events``."""
    namespace, name = _key(body)
    try:
        before = api.LLMDeploymentStatus.model_validate(body.get("status") or {}).to_k8s()
    except ValidationError:
        before = dict(body.get("status") or {})
    after = new.to_k8s()
    changed = before != after
    if changed:
        path = resource_path(api.API_VERSION, api.KIND, namespace, name, "status")
        await kube.merge_patch(path, {"status": merge_patch_diff(before, after)})
    _post(body, events)
    return changed


async def _fresh(kube: Kube, key: Key) -> dict[str, Any] | None:
    body = await kube.get(resource_path(api.API_VERSION, api.KIND, key[0], key[1]))
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        return None
    return body


async def report_invalid(state: OperatorState, key: Key, message: str) -> None:
    async with state.lock(key):
        body = await _fresh(state.kube, key)
        if body is not None:
            new, events = status_mod.invalid_spec_status(body, message, body.get("status"))
            await _write_status(state.kube, body, new, events)


async def report_failure(state: OperatorState, key: Key, message: str) -> None:
    """Best effort: Ready=False/ReconcileFailed when even observing failed (a bug or an unreadable object)."""
    try:
        async with state.lock(key):
            body = await _fresh(state.kube, key)
            if body is None:
                return
            previous = api.LLMDeploymentStatus.model_validate(body.get("status") or {})
            new = previous.model_copy(deep=True)
            generation = (body.get("metadata") or {}).get("generation")
            before = previous.get_condition(api.ConditionType.READY)
            new.set_condition(api.ConditionType.READY, False, "ReconcileFailed", message, generation)
            new.set_condition(api.ConditionType.DEGRADED, True, "ReconcileFailed", message, generation)
            fresh = before is None or before.reason != "ReconcileFailed" or before.message != message
            events = [status_mod.Event("Warning", "ReconcileFailed", message)] if fresh else []
            await _write_status(state.kube, body, new, events)
    except Exception:  # noqa: BLE001 - reporting a failure must not fail in turn
        logger.exception("could not report the failure of %s/%s", *key)


# --------------------------------------------------------------------------------------------------
# Reconcile
# --------------------------------------------------------------------------------------------------


def _backoff(retry: int) -> float:
    return float(min(2 ** min(retry, 6), 60))


def _template_id(deployment: Mapping[str, Any]) -> Any:
    """What identifies a Deployment's pod template: render's spec-hash annotation, else the template itself."""
    template = (deployment.get("spec") or {}).get("template") or {}
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    return annotations.get(render_mod.SPEC_HASH_ANNOTATION) or template


REPLICAS_HANDOVER_MANAGER = "kubellm-operator-replicas-handover"


def replicas_handover(child: Mapping[str, Any], existing: Mapping[str, Any] | None, field_manager: str):
    """The apply that parks ``spec.replicas`` with a second field manager, or None if none is needed.

    When autoscaling is switched on, the rendered Deployment stops carrying ``replicas``. If our field
    manager still owns the field, server-side apply would *remove* it and the Deployment would fall back
    to 1 replica until the autoscaler acts. Applying the current value under another manager first keeps
    it; the HPA's next scale update then takes the field over from that manager.
    """
    if child.get("kind") != "Deployment" or "replicas" in (child.get("spec") or {}) or existing is None:
        return None
    owned = any(
        entry.get("manager") == field_manager and "f:replicas" in ((entry.get("fieldsV1") or {}).get("f:spec") or {})
        for entry in existing.get("metadata", {}).get("managedFields") or []
    )
    current = (existing.get("spec") or {}).get("replicas")
    if not owned or current is None:
        return None
    meta = child["metadata"]
    return {"apiVersion": child["apiVersion"], "kind": "Deployment",
            "metadata": {"name": meta["name"], "namespace": meta.get("namespace")}, "spec": {"replicas": current}}


async def apply_children(
    kube: Kube,
    ld: api.LLMDeployment,
    children: list[dict[str, Any]],
    note_template: Callable[[bool], None] | None = None,
) -> bool | None:
    """Apply ``children``, delete the owned ones no longer rendered; return whether the Deployment's pod
    template changed (True for a new Deployment, None when no Deployment was rendered). ``note_template``
    hears that answer as soon as the Deployment is applied, even if a later child fails."""
    namespace = ld.namespace or "default"
    uid = ld.metadata.get("uid")
    kinds = list(MANAGED_KINDS) + [
        (c["apiVersion"], c["kind"]) for c in children if (c["apiVersion"], c["kind"]) not in MANAGED_KINDS
    ]
    existing: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}
    for api_version, kind in kinds:
        try:
            found = await kube.list(api_version, kind, namespace, {LABEL: render_mod.label_value(ld)})
        except ApiError as e:
            if not (e.status == 403 and kind in OPTIONAL_KINDS):
                raise
            logger.debug("may not list %s in %s: none of them are ours", kind, namespace)
            found = []
        for obj in found:
            if owned_by(obj, uid):
                existing[(kind, obj["metadata"]["name"])] = (api_version, obj)

    template_changed: bool | None = None
    rendered: set[tuple[str, str]] = set()
    for child in children:
        child = {
            **child,
            "metadata": {**child["metadata"], "namespace": child["metadata"].get("namespace") or namespace},
        }
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
            raise
        if kind == "Deployment":
            template_changed = before is None or _template_id(before[1]) != _template_id(applied or {})
            if note_template is not None:
                note_template(template_changed)

    for (kind, child_name), (api_version, _obj) in existing.items():
        if (kind, child_name) not in rendered:
            logger.info("deleting %s %s/%s: no longer rendered", kind, namespace, child_name)
            await kube.delete(api_version, kind, namespace, child_name)
    return template_changed


def _validate(body: Mapping[str, Any], old: Mapping[str, Any] | None, state: OperatorState):
    ld = parse(body)
    if old and old.get("spec"):
        try:
            old_spec = api.LLMDeploymentSpec.model_validate(old["spec"])
        except ValidationError:
            old_spec = None  # the previous spec was invalid: nothing to compare with
        if old_spec is not None and (problems := api.validate_update(old_spec, ld.spec)):
            raise InvalidSpec("; ".join(problems))
    return ld, render(
        ld, service_monitor_available=state.service_monitor_available, prometheus_url=state.prometheus_url
    )


@kopf.on.resume(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.create(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.update(api.GROUP, api.VERSION, api.PLURAL)
async def reconcile(
    body: kopf.Body, old: Any, reason: kopf.Reason, memo: Any, retry: int, logger: Any, **_: Any
) -> None:
    with metrics.reconciling() as outcome:
        state = _state(memo)
        raw = _plain(body)
        key = _key(raw)
        generation = raw["metadata"].get("generation")
        # Whether this generation changed the pod template is sticky across attempts: a retry (or a second
        # reconcile of the same generation) finds the template already applied, which is no reason to
        # forget it.
        prev = state.reconciled.get(key)
        seen: list[bool] = (
            [prev.template_changed] if prev and prev.generation == generation and prev.template_changed else []
        )

        def failed(message: str, delay: float) -> kopf.TemporaryError:
            """Record the failure for the observer (ReconcileFailed), wake it, and retry after ``delay``."""
            state.reconciled[key] = Reconciled(
                generation, template_changed=any(seen) if seen else None, error=message
            )
            state.poke(key)
            return kopf.TemporaryError(message, delay=delay)

        try:
            ld, children = _validate(raw, old if reason == kopf.Reason.UPDATE else None, state)
        except (ValidationError, InvalidSpec) as e:
            message = describe_invalid(e)
            logger.warning(f"invalid spec, children left as they are: {message}")
            state.reconciled[key] = Reconciled(generation, invalid=message)
            try:
                await report_invalid(state, key, message)
            except ApiError as api_error:
                raise kopf.TemporaryError(
                    f"could not report the invalid spec: {api_error}", delay=_backoff(retry)
                ) from e
            outcome.result = "invalid_spec"
            return  # not retried: only a new spec can fix it
        except Exception as e:  # a bug in parsing or rendering: log it, say so in the status, retry slowly
            logger.exception("rendering failed unexpectedly")
            raise failed(f"internal error: {type(e).__name__}: {e}", 60) from e

        try:
            await apply_children(state.kube, ld, children, note_template=seen.append)
        except ApiError as e:
            raise failed(f"applying the children failed: {e}", _backoff(retry)) from e
        except Exception as e:  # a bug: log it, say so in the status, retry slowly
            logger.exception("reconcile failed unexpectedly")
            raise failed(f"internal error: {type(e).__name__}: {e}", 60) from e
        state.reconciled[key] = Reconciled(generation, template_changed=any(seen) if seen else None)
        state.poke(key)


# --------------------------------------------------------------------------------------------------
# Observe
# --------------------------------------------------------------------------------------------------


async def read_children(
    kube: Kube, ld: api.LLMDeployment
) -> tuple[dict[str, Any] | None, dict[str, Any] | None, list[dict[str, Any]]]:
    """The owned Deployment, the autoscaler's HPA and the Deployment's pods (terminating ones included)."""
    namespace, name = ld.namespace or "default", render_mod.child_name(ld)
    uid = ld.metadata.get("uid")
    own = {LABEL: render_mod.label_value(ld)}
    deployments = [d for d in await kube.list("apps/v1", "Deployment", namespace, own) if owned_by(d, uid)]
    deployments.sort(key=lambda d: (d["metadata"]["name"] != name, d["metadata"]["name"]))
    deployment = deployments[0] if deployments else None

    hpa = None
    if ld.spec.autoscaling.enabled:
        # The HPA backend's HPA is ours; KEDA's belongs to the ScaledObject but carries its labels.
        hpas = await kube.list("autoscaling/v2", "HorizontalPodAutoscaler", namespace, own)
        hpas.sort(key=lambda h: h["metadata"]["name"])
        hpa = hpas[0] if hpas else None
        if hpa is None and ld.spec.autoscaling.backend == "keda":
            hpa = await kube.get(
                resource_path("autoscaling/v2", "HorizontalPodAutoscaler", namespace, f"keda-hpa-{name}")
            )

    selector = (deployment or {}).get("spec", {}).get("selector", {}).get("matchLabels") or own
    pods = await kube.list("v1", "Pod", namespace, selector)
    return deployment, hpa, pods


async def observe_once(state: OperatorState, key: Key) -> bool:
    """One observation of one LLMDeployment; returns whether the status changed."""
    async with state.lock(key):
        body = await _fresh(state.kube, key)
        if body is None:
            return False
        generation = body["metadata"].get("generation")
        rec = state.reconciled.get(key)
        if rec is None or rec.generation != generation:
            # The reconcile of this generation has not finished: it pokes us when it has. Go on without it
            # only when it is overdue (kopf saw no change to handle, e.g. a spec changed and changed back).
            since_gen, since = state.waiting_since.setdefault(key, (generation, time.monotonic()))
            if since_gen != generation:
                state.waiting_since[key] = (generation, time.monotonic())
                return False
            if time.monotonic() - since < 2 * state.observe_interval:
                return False
            rec = None
        state.waiting_since.pop(key, None)

        previous = body.get("status")
        if rec is not None and rec.invalid is not None:
            new, events = status_mod.invalid_spec_status(body, rec.invalid, previous)
        else:
            try:
                ld = parse(body)
            except ValidationError as e:
                new, events = status_mod.invalid_spec_status(body, describe_invalid(e), previous)
            else:
                state.label_keys[(key[0], render_mod.label_value(ld))] = key
                deployment, hpa, pods = await read_children(state.kube, ld)
                new, events = status_mod.observe(
                    ld,
                    deployment,
                    hpa,
                    pods,
                    previous,
                    template_changed=rec.template_changed if rec else None,
                    reconcile_error=rec.error if rec else None,
                )
        return await _write_status(state.kube, body, new, events)


@kopf.daemon(api.GROUP, api.VERSION, api.PLURAL, id="observe", cancellation_timeout=1.0)
async def observe_daemon(name: str, namespace: str, memo: Any, stopped: Any, logger: Any, **_: Any) -> None:
    state = _state(memo)
    key = (namespace or "default", name)
    poke = state.pokes.setdefault(key, asyncio.Event())
    failures = 0
    metrics.MANAGED.inc()
    try:
        while not stopped:
            poke.clear()
            delay = state.observe_interval
            try:
                await observe_once(state, key)
                failures = 0
                metrics.OBSERVATIONS.labels(result="ok").inc()
            except ApiError as e:
                failures += 1
                delay = min(state.observe_interval, _backoff(failures))
                metrics.OBSERVATIONS.labels(result="error").inc()
                logger.warning(f"observing failed (retrying in {delay:g}s): {e}")
            except Exception as e:  # never let one object kill its observer
                metrics.OBSERVATIONS.labels(result="error").inc()
                logger.exception("observing failed unexpectedly")
                await report_failure(state, key, f"internal error while observing: {type(e).__name__}: {e}")
            try:
                await asyncio.wait_for(poke.wait(), timeout=delay)
                await asyncio.sleep(state.debounce)  # let a burst of child events settle
            except TimeoutError:
                pass
    finally:
        metrics.MANAGED.dec()
        state.forget(key)


@kopf.on.event("apps", "v1", "deployments", labels={LABEL: kopf.PRESENT})
@kopf.on.event("autoscaling", "v2", "horizontalpodautoscalers", labels={LABEL: kopf.PRESENT})
@kopf.on.event("v1", "pods", labels={LABEL: kopf.PRESENT})
async def child_changed(namespace: str, labels: Mapping[str, str], memo: Any, **_: Any) -> None:
    """A child changed: wake its LLMDeployment's observer (it reads everything afresh)."""
    state = getattr(memo, "kubellm", None)
    if state is not None and labels.get(LABEL):
        key = state.label_keys.get((namespace or "default", labels[LABEL]))
        if key is not None and key in state.pokes:
            state.poke(key)


# --------------------------------------------------------------------------------------------------
# Startup and entry point
# --------------------------------------------------------------------------------------------------


async def service_monitor_crd_available(kube: Kube) -> bool:
    """Whether the API server serves monitoring.coreos.com/v1 servicemonitors (the Prometheus operator)."""
    try:
        listing = await kube.get("/apis/monitoring.coreos.com/v1")
    except ApiError as e:
        logger.warning("could not check for the ServiceMonitor CRD, assuming it is absent: %s", e)
        return False
    return any(r.get("name") == "servicemonitors" for r in (listing or {}).get("resources") or [])


def configure_settings(settings: kopf.OperatorSettings) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.WARNING  # kopf's own "handler succeeded" logs stay out of Events
    settings.posting.reporting_component = FIELD_MANAGER
    settings.posting.event_name_prefix = "kubellm-"
    settings.watching.server_timeout = settings.watching.server_timeout or 300
    settings.watching.client_timeout = settings.watching.client_timeout or 330
    settings.watching.connect_timeout = settings.watching.connect_timeout or 30


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: Any, logger: Any, **_: Any) -> None:
    configure_settings(settings)
    kube = Kube(await asyncio.to_thread(load_configuration))
    available = await service_monitor_crd_available(kube)
    logger.info(
        f"ServiceMonitor CRD {'found' if available else 'not found'}; field manager {kube.field_manager}"
    )
    memo.kubellm = OperatorState(
        kube=kube,
        service_monitor_available=available,
        prometheus_url=getattr(memo, "prometheus_url", None) or render_mod.DEFAULT_PROMETHEUS_URL,
        observe_interval=OBSERVE_INTERVAL,
        debounce=OBSERVE_DEBOUNCE,
    )


@kopf.on.cleanup()
async def cleanup(memo: Any, **_: Any) -> None:
    state = getattr(memo, "kubellm", None)
    if state is not None:
        state.kube.close()


def run(
    namespaces: list[str] | None,
    all_namespaces: bool,
    liveness: str | None,
    standalone: bool,
    *,
    metrics_port: int = 0,
    prometheus_url: str = render_mod.DEFAULT_PROMETHEUS_URL,
) -> None:
    """Run the operator until interrupted (``kubellm operator``).

    ``namespaces``: namespaces (or kopf patterns such as ``team-*``) to serve; ``all_namespaces``: serve the
    whole cluster (exactly one of the two must be given). ``liveness``: kopf's liveness endpoint, e.g.
    ``http://0.0.0.0:8080/healthz``. ``standalone``: skip kopf peering (one operator replica).
    ``metrics_port``: serve the operator's Prometheus metrics (:mod:`.metrics`) there, 0 for none.
    ``prometheus_url``: the Prometheus that rendered KEDA ScaledObjects query.
    """
    if all_namespaces and namespaces:
        raise ValueError("pass either namespaces or all_namespaces, not both")
    if not all_namespaces and not namespaces:
        raise ValueError("pass namespaces to watch or all_namespaces")
    metrics.serve(metrics_port)
    kopf.configure(verbose=False)
    kopf.run(
        clusterwide=all_namespaces,
        namespaces=list(namespaces or ()),
        liveness_endpoint=liveness,
        standalone=standalone,
        memo=kopf.Memo(prometheus_url=prometheus_url),
    )
