"""The serving port's app: its options, its state, error handling, and the routers per concern.

Routers: ``openai_routes`` (the OpenAI API, behind optional API keys), ``health`` (probes and metrics, always
open for the kubelet and Prometheus). Nothing on this port changes the pod's state: drain is on the loopback
admin listener (``admin.py``) and SIGTERM.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError

from kubellm.runtime.server.async_engine import AsyncEngine
from kubellm.runtime.server.errors import APIError, error_response
from kubellm.runtime.server.metrics import ServerMetrics


@dataclass
class ServerOptions:
    served_model_name: str
    max_queue: int = 256  # waiting requests beyond which new ones get 429
    kv_admit_factor: float = 4.0  # shed when queued prompt tokens exceed this many full KV caches
    drain_timeout: float = 30.0
    retry_after: int = 2
    probe_timeout: float = 10.0  # deadline of the readiness probe's 1-token generation
    probe_skip_window: float = 5.0  # tokens produced this recently → ready without a probe
    liveness_timeout: float = 60.0  # engine heartbeat older than this fails liveness
    default_completion_max_tokens: int = 16  # OpenAI's default for /v1/completions
    api_keys: tuple[str, ...] = ()  # when set, /v1/* needs `Authorization: Bearer <one of them>`
    max_request_bytes: int = 8 * 2**20  # larger bodies get 413 before they are read
    max_sequences_per_request: int = 64  # prompts x n of one request
    tool_call_parser: str = "auto"  # the model's tool-call syntax: auto (from the chat template) or a name


@dataclass
class ServerState:
    options: ServerOptions
    phase: str = "loading"  # loading → ready → draining → stopped (or failed)
    engine: AsyncEngine | None = None
    metrics: ServerMetrics | None = None
    startup_ok: bool = False
    load_error: str | None = None
    active_requests: int = 0
    probe_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_probe: tuple[bool, dict | str] | None = None
    on_drain: Callable[[str], None] | None = None  # set by the process runner: starts the drain sequence
    admin_url: str | None = None  # the loopback admin listener (drain), once bound

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len


def build_app(state: ServerState) -> FastAPI:
    from kubellm.runtime.server.health import health_router
    from kubellm.runtime.server.openai_routes import openai_router

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
