"""The LLMDeployment pydantic models: defaults, camelCase round trips, unknown fields, helpers."""

from __future__ import annotations

import tomllib
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from pydantic import ValidationError

from kubellm.operator import api

ROOT = Path(__file__).resolve().parents[2]

FULL_DEFAULTS = {
    "model": {"uri": "smollm2"},
    "dtype": "auto",
    "quantization": "none",
    "parallelism": {"tensor": 1, "nodes": 1, "rendezvousPort": 29500},
    "engine": {
        "maxNumSeqs": 256,
        "maxNumBatchedTokens": 2048,
        "kvCacheBlockSize": 16,
        "kvCacheMemoryFraction": 0.9,
        "prefixCaching": True,
        "speculative": {"ngram": 0, "method": "draft_model", "numTokens": 4},
        "cudaGraphs": {"enabled": True, "maxBatchSize": 256},
    },
    "resources": {"gpu": {"resourceName": "nvidia.com/gpu"}},
    "replicas": 1,
    "autoscaling": {
        "enabled": False,
        "minReplicas": 1,
        "maxReplicas": 4,
        "targetQueueDepth": 4,
        "scaleUpStabilizationSeconds": 0,
        "scaleDownStabilizationSeconds": 300,
        "backend": "hpa",
    },
    "rollout": {"maxSurge": 1, "maxUnavailable": 0, "drainTimeoutSeconds": 30, "surgeTimeoutSeconds": 300,
                "onNoSpareGPU": "Wait"},
    "probes": {"startupTimeoutSeconds": 600, "readinessPeriodSeconds": 10, "readinessTimeoutSeconds": 15},
    "image": api.DEFAULT_IMAGE,
    "imagePullPolicy": "IfNotPresent",
    "service": {"type": "ClusterIP", "port": 80},
    "monitoring": {"serviceMonitor": "Auto",
                   "alerts": {"enabled": False, "errorRatio": 0.05, "kvCacheUsage": 0.95, "queueAtMaxFor": "10m"}},
    "auth": {},
    "gateway": {"inferencePool": {"enabled": False}},
}


def minimal(**spec) -> dict:
    return {"apiVersion": "kubellm.io/v1alpha1", "kind": "LLMDeployment", "metadata": {"name": "m"},
            "spec": {"model": {"uri": "smollm2"}, **spec}}  # fmt: skip


def test_only_model_uri_gets_every_default():
    spec = api.LLMDeploymentSpec.model_validate({"model": {"uri": "smollm2"}})
    assert spec.to_k8s() == FULL_DEFAULTS
    assert spec.gpu_count == 1  # omitted: parallelism.tensor
    assert spec.served_model_name == "smollm2"
    assert spec.image.startswith("ghcr.io/kubellm/runtime:")


def test_default_image_tracks_the_project_version():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert project == api.RUNTIME_VERSION, (
        "bump api.RUNTIME_VERSION with the project version, then `make crds` (the CRD default image changes)"
    )


def test_round_trip_camel_case():
    full = {
        **FULL_DEFAULTS,
        "model": {"uri": "hf://Qwen/Qwen2.5-7B-Instruct", "revision": "main", "servedModelName": "qwen"},
        "dtype": "bfloat16",
        "quantization": "int4",
        "parallelism": {"tensor": 2, "nodes": 1, "rendezvousPort": 29500},
        "engine": {
            **FULL_DEFAULTS["engine"],
            "maxModelLen": 8192,
            "kvCacheBlockSize": 32,
            "prefixCaching": False,
            "speculative": {"ngram": 3, "method": "draft_model", "numTokens": 6},
            "cudaGraphs": {"enabled": False, "maxBatchSize": 64},
        },
        "resources": {
            "gpu": {"count": 4, "resourceName": "nvidia.com/gpu", "product": "NVIDIA-A100-SXM4-80GB"},
            "cpu": "8",
            "memory": "64Gi",
            "limits": {"cpu": 16},
        },
        "replicas": 3,
        "autoscaling": {**FULL_DEFAULTS["autoscaling"], "enabled": True, "maxReplicas": 6, "backend": "keda"},
        "rollout": {"maxSurge": "25%", "maxUnavailable": "0%", "drainTimeoutSeconds": 120,
                    "surgeTimeoutSeconds": 600, "onNoSpareGPU": "ReplaceInPlace"},
        "nodeSelector": {"pool": "gpu"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}
        },
        "priorityClassName": "high",
        "env": [
            {"name": "A", "value": "1"},
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
        ],
        "podLabels": {"team": "ml"},
        "podAnnotations": {"a": "b"},
        "service": {"type": "LoadBalancer", "port": 8080},
        "monitoring": {"serviceMonitor": "Disabled", "alerts": {
            "enabled": True, "ttftP99SecondsSLO": 1.5, "errorRatio": 0.01, "kvCacheUsage": 0.9, "queueAtMaxFor": "1h",
            "labels": {"team": "ml"}}},
        "auth": {"apiKeySecretRef": {"name": "keys", "key": "api-key"}},
        "gateway": {"inferencePool": {"enabled": True, "endpointPickerRef": {"name": "qwen-epp", "port": 9002,
                                                                            "failureMode": "FailOpen"}}},
    }
    spec = api.LLMDeploymentSpec.model_validate(full)
    assert spec.to_k8s() == full
    assert spec.model_dump(mode="json", exclude_none=True) == full  # camelCase is the default dump
    assert spec.engine.max_model_len == 8192 and spec.resources.gpu.resource_name == "nvidia.com/gpu"
    assert api.LLMDeploymentSpec.model_validate(spec.to_k8s()) == spec


