"""The LLMDeployments the end-to-end suite applies: the repository's examples, loaded and adjusted in Python.

The examples stay the source: each function loads one from examples/ and changes only what a kind cluster
on a CI runner needs (the locally built image, less CPU per pod so a surge pod fits next to the old one, a
CPU model in place of the autoscaled example's 7B GPU model). e2e/test_manifests.py checks offline that the
results still validate and render.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# Where `docker build --target runtime-cpu --build-arg BAKE_DEMO_MODEL=1` puts the demo model (the image's
# KUBELLM_CACHE, see the Dockerfile); a file:// model needs no init container and no download.
BAKED_DEMO_MODEL = "/opt/kubellm/cache/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SERVED_MODEL_NAME = "smollm2"


def load_example(filename: str) -> dict[str, Any]:
    with (EXAMPLES / filename).open() as f:
        return yaml.safe_load(f)


def _use_image(doc: dict[str, Any], image: str, pull_policy: str) -> None:
    doc["spec"]["image"] = image
    doc["spec"]["imagePullPolicy"] = pull_policy


def cpu_deployment(
    image: str, namespace: str, *, cpu: str = "1", pull_policy: str = "IfNotPresent"
) -> dict[str, Any]:
    """examples/llmdeployment-cpu.yaml running ``image``; the model stays the known name smollm2, so the pod's
    init container pulls it exactly as it would for a user.

    ``cpu``: the example asks for 2 CPUs; a rollout surges one extra pod, and two 2-CPU pods beside the
    control plane and Prometheus do not fit on a 4-CPU CI runner.
    """
    doc = load_example("llmdeployment-cpu.yaml")
    doc["metadata"]["namespace"] = namespace
    _use_image(doc, image, pull_policy)
    doc["spec"]["resources"]["cpu"] = cpu
    return doc


def autoscaled_deployment(
    image: str,
    namespace: str,
    *,
    model_uri: str = f"file://{BAKED_DEMO_MODEL}",
    cpu: str = "1",
    max_num_seqs: int = 2,
    max_replicas: int = 2,
    pull_policy: str = "IfNotPresent",
) -> dict[str, Any]:
    """examples/llmdeployment-autoscaled.yaml with the CPU example's model and resources.

    Kept from the autoscaled example: autoscaling (HPA backend, targetQueueDepth, stabilization windows), the
    rollout drain timeout and the ServiceMonitor. Changed: the model (the baked demo model, so scale-up pods
    start in seconds), dtype (auto: bfloat16 is the GPU example's choice), resources (CPU), ``max_num_seqs``
    (low, so concurrent requests wait in the queue the HPA scales on: with 256 slots nothing would ever
    wait) and ``max_replicas`` (what a CI runner holds).
    """
    doc = load_example("llmdeployment-autoscaled.yaml")
    cpu_spec = load_example("llmdeployment-cpu.yaml")["spec"]
    doc["metadata"] = {"name": "smollm2-autoscaled", "namespace": namespace}
    spec = doc["spec"]
    spec["model"] = {"uri": model_uri, "servedModelName": SERVED_MODEL_NAME}
    spec.pop("dtype", None)
    spec["resources"] = copy.deepcopy(cpu_spec["resources"])
    spec["resources"]["cpu"] = cpu
    spec.setdefault("engine", {})["maxNumSeqs"] = max_num_seqs
    spec["autoscaling"]["maxReplicas"] = max_replicas
    _use_image(doc, image, pull_policy)
    return doc


def api_keys_deployment(image: str, namespace: str, *, pull_policy: str = "IfNotPresent") -> dict[str, Any]:
    """examples/llmdeployment-api-keys.yaml with the baked demo model (no download) and one CPU."""
    doc = load_example("llmdeployment-api-keys.yaml")
    doc["metadata"]["namespace"] = namespace
    doc["spec"]["model"] = {"uri": f"file://{BAKED_DEMO_MODEL}", "servedModelName": SERVED_MODEL_NAME}
    doc["spec"]["resources"]["cpu"] = "1"
    _use_image(doc, image, pull_policy)
    return doc


FAKE_GPU_RESOURCE = "kubellm.io/e2e-fake-gpu"  # an extended resource the test advertises on the kind node


def fake_gpu_deployment(image: str, namespace: str, *, pull_policy: str = "IfNotPresent") -> dict[str, Any]:
    """examples/llmdeployment-7b-bf16.yaml's rollout settings on a kind node without GPUs: one replica asking for
    one :data:`FAKE_GPU_RESOURCE` (the test advertises exactly one on the node, so a surge pod cannot fit), the
    baked demo model, one CPU, and a surge timeout of seconds. The pods ask for ``--device cuda`` and cannot
    serve on kind; the test needs only the scheduler's answer and the Deployment's strategy."""
    doc = load_example("llmdeployment-7b-bf16.yaml")
    example_rollout = doc["spec"]["rollout"]
    doc["metadata"] = {"name": "fake-gpu", "namespace": namespace}
    doc["spec"] = {
        "model": {"uri": f"file://{BAKED_DEMO_MODEL}", "servedModelName": SERVED_MODEL_NAME},
        "resources": {"gpu": {"count": 1, "resourceName": FAKE_GPU_RESOURCE}, "cpu": "100m", "memory": "1Gi"},
        "replicas": 1,
        "rollout": {**example_rollout, "surgeTimeoutSeconds": 5, "onNoSpareGPU": "Wait"},
    }
    _use_image(doc, image, pull_policy)
    return doc


# The baked demo model (SmolLM2-135M) has 9 attention heads and 3 kv heads: tensor parallelism 3 is the
# smallest split above 1 that divides both, so three pods of one rank each.
MULTI_NODE_RANKS = 3


def multinode_deployment(
    image: str, namespace: str, *, cpu: str = "250m", pull_policy: str = "IfNotPresent"
) -> dict[str, Any]:
    """examples/llmdeployment-multinode.yaml on CPUs: one tensor-parallel group of :data:`MULTI_NODE_RANKS`
    ranks over as many pods (a LeaderWorkerSet group), serving the baked demo model.

    Kept from the example: nodes > 1 with one group, the rendezvous port and the rollout. Changed: the model
    (the 70B needs GPUs; the demo model splits in 3), tensor = nodes = 3, resources (CPU, ``cpu`` each: three
    pods share a CI runner with the other tests' pods), no GPU product, tolerations or HF token.
    """
    doc = load_example("llmdeployment-multinode.yaml")
    doc["metadata"] = {"name": "smollm2-multinode", "namespace": namespace}
    spec = doc["spec"]
    spec["model"] = {"uri": f"file://{BAKED_DEMO_MODEL}", "servedModelName": SERVED_MODEL_NAME}
    spec["parallelism"].update(tensor=MULTI_NODE_RANKS, nodes=MULTI_NODE_RANKS)
    spec.pop("dtype", None)
    spec.pop("engine", None)
    spec.pop("env", None)
    spec.pop("tolerations", None)
    spec["resources"] = copy.deepcopy(load_example("llmdeployment-cpu.yaml")["spec"]["resources"])
    spec["resources"]["cpu"] = cpu
    spec["probes"]["startupTimeoutSeconds"] = 600
    _use_image(doc, image, pull_policy)
    return doc


def inference_pool_deployment(image: str, namespace: str, *, pull_policy: str = "IfNotPresent") -> dict[str, Any]:
    """examples/llmdeployment-inferencepool.yaml on a CPU: its gateway.inferencePool (the pool and the endpoint
    picker reference) with the CPU example's resources, one replica and the baked demo model. No EPP or gateway
    runs on kind: the test checks what the operator owns (the pool, its members, the metrics an EPP reads)."""
    doc = load_example("llmdeployment-inferencepool.yaml")
    doc["metadata"] = {"name": "smollm2-pool", "namespace": namespace}
    doc["spec"] = {
        "model": {"uri": f"file://{BAKED_DEMO_MODEL}", "servedModelName": SERVED_MODEL_NAME},
        "resources": copy.deepcopy(load_example("llmdeployment-cpu.yaml")["spec"]["resources"]),
        "replicas": 1,
        "gateway": copy.deepcopy(doc["spec"]["gateway"]),
    }
    doc["spec"]["resources"]["cpu"] = "1"
    _use_image(doc, image, pull_policy)
    return doc


def secret(name: str, namespace: str, data: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace},
            "type": "Opaque", "stringData": data}  # fmt: skip


def scale_to_zero_deployment(image: str, namespace: str, *, pull_policy: str = "IfNotPresent") -> dict[str, Any]:
    """examples/llmdeployment-scale-to-zero.yaml on a CPU: minReplicas 0 through KEDA, woken by the activator.

    Kept: backend keda, minReplicas 0, the ServiceMonitor (the idle signal is the pods' metrics). Changed: the
    baked demo model (a new pod loads in seconds, no download), one CPU, one replica at most, and the shortest
    idle time the CRD allows (60 s) so the test reaches zero quickly."""
    doc = load_example("llmdeployment-scale-to-zero.yaml")
    doc["metadata"]["namespace"] = namespace
    spec = doc["spec"]
    spec["model"] = {"uri": f"file://{BAKED_DEMO_MODEL}", "servedModelName": SERVED_MODEL_NAME}
    spec["resources"] = copy.deepcopy(load_example("llmdeployment-cpu.yaml")["spec"]["resources"])
    spec["resources"]["cpu"] = "1"
    spec["autoscaling"].update(maxReplicas=1, scaleToZeroAfterSeconds=60)
    _use_image(doc, image, pull_policy)
    return doc
