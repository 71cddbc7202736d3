"""Render an LLMDeployment into the Kubernetes objects that serve it: pure functions, no I/O, no API client.

:func:`render` returns every child manifest in apply order (Service, Deployment or, for multi-node replicas,
LeaderWorkerSet (:mod:`.multinode`), PodDisruptionBudget, then
the HorizontalPodAutoscaler or KEDA ScaledObject when autoscaling is enabled, then the ServiceMonitor when
monitoring asks for one and the PrometheusRule when monitoring.alerts does (:mod:`.alerts`), then the InferencePool when gateway.inferencePool asks for one). Each child kind has
its own ``render_<kind>`` function; the optional ones return None when the spec does not call for that child,
so the operator can delete a child it owns that is no longer rendered (:data:`CHILD_KINDS` lists every kind
it may own). Specs the API server accepts but that cannot be rendered raise :class:`InvalidSpec` with a
message for humans; the operator turns it into a condition. ``kubellm render -f FILE`` (:func:`main`) prints
the same objects as multi-document YAML.

Decisions worth knowing (each has its constant below):

* Names: every child is named :func:`child_name` (the LLMDeployment name when it is a valid DNS-1035 label
  of at most 63 characters, else a sanitised, truncated form with a short hash of the full name, so two
  LLMDeployments never share children). Label values get the same treatment (:func:`label_value`).
* Selector: :func:`selector_labels` only (name, instance, component), constant for the life of the object:
  a Deployment's selector is immutable, and the spec-hash, model or image never appear in it.
* Roll-outs: the pod template carries ``kubellm.io/spec-hash``, a hash of the rendered pod template itself,
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
* Replicas: with autoscaling enabled the Deployment has no ``spec.replicas`` at all, so under server-side
  apply the HPA (or KEDA's HPA) is its only owner.
* PodDisruptionBudget: ``maxUnavailable: 1`` (never ``minAvailable``, which would leave a single-replica
  deployment with zero allowed disruptions and block node drains forever) and
  ``unhealthyPodEvictionPolicy: AlwaysAllow`` (a pod still loading or crash-looping never blocks a drain).
* Autoscaling metric names: see :data:`HPA_METRIC_NAME`, :data:`PROMETHEUS_ADAPTER_RULE` and
  :data:`PROMETHEUS_LLMDEPLOYMENT_LABEL`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import hashlib
import json
import math
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kubellm.operator import activation, alerts, api, crd, multinode, rollout_guard
from kubellm.runtime.engine import settings as engine_settings


class InvalidSpec(ValueError):
    """The LLMDeployment passed the API server's validation but cannot be rendered; the message says why."""


# --------------------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------------------

APP_NAME = "kubellm"
COMPONENT = "runtime"
MANAGED_BY = "kubellm-operator"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_LLMDEPLOYMENT = "kubellm.io/llmdeployment"
SPEC_HASH_ANNOTATION = "kubellm.io/spec-hash"

INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"  # Gateway API Inference Extension, GA
# Every kind the operator may own, in apply order (render() leaves out the ones a spec does not need).
CHILD_KINDS: tuple[tuple[str, str], ...] = (
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),  # instead of the Deployment when parallelism.nodes > 1
    ("policy/v1", "PodDisruptionBudget"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"),
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),  # monitoring.alerts.enabled (:mod:`.alerts`)
    (INFERENCE_POOL_API_VERSION, "InferencePool"),
)

MAX_NAME_LENGTH = 63  # DNS-1035 label (Service names) and label values
_HASH_LENGTH = 8

CONTAINER_NAME = "runtime"
PORT_NAME = "http"  # the runtime serves the API, the probes and /metrics on this one port
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
# hf:// emptyDirs have no sizeLimit: the model's size is unknown here (a 32B bf16 model is 65 GB).

