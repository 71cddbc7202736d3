"""The activator under attack: the real Catalog, SecretKeys and ScaleWaker against kmock (the emulated API server,
see test_operator_kmock.py), the real aiohttp proxy on loopback, and two loopback "upstreams" that record what
reaches them: the port the LLMDeployment's Service renders, and another port a client might name in its Host.

Each attack of issue 25 (section 1) is a request here; the tests check what kmock and the upstreams recorded:
no scale call, no Secret read, no forward where none may happen.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib

import aiohttp
import kubernetes.client
import kubernetes.config
import pytest
import pytest_asyncio
from aiohttp import web
from kmock import ResourceInfo
from test_operator_kmock import CLOSE, DEPLOYMENTS, VERBS, ApiServer, declare_resources, write_kubeconfig

from kubellm.operator import api
from kubellm.operator.activator import MAX_BODY_BYTES, Activator, Catalog, ScaleWaker, SecretKeys
from kubellm.operator.control.kube import Kube
from server_harness import free_port

pytestmark = pytest.mark.kmock(cls=ApiServer)

NS = "ml"
KEY = "sk-right"
SCALE_TO_ZERO = {"enabled": True, "backend": "keda", "minReplicas": 0}


class Upstream:
    """A loopback stand-in for a deployment's pods: records every request; /health/ready is 200 once ``ready``."""

    def __init__(self) -> None:
        self.port, self.ready, self.seen = free_port(), asyncio.Event(), []

    async def start(self) -> web.AppRunner:
        async def any_path(request: web.Request) -> web.Response:
            if request.path == "/health/ready":
                return web.Response(status=200 if self.ready.is_set() else 503)
            self.seen.append((request.method, request.path_qs, await request.read()))
            return web.json_response({"upstream": self.port})

        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", any_path)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        return runner


async def post(server, path: str, body: dict) -> None:
    async with server.post(path, json=body, headers=CLOSE) as resp:
        assert resp.status < 300, await resp.text()


def llmdeployment(name: str, port: int, **spec) -> dict:
    return {"apiVersion": api.API_VERSION, "kind": api.KIND,
            "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1},
            "spec": {"model": {"uri": "hf://org/llama"}, "service": {"port": port}, **spec}}  # fmt: skip


def deployment(namespace: str, name: str) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": namespace, "resourceVersion": "7"}, "spec": {"replicas": 0}}  # fmt: skip


@pytest_asyncio.fixture
async def cluster(kmock, tmp_path):
    """In kmock: `chat` (scale to zero, an API key) and `code` (scale to zero, no key) in ml, `always-on` (no
    scale to zero), and plain Deployments coredns/kube-system and payroll/finance, all at 0 replicas.
    Yields (kmock, activator, proxy URL, admin URL, chat's upstream, the other upstream, catalog)."""
    server = kmock
    declare_resources(server)
    server.resources["apps/v1/deployments"] = ResourceInfo(
        kind="Deployment", namespaced=True, verbs=VERBS, subresources={"status", "scale"})
    server.resources["v1/secrets"] = ResourceInfo(kind="Secret", namespaced=True, verbs=VERBS)
    chat, other = Upstream(), Upstream()
    ld_path = f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{NS}/{api.PLURAL}"
    await post(server, ld_path, llmdeployment("chat", chat.port, autoscaling=SCALE_TO_ZERO,
                                              auth={"apiKeySecretRef": {"name": "chat-key"}}))  # fmt: skip
    await post(server, ld_path, llmdeployment("code", chat.port, autoscaling=SCALE_TO_ZERO))
    await post(server, ld_path, llmdeployment("always-on", chat.port))
    await post(server, f"/api/v1/namespaces/{NS}/secrets", {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "chat-key", "namespace": NS},
        "data": {"api-key": base64.b64encode(f"sk-old, {KEY}".encode()).decode()}})  # fmt: skip
    for namespace, name in ((NS, "chat"), (NS, "code"), (NS, "always-on"), ("kube-system", "coredns"),
                            ("finance", "payroll")):
        await post(server, f"/apis/apps/v1/namespaces/{namespace}/deployments", deployment(namespace, name))

    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(write_kubeconfig(server, tmp_path / "kc", user="activator")),
                                       client_configuration=configuration)  # fmt: skip
    kube = await Kube.connect("kubellm-activator", configuration)
    catalog = Catalog(kube, [NS], upstream_template="http://127.0.0.1:{port}")
    await catalog.refresh()
    activator = Activator(catalog.resolve, ScaleWaker(kube), read_keys=SecretKeys(kube), hold_timeout=10,
                          max_held=2, max_held_total=3, poll_interval=0.05)  # fmt: skip
    runners = [await chat.start(), await other.start()]
    urls = []
    for app in (activator.app(), activator.admin_app()):
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{port}")
    try:
        yield server, activator, urls[0], urls[1], chat, other, catalog
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
        kube.close()


