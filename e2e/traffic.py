"""Steady streaming chat traffic from background threads, with every request's outcome recorded.

Clients use the official ``openai`` package with retries off: a request the server refused, cut short or
aborted is a failure here, never something a retry quietly papered over.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from openai import OpenAI


@dataclass
class Outcome:
    ok: bool
    detail: str  # finish_reason when ok, else what went wrong
    started: float  # time.time() at the request's start
    seconds: float


@dataclass
class StreamingLoad:
    """``workers`` threads, each sending one streaming chat request after another until :meth:`stop`.

    A request succeeds when the stream ends with finish_reason ``stop`` or ``length`` after at least one
    content token. ``ignore_eos`` makes every request generate exactly ``max_tokens`` tokens (long requests
    that hold a slot, for queue-depth tests).
    """

    base_url: str
    model: str
    workers: int = 3
    max_tokens: int = 24
    ignore_eos: bool = False
    prompt: str = "Name three colours of the rainbow."
    request_timeout: float = 300.0
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> StreamingLoad:
        for i in range(self.workers):
            thread = threading.Thread(target=self._worker, name=f"load-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop sending; wait for the requests in flight (each thread's current one) to end."""
        self._stop.set()
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    @property
    def succeeded(self) -> int:
        with self._lock:
            return sum(o.ok for o in self.outcomes)

    @property
    def failures(self) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if not o.ok]

    def _worker(self) -> None:
        client = OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=self.request_timeout)
        extra = {"ignore_eos": True} if self.ignore_eos else None
        while not self._stop.is_set():
            started, t0 = time.time(), time.monotonic()
            try:
                ok, detail = self._one_request(client, extra)
            except Exception as e:  # noqa: BLE001 - every client-side error is an outcome to report
                ok, detail = False, f"{type(e).__name__}: {e}"
            with self._lock:
                self.outcomes.append(Outcome(ok, detail, started, time.monotonic() - t0))
            if not ok:
                time.sleep(0.5)  # a failing server is not hammered in a tight loop

    def _one_request(self, client: OpenAI, extra: dict | None) -> tuple[bool, str]:
        stream = client.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": self.prompt}],
            max_tokens=self.max_tokens,
            temperature=0,
            stream=True,
            extra_body=extra,
        )
        text, finish = [], None
        for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    text.append(choice.delta.content)
                finish = choice.finish_reason or finish
        if finish not in ("stop", "length"):
            return False, f"stream ended with finish_reason={finish!r} after {len(text)} pieces"
        if not text:
            return False, f"finish_reason={finish!r} with no content"
        return True, finish