STARTUP_PERIOD_SECONDS = 10
READINESS_FAILURE_THRESHOLD = 3
READINESS_TIMEOUT_MARGIN_SECONDS = 2  # --probe-timeout = readinessTimeoutSeconds - this
LIVENESS_PERIOD_SECONDS = 10
LIVENESS_TIMEOUT_SECONDS = 5
LIVENESS_FAILURE_THRESHOLD = 6
PRESTOP_SLEEP_SECONDS = 5
TERMINATION_MARGIN_SECONDS = 15
REVISION_HISTORY_LIMIT = 3
# progressDeadlineSeconds = startupTimeoutSeconds + this (scheduling, image pull), so a slow model load is not
# reported as a stalled rollout.
PROGRESS_DEADLINE_MARGIN_SECONDS = 600

# Autoscaling. The runtime exports the per-pod gauge api.QUEUE_DEPTH_METRIC (kubellm:num_requests_waiting).
# HPA: prometheus-adapter serves it on the custom-metrics API under HPA_METRIC_NAME (colon → underscore, the
# adapter rule below, which the Helm chart ships); the HPA targets its per-pod average.
HPA_METRIC_NAME = "kubellm_num_requests_waiting"
PROMETHEUS_ADAPTER_RULE: dict[str, Any] = {
    "seriesQuery": f'{api.QUEUE_DEPTH_METRIC}{{namespace!="",pod!=""}}',
    "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
    "name": {"matches": "^kubellm:(.*)$", "as": "kubellm_${1}"},
    "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
}
# KEDA: a Prometheus query summing the gauge over the LLMDeployment's pods. Scraped series carry the target's
# namespace and, through the ServiceMonitor's podTargetLabels, the pod label kubellm.io/llmdeployment under
# its sanitised name (a hand-written scrape config with the usual labelmap of __meta_kubernetes_pod_label_(.+)
# produces the same name).
PROMETHEUS_LLMDEPLOYMENT_LABEL = "kubellm_io_llmdeployment"
DEFAULT_PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"
KEDA_POLLING_INTERVAL_SECONDS = 15
# Scale to zero: "in flight" is running plus waiting (a pod busy with requests can have an empty queue). The
# activity triggers' threshold is beyond any real count: they only tell KEDA "busy" (at most one pod).
IN_FLIGHT_METRICS = ("kubellm:num_requests_running", api.QUEUE_DEPTH_METRIC)
ACTIVITY_THRESHOLD = "1000000"
SCRAPE_INTERVAL = "15s"
SCRAPE_TIMEOUT = "10s"
# HPA behaviour policies (the stabilisation windows come from the spec). Up: double or add 4 pods a minute,
# whichever is more. Down: one pod a minute; each one drains its requests first.
SCALE_UP_POLICIES = (
    {"type": "Percent", "value": 100, "periodSeconds": 60},
    {"type": "Pods", "value": 4, "periodSeconds": 60},
)
SCALE_DOWN_POLICIES = ({"type": "Pods", "value": 1, "periodSeconds": 60},)

# --------------------------------------------------------------------------------------------------
# Names, labels, owner reference
# --------------------------------------------------------------------------------------------------

_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _short_hash(text: str, length: int = _HASH_LENGTH) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def _name(ld: api.LLMDeployment) -> str:
    name = ld.name
    if not name:
        raise InvalidSpec("metadata.name is required")
    if len(name) > 253 or not _DNS1123_SUBDOMAIN.match(name):
        raise InvalidSpec(f"metadata.name {name!r} is not a valid DNS subdomain name")
    return name


def _shorten(text: str, original: str) -> str:
    """``text`` cut to leave room for ``-<hash of original>`` within MAX_NAME_LENGTH, ending alphanumeric."""
    head = text[: MAX_NAME_LENGTH - _HASH_LENGTH - 1].rstrip("-._")
    return f"{head}-{_short_hash(original)}"


def child_name(ld: api.LLMDeployment) -> str:
    """The name of every child object (and of the Service clients call).

    The LLMDeployment's name when it is a DNS-1035 label of at most 63 characters (the usual case); else its
    name with dots turned into dashes, an ``llm-`` prefix if it does not start with a letter, cut to fit and
    suffixed with a hash of the full name (so distinct LLMDeployments never collide).
    """
    name = _name(ld)
    if len(name) <= MAX_NAME_LENGTH and _DNS1035_LABEL.match(name):
        return name
    base = name.replace(".", "-")
    if not base[0].isalpha():
        base = f"llm-{base}"
    return _shorten(base, name)


