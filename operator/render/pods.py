"""The runtime's pod template: the containers, volumes, probes and scheduling every runtime pod gets (the
Deployment's template; :mod:`.multinode` derives a LeaderWorkerSet's leader and worker templates from it).

* Roll-outs: the template carries ``kubellm.io/spec-hash``, a hash of the rendered pod template itself,
  so it moves exactly when the pods would change (model, image, engine flags, resources, probes...) and not
  on replicas, autoscaling, service or monitoring changes. The operator can compare it with its pods' to
  tell updated pods from old ones.
* Model sources: ``hf://org/name`` is downloaded by an init container (same image,
  ``kubellm models download``) into an emptyDir at /models; ``pvc://claim/path`` mounts the claim read-only
  at /models; ``file:///path`` is a path that already exists in the container (baked into the image, or on a
  volume a mutating webhook adds): no volume is mounted, because hostPath would break Pod Security
  "restricted" and tie pods to nodes; a known model name (smollm2) is pulled by an init container into the
  /cache emptyDir, where ``kubellm serve --model smollm2`` finds it.
* Graceful shutdown: ``preStop: {sleep: {seconds: 5}}`` (the kubelet's own sleep action, on by default
  since Kubernetes 1.30: no ``sleep`` binary needed in the image, no process exec'd into the container)
  gives endpoint controllers and proxies time to stop sending traffic before SIGTERM starts the runtime's
  drain (``--drain-timeout`` = rollout.drainTimeoutSeconds); terminationGracePeriodSeconds = preStop +
  drain + 15 s margin. Needs Kubernetes >= 1.30.
* Readiness: the kubelet's timeout is readinessTimeoutSeconds and the runtime's own deadline for the probe
  generation (``--probe-timeout``) is 2 s less, so a slow answer becomes a clean 503, never a kubelet timeout.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import math
from typing import Any

from kubellm.operator import api
from kubellm.operator.render.naming import PORT_NAME, SPEC_HASH_ANNOTATION, labels, selector_labels
from kubellm.runtime.engine import settings as engine_settings

CONTAINER_NAME = "runtime"
RUN_AS_USER = 10001  # the image's kubellm user (Dockerfile: useradd --uid 10001)
CACHE_DIR = "/cache"  # KUBELLM_CACHE: known models are pulled here
API_KEY_ENV = "KUBELLM_API_KEY"  # read by the runtime (kubellm.runtime.server.auth), from spec.auth
MODELS_DIR = "/models"  # hf:// downloads and pvc:// mounts
DRAFT_MODELS_DIR = "/draft-models"  # the same for engine.speculative.model
TMP_DIR = "/tmp"  # also HOME: pip, Hugging Face and Triton caches write under $HOME
SHM_DIR = "/dev/shm"
SHM_SIZE_PER_GPU_GI = 1  # memory-backed /dev/shm (NCCL, torch IPC); counts against the memory limit when used
SHM_SIZE_CPU = "256Mi"
TMP_SIZE_LIMIT = "4Gi"
CACHE_SIZE_LIMIT = "20Gi"
STARTUP_PERIOD_SECONDS = 10
READINESS_FAILURE_THRESHOLD = 3
READINESS_TIMEOUT_MARGIN_SECONDS = 2  # --probe-timeout = readinessTimeoutSeconds - this
LIVENESS_PERIOD_SECONDS = 10
LIVENESS_TIMEOUT_SECONDS = 5
LIVENESS_FAILURE_THRESHOLD = 6
PRESTOP_SLEEP_SECONDS = 5
TERMINATION_MARGIN_SECONDS = 15
# hf:// emptyDirs have no sizeLimit: the model's size is unknown here (a 32B bf16 model is 65 GB).


@dataclasses.dataclass(frozen=True)
class ModelFetch:
    """How the pod gets one model (the served one, or the draft of engine.speculative.model)."""

    path: str  # what the runtime is given (--model / --speculative-model)
    volume: dict | None  # the volume holding it (named ``volume_name``), None: none needed
    command: list[str] | None  # the init container's command, None: nothing to fetch before start
    read_only: bool  # whether the volume is only read (a PVC) or written by the init container
    mount_dir: str
    init_name: str  # the init container's name


def _fetch_plan(uri: str, revision: str | None, volume_name: str, mount_dir: str, what: str) -> ModelFetch:
    """``what``: ``model`` or ``draft-model``, for the init container's name (download-<what>, pull-<what>)."""
    if uri.startswith("hf://"):
        repo = uri.removeprefix("hf://")
        dest = f"{mount_dir}/{repo}"
        command = ["kubellm", "--log-format", "json", "models", "download", uri]
        if revision:
            command += ["--revision", revision]
        command += ["--dest", dest]
        return ModelFetch(dest, {"name": volume_name, "emptyDir": {}}, command, False, mount_dir, f"download-{what}")
    if uri.startswith("pvc://"):
        claim, _, sub = uri.removeprefix("pvc://").partition("/")
        sub = "/".join(p for p in sub.split("/") if p and p != ".")
        volume = {"name": volume_name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        return ModelFetch(f"{mount_dir}/{sub}" if sub else mount_dir, volume, None, True, mount_dir, "")
    if uri.startswith("file://"):
        return ModelFetch(uri.removeprefix("file://"), None, None, True, mount_dir, "")
    return ModelFetch(uri, None, ["kubellm", "--log-format", "json", "models", "pull", uri], False, mount_dir,
                      f"pull-{what}")


def _model_fetches(spec: api.LLMDeploymentSpec) -> list[ModelFetch]:
    """The served model's fetch, then the draft model's when engine.speculative.model is set."""
    fetches = [_fetch_plan(spec.model.uri, spec.model.revision, "models", MODELS_DIR, "model")]
    if (draft := spec.engine.speculative.model) is not None:
        fetches.append(_fetch_plan(draft.uri, draft.revision, "draft-models", DRAFT_MODELS_DIR, "draft-model"))
    return fetches


def _model_plan(spec: api.LLMDeploymentSpec) -> tuple[str, dict | None, list[str] | None, bool]:
    """``(--model argument, models volume or None, init container command or None, models volume read-only)``."""
    f = _model_fetches(spec)[0]
    return f.path, f.volume, f.command, f.read_only


def _cpu_threads(spec: api.LLMDeploymentSpec) -> int | None:
    """Torch's CPU threads: the CPU limit rounded down (at least 1). Torch otherwise starts one thread per
    core of the node, not of the container's quota, and a 2-CPU pod on a 64-core node thrashes."""
    cpu = spec.resource_requirements().get("limits", {}).get("cpu")
    if cpu is None:
        return None
    return max(1, math.floor(api.parse_quantity(cpu)))


def probe_timeout_seconds(spec: api.LLMDeploymentSpec) -> int:
    """The runtime's deadline for the readiness probe's generation (``--probe-timeout``)."""
    return max(1, spec.probes.readiness_timeout_seconds - READINESS_TIMEOUT_MARGIN_SECONDS)


def termination_grace_period_seconds(spec: api.LLMDeploymentSpec) -> int:
    return PRESTOP_SLEEP_SECONDS + spec.rollout.drain_timeout_seconds + TERMINATION_MARGIN_SECONDS


def _setting_args(spec: api.LLMDeploymentSpec) -> list[str]:
    """The flags of the engine settings the API offers, in the table's order (see EngineSetting.render)."""
    args: list[str] = []
    for s in engine_settings.ENGINE_SETTINGS:
        if s.crd_field is None:
            continue
        value = functools.reduce(getattr, s.crd_field.split("."), spec)
        if value is None or (s.render == "changed" and value == s.default):
            continue
        args += s.cli_value(value)
    return args


def runtime_args(spec: api.LLMDeploymentSpec) -> list[str]:
    """The arguments of ``kubellm serve`` for this spec."""
    model_arg, _, _, _ = _model_plan(spec)
    args = [
        "--model", model_arg,
        "--served-model-name", spec.served_model_name,
        "--port", str(api.RUNTIME_PORT),
        "--device", "cuda" if spec.gpu_count > 0 else "cpu",
        *_setting_args(spec),
    ]  # fmt: skip
    if spec.engine.speculative.model is not None:
        args += ["--speculative-model", _model_fetches(spec)[1].path]
    if (threads := _cpu_threads(spec)) is not None:
        args += ["--num-threads", str(threads)]
    args += [
        "--drain-timeout", str(spec.rollout.drain_timeout_seconds),
        "--probe-timeout", str(probe_timeout_seconds(spec)),
        "--log-format", "json",
    ]  # fmt: skip
    return args


def _env(spec: api.LLMDeploymentSpec) -> list[dict[str, Any]]:
    """The environment of every container: the operator's variables (unless the user's env overrides them)
    and the user's env."""
    user = [e.to_k8s() for e in spec.env or ()]
    names = {e["name"] for e in user}
    builtin = [{"name": "KUBELLM_CACHE", "value": CACHE_DIR}, {"name": "HOME", "value": TMP_DIR}]
    return [e for e in builtin if e["name"] not in names] + user


def _api_key_env(spec: api.LLMDeploymentSpec) -> list[dict[str, Any]]:
    """KUBELLM_API_KEY from spec.auth.apiKeySecretRef, for the runtime container only (the model download
    needs no key). Not optional: without the Secret the pod waits (CreateContainerConfigError) rather than
    serving without a key."""
    ref = spec.auth.api_key_secret_ref
    if ref is None:
        return []
    return [{"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


def _container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _http_probe(path: str, **fields: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": PORT_NAME, "scheme": "HTTP"}, **fields}


def _volumes(spec: api.LLMDeploymentSpec, models_volume: dict[str, Any] | None) -> tuple[list, list]:
    """The pod's volumes and the runtime container's mounts: shared memory, the cache, /tmp (the root
    filesystem is read-only) and the models volumes when the model URIs need them (the draft's too)."""
    shm_size = f"{SHM_SIZE_PER_GPU_GI * spec.gpu_count}Gi" if spec.gpu_count > 0 else SHM_SIZE_CPU
    mounts = [
        {"name": "dshm", "mountPath": SHM_DIR},
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "tmp", "mountPath": TMP_DIR},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}},
        {"name": "cache", "emptyDir": {"sizeLimit": CACHE_SIZE_LIMIT}},
        {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE_LIMIT}},
    ]
    if models_volume is not None:
        mounts.append({"name": "models", "mountPath": MODELS_DIR, "readOnly": True})
        volumes.append(models_volume)
    for draft in _model_fetches(spec)[1:]:
        if draft.volume is not None:
            mounts.append({"name": draft.volume["name"], "mountPath": draft.mount_dir, "readOnly": True})
            volumes.append(draft.volume)
    return volumes, mounts


