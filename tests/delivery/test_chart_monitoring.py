"""The chart's monitoring add-ons: the PrometheusRule (templates/prometheusrule.yaml) and the Grafana dashboard
(files/grafana-dashboard.json, shipped by templates/grafana-dashboard.yaml).

Rendered with the real helm (the fixture and helpers of test_chart.py), the rule is validated against the
upstream PrometheusRule CRD schema (vendored in data/), every PromQL expression of the rule and of the dashboard
is parsed with promql-parser, and every metric name they read must exist (tests/prometheus_series.py: the
runtime's and the operator's from their own Prometheus registries, kube-state-metrics' from a short list).
"""

# ruff: noqa: F811  (the tests take test_chart's `helm` fixture, imported below, as a parameter)

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_series import (
    KUBE_STATE_METRICS,
    check_names,
    closed,
    operator_series,
    runtime_metrics,
    selectors,
)
from test_chart import (  # noqa: F401  (helm is a fixture)
    CHART,
    K8S_VERSIONS,
    NAMESPACE,
    RELEASE,
    SCHEMA,
    VALUES,
    helm,
    merged,
    of_kind,
    template,
)

from kubellm.operator.render import alerts as llmdeployment_alerts

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data"
OPERATIONS = ROOT / "docs" / "operations.md"
DASHBOARD = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())

ON = {"prometheusRule": {"enabled": True}, "grafanaDashboard": {"enabled": True}}
TUNED = {
    "prometheusRule": {
        "enabled": True,
        "labels": {"release": "prom"},
        "runbookBaseUrl": "https://wiki.example/ops/",
        "operatorJob": "ops-kubellm",
        "alerts": {
            "operatorDown": {"for": "7m"},
            "operatorReconcileErrors": {"for": "8m"},
            "operatorRejectingSpecs": {"window": "45m"},
            "operatorApiErrors": {"perSecond": 0.25, "for": "9m"},
            "noReadyReplicas": {"for": "31m"},
            "notReady": {"for": "32m"},
            "queueGrowing": {"depth": 7, "for": "33m"},
            "queueAboveTargetAtMaxReplicas": {"for": "34m"},
            "kvCacheSaturated": {"usage": 0.875, "preemptionsPerSecond": 1.5, "for": "35m"},
            "slowFirstToken": {"p99Seconds": 2.5, "for": "36m"},
            "shedding": {"ratio": 0.125, "for": "37m"},
            "imagePullFailing": {"for": "38m"},
            "modelDownloadFailing": {"restarts": 5},
            "crashLooping": {"for": "39m"},
            "autoscalerBlocked": {"for": "41m"},
            "rolloutBlockedNoSpareGPU": {"for": "42m"},
            "kubeStateMetricsLabelsMissing": {"for": "2h"},
        },
    },
    "grafanaDashboard": {
        "enabled": True,
        "labels": {"dashboards": "kubellm"},
        "annotations": {"grafana_folder": "LLM"},
        "namespace": "monitoring",
    },
}
SEVERITIES = {"critical", "warning", "info"}

def test_the_registries_hold_the_names_the_docs_give():
    runtime, operator = runtime_metrics(), operator_series()
    assert {
        "kubellm:num_requests_waiting",
        "kubellm:request_rejected_total",
        "kubellm:time_to_first_token_seconds_bucket",
        "kubellm:num_preemptions_total",
    } <= set(runtime)
    assert runtime["kubellm:request_rejected_total"] >= {"model_name", "reason"}
    assert {"kubellm_operator_reconciles_total", "kubellm_operator_api_errors_total"} <= set(operator)
    assert operator["kubellm_operator_api_errors_total"] >= {"method", "code"}


# --------------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def on(helm) -> list[dict[str, Any]]:
    return template(helm, ON)


@pytest.fixture(scope="module")
def tuned(helm) -> list[dict[str, Any]]:
    return template(helm, TUNED)