def label_value(ld: api.LLMDeployment) -> str:
    """The LLMDeployment's name as a label value: itself when at most 63 characters, else cut and hashed."""
    return name_label_value(_name(ld))


def name_label_value(name: str) -> str:
    """:func:`label_value` of the LLMDeployment named ``name`` (a valid name, as the API server holds it)."""
    return name if len(name) <= MAX_NAME_LENGTH else _shorten(name, name)


def selector_labels(ld: api.LLMDeployment) -> dict[str, str]:
    """The labels that select the pods: fixed for the life of the LLMDeployment (Deployment selectors are
    immutable), so nothing that a spec change can alter belongs here."""
    return {LABEL_NAME: APP_NAME, LABEL_INSTANCE: label_value(ld), LABEL_COMPONENT: COMPONENT}


def serving_selector(ld: api.LLMDeployment) -> dict[str, str]:
    """The pods that serve HTTP (the Service's and the InferencePool's selector): all of them, or a multi-node
    group's leaders only (its workers run ranks and serve nothing)."""
    return multinode.leader_selector(ld) if multinode.is_multi_node(ld) else selector_labels(ld)


def labels(ld: api.LLMDeployment) -> dict[str, str]:
    """The labels on every child object and on the pods."""
    return {**selector_labels(ld), LABEL_MANAGED_BY: MANAGED_BY, LABEL_LLMDEPLOYMENT: label_value(ld)}


