"""The activator (``kubellm activator``): holds requests for a deployment scaled to zero, wakes it, forwards them.

A small asyncio reverse proxy (aiohttp, which kopf brings along: no torch, so it runs from the operator image).
It sits in front of an LLMDeployment only while that has no ready pod (docs/autoscaling.md, "Scale from zero"):

1. A request arrives. :func:`service_from_host` reads ``name.namespace[.svc…]`` from the ``Host`` header and
   the :class:`Catalog` (a periodic list of the LLMDeployments that opted into scale from zero, in the
   namespaces the activator serves) turns it into a :class:`Target`: the LLMDeployment's own ``<name>-pods``
   Service on the port the operator rendered. Nothing else of the request picks where it goes; a Host the
   catalog does not know gets 404 without any API call.
2. Before anything is held: a body declared over :data:`MAX_BODY_BYTES` gets 413, the deployment's API key
   (``spec.auth.apiKeySecretRef``) is checked (401), then the body is read, counted as it arrives (413 past
   the limit, chunked bodies too; 503 when the bytes held by all requests would pass ``max_buffered``).
3. If the upstream is not known to be ready, the request is *held*: the first held request of a target starts
   one activation task, which calls ``wake(target, waiting)`` (in a cluster :class:`ScaleWaker`: the
   Deployment's scale subresource 0 → 1 and an ``Activated`` Event with the waiting count), repeats it every
   ``wake_interval`` seconds while requests wait, and polls the upstream's ``/health/ready`` until it answers
   200.
4. Then every held request is forwarded. The response streams back chunk by chunk as it arrives (SSE stays
   a stream). A request whose connection is refused (the last pod went away again) is held again: nothing
   of it reached a runtime, so resending it is safe.
5. A request still held after ``hold_timeout`` seconds, one beyond ``max_held`` waiting for the same
   deployment or beyond ``max_held_total`` in all gets 503 with ``Retry-After`` and an OpenAI-style error body.

Per-target state and metric series exist only for catalogued deployments and go when they leave the catalog.
A second port (:meth:`Activator.admin_app`) answers the kubelet's probes, KEDA's ``/activity`` polls (requests
held or still streaming per target, which keep the deployment from being scaled back to zero) and Prometheus;
the chart's NetworkPolicy admits only KEDA and Prometheus to it (docs/operations.md, "The activator").
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily

logger = logging.getLogger(__name__)

READY_PATH = "/health/ready"  # the runtime's readiness probe (a real one-token generation)
MAX_BODY_BYTES = 8 * 2**20  # the same limit as `kubellm serve` (kubellm.runtime.server.state.max_request_bytes)
# Hop-by-hop headers (RFC 9110 7.6.1) belong to one connection; Host and Content-Length are set anew.
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length",
})  # fmt: skip
_SERVICE_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")  # DNS-1035 label
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # DNS-1123 label
_CLUSTER_SUFFIXES = ((), ("svc",), ("svc", "cluster", "local"))  # what may follow name.namespace in a Host
OUTCOMES = ("forwarded", "activation_timeout", "too_many_waiting", "unauthorized", "api_key_unreadable",
            "request_too_large")


@dataclass(frozen=True)
class Target:
    """Where a request goes: the LLMDeployment's Service ``(namespace, name)``, the LLMDeployment's own name,
    the base URL of its pods and the Secret key holding its API keys (None: it asks for none)."""

    namespace: str
    name: str
    upstream: str
    deployment: str = ""  # the LLMDeployment (its Service's name differs for names that are no DNS-1035 label)
    api_key: tuple[str, str] | None = None  # (Secret name, key)

    @property
    def key(self) -> tuple[str, str]:
        return self.namespace, self.name


class UnknownTarget(ValueError):
    """The request names no deployment the activator can serve (answered 404)."""


class Refusal(Exception):
    """A request answered with an error before (or instead of) being held or forwarded."""

    def __init__(self, status: int, message: str, code: str, type_: str, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.type, self.headers = status, message, code, type_, dict(headers or {})

    def response(self) -> web.Response:
        return web.json_response(error_body(self.message, self.code, self.type), status=self.status,
                                 headers=self.headers)  # fmt: skip


DEFAULT_UPSTREAM = "http://{service}.{namespace}.svc:{port}"


def service_from_host(host: str) -> tuple[str, str]:
    """``(namespace, service)`` a ``Host`` header names: ``name.namespace``, ``name.namespace.svc`` or
    ``name.namespace.svc.cluster.local``; its port, if any, is ignored (the operator's Service port is used).

    A bare ``name`` is refused: the activator serves several namespaces and the short name does not say which.
    """
    hostname = (host or "").strip().lower().rpartition("@")[2]
    if hostname.startswith("["):
        hostname = ""  # an IPv6 literal names no Service
    hostname = hostname.partition(":")[0].rstrip(".")
    labels = hostname.split(".")
    if (len(labels) < 2 or tuple(labels[2:]) not in _CLUSTER_SUFFIXES
            or not (_SERVICE_NAME.match(labels[0]) and _NAMESPACE.match(labels[1]))):  # fmt: skip
        raise UnknownTarget(
            f"cannot tell the deployment from Host {host[:100]!r}: call the Service as http://NAME.NAMESPACE:PORT "
            "(or its full name NAME.NAMESPACE.svc.cluster.local)"
        )
    return labels[1], labels[0]


def error_body(message: str, code: str, type_: str = "service_unavailable") -> dict:
    """The OpenAI error shape the runtime answers with (kubellm.runtime.server.errors)."""
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def api_keys_from(value: str) -> tuple[str, ...]:
    """The keys a Secret value holds: one, or several separated by commas (as the runtime reads
    KUBELLM_API_KEY: kubellm.runtime.server.auth.api_keys_from)."""
    return tuple(k.strip() for k in value.split(",") if k.strip())


def bearer_matches(authorization: str, keys: Iterable[str]) -> bool:
    """Whether ``Authorization: Bearer <key>`` carries one of ``keys``, compared in constant time against each."""
    scheme, _, token = authorization.partition(" ")
    given = token.strip().encode()
    return scheme.lower() == "bearer" and any([hmac.compare_digest(given, k.encode()) for k in keys])


Wake = Callable[[Target, int], Awaitable[None]]
# The keys a target accepts, read when a request needs them (None: cannot be told, the request is refused).
KeyReader = Callable[[Target], Awaitable[tuple[str, ...] | None]]


async def _no_keys(_target: Target) -> tuple[str, ...]:
    return ()


@dataclass
class _Gate:
    """Per target: whether its upstream answers, how many requests wait for it, the activation under way."""

    ready: asyncio.Event = field(default_factory=asyncio.Event)
    held: int = 0
    forwarding: int = 0  # requests sent upstream whose response is still streaming back
    activation: asyncio.Task | None = None

    @property
    def idle(self) -> bool:
        return not (self.held or self.forwarding) and (self.activation is None or self.activation.done())


class Activator:
    """The proxy. ``resolve`` maps a request to its :class:`Target` (raise :class:`UnknownTarget` for 404);
    ``wake`` asks for the target's first pod (called again every ``wake_interval`` s while requests wait);
    ``read_keys`` gives the API keys of a target that has a Secret for them. Times are seconds; ``max_held``
    bounds the requests held per deployment, ``max_held_total`` those held in all, ``max_buffered`` the bytes
    of request bodies in memory at once, ``max_body`` one body."""

    def __init__(
        self,
        resolve: Callable[[web.Request], Target],
        wake: Wake,
        *,
        read_keys: KeyReader = _no_keys,
        hold_timeout: float = 300.0,
        max_held: int = 1000,
        max_held_total: int = 2000,
        max_body: int = MAX_BODY_BYTES,
        max_buffered: int = 64 * 2**20,
        poll_interval: float = 0.5,
        wake_interval: float = 10.0,
        retry_after: int = 10,
    ) -> None:
        self.resolve, self.wake, self.read_keys = resolve, wake, read_keys
        self.hold_timeout, self.max_held, self.max_held_total = hold_timeout, max_held, max_held_total
        self.max_body, self.max_buffered, self.buffered = max_body, max_buffered, 0
        self.poll_interval, self.wake_interval, self.retry_after = poll_interval, wake_interval, retry_after
        self.gates: dict[tuple[str, str], _Gate] = {}
        self._labelled: set[tuple[str, str]] = set()  # targets with metric series, for forget_except
        self._session: aiohttp.ClientSession | None = None
        # Its own registry: the admin port's /metrics, and no clash between activators in one process (tests).
        self.registry = CollectorRegistry()
        self.outcomes = Counter("kubellm_activator_requests", "Requests the activator finished, by outcome: "
                                f"{', '.join(OUTCOMES)}, unknown_deployment.",
                                ["namespace", "name", "outcome"], registry=self.registry)  # fmt: skip
        self.wakes = Counter("kubellm_activator_wakes", "Wake calls (scale from zero) made for waiting requests.",
                             ["namespace", "name"], registry=self.registry)  # fmt: skip
        self.registry.register(_InFlight(self))

    # --- the aiohttp application --------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app: web.Application) -> None:
        # No total timeout: a stream lasts as long as generation does. Connecting must be quick, though.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
        self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)

    async def _close(self, _app: web.Application) -> None:
        for gate in self.gates.values():
            if gate.activation is not None:
                gate.activation.cancel()
        if self._session is not None:
            await self._session.close()

    def held(self) -> dict[tuple[str, str], int]:
        """Requests waiting per target ``(namespace, name)`` now."""
        return {t: g.held for t, g in self.gates.items() if g.held}

    def activity(self, namespace: str, name: str) -> dict[str, int]:
        """What the admin port reports for one target: requests held, forwarded and still streaming, and
        their sum (``requests``, which a KEDA metrics-api trigger reads so the deployment is not scaled
        back to zero while the activator has work for it)."""
        gate = self.gates.get((namespace, name))
        held, forwarding = (gate.held, gate.forwarding) if gate else (0, 0)
        return {"requests": held + forwarding, "held": held, "forwarding": forwarding}

    def forget_except(self, keep: Iterable[tuple[str, str]]) -> None:
        """Drop the state and metric series of idle targets not in ``keep`` (deployments gone from the
        catalog), so neither grows with the deployments that come and go."""
        keep = set(keep)
        for key in (self.gates.keys() | self._labelled) - keep:
            if key in self.gates and not self.gates[key].idle:
                continue
            self.gates.pop(key, None)
            self._labelled.discard(key)
            for labels in [(*key, o) for o in OUTCOMES]:
                with contextlib.suppress(KeyError):
                    self.outcomes.remove(*labels)
            with contextlib.suppress(KeyError):
                self.wakes.remove(*key)

    def admin_app(self, ready: Callable[[], bool] = lambda: True) -> web.Application:
        """The admin port: ``/healthz`` for the kubelet (503 until ``ready()``), ``/activity/{namespace}/{name}``
        for KEDA, ``/metrics`` for Prometheus. Apart from the proxy port, whose every path belongs to the
        deployments."""
        async def healthz(_request: web.Request) -> web.Response:
            return web.Response(text="ok") if ready() else web.Response(status=503, text="catalog not loaded yet")

        async def activity(request: web.Request) -> web.Response:
            return web.json_response(self.activity(request.match_info["namespace"], request.match_info["name"]))

        async def metrics(_request: web.Request) -> web.Response:
            return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.router.add_get("/healthz", healthz)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/activity/{namespace}/{name}", activity)
        return app

    # --- one request --------------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            target = self.resolve(request)
        except UnknownTarget as e:
            self.outcomes.labels("", "", "unknown_deployment").inc()
            return web.json_response(error_body(str(e), "unknown_deployment", "invalid_request_error"), status=404)
        try:
            self._check_declared_size(request)
            await self._authorize(request, target)
            async with self._body(request) as body:
                return await self._serve(request, target, body)
        except Refusal as r:
            self._count(target, r.code)
            return r.response()

    def _count(self, target: Target, outcome: str) -> None:
        self._labelled.add(target.key)
        self.outcomes.labels(target.namespace, target.name, outcome).inc()

    def _check_declared_size(self, request: web.Request) -> None:
        if request.content_length is not None and request.content_length > self.max_body:
            raise Refusal(413, f"request body of {request.content_length} bytes is over the limit of "
                          f"{self.max_body} bytes", "request_too_large", "invalid_request_error")  # fmt: skip

    async def _authorize(self, request: web.Request, target: Target) -> None:
        """401 unless the request carries one of the deployment's API keys (when it has a Secret for them)."""
        if target.api_key is None:
            return
        keys = await self.read_keys(target)
        if keys is None:
            raise Refusal(503, f"cannot read the API keys of {target.namespace}/{target.name} (Secret "
                          f"{target.api_key[0]!r}) to check the request; retry later", "api_key_unreadable",
                          "service_unavailable", {"Retry-After": str(self.retry_after)})  # fmt: skip
        if not (keys and bearer_matches(request.headers.get("Authorization", ""), keys)):
            raise Refusal(401, "invalid or missing API key: send `Authorization: Bearer <key>`", "unauthorized",
                          "authentication_error", {"WWW-Authenticate": "Bearer"})  # fmt: skip

    @contextlib.asynccontextmanager
    async def _body(self, request: web.Request):
        """The body, counted while it is read: 413 past ``max_body`` (chunked or not), 503 when the bodies in
        memory would pass ``max_buffered``. Its bytes count until the request is done."""
        body = bytearray()  # grown in place: no second copy of the body, as joining chunks would make
        try:
            async for chunk in request.content.iter_chunked(2**16):
                self.buffered += len(chunk)
                body += chunk
                if len(body) > self.max_body:
                    raise Refusal(413, f"request body is over the limit of {self.max_body} bytes",
                                  "request_too_large", "invalid_request_error")  # fmt: skip
                if self.buffered > self.max_buffered:
                    raise Refusal(503, "the activator holds as many request bytes as it may; retry later",
                                  "too_many_waiting", "service_unavailable",
                                  {"Retry-After": str(self.retry_after)})  # fmt: skip
            yield body
        finally:
            self.buffered -= len(body)

    async def _serve(self, request: web.Request, target: Target, body: bytearray) -> web.StreamResponse:
        deadline = asyncio.get_running_loop().time() + self.hold_timeout
        gate = self.gates.setdefault(target.key, _Gate())
        while True:
            if not gate.ready.is_set():
                await self._hold(target, gate, deadline)
            gate.forwarding += 1
            try:
                response = await self._forward(request, target, body)
                self._count(target, "forwarded")
                return response
            except aiohttp.ClientConnectorError:
                # Refused before anything was sent: the pods went away again. Hold it like a new one.
                logger.info("%s/%s: upstream unreachable, holding the request again", target.namespace, target.name)
                gate.ready.clear()
            finally:
                gate.forwarding -= 1

    async def _hold(self, target: Target, gate: _Gate, deadline: float) -> None:
        """Wait until the target is ready; a 503 :class:`Refusal` when a bound (count or time) is hit."""
        total = sum(g.held for g in self.gates.values())
        if gate.held >= self.max_held or total >= self.max_held_total:
            waiting = (f"{gate.held} requests already wait for {target.namespace}/{target.name}"
                       if gate.held >= self.max_held else f"{total} requests already wait in this activator")
            raise self._unavailable(f"{waiting} to start; retry later", "too_many_waiting")
        gate.held += 1
        try:
            if gate.activation is None or gate.activation.done():
                gate.activation = asyncio.create_task(self._activate(target, gate))
            remaining = deadline - asyncio.get_running_loop().time()
            await asyncio.wait_for(gate.ready.wait(), timeout=max(remaining, 0))
        except TimeoutError:
            raise self._unavailable(
                f"{target.namespace}/{target.name} did not become ready within {self.hold_timeout:g}s of the "
                "request (it was scaled to zero and is starting); retry later", "activation_timeout") from None
        finally:
            gate.held -= 1

    def _unavailable(self, message: str, code: str) -> Refusal:
        return Refusal(503, message, code, "service_unavailable", {"Retry-After": str(self.retry_after)})

    async def _activate(self, target: Target, gate: _Gate) -> None:
        """Wake the target and poll its readiness while anyone waits; open the gate when it answers."""
        loop = asyncio.get_running_loop()
        next_wake = loop.time()
        while gate.held and not gate.ready.is_set():
            if loop.time() >= next_wake:
                next_wake = loop.time() + self.wake_interval
                try:
                    self._labelled.add(target.key)
                    self.wakes.labels(target.namespace, target.name).inc()
                    await self.wake(target, gate.held)
                except Exception:  # noqa: BLE001 - keep polling: the pods may come up anyway, or the next try works
                    logger.exception("waking %s/%s failed", target.namespace, target.name)
            if await self._is_ready(target):
                logger.info("%s/%s is ready: forwarding %d held request(s)", target.namespace, target.name,
                            gate.held)
                gate.ready.set()
                return
            await asyncio.sleep(self.poll_interval)

    async def _is_ready(self, target: Target) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(target.upstream + READY_PATH,
                                         timeout=aiohttp.ClientTimeout(total=30, sock_connect=2)) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _forward(self, request: web.Request, target: Target, body: bytearray) -> web.StreamResponse:
        """Send the request upstream and stream the response back as it comes."""
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        async with self._session.request(request.method, target.upstream + request.path_qs, headers=headers,
                                         data=body, allow_redirects=False) as upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for k, v in upstream.headers.items():
                if k.lower() not in _HOP_BY_HOP:
                    response.headers.add(k, v)
            if upstream.content_length is not None and "Content-Encoding" not in upstream.headers:
                response.content_length = upstream.content_length
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response


class _InFlight:
    """Gauges read at scrape time from the gates: requests held and being forwarded, per target."""

    def __init__(self, activator: Activator) -> None:
        self.activator = activator

    def collect(self):
        held = GaugeMetricFamily("kubellm_activator_requests_held", "Requests waiting for their deployment to "
                                 "become ready.", labels=["namespace", "name"])  # fmt: skip
        forwarding = GaugeMetricFamily("kubellm_activator_requests_forwarding", "Requests forwarded whose "
                                       "response is still streaming back.", labels=["namespace", "name"])  # fmt: skip
        for (namespace, name), g in list(self.activator.gates.items()):
            held.add_metric([namespace, name], g.held)
            forwarding.add_metric([namespace, name], g.forwarding)
        yield held
        yield forwarding


# --------------------------------------------------------------------------------------------------
# In a cluster: the catalog of deployments, their API keys, and waking through the scale subresource
# --------------------------------------------------------------------------------------------------


class Catalog:
    """The LLMDeployments the activator serves: those that scale to zero (``autoscaling.minReplicas`` 0) in
    ``namespaces`` (None: every namespace), by their Service ``(namespace, name)``. :meth:`refresh` lists them
    (every ``refresh_interval`` s in :meth:`run`); looking a Host up costs no API call, so a Host naming
    anything else (another workload, another namespace, a deployment that does not scale to zero) gets 404
    before the activator touches the API. A failed list keeps the previous catalog."""

    def __init__(self, kube, namespaces: list[str] | None, upstream_template: str = DEFAULT_UPSTREAM) -> None:
        self.kube, self.namespaces, self.upstream_template = kube, namespaces, upstream_template
        self.targets: dict[tuple[str, str], Target] = {}
        self.loaded = False

    def resolve(self, request: web.Request) -> Target:
        namespace, service = service_from_host(request.host)
        target = self.targets.get((namespace, service))
        if target is None:
            raise UnknownTarget(f"{service}.{namespace} is no LLMDeployment this activator serves (it serves those "
                                "with autoscaling.minReplicas 0 in the namespaces its chart allows)")
        return target

    async def refresh(self) -> None:
        from kubellm.operator import api

        items: list[dict[str, Any]] = []
        for namespace in self.namespaces if self.namespaces is not None else [None]:
            items += await self.kube.list(api.API_VERSION, api.KIND, namespace, {})
        targets = (self.target_of(item) for item in items)
        self.targets = {t.key: t for t in targets if t is not None}
        self.loaded = True

    def target_of(self, obj: Mapping[str, Any]) -> Target | None:
        """The target of one LLMDeployment object, None unless it is valid and scales to zero."""
        from pydantic import ValidationError

        from kubellm.operator.render import naming
        from kubellm.operator.status import observe

        try:
            ld = observe.parse(obj)
        except ValidationError:
            return None
        if not naming.scales_to_zero(ld) or ld.metadata.get("deletionTimestamp"):
            return None
        namespace = ld.namespace or "default"
        ref = ld.spec.auth.api_key_secret_ref
        upstream = self.upstream_template.format(service=naming.pods_service_name(ld), namespace=namespace,
                                                 port=ld.spec.service.port)  # fmt: skip
        return Target(namespace, naming.child_name(ld), upstream, deployment=ld.name,
                      api_key=(ref.name, ref.key) if ref else None)  # fmt: skip

    async def run(self, activator: Activator, refresh_interval: float) -> None:
        """Refresh forever; after each refresh drop the activator's state for deployments that left."""
        while True:
            try:
                await self.refresh()
                activator.forget_except(self.targets)
            except Exception:  # noqa: BLE001 - keep the last catalog and try again
                logger.exception("listing LLMDeployments failed; keeping the previous catalog")
            await asyncio.sleep(refresh_interval)


class SecretKeys:
    """A target's API keys read from its Secret (``spec.auth.apiKeySecretRef``), each Secret read at most once
    every ``ttl`` seconds however many requests (right or wrong) arrive. None when it cannot be read."""

    def __init__(self, kube, ttl: float = 30.0) -> None:
        self.kube, self.ttl = kube, ttl
        self._cache: dict[tuple[str, str, str], tuple[float, tuple[str, ...] | None]] = {}

    async def __call__(self, target: Target) -> tuple[str, ...] | None:
        assert target.api_key is not None
        where = (target.namespace, *target.api_key)
        now = time.monotonic()
        cached = self._cache.get(where)
        if cached is not None and now - cached[0] < self.ttl:
            return cached[1]
        keys: tuple[str, ...] | None = None
        try:
            secret = await self.kube.get("v1", "Secret", target.namespace, target.api_key[0])
            value = ((secret or {}).get("data") or {}).get(target.api_key[1])
            if value is not None:
                keys = api_keys_from(base64.b64decode(value).decode())
            else:
                logger.warning("%s/%s: Secret %s has no key %r", target.namespace, target.name, *target.api_key)
        except Exception:  # noqa: BLE001 - refuse the request (503), never let it through unchecked
            logger.exception("reading the API keys of %s/%s failed", target.namespace, target.name)
        # Only live targets' Secrets stay: the cache is as bounded as the catalog.
        self._cache = {k: v for k, v in self._cache.items() if now - v[0] < self.ttl}
        self._cache[where] = (now, keys)
        return keys


class ScaleWaker:
    """Wakes a target by scaling its Deployment (named like the Service) from 0 to 1 replica, and posts an
    ``Activated`` Event on the LLMDeployment with the number of waiting requests. A Deployment already above
    zero is left alone: the operator (or the autoscaler) owns every other change of the count."""

    FIELD_MANAGER = "kubellm-activator"

    def __init__(self, kube) -> None:
        self.kube = kube

    async def __call__(self, target: Target, waiting: int) -> None:
        from kubellm.operator import api

        scaled = await self.kube.scale_from_zero("apps/v1", "Deployment", target.namespace, target.name)
        if not scaled:
            return
        logger.info("%s/%s: scaled 0 -> 1 for %d waiting request(s)", target.namespace, target.name, waiting)
        owner = await self.kube.get(api.API_VERSION, api.KIND, target.namespace, target.deployment or target.name)
        if owner is not None:
            await self.kube.post_event(owner, "Normal", "Activated",
                                       f"scaling from zero: {waiting} request(s) waiting in the activator",
                                       component=self.FIELD_MANAGER)


async def serve(activator: Activator, host: str, port: int, admin_port: int | None = None, *,
                ready: Callable[[], bool] = lambda: True) -> None:
    """Serve ``activator`` on host:port (and its admin app on ``admin_port``) until cancelled; the admin
    app's /healthz answers 503 until ``ready()``."""
    # A client that leaves stops being held (and closes its upstream request, which aborts the generation).
    sites = [(web.AppRunner(activator.app(), access_log=None, handler_cancellation=True), host, port)]
    if admin_port is not None:
        sites.append((web.AppRunner(activator.admin_app(ready), access_log=None), host, admin_port))
    try:
        for runner, h, p in sites:
            await runner.setup()
            await web.TCPSite(runner, h, p).start()
            logger.info("activator listening on %s:%d", h, p)
        await asyncio.Event().wait()
    finally:
        for runner, _h, _p in sites:
            with contextlib.suppress(Exception):
                await runner.cleanup()


@dataclass(frozen=True)
class Limits:
    """The activator's bounds (``kubellm activator`` flags): seconds, counts and bytes."""

    hold_timeout: float = 300.0
    max_held: int = 1000
    max_held_total: int = 2000
    max_buffered: int = 64 * 2**20


def run(host: str, port: int, *, namespaces: list[str] | None, limits: Limits, upstream_template: str = DEFAULT_UPSTREAM,
        admin_port: int | None = None, refresh_interval: float = 5.0) -> None:
    """``kubellm activator``: log in to the cluster (in-cluster or kubeconfig) and serve the LLMDeployments
    of ``namespaces`` (None: every namespace) until interrupted."""
    from kubellm.operator.control.kube import Kube

    async def main() -> None:
        kube = await Kube.connect(ScaleWaker.FIELD_MANAGER)
        catalog = Catalog(kube, namespaces, upstream_template)
        try:
            activator = Activator(catalog.resolve, ScaleWaker(kube), read_keys=SecretKeys(kube),
                                  hold_timeout=limits.hold_timeout, max_held=limits.max_held,
                                  max_held_total=limits.max_held_total, max_buffered=limits.max_buffered)  # fmt: skip
            refresher = asyncio.create_task(catalog.run(activator, refresh_interval))
            try:
                await serve(activator, host, port, admin_port, ready=lambda: catalog.loaded)
            finally:
                refresher.cancel()
        finally:
            kube.close()

    asyncio.run(main())
