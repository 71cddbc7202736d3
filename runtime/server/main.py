"""``kubellm serve``: one process = uvicorn + the engine thread, with drain on SIGTERM.

Start-up: uvicorn listens at once (probes answer 503 "loading"), the model loads on a worker
thread with a progress bar, one real generation runs, then the server reports ready.
Drain: SIGTERM (or POST /admin/drain on the loopback admin listener) → readiness 503 and new requests 503 at once; in-flight
requests finish; after --drain-timeout the rest are aborted (finish_reason "abort"); exit 0.
A second SIGTERM exits immediately.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time

import uvicorn

from kubellm.runtime.engine.config import EngineConfig
from kubellm.runtime.engine.llm_engine import LLMEngine
from kubellm.runtime.server.admin import ADMIN_HOST, DEFAULT_ADMIN_PORT, bind_admin_socket, build_admin_app
from kubellm.runtime.server.app import build_app
from kubellm.runtime.server.async_engine import AsyncEngine
from kubellm.runtime.server.health import probe_generation
from kubellm.runtime.server.metrics import ServerMetrics
from kubellm.runtime.server.state import ServerOptions, ServerState

log = logging.getLogger("kubellm.server")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: SIGTERM means drain, which this module owns."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass


async def run_server(engine_config: EngineConfig, options: ServerOptions, host: str, port: int,
                     on_ready=None, install_signals: bool = True, admin_port: int | None = DEFAULT_ADMIN_PORT) -> int:
    """Serve until drained. ``on_ready(state)`` is called once ready (tests use it to reach the state);
    ``install_signals=False`` lets the server run off the main thread (then drain via the admin listener).
    ``admin_port``: the loopback admin listener's port (0 = any free port, None = no admin listener)."""
    state = ServerState(options)
    admin_sock = None
    if admin_port is not None:
        try:
            admin_sock = bind_admin_socket(admin_port)
        except OSError as e:
            log.error("cannot bind the admin listener on %s:%d (%s): pass --admin-port with a free port, "
                      "0 for any, or -1 for none", ADMIN_HOST, admin_port, e.strerror or e)
            return 1
        state.admin_url = "http://{}:{}".format(*admin_sock.getsockname())
    server = _Server(uvicorn.Config(build_app(state), host=host, port=port, log_config=None, access_log=False,
                                    timeout_keep_alive=30, lifespan="off"))
    admin = _Server(uvicorn.Config(build_admin_app(state), log_config=None, access_log=False, lifespan="off"))
    loop = asyncio.get_running_loop()
    drain_task: asyncio.Task | None = None

    def start_drain(reason: str) -> None:
        nonlocal drain_task
        if drain_task is not None:
            return
        if state.phase != "ready":  # nothing to drain while loading or failed
            log.info("%s before the server was ready: exiting", reason)
            server.should_exit = True
            drain_task = asyncio.ensure_future(asyncio.sleep(0))
            return
        drain_task = asyncio.ensure_future(drain(state, server, reason))

    def on_signal(sig: signal.Signals) -> None:
        if drain_task is not None:
            log.warning("second %s during drain: exiting immediately", sig.name)
            os._exit(1)
        start_drain(sig.name)

    if install_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
    state.on_drain = lambda reason: loop.call_soon_threadsafe(start_drain, reason)  # callable from any thread

    serving = asyncio.ensure_future(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.01)
    if serving.done():
        if admin_sock is not None:
            admin_sock.close()
        return 1  # could not bind
    administering = asyncio.ensure_future(admin.serve(sockets=[admin_sock]) if admin_sock else asyncio.sleep(0))
    log.info("listening on http://%s:%d (loading %s); admin (drain) on %s", host, port, engine_config.model,
             state.admin_url or "none")
    try:
        return await _load_and_serve(state, server, serving, engine_config, options, host, port, on_ready)
    finally:
        admin.should_exit = True
        await administering
        state.workers.shutdown()


async def _load_and_serve(state: ServerState, server: uvicorn.Server, serving: asyncio.Future,
                          engine_config: EngineConfig, options: ServerOptions, host: str, port: int,
                          on_ready) -> int:
    try:
        async_engine = await AsyncEngine.create(lambda: _build_engine(engine_config))
    except Exception as e:
        state.phase, state.load_error = "failed", f"model load failed: {e}"
        log.error("%s", state.load_error)
        server.should_exit = True
        await serving
        return 1
    state.metrics = ServerMetrics(options.served_model_name, async_engine)
    async_engine.on_step = state.metrics.observe_step
    state.engine = async_engine

    ok, detail = await probe_generation(state)
    if not ok:
        state.phase, state.load_error = "failed", f"first generation failed: {detail}"
        log.error("%s", state.load_error)
        server.should_exit = True
    else:
        state.startup_ok, state.phase = True, "ready"
        log.info("ready: serving %s as %r on http://%s:%d", engine_config.model, options.served_model_name, host,
                 port)
        if on_ready is not None:
            on_ready(state)
    await serving
    async_engine.stop()
    state.phase = "stopped"
    log.info("stopped")
    return 0 if state.startup_ok else 1


def _build_engine(config) -> LLMEngine:
    engine = LLMEngine(config, True)
    start = time.monotonic()
    engine.structured_outputs  # noqa: B018 - built now, not in the first structured request's latency
    log.info("grammar engine (llguidance) ready in %.2fs", time.monotonic() - start)
    log.info("warm-up: a full %d-token step took %.2fs", engine.config.max_num_batched_tokens, engine.warmup())
    return engine


async def drain(state: ServerState, server: uvicorn.Server, reason: str) -> None:
    opts, engine = state.options, state.engine
    state.phase = "draining"
    in_flight = engine.num_waiting + engine.num_running
    log.info("drain started (%s): readiness now 503, %d requests in flight, timeout %.0fs", reason, in_flight,
             opts.drain_timeout)
    deadline = time.monotonic() + opts.drain_timeout
    while (engine.num_waiting + engine.num_running or state.active_requests) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    left = engine.num_waiting + engine.num_running
    if left:
        log.warning("drain timeout: aborting %d requests (finish_reason=abort)", left)
        await asyncio.wrap_future(engine.abort_all())
    flush_deadline = time.monotonic() + 5.0  # let aborted streams send their final chunk
    while state.active_requests and time.monotonic() < flush_deadline:
        await asyncio.sleep(0.02)
    log.info("drain complete: shutting down")
    server.should_exit = True