def rule_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (rule,) = of_kind(docs, "PrometheusRule")
    return rule


def alerts(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for group in rule_of(docs)["spec"]["groups"]:
        for rule in group["rules"]:
            assert rule["alert"] not in out, f"two alerts named {rule['alert']}"
            out[rule["alert"]] = rule
    return out


ALERT_NAMES = SCHEMA["properties"]["prometheusRule"]["properties"]["disabledAlerts"]["items"]["enum"]


def test_nothing_renders_by_default(helm):
    docs = template(helm, {})
    assert not of_kind(docs, "PrometheusRule") and not of_kind(docs, "ConfigMap")
    off = template(helm, {"prometheusRule": {"enabled": False}, "grafanaDashboard": {"enabled": False}})
    assert off == docs


@pytest.mark.parametrize("values", [ON, TUNED], ids=["on", "tuned"])
def test_helm_lint_strict_passes_with_monitoring_on(helm, values):
    result = helm("lint", "--strict", str(CHART), values=values)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("case", ["on", "tuned"])
def test_prometheus_rule_satisfies_the_upstream_crd_schema(on, tuned, case):
    docs = {"on": on, "tuned": tuned}[case]
    rule = rule_of(docs)
    schema = yaml.safe_load((DATA / "prometheusrule-schema.yaml").read_text())
    jsonschema.Draft7Validator(closed(schema)).validate(rule)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == NAMESPACE
    assert [g["name"] for g in rule["spec"]["groups"]] == ["kubellm-operator", "kubellm-llmdeployments",
                                                           "kubellm-pods"]  # fmt: skip
    # a misspelt field would be pruned silently; check the closed schema does catch one
    bad = copy.deepcopy(rule)
    bad["spec"]["groups"][0]["rules"][0]["anotations"] = {}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(closed(schema)).validate(bad)


def test_rule_labels_let_prometheus_select_it(tuned):
    assert rule_of(tuned)["metadata"]["labels"]["release"] == "prom"


def test_every_alert_is_rendered_and_described(on):
    rendered = alerts(on)
    assert sorted(rendered) == sorted(ALERT_NAMES)
    anchors = doc_anchors()
    base = VALUES["prometheusRule"]["runbookBaseUrl"]
    for name, rule in rendered.items():
        assert rule["labels"]["severity"] in SEVERITIES, name
        assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}, name
        assert all(rule["annotations"][k].strip() for k in ("summary", "description")), name
        url, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert url == base and anchor in anchors, f"{name}: runbook_url {rule['annotations']['runbook_url']}"
        for text in rule["annotations"].values():  # Prometheus templates survive helm's
            assert "{{" not in text or re.search(r"\{\{ \$(labels\.\w+|value)( \| \w+)? \}\}", text), (
                name,
                text,
            )


@pytest.mark.parametrize("case", ["on", "tuned"])
def test_every_expr_parses_and_reads_existing_series(on, tuned, case):
    for name, rule in alerts({"on": on, "tuned": tuned}[case]).items():
        check_names(rule["expr"], name)


def test_kube_state_metrics_alerts_keep_to_kubellms_objects(on):
    for name, rule in alerts(on).items():
        names = {n for n, _ in selectors(rule["expr"])}
        if names & set(runtime_metrics()):
            continue  # joined on the runtime's own series, which only kubellm's pods export
        if names & (KUBE_STATE_METRICS - {"kube_deployment_labels"}):
            assert "label_kubellm_io_llmdeployment" in rule["expr"], f"{name} reads every workload's series"
            assert 'up{kubellm_io_llmdeployment!=""}' in rule["expr"], (
                f"{name} has no fallback without the allowlist"
            )


