"""The operator's own Prometheus metrics (``kubellm operator --metrics-port``), separate from the runtime's.

They live in their own registry (:data:`REGISTRY`, with the process, platform and GC collectors), apart from
the runtime's. :mod:`.handlers` feeds them (the API errors come from :mod:`.kube`):

* ``kubellm_operator_reconciles_total{result}``: reconciles by outcome: ``ok`` (children applied),
  ``invalid_spec`` (rejected, children left alone), ``error`` (failed; kopf retries it).
* ``kubellm_operator_reconcile_duration_seconds``: wall time of one reconcile, whatever its outcome.
* ``kubellm_operator_managed_llmdeployments``: LLMDeployments this replica observes right now.
* ``kubellm_operator_observations_total{result}``: status observations, ``ok`` or ``error``.
* ``kubellm_operator_api_errors_total{method,code}``: failed requests to the API server (code 0: not reached).
  404 is not counted: it answers "not installed" or "already gone", which the operator expects.
* ``kubellm_operator_reconcile_failing{llmdeployment_namespace,llmdeployment}``: 1 while an LLMDeployment's last
  reconcile failed (its Degraded ReconcileFailed), 0 once one succeeds; gone with the object. Per object, so
  its own PrometheusRule (monitoring.alerts) can page on it; the label names avoid the scrape's namespace.
* ``kubellm_operator_rollouts_blocked``: LLMDeployments this replica observes whose rollout has a new pod
  waiting past ``rollout.surgeTimeoutSeconds`` for a GPU (:mod:`.rollout_guard`); which ones, their status says.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    gc_collector,
    platform_collector,
    process_collector,
    start_http_server,
)

REGISTRY = CollectorRegistry()
process_collector.ProcessCollector(registry=REGISTRY)
platform_collector.PlatformCollector(registry=REGISTRY)
gc_collector.GCCollector(registry=REGISTRY)

ReconcileResult = Literal["ok", "invalid_spec", "error"]
RECONCILE_RESULTS: tuple[ReconcileResult, ...] = ("ok", "invalid_spec", "error")

RECONCILES = Counter(
    "kubellm_operator_reconciles",
    "Reconciles of LLMDeployments by result: ok, invalid_spec (rejected, children untouched), error (retried).",
    ["result"],
    registry=REGISTRY,
)
RECONCILE_DURATION = Histogram(
    "kubellm_operator_reconcile_duration_seconds",
    "Wall time of one reconcile (render and apply every child), whatever its result.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
    registry=REGISTRY,
)
MANAGED = Gauge(
    "kubellm_operator_managed_llmdeployments",
    "LLMDeployments this operator replica is observing.",
    registry=REGISTRY,
)
OBSERVATIONS = Counter(
    "kubellm_operator_observations",
    "Status observations of LLMDeployments by result: ok or error (retried with a backoff).",
    ["result"],
    registry=REGISTRY,
)
API_ERRORS = Counter(
    "kubellm_operator_api_errors",
    "Failed requests to the Kubernetes API server by HTTP method and status code (0: the server was not "
    "reached). 404 is not counted.",
    ["method", "code"],
    registry=REGISTRY,
)
ROLLOUTS_BLOCKED = Gauge(
    "kubellm_operator_rollouts_blocked",
    "LLMDeployments whose rollout has a new pod waiting past rollout.surgeTimeoutSeconds for a GPU "
    "(Progressing RolloutBlockedNoSpareGPU, or ReplacingInPlace until that pod schedules).",
    registry=REGISTRY,
)
RECONCILE_FAILING = Gauge(
    "kubellm_operator_reconcile_failing",
    "1 while the last reconcile of this LLMDeployment failed (Degraded, reason ReconcileFailed; kopf retries it).",
    ["llmdeployment_namespace", "llmdeployment"],
    registry=REGISTRY,
)
_blocked: set[tuple[str, str]] = set()  # (namespace, name) of the rollouts ROLLOUTS_BLOCKED counts


def note_rollout_blocked(key: tuple[str, str], blocked: bool) -> None:
    """Count ``key``'s rollout as blocked or not (an object no longer observed: not)."""
    if blocked:
        _blocked.add(key)
    else:
        _blocked.discard(key)
    ROLLOUTS_BLOCKED.set(len(_blocked))


def note_reconcile_failing(key: tuple[str, str], failing: bool | None) -> None:
    """Record whether ``key``'s last reconcile failed; None: the object is no longer observed, drop its series."""
    namespace, name = key
    if failing is None:
        with contextlib.suppress(KeyError):  # never reconciled by this replica
            RECONCILE_FAILING.remove(namespace, name)
        return
    RECONCILE_FAILING.labels(llmdeployment_namespace=namespace, llmdeployment=name).set(1 if failing else 0)


for _result in RECONCILE_RESULTS:  # export every result at 0 from the start, so rate() sees the first one
    RECONCILES.labels(result=_result)
for _result in ("ok", "error"):
    OBSERVATIONS.labels(result=_result)


@dataclass
class ReconcileOutcome:
    """What :func:`reconciling` records; the handler sets ``result`` when it is not ``ok``."""

    result: ReconcileResult = "ok"


@contextmanager
def reconciling() -> Iterator[ReconcileOutcome]:
    """Time one reconcile and count it by result; an exception escaping the block counts as ``error``.

    Cancellation (operator shutdown) is not an outcome and is not counted.
    """
    outcome = ReconcileOutcome()
    started = time.perf_counter()
    try:
        yield outcome
    except Exception:
        outcome.result = "error"
        _record(outcome, started)
        raise
    _record(outcome, started)


def _record(outcome: ReconcileOutcome, started: float) -> None:
    RECONCILE_DURATION.observe(time.perf_counter() - started)
    RECONCILES.labels(result=outcome.result).inc()


def count_api_error(method: str, status: int) -> None:
    """Count a failed API request (``status`` 0: not reached); not-found answers are not failures."""
    if status != 404:
        API_ERRORS.labels(method=method.upper(), code=str(status)).inc()


def serve(port: int, address: str = "0.0.0.0") -> WSGIServer | None:
    """Serve ``/metrics`` on ``address:port`` from a daemon thread; returns the server (None when ``port`` is 0:
    no metrics). Raises ValueError saying what to do when the port cannot be bound."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--metrics-port must be a TCP port (1-65535) or 0 to disable metrics, got {port}")
    if port == 0:
        return None
    disable_created_metrics()  # the *_created series only double what a scrape needs; global, so only here
    try:
        server, _thread = start_http_server(port, addr=address, registry=REGISTRY)
    except OSError as e:
        raise ValueError(
            f"cannot serve operator metrics on {address}:{port}: {e}; pick another --metrics-port or pass 0 "
            "to disable them"
        ) from e
    return server
