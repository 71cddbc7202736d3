"""Rendering LLMDeployments into child manifests: every built-in kind validated against the upstream OpenAPI
schemas (kubernetes-validate, strict: unknown fields fail), the LeaderWorkerSet against its CRD's schema (vendored
in data/) with its pod templates through kubernetes-validate, the other CRD kinds (KEDA ScaledObject,
ServiceMonitor) checked structurally, the PrometheusRule against its vendored upstream schema (test_alerts), the
InferencePool against its vendored upstream schema and CEL rules, plus the behaviours the operator relies on."""

from __future__ import annotations

import copy
import io
import itertools
import math
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from test_alerts import check_prometheus_rule
from test_crd import cel_violations, to_json_schema  # how tests/operator/test_crd.py admits our own CRD

from kubellm.operator import api, render
from kubellm.operator.crd import schema as crd
from kubellm.operator.render import (
    InvalidSpec,
    disruption_budget,
    inference_pool,
    multinode,
    naming,
    service_monitor,
)
from kubellm.operator.render import autoscaling as autoscaling_mod
from kubellm.operator.render import cli as render_cli
from kubellm.operator.render import deployment as deployment_mod
from kubellm.operator.render import pods as pods_mod
from kubellm.operator.render import service as service_mod

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("llmdeployment-*.yaml"))
# The oldest Kubernetes the manifests target (the preStop sleep action is on by default from 1.30; 1.31 is the
# oldest release still in upstream support) and the newest schemas kubernetes-validate bundles.
K8S_VERSIONS = ("1.31", "1.37")
UID = "6f1c2a8e-3b5d-4c7e-9f10-2a3b4c5d6e7f"
DATA = Path(__file__).parent / "data"
BUILT_IN = {("v1", "Service"), ("apps/v1", "Deployment"), ("policy/v1", "PodDisruptionBudget"),
            ("autoscaling/v2", "HorizontalPodAutoscaler")}  # fmt: skip
WORKLOADS = ("Deployment", "LeaderWorkerSet")


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def manifest(
    spec: dict[str, Any], name: str = "llm", namespace: str | None = "team-a", uid: str | None = UID
):
    meta: dict[str, Any] = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    if uid:
        meta["uid"] = uid
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": meta, "spec": copy.deepcopy(spec)}


def make(spec: dict[str, Any] | None = None, **kwargs) -> api.LLMDeployment:
    return render_cli.load(manifest(spec if spec is not None else {"model": {"uri": "smollm2"}}, **kwargs))


def merged(base: dict[str, Any], *overrides: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for override in overrides:
        for key, value in override.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merged(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
    return out


def by_kind(manifests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One manifest per kind; the second Service (scale to zero's <name>-pods) is keyed PodsService."""
    kinds = [m["kind"] for m in manifests]
    if kinds.count("Service") == 2:
        second = kinds.index("Service", kinds.index("Service") + 1)
        assert manifests[second]["metadata"]["name"].endswith(naming.PODS_SERVICE_SUFFIX)
        kinds[second] = "PodsService"
    assert len(kinds) == len(set(kinds)), kinds
    return dict(zip(kinds, manifests, strict=True))


def workload(children: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (found,) = [children[k] for k in WORKLOADS if k in children]
    return found


def pod_templates(workload_: dict[str, Any]) -> list[dict[str, Any]]:
    """The Deployment's pod template, or the LeaderWorkerSet's leader and worker templates."""
    if workload_["kind"] == "Deployment":
        return [workload_["spec"]["template"]]
    group = workload_["spec"]["leaderWorkerTemplate"]
    return [group["leaderTemplate"], group["workerTemplate"]]


LWS_VALIDATOR = jsonschema.Draft202012Validator(
    to_json_schema(yaml.safe_load((DATA / "leaderworkerset-schema.yaml").read_text()))
)  # unknown fields refused: the API server would prune a misspelt one silently


def runtime(ld: api.LLMDeployment) -> dict[str, Any]:
    (container,) = deployment_mod.render_deployment(ld)["spec"]["template"]["spec"]["containers"]
    return container


def pod_spec(ld: api.LLMDeployment) -> dict[str, Any]:
    return deployment_mod.render_deployment(ld)["spec"]["template"]["spec"]


def arg(container: dict[str, Any], flag: str) -> str | None:
    args = container["args"]
    return args[args.index(flag) + 1] if flag in args else None


_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
RESTRICTED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                           "projected", "secret"}  # fmt: skip


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """Pod Security Standards "restricted" (v1.31), the checks that apply to what we render."""
    problems = []
    pod_sc = spec.get("securityContext", {})
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            problems.append(key)
    for volume in spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            problems.append(f"volume {volume['name']}: {kinds}")
    if pod_sc.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
        problems.append("pod seccompProfile")
    if pod_sc.get("runAsUser") == 0:
        problems.append("pod runAsUser 0")
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        sc = c.get("securityContext", {})
        if sc.get("privileged"):
            problems.append(f"{c['name']}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{c['name']}: allowPrivilegeEscalation")
        if "ALL" not in sc.get("capabilities", {}).get("drop", []):
            problems.append(f"{c['name']}: capabilities.drop ALL")
        if set(sc.get("capabilities", {}).get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"{c['name']}: capabilities.add")
        if not (
            sc.get("runAsNonRoot") or (pod_sc.get("runAsNonRoot") and sc.get("runAsNonRoot") is not False)
        ):
            problems.append(f"{c['name']}: runAsNonRoot")
        if sc.get("runAsUser") == 0:
            problems.append(f"{c['name']}: runAsUser 0")
        if any("hostPort" in p for p in c.get("ports", [])):
            problems.append(f"{c['name']}: hostPort")
    return problems


def check_common(ld: api.LLMDeployment, m: dict[str, Any]) -> None:
    meta = m["metadata"]
    if meta["name"] == naming.pods_service_name(ld):  # scale to zero's second Service, for the activator
        assert m["kind"] == "Service" and naming.scales_to_zero(ld)
        labels = {**naming.labels(ld), naming.LABEL_COMPONENT: service_mod.PODS_SERVICE_COMPONENT}
    else:
        assert meta["name"] == (naming.lws_name(ld) if m["kind"] == "LeaderWorkerSet" else naming.child_name(ld))
        labels = naming.labels(ld)
    assert len(meta["name"]) <= 63 and _DNS1035.match(meta["name"])
    assert meta.get("namespace") == ld.namespace
    assert meta["labels"] == labels
    for value in meta["labels"].values():
        assert len(value) <= 63 and _LABEL_VALUE.match(value)
    if ld.metadata.get("uid"):
        assert meta["ownerReferences"] == [naming.owner_reference(ld)]


def scale_target(ld: api.LLMDeployment) -> dict[str, str]:
    if ld.spec.parallelism.nodes > 1:
        return {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "name": naming.lws_name(ld)}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": naming.child_name(ld)}


def check_leader_worker_set(ld: api.LLMDeployment, lws: dict[str, Any]) -> None:
    """The LWS CRD's own schema (unknown fields refused), then each pod template inside a Deployment through kubernetes-validate
    (the LWS embeds core/v1 PodTemplateSpecs), then the group's wiring."""
    LWS_VALIDATOR.validate(lws)
    assert len(lws["metadata"]["name"]) <= naming.MAX_LWS_NAME_LENGTH and _DNS1035.match(lws["metadata"]["name"])
    for template in pod_templates(lws):
        wrapped = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
                   "spec": {"selector": {"matchLabels": naming.selector_labels(ld)}, "template": template}}  # fmt: skip
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(wrapped, version, strict=True)
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == ld.spec.parallelism.nodes
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"
    assert ("replicas" in lws["spec"]) == (not ld.spec.autoscaling.enabled)


def check_scaled_object(ld: api.LLMDeployment, so: dict[str, Any]) -> None:
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    spec = so["spec"]
    assert set(spec) <= {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval",
                         "cooldownPeriod", "idleReplicaCount", "advanced", "triggers", "fallback"}  # fmt: skip
    assert spec["scaleTargetRef"] == scale_target(ld)
    for key in ("minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod"):
        assert isinstance(spec[key], int) and spec[key] >= 0
    assert spec["minReplicaCount"] <= spec["maxReplicaCount"]
    trigger, *activity = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] in ("AverageValue", "Value")
    assert set(trigger["metadata"]) == {"serverAddress", "query", "threshold"}
    # Scale to zero adds triggers that only say "busy": in flight in the pods, and held by the activator.
    assert bool(activity) == (spec["minReplicaCount"] == 0)
    for t in activity:
        assert set(t) == {"type", "name", "metricType", "metadata"} and t["metricType"] == "AverageValue"
        keys = {"prometheus": {"serverAddress", "query", "threshold", "activationThreshold"},
                "metrics-api": {"url", "valueLocation", "format", "targetValue", "activationTargetValue"}}
        assert set(t["metadata"]) == keys[t["type"]]
    for t in spec["triggers"]:
        assert all(isinstance(v, str) and v for v in t["metadata"].values())  # KEDA metadata is map[string]string
    assert set(spec["advanced"]) == {"horizontalPodAutoscalerConfig"}
    # The behaviour is an autoscaling/v2 HorizontalPodAutoscalerBehavior: validate it inside a synthetic HPA.
    hpa = {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "x"},
        "spec": {"scaleTargetRef": spec["scaleTargetRef"], "maxReplicas": spec["maxReplicaCount"],
                 "behavior": spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]},
    }  # fmt: skip
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(hpa, version, strict=True)