def test_operator_alerts_select_the_operators_scrape(on, tuned):
    job = f"{RELEASE}-operator-metrics"
    assert rule_of(on)["spec"]["groups"][0]["name"] == "kubellm-operator"
    for docs, expected in ((on, job), (tuned, "ops-kubellm")):
        (group, *_) = rule_of(docs)["spec"]["groups"]
        for rule in group["rules"]:
            (series, *_) = [m for n, m in selectors(rule["expr"]) if n != "up" or "job" in m]
            assert series["job"] == ("Equal", expected) and series["namespace"] == ("Equal", NAMESPACE), rule
    # the default job is what the chart's ServiceMonitor produces: the metrics Service's name
    service_names = [s["metadata"]["name"] for s in of_kind(on, "Service")]
    assert job in service_names


def fired_values(expr: str) -> set[str]:
    return set(re.findall(r"[<>]=? *([0-9.]+)", expr))


def test_thresholds_and_durations_come_from_the_values(on, tuned):
    for docs, values in ((on, VALUES), (tuned, merged(VALUES, TUNED))):
        a, v = alerts(docs), values["prometheusRule"]["alerts"]

        def has(alert: str, value: Any, a: dict[str, dict[str, Any]] = a) -> None:
            assert format(value, "g") in fired_values(a[alert]["expr"]), (alert, value, a[alert]["expr"])

        has("KubellmOperatorAPIErrors", v["operatorApiErrors"]["perSecond"])
        has("KubellmQueueGrowing", v["queueGrowing"]["depth"])
        has("KubellmKVCacheSaturated", v["kvCacheSaturated"]["usage"])
        has("KubellmKVCacheSaturated", v["kvCacheSaturated"]["preemptionsPerSecond"])
        has("KubellmSlowFirstToken", v["slowFirstToken"]["p99Seconds"])
        has("KubellmShedding", v["shedding"]["ratio"])
        has("KubellmModelDownloadFailing", v["modelDownloadFailing"]["restarts"])
        assert f"[{v['operatorRejectingSpecs']['window']}]" in a["KubellmOperatorRejectingSpecs"]["expr"]
        durations = {
            "KubellmOperatorDown": "operatorDown", "KubellmOperatorReconcileErrors": "operatorReconcileErrors",
            "KubellmOperatorAPIErrors": "operatorApiErrors", "KubellmNoReadyReplicas": "noReadyReplicas",
            "KubellmNotReady": "notReady", "KubellmQueueGrowing": "queueGrowing",
            "KubellmQueueAboveTargetAtMaxReplicas": "queueAboveTargetAtMaxReplicas",
            "KubellmKVCacheSaturated": "kvCacheSaturated", "KubellmSlowFirstToken": "slowFirstToken",
            "KubellmShedding": "shedding", "KubellmImagePullFailing": "imagePullFailing",
            "KubellmCrashLooping": "crashLooping", "KubellmAutoscalerBlocked": "autoscalerBlocked",
            "KubellmRolloutBlockedNoSpareGPU": "rolloutBlockedNoSpareGPU",
            "KubellmKubeStateMetricsLabelsMissing": "kubeStateMetricsLabelsMissing",
        }  # fmt: skip
        for alert, key in durations.items():
            assert a[alert]["for"] == v[key]["for"], alert
        # every alert value is used by some alert
        assert set(durations.values()) | {"operatorRejectingSpecs", "modelDownloadFailing"} == set(v)
    for rule in alerts(tuned).values():
        assert rule["annotations"]["runbook_url"].startswith("https://wiki.example/ops#")


def test_disabled_alerts_are_left_out(helm):
    off = ["KubellmQueueGrowing", "KubellmOperatorDown", "KubellmKubeStateMetricsLabelsMissing"]
    docs = template(helm, {"prometheusRule": {"enabled": True, "disabledAlerts": off}})
    assert sorted(alerts(docs)) == sorted(set(ALERT_NAMES) - set(off))


