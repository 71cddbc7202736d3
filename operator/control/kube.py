"""API access for the operator: the official client's dynamic client behind a small async surface.

The ``kubernetes`` package's :class:`~kubernetes.dynamic.DynamicClient` finds each kind's resource (plural,
scope, group path) through API discovery, so a new child kind needs no table here, and it speaks server-side
apply. It is synchronous: every call runs in a worker thread (``asyncio.to_thread``) so the event loop kopf
shares with the handlers never blocks. Objects come back as plain JSON dicts. Failures become
:class:`ApiError` (counted in the operator's metrics); a kind the server does not serve reads as "none".
Why this client and not an asyncio one: docs/architecture.md, "API access".
"""

from __future__ import annotations

import asyncio
import datetime
import json
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import kubernetes
import urllib3
from kubernetes.dynamic import DynamicClient, LazyDiscoverer
from kubernetes.dynamic.exceptions import DynamicApiError, ResourceNotFoundError

from kubellm.operator.control import metrics

REQUEST_TIMEOUT = (10.0, 60.0)  # seconds: connect, read
REDISCOVER_AFTER = 30.0  # seconds: how soon a kind the server did not serve is looked for again


class ApiError(Exception):
    """A failed API request (``status`` 0: the server could not be reached)."""

    def __init__(self, status: int, reason: str, message: str, method: str = "", path: str = "") -> None:
        self.status, self.reason, self.message = status, reason, message
        where = f"{method} {path}: " if method else ""
        super().__init__(f"{where}{status} {reason}: {message}" if status else f"{where}{reason}: {message}")

    @property
    def not_found(self) -> bool:
        return self.status == 404


class _MemoryDiscoverer(LazyDiscoverer):
    """Discovery kept in this process: the library's default also writes it to a file under /tmp that every
    process talking to the same server shares, and reads it back stale after a CRD is installed.

    The library re-reads all of discovery whenever a kind is not found. Here that happens at most once every
    :data:`REDISCOVER_AFTER` seconds: the optional kinds every reconcile lists (KEDA's ScaledObject, the
    Prometheus operator's ServiceMonitor) cost no requests while they are not installed, and a CRD installed
    later is found within that time."""

    _rediscovered_at = float("-inf")

    def _write_cache(self) -> None:
        pass

    def invalidate_cache(self) -> None:
        now = time.monotonic()
        if now - self._rediscovered_at >= REDISCOVER_AFTER:
            self._rediscovered_at = now
            super().invalidate_cache()


def _plain(_client: Any, data: Any) -> Any:
    return data  # the dynamic client's serializer hook: keep JSON as dicts


def load_configuration() -> kubernetes.client.Configuration:
    """The client configuration: in-cluster (service account) first, else the kubeconfig."""
    cfg = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=cfg)
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(client_configuration=cfg)
    return cfg


def _error(method: str, what: str, e: Exception) -> ApiError:
    if isinstance(e, DynamicApiError):
        reason, message = e.reason or "Error", (e.body.decode(errors="replace") if isinstance(e.body, bytes) else str(e.body or ""))[:500]
        try:
            payload = json.loads(e.body or b"")
            reason, message = payload.get("reason") or reason, payload.get("message") or message
        except (ValueError, AttributeError, TypeError):
            pass
        metrics.count_api_error(method, e.status)
        return ApiError(e.status, str(reason), str(message), method, what)
    metrics.count_api_error(method, 0)
    return ApiError(0, type(e).__name__, str(e), method, what)


