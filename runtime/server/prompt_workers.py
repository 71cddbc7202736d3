"""A small thread pool for a request's CPU work before the engine: JSON parsing, chat-template rendering,
tokenization and detokenization.

On the event loop, one 8 MB prompt took seconds during which ``/health/live`` and every other client's stream
stood still. Here at most ``size`` such jobs run at once; the rest wait in the pool's queue while the loop keeps
serving. ``tokenizers`` releases the GIL while it encodes, so the loop keeps most of a core even then.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class PromptWorkers:
    def __init__(self, size: int):
        self.size = size
        self._pool = ThreadPoolExecutor(size, thread_name_prefix="prompt-work")

    async def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """``fn(*args, **kwargs)`` on a worker; its exception is raised here. Cancelling the caller drops a job
        that has not started (a client that left costs nothing more)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
