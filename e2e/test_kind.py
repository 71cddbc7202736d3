"""kubellm on a real cluster: the CPU example serves, rolls without dropping a request, and the autoscaled
example scales up on queue depth. Run through e2e/kind.sh (`make e2e`); without a cluster every test here
skips with the reason (see conftest.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import manifests
import pytest
from kube import Kubectl, KubectlError, api_proxy, port_forward, service_proxy_url, wait_until
from openai import OpenAI
from traffic import StreamingLoad

KIND = "llmd"
EVENT_KIND = "LLMDeployment"
PRINTER_COLUMNS = ["NAME", "MODEL", "QUANT", "TP", "READY", "QUEUE", "STATUS", "AGE"]


def _wait_ready(ns: Kubectl, name: str, timeout: float) -> None:
    """``kubectl wait --for=condition=Ready``, with describe output in the failure."""
    try:
        ns.run("wait", "--for=condition=Ready", f"{KIND}/{name}", f"--timeout={int(timeout)}s", timeout=timeout + 30)
    except KubectlError as e:
        raise AssertionError(f"{KIND}/{name} did not become Ready in {timeout:.0f}s: {e}\n"
                             f"{ns.diagnostics(KIND, name)}") from e


def _service_port(ns: Kubectl, name: str) -> tuple[int, str]:
    """(port, port name) of the LLMDeployment's Service."""
    ports = ns.json("get", "service", name)["spec"]["ports"]
    return ports[0]["port"], ports[0]["name"]


def _pods(ns: Kubectl, name: str) -> set[str]:
    items = ns.json("get", "pods", "--selector", f"kubellm.io/llmdeployment={name}")["items"]
    return {p["metadata"]["name"] for p in items if not p["metadata"].get("deletionTimestamp")}


def _event_reasons(ns: Kubectl, name: str) -> list[tuple[str, str]]:
    return [(e["reason"], e.get("message", "")) for e in ns.events_for(EVENT_KIND, name)]


@pytest.fixture(scope="module")
def smollm2(namespace: Kubectl, runtime_image: str, pull_policy: str, ready_timeout: float) -> str:
    """examples/llmdeployment-cpu.yaml, applied with the image under test and waited on until Ready."""
    doc = manifests.cpu_deployment(runtime_image, namespace.namespace, pull_policy=pull_policy)
    namespace.apply(doc)
    name = doc["metadata"]["name"]
    _wait_ready(namespace, name, ready_timeout)
    return name


def test_cpu_example_answers_openai_chat_through_its_service(namespace: Kubectl, smollm2: str):
    port, _ = _service_port(namespace, smollm2)
    with port_forward(namespace, f"service/{smollm2}", port) as local:
        client = OpenAI(base_url=f"http://127.0.0.1:{local}/v1", api_key="unused", max_retries=0, timeout=120)
        assert manifests.SERVED_MODEL_NAME in [m.id for m in client.models.list().data]
        question = [{"role": "user", "content": "What is the capital of France?"}]
        reply = client.chat.completions.create(
            model=manifests.SERVED_MODEL_NAME, messages=question, temperature=0, max_tokens=32
        )
        assert "Paris" in (reply.choices[0].message.content or ""), reply
        assert reply.usage is not None and reply.usage.completion_tokens > 0
        pieces = [
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(
                model=manifests.SERVED_MODEL_NAME, messages=question, temperature=0, max_tokens=32, stream=True
            )
            if chunk.choices
        ]
        assert len(pieces) > 1 and "Paris" in "".join(pieces), pieces


