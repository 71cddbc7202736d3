"""The series kubellm's Prometheus rules and dashboards may read, and a check that PromQL reads only those.

Shared by the chart's rule and dashboard tests (tests/delivery/test_chart_monitoring.py) and the per-LLMDeployment
rule's (tests/operator/test_alerts.py): every PromQL expression is parsed with promql-parser, and every metric
name it reads must exist: the runtime's and the operator's from their own Prometheus registries,
kube-state-metrics' from the short list below.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import promql_parser
import yaml
from prometheus_client import CollectorRegistry

from kubellm.operator.control import metrics as operator_metrics
from kubellm.operator.render import naming
from kubellm.runtime.server.metrics import ServerMetrics

ROOT = Path(__file__).resolve().parents[1]

# kube-state-metrics series the rule and the dashboard read, as its documentation names them
# (github.com/kubernetes/kube-state-metrics, docs/metrics/workload/pod-metrics.md, deployment-metrics.md and
# horizontalpodautoscaler-metrics.md). The *_labels series carry label_<key> only for keys allowlisted with
# --metric-labels-allowlist.
KUBE_STATE_METRICS = {
    "kube_pod_labels",
    "kube_pod_container_status_running",
    "kube_pod_container_status_ready",
    "kube_pod_container_status_waiting_reason",
    "kube_pod_container_status_last_terminated_reason",
    "kube_pod_container_status_restarts_total",
    "kube_pod_init_container_status_waiting_reason",
    "kube_pod_init_container_status_restarts_total",
    "kube_deployment_labels",
    "kube_deployment_spec_replicas",
    "kube_deployment_status_replicas_available",
    "kube_horizontalpodautoscaler_labels",
    "kube_horizontalpodautoscaler_spec_target_metric",
    "kube_horizontalpodautoscaler_spec_max_replicas",
    "kube_horizontalpodautoscaler_status_current_replicas",
    "kube_horizontalpodautoscaler_status_desired_replicas",
    "kube_horizontalpodautoscaler_status_condition",
}
# Labels Prometheus attaches to every series of a ServiceMonitor's targets (the LLMDeployment's ServiceMonitor
# adds kubellm_io_llmdeployment from the pod label); `up` is Prometheus's own series per target.
TARGET_LABELS = {"namespace", "pod", "service", "job", "instance", "container", "endpoint",
                 naming.LABEL_LLMDEPLOYMENT.replace(".", "_").replace("/", "_")}  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Metric names the code exports
# --------------------------------------------------------------------------------------------------


def exported(registry: CollectorRegistry) -> dict[str, set[str]]:
    """Series name -> label names, as the exposition writes them (counters with _total, histograms split)."""
    out: dict[str, set[str]] = {}
    for family in registry.collect():
        labels = {k for s in family.samples for k in s.labels} - {"le", "quantile"}
        labels |= set(getattr(family, "_labelnames", ()))
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
        for suffix in suffixes:
            out[family.name + suffix] = labels
    return out


@cache
def runtime_metrics() -> dict[str, set[str]]:
    stats = SimpleNamespace(
        kv_usage=0.0,
        kv_blocks_total=1,
        prefix_queries=0,
        prefix_hits=0,
        num_preemptions=0,
        speculation=SimpleNamespace(num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0),
    )
    server = ServerMetrics(
        "m", SimpleNamespace(stats=stats, num_waiting=0, num_running=0, block_size=16, engine=None)
    )
    names = exported(server.registry)
    # labelled counters and histograms without a child yet: their label names come from the metric objects
    for metric in (server.request_success, server.request_rejected, server.prompt_tokens, server.ttft):
        for name in names:
            if name.startswith(metric._name):
                names[name] |= set(metric._labelnames)
    return names


@cache
def operator_series() -> dict[str, set[str]]:
    names = exported(operator_metrics.REGISTRY)
    for metric in (operator_metrics.RECONCILES, operator_metrics.API_ERRORS, operator_metrics.OBSERVATIONS):
        names[metric._name + "_total"] |= set(metric._labelnames)
    # labelled gauges without a child yet export no sample, so no name: taken from the metric objects
    names[operator_metrics.RECONCILE_FAILING._name] = set(operator_metrics.RECONCILE_FAILING._labelnames)
    return names


# --------------------------------------------------------------------------------------------------
# PromQL
# --------------------------------------------------------------------------------------------------


def selectors(expr: str) -> list[tuple[str, dict[str, tuple[str, str]]]]:
    """(metric name, {label: (op, value)}) of every vector selector in ``expr``; raises on a syntax error."""
    found: list[tuple[str, dict[str, tuple[str, str]]]] = []

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            matchers = {m.name: (str(m.op).rsplit(".", 1)[-1], m.value) for m in node.matchers.matchers}
            name = node.name or matchers.get("__name__", ("", ""))[1]
            found.append((name, matchers))
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    assert found, f"no series read by {expr!r}"
    return found


def check_names(expr: str, where: str) -> None:
    """Every series ``expr`` reads exists, and labels matched on the runtime's and operator's series exist."""
    runtime, operator = runtime_metrics(), operator_series()
    for name, matchers in selectors(expr):
        labels = set(matchers) - {"__name__"}
        if name in runtime:
            assert labels <= runtime[name] | TARGET_LABELS, (
                f"{where}: {name} has no label {labels - runtime[name]}"
            )
        elif name in operator:
            assert labels <= operator[name] | TARGET_LABELS, (
                f"{where}: {name} has no label {labels - operator[name]}"
            )
        else:
            assert name in KUBE_STATE_METRICS | {"up"}, f"{where}: nothing exports {name!r}"
        if name == "kubellm_operator_reconciles_total" and "result" in matchers:
            assert matchers["result"][1] in operator_metrics.RECONCILE_RESULTS, where
        if name.startswith("kubellm:request_rejected") and "reason" in matchers:
            routes = (ROOT / "runtime" / "server" / "openai_routes.py").read_text()
            for reason in matchers["reason"][1].split("|"):
                assert f'rejected("{reason}")' in routes, f"{where}: the runtime never rejects with {reason}"


# --------------------------------------------------------------------------------------------------
# The PrometheusRule CRD
# --------------------------------------------------------------------------------------------------

PROMETHEUS_RULE_SCHEMA = ROOT / "tests" / "delivery" / "data" / "prometheusrule-schema.yaml"


def closed(schema: Any) -> Any:
    """The CRD schema with every object that names its properties closed: the API server prunes unknown fields
    silently, so a misspelt key would otherwise pass here and vanish there."""
    if isinstance(schema, dict):
        out = {k: closed(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    return schema


@cache
def prometheus_rule_schema() -> dict[str, Any]:
    """The upstream PrometheusRule CRD's schema (vendored), closed."""
    return closed(yaml.safe_load(PROMETHEUS_RULE_SCHEMA.read_text()))