def test_inference_pool_endpoint_picker_gets_its_defaults():
    spec = api.LLMDeploymentSpec.model_validate(
        {"model": {"uri": "smollm2"}, "gateway": {"inferencePool": {"enabled": True, "endpointPickerRef": {"name": "e"}}}}
    )
    assert spec.to_k8s()["gateway"] == {
        "inferencePool": {"enabled": True, "endpointPickerRef": {"name": "e", "port": 9002, "failureMode": "FailClose"}}
    }


def test_snake_case_input_is_accepted():
    spec = api.LLMDeploymentSpec.model_validate(
        {"model": {"uri": "smollm2", "served_model_name": "x"}, "engine": {"max_num_seqs": 8}}
    )
    assert spec.to_k8s()["engine"]["maxNumSeqs"] == 8
    assert spec.to_k8s()["model"]["servedModelName"] == "x"


def test_whole_object_round_trip_with_status():
    obj = minimal()
    obj["status"] = {
        "observedGeneration": 3,
        "replicas": 2,
        "readyReplicas": 1,
        "updatedReplicas": 2,
        "readyText": "1/2",
        "selector": "app.kubernetes.io/instance=m",
        "endpoint": "http://m.default.svc.cluster.local/v1",
        "autoscaling": {"currentQueueDepth": 2.5, "targetQueueDepth": 4, "currentReplicas": 2, "desiredReplicas": 3,
                        "lastScaleTime": "2025-01-02T03:04:05Z"},
        "conditions": [{"type": "Ready", "status": "False", "reason": "MinimumReplicasUnavailable", "message": "",
                        "lastTransitionTime": "2025-01-02T03:04:05Z", "observedGeneration": 3}],
    }  # fmt: skip
    model = api.LLMDeployment.model_validate(obj)
    assert model.name == "m" and model.status.conditions[0].status == api.ConditionStatus.FALSE
    assert model.to_k8s() == {**obj, "spec": FULL_DEFAULTS}


@pytest.mark.parametrize(
    "spec",
    [
        {"model": {"uri": "smollm2"}, "replica": 2},
        {"model": {"uri": "smollm2", "url": "x"}},
        {"model": {"uri": "smollm2"}, "engine": {"maxNumSeq": 2}},
        {"model": {"uri": "smollm2"}, "resources": {"gpu": {"type": "a100"}}},
        {"model": {"uri": "smollm2"}, "rollout": {"onNoSpareGpu": "Wait"}},  # the field is spelt onNoSpareGPU
        {
            "model": {"uri": "smollm2"},
            "tolerations": [{"key": "k", "operator": "Exists", "tolerateSeconds": 1}],
        },
    ],
)
def test_unknown_spec_fields_are_rejected(spec):
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        api.LLMDeploymentSpec.model_validate(spec)


def test_unknown_status_fields_are_ignored():
    status = api.LLMDeploymentStatus.model_validate({"replicas": 1, "futureField": {"x": 1}})
    assert status.to_k8s() == {"replicas": 1}


def test_model_is_required():
    with pytest.raises(ValidationError, match="model"):
        api.LLMDeploymentSpec.model_validate({})


def test_wrong_api_version_or_kind_is_rejected():
    with pytest.raises(ValidationError):
        api.LLMDeployment.model_validate({**minimal(), "apiVersion": "kubellm.io/v1"})
    with pytest.raises(ValidationError):
        api.LLMDeployment.model_validate({**minimal(), "kind": "Deployment"})


