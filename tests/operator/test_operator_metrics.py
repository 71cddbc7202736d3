"""The operator's Prometheus metrics (kubellm.operator.control.metrics): the handlers move them, /metrics serves them.

The handlers run as kopf calls them, on an in-memory stand-in for the API client; the exposition is scraped
over HTTP and parsed with prometheus_client's own parser.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import urllib.request
from typing import Any

import kopf
import kubernetes
import prometheus_client.metrics
import pytest
from kmock import KubernetesError
from prometheus_client.parser import text_string_to_metric_families

from kubellm.operator import api
from kubellm.operator.control import handlers, metrics, observer
from kubellm.operator.control.kube import ApiError, Kube
from kubellm.operator.control.tracking import OperatorState
from kubellm.operator.render import autoscaling as autoscaling_mod
from kubellm.operator.testing import ApiServer, declare_resources
from kubellm.runtime.cli import build_parser

NS, NAME = "ml", "llama"
LOG = logging.getLogger("test")


class FakeKube:
    """The part of kube.Kube the handlers use, over a dict; ``fail_apply`` makes every apply fail."""

    field_manager = handlers.FIELD_MANAGER

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.applied: list[dict[str, Any]] = []
        self.fail_apply: ApiError | None = None

    async def list(self, api_version, kind, namespace, selector) -> list[dict]:
        return []

    async def find(self, api_version, kind, namespace, name) -> dict[str, Any] | None:
        return None

    async def apply(self, obj, field_manager=None) -> dict[str, Any]:
        if self.fail_apply is not None:
            raise self.fail_apply
        self.applied.append(obj)
        return dict(obj)

    async def delete(self, api_version, kind, namespace, name) -> None:
        pass

    async def get(self, api_version, kind, namespace, name) -> dict[str, Any] | None:
        return self.body if (api_version, kind, namespace, name) == (api.API_VERSION, api.KIND, NS, NAME) else None

    async def patch_status(self, api_version, kind, namespace, name, patch) -> None:
        pass


def body(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": NAME, "namespace": NS, "uid": "u-1", "generation": 1},
        "spec": {"model": {"uri": "hf://org/llama"}, **spec},
    }


def state_for(kube: FakeKube) -> kopf.Memo:
    memo = kopf.Memo()
    memo.kubellm = OperatorState(kube=kube, observe_interval=0.01, debounce=0.0)
    return memo


async def reconcile(memo: kopf.Memo, raw: dict[str, Any]) -> None:
    await handlers.reconcile(body=raw, old=None, reason=kopf.Reason.CREATE, memo=memo, retry=0, logger=LOG)


def value(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture(autouse=True)
def no_events(monkeypatch):
    """kopf posts Events through the running operator's queue; there is none here."""
    monkeypatch.setattr(observer, "post", lambda body, events: None)


# --------------------------------------------------------------------------------------------------
# Handlers move the metrics
# --------------------------------------------------------------------------------------------------


def test_reconciles_are_counted_and_timed_by_result():
    async def scenario():
        raw = body(replicas=1)
        kube = FakeKube(raw)
        memo = state_for(kube)
        await reconcile(memo, raw)
        assert kube.applied  # it did apply the children
        invalid = body(replicas=-1)
        await reconcile(state_for(FakeKube(invalid)), invalid)
        kube.fail_apply = ApiError(500, "InternalError", "etcd timed out")
        with pytest.raises(kopf.TemporaryError):
            await reconcile(memo, raw)

    before = {r: value("kubellm_operator_reconciles_total", result=r) for r in metrics.RECONCILE_RESULTS}
    timed_before = value("kubellm_operator_reconcile_duration_seconds_count")
    asyncio.run(scenario())
    after = {r: value("kubellm_operator_reconciles_total", result=r) for r in metrics.RECONCILE_RESULTS}
    assert {r: after[r] - before[r] for r in after} == {"ok": 1, "invalid_spec": 1, "error": 1}
    assert value("kubellm_operator_reconcile_duration_seconds_count") - timed_before == 3


def test_reconcile_failing_is_set_per_object_and_cleared_by_a_success_then_dropped():
    failing = "kubellm_operator_reconcile_failing"
    labels = {"llmdeployment_namespace": NS, "llmdeployment": NAME}

    async def scenario() -> list[float | None]:
        raw = body(replicas=1)
        kube = FakeKube(raw)
        memo = state_for(kube)
        seen = []
        kube.fail_apply = ApiError(422, "Invalid", "refused by admission")
        with pytest.raises(kopf.TemporaryError):
            await reconcile(memo, raw)
        seen.append(metrics.REGISTRY.get_sample_value(failing, labels))
        kube.fail_apply = None
        await reconcile(memo, raw)
        seen.append(metrics.REGISTRY.get_sample_value(failing, labels))
        metrics.note_reconcile_failing((NS, NAME), None)  # what the observer does when the object goes
        seen.append(metrics.REGISTRY.get_sample_value(failing, labels))
        return seen

    assert asyncio.run(scenario()) == [1.0, 0.0, None]


def test_a_cancelled_reconcile_is_not_an_outcome():
    before = value("kubellm_operator_reconcile_duration_seconds_count")
    with pytest.raises(asyncio.CancelledError), metrics.reconciling():
        raise asyncio.CancelledError
    assert value("kubellm_operator_reconcile_duration_seconds_count") == before


