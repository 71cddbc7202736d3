"""The activator (kubellm.operator.activator): hold, wake, forward, and the 503 bound.

The forwarding tests put a real `kubellm serve` (uvicorn on loopback, tiny Llama) behind the activator and
start it only from the wake call, i.e. after the first request has arrived and is being held.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import aiohttp
import openai
import pytest
import pytest_asyncio
from aiohttp import web

from kubellm.operator.activator import Activator, Target, UnknownTarget, api_keys_from, service_from_host
from server_harness import MODEL_NAME, ServerThread, free_port

# --- naming the Service from the Host header ---------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    ["chat.team-a:8000", "chat.team-a.svc.cluster.local:8000", "Chat.Team-A.svc", "chat.team-a.", "chat.team-a:81"],
)
def test_service_from_host_names_the_service_and_ignores_the_port(host):
    assert service_from_host(host) == ("team-a", "chat")


@pytest.mark.parametrize("host", ["chat", "chat:8000", "", "10.0.0.1:8000", "under_score.ns", "[::1]:80",
                                  "chat.team-a.example.com", "chat.team-a.svc.evil", "a.b.c.d.e.f"])
def test_service_from_host_refuses_a_host_without_namespace_or_outside_the_cluster(host):
    with pytest.raises(UnknownTarget, match="NAME.NAMESPACE"):
        service_from_host(host)


def test_api_keys_are_read_as_the_runtime_reads_them():
    from kubellm.runtime.server.auth import api_keys_from as runtime_keys

    for value in ("k1", " k1 , k2,,", ""):
        assert api_keys_from(value) == runtime_keys(None, {"KUBELLM_API_KEY": value})


def test_the_activator_does_not_import_torch():
    """It runs from the operator image, which has no torch."""
    code = ("import sys; from kubellm.runtime.cli import build_parser; import kubellm.operator.activator; "
            "build_parser().parse_args(['activator']); assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("argv", [["activator"], ["activator", "-n", "ml", "--all-namespaces"]])
def test_the_activator_needs_exactly_one_namespace_scope(argv):
    from kubellm.runtime.cli import build_parser

    args = build_parser().parse_args(argv)
    with pytest.raises(ValueError, match="--namespace NS .* or --all-namespaces"):
        args.func(args)


# --- a running activator ------------------------------------------------------------------------------


class Wakes:
    """A wake callback that records its calls and, if given a server, starts it (once) in the background as
    soon as ``go`` is set (the test decides how many requests must be held first)."""

    def __init__(self, server: ServerThread | None = None) -> None:
        self.server, self.calls, self.started = server, [], None
        self.go = asyncio.Event()

    async def __call__(self, target: Target, waiting: int) -> None:
        self.calls.append((target, waiting))
        if self.server is not None and self.started is None:
            self.started = asyncio.create_task(self._start())

    async def _start(self) -> None:
        await self.go.wait()
        await asyncio.to_thread(self.server.start)


async def start_activator(upstream: str, wakes: Wakes, **kwargs) -> tuple[Activator, web.AppRunner, str]:
    target = Target("ns", "tiny", upstream)
    activator = Activator(lambda _request: target, wakes, poll_interval=0.1, **kwargs)
    runner = web.AppRunner(activator.app(), handler_cancellation=True)  # as activator.serve runs it
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return activator, runner, f"http://127.0.0.1:{port}"


@pytest_asyncio.fixture
async def cold(tiny_llama):
    """An activator in front of a server that is not running: the wake call starts it."""
    server = ServerThread(tiny_llama, probe_skip_window=0.3)
    wakes = Wakes(server)
    activator, runner, url = await start_activator(server.url, wakes, hold_timeout=120)
    yield activator, wakes, server, url
    await runner.cleanup()
    if wakes.started is not None:
        wakes.go.set()
        await wakes.started
    await asyncio.to_thread(server.stop)


async def wait_for_held(activator: Activator, count: int, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while sum(activator.held().values()) < count:
            await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_held_requests_are_all_answered_once_the_server_starts(cold):
    """N concurrent requests (plain and streaming) arrive before any server exists; each gets its answer,
    the same one the server gives directly."""
    activator, wakes, server, url = cold
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = [f"Count to {i}:" for i in range(6)]

    async def plain(prompt: str) -> str:
        r = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0)
        return r.choices[0].text

    async def streamed(prompt: str) -> tuple[str, int]:
        chunks = [c async for c in await client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, stream=True)]  # fmt: skip
        return "".join(c.choices[0].text for c in chunks if c.choices), len(chunks)

    tasks = [asyncio.create_task(plain(p)) for p in prompts[:3]] + [
        asyncio.create_task(streamed(p)) for p in prompts[3:]
    ]
    await wait_for_held(activator, len(prompts))  # all six are held: none was refused or lost
    async with asyncio.timeout(10):  # the activation task calls wake on its own turn of the loop
        while not wakes.calls:
            await asyncio.sleep(0.01)
    assert wakes.calls[0][1] >= 1
    wakes.go.set()  # the "pod" starts now
    answers = await asyncio.gather(*tasks)

    direct = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    for prompt, answer in zip(prompts, answers, strict=True):
        expected = (await direct.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8,
                                                    temperature=0)).choices[0].text
        text = answer if isinstance(answer, str) else answer[0]
        assert text == expected
    assert all(n > 1 for _text, n in answers[3:]), "the streams arrived as one chunk"
    assert activator.held() == {}
    # Once ready, a new request is forwarded at once, without waking anything.
    before = len(wakes.calls)
    assert await plain("Again:") == (await direct.completions.create(
        model=MODEL_NAME, prompt="Again:", max_tokens=8, temperature=0)).choices[0].text  # fmt: skip
    assert len(wakes.calls) == before


@pytest.mark.asyncio
async def test_a_stream_passes_through_event_by_event(cold):
    """The activator writes each upstream chunk as it comes: the client sees the first SSE event before the
    last one was produced."""
    activator, wakes, server, url = cold
    wakes.go.set()
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 64, "temperature": 0, "stream": True,
            "ignore_eos": True}
    seen_running = False
    async with aiohttp.ClientSession() as session, session.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = 0
        async for line in r.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                events += 1
                if events == 1:
                    # Generation is still under way when the first event reaches us.
                    seen_running = server.state.engine.num_running > 0 or server.state.engine.num_waiting > 0
    assert events > 1 and seen_running


@pytest.mark.asyncio
async def test_a_held_request_times_out_with_503_and_retry_after():
    wakes = Wakes()  # wakes nothing: the deployment never comes up
    activator, runner, url = await start_activator(f"http://127.0.0.1:{free_port()}", wakes, hold_timeout=0.5,
                                                   retry_after=7)
    try:
        async with aiohttp.ClientSession() as session, session.post(
            f"{url}/v1/completions", json={"model": "m", "prompt": "x"}
        ) as r:
            assert r.status == 503
            assert r.headers["Retry-After"] == "7"
            error = (await r.json())["error"]
        assert error["code"] == "activation_timeout" and error["type"] == "service_unavailable"
        assert "did not become ready within 0.5s" in error["message"]
        assert activator.registry.get_sample_value(
            "kubellm_activator_requests_total",
            {"namespace": "ns", "name": "tiny", "outcome": "activation_timeout"}) == 1
        assert wakes.calls, "the deployment was never asked to wake"
        # Nothing is left behind: no held count, and the activation task stops with no one waiting.
        assert activator.held() == {}
        gate = next(iter(activator.gates.values()))
        await asyncio.wait_for(gate.activation, timeout=2)
    finally:
        await runner.cleanup()


@pytest.mark.asyncio
async def test_requests_beyond_max_held_get_503_at_once():
    activator, runner, url = await start_activator(f"http://127.0.0.1:{free_port()}", Wakes(), hold_timeout=5,
                                                   max_held=2)
    try:
        async with aiohttp.ClientSession() as session:
            async def post(i: int) -> None:
                async with session.post(f"{url}/v1/completions", json={"prompt": str(i)}):
                    pass

            held = [asyncio.create_task(post(i)) for i in range(2)]
            await wait_for_held(activator, 2)
            async with session.post(f"{url}/v1/completions", json={"prompt": "3"}) as r:
                assert r.status == 503 and "Retry-After" in r.headers
                assert (await r.json())["error"]["code"] == "too_many_waiting"
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)
        # Clients that hang up stop being held at once, long before the 5 s bound.
        async with asyncio.timeout(2):
            while activator.held():
                await asyncio.sleep(0.01)
    finally:
        await runner.cleanup()


@pytest.mark.asyncio
async def test_an_unknown_host_gets_404_in_the_openai_shape():
    def resolve(request: web.Request) -> Target:
        namespace, name = service_from_host(request.host)
        raise UnknownTarget(f"{namespace}/{name} is not served")

    activator = Activator(resolve, Wakes())
    runner = web.AppRunner(activator.app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/v1/models") as r:
            assert r.status == 404
            assert (await r.json())["error"]["code"] == "unknown_deployment"
    finally:
        await runner.cleanup()


@pytest.mark.asyncio
async def test_activity_counts_held_and_forwarded_requests_for_keda():
    """The admin port's /activity/NAMESPACE/NAME (a KEDA metrics-api trigger polls it) counts a request while it
    is held and while its response streams back, and nothing once it is done, for that target only."""
    ready, release = asyncio.Event(), asyncio.Event()

    async def health(_request: web.Request) -> web.Response:
        return web.Response(status=200 if ready.is_set() else 503)

    async def slow(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"first ")
        await release.wait()
        await response.write(b"last")
        return response

    upstream_app = web.Application()
    upstream_app.router.add_get("/health/ready", health)
    upstream_app.router.add_post("/v1/completions", slow)
    upstream = web.AppRunner(upstream_app)
    await upstream.setup()
    upstream_port = free_port()
    await web.TCPSite(upstream, "127.0.0.1", upstream_port).start()
    activator, runner, url = await start_activator(f"http://127.0.0.1:{upstream_port}", Wakes(), hold_timeout=10)
    admin = web.AppRunner(activator.admin_app())
    await admin.setup()
    admin_port = free_port()
    await web.TCPSite(admin, "127.0.0.1", admin_port).start()
    try:
        async with aiohttp.ClientSession() as session:
            async def activity(name: str = "tiny") -> dict:
                async with session.get(f"http://127.0.0.1:{admin_port}/activity/ns/{name}") as r:
                    return await r.json()

            async def healthz() -> int:
                async with session.get(f"http://127.0.0.1:{admin_port}/healthz") as r:
                    return r.status

            assert await healthz() == 200
            assert await activity() == {"requests": 0, "held": 0, "forwarding": 0}

            async def post() -> bytes:
                async with session.post(f"{url}/v1/completions", json={"prompt": "x"}) as r:
                    return await r.read()

            client = asyncio.create_task(post())
            await wait_for_held(activator, 1)
            assert await activity() == {"requests": 1, "held": 1, "forwarding": 0}
            assert await activity("other") == {"requests": 0, "held": 0, "forwarding": 0}
            async with session.get(f"http://127.0.0.1:{admin_port}/metrics") as r:
                exposition = await r.text()
            assert 'kubellm_activator_requests_held{name="tiny",namespace="ns"} 1.0' in exposition
            assert 'kubellm_activator_wakes_total{name="tiny",namespace="ns"} 1.0' in exposition
            ready.set()
            async with asyncio.timeout(10):
                while (await activity())["forwarding"] != 1:
                    await asyncio.sleep(0.02)
            assert await activity() == {"requests": 1, "held": 0, "forwarding": 1}  # streaming back
            release.set()
            assert await client == b"first last"
            assert await activity() == {"requests": 0, "held": 0, "forwarding": 0}
            assert activator.registry.get_sample_value(
                "kubellm_activator_requests_total", {"namespace": "ns", "name": "tiny", "outcome": "forwarded"}) == 1
    finally:
        await runner.cleanup()
        await admin.cleanup()
        await upstream.cleanup()