@pytest.mark.parametrize(
    ("uri", "name"),
    [
        ("smollm2", "smollm2"),
        ("hf://Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct"),
        ("pvc://models/llama/Llama-3.1-8B-Instruct", "Llama-3.1-8B-Instruct"),
        ("pvc://models/smollm2.Q4_1.gguf", "smollm2.Q4_1"),
        ("pvc://models", "models"),
        ("pvc://models/llama/", "llama"),
        ("file:///models/tiny.gguf", "tiny"),
    ],
)
def test_default_served_model_name(uri, name):
    assert api.default_served_model_name(uri) == name
    assert api.ModelSpec(uri=uri).effective_served_model_name == name
    assert api.ModelSpec(uri=uri, served_model_name="x").effective_served_model_name == "x"


@pytest.mark.parametrize(
    "uri",
    ["smollm2", "hf://meta-llama/Llama-3.1-8B-Instruct", "pvc://models", "pvc://my-claim.v2/a/b c/model.gguf",
     "file:///opt/models/x.gguf"],
)  # fmt: skip
def test_valid_model_uris(uri):
    api.ModelSpec(uri=uri)


@pytest.mark.parametrize(
    "uri",
    ["", "s3://b/m", "hf://org", "hf://org/name/extra", "file://rel/path", "pvc://", "Smol LM", "smollm2\n"],
)
def test_invalid_model_uris(uri):
    with pytest.raises(ValidationError):
        api.ModelSpec(uri=uri)


def test_gpu_count_and_resource_requirements():
    tp2 = api.LLMDeploymentSpec.model_validate({"model": {"uri": "smollm2"}, "parallelism": {"tensor": 2}})
    assert tp2.gpu_count == 2
    assert tp2.resource_requirements() == {
        "requests": {"nvidia.com/gpu": "2"},
        "limits": {"nvidia.com/gpu": "2"},
    }

    # One group over several pods: each pod gets the GPUs of its own ranks, tensor / nodes.
    spread = api.LLMDeploymentSpec.model_validate(
        {"model": {"uri": "smollm2"}, "parallelism": {"tensor": 16, "nodes": 2}}
    )
    assert (spread.parallelism.ranks_per_node, spread.gpu_count) == (8, 8)
    assert spread.resource_requirements()["limits"] == {"nvidia.com/gpu": "8"}

    cpu = api.LLMDeploymentSpec.model_validate(
        {"model": {"uri": "smollm2"}, "resources": {"gpu": {"count": 0}, "cpu": 2, "memory": "2Gi"}}
    )
    assert cpu.gpu_count == 0
    # limits equal the requests unless resources.limits says otherwise
    assert cpu.resource_requirements() == {
        "requests": {"cpu": "2", "memory": "2Gi"},
        "limits": {"cpu": "2", "memory": "2Gi"},
    }

    burst = api.LLMDeploymentSpec.model_validate(
        {"model": {"uri": "smollm2"},
         "resources": {"gpu": {"count": 1, "resourceName": "amd.com/gpu"}, "cpu": "4", "limits": {"cpu": "8"}}}
    )  # fmt: skip
    assert burst.resource_requirements() == {
        "requests": {"cpu": "4", "amd.com/gpu": "1"},
        "limits": {"cpu": "8", "amd.com/gpu": "1"},
    }


