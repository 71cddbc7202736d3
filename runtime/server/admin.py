"""The admin listener: controls that change the pod's state, on loopback only.

Nothing a client of the Service can reach may drain or stop a replica, so ``POST /admin/drain`` is not on
the serving port: it lives on a second listener bound to 127.0.0.1, reachable from inside the pod
(``kubectl exec``, a sidecar) and never through the Service. SIGTERM stays the primary path (the kubelet
sends it after the preStop sleep); this listener is for people and tools inside the pod.
"""

from __future__ import annotations

import socket

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from kubellm.runtime.server.errors import APIError, error_response

ADMIN_HOST = "127.0.0.1"
DEFAULT_ADMIN_PORT = 8001


def bind_admin_socket(port: int) -> socket.socket:
    """A listening socket on 127.0.0.1:``port`` (0 = any free port). Raises OSError when the port is taken."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ADMIN_HOST, port))
        sock.listen(16)
    except OSError:
        sock.close()
        raise
    return sock


def build_admin_app(state) -> FastAPI:
    """Routes of the loopback listener; ``state`` is the serving ``ServerState``."""
    app = FastAPI(title="kubellm admin (loopback only)", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return exc.response()

    @app.exception_handler(404)
    async def _not_found(request, _):
        return error_response(404, f"no route {request.method} {request.url.path}", "not_found_error")

    @app.post("/admin/drain")
    async def drain():
        if state.on_drain is None:
            raise APIError(501, "drain is not wired in this process", "not_implemented")
        state.on_drain("POST /admin/drain (loopback)")
        return JSONResponse({"status": "draining"}, status_code=202)

    @app.get("/admin/status")
    async def status():
        engine = state.engine
        return {"phase": state.phase, "active_requests": state.active_requests,
                "waiting": engine.num_waiting if engine else 0, "running": engine.num_running if engine else 0}

    return app
