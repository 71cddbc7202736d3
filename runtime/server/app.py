"""The serving port's app: error handling and the routers per concern (options and state: ``state.py``).

Routers: ``openai_routes`` (the OpenAI API, behind optional API keys), ``health`` (probes and metrics, always
open for the kubelet and Prometheus). Nothing on this port changes the pod's state: drain is on the loopback
admin listener (``admin.py``) and SIGTERM.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError

from kubellm.runtime.server.errors import APIError, error_response
from kubellm.runtime.server.health import health_router
from kubellm.runtime.server.openai_routes import openai_router
from kubellm.runtime.server.state import ServerOptions, ServerState

__all__ = ["ServerOptions", "ServerState", "build_app", "install_error_handlers"]


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="kubellm runtime", docs_url=None, redoc_url=None)
    app.state.kubellm = state
    install_error_handlers(app)
    app.include_router(health_router(state))
    app.include_router(openai_router(state))
    return app


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI-style body (``{"error": {...}}``), whatever raised it."""

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_, exc: RequestValidationError):
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"] if p not in ("body", "query")) or None
        return error_response(400, f"{param}: {err['msg']}" if param else err["msg"], param=param)

    @app.exception_handler(404)
    async def _not_found(request: Request, _):
        return error_response(404, f"no route {request.method} {request.url.path}", "not_found_error")

    @app.exception_handler(405)
    async def _method(request: Request, _):
        return error_response(405, f"method {request.method} not allowed on {request.url.path}",
                              "invalid_request_error")