def check_service_monitor(ld: api.LLMDeployment, sm: dict[str, Any], children: dict[str, dict]) -> None:
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    spec = sm["spec"]
    assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "podTargetLabels", "jobLabel"}
    service = children["Service"]
    selector = spec["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    port_names = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme"}
        assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"
        assert re.fullmatch(r"[0-9]+s", endpoint["interval"]) and re.fullmatch(
            r"[0-9]+s", endpoint["scrapeTimeout"]
        )
    pod_labels = pod_templates(workload(children))[0]["metadata"]["labels"]
    assert set(spec["podTargetLabels"]) <= set(pod_labels)
    if ld.namespace:
        assert spec["namespaceSelector"] == {"matchNames": [ld.namespace]}


INFERENCE_POOL_SCHEMA = yaml.safe_load((DATA / "inferencepool-v1.schema.yaml").read_text())
_INFERENCE_POOL_VALIDATOR = jsonschema.Draft202012Validator(to_json_schema(INFERENCE_POOL_SCHEMA))


def inference_pool_errors(pool: dict[str, Any]) -> list[str]:
    """What an API server with the upstream InferencePool CRD would refuse: schema errors (unknown fields
    included) and broken CEL rules, after the CRD's defaults."""
    pool = crd.apply_defaults(INFERENCE_POOL_SCHEMA, copy.deepcopy(pool))
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in _INFERENCE_POOL_VALIDATOR.iter_errors(pool)]  # fmt: skip
    return errors + [f"{path}: {message}" for path, _, message in cel_violations(INFERENCE_POOL_SCHEMA, pool)]


def check_inference_pool(ld: api.LLMDeployment, pool: dict[str, Any], children: dict[str, dict]) -> None:
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert inference_pool_errors(pool) == []
    # The pool's members are exactly the Service's endpoints, on the port the runtime listens on.
    assert pool["spec"]["selector"] == {"matchLabels": children["Service"]["spec"]["selector"]}
    template = pod_templates(workload(children))[0]  # a multi-node group's leader: the only one serving
    # (the LWS controller adds the worker index to the pods' labels)
    selected = {k: v for k, v in pool["spec"]["selector"]["matchLabels"].items() if k != naming.WORKER_INDEX_LABEL}
    assert selected.items() <= template["metadata"]["labels"].items()
    (container,) = template["spec"]["containers"]
    (http,) = [p for p in container["ports"] if p["name"] == naming.PORT_NAME]
    assert pool["spec"]["targetPorts"] == [{"number": http["containerPort"]}]


def check_all(ld: api.LLMDeployment, manifests: list[dict[str, Any]]) -> None:
    children = by_kind(manifests)
    for m in manifests:
        check_common(ld, m)
        if (m["apiVersion"], m["kind"]) in BUILT_IN:
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(m, version, strict=True)
        elif m["kind"] == "LeaderWorkerSet":
            check_leader_worker_set(ld, m)
        elif m["kind"] == "ScaledObject":
            check_scaled_object(ld, m)
        elif m["kind"] == "ServiceMonitor":
            check_service_monitor(ld, m, children)
        elif m["kind"] == "InferencePool":
            check_inference_pool(ld, m, children)
        elif m["kind"] == "PrometheusRule":
            check_prometheus_rule(ld, m)
        else:
            raise AssertionError(f"unexpected kind {m['kind']}")
    order = list(dict.fromkeys((m["apiVersion"], m["kind"]) for m in manifests))
    assert order == [k for k in naming.CHILD_KINDS if k in order]
    templates = pod_templates(workload(children))
    selector = naming.selector_labels(ld)
    for template in templates:
        assert selector.items() <= template["metadata"]["labels"].items()
        assert restricted_violations(template["spec"]) == []
        for value in template["metadata"]["labels"].values():
            assert len(value) <= 63 and _LABEL_VALUE.match(value)
    if "Deployment" in children:
        assert children["Deployment"]["spec"]["selector"]["matchLabels"] == selector
        assert children["Service"]["spec"]["selector"] == selector
    else:  # the Service reaches the leaders only (the LWS controller labels each pod with its worker index)
        assert children["Service"]["spec"]["selector"] == {**selector, naming.WORKER_INDEX_LABEL: "0"}
    assert children["PodDisruptionBudget"]["spec"]["selector"] == {"matchLabels": selector}


# --------------------------------------------------------------------------------------------------
# The matrix: every built-in manifest validates against the upstream schemas
# --------------------------------------------------------------------------------------------------

GPU = {"resources": {"gpu": {"product": "NVIDIA-L4"}, "cpu": "4", "memory": "24Gi"},
       "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}  # fmt: skip
CPU = {"resources": {"gpu": {"count": 0}, "cpu": "2", "memory": "4Gi"}}
URIS = {
    "hf": {"uri": "hf://Qwen/Qwen2.5-7B-Instruct", "revision": "a1b2c3d"},
    "hf-default-branch": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"},
    "pvc": {"uri": "pvc://model-store/llama/3.2-3b/", "servedModelName": "llama-3b"},
    "pvc-claim-root": {"uri": "pvc://llama-gguf"},
    "file": {"uri": "file:///opt/models/llama.gguf"},
    "name": {"uri": "smollm2"},
}
AUTOSCALING = {
    "off": {"replicas": 3},
    "hpa": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6, "targetQueueDepth": 8}},
    "keda": {"autoscaling": {"enabled": True, "backend": "keda", "minReplicas": 0, "maxReplicas": 3,
                             "scaleDownStabilizationSeconds": 900}},
}  # fmt: skip
MONITORING = {"Enabled": (False,), "Disabled": (True,), "Auto": (False, True)}
HARDWARE = {
    "cpu": CPU,
    "gpu": GPU,
    "tp2": merged(GPU, {"parallelism": {"tensor": 2}}),
    "tp4": merged(GPU, {"parallelism": {"tensor": 4}, "resources": {"gpu": {"count": 8}}}),
    "amd": merged(GPU, {"resources": {"gpu": {"resourceName": "amd.com/gpu", "product": None}}}),
    "nodes2": merged(CPU, {"parallelism": {"tensor": 2, "nodes": 2}}),
    "nodes4": merged(CPU, {"parallelism": {"tensor": 4, "nodes": 4, "rendezvousPort": 23456}}),
    "nodes2-gpu": merged(GPU, {"parallelism": {"tensor": 16, "nodes": 2}, "resources": {"gpu": {"count": 8}}}),
}
FULL = merged(
    GPU,
    {
        "model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct", "servedModelName": "llama"},
        "dtype": "float16",
        "engine": {"maxModelLen": 8192, "maxNumSeqs": 64, "maxNumBatchedTokens": 4096, "kvCacheBlockSize": 32,
                   "kvCacheMemoryFraction": 0.8, "prefixCaching": False,
                   "speculative": {"ngram": 3, "numTokens": 6}},
        "resources": {"cpu": "3500m", "memory": "30Gi", "limits": {"cpu": "8", "memory": "32Gi"}},
        "rollout": {"maxSurge": "25%", "maxUnavailable": "10%", "drainTimeoutSeconds": 120},
        "probes": {"startupTimeoutSeconds": 901, "readinessPeriodSeconds": 5, "readinessTimeoutSeconds": 11},
        "image": "registry.example.com/kubellm/runtime@sha256:" + "a" * 64,
        "imagePullPolicy": "Always",
        "nodeSelector": {"topology.kubernetes.io/zone": "eu-west-1a"},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "node.kubernetes.io/instance-type", "operator": "In",
                                   "values": ["g6.xlarge"]}]}]}}},
        "priorityClassName": "inference-high",
        "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
                {"name": "HOME", "value": "/tmp/home"}, {"name": "LOG_LEVEL", "value": "debug"}],
        "podLabels": {"team": "search", "example.com/cost-center": "42"},
        "podAnnotations": {"example.com/owner": "search-team", "note": "anything: goes here"},
        "service": {"type": "LoadBalancer", "port": 8080},
        "auth": {"apiKeySecretRef": {"name": "llama-keys", "key": "keys"}},
        "gateway": {"inferencePool": {"enabled": True, "endpointPickerRef": {"name": "llama-epp", "port": 9003,
                                                                            "failureMode": "FailOpen"}}},
        "monitoring": {"alerts": {"enabled": True, "ttftP99SecondsSLO": 3, "labels": {"team": "search"}}},
    },
)  # fmt: skip