@pytest.mark.parametrize(
    "bad, complaint",
    [
        ({"prometheusRule": {"disabledAlerts": ["KubellmNope"]}}, "/prometheusRule/disabledAlerts/0"),
        ({"prometheusRule": {"alerts": {"kvCacheSaturated": {"usage": 1.5}}}}, "/prometheusRule/alerts/kvCacheSaturated/usage"),
        ({"prometheusRule": {"alerts": {"shedding": {"for": "a while"}}}}, "/prometheusRule/alerts/shedding/for"),
        ({"prometheusRule": {"alerts": {"queueGrowing": {"threshold": 3}}}}, "'threshold' not allowed"),
        ({"prometheusRule": {"alerts": {"slowFirstToken": {"p99Seconds": 0}}}}, "/prometheusRule/alerts/slowFirstToken/p99Seconds"),
        ({"prometheusRule": {"runbookBaseUrl": "docs/operations.md"}}, "/prometheusRule/runbookBaseUrl"),
        ({"prometheusRule": {"operatorJob": 'a"b'}}, "/prometheusRule/operatorJob"),
        ({"grafanaDashboard": {"namespace": "Monitoring"}}, "/grafanaDashboard/namespace"),
        ({"grafanaDashboard": {"labels": {"grafana_dashboard": 1}}}, "/grafanaDashboard/labels/grafana_dashboard"),
    ],
)  # fmt: skip
def test_helm_rejects_monitoring_values_the_schema_forbids(helm, bad, complaint):
    result = helm("template", RELEASE, str(CHART), values=bad)
    assert result.returncode != 0
    assert "don't meet the specifications of the schema" in result.stderr and complaint in result.stderr, (
        result.stderr
    )
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(SCHEMA).validate(merged(VALUES, bad))


# --------------------------------------------------------------------------------------------------
# The docs point where the alerts do
# --------------------------------------------------------------------------------------------------


def doc_anchors() -> set[str]:
    """GitHub's anchors of docs/operations.md's headings."""
    anchors = set()
    for line in OPERATIONS.read_text().splitlines():
        if m := re.match(r"#+ (.+)", line):
            anchors.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return anchors


def test_operations_guide_and_readme_list_every_alert_and_no_other():
    ops = OPERATIONS.read_text()
    section = ops[ops.index("\n## Alerts\n") : ops.index("\n## Runbooks\n")]
    readme = (CHART / "README.md").read_text()
    # the section lists the per-LLMDeployment alerts (operator/render/alerts.py) too, the chart's README does not
    assert set(re.findall(r"`(Kubellm\w+)`", section)) == set(ALERT_NAMES) | set(llmdeployment_alerts.ALERT_NAMES)
    assert set(re.findall(r"`(Kubellm\w+)`", readme)) == set(ALERT_NAMES)
    assert "apiVersion: monitoring.coreos.com/v1" not in ops, "one source: the chart's template, not a copy"
    for mentioned in set(re.findall(r"\b(Kubellm[A-Z]\w+)\b", ops)):
        assert mentioned in set(ALERT_NAMES) | set(llmdeployment_alerts.ALERT_NAMES), f"docs/operations.md mentions {mentioned}"


# --------------------------------------------------------------------------------------------------
# The Grafana dashboard
# --------------------------------------------------------------------------------------------------


def dashboard_config_map(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (cm,) = of_kind(docs, "ConfigMap")
    return cm


@pytest.mark.parametrize("case", ["on", "tuned"])
def test_dashboard_config_map_is_valid_and_holds_the_file(on, tuned, case):
    docs, values = {"on": (on, merged(VALUES, ON)), "tuned": (tuned, merged(VALUES, TUNED))}[case]
    cm = dashboard_config_map(docs)
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(cm, version, strict=True)
    (data,) = cm["data"].values()
    assert json.loads(data) == DASHBOARD
    wanted = values["grafanaDashboard"]
    assert wanted["labels"].items() <= cm["metadata"]["labels"].items()
    assert cm["metadata"].get("annotations", {}) == wanted["annotations"]
    assert cm["metadata"]["namespace"] == (wanted["namespace"] or NAMESPACE)
    assert VALUES["grafanaDashboard"]["labels"] == {"grafana_dashboard": "1"}


def variables() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in DASHBOARD["templating"]["list"]}