def test_kubectl_get_llmd_shows_model_quant_tp_ready_queue_status_age(namespace: Kubectl, smollm2: str):
    lines = namespace.run("get", KIND, smollm2).splitlines()
    header, row = lines[0].split(), lines[1].split()
    assert header == PRINTER_COLUMNS, lines
    values = dict(zip(header, row, strict=True))
    assert values["NAME"] == smollm2
    assert values["MODEL"] == "smollm2"
    assert values["QUANT"] == "none"
    assert values["TP"] == "1"
    assert values["READY"] == "1/1"
    assert values["STATUS"] == "Available"
    assert values["QUEUE"] in ("<none>", "0"), "no autoscaling: the queue column has nothing to show"
    wide = namespace.run("get", KIND, smollm2, "--output", "wide").splitlines()
    wide_values = dict(zip(wide[0].split(), wide[1].split(), strict=True))
    port, _ = _service_port(namespace, smollm2)
    assert wide_values["ENDPOINT"] == f"http://{smollm2}.{namespace.namespace}.svc:{port}/v1"


def test_rollout_under_streaming_load_fails_no_request(namespace: Kubectl, smollm2: str, ready_timeout: float):
    """Changing the spec rolls the pods (surge first, drain last); clients of the Service see no error."""
    _, port_name = _service_port(namespace, smollm2)
    pods_before = _pods(namespace, smollm2)
    with api_proxy(namespace) as proxy:
        url = service_proxy_url(proxy, namespace.namespace, smollm2, port_name, "/v1")
        load = StreamingLoad(url, manifests.SERVED_MODEL_NAME, workers=3).start()
        try:
            wait_until(lambda: load.succeeded >= 3, timeout=120, what="steady traffic before the rollout",
                       interval=1, diagnostics=lambda: f"failures so far: {load.failures[:5]}")
            patch = {"spec": {"env": [{"name": "KUBELLM_E2E_ROLLOUT", "value": str(time.time_ns())}]}}
            namespace.run("patch", KIND, smollm2, "--type", "merge", "--patch", json.dumps(patch))
            generation = namespace.get(KIND, smollm2)["metadata"]["generation"]
            wait_until(
                lambda: any(reason == "RolloutComplete" and f"generation {generation}:" in message
                            for reason, message in _event_reasons(namespace, smollm2)),
                timeout=ready_timeout, what=f"a RolloutComplete Event for generation {generation}",
                diagnostics=lambda: namespace.diagnostics(KIND, smollm2),
            )
            settled = load.succeeded
            wait_until(lambda: load.succeeded >= settled + 3, timeout=120, what="traffic after the rollout",
                       interval=1)
        finally:
            load.stop(timeout=180)
    failures = load.failures
    assert not failures, f"{len(failures)} of {len(load.outcomes)} requests failed during the rollout: {failures[:10]}"
    assert load.succeeded >= 6
    pods_after = _pods(namespace, smollm2)
    assert pods_after and not pods_after & pods_before, f"pods before {pods_before}, after {pods_after}"
    status = namespace.get(KIND, smollm2)["status"]
    assert status["readyText"] == "1/1", status


def test_autoscaled_example_scales_up_on_queue_depth(
    namespace: Kubectl, runtime_image: str, pull_policy: str, ready_timeout: float
):
    """Queue depth (kubellm:num_requests_waiting via Prometheus and prometheus-adapter) drives the HPA."""
    doc = manifests.autoscaled_deployment(runtime_image, namespace.namespace, pull_policy=pull_policy)
    name = doc["metadata"]["name"]
    max_num_seqs = doc["spec"]["engine"]["maxNumSeqs"]
    target = doc["spec"]["autoscaling"]["targetQueueDepth"]
    namespace.apply(doc)
    _wait_ready(namespace, name, ready_timeout)
    hpa = wait_until(lambda: namespace.get("hpa", name), timeout=120, what=f"the HorizontalPodAutoscaler {name}")
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "kubellm_num_requests_waiting"

    _, port_name = _service_port(namespace, name)
    queue_depths: list[float] = []

    def scaled_up() -> bool:
        depth = (namespace.get(KIND, name).get("status", {}).get("autoscaling") or {}).get("currentQueueDepth")
        if depth is not None:
            queue_depths.append(float(depth))
        return any(reason == "ScaledUp" for reason, _ in _event_reasons(namespace, name))

    def autoscaler_state() -> str:
        custom = namespace.run(
            "get", "--raw",
            f"/apis/custom.metrics.k8s.io/v1beta1/namespaces/{namespace.namespace}/pods/*/kubellm_num_requests_waiting",
            check=False,
        )
        return (f"queue depths seen in status: {queue_depths}\ncustom metrics API: {custom}\n"
                f"{namespace.run('describe', 'hpa', name, check=False)}\n{namespace.diagnostics(KIND, name)}")

    with api_proxy(namespace) as proxy:
        url = service_proxy_url(proxy, namespace.namespace, name, port_name, "/v1")
        # Enough long requests that, with max_num_seqs of them running, the rest wait: well over the target.
        workers = max_num_seqs + 4 * target
        load = StreamingLoad(url, manifests.SERVED_MODEL_NAME, workers=workers, max_tokens=384, ignore_eos=True)
        load.start()
        try:
            wait_until(scaled_up, timeout=ready_timeout, what="a ScaledUp Event", interval=5,
                       diagnostics=autoscaler_state)
        finally:
            load.stop(timeout=0)  # the daemon threads finish their last request on their own
    scaled = [message for reason, message in _event_reasons(namespace, name) if reason == "ScaledUp"]
    assert scaled[0].startswith("from 1 to "), scaled  # "from 1 to 2, queue depth 9 (target 4)"
    describe = namespace.run("describe", KIND, name)
    assert "ScaledUp" in describe, describe