def api_calls(server) -> list[tuple[str, str]]:
    return [(r.method.value, r.url.path) for r in list(server)]


def scale_calls(server) -> list[tuple[str, str]]:
    return [c for c in api_calls(server) if c[1].endswith("/scale")]


async def send(session, url: str, host: str, *, method: str = "POST", path: str = "/v1/completions",
               key: str | None = KEY, **kwargs) -> tuple[int, dict]:  # fmt: skip
    headers = {"Host": host, **({"Authorization": f"Bearer {key}"} if key else {})}
    async with session.request(method, url + path, headers=headers, **kwargs) as r:
        return r.status, await r.json()


@pytest.mark.asyncio
@pytest.mark.parametrize("host", [
    "coredns.kube-system", "payroll.finance.svc.cluster.local:443", "always-on.ml", "chat-pods.ml", "chat",
    "kubernetes.default.svc", "chat.ml.evil.example", "10.0.0.1:8000",
])  # fmt: skip
async def test_a_host_naming_anything_but_a_served_deployment_gets_404_without_any_api_call(cluster, host):
    server, activator, url, _admin, chat, other, _ = cluster
    before = len(list(server))
    async with aiohttp.ClientSession() as session:
        status, body = await send(session, url, host, method="DELETE", path="/admin/secret?x=1")
    assert status == 404 and body["error"]["code"] == "unknown_deployment"
    await asyncio.sleep(0.2)  # an activation, had one started, would have called by now
    assert len(list(server)) == before, api_calls(server)[before:]
    assert not scale_calls(server)
    assert chat.seen == other.seen == [] and activator.gates == {}
    coredns = server.objects[DEPLOYMENTS, "kube-system", "coredns"].raw
    assert coredns["spec"]["replicas"] == 0


@pytest.mark.asyncio
async def test_the_port_in_the_host_neither_picks_the_upstream_nor_escapes_max_held(cluster):
    """Ports 81-84 in the Host are one deployment: two are held (max_held 2), two get 503; once the pods are
    ready the held ones reach the port the LLMDeployment renders, never the one the client named."""
    server, activator, url, _admin, chat, other, _ = cluster
    async with aiohttp.ClientSession() as session:
        held = [asyncio.create_task(send(session, url, f"chat.ml:{p}", method="DELETE", path=f"/admin/x?p={p}"))
                for p in (81, 82)]  # fmt: skip
        async with asyncio.timeout(5):
            while sum(activator.held().values()) < 2:
                await asyncio.sleep(0.01)
        for port in (83, other.port):
            status, body = await send(session, url, f"chat.ml:{port}")
            assert status == 503 and body["error"]["code"] == "too_many_waiting"
        # The global cap: one more for `code` fits (3 in all), the next does not.
        code = asyncio.create_task(send(session, url, "code.ml", key=None))
        async with asyncio.timeout(5):
            while sum(activator.held().values()) < 3:
                await asyncio.sleep(0.01)
        status, body = await send(session, url, "code.ml:84", key=None)
        assert status == 503 and "3 requests already wait in this activator" in body["error"]["message"]
        chat.ready.set()
        answers = await asyncio.gather(*held, code)
    assert [a[0] for a in answers] == [200, 200, 200]
    assert all(a[1] == {"upstream": chat.port} for a in answers)
    assert sorted(p for _m, p, _b in chat.seen if p.startswith("/admin")) == ["/admin/x?p=81", "/admin/x?p=82"]
    assert other.seen == []
    # Woken through the scale subresource of the deployments named by the catalog, nothing else.
    assert {path for _m, path in scale_calls(server)} <= {
        f"/apis/apps/v1/namespaces/{NS}/deployments/chat/scale", f"/apis/apps/v1/namespaces/{NS}/deployments/code/scale"}
    assert server.objects[DEPLOYMENTS, NS, "chat"].raw["spec"]["replicas"] == 1


@pytest.mark.asyncio
async def test_a_missing_or_wrong_api_key_gets_401_and_wakes_nothing(cluster):
    server, activator, url, _admin, chat, _other, _ = cluster
    async with aiohttp.ClientSession() as session:
        for key in (None, "sk-wrong", f"{KEY}x", "") * 5:
            status, body = await send(session, url, "chat.ml", key=key)
            assert status == 401 and body["error"]["type"] == "authentication_error"
    await asyncio.sleep(0.2)
    assert not scale_calls(server) and chat.seen == [] and activator.held() == {}
    secret_reads = [c for c in api_calls(server) if "/secrets/" in c[1]]
    assert len(secret_reads) == 1, "the Secret is read once, not once per guess"
    assert server.objects[DEPLOYMENTS, NS, "chat"].raw["spec"]["replicas"] == 0


