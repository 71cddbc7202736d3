"""The activator (``kubellm activator``): holds requests for a deployment scaled to zero, wakes it, forwards them.

A small asyncio reverse proxy (aiohttp, which kopf brings along: no torch, so it runs from the operator image).
It sits in front of an LLMDeployment only while that has no ready pod (docs/autoscaling.md, "Scale from zero"):

1. A request arrives. :func:`target_from_host` names the LLMDeployment from the ``Host`` header
   (``name.namespace[.svc…][:port]``) and the upstream to forward to.
2. If the upstream is not known to be ready, the request is *held*: the first held request of a target starts
   one activation task, which calls ``wake(target, waiting)`` (in a cluster :class:`ScaleWaker`: the
   Deployment's scale subresource 0 → 1 and an ``Activated`` Event with the waiting count), repeats it every
   ``wake_interval`` seconds while requests wait, and polls the upstream's ``/health/ready`` until it answers
   200.
3. Then every held request is forwarded. The response streams back chunk by chunk as it arrives (SSE stays
   a stream). A request whose connection is refused (the last pod went away again) is held again: nothing
   of it reached a runtime, so resending it is safe.
4. A request still held after ``hold_timeout`` seconds, or one beyond ``max_held`` waiting for the same
   target, gets 503 with ``Retry-After`` and an OpenAI-style error body.

A second port (:meth:`Activator.admin_app`) answers the kubelet's probes, KEDA's ``/activity`` polls (requests
held or still streaming per target, which keep the deployment from being scaled back to zero) and Prometheus.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily

logger = logging.getLogger(__name__)

READY_PATH = "/health/ready"  # the runtime's readiness probe (a real one-token generation)
# Hop-by-hop headers (RFC 9110 7.6.1) belong to one connection; Host and Content-Length are set anew.
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length",
})  # fmt: skip
_SERVICE_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")  # DNS-1035 label
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # DNS-1123 label


@dataclass(frozen=True)
class Target:
    """Where a request goes: the LLMDeployment's Service ``(namespace, name)`` and the base URL of its pods."""

    namespace: str
    name: str
    upstream: str


class UnknownTarget(ValueError):
    """The request names no deployment the activator can serve (answered 404)."""


DEFAULT_UPSTREAM = "http://{name}-pods.{namespace}.svc:{port}"


def target_from_host(host: str, upstream_template: str = DEFAULT_UPSTREAM, default_port: int = 80) -> Target:
    """The target a ``Host`` header names: ``name.namespace``, ``name.namespace.svc``, … (an optional port).

    A bare ``name`` is refused: the activator serves many namespaces and the short name does not say which.
    ``upstream_template`` is formatted with ``name``, ``namespace`` and ``port`` (the port the client called).
    """
    hostname, _, port = (host or "").strip().lower().partition(":")
    labels = hostname.rstrip(".").split(".")
    if len(labels) < 2 or not (_SERVICE_NAME.match(labels[0]) and _NAMESPACE.match(labels[1])):
        raise UnknownTarget(
            f"cannot tell the deployment from Host {host!r}: call the Service as http://NAME.NAMESPACE:PORT "
            "(or its full name NAME.NAMESPACE.svc.cluster.local)"
        )
    name, namespace = labels[0], labels[1]
    port_number = int(port) if port.isdigit() else default_port
    return Target(namespace, name, upstream_template.format(name=name, namespace=namespace, port=port_number))


def error_body(message: str, code: str, type_: str = "service_unavailable") -> dict:
    """The OpenAI error shape the runtime answers with (kubellm.runtime.server.errors)."""
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


Wake = Callable[[Target, int], Awaitable[None]]


@dataclass
class _Gate:
    """Per target: whether its upstream answers, how many requests wait for it, the activation under way."""

    ready: asyncio.Event = field(default_factory=asyncio.Event)
    held: int = 0
    forwarding: int = 0  # requests sent upstream whose response is still streaming back
    activation: asyncio.Task | None = None