def with_variables(expr: str) -> str:
    """A dashboard query as Grafana sends it, variables replaced by sample values."""
    for name, value in (("__rate_interval", "5m"), ("__interval", "1m"), ("namespace", "(ml|team-a)"),
                        ("llmdeployment", "(qwen|smollm2)")):  # fmt: skip
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    assert "$" not in expr.replace("$1", ""), expr
    return expr


def targets() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for panel in DASHBOARD["panels"]:
        for t in panel.get("targets", []):
            out.append((panel["title"], t))
    return out


def test_dashboard_variables_pick_data_source_namespace_and_llmdeployment():
    v = variables()
    assert list(v) == ["datasource", "namespace", "llmdeployment"]
    assert v["datasource"]["type"] == "datasource" and v["datasource"]["query"] == "prometheus"
    for name, label in (("namespace", "namespace"), ("llmdeployment", "kubellm_io_llmdeployment")):
        query = v[name]["query"]["query"]
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", query)
        assert m and m.group(2) == label, query
        check_names(with_variables(m.group(1)), f"variable {name}")
        assert v[name]["multi"] and v[name]["includeAll"] and "allValue" not in v[name]
    assert "$namespace" in v["llmdeployment"]["query"]["query"]


def test_every_dashboard_query_parses_and_reads_existing_series():
    ts = targets()
    assert len(ts) >= 14
    for title, t in ts:
        assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, title
        check_names(with_variables(t["expr"]), f"panel {title!r}")
        # every panel is filtered by the picked LLMDeployments
        assert "$llmdeployment" in t["expr"] and "$namespace" in t["expr"], title
    for annotation in DASHBOARD["annotations"]["list"]:
        if "expr" in annotation:
            check_names(with_variables(annotation["expr"]), f"annotation {annotation['name']!r}")


def test_dashboard_has_the_panels_operators_look_at():
    panels = {p["title"]: p for p in DASHBOARD["panels"] if p["type"] != "row"}
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    reads = {title: " ".join(t["expr"] for t in p["targets"]) for title, p in panels.items()}

    def panel_reading(*metrics: str) -> str:
        (title,) = [t for t, expr in reads.items() if all(m in expr for m in metrics)]
        return title

    queue = panel_reading("kubellm:num_requests_waiting", "kube_horizontalpodautoscaler_spec_target_metric")
    assert "target" in queue.lower()
    panel_reading("kubellm:kv_cache_usage_perc")
    panel_reading("kubellm:num_requests_running")
    panel_reading("kubellm:generation_tokens_total")
    panel_reading("kubellm:prompt_tokens_total")
    panel_reading("kubellm:num_preemptions_total")
    panel_reading("kubellm:prefix_cache_hits_total", "kubellm:prefix_cache_queries_total")
    shedding = panel_reading("kubellm:request_rejected_total")
    assert "reason" in panels[shedding]["targets"][0]["expr"]
    panel_reading("kube_deployment_status_replicas_available", "kube_deployment_spec_replicas",
                  "kube_horizontalpodautoscaler_status_desired_replicas")  # fmt: skip
    for metric in (
        "kubellm:time_to_first_token_seconds_bucket",
        "kubellm:inter_token_latency_seconds_bucket",
    ):
        heatmap = panels[panel_reading(metric)]
        assert heatmap["type"] == "heatmap" and heatmap["options"]["calculate"] is False
        (t,) = heatmap["targets"]
        assert t["format"] == "heatmap" and "by (le)" in t["expr"] and t["legendFormat"] == "{{le}}"
    (scale,) = [a for a in DASHBOARD["annotations"]["list"] if "expr" in a]
    assert "kube_deployment_spec_replicas" in scale["expr"] and "changes(" in scale["expr"]