def _probes(spec: api.LLMDeploymentSpec) -> dict[str, Any]:
    """Startup (model load), readiness (a real short inference) and liveness (the process answers)."""
    return {
        "startupProbe": _http_probe(
            "/health/startup",
            periodSeconds=STARTUP_PERIOD_SECONDS,
            timeoutSeconds=5,
            failureThreshold=math.ceil(spec.probes.startup_timeout_seconds / STARTUP_PERIOD_SECONDS),
        ),
        "readinessProbe": _http_probe(
            "/health/ready",
            periodSeconds=spec.probes.readiness_period_seconds,
            timeoutSeconds=spec.probes.readiness_timeout_seconds,
            successThreshold=1,
            failureThreshold=READINESS_FAILURE_THRESHOLD,
        ),
        "livenessProbe": _http_probe(
            "/health/live",
            periodSeconds=LIVENESS_PERIOD_SECONDS,
            timeoutSeconds=LIVENESS_TIMEOUT_SECONDS,
            failureThreshold=LIVENESS_FAILURE_THRESHOLD,
        ),
    }


def _runtime_container(
    spec: api.LLMDeploymentSpec, resources: dict[str, Any], mounts: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "name": CONTAINER_NAME,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["kubellm", "serve"],
        "args": runtime_args(spec),
        "ports": [{"name": PORT_NAME, "containerPort": api.RUNTIME_PORT, "protocol": "TCP"}],
        "env": _env(spec) + _api_key_env(spec),
        "resources": resources,
        "volumeMounts": mounts,
        **_probes(spec),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
        "securityContext": _container_security_context(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def _init_container(spec: api.LLMDeploymentSpec, fetch: ModelFetch, resources: dict[str, Any]) -> dict[str, Any]:
    """A container that fetches a model (the served one or the draft) before the runtime starts."""
    # hf:// writes its models volume, a known name the cache; both need /tmp (pip, Hugging Face).
    mounts = [
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "tmp", "mountPath": TMP_DIR},
    ]
    if fetch.volume is not None and not fetch.read_only:
        mounts.append({"name": fetch.volume["name"], "mountPath": fetch.mount_dir})
    # Same CPU and memory as the runtime (no GPUs): keeps Guaranteed QoS without raising the pod's request.
    init_resources = {
        kind: {k: v for k, v in values.items() if k in ("cpu", "memory")}
        for kind, values in resources.items()
    }
    return {
        "name": fetch.init_name,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": fetch.command,
        "env": _env(spec),
        "resources": {k: v for k, v in init_resources.items() if v},
        "volumeMounts": mounts,
        "securityContext": _container_security_context(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def _scheduling(ld: api.LLMDeployment) -> dict[str, Any]:
    """Where the pods may run: node selector (with the GPU product), tolerations, affinity, priority, and a
    soft preference for spreading replicas over nodes that never blocks scheduling."""
    spec = ld.spec
    out: dict[str, Any] = {}
    node_selector = dict(spec.node_selector or {})
    if spec.resources.gpu.product is not None and spec.gpu_count > 0:
        node_selector[api.GPU_PRODUCT_LABEL] = spec.resources.gpu.product
    if node_selector:
        out["nodeSelector"] = node_selector
    if spec.tolerations:
        out["tolerations"] = [t.to_k8s() for t in spec.tolerations]
    if spec.affinity:
        out["affinity"] = copy.deepcopy(spec.affinity)
    if spec.priority_class_name:
        out["priorityClassName"] = spec.priority_class_name
    out["topologySpreadConstraints"] = [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": selector_labels(ld)},
            "matchLabelKeys": ["pod-template-hash"],
        }
    ]
    return out


def pod_template(ld: api.LLMDeployment) -> dict[str, Any]:
    """The runtime's pod template (a Deployment's; multinode.py derives the leader and worker templates)."""
    spec = ld.spec
    _, models_volume, _, _ = _model_plan(spec)
    resources = spec.resource_requirements()
    volumes, mounts = _volumes(spec, models_volume)
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # the runtime never talks to the API server
        "enableServiceLinks": False,  # no <SERVICE>_PORT variables (a Service named kubellm would add KUBELLM_*)
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": termination_grace_period_seconds(spec),
    }
    if init := [_init_container(spec, f, resources) for f in _model_fetches(spec) if f.command is not None]:
        pod_spec["initContainers"] = init
    pod_spec["containers"] = [_runtime_container(spec, resources, mounts)]
    pod_spec["volumes"] = volumes
    pod_spec.update(_scheduling(ld))
    template: dict[str, Any] = {
        "metadata": {
            "labels": {**(spec.pod_labels or {}), **labels(ld)},
            "annotations": dict(spec.pod_annotations or {}),
        },
        "spec": pod_spec,
    }
    template["metadata"]["annotations"][SPEC_HASH_ANNOTATION] = spec_hash(template)
    return template


def spec_hash(template: dict[str, Any]) -> str:
    """The ``kubellm.io/spec-hash`` of a pod template (its own hash annotation ignored): 16 hex digits of the
    SHA-256 of its canonical JSON, so equal templates hash equal whatever the key order."""
    stripped = copy.deepcopy(template)
    stripped.get("metadata", {}).get("annotations", {}).pop(SPEC_HASH_ANNOTATION, None)
    canonical = json.dumps(stripped, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