class Kube:
    """The operator's API access: get, list, server-side apply, delete and status patches by apiVersion/kind."""

    def __init__(self, client: DynamicClient, field_manager: str) -> None:
        self.client = client
        self.field_manager = field_manager
        self._discovery = threading.Lock()  # the library's discovery cache is not thread-safe

    @classmethod
    async def connect(cls, field_manager: str, configuration: kubernetes.client.Configuration | None = None) -> Kube:
        """Log in (in-cluster or kubeconfig) and read the server's API groups; raises :class:`ApiError`."""

        def make() -> DynamicClient:
            cfg = configuration or load_configuration()
            cfg.retries = False  # kopf retries whole handlers, with backoff
            api_client = kubernetes.client.ApiClient(cfg)
            api_client.user_agent = field_manager
            cache = f"/nonexistent/kubellm-discovery-{id(api_client)}.json"  # never read: see _MemoryDiscoverer
            return DynamicClient(api_client, cache_file=cache, discoverer=_MemoryDiscoverer)

        try:
            client = await asyncio.to_thread(make)
        except (DynamicApiError, urllib3.exceptions.HTTPError) as e:
            raise _error("GET", "/apis (discovery)", e) from e
        return cls(client, field_manager)

    def close(self) -> None:
        """Close the pooled connections."""
        self.client.client.close()

    async def _call(self, method: str, api_version: str, kind: str, call: Callable[[Any], Any]) -> Any:
        """``call(resource)`` in a thread, the resource discovered; None when the kind is not served."""

        def run() -> Any:
            try:
                with self._discovery:
                    resource = self.client.resources.get(api_version=api_version, kind=kind)
            except ResourceNotFoundError:
                return None
            return call(resource)

        try:
            return await asyncio.to_thread(run)
        except (DynamicApiError, urllib3.exceptions.HTTPError) as e:
            raise _error(method, f"{kind}.{api_version}", e) from e

    async def serves(self, api_version: str, kind: str) -> bool:
        """Whether the server serves this kind (e.g. ServiceMonitor, when the Prometheus operator is there)."""
        return await self._call("GET", api_version, kind, lambda _resource: True) is True

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it (or its kind) does not exist."""
        try:
            return await self._call("GET", api_version, kind, lambda r: self.client.get(
                r, name=name, namespace=namespace, serializer=_plain, _request_timeout=REQUEST_TIMEOUT))  # fmt: skip
        except ApiError as e:
            if e.not_found:
                return None
            raise

    async def list(
        self, api_version: str, kind: str, namespace: str, selector: Mapping[str, str]
    ) -> list[dict[str, Any]]:
        """Objects of a kind in a namespace whose labels match ``selector`` ([] when the kind is not served).
        The selector is also checked here, so a server that ignores labelSelector gives the same answer."""
        label_selector = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        result = await self._call("GET", api_version, kind, lambda r: self.client.get(
            r, namespace=namespace, label_selector=label_selector, serializer=_plain,
            _request_timeout=REQUEST_TIMEOUT))  # fmt: skip
        items = (result or {}).get("items") or []
        return [i for i in items if matches(i, selector)]

    async def find(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object of that name, found with ``list`` (a field selector) so that no ``get`` must be granted;
        None when there is none or the kind is not served."""
        result = await self._call("GET", api_version, kind, lambda r: self.client.get(
            r, namespace=namespace, field_selector=f"metadata.name={name}", serializer=_plain,
            _request_timeout=REQUEST_TIMEOUT))  # fmt: skip
        items = (result or {}).get("items") or []
        return next((i for i in items if (i.get("metadata") or {}).get("name") == name), None)

    async def apply(self, obj: Mapping[str, Any], field_manager: str | None = None) -> dict[str, Any]:
        """Server-side apply: the object is what this field manager wants; conflicts are forced."""
        meta = obj["metadata"]
        applied = await self._call("PATCH", obj["apiVersion"], obj["kind"], lambda r: self.client.server_side_apply(
            r, body=dict(obj), name=meta["name"], namespace=meta.get("namespace"),
            field_manager=field_manager or self.field_manager, force_conflicts="true", serializer=_plain,
            _request_timeout=REQUEST_TIMEOUT))  # fmt: skip
        if applied is None:
            raise ApiError(404, "NotFound", f"the server does not serve {obj['kind']}.{obj['apiVersion']}", "PATCH")
        return applied

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        """Delete in the background (dependents go later); gone already is fine."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        try:
            await self._call("DELETE", api_version, kind, lambda r: self.client.delete(
                r, name=name, namespace=namespace, body=body, serializer=_plain,
                _request_timeout=REQUEST_TIMEOUT))  # fmt: skip
        except ApiError as e:
            if not e.not_found:
                raise

    async def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> None:
        """A JSON merge patch of the status subresource."""
        await self._call("PATCH", api_version, kind, lambda r: self.client.request(
            "patch", r.path(name=name, namespace=namespace) + "/status", body=dict(patch),
            content_type="application/merge-patch+json", serializer=_plain,
            _request_timeout=REQUEST_TIMEOUT))  # fmt: skip

    async def scale_from_zero(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Set the scale subresource to 1 replica if it is at 0; whether this call did it. The patch carries
        the resourceVersion read, so it never overwrites a count someone else set in between."""

        def run(r: Any) -> bool:
            path = r.path(name=name, namespace=namespace) + "/scale"
            scale = self.client.request("get", path, serializer=_plain, _request_timeout=REQUEST_TIMEOUT)
            if (scale.get("spec") or {}).get("replicas", 0) != 0:
                return False
            patch = {"metadata": {"resourceVersion": scale["metadata"]["resourceVersion"]}, "spec": {"replicas": 1}}
            self.client.request("patch", path, body=patch, content_type="application/merge-patch+json",
                                serializer=_plain, _request_timeout=REQUEST_TIMEOUT)
            return True

        try:
            return bool(await self._call("PATCH", api_version, kind, run))
        except ApiError as e:
            if e.status == 409 or e.not_found:  # someone scaled it meanwhile, or it is gone: nothing to wake
                return False
            raise

    async def post_event(
        self, about: Mapping[str, Any], type_: str, reason: str, message: str, *, component: str
    ) -> None:
        """Create a core/v1 Event about ``about`` (an object with apiVersion, kind and metadata)."""
        meta = about["metadata"]
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta.get("namespace")},
            "involvedObject": {"apiVersion": about["apiVersion"], "kind": about["kind"], "name": meta["name"],
                               "namespace": meta.get("namespace"), "uid": meta.get("uid")},
            "type": type_, "reason": reason, "message": message, "source": {"component": component},
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }  # fmt: skip
        await self._call("POST", "v1", "Event", lambda r: self.client.create(
            r, body=event, namespace=meta.get("namespace"), serializer=_plain,
            _request_timeout=REQUEST_TIMEOUT))  # fmt: skip


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
