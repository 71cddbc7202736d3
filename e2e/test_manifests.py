"""Offline checks of what the end-to-end suite would apply: no cluster needed, so these run everywhere.

A mistake in e2e/manifests.py would otherwise show only after minutes of cluster set-up on CI."""

from __future__ import annotations

from pathlib import Path

import manifests

from kubellm.operator import api, render
from kubellm.operator.render import autoscaling as autoscaling_mod
from kubellm.operator.render import cli as render_cli
from kubellm.operator.render import pods as pods_mod

IMAGE = "kubellm/runtime-cpu:e2e"
NAMESPACE = "kubellm-e2e-test"
ROOT = Path(__file__).resolve().parents[1]


def _children(doc: dict) -> dict[str, dict]:
    ld = render_cli.load(doc)
    return {c["kind"]: c for c in render.render(ld, service_monitor_available=True)}


def _runtime_container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_cpu_deployment_is_the_cpu_example_with_the_image_under_test():
    doc = manifests.cpu_deployment(IMAGE, NAMESPACE, pull_policy="Never")
    example = manifests.load_example("llmdeployment-cpu.yaml")
    assert doc["spec"]["model"] == example["spec"]["model"]
    assert doc["metadata"]["name"] == example["metadata"]["name"]
    children = _children(doc)
    pod = children["Deployment"]["spec"]["template"]["spec"]
    container = _runtime_container(children["Deployment"])
    assert container["image"] == IMAGE and container["imagePullPolicy"] == "Never"
    assert container["resources"]["requests"]["cpu"] == "1"
    # The known model name goes through the init container's pull, as for a user.
    assert [c["command"][-3:] for c in pod["initContainers"]] == [["models", "pull", "smollm2"]]
    assert pod["initContainers"][0]["image"] == IMAGE
    assert "HorizontalPodAutoscaler" not in children


def test_autoscaled_deployment_scales_a_cpu_model_on_queue_depth():
    doc = manifests.autoscaled_deployment(IMAGE, NAMESPACE)
    example = manifests.load_example("llmdeployment-autoscaled.yaml")
    for key in ("minReplicas", "targetQueueDepth", "scaleUpStabilizationSeconds", "scaleDownStabilizationSeconds"):
        assert doc["spec"]["autoscaling"][key] == example["spec"]["autoscaling"][key]
    children = _children(doc)
    hpa = children["HorizontalPodAutoscaler"]
    assert hpa["spec"]["maxReplicas"] == 2
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == autoscaling_mod.HPA_METRIC_NAME
    assert "ServiceMonitor" in children, "Prometheus must scrape the queue depth the HPA scales on"
    pod = children["Deployment"]["spec"]["template"]["spec"]
    assert "initContainers" not in pod, "the baked model needs no download"
    args = _runtime_container(children["Deployment"])["args"]
    assert args[args.index("--model") + 1] == manifests.BAKED_DEMO_MODEL
    assert args[args.index("--max-num-seqs") + 1] == "2"
    assert args[args.index("--device") + 1] == "cpu"
    assert render_cli.load(doc).spec.served_model_name == manifests.SERVED_MODEL_NAME


def test_baked_model_path_is_where_the_image_keeps_the_demo_model():
    from kubellm.runtime.models import store as model_store  # imports torch: only here

    dockerfile = (ROOT / "Dockerfile").read_text()
    cache = "/opt/kubellm/cache"
    assert f"KUBELLM_CACHE={cache}" in dockerfile
    assert str(model_store.model_path("smollm2", cache_dir=cache)) == manifests.BAKED_DEMO_MODEL


def test_rendered_pods_run_as_the_image_user():
    children = _children(manifests.cpu_deployment(IMAGE, NAMESPACE))
    security = children["Deployment"]["spec"]["template"]["spec"]["securityContext"]
    assert security["runAsUser"] == pods_mod.RUN_AS_USER == 10001
    assert api.KIND == "LLMDeployment"


def test_api_keys_deployment_renders_the_secret_into_the_runtime():
    doc = manifests.api_keys_deployment(IMAGE, NAMESPACE)
    container = _runtime_container(_children(doc)["Deployment"])
    env = {e["name"]: e for e in container["env"]}
    ref = doc["spec"]["auth"]["apiKeySecretRef"]
    assert env["KUBELLM_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": ref["name"], "key": "api-key"}}
    assert container["image"] == IMAGE


def test_fake_gpu_deployment_asks_for_the_fake_resource_and_keeps_the_examples_rollout():
    doc = manifests.fake_gpu_deployment(IMAGE, NAMESPACE)
    example = manifests.load_example("llmdeployment-7b-bf16.yaml")
    assert example["spec"]["rollout"]["onNoSpareGPU"] == "ReplaceInPlace"  # what the test switches to
    assert doc["spec"]["rollout"]["onNoSpareGPU"] == "Wait" and doc["spec"]["rollout"]["surgeTimeoutSeconds"] == 5
    deployment = _children(doc)["Deployment"]
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    resources = _runtime_container(deployment)["resources"]
    assert resources["requests"][manifests.FAKE_GPU_RESOURCE] == resources["limits"][manifests.FAKE_GPU_RESOURCE] == "1"


