"""A real kubellm server (uvicorn on a loopback port) in a background thread, for tests."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import Callable

import httpx

from kubellm.runtime.engine.config import EngineConfig
from kubellm.runtime.server.app import ServerOptions
from kubellm.runtime.server.main import run_server

MODEL_NAME = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, processes: list[subprocess.Popen], logs: Callable[[], str], timeout: float) -> None:
    """Until ``url``'s /health/ready answers 200 (a ``kubellm serve`` started as a process); fails with
    ``logs()`` when one of ``processes`` exits or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        assert all(p.poll() is None for p in processes), logs()
        try:
            if httpx.get(url + "/health/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, logs()
        time.sleep(0.2)


class ServerThread:
    """Starts ``run_server`` on its own thread and event loop; ``stop()`` drains it through the loopback admin
    listener (on a free port)."""

    def __init__(self, model_dir, engine_kwargs: dict | None = None, **option_kwargs):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        kwargs = dict(dtype="float32", block_size=16, num_kv_blocks=128, max_model_len=512, max_num_seqs=64,
                      max_num_batched_tokens=256)
        kwargs.update(engine_kwargs or {})
        self.engine_config = EngineConfig(model=str(model_dir), **kwargs)
        options = dict(served_model_name=MODEL_NAME, drain_timeout=10.0)
        options.update(option_kwargs)
        self.options = ServerOptions(**options)
        self.state = None
        self._ready = threading.Event()
        self.exit_code = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        def on_ready(state):
            self.state = state
            self._ready.set()

        self.exit_code = asyncio.run(run_server(self.engine_config, self.options, "127.0.0.1", self.port,
                                                on_ready=on_ready, install_signals=False, admin_port=0))
        self._ready.set()

    def start(self, timeout: float = 120) -> ServerThread:
        self.thread.start()
        if not self._ready.wait(timeout) or self.state is None:
            raise RuntimeError(f"server did not become ready (exit code {self.exit_code})")
        return self

    @property
    def engine(self):
        return self.state.engine.engine

    def used_blocks(self) -> int:
        return self.engine.block_manager.num_used_blocks

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until no request is queued or running and every block is free (or fail)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            e = self.state.engine
            if e.num_waiting == 0 and e.num_running == 0 and self.used_blocks() == 0 and not self.engine.requests:
                return
            time.sleep(0.02)
        raise AssertionError(f"server not idle after {timeout}s: {self.used_blocks()} blocks used, "
                             f"{len(self.engine.requests)} requests")

    def stop(self) -> None:
        if self.thread.is_alive() and self.state is not None:
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"{self.state.admin_url}/admin/drain", timeout=5)
            self.thread.join(timeout=30)


