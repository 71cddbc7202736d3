"""The PrometheusRule of one LLMDeployment (spec.monitoring.alerts): pure rendering, no I/O.

The chart's rule (charts/kubellm/templates/prometheusrule.yaml) watches every LLMDeployment with one set of
thresholds; this one watches a single LLMDeployment with thresholds from its spec, so a team can page on its
own model with its own SLO and route it with its own labels. Alerts that mean the same thing carry the same
name and PromQL shape as the chart's (tests/operator/test_alerts.py holds the two side by side), and their
fixed durations are the chart's defaults (:data:`FOR`).

Every expression is narrowed to this LLMDeployment's series:

* runtime series by ``namespace`` and ``kubellm_io_llmdeployment`` (the pod label kubellm.io/llmdeployment,
  copied by the ServiceMonitor :func:`.service_monitor.render_service_monitor` renders);
* kube-state-metrics series by namespace and object name (the Deployment and HPA are named
  :func:`.naming.child_name`, KEDA's HPA ``keda-hpa-<name>``), pods by joining on the runtime's ``up``;
* the operator's ``kubellm_operator_reconcile_failing`` by its ``llmdeployment_namespace`` and
  ``llmdeployment`` labels.
"""

from __future__ import annotations

from typing import Any

from kubellm.operator import api
from kubellm.operator.render.naming import (
    PROMETHEUS_LLMDEPLOYMENT_LABEL,
    child_metadata,
    child_name,
    label_value,
)

API_VERSION = "monitoring.coreos.com/v1"
KIND = "PrometheusRule"
# The chart's prometheusRule.runbookBaseUrl default: runbook_url is this plus a heading anchor.
RUNBOOK_BASE_URL = "https://github.com/kubellm/kubellm/blob/main/docs/operations.md"
GROUP = "kubellm-llmdeployment"

# How long each condition must hold before its alert fires: the chart's defaults for the same alerts.
FOR = {
    "KubellmNoReadyReplicas": "15m",
    "KubellmNotReady": "20m",
    "KubellmKVCacheSaturated": "15m",
    "KubellmSlowFirstToken": "15m",
    "KubellmShedding": "10m",
    "KubellmReconcileFailing": "15m",
}
PREEMPTION_WINDOW = "10m"
RATE_WINDOW = "5m"


def runtime_matchers(ld: api.LLMDeployment) -> str:
    """Label matchers of this LLMDeployment's runtime series (as the ServiceMonitor's scrape labels them)."""
    return f'namespace="{_namespace(ld)}", {PROMETHEUS_LLMDEPLOYMENT_LABEL}="{label_value(ld)}"'


def _namespace(ld: api.LLMDeployment) -> str:
    return ld.namespace or "default"


def _rule(name: str, expr: str, severity: str, summary: str, description: str, anchor: str,
          duration: str | None) -> dict[str, Any]:  # fmt: skip
    rule: dict[str, Any] = {"alert": name, "expr": expr}
    if duration is not None:
        rule["for"] = duration
    rule["labels"] = {"severity": severity}
    rule["annotations"] = {
        "summary": summary,
        "description": description,
        "runbook_url": f"{RUNBOOK_BASE_URL}#{anchor}",
    }
    return rule


def _who(ld: api.LLMDeployment) -> str:
    return f"LLMDeployment {_namespace(ld)}/{ld.name}"


def no_ready_replicas(ld: api.LLMDeployment) -> dict[str, Any] | None:
    """Desired replicas but none available (a Deployment; multi-node LeaderWorkerSets have no
    kube-state-metrics series, so none then). At zero replicas (scaled to zero) it does not fire."""
    if ld.spec.parallelism.nodes > 1:
        return None
    sel = f'namespace="{_namespace(ld)}", deployment="{child_name(ld)}"'
    expr = f"kube_deployment_spec_replicas{{{sel}}} > 0\nand on (namespace, deployment)\n" \
           f"kube_deployment_status_replicas_available{{{sel}}} == 0"  # fmt: skip
    return _rule(
        "KubellmNoReadyReplicas", expr, "critical", f"{_who(ld)} serves nobody.",
        f"None of its {{{{ $value }}}} desired replicas has been available for {FOR['KubellmNoReadyReplicas']}: "
        "clients get no answer. `kubectl describe llmd` names the cause under Degraded.",
        "degraded", FOR["KubellmNoReadyReplicas"],
    )  # fmt: skip