def test_api_keys_example_waits_for_its_secret_then_refuses_calls_without_a_key(
    namespace: Kubectl, runtime_image: str, pull_policy: str, ready_timeout: float
):
    doc = manifests.api_keys_deployment(runtime_image, namespace.namespace, pull_policy=pull_policy)
    name, secret_name = doc["metadata"]["name"], doc["spec"]["auth"]["apiKeySecretRef"]["name"]
    namespace.apply(doc)

    def degraded_for_the_secret() -> bool:
        conditions = namespace.json("get", KIND, name).get("status", {}).get("conditions", [])
        return any(c["type"] == "Degraded" and c["status"] == "True" and c["reason"] == "CreateContainerConfigError"
                   for c in conditions)

    # No Secret yet: the pod must not start without keys, and the SRE sees why.
    wait_until(degraded_for_the_secret, timeout=300, what="Degraded=CreateContainerConfigError without the Secret",
               diagnostics=lambda: namespace.diagnostics(KIND, name))
    namespace.apply(manifests.secret(secret_name, namespace.namespace, {"api-key": "e2e-old,e2e-new"}))
    _wait_ready(namespace, name, ready_timeout)
    port, _ = _service_port(namespace, name)
    with port_forward(namespace, f"service/{name}", port) as local:
        base = f"http://127.0.0.1:{local}"
        refused = httpx.get(f"{base}/v1/models", timeout=30)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key", refused.text
        assert httpx.get(f"{base}/health/ready", timeout=60).status_code == 200  # probes need no key
        for key in ("e2e-old", "e2e-new"):
            client = OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)
            assert manifests.SERVED_MODEL_NAME in [m.id for m in client.models.list().data]


@pytest.fixture
def one_fake_gpu(kube: Kubectl) -> Iterator[str]:
    """The (single) kind node advertises one :data:`manifests.FAKE_GPU_RESOURCE`, as the Kubernetes docs'
    "Advertise Extended Resources for a Node" does: a JSON patch of the node's status capacity (the kubelet
    keeps it). Removed afterwards."""
    nodes = [n["metadata"]["name"] for n in kube.json("get", "nodes")["items"]]
    if len(nodes) != 1:  # with more nodes a surge pod may find room elsewhere (kind.sh makes one)
        pytest.skip(f"the fake-GPU rollout case needs a one-node cluster, this one has {len(nodes)}")
    (node,) = nodes
    path = "/status/capacity/" + manifests.FAKE_GPU_RESOURCE.replace("/", "~1")
    kube.run("patch", "node", node, "--subresource=status", "--type=json",
             "--patch", json.dumps([{"op": "add", "path": path, "value": "1"}]))
    try:
        yield node
    finally:
        kube.run("patch", "node", node, "--subresource=status", "--type=json",
                 "--patch", json.dumps([{"op": "remove", "path": path}]), check=False)