def test_python_only_checks():
    with pytest.raises(ValidationError, match="env: A appears more than once"):
        api.LLMDeploymentSpec.model_validate(
            {"model": {"uri": "smollm2"}, "env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}
        )
    with pytest.raises(
        ValidationError, match=r"resources.limits.memory \(1Gi\) must be >= resources.memory \(2Gi\)"
    ):
        api.LLMDeploymentSpec.model_validate(
            {"model": {"uri": "smollm2"}, "resources": {"memory": "2Gi", "limits": {"memory": "1Gi"}}}
        )


def test_several_violations_are_reported_together():
    with pytest.raises(ValidationError) as e:
        api.LLMDeploymentSpec.model_validate(
            {"model": {"uri": "smollm2"}, "parallelism": {"tensor": 2}, "resources": {"gpu": {"count": 1}},
             "quantization": "int4"}
        )  # fmt: skip
    text = str(e.value)
    assert "must be 0 (CPU) or a multiple of the ranks in each pod" in text
    assert "more than one tensor-parallel rank per pod" in text


@pytest.mark.parametrize(
    ("value", "expected"),
    [(2, Decimal(2)), ("500m", Decimal("0.5")), ("16Gi", Decimal(16 * 2**30)), ("1.5G", Decimal("1.5e9")),
     ("1e3", Decimal(1000)), ("100", Decimal(100)), ("0.1", Decimal("0.1"))],
)  # fmt: skip
def test_parse_quantity(value, expected):
    assert api.parse_quantity(value) == expected


@pytest.mark.parametrize("value", ["", "2 cores", "-1", "1Gb", "Gi", -1])
def test_parse_quantity_rejects(value):
    with pytest.raises(ValueError):
        api.parse_quantity(value)


@pytest.mark.parametrize(("value", "ok"), [(0, True), (3, True), ("25%", True), ("0%", True), ("25", False),
                                           ("x%", False), (-1, False)])  # fmt: skip
def test_int_or_percent(value, ok):
    data = {"maxSurge": value, "maxUnavailable": 1}
    if ok:
        assert api.RolloutSpec.model_validate(data).max_surge == value
    else:
        with pytest.raises(ValidationError):
            api.RolloutSpec.model_validate(data)


def test_validate_update():
    old = api.LLMDeploymentSpec.model_validate(
        {"model": {"uri": "smollm2"}, "autoscaling": {"enabled": True}}
    )
    assert api.validate_update(old, old.model_copy(update={"replicas": 3})) == []
    assert api.validate_update(old, old.model_copy(update={"replicas": 9})) == [
        "replicas 9 is outside autoscaling [1, 4]: autoscaling is enabled, so the autoscaler owns spec.replicas; "
        "remove replicas from your manifest"
    ]
    off = old.model_copy(update={"autoscaling": api.AutoscalingSpec()})
    assert api.validate_update(off, off.model_copy(update={"replicas": 9})) == []


def test_every_rule_has_a_message_and_python_twin():
    for model, rules in api.all_rules().items():
        for rule in rules:
            assert rule.message and "\n" not in rule.message, model
            assert callable(rule.check), model
            assert (rule.message_expression is None) == (rule.explain is None), f"{model}: {rule.rule}"


# --------------------------------------------------------------------------------------------------
# Conditions
# --------------------------------------------------------------------------------------------------

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def test_condition_types():
    assert [t.value for t in api.ConditionType] == [
        "Ready", "Progressing", "Degraded", "ModelLoaded", "ScalingActive", "Draining", "Reconciling", "Stalled"
    ]  # fmt: skip


def test_set_condition_adds_and_keeps_transition_time_while_status_holds():
    status = api.LLMDeploymentStatus()
    assert status.set_condition(api.ConditionType.READY, False, "ModelLoading", "loading", 1, now=T0)
    c = status.get_condition("Ready")
    assert (c.status, c.reason, c.last_transition_time) == (api.ConditionStatus.FALSE, "ModelLoading", T0)

    # same status, new reason: updated, transition time kept
    assert status.set_condition("Ready", "False", "Unschedulable", "no GPU", 1, now=T0 + timedelta(minutes=1))
    c = status.get_condition("Ready")
    assert (c.reason, c.message, c.last_transition_time) == ("Unschedulable", "no GPU", T0)

    # nothing changed: reports no change
    assert not status.set_condition(
        "Ready", "False", "Unschedulable", "no GPU", 1, now=T0 + timedelta(minutes=2)
    )

    # status flips: transition time moves
    t1 = T0 + timedelta(minutes=3)
    assert status.set_condition("Ready", api.ConditionStatus.TRUE, "MinimumReplicasAvailable", "", 2, now=t1)
    assert status.is_condition_true("Ready")
    assert status.get_condition("Ready").last_transition_time == t1
    assert status.get_condition("Ready").observed_generation == 2


def test_condition_serialisation_and_removal():
    status = api.LLMDeploymentStatus()
    status.set_condition("Ready", True, "MinimumReplicasAvailable", now=T0)
    status.set_condition("Draining", False, "NoTerminatingPods", now=T0)
    out = status.to_k8s()["conditions"]
    assert out[0] == {"type": "Ready", "status": "True", "reason": "MinimumReplicasAvailable", "message": "",
                      "lastTransitionTime": "2025-01-01T00:00:00Z"}  # fmt: skip
    assert [c["type"] for c in out] == ["Ready", "Draining"]
    assert not status.is_condition_true("Draining") and not status.is_condition_true("Degraded")
    assert status.remove_condition("Draining") and not status.remove_condition("Draining")
    assert status.remove_condition("Ready") and status.conditions is None


def test_default_transition_time_is_whole_seconds_utc():
    status = api.LLMDeploymentStatus()
    status.set_condition("Progressing", "Unknown", "Reconciling")
    t = status.get_condition("Progressing").last_transition_time
    assert t.tzinfo is not None and t.microsecond == 0


def test_condition_reason_must_be_camel_case():
    with pytest.raises(ValidationError):
        api.Condition(type="Ready", status="True", reason="not ok", last_transition_time=T0)


def test_ready_text():
    assert api.ready_text(1, 2) == "1/2"