def label_selector(ld: api.LLMDeployment) -> str:
    """:func:`selector_labels` as a label-selector string, keys sorted (status.selector, the scale subresource's)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(ld).items()))


def owner_reference(ld: api.LLMDeployment) -> dict[str, Any] | None:
    """The controller reference children carry, or None when the LLMDeployment has no metadata.uid (it was
    read from a file, not from the API server: ``kubellm render``)."""
    uid = ld.metadata.get("uid")
    if not uid:
        return None
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "name": _name(ld),
        "uid": str(uid),
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_metadata(ld: api.LLMDeployment) -> dict[str, Any]:
    """Name, namespace, labels and owner reference of a child object."""
    meta: dict[str, Any] = {"name": child_name(ld)}
    if ld.namespace:
        meta["namespace"] = ld.namespace
    meta["labels"] = labels(ld)
    owner = owner_reference(ld)
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return meta


# --------------------------------------------------------------------------------------------------
# Validation beyond the API's rules
# --------------------------------------------------------------------------------------------------


def _label_key_problem(key: str) -> str | None:
    prefix, _, name = key.rpartition("/")
    if "/" in prefix:
        return "has more than one '/'"
    if prefix and (len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix)):
        return "has a prefix that is not a DNS subdomain (lowercase, e.g. example.com)"
    if not name or len(name) > 63 or not _QUALIFIED_NAME.match(name):
        return (
            "needs a name part of at most 63 alphanumerics, '-', '_' or '.', starting and ending alphanumeric"
        )
    return None


def _check_labels(field: str, values: dict[str, str]) -> list[str]:
    problems = []
    for key, value in values.items():
        if (why := _label_key_problem(key)) is not None:
            problems.append(f"{field}: key {key!r} {why}")
        if len(value) > 63 or not _LABEL_VALUE.match(value):
            problems.append(
                f"{field}: value {value!r} of {key!r} must be at most 63 alphanumerics, '-', '_' or '.', "
                "starting and ending alphanumeric"
            )
    return problems


def _format_validation_error(error: ValidationError, prefix: str) -> str:
    lines = []
    for e in error.errors():
        where = ".".join(str(p) for p in (prefix, *e["loc"]) if p != "")
        lines.append(f"{where}: {e['msg']}")
    return lines[0] if len(lines) == 1 else "\n".join(f"- {line}" for line in lines)


def validate(ld: api.LLMDeployment) -> None:
    """Raise :class:`InvalidSpec` when ``ld`` cannot be rendered.

    Re-runs the API's own validators (the CEL rules' Python twins, so specs from API servers without CEL or
    objects built without validation are caught too), then the checks only rendering needs: metadata.name,
    podLabels/podAnnotations/nodeSelector syntax, no overriding of the labels, annotation and environment
    variable the operator manages, and model paths the pod's own volumes would hide.
    """
    _name(ld)
    spec = ld.spec
    try:
        api.LLMDeploymentSpec.model_validate(spec.model_dump(mode="json", by_alias=True, exclude_none=True))
    except ValidationError as e:
        raise InvalidSpec(_format_validation_error(e, "spec")) from None
    problems: list[str] = []
    managed = labels(ld)
    problems += _check_labels("spec.podLabels", spec.pod_labels or {})
    for key in spec.pod_labels or {}:
        if key in managed:
            problems.append(f"spec.podLabels: {key} is set by the operator; remove it")
    problems += _check_labels("spec.nodeSelector", spec.node_selector or {})
    product = spec.resources.gpu.product
    chosen = (spec.node_selector or {}).get(api.GPU_PRODUCT_LABEL)
    if product is not None and spec.gpu_count > 0 and chosen is not None and chosen != product:
        problems.append(
            f"spec.nodeSelector[{api.GPU_PRODUCT_LABEL}]={chosen} contradicts resources.gpu.product={product}; "
            "set only resources.gpu.product"
        )
    for key in spec.pod_annotations or {}:
        if (why := _label_key_problem(key)) is not None:
            problems.append(f"spec.podAnnotations: key {key!r} {why}")
        if key == SPEC_HASH_ANNOTATION:
            problems.append(f"spec.podAnnotations: {key} is set by the operator; remove it")
    for env in spec.env or ():
        if env.name == "KUBELLM_CACHE":
            problems.append(
                f"spec.env: KUBELLM_CACHE is set by the operator (the {CACHE_DIR} volume); remove it"
            )
    problems += _check_model_uri("spec.model.uri", spec.model.uri)
    if (draft := spec.engine.speculative.model) is not None:
        problems += _check_model_uri("spec.engine.speculative.model.uri", draft.uri)
    if problems:
        raise InvalidSpec(problems[0] if len(problems) == 1 else "\n".join(f"- {p}" for p in problems))


def _check_model_uri(field: str, uri: str) -> list[str]:
    """Model paths the pod's own volumes would hide, or that leave their claim."""
    problems = []
    if uri.startswith("pvc://"):
        _, _, sub = uri.removeprefix("pvc://").partition("/")
        if ".." in sub.split("/"):
            problems.append(f"{field}: {uri} has a '..' path element; give a path inside the claim")
    elif uri.startswith("file://"):
        path = uri.removeprefix("file://")
        for hidden in (CACHE_DIR, TMP_DIR, SHM_DIR):
            if path == hidden or path.startswith(f"{hidden}/"):
                problems.append(
                    f"{field}: {uri} lies under {hidden}, which the pod mounts an empty volume over; "
                    "put the model elsewhere in the image"
                )
    return problems


# --------------------------------------------------------------------------------------------------
# Deployment
# --------------------------------------------------------------------------------------------------


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


def render_deployment(ld: api.LLMDeployment, *, replace_in_place: str | None = None) -> dict[str, Any]:
    """The apps/v1 Deployment running ``kubellm serve``.

    ``replace_in_place``: the spec-hash of a pod template whose rollout :mod:`.rollout_guard` switched to
    replacing pods in place (no spare GPU for a surge pod). When it is this template's, the strategy is
    :func:`.rollout_guard.in_place_strategy` and the Deployment carries the hash in
    ``kubellm.io/replacing-in-place``; any other value (a new template: a new rollout) renders the spec's strategy.
    """
    validate(ld)
    spec = ld.spec
    template = pod_template(ld)
    in_place = replace_in_place is not None and replace_in_place == template["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
    rolling_update = (
        rollout_guard.in_place_strategy(spec.rollout) if in_place else rollout_guard.spec_strategy(spec.rollout)
    )
    dep_spec: dict[str, Any] = {}
    if not spec.autoscaling.enabled:  # else the HPA / KEDA owns replicas: leave the field out entirely
        dep_spec["replicas"] = spec.replicas
    dep_spec.update(
        {
            "selector": {"matchLabels": selector_labels(ld)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling_update},
            "revisionHistoryLimit": REVISION_HISTORY_LIMIT,
            "progressDeadlineSeconds": spec.probes.startup_timeout_seconds + PROGRESS_DEADLINE_MARGIN_SECONDS,
            "template": template,
        }
    )
    metadata = child_metadata(ld)
    if in_place:
        metadata["annotations"] = {rollout_guard.IN_PLACE_ANNOTATION: replace_in_place}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata, "spec": dep_spec}