def test_a_rollout_without_a_spare_gpu_is_reported_then_replaced_in_place(
    namespace: Kubectl, runtime_image: str, pull_policy: str, one_fake_gpu: str
):
    """One fake GPU, one replica holding it: the surge pod of a rollout cannot schedule. The operator reports
    RolloutBlockedNoSpareGPU with one Warning; switched to ReplaceInPlace it applies maxSurge 0 and the new pod
    gets the GPU the old one frees. (The pods ask for CUDA and never serve here: completion and the restored
    strategy are covered by tests/operator/test_rollout_guard_kmock.py.)"""
    doc = manifests.fake_gpu_deployment(runtime_image, namespace.namespace, pull_policy=pull_policy)
    name = doc["metadata"]["name"]
    namespace.apply(doc)

    def scheduled_pods() -> list[dict]:
        pods = namespace.json("get", "pods", "--selector", f"kubellm.io/llmdeployment={name}")["items"]
        return [p for p in pods if any(c["type"] == "PodScheduled" and c["status"] == "True"
                                       for c in p.get("status", {}).get("conditions", []))]

    first = wait_until(scheduled_pods, timeout=120, what="the first pod on the fake GPU",
                       diagnostics=lambda: namespace.diagnostics(KIND, name))
    patch = {"spec": {"env": [{"name": "KUBELLM_E2E_ROLLOUT", "value": str(time.time_ns())}]}}
    namespace.run("patch", KIND, name, "--type", "merge", "--patch", json.dumps(patch))

    def progressing(reason: str):
        conditions = namespace.json("get", KIND, name).get("status", {}).get("conditions", [])
        return next((c for c in conditions if c["type"] == "Progressing" and c["reason"] == reason), None)

    blocked = wait_until(lambda: progressing("RolloutBlockedNoSpareGPU"), timeout=180,
                         what="Progressing=False/RolloutBlockedNoSpareGPU",
                         diagnostics=lambda: namespace.diagnostics(KIND, name))
    assert blocked["status"] == "False" and f"Insufficient {manifests.FAKE_GPU_RESOURCE}" in blocked["message"]
    time.sleep(35)  # two more observations (every 15 s): still one Warning
    warnings = [m for reason, m in _event_reasons(namespace, name) if reason == "RolloutBlockedNoSpareGPU"]
    assert len(warnings) == 1, warnings

    patch = {"spec": {"rollout": {"onNoSpareGPU": "ReplaceInPlace"}}}
    namespace.run("patch", KIND, name, "--type", "merge", "--patch", json.dumps(patch))
    wait_until(lambda: progressing("ReplacingInPlace"), timeout=120, what="Progressing=True/ReplacingInPlace",
               diagnostics=lambda: namespace.diagnostics(KIND, name))
    deployment = namespace.get("deployment", name)
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert "kubellm.io/replacing-in-place" in deployment["metadata"]["annotations"]
    first_name = first[0]["metadata"]["name"]
    wait_until(lambda: [p for p in scheduled_pods() if p["metadata"]["name"] != first_name], timeout=180,
               what="the new pod scheduled on the GPU the old one freed",
               diagnostics=lambda: namespace.diagnostics(KIND, name))
    assert any(reason == "RolloutReplacingInPlace" for reason, _ in _event_reasons(namespace, name))


