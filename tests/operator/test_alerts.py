"""The PrometheusRule of one LLMDeployment (kubellm.operator.render.alerts, spec.monitoring.alerts).

Rendered from real specs, validated against the upstream PrometheusRule CRD schema (vendored), every expression
parsed with promql-parser and checked to read only series the runtime, the operator or kube-state-metrics
export (tests/prometheus_series.py), scoped to this LLMDeployment, and held against the chart's rule for the
alerts both define.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from prometheus_series import check_names, prometheus_rule_schema, selectors

from kubellm.operator import api, render
from kubellm.operator.render import alerts, naming
from kubellm.operator.render import cli as render_cli

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kubellm"
CHART_RULE = (CHART / "templates" / "prometheusrule.yaml").read_text()
CHART_VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()
NS, NAME = "team-a", "qwen"

AUTOSCALED = {"enabled": True, "minReplicas": 2, "maxReplicas": 6, "targetQueueDepth": 3}
EVERY_KNOB = {"enabled": True, "ttftP99SecondsSLO": 1.75, "errorRatio": 0.02, "kvCacheUsage": 0.875,
              "queueAtMaxFor": "25m", "labels": {"team": "search", "severity": "page"}}  # fmt: skip


def make(alerts_spec: dict[str, Any] | None = None, name: str = NAME, **spec: Any) -> api.LLMDeployment:
    body: dict[str, Any] = {"model": {"uri": "smollm2"}, **spec}
    if alerts_spec is not None:
        body["monitoring"] = {"alerts": alerts_spec}
    return render_cli.load({"apiVersion": api.API_VERSION, "kind": api.KIND,
                        "metadata": {"name": name, "namespace": NS, "uid": "u-1"}, "spec": body})  # fmt: skip


def rules(ld: api.LLMDeployment) -> dict[str, dict[str, Any]]:
    rule = alerts.render_prometheus_rule(ld)
    assert rule is not None
    (group,) = rule["spec"]["groups"]
    return {r["alert"]: r for r in group["rules"]}


def check_prometheus_rule(ld: api.LLMDeployment, rule: dict[str, Any]) -> None:
    """What every rendered PrometheusRule must satisfy (test_render's matrix calls this too)."""
    jsonschema.Draft7Validator(prometheus_rule_schema()).validate(rule)
    assert rule["metadata"] == naming.child_metadata(ld)
    label = naming.label_value(ld)
    (group,) = rule["spec"]["groups"]
    for r in group["rules"]:
        name = r["alert"]
        check_names(r["expr"], name)
        assert set(r["annotations"]) == {"summary", "description", "runbook_url"}, name
        url, _, anchor = r["annotations"]["runbook_url"].partition("#")
        assert url == alerts.RUNBOOK_BASE_URL and anchor in doc_anchors(), r["annotations"]["runbook_url"]
        assert (ld.spec.monitoring.alerts.labels or {}).items() <= r["labels"].items(), name
        # scoped to this LLMDeployment: every series selected by its namespace and its name
        for series, matchers in selectors(r["expr"]):
            if series.startswith("kubellm_operator_"):
                assert matchers["llmdeployment_namespace"] == ("Equal", ld.namespace), name
                assert matchers["llmdeployment"] == ("Equal", ld.name), name
                continue
            assert matchers["namespace"] == ("Equal", ld.namespace), (name, series)
            if series.startswith("kubellm:") or series == "up":
                assert matchers[naming.PROMETHEUS_LLMDEPLOYMENT_LABEL] == ("Equal", label), (name, series)
            elif series.startswith("kube_deployment_"):
                assert matchers["deployment"] == ("Equal", naming.child_name(ld)), name
            elif series.startswith("kube_horizontalpodautoscaler_"):
                op, value = matchers["horizontalpodautoscaler"]
                assert op == "Re" and value == f"{naming.child_name(ld)}|keda-hpa-{naming.child_name(ld)}", name
            else:  # pod series: joined on this LLMDeployment's scrape targets
                assert "and on (namespace, pod)" in r["expr"] and f'{naming.PROMETHEUS_LLMDEPLOYMENT_LABEL}="{label}"' \
                    in r["expr"], name  # fmt: skip


def doc_anchors() -> set[str]:
    """GitHub's anchors of docs/operations.md's headings."""
    return {
        re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        for m in re.finditer(r"^#+ (.+)$", OPERATIONS, re.M)
    }


# --------------------------------------------------------------------------------------------------
# When it renders and what it holds
# --------------------------------------------------------------------------------------------------


def test_no_rule_unless_alerts_are_enabled():
    assert alerts.render_prometheus_rule(make()) is None
    assert alerts.render_prometheus_rule(make({"enabled": False, "ttftP99SecondsSLO": 1})) is None
    assert "PrometheusRule" not in {m["kind"] for m in render.render(make(), service_monitor_available=True)}


def test_the_rule_is_an_owned_child_applied_after_the_service_monitor():
    ld = make({"enabled": True})
    manifests = render.render(ld, service_monitor_available=True)
    kinds = [m["kind"] for m in manifests]
    assert kinds.index("PrometheusRule") == kinds.index("ServiceMonitor") + 1
    rule = manifests[kinds.index("PrometheusRule")]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["name"] == NAME and rule["metadata"]["namespace"] == NS
    assert rule["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    check_prometheus_rule(ld, rule)


def test_defaults_render_the_alerts_that_need_no_setting():
    assert sorted(rules(make({"enabled": True}))) == sorted([
        "KubellmNoReadyReplicas", "KubellmNotReady", "KubellmKVCacheSaturated", "KubellmShedding",
        "KubellmReconcileFailing",
    ])  # fmt: skip


def test_every_knob_reaches_its_alert():
    ld = make(EVERY_KNOB, autoscaling=AUTOSCALED)
    check_prometheus_rule(ld, alerts.render_prometheus_rule(ld))
    r = rules(ld)
    assert list(r) == list(alerts.ALERT_NAMES)
    assert re.search(r"\) > 1\.75$", r["KubellmSlowFirstToken"]["expr"])
    assert "1.75s" in r["KubellmSlowFirstToken"]["annotations"]["description"]
    assert r["KubellmShedding"]["expr"].endswith("> 0.02")
    assert "kubellm:kv_cache_usage_perc" in r["KubellmKVCacheSaturated"]["expr"]
    assert "> 0.875" in r["KubellmKVCacheSaturated"]["expr"]
    queue = r["KubellmQueueAboveTargetAtMaxReplicas"]
    assert queue["for"] == "25m"
    assert re.search(r"\) > 3\n", queue["expr"]) and queue["expr"].endswith(">= 6")
    for rule in r.values():
        # spec labels win over the default severity; namespace and LLMDeployment as the chart's alerts carry them
        assert rule["labels"] == {"severity": "page", "team": "search", "namespace": NS,
                                  naming.PROMETHEUS_LLMDEPLOYMENT_LABEL: NAME}  # fmt: skip


def test_the_queue_alert_needs_autoscaling_and_the_ttft_alert_an_slo():
    r = rules(make({"enabled": True, "queueAtMaxFor": "5m"}))
    assert "KubellmQueueAboveTargetAtMaxReplicas" not in r and "KubellmSlowFirstToken" not in r
    r = rules(make({"enabled": True, "ttftP99SecondsSLO": 2}, autoscaling=AUTOSCALED))
    assert "KubellmQueueAboveTargetAtMaxReplicas" in r and "KubellmSlowFirstToken" in r


def test_keda_autoscaling_matches_kedas_hpa_too():
    ld = make({"enabled": True}, autoscaling={**AUTOSCALED, "backend": "keda", "minReplicas": 0})
    check_prometheus_rule(ld, alerts.render_prometheus_rule(ld))
    assert f'horizontalpodautoscaler=~"{NAME}|keda-hpa-{NAME}"' in rules(ld)["KubellmQueueAboveTargetAtMaxReplicas"]["expr"]


def test_multi_node_groups_leave_out_the_deployment_alert():
    ld = make({"enabled": True}, parallelism={"tensor": 2, "nodes": 2})
    check_prometheus_rule(ld, alerts.render_prometheus_rule(ld))
    assert "KubellmNoReadyReplicas" not in rules(ld)


@pytest.mark.parametrize("name", ["qwen2.5.7b", "x" * 200])
def test_names_that_are_not_labels_select_the_sanitised_series(name):
    ld = make({"enabled": True}, name=name)
    check_prometheus_rule(ld, alerts.render_prometheus_rule(ld))
    assert naming.label_value(ld) != name or "." in name


def test_schema_check_catches_a_misspelt_field():
    ld = make({"enabled": True})
    bad = copy.deepcopy(alerts.render_prometheus_rule(ld))
    bad["spec"]["groups"][0]["rules"][0]["anotations"] = {}
    with pytest.raises(jsonschema.ValidationError):
        check_prometheus_rule(ld, bad)


# --------------------------------------------------------------------------------------------------
# The same alerts as the chart's
# --------------------------------------------------------------------------------------------------

CHART_VALUE_OF = {  # alert -> the chart's prometheusRule.alerts key for the same alert
    "KubellmNoReadyReplicas": "noReadyReplicas",
    "KubellmNotReady": "notReady",
    "KubellmKVCacheSaturated": "kvCacheSaturated",
    "KubellmSlowFirstToken": "slowFirstToken",
    "KubellmShedding": "shedding",
    "KubellmReconcileFailing": "operatorReconcileErrors",
}


def chart_alert(name: str) -> dict[str, str]:
    """Severity and runbook anchor of the chart's alert ``name``, read from its template."""
    block = CHART_RULE[CHART_RULE.index(f"- alert: {name}\n") :]
    block = block[: block.index("{{- end }}")]
    severity = re.search(r"severity: (\w+)", block)
    anchor = re.search(r"runbook_url: \{\{ \$runbook \}\}#([\w-]+)", block)
    assert severity and anchor, block
    return {"severity": severity.group(1), "anchor": anchor.group(1)}


def test_alerts_named_like_the_charts_keep_its_severity_runbook_and_durations():
    r = rules(make(EVERY_KNOB | {"labels": {}}, autoscaling=AUTOSCALED))
    chart_names = set(re.findall(r"- alert: (\w+)", CHART_RULE))
    values = CHART_VALUES["prometheusRule"]["alerts"]
    for name, rule in r.items():
        if name in chart_names:
            chart = chart_alert(name)
            assert rule["labels"]["severity"] == chart["severity"], name
            assert rule["annotations"]["runbook_url"].endswith("#" + chart["anchor"]), name
        if name in CHART_VALUE_OF:
            assert alerts.FOR[name] == values[CHART_VALUE_OF[name]]["for"], name
    assert set(r) - chart_names == {"KubellmReconcileFailing"}  # the chart's operator alerts are not per object
    assert CHART_VALUES["prometheusRule"]["runbookBaseUrl"] == alerts.RUNBOOK_BASE_URL
    defaults = api.AlertsSpec()
    assert defaults.queue_at_max_for == values["queueAboveTargetAtMaxReplicas"]["for"]
    assert defaults.kv_cache_usage == values["kvCacheSaturated"]["usage"]
    assert defaults.error_ratio == values["shedding"]["ratio"]


def test_reconcile_failing_reads_the_operators_per_object_gauge():
    expr = rules(make({"enabled": True}))["KubellmReconcileFailing"]["expr"]
    ((series, matchers),) = selectors(expr)
    assert series == "kubellm_operator_reconcile_failing"
    assert matchers["llmdeployment_namespace"] == ("Equal", NS) and matchers["llmdeployment"] == ("Equal", NAME)


def test_operations_guide_lists_the_per_deployment_alerts():
    section = OPERATIONS[OPERATIONS.index("\n### Per-LLMDeployment alerts\n") :]
    section = section[: min(section.index("\n## "), section.index("\n### ", 1))]
    assert set(re.findall(r"`(Kubellm\w+)`", section)) == set(alerts.ALERT_NAMES)
