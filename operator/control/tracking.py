"""What the operator remembers about each LLMDeployment between handler calls (kept in kopf's memo).

The reconcile handler records its outcome (:class:`Reconciled`); the observer daemon waits on the object's
poke event, holds its lock while it reads and writes, and observes a new generation only once its reconcile
has finished, or once that reconcile is overdue (kopf saw no change to handle, e.g. a spec changed and
changed back): :meth:`Tracked.due`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kubellm.operator.control.kube import Kube
from kubellm.operator.render import autoscaling as autoscaling_mod

Key = tuple[str, str]  # (namespace, name)


def key_of(body: Mapping[str, Any]) -> Key:
    """The key of an LLMDeployment body."""
    meta = body.get("metadata") or {}
    return meta.get("namespace") or "default", meta.get("name") or ""


@dataclass
class Reconciled:
    """The outcome of the last reconcile of one LLMDeployment."""

    generation: int | None
    template_changed: bool | None = None
    invalid: str | None = None  # the spec was rejected (InvalidSpec)
    error: str | None = None  # applying the children failed (ReconcileFailed)


@dataclass
class Tracked:
    """One LLMDeployment: its last reconcile, the event that wakes its observer, the lock around status writes."""

    reconciled: Reconciled | None = None
    poke: asyncio.Event = field(default_factory=asyncio.Event)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    waiting_since: tuple[int | None, float] | None = None  # (generation, monotonic seconds) awaiting its reconcile

    def due(self, generation: int | None, now: float, overdue_after: float) -> tuple[bool, Reconciled | None]:
        """Whether to observe ``generation`` now, and the reconcile outcome to observe it with (None when its
        reconcile is overdue and the observer goes on without it)."""
        rec = self.reconciled
        if rec is not None and rec.generation == generation:
            self.waiting_since = None
            return True, rec
        if self.waiting_since is None or self.waiting_since[0] != generation:
            self.waiting_since = (generation, now)
            return False, None
        if now - self.waiting_since[1] < overdue_after:
            return False, None
        self.waiting_since = None
        return True, None


@dataclass
class OperatorState:
    """The operator's settings found at start-up and every tracked LLMDeployment."""

    kube: Kube
    service_monitor_available: bool = False
    prometheus_url: str = autoscaling_mod.DEFAULT_PROMETHEUS_URL  # what KEDA triggers query
    activator_service: Key | None = None  # (namespace, name) of the activator's Service; None: no activator
    activator_url: str | None = None  # the activator's admin base URL, which KEDA triggers poll
    observe_interval: float = 15.0  # seconds between observations without a child event
    debounce: float = 0.5  # child events arriving within this window trigger one observation
    objects: dict[Key, Tracked] = field(default_factory=dict)

    def track(self, key: Key) -> Tracked:
        return self.objects.setdefault(key, Tracked())

    def poke(self, key: Key) -> None:
        """Wake the observer of ``key`` (it reads everything afresh)."""
        self.track(key).poke.set()

    def forget(self, key: Key) -> None:
        self.objects.pop(key, None)