def render_workload(ld: api.LLMDeployment, *, replace_in_place: str | None = None) -> dict[str, Any]:
    """What runs the pods: the Deployment, or with parallelism.nodes > 1 a LeaderWorkerSet whose groups of
    pods each hold one tensor-parallel group (:mod:`.multinode`; the rollout guard leaves those alone)."""
    if multinode.is_multi_node(ld):
        return multinode.render_leader_worker_set(ld)
    return render_deployment(ld, replace_in_place=replace_in_place)


# --------------------------------------------------------------------------------------------------
# Service, PodDisruptionBudget
# --------------------------------------------------------------------------------------------------


def render_service(ld: api.LLMDeployment) -> dict[str, Any]:
    """The v1 Service clients call (OpenAI API); /metrics is on the same port, which the ServiceMonitor scrapes."""
    validate(ld)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(ld),
        "spec": {
            "type": ld.spec.service.type,
            "selector": serving_selector(ld),
            "ports": [
                {
                    "name": PORT_NAME,
                    "port": ld.spec.service.port,
                    "targetPort": PORT_NAME,
                    "protocol": "TCP",
                    "appProtocol": "http",
                }
            ],
        },
    }


def render_pdb(ld: api.LLMDeployment) -> dict[str, Any]:
    """The policy/v1 PodDisruptionBudget: voluntary evictions (node drains) take one pod at a time."""
    validate(ld)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(ld),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(ld)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


# --------------------------------------------------------------------------------------------------
# Autoscaling
# --------------------------------------------------------------------------------------------------


def _behavior(autoscaling: api.AutoscalingSpec) -> dict[str, Any]:
    return {
        "scaleUp": {
            "stabilizationWindowSeconds": autoscaling.scale_up_stabilization_seconds,
            "selectPolicy": "Max",
            "policies": [dict(p) for p in SCALE_UP_POLICIES],
        },
        "scaleDown": {
            "stabilizationWindowSeconds": autoscaling.scale_down_stabilization_seconds,
            "selectPolicy": "Max",
            "policies": [dict(p) for p in SCALE_DOWN_POLICIES],
        },
    }


def _scale_target(ld: api.LLMDeployment) -> dict[str, str]:
    if multinode.is_multi_node(ld):  # the LWS has a scale subresource; its selector picks the leaders
        return {"apiVersion": multinode.API_VERSION, "kind": multinode.KIND, "name": multinode.lws_name(ld)}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": child_name(ld)}


def render_hpa(ld: api.LLMDeployment) -> dict[str, Any] | None:
    """The autoscaling/v2 HorizontalPodAutoscaler (backend hpa), or None when the spec needs none.

    Targets the per-pod average of :data:`HPA_METRIC_NAME` (a Pods metric from the custom-metrics API).
    """
    validate(ld)
    autoscaling = ld.spec.autoscaling
    if not autoscaling.enabled or autoscaling.backend != "hpa":
        return None
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": child_metadata(ld),
        "spec": {
            "scaleTargetRef": _scale_target(ld),
            "minReplicas": autoscaling.min_replicas,
            "maxReplicas": autoscaling.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": HPA_METRIC_NAME},
                        "target": {
                            "type": "AverageValue",
                            "averageValue": str(autoscaling.target_queue_depth),
                        },
                    },
                }
            ],
            "behavior": _behavior(autoscaling),
        },
    }


def _series_matchers(ld: api.LLMDeployment) -> str:
    """PromQL label matchers selecting the LLMDeployment's pods' series."""
    matchers = []
    if ld.namespace:
        matchers.append(f'namespace="{ld.namespace}"')
    matchers.append(f'{PROMETHEUS_LLMDEPLOYMENT_LABEL}="{label_value(ld)}"')
    return ",".join(matchers)