def _cases() -> list[tuple[str, dict[str, Any], bool]]:
    cases: list[tuple[str, dict[str, Any], bool]] = []
    for path in EXAMPLES:
        spec = yaml.safe_load(path.read_text())["spec"]
        for available in (False, True):
            cases.append((f"example-{path.stem}-sm{available}", spec, available))
    for (uri_id, uri), (auto_id, auto), (mode, availables) in itertools.product(
        URIS.items(), AUTOSCALING.items(), MONITORING.items()
    ):
        for available in availables:
            spec = merged(
                GPU if uri_id != "name" else CPU,
                {"model": uri},
                auto,
                {"monitoring": {"serviceMonitor": mode}},
            )
            cases.append((f"{uri_id}-{auto_id}-{mode}-sm{available}", spec, available))
    for hw_id, hw in HARDWARE.items():
        for quant in api.QUANTIZATIONS:  # every one on CPU and GPU alike
            spec = merged(hw, {"model": {"uri": "hf://Qwen/Qwen2.5-7B-Instruct"}, "quantization": quant})
            cases.append((f"{hw_id}-{quant}", spec, False))
    cases.append(("full", FULL, True))
    cases.append(("full-nodeport", merged(FULL, {"service": {"type": "NodePort"}, "replicas": 0}), True))
    cases.append(("minimal", {"model": {"uri": "smollm2"}}, False))
    cases.append(("pool-without-epp", {"model": {"uri": "smollm2"}, "gateway": {"inferencePool": {"enabled": True}}},
                  False))
    for auto_id in ("hpa", "keda"):
        spec = merged(HARDWARE["nodes2"], {"model": {"uri": "smollm2"}}, AUTOSCALING[auto_id])
        cases.append((f"nodes2-{auto_id}", spec, True))
    cases.append(("full-nodes2", merged(FULL, {"parallelism": {"tensor": 2, "nodes": 2}}), True))
    cases.append(("pool-nodes2", merged(HARDWARE["nodes2"], {"model": {"uri": "smollm2"}, "gateway": {
        "inferencePool": {"enabled": True, "endpointPickerRef": {"name": "epp"}}}}), False))  # fmt: skip
    return cases


CASES = _cases()
NAMES = ["llm", "a" * 63, "x" * 200, "qwen2.5.7b", "7b-chat", "0"]


@pytest.mark.parametrize(("spec", "available"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_matrix_manifests_are_valid(spec, available):
    ld = make(spec)
    check_all(ld, render.render(ld, service_monitor_available=available))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("namespace", [None, "team-a"])
def test_names_fit_everywhere(name, namespace):
    ld = make(merged(CPU, {"model": {"uri": "smollm2"}}, AUTOSCALING["keda"]), name=name, namespace=namespace)
    if len(naming.child_name(ld)) > 63 - len(naming.PODS_SERVICE_SUFFIX):
        # Scale to zero needs <name>-pods, which the activator derives from the Service name: refused, not cut.
        with pytest.raises(InvalidSpec, match="shorten metadata.name to at most 58 characters"):
            render.render(ld)
        ld = make(merged(CPU, {"model": {"uri": "smollm2"}}, AUTOSCALING["keda"],
                         {"autoscaling": {"minReplicas": 1}}), name=name, namespace=namespace)  # fmt: skip
    check_all(ld, render.render(ld, service_monitor_available=True))
    ld = make(merged(GPU, {"model": {"uri": "smollm2"}}, AUTOSCALING["hpa"]), name=name, namespace=namespace)
    check_all(ld, render.render(ld))
    ld = make(merged(HARDWARE["nodes2"], {"model": {"uri": "smollm2"}}), name=name, namespace=namespace)
    check_all(ld, render.render(ld))


def test_matrix_covers_what_it_claims():
    ids = [c[0] for c in CASES]
    assert len([i for i in ids if i.startswith("example-")]) == 2 * len(EXAMPLES) == 20
    kinds = set()
    for _, spec, available in CASES:
        kinds |= {m["kind"] for m in render.render(make(spec), service_monitor_available=available)}
    assert kinds == {k for _, k in naming.CHILD_KINDS}


# --------------------------------------------------------------------------------------------------
# Names, labels, owner references
# --------------------------------------------------------------------------------------------------


def test_child_name_is_the_name_when_it_fits():
    assert naming.child_name(make(name="qwen2-5-7b")) == "qwen2-5-7b"
    assert naming.child_name(make(name="a" * 63)) == "a" * 63


def test_child_name_shortens_and_sanitises_with_a_hash():
    long_a, long_b = make(name="m" * 100 + "a"), make(name="m" * 100 + "b")
    assert naming.child_name(long_a) != naming.child_name(long_b)
    assert naming.child_name(long_a) == naming.child_name(make(name="m" * 100 + "a"))  # deterministic
    for ld in (long_a, make(name="qwen2.5.7b"), make(name="7b-chat")):
        name = naming.child_name(ld)
        assert len(name) <= 63 and _DNS1035.match(name), name
    # Sanitising gets a hash too, so "qwen2.5" and "qwen2-5" never share children.
    assert naming.child_name(make(name="qwen2.5")) != naming.child_name(make(name="qwen2-5"))
    assert naming.child_name(make(name="7b-chat")).startswith("llm-7b-chat-")
    assert naming.label_value(make(name="qwen2.5.7b")) == "qwen2.5.7b"  # dots are fine in label values
    assert len(naming.label_value(long_a)) == 63


def test_missing_or_invalid_name_is_invalid_spec():
    ld = make()
    ld.metadata.pop("name")
    with pytest.raises(InvalidSpec, match="metadata.name is required"):
        render.render(ld)
    ld.metadata["name"] = "Not_Valid"
    with pytest.raises(InvalidSpec, match="DNS subdomain"):
        render.render(ld)


def test_owner_reference_on_every_child():
    for spec, available in [(c[1], c[2]) for c in CASES]:
        ld = make(spec, name="owner")
        for m in render.render(ld, service_monitor_available=available):
            assert m["metadata"]["ownerReferences"] == [
                {"apiVersion": "kubellm.io/v1alpha1", "kind": "LLMDeployment", "name": "owner", "uid": UID,
                 "controller": True, "blockOwnerDeletion": True}
            ]  # fmt: skip


def test_no_uid_means_no_owner_reference():
    ld = make(uid=None)
    assert naming.owner_reference(ld) is None
    assert all("ownerReferences" not in m["metadata"] for m in render.render(ld))


def test_labels():
    ld = make(name="qwen", spec={"model": {"uri": "smollm2"}, "podLabels": {"team": "a"}})
    assert naming.labels(ld) == {
        "app.kubernetes.io/name": "kubellm",
        "app.kubernetes.io/instance": "qwen",
        "app.kubernetes.io/component": "runtime",
        "app.kubernetes.io/managed-by": "kubellm-operator",
        "kubellm.io/llmdeployment": "qwen",
    }
    assert naming.label_selector(ld) == (
        "app.kubernetes.io/component=runtime,app.kubernetes.io/instance=qwen,app.kubernetes.io/name=kubellm"
    )
    template = deployment_mod.render_deployment(ld)["spec"]["template"]
    assert template["metadata"]["labels"] == {"team": "a", **naming.labels(ld)}


@pytest.mark.parametrize(
    "change",
    [
        {"model": {"uri": "hf://org/other"}},
        {"image": "example.com/kubellm:2"},
        {"podLabels": {"version": "v2"}},
        {"parallelism": {"tensor": 2}, "resources": {"gpu": {"count": 2}}},
        {"autoscaling": {"enabled": True}},
        {"quantization": "int8", "dtype": "float16"},
    ],
)
def test_selector_is_stable_across_spec_changes(change):
    before = make({"model": {"uri": "smollm2"}})
    after = make(merged({"model": {"uri": "smollm2"}}, change))
    for old, new in zip(render.render(before), render.render(after), strict=False):
        assert old["kind"] == new["kind"]
        if old["kind"] in ("Deployment", "PodDisruptionBudget"):
            assert old["spec"]["selector"] == new["spec"]["selector"]
        if old["kind"] == "Service":
            assert old["spec"]["selector"] == new["spec"]["selector"]
    assert naming.selector_labels(before) == naming.selector_labels(after)


# --------------------------------------------------------------------------------------------------
# Deployment behaviours
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["hpa", "keda"])
def test_autoscaling_leaves_replicas_out(backend):
    ld = make(
        {"model": {"uri": "smollm2"}, "replicas": 3, "autoscaling": {"enabled": True, "backend": backend}}
    )
    assert "replicas" not in deployment_mod.render_deployment(ld)["spec"]
    assert (
        deployment_mod.render_deployment(make({"model": {"uri": "smollm2"}, "replicas": 3}))["spec"]["replicas"] == 3
    )
    assert (
        deployment_mod.render_deployment(make({"model": {"uri": "smollm2"}, "replicas": 0}))["spec"]["replicas"] == 0
    )


@pytest.mark.parametrize("tensor", [1, 2, 4])
def test_gpu_count_defaults_to_tensor_parallelism(tensor):
    ld = make({"model": {"uri": "smollm2"}, "parallelism": {"tensor": tensor}})
    resources = runtime(ld)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == str(tensor)
    assert arg(runtime(ld), "--tensor-parallel-size") == (str(tensor) if tensor > 1 else None)
    assert arg(runtime(ld), "--device") == "cuda"
    assert pod_spec(ld)["volumes"][0]["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{tensor}Gi"}


def test_gpu_resource_name_and_product_are_honoured():
    ld = make({"model": {"uri": "smollm2"},
               "resources": {"gpu": {"count": 2, "resourceName": "amd.com/gpu", "product": "MI300X"}}})  # fmt: skip
    resources = runtime(ld)["resources"]
    assert resources == {"requests": {"amd.com/gpu": "2"}, "limits": {"amd.com/gpu": "2"}}
    assert pod_spec(ld)["nodeSelector"] == {api.GPU_PRODUCT_LABEL: "MI300X"}
    # init containers get no GPUs (they would hold them for the whole download)
    assert "amd.com/gpu" not in str(pod_spec(ld)["initContainers"][0].get("resources"))


def test_cpu_only_has_no_gpu_anything():
    ld = make(merged(CPU, {"model": {"uri": "smollm2"}, "nodeSelector": {"kubernetes.io/arch": "amd64"}}))
    c = runtime(ld)
    assert c["resources"] == {
        "requests": {"cpu": "2", "memory": "4Gi"},
        "limits": {"cpu": "2", "memory": "4Gi"},
    }
    assert "gpu" not in yaml.safe_dump(c["resources"])
    assert pod_spec(ld)["nodeSelector"] == {"kubernetes.io/arch": "amd64"}
    assert arg(c, "--device") == "cpu"
    assert arg(c, "--num-threads") == "2"


@pytest.mark.parametrize(
    ("cpu", "limit", "threads"), [("500m", None, "1"), ("2", "3500m", "3"), (None, None, None)]
)
def test_num_threads_follows_the_cpu_limit(cpu, limit, threads):
    resources: dict[str, Any] = {"gpu": {"count": 0}}
    if cpu:
        resources["cpu"] = cpu
    if limit:
        resources["limits"] = {"cpu": limit}
    assert (
        arg(runtime(make({"model": {"uri": "smollm2"}, "resources": resources})), "--num-threads") == threads
    )


@pytest.mark.parametrize("drain", [0, 30, 600])
def test_termination_grace_covers_prestop_and_drain(drain):
    ld = make({"model": {"uri": "smollm2"}, "rollout": {"drainTimeoutSeconds": drain}})
    c = runtime(ld)
    assert c["lifecycle"] == {"preStop": {"sleep": {"seconds": pods_mod.PRESTOP_SLEEP_SECONDS}}}
    assert arg(c, "--drain-timeout") == str(drain)
    assert pod_spec(ld)["terminationGracePeriodSeconds"] == (
        pods_mod.PRESTOP_SLEEP_SECONDS + drain + pods_mod.TERMINATION_MARGIN_SECONDS
    )
    assert pod_spec(ld)["terminationGracePeriodSeconds"] > pods_mod.PRESTOP_SLEEP_SECONDS + drain


@pytest.mark.parametrize("timeout", [api.RUNTIME_PROBE_DEADLINE_SECONDS + 1, 15, 60])
def test_readiness_timeout_exceeds_the_runtime_deadline(timeout):
    c = runtime(make({"model": {"uri": "smollm2"}, "probes": {"readinessTimeoutSeconds": timeout,
                                                               "readinessPeriodSeconds": 7}}))  # fmt: skip
    probe = c["readinessProbe"]
    assert probe["httpGet"] == {"path": "/health/ready", "port": "http", "scheme": "HTTP"}
    assert (
        probe["timeoutSeconds"] == timeout and probe["periodSeconds"] == 7 and probe["failureThreshold"] == 3
    )
    assert 0 < float(arg(c, "--probe-timeout")) < probe["timeoutSeconds"]


@pytest.mark.parametrize("budget", [1, 9, 10, 11, 600, 1801])
def test_startup_probe_covers_the_load_budget(budget):
    c = runtime(make({"model": {"uri": "smollm2"}, "probes": {"startupTimeoutSeconds": budget}}))
    probe = c["startupProbe"]
    assert probe["httpGet"]["path"] == "/health/startup" and probe["periodSeconds"] == 10
    assert probe["failureThreshold"] == math.ceil(budget / 10)
    assert probe["failureThreshold"] * probe["periodSeconds"] >= budget
    assert (probe["failureThreshold"] - 1) * probe["periodSeconds"] < budget


def test_liveness_probe():
    probe = runtime(make())["livenessProbe"]
    assert probe == {"httpGet": {"path": "/health/live", "port": "http", "scheme": "HTTP"}, "periodSeconds": 10,
                     "timeoutSeconds": 5, "failureThreshold": 6}  # fmt: skip


def test_rollout_defaults_and_overrides():
    strategy = deployment_mod.render_deployment(make())["spec"]["strategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    ld = make({"model": {"uri": "smollm2"}, "rollout": {"maxSurge": 0, "maxUnavailable": "50%"}})
    assert deployment_mod.render_deployment(ld)["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": 0,
        "maxUnavailable": "50%",
    }
    assert deployment_mod.render_deployment(ld)["spec"]["revisionHistoryLimit"] == deployment_mod.REVISION_HISTORY_LIMIT


def test_progress_deadline_exceeds_the_startup_budget():
    ld = make({"model": {"uri": "smollm2"}, "probes": {"startupTimeoutSeconds": 1800}})
    assert deployment_mod.render_deployment(ld)["spec"]["progressDeadlineSeconds"] > 1800


def test_security_context_is_restricted():
    for spec, _ in [(c[1], c[2]) for c in CASES]:
        ps = pod_spec(make(spec))
        assert restricted_violations(ps) == []
        assert ps["securityContext"] == {
            "runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
            "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"},
        }  # fmt: skip
        assert ps["automountServiceAccountToken"] is False
        for c in [*ps.get("initContainers", []), *ps["containers"]]:
            assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}  # fmt: skip
            # read-only root: everything the runtime writes has a volume
            mounts = {m["mountPath"] for m in c["volumeMounts"]}
            assert {"/tmp", "/cache"} <= mounts
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["KUBELLM_CACHE"] == "/cache"