def test_multinode_deployment_is_one_cpu_group_over_three_pods():
    doc = manifests.multinode_deployment(IMAGE, NAMESPACE)
    example = manifests.load_example("llmdeployment-multinode.yaml")
    assert doc["spec"]["rollout"] == example["spec"]["rollout"]
    assert doc["spec"]["parallelism"]["rendezvousPort"] == example["spec"]["parallelism"]["rendezvousPort"]
    children = _children(doc)
    assert "Deployment" not in children
    lws = children["LeaderWorkerSet"]
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == manifests.MULTI_NODE_RANKS == 3
    assert children["Service"]["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    for role in ("leaderTemplate", "workerTemplate"):
        pod = lws["spec"]["leaderWorkerTemplate"][role]["spec"]
        assert "initContainers" not in pod, "the baked model needs no download"
        (container,) = pod["containers"]
        args = container["args"]
        assert container["image"] == IMAGE
        assert args[args.index("--model") + 1] == manifests.BAKED_DEMO_MODEL
        assert args[args.index("--device") + 1] == "cpu"
        assert args[args.index("--tensor-parallel-size") + 1] == args[args.index("--nnodes") + 1] == "3"
        assert "nvidia.com/gpu" not in str(container["resources"])


def test_multinode_split_divides_the_demo_models_heads():
    """The tensor-parallel size must divide the baked model's heads, kv heads and MLP (the runtime refuses it
    at start-up otherwise, which on a cluster shows only as a crash loop)."""
    import pytest
    from gguf import GGUFReader

    from kubellm.runtime.distributed.tp_group import check_divisible
    from kubellm.runtime.models import store as model_store

    path = model_store.model_path("smollm2")
    if not path.exists():
        pytest.skip(f"the demo model is not in this machine's cache ({path}); `kubellm models pull smollm2`")
    fields = GGUFReader(str(path)).fields

    def value(key: str) -> int:
        return int(fields[key].parts[fields[key].data[0]][0])

    heads, kv_heads = value("llama.attention.head_count"), value("llama.attention.head_count_kv")
    check_divisible(heads, kv_heads, value("llama.feed_forward_length"), manifests.MULTI_NODE_RANKS)
    with pytest.raises(ValueError):  # the check does refuse a split that does not divide (2 of 9 heads)
        check_divisible(heads, kv_heads, value("llama.feed_forward_length"), 2)


def test_inference_pool_deployment_keeps_the_examples_pool_on_one_cpu_pod():
    doc = manifests.inference_pool_deployment(IMAGE, NAMESPACE)
    example = manifests.load_example("llmdeployment-inferencepool.yaml")
    assert doc["spec"]["gateway"] == example["spec"]["gateway"]
    children = _children(doc)
    pool = children["InferencePool"]
    assert pool["spec"]["selector"]["matchLabels"] == children["Service"]["spec"]["selector"]
    assert pool["spec"]["endpointPickerRef"]["name"] == example["spec"]["gateway"]["inferencePool"][
        "endpointPickerRef"]["name"]
    container = _runtime_container(children["Deployment"])
    assert container["image"] == IMAGE and "nvidia.com/gpu" not in str(container["resources"])
    assert pool["spec"]["targetPorts"] == [{"number": container["ports"][0]["containerPort"]}]


def test_scale_to_zero_deployment_sleeps_after_a_minute_through_keda():
    doc = manifests.scale_to_zero_deployment(IMAGE, NAMESPACE)
    example = manifests.load_example("llmdeployment-scale-to-zero.yaml")
    assert doc["metadata"]["name"] == example["metadata"]["name"]
    assert (doc["spec"]["autoscaling"]["backend"], doc["spec"]["autoscaling"]["minReplicas"]) == ("keda", 0)
    ld = render_cli.load(doc)
    children = render.render(ld, service_monitor_available=True, activator_url="http://a.b.svc:9090")
    (so,) = [c for c in children if c["kind"] == "ScaledObject"]
    assert so["spec"]["cooldownPeriod"] == 60 and so["spec"]["maxReplicaCount"] == 1
    assert [t.get("name") for t in so["spec"]["triggers"]] == [None, "in-flight", "activator"]
    services = [c["metadata"]["name"] for c in children if c["kind"] == "Service"]
    assert services == [doc["metadata"]["name"], doc["metadata"]["name"] + "-pods"]
    assert "ServiceMonitor" in [c["kind"] for c in children], "KEDA's idle signal is the pods' scraped metrics"
