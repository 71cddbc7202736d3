"""Probes and metrics: ``/health/{live,ready,startup}`` and ``/metrics``, open to the kubelet and Prometheus.

Readiness runs a real one-token generation (skipped while tokens are flowing); liveness reads the engine
loop's heartbeat; startup turns green once the model loaded and the first generation succeeded.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from kubellm.runtime.sampling.params import SamplingParams
from kubellm.runtime.server.metrics import CONTENT_TYPE
from kubellm.runtime.server.protocol import new_id
from kubellm.runtime.server.state import ServerState

PROBE_PROMPT = "ping"


def health_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health/live")
    async def live():
        if state.phase == "failed":
            return JSONResponse({"status": "failed", "reason": state.load_error}, status_code=503)
        if state.engine is None:  # still loading: the startup probe decides, not liveness
            return {"status": "loading"}
        age = time.monotonic() - state.engine.heartbeat
        if not state.engine.alive or age > state.options.liveness_timeout:
            return JSONResponse({"status": "wedged", "reason": f"engine loop heartbeat is {age:.1f}s old"},
                                status_code=503)
        return {"status": "alive", "heartbeat_age_s": round(age, 3)}

    @router.get("/health/startup")
    async def startup():
        if state.startup_ok:
            return {"status": "started"}
        return JSONResponse({"status": state.phase, "reason": state.load_error}, status_code=503)

    @router.get("/health/ready")
    @router.get("/health")
    async def ready():
        if state.phase != "ready":
            return JSONResponse({"status": state.phase, "reason": state.load_error}, status_code=503)
        idle_for = time.monotonic() - state.engine.last_token_time
        if idle_for < state.options.probe_skip_window:
            return {"status": "ready", "probe": "skipped", "reason": f"tokens produced {idle_for:.1f}s ago"}
        ok, detail = await probe_generation(state)
        if not ok:
            return JSONResponse({"status": "unready", "reason": detail}, status_code=503)
        return {"status": "ready", "probe": "ok", **detail}

    @router.get("/metrics")
    async def metrics():
        if state.metrics is None:
            return Response(b"", media_type=CONTENT_TYPE)
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE)

    return router


async def probe_generation(state: ServerState) -> tuple[bool, dict | str]:
    """One real token through tokenizer → scheduler → model → sampler, within a deadline.

    Concurrent probes share one generation (single flight), so a probe storm adds no load.
    """
    if state.probe_lock.locked():
        async with state.probe_lock:
            return state.last_probe
    async with state.probe_lock:
        start = time.monotonic()
        rid = new_id("probe")
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        ids = state.tokenizer.encode(PROBE_PROMPT)

        async def run():
            async for out in state.engine.generate(ids, params, rid):
                if out.finished:
                    return out
            return None

        try:
            out = await asyncio.wait_for(run(), state.options.probe_timeout)
            if out is None or len(out.token_ids) != 1:
                result = (False, "the probe generation produced no token")
            else:
                result = (True, {"latency_ms": round((time.monotonic() - start) * 1000, 1)})
        except TimeoutError:
            result = (False, f"the probe generation did not finish within {state.options.probe_timeout}s")
        except Exception as e:
            result = (False, f"the probe generation failed: {e}")
        state.last_probe = result
        return result
