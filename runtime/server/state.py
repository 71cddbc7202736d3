"""The serving process's options and state, shared by the app, its routers, the admin listener and the runner."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from kubellm.runtime.server.async_engine import AsyncEngine
from kubellm.runtime.server.metrics import ServerMetrics
from kubellm.runtime.server.prompt_workers import PromptWorkers


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
    max_request_bytes: int = 8 * 2**20  # larger bodies get 413, refused while they are read
    max_prompt_chars: int | None = None  # longer prompts get 400 untokenized; None: what the context could hold
    prompt_workers: int = 2  # threads that parse, render and tokenize requests (off the event loop)
    max_sequences_per_request: int = 1024  # prompts x n of one request (lm_eval batches 128 prompts and more)
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
    admitting: int = 0  # admitted requests still being tokenized (queued, not yet in the engine's count)
    probe_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_probe: tuple[bool, dict | str] | None = None
    on_drain: Callable[[str], None] | None = None  # set by the process runner: starts the drain sequence
    admin_url: str | None = None  # the loopback admin listener (drain), once bound
    workers: PromptWorkers = field(init=False)

    def __post_init__(self) -> None:
        self.workers = PromptWorkers(self.options.prompt_workers)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len