def test_restricted_checker_catches_violations():
    ps = pod_spec(make())
    bad = copy.deepcopy(ps)
    bad["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    bad["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    del bad["securityContext"]["seccompProfile"]
    assert len(restricted_violations(bad)) == 3


def test_volumes_and_mounts():
    ps = pod_spec(make())
    volumes = {v["name"]: v for v in ps["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory" and "sizeLimit" in volumes["dshm"]["emptyDir"]
    assert {"cache", "tmp"} <= set(volumes)
    for c in [*ps.get("initContainers", []), *ps["containers"]]:
        for mount in c["volumeMounts"]:
            assert mount["name"] in volumes


def test_env_merges_user_variables_without_duplicates():
    c = runtime(make(FULL))
    names = [e["name"] for e in c["env"]]
    assert len(names) == len(set(names))
    env = {e["name"]: e for e in c["env"]}
    assert env["HOME"]["value"] == "/tmp/home"  # the user's value wins over the default HOME
    assert env["KUBELLM_CACHE"]["value"] == "/cache"
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert names.index("KUBELLM_CACHE") < names.index(
        "HF_TOKEN"
    )  # built-ins first: user values may use $(...)


def _resolve_env(env: list[dict[str, Any]], secrets: dict[tuple[str, str], str]) -> dict[str, str]:
    """What the kubelet hands the container: values, and secretKeyRefs looked up in ``secrets``."""
    out = {}
    for e in env:
        if "value" in e:
            out[e["name"]] = e["value"]
        elif ref := e.get("valueFrom", {}).get("secretKeyRef"):
            assert not ref.get("optional"), (
                "a missing key Secret must stop the pod, not start it without keys"
            )
            out[e["name"]] = secrets[(ref["name"], ref["key"])]
    return out


@pytest.mark.parametrize("key", [None, "token"])
def test_api_key_secret_reaches_the_runtime_and_only_the_runtime(key):
    from kubellm.runtime.cli import build_parser
    from kubellm.runtime.server import auth

    ref = {"name": "llm-keys"} if key is None else {"name": "llm-keys", "key": key}
    ld = make({"model": {"uri": "hf://org/model"}, "auth": {"apiKeySecretRef": ref}})
    ps = pod_spec(ld)
    secrets = {("llm-keys", key or "api-key"): "k-old, k-new"}
    container = ps["containers"][0]
    env = _resolve_env(container["env"], secrets)
    args = build_parser().parse_args(["serve", *container["args"]])
    assert auth.api_keys_from(args.api_key, env) == ("k-old", "k-new")
    assert pods_mod.API_KEY_ENV == auth.API_KEY_ENV
    for init in ps["initContainers"]:  # the model download never sees the key
        assert auth.API_KEY_ENV not in {e["name"] for e in init["env"]}
    # Without auth nothing is rendered, so the runtime asks for no key.
    plain = pod_spec(make({"model": {"uri": "hf://org/model"}}))["containers"][0]
    assert auth.api_keys_from(None, _resolve_env(plain["env"], {})) == ()


def test_api_key_secret_changes_the_pods():
    """Turning keys on or pointing at another Secret rolls the pods (the env is part of the template)."""
    base = {"model": {"uri": "smollm2"}}
    hashes = {
        pods_mod.spec_hash(deployment_mod.render_deployment(make(merged(base, extra)))["spec"]["template"])
        for extra in (
            {},
            {"auth": {"apiKeySecretRef": {"name": "a"}}},
            {"auth": {"apiKeySecretRef": {"name": "b"}}},
        )
    }
    assert len(hashes) == 3


def test_pod_spec_passthrough_fields():
    ld = make(FULL)
    ps = pod_spec(ld)
    assert ps["affinity"] == FULL["affinity"]
    assert ps["priorityClassName"] == "inference-high"
    assert ps["tolerations"] == FULL["tolerations"]
    assert ps["nodeSelector"] == {
        "topology.kubernetes.io/zone": "eu-west-1a",
        api.GPU_PRODUCT_LABEL: "NVIDIA-L4",
    }
    c = ps["containers"][0]
    assert c["image"] == FULL["image"] and c["imagePullPolicy"] == "Always"
    annotations = deployment_mod.render_deployment(ld)["spec"]["template"]["metadata"]["annotations"]
    assert {k: v for k, v in annotations.items() if k != naming.SPEC_HASH_ANNOTATION} == FULL[
        "podAnnotations"
    ]
    assert c["resources"]["limits"] == {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "1"}


# --------------------------------------------------------------------------------------------------
# Runtime arguments and model sources
# --------------------------------------------------------------------------------------------------


def test_runtime_args_full():
    c = runtime(make(FULL))
    assert c["command"] == ["kubellm", "serve"]
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert c["args"] == [
        "--model", "/models/meta-llama/Llama-3.1-8B-Instruct",
        "--served-model-name", "llama",
        "--port", "8000",
        "--device", "cuda",
        "--dtype", "float16",
        "--max-model-len", "8192",
        "--max-num-seqs", "64",
        "--max-num-batched-tokens", "4096",
        "--block-size", "32",
        "--kv-cache-memory-fraction", "0.8",
        "--no-prefix-caching",
        "--speculative-ngram", "3",
        "--num-speculative-tokens", "6",
        "--num-threads", "8",
        "--drain-timeout", "120",
        "--probe-timeout", "9",
        "--log-format", "json",
    ]  # fmt: skip


def test_runtime_args_leave_unchanged_defaults_out():
    c = runtime(make(merged(CPU, {"model": {"uri": "smollm2"}})))
    assert not {"--kv-cache-memory-fraction", "--quantization", "--tensor-parallel-size"} & set(c["args"])
    assert arg(c, "--served-model-name") == "smollm2"
    assert arg(c, "--dtype") == "auto"
    assert "--max-model-len" not in c["args"] and "--no-prefix-caching" not in c["args"]


@pytest.mark.parametrize("quant", api.QUANTIZATIONS)
def test_quantization_flag(quant):
    c = runtime(make({"model": {"uri": "smollm2"}, "quantization": quant}))
    assert arg(c, "--quantization") == (None if quant == "none" else quant)


def test_rendered_commands_parse_with_the_runtime_cli():
    """Every flag and command the manifests use exists in `kubellm`, with the value render gives it."""
    from kubellm.runtime.cli import build_parser

    parser = build_parser()
    for spec in [c[1] for c in CASES]:
        ps = pod_spec(make(spec))
        assert ps["containers"][0]["command"] == ["kubellm", "serve"]
        args = parser.parse_args(["serve", *ps["containers"][0]["args"]])
        ld_spec = make(spec).spec
        assert args.quantization == ld_spec.quantization
        assert args.tensor_parallel_size == ld_spec.parallelism.tensor
        assert args.kv_cache_memory_fraction == ld_spec.engine.kv_cache_memory_fraction
        for init in ps.get("initContainers", []):
            command = init["command"]
            assert command[:4] == ["kubellm", "--log-format", "json", "models"]
            parser.parse_args(command[1:])


@pytest.mark.parametrize(
    ("uri", "revision", "model_arg", "init", "volume"),
    [
        ("hf://Qwen/Qwen2.5-7B-Instruct", "v2",
         "/models/Qwen/Qwen2.5-7B-Instruct",
         ["kubellm", "--log-format", "json", "models", "download", "hf://Qwen/Qwen2.5-7B-Instruct",
          "--revision", "v2", "--dest", "/models/Qwen/Qwen2.5-7B-Instruct"],
         {"name": "models", "emptyDir": {}}),
        ("hf://Qwen/Qwen2.5-7B-Instruct", None,
         "/models/Qwen/Qwen2.5-7B-Instruct",
         ["kubellm", "--log-format", "json", "models", "download", "hf://Qwen/Qwen2.5-7B-Instruct",
          "--dest", "/models/Qwen/Qwen2.5-7B-Instruct"],
         {"name": "models", "emptyDir": {}}),
        ("pvc://store/llama/3b.gguf", None, "/models/llama/3b.gguf", None,
         {"name": "models", "persistentVolumeClaim": {"claimName": "store", "readOnly": True}}),
        ("pvc://store//llama/./3b/", None, "/models/llama/3b", None,
         {"name": "models", "persistentVolumeClaim": {"claimName": "store", "readOnly": True}}),
        ("pvc://store", None, "/models", None,
         {"name": "models", "persistentVolumeClaim": {"claimName": "store", "readOnly": True}}),
        ("file:///opt/models/llama.gguf", None, "/opt/models/llama.gguf", None, None),
        ("smollm2", None, "smollm2", ["kubellm", "--log-format", "json", "models", "pull", "smollm2"], None),
    ],
)  # fmt: skip
def test_model_sources(uri, revision, model_arg, init, volume):
    model: dict[str, Any] = {"uri": uri}
    if revision:
        model["revision"] = revision
    ps = pod_spec(make({"model": model}))
    c = ps["containers"][0]
    assert arg(c, "--model") == model_arg
    volumes = {v["name"]: v for v in ps["volumes"]}
    assert volumes.get("models") == volume
    main_mounts = {m["name"]: m for m in c["volumeMounts"]}
    if volume is not None:
        assert main_mounts["models"] == {"name": "models", "mountPath": "/models", "readOnly": True}
    else:
        assert "models" not in main_mounts
    if init is None:
        assert "initContainers" not in ps
    else:
        (container,) = ps["initContainers"]
        assert container["command"] == init
        assert container["image"] == c["image"] and container["env"] == c["env"]
        init_mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert init_mounts["cache"] == {"name": "cache", "mountPath": "/cache"}
        if uri.startswith("hf://"):
            assert init_mounts["models"] == {"name": "models", "mountPath": "/models"}  # writable


@pytest.mark.parametrize(
    ("uri", "draft_arg", "init", "volume"),
    [
        ("hf://Qwen/Qwen2.5-0.5B-Instruct", "/draft-models/Qwen/Qwen2.5-0.5B-Instruct",
         ["kubellm", "--log-format", "json", "models", "download", "hf://Qwen/Qwen2.5-0.5B-Instruct",
          "--dest", "/draft-models/Qwen/Qwen2.5-0.5B-Instruct"],
         {"name": "draft-models", "emptyDir": {}}),
        ("pvc://store/qwen-0.5b", "/draft-models/qwen-0.5b", None,
         {"name": "draft-models", "persistentVolumeClaim": {"claimName": "store", "readOnly": True}}),
        ("file:///opt/draft", "/opt/draft", None, None),
        ("smollm2", "smollm2", ["kubellm", "--log-format", "json", "models", "pull", "smollm2"], None),
    ],
)  # fmt: skip
def test_a_draft_model_is_fetched_like_the_model_and_passed_to_the_runtime(uri, draft_arg, init, volume):
    """engine.speculative.model gets its own volume (/draft-models) and init container beside the model's."""
    ps = pod_spec(make({"model": {"uri": "hf://Qwen/Qwen2.5-7B-Instruct"},
                        "engine": {"speculative": {"numTokens": 5, "model": {"uri": uri}}}}))
    c = ps["containers"][0]
    assert arg(c, "--speculative-model") == draft_arg
    assert arg(c, "--num-speculative-tokens") == "5"
    assert arg(c, "--speculative-ngram") is None
    assert arg(c, "--speculative-method") is None  # draft_model, the default
    assert arg(c, "--model") == "/models/Qwen/Qwen2.5-7B-Instruct"
    volumes = {v["name"]: v for v in ps["volumes"]}
    assert volumes.get("draft-models") == volume
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    if volume is not None:
        assert mounts["draft-models"] == {"name": "draft-models", "mountPath": "/draft-models", "readOnly": True}
    else:
        assert "draft-models" not in mounts
    inits = {i["name"]: i for i in ps["initContainers"]}
    assert inits["download-model"]["command"][5] == "hf://Qwen/Qwen2.5-7B-Instruct"
    drafts = [i for name, i in inits.items() if name.endswith("draft-model")]
    assert [i["command"] for i in drafts] == ([init] if init else [])
    if uri.startswith("hf://"):
        assert {"name": "draft-models", "mountPath": "/draft-models"} in drafts[0]["volumeMounts"]  # writable


def test_an_eagle_head_is_fetched_like_a_draft_model_and_named_by_the_method():
    ps = pod_spec(make({"model": {"uri": "hf://meta-llama/Meta-Llama-3-8B-Instruct"}, "engine": {"speculative": {
        "method": "eagle", "model": {"uri": "hf://yuhuili/EAGLE-LLaMA3-Instruct-8B"}}}}))
    c = ps["containers"][0]
    assert arg(c, "--speculative-method") == "eagle"
    assert arg(c, "--speculative-model") == "/draft-models/yuhuili/EAGLE-LLaMA3-Instruct-8B"
    assert "download-draft-model" in {i["name"] for i in ps["initContainers"]}


def test_without_a_draft_model_nothing_of_it_is_rendered():
    ps = pod_spec(make({"model": {"uri": "hf://a/b"}, "engine": {"speculative": {"ngram": 3}}}))
    assert arg(ps["containers"][0], "--speculative-model") is None
    assert arg(ps["containers"][0], "--speculative-ngram") == "3"
    assert [i["name"] for i in ps["initContainers"]] == ["download-model"]
    assert "draft-models" not in {v["name"] for v in ps["volumes"]}


def test_a_draft_pvc_path_leaving_its_claim_is_refused():
    ld = make({"model": {"uri": "smollm2"}, "engine": {"speculative": {"model": {"uri": "pvc://store/../etc"}}}})
    with pytest.raises(render.InvalidSpec, match=r"spec.engine.speculative.model.uri: pvc://store/../etc has a '..'"):
        render.render(ld)


def test_init_container_shares_cpu_and_memory_for_guaranteed_qos():
    ps = pod_spec(make(merged(GPU, {"model": {"uri": "hf://a/b"}})))
    assert ps["initContainers"][0]["resources"] == {"requests": {"cpu": "4", "memory": "24Gi"},
                                                    "limits": {"cpu": "4", "memory": "24Gi"}}  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Spec hash, determinism, purity
# --------------------------------------------------------------------------------------------------


def _hash(spec: dict[str, Any]) -> str:
    return deployment_mod.render_deployment(make(spec))["spec"]["template"]["metadata"]["annotations"][
        naming.SPEC_HASH_ANNOTATION
    ]


def test_spec_hash_follows_the_pods_only():
    base = merged(GPU, {"model": {"uri": "hf://Qwen/Qwen2.5-7B-Instruct"}, "replicas": 2})
    h = _hash(base)
    assert re.fullmatch(r"[0-9a-f]{16}", h)
    for change in ({"model": {"uri": "hf://Qwen/Qwen2.5-14B-Instruct"}}, {"model": {"revision": "v2"}},
                   {"image": "example.com/runtime:2"}, {"engine": {"maxNumSeqs": 8}},
                   {"resources": {"memory": "32Gi"}}, {"rollout": {"drainTimeoutSeconds": 90}},
                   {"probes": {"readinessTimeoutSeconds": 20}}, {"env": [{"name": "A", "value": "1"}]}):  # fmt: skip
        assert _hash(merged(base, change)) != h, change
    for change in ({"replicas": 5}, {"autoscaling": {"enabled": True, "maxReplicas": 9}},
                   {"service": {"port": 8080, "type": "NodePort"}}, {"monitoring": {"serviceMonitor": "Disabled"}},
                   {"rollout": {"maxSurge": 2}}):  # fmt: skip
        assert _hash(merged(base, change)) == h, change


def test_spec_hash_ignores_key_order():
    a = make({"model": {"uri": "smollm2"}, "podAnnotations": {"a": "1", "b": "2"}})
    b = make({"model": {"uri": "smollm2"}, "podAnnotations": {"b": "2", "a": "1"}})
    key = naming.SPEC_HASH_ANNOTATION
    assert (deployment_mod.render_deployment(a)["spec"]["template"]["metadata"]["annotations"][key]
            == deployment_mod.render_deployment(b)["spec"]["template"]["metadata"]["annotations"][key])  # fmt: skip


def test_render_is_deterministic_and_pure():
    for spec, available in [(c[1], c[2]) for c in CASES]:
        ld = make(spec)
        before = ld.model_dump()
        first = render.render(ld, service_monitor_available=available)
        second = render.render(make(spec), service_monitor_available=available)
        assert first == second
        assert render_cli.to_yaml(first) == render_cli.to_yaml(second)
        assert ld.model_dump() == before
        # The output shares no mutable state with the input.
        for m in first:
            _scramble(m)
        assert ld.model_dump() == before
        assert render.render(ld, service_monitor_available=available) == second


def _scramble(node: Any) -> None:
    if isinstance(node, dict):
        for value in node.values():
            _scramble(value)
        node["scrambled"] = True
    elif isinstance(node, list):
        for value in node:
            _scramble(value)
        node.append("scrambled")


# --------------------------------------------------------------------------------------------------
# Children that come and go
# --------------------------------------------------------------------------------------------------


def test_service():
    svc = service_mod.render_service(make(merged(FULL, {"service": {"type": "NodePort", "port": 9000}})))
    assert svc["spec"] == {
        "type": "NodePort",
        "selector": naming.selector_labels(make()) | {"app.kubernetes.io/instance": "llm"},
        "ports": [
            {"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"}
        ],
    }
    assert service_mod.render_service(make())["spec"]["ports"][0]["port"] == 80


def test_pdb_never_blocks_a_single_replica_drain():
    pdb = disruption_budget.render_pdb(make({"model": {"uri": "smollm2"}, "replicas": 1}))
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_hpa():
    ld = make(merged({"model": {"uri": "smollm2"}}, AUTOSCALING["hpa"],
                     {"autoscaling": {"scaleUpStabilizationSeconds": 30, "scaleDownStabilizationSeconds": 600}}))  # fmt: skip
    hpa = autoscaling_mod.render_hpa(ld)
    assert autoscaling_mod.render_scaled_object(ld) is None
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llm"}
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 6)
    assert spec["metrics"] == [{"type": "Pods", "pods": {"metric": {"name": "kubellm_num_requests_waiting"},
                                                         "target": {"type": "AverageValue", "averageValue": "8"}}}]  # fmt: skip
    assert spec["behavior"]["scaleUp"]["stabilizationWindowSeconds"] == 30
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 600
    assert autoscaling_mod.render_hpa(make()) is None


def test_hpa_metric_name_matches_the_adapter_rule():
    rule = autoscaling_mod.PROMETHEUS_ADAPTER_RULE
    assert rule["seriesQuery"].startswith(api.QUEUE_DEPTH_METRIC + "{")
    exposed = re.sub(
        rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), api.QUEUE_DEPTH_METRIC
    )
    assert exposed == autoscaling_mod.HPA_METRIC_NAME


def test_scaled_object():
    ld = make(merged({"model": {"uri": "smollm2"}}, AUTOSCALING["keda"]), name="qwen", namespace="ml")
    so = autoscaling_mod.render_scaled_object(ld, prometheus_url="http://prom.example:9090")
    assert autoscaling_mod.render_hpa(ld) is None
    check_scaled_object(ld, so)
    spec = so["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (0, 3)
    assert spec["cooldownPeriod"] == 900  # scaleDownStabilizationSeconds, as no scaleToZeroAfterSeconds is set
    trigger, in_flight = spec["triggers"]  # no activator: no trigger polling it
    assert in_flight["metadata"]["query"] == (
        'sum(kubellm:num_requests_running{namespace="ml",kubellm_io_llmdeployment="qwen"} + '
        'kubellm:num_requests_waiting{namespace="ml",kubellm_io_llmdeployment="qwen"}) or vector(0)')
    assert trigger["metadata"] == {
        "serverAddress": "http://prom.example:9090",
        "query": 'sum(kubellm:num_requests_waiting{namespace="ml",kubellm_io_llmdeployment="qwen"}) or vector(0)',
        "threshold": "4",
    }
    assert autoscaling_mod.render_scaled_object(ld)["spec"]["triggers"][0]["metadata"]["serverAddress"] == (
        autoscaling_mod.DEFAULT_PROMETHEUS_URL
    )
    # The label the query selects on is the one the ServiceMonitor copies from the pods, sanitised.
    sm = service_monitor.render_service_monitor(ld, service_monitor_available=True)
    (copied,) = sm["spec"]["podTargetLabels"]
    assert re.sub(r"[^a-zA-Z0-9_]", "_", copied) == naming.PROMETHEUS_LLMDEPLOYMENT_LABEL


@pytest.mark.parametrize(
    ("mode", "available", "expected"),
    [("Enabled", False, True), ("Enabled", True, True), ("Auto", True, True), ("Auto", False, False),
     ("Disabled", True, False), ("Disabled", False, False)],
)  # fmt: skip
def test_service_monitor_modes(mode, available, expected):
    ld = make({"model": {"uri": "smollm2"}, "monitoring": {"serviceMonitor": mode}})
    sm = service_monitor.render_service_monitor(ld, service_monitor_available=available)
    assert (sm is not None) == expected
    kinds = [m["kind"] for m in render.render(ld, service_monitor_available=available)]
    assert ("ServiceMonitor" in kinds) == expected
    if sm:
        assert sm["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s",
                                            "scrapeTimeout": "10s"}]  # fmt: skip


def test_inference_pool_only_when_enabled():
    epp = {"name": "epp"}
    for gateway in ({}, {"inferencePool": {}}, {"inferencePool": {"enabled": False, "endpointPickerRef": epp}}):
        ld = make({"model": {"uri": "smollm2"}, "gateway": gateway})
        assert inference_pool.render_inference_pool(ld) is None
        assert "InferencePool" not in [m["kind"] for m in render.render(ld)]
    ld = make({"model": {"uri": "smollm2"}, "gateway": {"inferencePool": {"enabled": True, "endpointPickerRef": epp}}})
    assert [m["kind"] for m in render.render(ld)][-1] == "InferencePool"


def test_inference_pool_selects_the_serving_pods_and_names_the_endpoint_picker():
    ld = make({"model": {"uri": "smollm2"}, "service": {"port": 8080},
               "gateway": {"inferencePool": {"enabled": True, "endpointPickerRef": {"name": "qwen-epp"}}}},
              name="qwen", namespace="ml")  # fmt: skip
    pool = inference_pool.render_inference_pool(ld)
    check_all(ld, render.render(ld))
    assert pool["metadata"]["name"] == "qwen" and pool["metadata"]["namespace"] == "ml"
    assert pool["spec"] == {
        "selector": {"matchLabels": naming.selector_labels(ld)},
        "targetPorts": [{"number": 8000}],  # the pods' port, not the Service's 8080
        "appProtocol": "http",
        "endpointPickerRef": {"group": "", "kind": "Service", "name": "qwen-epp", "port": {"number": 9002},
                              "failureMode": "FailClose"},
    }  # fmt: skip
    # Without an endpoint picker the field is left out (the upstream API allows it; most gateways then refuse).
    ld = make({"model": {"uri": "smollm2"}, "gateway": {"inferencePool": {"enabled": True}}})
    assert "endpointPickerRef" not in inference_pool.render_inference_pool(ld)["spec"]


@pytest.mark.parametrize(
    ("case", "change", "error"),
    [
        ("unknown field", {"spec": {"targetPort": 8000}}, "spec: Additional properties"),
        ("no target ports", {"spec": {"targetPorts": []}}, "spec.targetPorts"),
        ("duplicate ports", {"spec": {"targetPorts": [{"number": 8000}, {"number": 8000}]}},
         "port number must be unique"),
        ("service EPP without port", {"spec": {"endpointPickerRef": {"name": "epp"}}}, "port is required"),
        ("unknown failure mode", {"spec": {"endpointPickerRef": {"name": "e", "port": {"number": 1},
                                                                  "failureMode": "Retry"}}}, "Retry"),
        ("selector expressions", {"spec": {"selector": {"matchExpressions": []}}}, "Additional properties"),
    ],
)  # fmt: skip
def test_vendored_inference_pool_schema_refuses_broken_pools(case, change, error):
    """The check the render tests rely on can fail: what the upstream CRD refuses, it refuses."""
    ld = make({"model": {"uri": "smollm2"}, "gateway": {"inferencePool": {"enabled": True}}})
    pool = inference_pool.render_inference_pool(ld)
    assert inference_pool_errors(pool) == []
    broken = merged(pool, change)
    assert any(error in e for e in inference_pool_errors(broken)), (case, inference_pool_errors(broken))


def test_default_children():
    assert [m["kind"] for m in render.render(make())] == ["Service", "Deployment", "PodDisruptionBudget"]


# --------------------------------------------------------------------------------------------------
# Multi-node replicas: a LeaderWorkerSet
# --------------------------------------------------------------------------------------------------

MULTI_NODE = merged(GPU, {"model": {"uri": "hf://meta-llama/Llama-3.1-70B-Instruct"},
                          "parallelism": {"tensor": 16, "nodes": 2, "rendezvousPort": 29600},
                          "resources": {"gpu": {"count": 8}}, "replicas": 3})  # fmt: skip


def group(ld: api.LLMDeployment) -> tuple[dict[str, Any], dict[str, Any]]:
    """The leader's and the worker's runtime container."""
    lws = render.render_workload(ld)
    assert lws["kind"] == "LeaderWorkerSet"
    return tuple(t["spec"]["containers"][0] for t in pod_templates(lws))  # type: ignore[return-value]


def test_one_node_renders_the_deployment_exactly_as_before():
    for spec in (FULL, merged(CPU, {"model": {"uri": "smollm2"}}, AUTOSCALING["hpa"])):
        ld = make(spec)
        assert render.render_workload(ld) == deployment_mod.render_deployment(ld)
        assert service_mod.render_service(ld)["spec"]["selector"] == naming.selector_labels(ld)
        assert "LeaderWorkerSet" not in [m["kind"] for m in render.render(ld)]


def test_several_nodes_render_a_leader_worker_set_instead_of_the_deployment():
    ld = make(MULTI_NODE)
    kinds = [m["kind"] for m in render.render(ld)]
    assert kinds == ["Service", "LeaderWorkerSet", "PodDisruptionBudget"]
    lws = by_kind(render.render(ld))["LeaderWorkerSet"]
    assert lws["spec"]["replicas"] == 3 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert lws["spec"]["rolloutStrategy"] == {
        "type": "RollingUpdate", "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0}
    }  # fmt: skip
    # Each pod holds tensor / nodes ranks and as many GPUs.
    for template in pod_templates(lws):
        (container,) = template["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert (arg(container, "--tensor-parallel-size"), arg(container, "--nnodes")) == ("16", "2")


def test_the_leader_serves_and_hosts_the_rendezvous_and_the_workers_only_run_ranks():
    leader, worker = group(make(MULTI_NODE))
    assert (arg(leader, "--node-rank"), arg(leader, "--dist-init-addr")) == ("0", "$(LWS_LEADER_ADDRESS):29600")
    assert (arg(worker, "--node-rank"), arg(worker, "--dist-init-addr")) == (
        "$(LWS_WORKER_INDEX)", "$(LWS_LEADER_ADDRESS):29600"
    )  # fmt: skip
    assert {p["name"]: p["containerPort"] for p in leader["ports"]} == {"http": 8000, "rendezvous": 29600}
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(leader)
    # Workers serve no HTTP: nothing to probe, no endpoint to leave before SIGTERM.
    assert not {"ports", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle"} & set(worker)
    assert leader["args"][: -4] == worker["args"][: -4] == runtime(make(MULTI_NODE))["args"]


def test_group_commands_parse_and_configure_the_runtime_once_the_kubelet_expands_them():
    """The kubelet expands $(VAR) from the variables the LWS controller injects: what each pod then runs is a
    valid multi-node EngineConfig with its own node rank."""
    from kubellm.runtime.cli import build_parser, engine_kwargs
    from kubellm.runtime.engine.config import EngineConfig

    ld = make(merged(HARDWARE["nodes4"], {"model": {"uri": "smollm2"}}))
    lws = render.render_workload(ld)
    env = {"LWS_LEADER_ADDRESS": "llm-group-0.llm-group.team-a"}
    for index, template in enumerate(pod_templates(lws) + [pod_templates(lws)[1]] * 2):
        env["LWS_WORKER_INDEX"] = str(index)
        args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in template["spec"]["containers"][0]["args"]]
        parsed = build_parser().parse_args(["serve", *args])
        config = EngineConfig(model=parsed.model, **engine_kwargs(parsed))
        assert (config.nnodes, config.node_rank, config.ranks_per_node) == (4, index, 1)
        assert config.rendezvous == ("llm-group-0.llm-group.team-a", 23456)


def test_group_templates_differ_from_the_deployments_and_hash_what_they_hold():
    ld = make(MULTI_NODE)
    leader, worker = pod_templates(render.render_workload(ld))
    hashes = {t["metadata"]["annotations"][naming.SPEC_HASH_ANNOTATION] for t in (leader, worker)}
    assert hashes == {pods_mod.spec_hash(leader), pods_mod.spec_hash(worker)} and len(hashes) == 2
    for template in (leader, worker):
        (spread,) = template["spec"]["topologySpreadConstraints"]
        assert spread["matchLabelKeys"] == [multinode.REVISION_LABEL]  # LWS pods have no pod-template-hash


def test_autoscalers_target_the_leader_worker_set():
    for auto_id in ("hpa", "keda"):
        ld = make(merged(MULTI_NODE, AUTOSCALING[auto_id]))
        children = by_kind(render.render(ld, service_monitor_available=True))
        scaler = children["HorizontalPodAutoscaler" if auto_id == "hpa" else "ScaledObject"]
        assert scaler["spec"]["scaleTargetRef"] == {
            "apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "name": "llm-group"
        }  # fmt: skip
        assert "replicas" not in children["LeaderWorkerSet"]["spec"]  # the autoscaler owns it


@pytest.mark.parametrize("name", ["llm", "a" * 40, "a" * 41, "b" * 63, "x" * 200, "qwen2.5.7b"])
def test_lws_names_leave_room_for_the_statefulsets_and_never_collide_with_the_service(name):
    ld = make(MULTI_NODE, name=name)
    lws = naming.lws_name(ld)
    assert len(lws) <= naming.MAX_LWS_NAME_LENGTH and _DNS1035.match(lws)
    assert lws != naming.child_name(ld)  # the LWS controller would adopt our Service as its headless one
    # worker StatefulSet <lws>-<group> and its controller-revision-hash label <sts>-<10 characters>
    assert len(f"{lws}-99999-0123456789") <= 63
    other = make(MULTI_NODE, name=name + "z" if len(name) < 253 else name[:-1])
    assert naming.lws_name(other) != lws


@pytest.mark.parametrize(("field", "value"), [("maxSurge", "101%"), ("maxUnavailable", "150%")])
def test_rollout_percentages_the_lws_webhook_refuses_are_invalid(field, value):
    ld = make(merged(MULTI_NODE, {"rollout": {field: value, "maxUnavailable" if field == "maxSurge" else
                                              "maxSurge": 1}}))  # fmt: skip
    with pytest.raises(InvalidSpec, match=re.escape(f"spec.rollout.{field} {value}")):
        render.render(ld)


def test_the_lws_schema_catches_a_misspelt_field():
    lws = render.render_workload(make(MULTI_NODE))
    lws["spec"]["leaderWorkerTemplate"]["sise"] = 2
    with pytest.raises(jsonschema.ValidationError):
        LWS_VALIDATOR.validate(lws)


# --------------------------------------------------------------------------------------------------
# Invalid specs
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"podLabels": {"app.kubernetes.io/instance": "other"}}, "podLabels: app.kubernetes.io/instance is set by"),
        ({"podLabels": {"kubellm.io/llmdeployment": "x"}}, "is set by the operator"),
        ({"podLabels": {"bad key!": "x"}}, "podLabels: key 'bad key!'"),
        ({"podLabels": {"ok": "-bad"}}, "podLabels: value '-bad'"),
        ({"podLabels": {"UPPER.example/x": "y"}}, "prefix that is not a DNS subdomain"),
        ({"podAnnotations": {"kubellm.io/spec-hash": "x"}}, "podAnnotations: kubellm.io/spec-hash is set by"),
        ({"podAnnotations": {"a/b/c": "x"}}, "more than one '/'"),
        ({"nodeSelector": {"k": "v" * 64}}, "nodeSelector: value"),
        ({"resources": {"gpu": {"product": "A100"}}, "nodeSelector": {"nvidia.com/gpu.product": "H100"}},
         "contradicts resources.gpu.product=A100"),
        ({"env": [{"name": "KUBELLM_CACHE", "value": "/x"}]}, "KUBELLM_CACHE is set by the operator"),
        ({"model": {"uri": "pvc://claim/../etc"}}, "'..' path element"),
        ({"model": {"uri": "file:///tmp/model.gguf"}}, "lies under /tmp"),
        ({"model": {"uri": "file:///cache"}}, "lies under /cache"),
    ],
)  # fmt: skip
def test_invalid_specs(change, message):
    ld = make(merged({"model": {"uri": "smollm2"}}, change))
    with pytest.raises(InvalidSpec, match=re.escape(message)):
        render.render(ld)
    with pytest.raises(InvalidSpec, match=re.escape(message)):
        render.validate(ld)