def queue_depth_query(ld: api.LLMDeployment) -> str:
    """PromQL: requests waiting over all the LLMDeployment's pods (0 when none report, e.g. at zero replicas)."""
    return f"sum({api.QUEUE_DEPTH_METRIC}{{{_series_matchers(ld)}}}) or vector(0)"


def in_flight_query(ld: api.LLMDeployment) -> str:
    """PromQL: requests running or waiting over all the LLMDeployment's pods (0 when none report)."""
    matchers = _series_matchers(ld)
    return f"sum({IN_FLIGHT_METRICS[0]}{{{matchers}}} + {IN_FLIGHT_METRICS[1]}{{{matchers}}}) or vector(0)"


def activity_url(ld: api.LLMDeployment, activator_url: str) -> str:
    """The activator's count of requests it holds or forwards for ``ld`` (JSON ``{"requests": n, ...}``)."""
    return f"{activator_url.rstrip('/')}/activity/{ld.namespace or 'default'}/{child_name(ld)}"


def _activity_triggers(ld: api.LLMDeployment, prometheus_url: str, activator_url: str | None) -> list[dict]:
    """KEDA triggers that keep a deployment with minReplicas 0 awake while any request is in flight (none
    unless it scales to zero). Their threshold is beyond any real count, so they ask for one pod at most and
    the queue-depth trigger alone sizes the deployment above that."""
    if ld.spec.autoscaling.min_replicas != 0:
        return []
    triggers: list[dict[str, Any]] = [{
        "type": "prometheus",
        "name": "in-flight",
        "metricType": "AverageValue",
        "metadata": {"serverAddress": prometheus_url, "query": in_flight_query(ld),
                     "threshold": ACTIVITY_THRESHOLD, "activationThreshold": "0"},
    }]  # fmt: skip
    if activator_url:
        triggers.append({
            "type": "metrics-api",
            "name": "activator",
            "metricType": "AverageValue",
            "metadata": {"url": activity_url(ld, activator_url), "valueLocation": "requests", "format": "json",
                         "targetValue": ACTIVITY_THRESHOLD, "activationTargetValue": "0"},
        })  # fmt: skip
    return triggers


def render_scaled_object(
    ld: api.LLMDeployment, *, prometheus_url: str = DEFAULT_PROMETHEUS_URL, activator_url: str | None = None
) -> dict[str, Any] | None:
    """The keda.sh/v1alpha1 ScaledObject (backend keda), or None when the spec needs none.

    A Prometheus trigger on the summed queue depth with metricType AverageValue and threshold
    targetQueueDepth, i.e. the same per-pod target as the HPA backend. With minReplicas 0, triggers that say
    whether any request is in flight (:func:`_activity_triggers`) and cooldownPeriod from
    scaleToZeroAfterSeconds; ``activator_url`` is the activator's admin base URL, None without an activator.
    """
    validate(ld)
    autoscaling = ld.spec.autoscaling
    if not autoscaling.enabled or autoscaling.backend != "keda":
        return None
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": child_metadata(ld),
        "spec": {
            "scaleTargetRef": _scale_target(ld),
            "minReplicaCount": autoscaling.min_replicas,
            "maxReplicaCount": autoscaling.max_replicas,
            "pollingInterval": KEDA_POLLING_INTERVAL_SECONDS,
            # Only used for the last step to zero (minReplicaCount 0): idle this long, every trigger inactive.
            "cooldownPeriod": activation.idle_seconds(ld),
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(autoscaling)}},
            "triggers": [
                {
                    "type": "prometheus",
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": prometheus_url,
                        "query": queue_depth_query(ld),
                        "threshold": str(autoscaling.target_queue_depth),
                    },
                },
                *_activity_triggers(ld, prometheus_url, activator_url),
            ],
        },
    }


# --------------------------------------------------------------------------------------------------
# ServiceMonitor
# --------------------------------------------------------------------------------------------------


def wants_service_monitor(ld: api.LLMDeployment, service_monitor_available: bool) -> bool:
    mode = ld.spec.monitoring.service_monitor
    return mode == "Enabled" or (mode == "Auto" and service_monitor_available)


