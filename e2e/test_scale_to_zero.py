"""Scale from zero on a real cluster: examples/llmdeployment-scale-to-zero.yaml goes to zero after its idle time
(KEDA), and a request sent to its Service from inside the cluster is held by the activator, wakes it and is
answered. Needs KEDA and the chart's activator (kind.sh installs both); skips without them."""

from __future__ import annotations

import json

import manifests
import pytest
from kube import Kubectl, wait_until

KIND = "llmd"
CLIENT = "wake-client"
# Runs in the runtime image (Python, no curl): one completion through the Service, as a client in the cluster
# would send it, with a timeout above the activator's hold timeout.
REQUEST = """
import json, sys, urllib.request
body = json.dumps({"model": sys.argv[2], "prompt": "The capital of France is", "max_tokens": 8,
                   "temperature": 0}).encode()
req = urllib.request.Request(sys.argv[1], data=body, headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=600) as r:
    print(r.status, r.read().decode())
"""


def _activation(ns: Kubectl, name: str) -> dict:
    return ((ns.json("get", KIND, name).get("status") or {}).get("autoscaling") or {}).get("activation") or {}


def _reasons(ns: Kubectl, name: str) -> list[str]:
    return [e["reason"] for e in ns.events_for("LLMDeployment", name)]


def client_pod(image: str, pull_policy: str, url: str) -> dict:
    """A one-shot pod that passes Pod Security "restricted" and prints the answer."""
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": CLIENT},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "client", "image": image, "imagePullPolicy": pull_policy,
                "command": ["python", "-c", REQUEST, url, manifests.SERVED_MODEL_NAME],
                "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
            }],
        },
    }  # fmt: skip


def test_scale_to_zero_example_sleeps_when_idle_and_wakes_on_a_request(
    kube: Kubectl, namespace: Kubectl, runtime_image: str, pull_policy: str, ready_timeout: float
):
    if not kube.run("get", "crd", "scaledobjects.keda.sh", "--ignore-not-found").strip():
        pytest.skip("KEDA is not installed (kind.sh installs it)")
    activators = kube.run("get", "deployments", "-A", "--selector", "app.kubernetes.io/component=activator",
                          "-o", "name").strip()  # fmt: skip
    if not activators:
        pytest.skip("the chart's activator is not running (kind.sh installs it with activator.enabled=true)")
    doc = manifests.scale_to_zero_deployment(runtime_image, namespace.namespace, pull_policy=pull_policy)
    name = doc["metadata"]["name"]
    namespace.apply(doc)

    def diagnostics() -> str:
        return (f"{namespace.diagnostics(KIND, name)}\n{namespace.run('describe', 'scaledobject', name, check=False)}\n"
                f"{namespace.run('get', 'endpointslices', '-o', 'yaml', check=False)}")

    try:
        # The first pod starts, serves nothing, and KEDA takes it away after the idle time.
        wait_until(lambda: (namespace.json("get", "deployment", name).get("spec") or {}).get("replicas") == 0,
                   timeout=ready_timeout, what="KEDA scaling the idle deployment to zero", interval=10,
                   diagnostics=diagnostics)  # fmt: skip
        wait_until(lambda: _activation(namespace, name).get("route") == "Activator", timeout=120,
                   what="the Service routed to the activator", diagnostics=diagnostics)  # fmt: skip
        assert "ScaledToZero" in _reasons(namespace, name)
        slices = namespace.json("get", "endpointslices", "--selector", f"kubernetes.io/service-name={name}")["items"]
        assert any(s["metadata"]["name"] == f"{name}-activator" for s in slices), slices

        # A request through the Service's own name: held, the deployment woken, the answer returned.
        port = namespace.json("get", "service", name)["spec"]["ports"][0]["port"]
        url = f"http://{name}.{namespace.namespace}.svc:{port}/v1/completions"
        namespace.apply(client_pod(runtime_image, pull_policy, url))
        phase = wait_until(
            lambda: (namespace.json("get", "pod", CLIENT).get("status") or {}).get("phase") in ("Succeeded", "Failed")
            and namespace.json("get", "pod", CLIENT)["status"]["phase"],
            timeout=ready_timeout, what="the held request's answer", interval=5, diagnostics=diagnostics,
        )  # fmt: skip
        output = namespace.run("logs", CLIENT)
        assert phase == "Succeeded", output
        status, _, body = output.strip().partition(" ")
        assert status == "200" and json.loads(body)["choices"][0]["text"], output
        assert "Activated" in _reasons(namespace, name), _reasons(namespace, name)
        wait_until(lambda: _activation(namespace, name).get("route") == "Pods", timeout=120,
                   what="the Service routed back to its pods", diagnostics=diagnostics)  # fmt: skip
        assert _activation(namespace, name).get("lastActivationTime")
    finally:
        namespace.run("delete", KIND, name, "--wait=false", check=False)