def test_multinode_example_serves_one_tensor_parallel_group_over_three_pods(
    kube: Kubectl, namespace: Kubectl, runtime_image: str, pull_policy: str, ready_timeout: float
):
    """examples/llmdeployment-multinode.yaml on CPUs: a LeaderWorkerSet group of a leader and two workers (one
    rank each, the demo model split in 3) answers through the Service, which reaches the leader only. Needs the
    LWS controller (kind.sh installs it); skips without its CRD."""
    if not kube.run("get", "crd", "leaderworkersets.leaderworkerset.x-k8s.io", "--ignore-not-found").strip():
        pytest.skip("the LeaderWorkerSet CRD is not installed (kind.sh installs LWS)")
    doc = manifests.multinode_deployment(runtime_image, namespace.namespace, pull_policy=pull_policy)
    name = doc["metadata"]["name"]
    namespace.apply(doc)
    try:
        _wait_ready(namespace, name, ready_timeout)
        lws = namespace.get("leaderworkerset", f"{name}-group")
        assert lws is not None and lws["spec"]["leaderWorkerTemplate"]["size"] == manifests.MULTI_NODE_RANKS
        pods = namespace.json("get", "pods", "--selector", f"kubellm.io/llmdeployment={name}")["items"]
        indices = sorted(p["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/worker-index"] for p in pods)
        assert indices == ["0", "1", "2"], indices
        slices = namespace.json("get", "endpointslices", "--selector", f"kubernetes.io/service-name={name}")["items"]
        endpoints = [e for s in slices for e in s.get("endpoints") or []]
        assert len(endpoints) == 1, endpoints  # the leader: workers serve no HTTP
        port, _ = _service_port(namespace, name)
        with port_forward(namespace, f"service/{name}", port) as local:
            client = OpenAI(base_url=f"http://127.0.0.1:{local}/v1", api_key="unused", max_retries=0, timeout=300)
            question = [{"role": "user", "content": "What is the capital of France?"}]
            reply = client.chat.completions.create(
                model=manifests.SERVED_MODEL_NAME, messages=question, temperature=0, max_tokens=16
            )
            assert "Paris" in (reply.choices[0].message.content or ""), reply
        status = namespace.json("get", KIND, name)["status"]
        assert status["readyText"] == "1/1", status
    finally:
        namespace.run("delete", KIND, name, "--wait=false", check=False)  # three pods: free the runner's CPUs


def test_inference_pool_example_owns_a_pool_of_its_ready_pods_with_the_metrics_an_epp_reads(
    kube: Kubectl, namespace: Kubectl, runtime_image: str, pull_policy: str, ready_timeout: float
):
    """examples/llmdeployment-inferencepool.yaml on a CPU: the API server admits the rendered InferencePool (the
    upstream CRD's schema and CEL rules), the pool selects exactly the LLMDeployment's pods, and the pod's port
    answers /metrics with every name ENDPOINT_PICKER_METRICS gives the EPP. No gateway or EPP runs here (see
    docs/gateway.md). Needs the InferencePool CRD (kind.sh installs it); skips without it."""
    from kubellm.runtime.server.metrics import ENDPOINT_PICKER_METRICS

    if not kube.run("get", "crd", "inferencepools.inference.networking.k8s.io", "--ignore-not-found").strip():
        pytest.skip("the InferencePool CRD is not installed (kind.sh installs the Gateway API Inference Extension's)")
    doc = manifests.inference_pool_deployment(runtime_image, namespace.namespace, pull_policy=pull_policy)
    name = doc["metadata"]["name"]
    namespace.apply(doc)
    try:
        _wait_ready(namespace, name, ready_timeout)
        pool = wait_until(lambda: namespace.get("inferencepool", name), timeout=60, what="the InferencePool",
                          diagnostics=lambda: namespace.diagnostics(KIND, name))
        assert [r["kind"] for r in pool["metadata"]["ownerReferences"]] == [EVENT_KIND]
        selector = ",".join(f"{k}={v}" for k, v in sorted(pool["spec"]["selector"]["matchLabels"].items()))
        members = {p["metadata"]["name"] for p in namespace.json("get", "pods", "--selector", selector)["items"]}
        assert members == _pods(namespace, name) and len(members) == 1, (members, _pods(namespace, name))
        (target,) = pool["spec"]["targetPorts"]
        with port_forward(namespace, f"pod/{members.pop()}", target["number"]) as local:
            text = httpx.get(f"http://127.0.0.1:{local}/metrics", timeout=30).text
        for field, metric in ENDPOINT_PICKER_METRICS.items():
            assert not metric or f"\n{metric}{{" in text, (field, metric)
    finally:
        namespace.run("delete", KIND, name, "--wait=false", check=False)