def not_ready(ld: api.LLMDeployment) -> dict[str, Any]:
    """A runtime container running but failing its readiness probe, per pod (pods joined on the runtime's up)."""
    ns = _namespace(ld)
    expr = (
        f'max by (namespace, pod) (kube_pod_container_status_running{{namespace="{ns}", container="runtime"}}) == 1\n'
        "and on (namespace, pod)\n"
        f'max by (namespace, pod) (kube_pod_container_status_ready{{namespace="{ns}", container="runtime"}}) == 0\n'
        "and on (namespace, pod)\n"
        f"up{{{runtime_matchers(ld)}}}"
    )
    return _rule(
        "KubellmNotReady", expr, "warning",
        "Pod {{ $labels.namespace }}/{{ $labels.pod }} runs but fails its readiness probe.",
        f"A pod of {_who(ld)} has been running but not ready for {FOR['KubellmNotReady']} (still loading the "
        "model, or failing the one-token readiness generation); it receives no traffic.",
        "startup-and-readiness-probe-failures", FOR["KubellmNotReady"],
    )  # fmt: skip


def queue_above_target_at_max(ld: api.LLMDeployment) -> dict[str, Any] | None:
    """The queue per pod above autoscaling.targetQueueDepth while the HPA (the operator's, or KEDA's) is at
    autoscaling.maxReplicas; only with autoscaling."""
    autoscaling = ld.spec.autoscaling
    if not autoscaling.enabled:
        return None
    name = child_name(ld)
    hpa = f'namespace="{_namespace(ld)}", horizontalpodautoscaler=~"{name}|keda-hpa-{name}"'
    expr = (
        f"avg({api.QUEUE_DEPTH_METRIC}{{{runtime_matchers(ld)}}}) > {autoscaling.target_queue_depth}\n"
        "and on ()\n"
        f"max(kube_horizontalpodautoscaler_status_current_replicas{{{hpa}}}) >= {autoscaling.max_replicas}"
    )
    duration = ld.spec.monitoring.alerts.queue_at_max_for
    return _rule(
        "KubellmQueueAboveTargetAtMaxReplicas", expr, "warning",
        f"{_who(ld)} is at maxReplicas and still queues.",
        f"The queue per pod ({{{{ $value | humanize }}}}) has stayed above the target {autoscaling.target_queue_depth} "
        f"for {duration} with {autoscaling.max_replicas} replicas (maxReplicas): raise spec.autoscaling.maxReplicas, "
        "or add capacity per pod.",
        "autoscaler-blocked", duration,
    )  # fmt: skip


def kv_cache_saturated(ld: api.LLMDeployment) -> dict[str, Any]:
    """KV-cache usage above the spec's threshold on some pod while sequences are being preempted."""
    usage = ld.spec.monitoring.alerts.kv_cache_usage
    m = runtime_matchers(ld)
    expr = (
        f"max(kubellm:kv_cache_usage_perc{{{m}}}) > {usage:g}\n"
        "and on ()\n"
        f"sum(rate(kubellm:num_preemptions_total{{{m}}}[{PREEMPTION_WINDOW}])) > 0"
    )
    return _rule(
        "KubellmKVCacheSaturated", expr, "warning", f"{_who(ld)} runs out of KV cache.",
        f"KV-cache usage above {usage:g} with sequences preempted for {FOR['KubellmKVCacheSaturated']}: they are "
        "evicted and recomputed, which wastes GPU time.",
        "kv-cache-exhaustion-and-429s", FOR["KubellmKVCacheSaturated"],
    )  # fmt: skip


def slow_first_token(ld: api.LLMDeployment) -> dict[str, Any] | None:
    """The p99 time to first token over all pods above the spec's SLO; only when ttftP99SecondsSLO is set."""
    slo = ld.spec.monitoring.alerts.ttft_p99_seconds_slo
    if slo is None:
        return None
    expr = (
        "histogram_quantile(0.99,\n"
        f"  sum by (le) (rate(kubellm:time_to_first_token_seconds_bucket{{{runtime_matchers(ld)}}}[{RATE_WINDOW}]))\n"
        f") > {slo:g}"
    )
    return _rule(
        "KubellmSlowFirstToken", expr, "warning", f"{_who(ld)} answers slower than its SLO.",
        "The 99th percentile of time to first token is {{ $value | humanizeDuration }}, above the SLO of "
        f"{slo:g}s (spec.monitoring.alerts.ttftP99SecondsSLO) for {FOR['KubellmSlowFirstToken']}.",
        "slow-first-token", FOR["KubellmSlowFirstToken"],
    )  # fmt: skip