def test_api_rules_are_rechecked():
    """An object that skipped validation (model_construct, an API server without CEL) is still refused,
    with the API's own message."""
    ld = make()
    ld.spec.resources.gpu.count = 0
    ld.spec.parallelism.tensor = 2
    with pytest.raises(InvalidSpec, match="more than one tensor-parallel rank per pod"):
        render.render(ld)


def test_several_problems_are_listed_together():
    ld = make({"model": {"uri": "smollm2"}, "podLabels": {"app.kubernetes.io/name": "x"},
               "env": [{"name": "KUBELLM_CACHE", "value": "/x"}]})  # fmt: skip
    with pytest.raises(InvalidSpec) as info:
        render.render(ld)
    assert str(info.value).count("\n- ") == 1 and str(info.value).startswith("- ")


def test_invalid_spec_is_a_value_error():
    assert issubclass(InvalidSpec, ValueError)


def test_load_applies_crd_defaults_and_rejects_garbage():
    obj = manifest({"model": {"uri": "smollm2"}})
    frozen = copy.deepcopy(obj)
    ld = render_cli.load(obj)
    assert obj == frozen
    assert ld.spec.image == api.DEFAULT_IMAGE and ld.spec.rollout.max_unavailable == 0
    with pytest.raises(InvalidSpec, match="expected apiVersion kubellm.io/v1alpha1 kind LLMDeployment"):
        render_cli.load({"apiVersion": "v1", "kind": "ConfigMap"})
    with pytest.raises(InvalidSpec, match="spec.replicas"):
        render_cli.load(manifest({"model": {"uri": "smollm2"}, "replicas": -1}))
    with pytest.raises(InvalidSpec, match="expected a mapping"):
        render_cli.load(["not", "a", "mapping"])  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# kubellm render -f