async def raw_request(url: str, head: str, chunks, total: int) -> bytes:
    """Send ``head`` then ``chunks`` (bytes) up to ``total`` bytes on a raw connection; return what came back.
    The server may answer and close before all of it is sent, which is the point."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))

    async def write() -> None:
        with contextlib.suppress(ConnectionError):
            writer.write(head.encode())
            sent = 0
            while sent < total:
                chunk = chunks(min(2**20, total - sent))
                writer.write(chunk)
                await writer.drain()
                sent += 2**20

    sender = asyncio.create_task(write())
    try:
        async with asyncio.timeout(20):
            answer = await reader.read(65536)
    finally:
        sender.cancel()
        writer.close()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await sender
    return answer


@pytest.mark.asyncio
@pytest.mark.parametrize("chunked", [False, True])
async def test_a_64_mib_body_gets_413_and_is_never_held(cluster, chunked):
    server, activator, url, _admin, chat, _other, _ = cluster
    size = 64 * 2**20
    if chunked:
        head = ("POST /v1/completions HTTP/1.1\r\nHost: chat.ml\r\nAuthorization: Bearer sk-right\r\n"
                "Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip

        def chunks(n: int) -> bytes:
            return f"{n:x}\r\n".encode() + b"x" * n + b"\r\n"
    else:
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: chat.ml\r\nAuthorization: Bearer sk-right\r\n"
                f"Content-Length: {size}\r\n\r\n")  # fmt: skip

        def chunks(n: int) -> bytes:
            return b"x" * n

    answer = await raw_request(url, head, chunks, size)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b'"code": "request_too_large"' in answer and str(MAX_BODY_BYTES).encode() in answer
    await asyncio.sleep(0.2)
    assert not scale_calls(server) and chat.seen == [] and activator.buffered == 0 and activator.held() == {}


@pytest.mark.asyncio
async def test_300_distinct_hosts_leave_no_state_and_no_metric_series(cluster):
    server, activator, url, admin, _chat, _other, catalog = cluster
    before = len(list(server))
    async with aiohttp.ClientSession() as session:
        for i in range(300):
            status, _ = await send(session, url, f"svc-{i}.ns-{i}:{1000 + i}")
            assert status == 404
        async with session.get(f"{admin}/metrics") as r:
            series = [line for line in (await r.text()).splitlines()
                      if line.startswith("kubellm_activator_") and "_created" not in line]  # fmt: skip
    assert activator.gates == {} and len(list(server)) == before
    assert series == ['kubellm_activator_requests_total{name="",namespace="",outcome="unknown_deployment"} 300.0']

    # A deployment that leaves the catalog takes its state and series with it.
    async with aiohttp.ClientSession() as session:
        assert (await send(session, url, "chat.ml", key="bad"))[0] == 401
    assert activator.registry.get_sample_value(
        "kubellm_activator_requests_total", {"namespace": NS, "name": "chat", "outcome": "unauthorized"}) == 1
    async with server.delete(f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{NS}/{api.PLURAL}/chat",
                             headers=CLOSE) as resp:  # fmt: skip
        assert resp.status < 300
    await catalog.refresh()
    activator.forget_except(catalog.targets)
    assert (NS, "chat") not in catalog.targets and (NS, "code") in catalog.targets
    assert activator.registry.get_sample_value(
        "kubellm_activator_requests_total", {"namespace": NS, "name": "chat", "outcome": "unauthorized"}) is None


@pytest.mark.asyncio
async def test_the_proxy_port_does_not_answer_for_the_admin_port(cluster):
    """/activity and /metrics are the admin port's (which the chart's NetworkPolicy admits KEDA and Prometheus
    to); on the proxy port they are paths of a deployment like any other."""
    server, activator, url, admin, chat, _other, _ = cluster
    async with aiohttp.ClientSession() as session:
        for path in (f"/activity/{NS}/chat", "/metrics", "/healthz"):
            status, body = await send(session, url, "kubellm-activator.kubellm-system", method="GET", path=path)
            assert status == 404 and body["error"]["code"] == "unknown_deployment"
        async with session.get(f"{admin}/activity/{NS}/chat") as r:
            assert await r.json() == {"requests": 0, "held": 0, "forwarding": 0}
    assert not scale_calls(server) and chat.seen == []


@pytest.mark.asyncio
async def test_a_catalog_of_every_namespace_lists_them_all_and_one_of_a_namespace_only_that_one(cluster):
    _server, _activator, _url, _admin, _chat, _other, catalog = cluster
    everywhere = Catalog(catalog.kube, None)
    await everywhere.refresh()
    assert set(everywhere.targets) == {(NS, "chat"), (NS, "code")}
    elsewhere = Catalog(catalog.kube, ["finance"])
    await elsewhere.refresh()
    assert elsewhere.targets == {} and elsewhere.loaded