def shedding(ld: api.LLMDeployment) -> dict[str, Any]:
    """The share of requests refused with 429 (queue_full, kv_cache_full) above the spec's errorRatio: the
    runtime's request error ratio (draining 503s during rollouts are left out, as in the chart's alert)."""
    ratio = ld.spec.monitoring.alerts.error_ratio
    m = runtime_matchers(ld)
    refused = f'sum(rate(kubellm:request_rejected_total{{{m}, reason=~"queue_full|kv_cache_full"}}[{RATE_WINDOW}]))'
    rejected = f"sum(rate(kubellm:request_rejected_total{{{m}}}[{RATE_WINDOW}]))"
    finished = f"sum(rate(kubellm:request_success_total{{{m}}}[{RATE_WINDOW}]))"
    # no request finished yet is 0 finished, not "no data"
    expr = f"{refused}\n/\n({rejected} + ({finished} or 0 * {rejected}))\n> {ratio:g}"
    return _rule(
        "KubellmShedding", expr, "warning", f"{_who(ld)} refuses requests with 429.",
        "{{ $value | humanizePercentage }} of requests are refused (queue_full, kv_cache_full), above "
        f"{ratio:g} (spec.monitoring.alerts.errorRatio) for {FOR['KubellmShedding']}: the pods are full.",
        "kv-cache-exhaustion-and-429s", FOR["KubellmShedding"],
    )  # fmt: skip


def reconcile_failing(ld: api.LLMDeployment) -> dict[str, Any]:
    """The operator keeps failing to apply this LLMDeployment's children."""
    expr = (
        f'max(kubellm_operator_reconcile_failing{{llmdeployment_namespace="{_namespace(ld)}", '
        f'llmdeployment="{ld.name}"}}) == 1'
    )
    return _rule(
        "KubellmReconcileFailing", expr, "warning", f"The operator cannot apply {_who(ld)}.",
        f"Its reconciles have failed for {FOR['KubellmReconcileFailing']}; the pods keep their last applied spec. "
        "It shows Degraded=True with reason ReconcileFailed and a Warning Event with the API error.",
        "reconcilefailed", FOR["KubellmReconcileFailing"],
    )  # fmt: skip


RULES = (no_ready_replicas, not_ready, queue_above_target_at_max, kv_cache_saturated, slow_first_token,
         shedding, reconcile_failing)  # fmt: skip
# Every alert a rule may hold, in RULES' order (docs and tests list them).
ALERT_NAMES = ("KubellmNoReadyReplicas", "KubellmNotReady", "KubellmQueueAboveTargetAtMaxReplicas",
               "KubellmKVCacheSaturated", "KubellmSlowFirstToken", "KubellmShedding", "KubellmReconcileFailing")  # fmt: skip


def render_prometheus_rule(ld: api.LLMDeployment) -> dict[str, Any] | None:
    """The monitoring.coreos.com/v1 PrometheusRule of ``ld`` (an owned child named like it), or None unless
    monitoring.alerts.enabled. Every alert is labelled with severity, namespace, kubellm_io_llmdeployment and
    then monitoring.alerts.labels (which may replace any of them)."""
    spec = ld.spec.monitoring.alerts
    if not spec.enabled:
        return None
    # The chart's alerts carry namespace and kubellm_io_llmdeployment from their series; these say them outright
    # (most of these expressions aggregate them away), so one Alertmanager route serves both.
    identity = {"namespace": _namespace(ld), PROMETHEUS_LLMDEPLOYMENT_LABEL: label_value(ld)}
    rules = [r for build in RULES if (r := build(ld)) is not None]
    for rule in rules:
        rule["labels"] = {**rule["labels"], **identity, **(spec.labels or {})}
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": child_metadata(ld),
        "spec": {"groups": [{"name": GROUP, "rules": rules}]},
    }