def test_observers_are_counted_while_they_run():
    class Stopped:
        flag = False

        def __bool__(self) -> bool:
            return self.flag

    async def scenario() -> tuple[float, float]:
        raw = body(replicas=1)
        memo = state_for(FakeKube(raw))
        stopped = Stopped()
        task = asyncio.create_task(
            handlers.observe_daemon(name=NAME, namespace=NS, memo=memo, stopped=stopped, logger=LOG)
        )
        while value("kubellm_operator_observations_total", result="ok") < ok_before + 2:
            await asyncio.sleep(0.01)
        running = value("kubellm_operator_managed_llmdeployments")
        stopped.flag = True
        await asyncio.wait_for(task, timeout=5)
        return running, value("kubellm_operator_managed_llmdeployments")

    managed_before = value("kubellm_operator_managed_llmdeployments")
    ok_before = value("kubellm_operator_observations_total", result="ok")
    running, stopped_after = asyncio.run(scenario())
    assert running == managed_before + 1
    assert stopped_after == managed_before


@pytest.mark.asyncio
@pytest.mark.kmock(cls=ApiServer)  # server-side apply creates the object, then the PATCH is answered with 500
async def test_api_errors_are_counted_by_method_and_code_but_not_found_is_not_an_error(kmock):
    declare_resources(kmock)
    kmock[lambda request: request.method.value.upper() == "PATCH"] << KubernetesError(
        status=500, reason="InternalError", message="etcd timed out"
    )
    kube = await Kube.connect(handlers.FIELD_MANAGER, kubernetes.client.Configuration(host=str(kmock.url)))
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x", "namespace": NS}}
    before = {code: value("kubellm_operator_api_errors_total", method="PATCH", code=code) for code in ("500", "0")}
    not_found_before = value("kubellm_operator_api_errors_total", method="GET", code="404")
    try:
        with pytest.raises(ApiError, match="500 InternalError: etcd timed out"):
            await kube.apply(service)
        assert await kube.get("v1", "Service", NS, "missing") is None  # 404: not an error
        kube.client.client.configuration.host = f"http://127.0.0.1:{free_port()}"  # nobody listens there
        with pytest.raises(ApiError) as refused:
            await kube.apply(service)
        assert refused.value.status == 0
    finally:
        kube.close()
    assert value("kubellm_operator_api_errors_total", method="PATCH", code="500") == before["500"] + 1
    assert value("kubellm_operator_api_errors_total", method="PATCH", code="0") == before["0"] + 1
    assert value("kubellm_operator_api_errors_total", method="GET", code="404") == not_found_before == 0


# --------------------------------------------------------------------------------------------------
# The endpoint
# --------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def endpoint(monkeypatch):
    """``serve()`` on a free local port; yields a function that scrapes it into {sample name+labels: value}."""
    # serve() turns off the *_created series process-wide (right for the operator's own process); undo it.
    monkeypatch.setattr(prometheus_client.metrics, "_use_created", prometheus_client.metrics._use_created)
    port = free_port()
    server = metrics.serve(port, "127.0.0.1")

    def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            assert resp.status == 200
            text = resp.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    yield scrape
    server.shutdown()
    server.server_close()


def test_metrics_endpoint_serves_the_operator_metrics_and_they_move(endpoint):
    first = endpoint()
    for result in metrics.RECONCILE_RESULTS:  # present from the start, at whatever count
        assert ("kubellm_operator_reconciles_total", (("result", result),)) in first
    assert ("kubellm_operator_managed_llmdeployments", ()) in first
    assert ("kubellm_operator_reconcile_duration_seconds_count", ()) in first
    if sys.platform == "linux":  # the process collector reads /proc
        assert ("process_resident_memory_bytes", ()) in first
    assert not any(name.endswith("_created") for name, _ in first)

    raw = body(replicas=1)
    asyncio.run(reconcile(state_for(FakeKube(raw)), raw))
    second = endpoint()
    ok = ("kubellm_operator_reconciles_total", (("result", "ok"),))
    count = ("kubellm_operator_reconcile_duration_seconds_count", ())
    assert second[ok] == first[ok] + 1
    assert second[count] == first[count] + 1
    assert not any(name.startswith("kubellm:") for name, _ in second)  # the runtime's metrics stay apart


def test_serve_refuses_a_bad_or_busy_port():
    assert metrics.serve(0) is None
    with pytest.raises(ValueError, match="metrics-port"):
        metrics.serve(70000)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ValueError, match="pass 0"):
            metrics.serve(taken.getsockname()[1], "127.0.0.1")


def test_operator_cli_flags():
    args = build_parser().parse_args(["operator", "-A"])
    assert args.metrics_port == 9090
    assert args.prometheus_url == autoscaling_mod.DEFAULT_PROMETHEUS_URL
    args = build_parser().parse_args(["operator", "-n", "ml", "--metrics-port", "0", "--prometheus-url", "http://p:9090"])
    assert (args.metrics_port, args.prometheus_url, args.namespaces) == (0, "http://p:9090", ["ml"])


def test_rendered_scaled_objects_query_the_configured_prometheus():
    raw = body(autoscaling={"enabled": True, "backend": "keda", "minReplicas": 0, "maxReplicas": 2})
    kube = FakeKube(raw)
    memo = state_for(kube)
    memo.kubellm.prometheus_url = "http://prometheus.example:9090"
    asyncio.run(reconcile(memo, raw))
    (scaled,) = [c for c in kube.applied if c["kind"] == "ScaledObject"]
    assert scaled["spec"]["triggers"][0]["metadata"]["serverAddress"] == "http://prometheus.example:9090"