# --------------------------------------------------------------------------------------------------


def _rendered_docs(out: str) -> list[dict[str, Any]]:
    assert out.startswith("---\n")
    docs = list(yaml.safe_load_all(out))
    assert all(isinstance(d, dict) for d in docs)
    return docs


def test_main_renders_every_example(capsys):
    args = []
    for path in EXAMPLES:
        args += ["-f", str(path)]
    assert render_cli.main([*args, "--service-monitor-available"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    docs = _rendered_docs(captured.out)
    names = {yaml.safe_load(p.read_text())["metadata"]["name"] for p in EXAMPLES}
    scale_to_zero = {f"{n}{naming.PODS_SERVICE_SUFFIX}" for n in names if n.endswith("-on-demand")}
    assert {d["metadata"]["name"].removesuffix(naming.LWS_NAME_SUFFIX) for d in docs} == names | scale_to_zero
    for d in docs:
        assert d["metadata"]["namespace"] == "default"
        assert "ownerReferences" not in d["metadata"]  # files have no uid
        if (d["apiVersion"], d["kind"]) in BUILT_IN:
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(d, version, strict=True)
    kinds = [d["kind"] for d in docs]
    assert kinds.count("Deployment") == len(EXAMPLES) - 1
    assert kinds.count("LeaderWorkerSet") == 1  # the multinode example
    assert kinds.count("HorizontalPodAutoscaler") == 1  # the autoscaled example
    assert kinds.count("ScaledObject") == 1  # the scale-to-zero example
    assert kinds.count("ServiceMonitor") == len(EXAMPLES)  # Auto + available, and Enabled
    assert kinds.count("PrometheusRule") == 1  # the autoscaled example's monitoring.alerts
    # The output is exactly what render() gives for the same objects.
    expected = []
    for path in EXAMPLES:
        obj = yaml.safe_load(path.read_text())
        obj["metadata"]["namespace"] = "default"
        expected += render.render(render_cli.load(obj), service_monitor_available=True)
    assert docs == expected


def test_main_reads_multi_document_stdin_and_namespace(capsys, monkeypatch):
    text = "".join("---\n" + p.read_text() for p in EXAMPLES[:2]) + "---\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    assert render_cli.main(["-f", "-", "-n", "ml", "--prometheus-url", "http://p:9090"]) == 0
    docs = _rendered_docs(capsys.readouterr().out)
    assert {d["metadata"]["namespace"] for d in docs} == {"ml"}
    assert len({d["metadata"]["name"] for d in docs}) == 2


def test_main_reports_bad_input(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(manifest({"model": {"uri": "smollm2"}, "podLabels": {"kubellm.io/x": "1",
                                                                                     "app.kubernetes.io/name": "x"}},
                                           namespace=None, uid=None)))  # fmt: skip
    assert render_cli.main(["-f", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kubellm render: {bad}: document 1 (llm): spec.podLabels: app.kubernetes.io/name")
    assert render_cli.main(["-f", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    (tmp_path / "broken.yaml").write_text("spec: [unclosed")
    assert render_cli.main(["-f", str(tmp_path / "broken.yaml")]) == 2
    (tmp_path / "ns.yaml").write_text(yaml.safe_dump(manifest({"model": {"uri": "smollm2"}}, namespace="a")))
    assert render_cli.main(["-f", str(tmp_path / "ns.yaml"), "-n", "b"]) == 2
    assert "does not match --namespace b" in capsys.readouterr().err
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump(manifest({"model": {"uri": "smollm2"}, "replica": 2})))
    assert render_cli.main(["-f", str(tmp_path / "typo.yaml")]) == 2
    assert "spec.replica" in capsys.readouterr().err


def _reordered(node: Any) -> Any:
    """The same YAML value with every mapping's keys in reverse order."""
    if isinstance(node, dict):
        return {k: _reordered(node[k]) for k in reversed(list(node))}
    if isinstance(node, list):
        return [_reordered(v) for v in node]
    return node


def test_kubellm_render_is_byte_stable_across_processes_and_input_key_order(tmp_path):
    """GitOps review diffs `kubellm render` output: the same objects give the same bytes, whatever the hash seed
    of the process or the key order of the input file."""
    import os
    import subprocess
    import sys

    docs = [yaml.safe_load(p.read_text()) for p in EXAMPLES]
    straight, shuffled = tmp_path / "a.yaml", tmp_path / "b.yaml"
    straight.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    shuffled.write_text(yaml.safe_dump_all([_reordered(d) for d in reversed(docs)], sort_keys=False))
    outputs = []
    for seed, path in (("1", straight), ("2", straight), ("3", shuffled)):
        code = "import sys; from kubellm.operator.render.cli import main; sys.exit(main(sys.argv[1:]))"
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run([sys.executable, "-c", code, "-f", str(path), "-n", "ml"], env=env,
                                capture_output=True, check=True, timeout=120)  # fmt: skip
        outputs.append(result.stdout)
    assert outputs[0] == outputs[1]
    # The shuffled file lists the objects in reverse: compare per object, byte for byte.
    split = [sorted(d for d in re.split(rb"(?m)^---\n", o) if d) for o in outputs]
    assert split[2] == split[0] and len(split[0]) > len(EXAMPLES)


# --------------------------------------------------------------------------------------------------
# One check per render
# --------------------------------------------------------------------------------------------------


def count_spec_checks(monkeypatch) -> list[object]:
    """Every spec checked against the API's rules from now on (LLMDeploymentSpec.model_validate's inputs)."""
    checked: list[object] = []
    original = api.LLMDeploymentSpec.model_validate

    def counted(obj, *args, **kwargs):
        checked.append(obj)
        return original(obj, *args, **kwargs)

    monkeypatch.setattr(api.LLMDeploymentSpec, "model_validate", counted)
    return checked


@pytest.mark.parametrize("hardware", ["gpu", "nodes2"])
def test_render_checks_the_spec_once_for_all_its_children(monkeypatch, hardware):
    """Every child kind on (Service and pods Service, workload, PDB, KEDA, ServiceMonitor, PrometheusRule,
    InferencePool): one validation for the whole render, not one per child."""
    ld = make(merged(HARDWARE[hardware], {"model": {"uri": "hf://a/b"}}, AUTOSCALING["keda"],
                     {"monitoring": {"alerts": {"enabled": True}}, "gateway": {"inferencePool": {"enabled": True}}}))  # fmt: skip
    checked = count_spec_checks(monkeypatch)
    children = render.render(ld, service_monitor_available=True)
    assert {c["kind"] for c in children} >= {"Service", "PodDisruptionBudget", "ScaledObject", "ServiceMonitor",
                                              "PrometheusRule", "InferencePool"}  # fmt: skip
    assert len(checked) == 1