def render_service_monitor(
    ld: api.LLMDeployment, *, service_monitor_available: bool = False
) -> dict[str, Any] | None:
    """The monitoring.coreos.com/v1 ServiceMonitor scraping /metrics, or None when monitoring asks for none
    (Disabled, or Auto without the CRD). It copies the pod label kubellm.io/llmdeployment onto the series."""
    validate(ld)
    if not wants_service_monitor(ld, service_monitor_available):
        return None
    spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(ld)},
        "endpoints": [
            {
                "port": PORT_NAME,
                "path": "/metrics",
                "interval": SCRAPE_INTERVAL,
                "scrapeTimeout": SCRAPE_TIMEOUT,
            }
        ],
        "podTargetLabels": [LABEL_LLMDEPLOYMENT],
    }
    if ld.namespace:
        spec["namespaceSelector"] = {"matchNames": [ld.namespace]}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": child_metadata(ld),
        "spec": spec,
    }


# --------------------------------------------------------------------------------------------------
# InferencePool (Gateway API Inference Extension)
# --------------------------------------------------------------------------------------------------


def render_inference_pool(ld: api.LLMDeployment) -> dict[str, Any] | None:
    """The inference.networking.k8s.io/v1 InferencePool of the serving pods, or None unless
    gateway.inferencePool.enabled.

    It selects the pods the Service selects and targets the runtime's port, where the endpoint picker
    also scrapes /metrics (docs/gateway.md maps the metric names it reads). v1, not v1alpha2
    (inference.networking.x-k8s.io): v1 is the API every conformant gateway serves since the extension's
    v1.0, and v1alpha2 is deprecated and gone from its CRDs.
    """
    validate(ld)
    pool = ld.spec.gateway.inference_pool
    if not pool.enabled:
        return None
    spec: dict[str, Any] = {
        "selector": {"matchLabels": serving_selector(ld)},
        "targetPorts": [{"number": api.RUNTIME_PORT}],
        "appProtocol": "http",
    }
    if pool.endpoint_picker_ref is not None:
        epp = pool.endpoint_picker_ref
        spec["endpointPickerRef"] = {
            "group": "",
            "kind": "Service",
            "name": epp.name,
            "port": {"number": epp.port},
            "failureMode": epp.failure_mode,
        }
    return {
        "apiVersion": INFERENCE_POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": child_metadata(ld),
        "spec": spec,
    }


# --------------------------------------------------------------------------------------------------
# Everything
# --------------------------------------------------------------------------------------------------


def render(
    ld: api.LLMDeployment,
    *,
    service_monitor_available: bool = False,
    prometheus_url: str = DEFAULT_PROMETHEUS_URL,
    replace_in_place: str | None = None,
    activator_url: str | None = None,
) -> list[dict[str, Any]]:
    """Every child manifest of ``ld``, in apply order. Pure: same input, same output; ``ld`` is not changed.

    ``service_monitor_available``: whether the monitoring.coreos.com ServiceMonitor CRD is installed (for
    monitoring.serviceMonitor Auto). ``prometheus_url``: the Prometheus the KEDA trigger queries.
    ``replace_in_place``: the rollout guard's decision (:func:`render_deployment`).
    ``activator_url``: the activator's admin base URL (its activity counts feed KEDA), None without one.
    The activator's EndpointSlice depends on observed state and is not among these
    (:func:`.activation.render_routing`). Raises :class:`InvalidSpec` when the spec cannot be rendered.
    """
    validate(ld)
    children = [
        render_service(ld),
        activation.render_pods_service(ld),
        render_workload(ld, replace_in_place=replace_in_place),
        render_pdb(ld),
        render_hpa(ld),
        render_scaled_object(ld, prometheus_url=prometheus_url, activator_url=activator_url),
        render_service_monitor(ld, service_monitor_available=service_monitor_available),
        alerts.render_prometheus_rule(ld),
        render_inference_pool(ld),
    ]
    return [c for c in children if c is not None]


