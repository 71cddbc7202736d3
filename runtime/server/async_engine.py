"""Runs the engine's step loop on its own thread and hands each request's outputs to asyncio.

Only the engine thread touches ``LLMEngine``; handlers talk to it through a command queue and
receive ``RequestOutput``s on a per-request ``asyncio.Queue``. The loop stamps a heartbeat every
iteration (liveness) and the time of the last produced token (readiness skips its probe then).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from kubellm.runtime.engine.llm_engine import EngineStats, LLMEngine, RequestOutput
from kubellm.runtime.sampling.params import SamplingParams

log = logging.getLogger("kubellm.server.engine")

IDLE_WAIT_S = 0.5  # how long the idle loop sleeps between heartbeats when there is no work


class EngineDead(RuntimeError):
    """The engine loop has stopped or failed; the request cannot be served."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_step: Callable[[list[RequestOutput], float], None] | None = None):
        self.engine = engine
        self.on_step = on_step  # metrics hook, called on the engine thread after each step
        self.loop: asyncio.AbstractEventLoop | None = None
        self._commands: deque[tuple] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self.heartbeat = time.monotonic()
        self.last_token_time = 0.0
        self.num_waiting = 0
        self.num_running = 0
        self.waiting_prompt_tokens = 0
        # Requests handed to the engine thread that its last snapshot may not count yet (see num_queued):
        # submitted on the event loop, taken off the command queue on the engine thread.
        self._adds_submitted = 0
        self._adds_taken = 0
        self._queue_snapshot = (0, 0)  # (num_waiting, adds taken when it was read), replaced as one object
        self.stats: EngineStats | None = None  # the latest snapshot, taken on the engine thread
        self.error: BaseException | None = None

    # ---- lifecycle -----------------------------------------------------------------------------
    @classmethod
    async def create(cls, factory: Callable[[], LLMEngine], on_step=None) -> AsyncEngine:
        """Build the engine on the thread that then runs its loop, and return once it is built.

        Every torch op of the process thereby runs on one thread. That matters on CPUs: each thread that runs
        a parallel op gets its own OpenMP worker pool, and once libgomp counts more pool threads than CPUs it
        throttles its spin-waits, so every op pays a futex wake-up. Loading on a helper thread and stepping on
        another made every engine step ~25% slower on 2 cores.
        """
        self = cls(None, on_step)  # type: ignore[arg-type]
        self.loop = asyncio.get_running_loop()
        built: asyncio.Future = self.loop.create_future()

        def settle(error: BaseException | None) -> None:
            if not built.done():
                built.set_exception(error) if error is not None else built.set_result(None)

        def main() -> None:
            try:
                self.engine = factory()
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                self.loop.call_soon_threadsafe(settle, e)
                return
            self.loop.call_soon_threadsafe(settle, None)
            self._run()

        self._thread = threading.Thread(target=main, name="engine-loop", daemon=True)
        self._thread.start()
        await built
        return self

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run the loop of an engine built elsewhere (tests; see :meth:`create` for why serving does not)."""
        self.loop = loop
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- what handlers may read from any thread (configuration, not loop state) -----------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def capacity_tokens(self) -> int:
        return self.engine.capacity_tokens

    @property
    def block_size(self) -> int:
        return self.engine.block_size

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def num_queued(self) -> int:
        """Waiting requests, counting those submitted since the engine thread last counted: a burst admitted
        between two snapshots must not all read the same stale, short queue."""
        waiting, taken = self._queue_snapshot
        return waiting + self._adds_submitted - taken

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request can never run (reads configuration only)."""
        self.engine.validate(prompt_ids, params)

    # ---- API for handlers (event-loop side) ----------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs; closing the iterator early aborts it."""
        if not self.alive:
            raise EngineDead("the engine loop is not running")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        finished = False
        try:
            self._adds_submitted += 1
            await asyncio.wrap_future(self._submit("add", prompt_ids, params, request_id))
            while True:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._submit("abort", request_id)

    def abort(self, request_id: str) -> None:
        self._submit("abort", request_id)

    def abort_all(self) -> concurrent.futures.Future:
        return self._submit("abort_all")

    def call(self, fn: Callable, *args) -> concurrent.futures.Future:
        """Run ``fn(engine, *args)`` on the engine thread (for stats that must not race the loop)."""
        return self._submit("call", fn, *args)

    def _submit(self, *command) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.append((future, *command))
        self._wake.set()
        return future

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        log.info("engine loop started")
        while not self._stop:
            self._apply_commands()
            try:
                if self.engine.has_unfinished_requests():
                    start = time.monotonic()
                    outputs = self.engine.step()
                    self._publish(outputs, time.monotonic() - start)
                else:
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
            except Exception as e:  # a bug or a device error: fail in-flight requests, keep serving
                log.exception("engine step failed; aborting %d in-flight requests", self.engine.num_unfinished_requests)
                self.error = e
                self._fail_all(e)
                if not self.engine.workers_alive():  # a lost tensor-parallel rank: no step can succeed again
                    log.error("a tensor-parallel worker is gone: stopping the engine loop (liveness will fail)")
                    break
            self._update_gauges()
            self.heartbeat = time.monotonic()
        self.engine.shutdown()
        log.info("engine loop stopped")

    def _apply_commands(self) -> None:
        while self._commands:
            future, kind, *args = self._commands.popleft()
            self._adds_taken += kind == "add"  # cancelled or refused too: either way it is no longer pending
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if kind == "add":
                    future.set_result(self.engine.add_request(*args))
                elif kind == "abort":
                    out = self.engine.abort_request(args[0])
                    if out is not None:
                        self._publish([out], 0.0)
                    future.set_result(out)
                elif kind == "abort_all":
                    outs = self.engine.abort_all()
                    self._publish(outs, 0.0)
                    future.set_result(len(outs))
                elif kind == "call":
                    future.set_result(args[0](self.engine, *args[1:]))
            except Exception as e:  # invalid request: the handler turns it into a 4xx
                future.set_exception(e)
        self._update_gauges()

    def _publish(self, outputs: list[RequestOutput], step_time: float) -> None:
        if not outputs:
            return
        if any(o.new_token_ids for o in outputs):
            self.last_token_time = time.monotonic()
        if self.on_step is not None:
            try:
                self.on_step(outputs, step_time)
            except Exception:
                log.exception("metrics hook failed")
        self.loop.call_soon_threadsafe(self._deliver, outputs)

    def _deliver(self, outputs: list) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _fail_all(self, error: Exception) -> None:
        self.engine.abort_all()
        failure = EngineDead(f"the engine failed while serving this request: {error}")
        self.loop.call_soon_threadsafe(lambda: [q.put_nowait(failure) for q in self._streams.values()])

    def _update_gauges(self) -> None:
        self.stats = stats = self.engine.stats()
        self.num_waiting, self.num_running = stats.num_waiting, stats.num_running
        self._queue_snapshot = (stats.num_waiting, self._adds_taken)
        self.waiting_prompt_tokens = stats.waiting_prompt_tokens