class Activator:
    """The proxy. ``resolve`` maps a request to its :class:`Target` (raise :class:`UnknownTarget` for 404);
    ``wake`` asks for the target's first pod (called again every ``wake_interval`` s while requests wait).
    Times are seconds."""

    def __init__(
        self,
        resolve: Callable[[web.Request], Target],
        wake: Wake,
        *,
        hold_timeout: float = 300.0,
        max_held: int = 1000,
        poll_interval: float = 0.5,
        wake_interval: float = 10.0,
        retry_after: int = 10,
    ) -> None:
        self.resolve, self.wake = resolve, wake
        self.hold_timeout, self.max_held = hold_timeout, max_held
        self.poll_interval, self.wake_interval, self.retry_after = poll_interval, wake_interval, retry_after
        self.gates: dict[Target, _Gate] = {}
        self._session: aiohttp.ClientSession | None = None
        # Its own registry: the admin port's /metrics, and no clash between activators in one process (tests).
        self.registry = CollectorRegistry()
        self.outcomes = Counter("kubellm_activator_requests", "Requests the activator finished, by outcome: "
                                "forwarded, activation_timeout, too_many_waiting, unknown_deployment.",
                                ["namespace", "name", "outcome"], registry=self.registry)  # fmt: skip
        self.wakes = Counter("kubellm_activator_wakes", "Wake calls (scale from zero) made for waiting requests.",
                             ["namespace", "name"], registry=self.registry)  # fmt: skip
        self.registry.register(_InFlight(self))

    # --- the aiohttp application --------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
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

    def held(self) -> dict[Target, int]:
        """Requests waiting per target now."""
        return {t: g.held for t, g in self.gates.items() if g.held}

    def activity(self, namespace: str, name: str) -> dict[str, int]:
        """What the admin port reports for one target: requests held, forwarded and still streaming, and
        their sum (``requests``, which a KEDA metrics-api trigger reads so the deployment is not scaled
        back to zero while the activator has work for it)."""
        held = forwarding = 0
        for t, g in self.gates.items():
            if (t.namespace, t.name) == (namespace, name):
                held, forwarding = held + g.held, forwarding + g.forwarding
        return {"requests": held + forwarding, "held": held, "forwarding": forwarding}

    def admin_app(self) -> web.Application:
        """The admin port: ``/healthz`` for the kubelet, ``/activity/{namespace}/{name}`` for KEDA, ``/metrics``
        for Prometheus. Apart from the proxy port, whose every path belongs to the deployments."""
        async def healthz(_request: web.Request) -> web.Response:
            return web.Response(text="ok")

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
        body = await request.read()
        deadline = asyncio.get_running_loop().time() + self.hold_timeout
        gate = self.gates.setdefault(target, _Gate())
        while True:
            if not gate.ready.is_set():
                refusal = await self._hold(target, gate, deadline)
                if refusal is not None:
                    message, code = refusal
                    self.outcomes.labels(target.namespace, target.name, code).inc()
                    return self._unavailable(message, code)
            gate.forwarding += 1
            try:
                response = await self._forward(request, target, body)
                self.outcomes.labels(target.namespace, target.name, "forwarded").inc()
                return response
            except aiohttp.ClientConnectorError:
                # Refused before anything was sent: the pods went away again. Hold it like a new one.
                logger.info("%s/%s: upstream unreachable, holding the request again", target.namespace, target.name)
                gate.ready.clear()
            finally:
                gate.forwarding -= 1

    async def _hold(self, target: Target, gate: _Gate, deadline: float) -> tuple[str, str] | None:
        """Wait until the target is ready; (message, code) of the 503 instead when the bound (count or time) is hit."""
        if gate.held >= self.max_held:
            return (
                f"{gate.held} requests already wait for {target.namespace}/{target.name} to start; retry later",
                "too_many_waiting")
        gate.held += 1
        try:
            if gate.activation is None or gate.activation.done():
                gate.activation = asyncio.create_task(self._activate(target, gate))
            remaining = deadline - asyncio.get_running_loop().time()
            await asyncio.wait_for(gate.ready.wait(), timeout=max(remaining, 0))
            return None
        except TimeoutError:
            return (
                f"{target.namespace}/{target.name} did not become ready within {self.hold_timeout:g}s of the "
                "request (it was scaled to zero and is starting); retry later", "activation_timeout")
        finally:
            gate.held -= 1

    def _unavailable(self, message: str, code: str) -> web.Response:
        return web.json_response(error_body(message, code), status=503,
                                 headers={"Retry-After": str(self.retry_after)})

    async def _activate(self, target: Target, gate: _Gate) -> None:
        """Wake the target and poll its readiness while anyone waits; open the gate when it answers."""
        loop = asyncio.get_running_loop()
        next_wake = loop.time()
        while gate.held and not gate.ready.is_set():
            if loop.time() >= next_wake:
                next_wake = loop.time() + self.wake_interval
                try:
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

    async def _forward(self, request: web.Request, target: Target, body: bytes) -> web.StreamResponse:
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
        for t, g in list(self.activator.gates.items()):
            held.add_metric([t.namespace, t.name], g.held)
            forwarding.add_metric([t.namespace, t.name], g.forwarding)
        yield held
        yield forwarding


# --------------------------------------------------------------------------------------------------
# In a cluster: wake through the Deployment's scale subresource
# --------------------------------------------------------------------------------------------------


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
        owner = await self.kube.get(api.API_VERSION, api.KIND, target.namespace, target.name)
        if owner is not None:
            await self.kube.post_event(owner, "Normal", "Activated",
                                       f"scaling from zero: {waiting} request(s) waiting in the activator",
                                       component=self.FIELD_MANAGER)


async def serve(activator: Activator, host: str, port: int, admin_port: int | None = None) -> None:
    """Serve ``activator`` on host:port (and its admin app on ``admin_port``) until cancelled."""
    # A client that leaves stops being held (and closes its upstream request, which aborts the generation).
    runners = [web.AppRunner(activator.app(), access_log=None, handler_cancellation=True)]
    if admin_port is not None:
        runners.append(web.AppRunner(activator.admin_app(), access_log=None))
    try:
        for runner, p in zip(runners, (port, admin_port), strict=False):
            await runner.setup()
            await web.TCPSite(runner, host, p).start()
            logger.info("activator listening on %s:%d", host, p)
        await asyncio.Event().wait()
    finally:
        for runner in runners:
            with contextlib.suppress(Exception):
                await runner.cleanup()


def run(
    host: str, port: int, *, upstream_template: str, hold_timeout: float, max_held: int, admin_port: int | None = None
) -> None:
    """``kubellm activator``: log in to the cluster (in-cluster or kubeconfig) and serve until interrupted."""
    from kubellm.operator.kube import Kube

    async def main() -> None:
        kube = await Kube.connect(ScaleWaker.FIELD_MANAGER)
        try:
            activator = Activator(lambda r: target_from_host(r.host, upstream_template),
                                  ScaleWaker(kube), hold_timeout=hold_timeout, max_held=max_held)
            await serve(activator, host, port, admin_port)
        finally:
            kube.close()

    asyncio.run(main())