@functools.cache
def _crd_schema() -> dict[str, Any]:
    return crd.crd_schema()  # read-only here: apply_defaults copies the defaults it inserts


def load(obj: dict[str, Any]) -> api.LLMDeployment:
    """An LLMDeployment from a manifest, with the CRD's defaults applied the way the API server applies them
    (``obj`` is not changed). Raises :class:`InvalidSpec` when it is not a valid LLMDeployment."""
    if not isinstance(obj, dict):
        raise InvalidSpec(f"expected a mapping, got {type(obj).__name__}")
    if obj.get("apiVersion") != api.API_VERSION or obj.get("kind") != api.KIND:
        raise InvalidSpec(
            f"expected apiVersion {api.API_VERSION} kind {api.KIND}, got apiVersion {obj.get('apiVersion')} "
            f"kind {obj.get('kind')}"
        )
    doc = crd.apply_defaults(_crd_schema(), copy.deepcopy(obj))
    try:
        return api.LLMDeployment.model_validate(doc)
    except ValidationError as e:
        raise InvalidSpec(_format_validation_error(e, "")) from None


def to_yaml(manifests: Iterable[dict[str, Any]]) -> str:
    """Multi-document YAML, every document starting with ``---``."""
    return "".join(
        "---\n"
        + yaml.safe_dump(m, sort_keys=False, width=2**16, allow_unicode=True, default_flow_style=False)
        for m in manifests
    )


def main(argv: list[str] | None = None) -> int:
    """``kubellm render -f FILE``: print the objects the operator would create, as multi-document YAML."""
    parser = argparse.ArgumentParser(
        prog="kubellm render",
        description="Print the Kubernetes objects the operator creates for LLMDeployments (multi-document "
        "YAML), with the CRD's defaults applied. Children get no ownerReferences when the input has no "
        "metadata.uid (files do not).",
    )
    parser.add_argument(
        "-f", "--filename", action="append", required=True,
        help="YAML file with one or more LLMDeployment documents, - for stdin; repeatable",
    )  # fmt: skip
    parser.add_argument(
        "-n", "--namespace",
        help="namespace of LLMDeployments that name none (default: default); one that names another is an error",
    )  # fmt: skip
    parser.add_argument(
        "--service-monitor-available", action="store_true",
        help="render ServiceMonitors for monitoring.serviceMonitor Auto, as if the CRD were installed",
    )  # fmt: skip
    parser.add_argument(
        "--prometheus-url", default=DEFAULT_PROMETHEUS_URL,
        help=f"Prometheus the KEDA trigger queries (default {DEFAULT_PROMETHEUS_URL})",
    )  # fmt: skip
    parser.add_argument(
        "--activator-url", default=None,
        help="the activator's admin base URL, as the operator's --activator-url (the chart's: "
        "http://kubellm-activator.kubellm-system.svc:9090); scale-to-zero ScaledObjects poll it (default: none)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    out: list[dict[str, Any]] = []
    for filename in args.filename:
        try:
            text = sys.stdin.read() if filename == "-" else Path(filename).read_text()
            docs = list(yaml.safe_load_all(text))
        except (OSError, yaml.YAMLError) as e:
            print(f"kubellm render: {filename}: {e}", file=sys.stderr)
            return 2
        for index, doc in enumerate(docs, start=1):
            if doc is None:
                continue
            where = f"{filename}: document {index}"
            try:
                if isinstance(doc, dict):
                    meta = doc.setdefault("metadata", {}) or {}
                    doc["metadata"] = meta
                    where += f" ({meta.get('name')})" if meta.get("name") else ""
                    if args.namespace and meta.get("namespace") not in (None, args.namespace):
                        raise InvalidSpec(
                            f"metadata.namespace {meta['namespace']} does not match --namespace {args.namespace}"
                        )
                    meta.setdefault("namespace", args.namespace or "default")
                ld = load(doc)
                out += render(
                    ld,
                    service_monitor_available=args.service_monitor_available,
                    prometheus_url=args.prometheus_url,
                    activator_url=args.activator_url,
                )
            except InvalidSpec as e:
                print(f"kubellm render: {where}: {e}", file=sys.stderr)
                return 2
    sys.stdout.write(to_yaml(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
