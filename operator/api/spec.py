"""The LLMDeployment spec: what a user writes, its defaults and its rules (``k8s_rules`` on each model).

The engine settings (``spec.dtype``, ``spec.quantization``, ``spec.engine.*``) are derived from the runtime's
settings table (:mod:`kubellm.runtime.engine.settings`). A few checks CEL cannot express are Python-only
(:func:`_python_only_checks`); :func:`validate_update` runs the transition rules an update must pass.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import Field, create_model, model_validator

from kubellm.operator.api.fields import FreeForm, IntOrPercent, Quantity, parse_quantity
from kubellm.operator.api.rules import KubeModel, Rule, nested, raise_violations
from kubellm.runtime.engine import settings as engine_settings
from kubellm.runtime.engine.settings import ENGINE_SETTINGS, EngineSetting, setting

# The runtime image a spec gets when it names none. Keep RUNTIME_VERSION equal to the project version
# (tests/operator/test_api.py checks it); changing it changes the CRD default, so regenerate the CRD.
RUNTIME_VERSION = "0.1.0"
DEFAULT_IMAGE = f"ghcr.io/kubellm/runtime:{RUNTIME_VERSION}"
RUNTIME_PORT = 8000  # the container port `kubellm serve` listens on; spec.service.port maps to it
DEFAULT_RENDEZVOUS_PORT = 29500  # spec.parallelism.rendezvousPort: torch.distributed's usual MASTER_PORT
# The runtime's deadline for the readiness probe's generation (ServerOptions.probe_timeout).
RUNTIME_PROBE_DEADLINE_SECONDS = 10
QUEUE_DEPTH_METRIC = "kubellm:num_requests_waiting"  # per-pod gauge the autoscalers target
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"  # node label spec.resources.gpu.product selects on
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
QUANTIZATIONS = engine_settings.QUANTIZATIONS  # spec.quantization's choices


# hf://org/name | pvc://claim[/path] | file:///abs/path | a known model name (smollm2). No backslashes,
# so the same text is a valid CEL string literal and a Python regex.
MODEL_URI_PATTERN = (
    "^(hf://[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*"
    "|pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/.*)?"
    "|file:///.+"
    "|[a-z0-9][-a-z0-9_.]*)$"
)
MODEL_URI_MESSAGE = (
    "model.uri must be hf://<org>/<name>, pvc://<claim>/<path>, file:///<absolute path> "
    "or a known model name such as smollm2"
)


def model_source_rules(field: str) -> tuple[Rule, ...]:
    """The uri form and the hf://-only revision, for a model source named ``field`` in messages (the served
    model and a speculative draft are fetched the same way)."""
    return (
        Rule(
            rule=f"self.uri.matches('{MODEL_URI_PATTERN}')",
            message=field + MODEL_URI_MESSAGE.removeprefix("model"),
            check=lambda s: re.fullmatch(MODEL_URI_PATTERN, s.uri) is not None,
            field_path=".uri",
        ),
        Rule(
            rule="!has(self.revision) || self.uri.startsWith('hf://')",
            message=f"{field}.revision applies to hf:// models only",
            check=lambda s: s.revision is None or s.uri.startswith("hf://"),
            field_path=".revision",
        ),
    )


def default_served_model_name(uri: str) -> str:
    """The name clients pass as ``model`` when ``servedModelName`` is unset.

    ``hf://org/name`` → ``org/name`` (what vLLM serves it as); ``pvc://claim/dir/llama.gguf`` and
    ``file:///models/llama.gguf`` → the last path element without ``.gguf`` (``llama``), or the claim
    name for a bare ``pvc://claim``; a known model name → itself.
    """
    if uri.startswith("hf://"):
        return uri.removeprefix("hf://")
    for scheme in ("pvc://", "file://"):
        if uri.startswith(scheme):
            parts = [p for p in uri.removeprefix(scheme).split("/") if p]
            last = parts[-1] if parts else uri.removeprefix(scheme)
            return last.removesuffix(".gguf")
    return uri


def _setting_field(s: EngineSetting) -> tuple[Any, Any]:
    """The annotation and pydantic Field of the spec field an engine setting declares (its CRD schema)."""
    annotation: Any = Literal[s.api_choices] if s.api_choices else s.type
    if s.default is None:
        annotation = annotation | None
    return annotation, Field(default=s.default, ge=s.ge, gt=s.gt, le=s.le, description=s.doc)


Dtype = _setting_field(setting("dtype"))[0]
Quantization = _setting_field(setting("quantization"))[0]


class ModelSpec(KubeModel):
    """The model to serve."""

    uri: str = Field(min_length=1, max_length=2048)
    """Where the weights come from: hf://<org>/<name> (a Hugging Face repository, downloaded at pod start),
    pvc://<claim>/<path> (a Hugging Face folder or .gguf file on a PersistentVolumeClaim, mounted read-only),
    file:///<absolute path> (already in the image or on the node), or a known model name such as smollm2
    (pulled by the runtime)."""

    revision: str | None = Field(default=None, min_length=1, max_length=256)
    """Hugging Face revision (branch, tag or commit) for hf:// models. Default: the repository's default branch."""

    served_model_name: str | None = Field(default=None, min_length=1, max_length=256)
    """The name clients pass as "model" in OpenAI requests. Default: derived from the uri (hf://org/name is
    served as org/name, a file or PVC path as its last element without .gguf, a known model as its name)."""

    k8s_rules: ClassVar[tuple[Rule, ...]] = model_source_rules("model")

    @property
    def effective_served_model_name(self) -> str:
        return self.served_model_name or default_served_model_name(self.uri)


class ParallelismSpec(KubeModel):
    """How the model is sharded across GPUs and pods."""

    tensor: int = _setting_field(setting("tensor_parallel_size"))[1]

    nodes: int = _setting_field(setting("nnodes"))[1]

    rendezvous_port: int = Field(default=DEFAULT_RENDEZVOUS_PORT, ge=1, le=65535)
    """With nodes above 1: the port on the leader pod where the ranks of a group meet (a TCP store); the
    worker pods connect to it at the leader's stable DNS name. Must differ from the API port 8000."""

    k8s_rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            rule="self.tensor % self.nodes == 0",
            message="parallelism.tensor must be a multiple of parallelism.nodes: every pod of a group holds the "
            "same number of tensor-parallel ranks",
            message_expression="'parallelism.tensor ' + string(self.tensor) + ' must be a multiple of "
            "parallelism.nodes ' + string(self.nodes) + ': every pod of a group holds the same number of "
            "tensor-parallel ranks'",
            check=lambda s: s.tensor % s.nodes == 0,
            explain=lambda s: (
                f"parallelism.tensor {s.tensor} must be a multiple of parallelism.nodes {s.nodes}: every pod of "
                "a group holds the same number of tensor-parallel ranks"
            ),
            field_path=".tensor",
        ),
        Rule(
            rule=f"self.rendezvousPort != {RUNTIME_PORT}",
            message=f"parallelism.rendezvousPort must differ from the runtime's API port {RUNTIME_PORT}",
            check=lambda s: s.rendezvous_port != RUNTIME_PORT,
            field_path=".rendezvousPort",
        ),
    )

    @property
    def ranks_per_node(self) -> int:
        """Tensor-parallel ranks in each pod of a group (EngineConfig.ranks_per_node)."""
        return self.tensor // self.nodes


class DraftModelSpec(KubeModel):
    """A draft model for speculative decoding: a smaller model with the served model's tokenizer (the runtime
    refuses another tokenizer at start-up), e.g. Qwen2.5-0.5B-Instruct drafting for Qwen2.5-7B-Instruct; with
    engine.speculative.method eagle, an EAGLE-1 head trained for the served model (e.g.
    yuhuili/EAGLE-LLaMA3-Instruct-8B for Meta-Llama-3-8B-Instruct; the runtime refuses one of another shape)."""

    uri: str = Field(min_length=1, max_length=2048)
    """Where the draft's weights come from, in the forms of model.uri: hf://<org>/<name> (downloaded at pod
    start), pvc://<claim>/<path> (mounted read-only), file:///<absolute path> or a known model name."""

    revision: str | None = Field(default=None, min_length=1, max_length=256)
    """Hugging Face revision (branch, tag or commit) for an hf:// draft. Default: the repository's default branch."""

    k8s_rules: ClassVar[tuple[Rule, ...]] = model_source_rules("engine.speculative.model")


class _SpeculativeBase(KubeModel):
    k8s_rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            rule="self.ngram == 0 || !has(self.model)",
            message="engine.speculative takes one proposer: set ngram (prompt lookup) or model (a draft model), "
            "not both",
            check=lambda s: s.ngram == 0 or s.model is None,
            field_path=".model",
        ),
        Rule(
            rule="self.method != 'eagle' || has(self.model)",
            message="engine.speculative.method eagle drafts with an EAGLE head: set engine.speculative.model to "
            "the head's uri",
            check=lambda s: s.method != "eagle" or s.model is not None,
            field_path=".method",
        ),
    )


# Objects inside spec.engine that group engine settings (crd_field engine.<group>.<name>).
_SETTING_GROUPS = {
    "engine": "Runtime engine settings (the flags of `kubellm serve`).",
    "engine.speculative": "Speculative decoding: tokens drafted cheaply and verified together (off by default). "
    "Drafts come from prompt lookup (ngram) or from model: a draft model, or an EAGLE-1 head with method eagle; "
    "not both.",
    "engine.cuda_graphs": "CUDA graphs for decode steps (GPUs only; on by default).",
}
# Group fields that are no engine setting, appended after the settings', and the group's own base (its rules).
_GROUP_FIELDS: dict[str, dict[str, Any]] = {
    "engine.speculative": {
        "model": (DraftModelSpec | None, Field(default=None, description=(
            "A draft model (or, with method eagle, an EAGLE-1 head) that proposes numTokens tokens per step, "
            "verified in one forward pass of the served model: greedy output is unchanged, sampled output keeps "
            "its distribution. Fetched like spec.model (an init container for hf:// and known names). Not with "
            "ngram, nor with parallelism.tensor > 1."))),
    },
}
_GROUP_BASES: dict[str, type[KubeModel]] = {"engine.speculative": _SpeculativeBase}


def _settings_model(path: str) -> type[KubeModel]:
    """The spec model at ``path`` (``engine``, ``engine.speculative``): one field per engine setting whose
    crd_field is ``<path>.<name>`` and one nested object per group below it, in the table's order."""
    fields: dict[str, Any] = {}
    for s in ENGINE_SETTINGS:
        if not (s.crd_field and s.crd_field.startswith(path + ".")):
            continue
        head, _, rest = s.crd_field.removeprefix(path + ".").partition(".")
        if not rest:
            fields[head] = _setting_field(s)
        elif head not in fields:
            sub = _settings_model(f"{path}.{head}")
            fields[head] = (sub, Field(default_factory=sub, json_schema_extra={"default": {}},
                                       description=_SETTING_GROUPS[f"{path}.{head}"]))
    fields.update(_GROUP_FIELDS.get(path, {}))
    name = "".join(part.capitalize() for part in path.split(".")[1:]) + "Spec" if "." in path else "EngineSpec"
    return create_model(name, __base__=_GROUP_BASES.get(path, KubeModel), __doc__=_SETTING_GROUPS[path],
                        __module__=__name__, **fields)


# spec.engine: one field per engine setting whose crd_field is engine.<name>, in the table's order.
EngineSpec = _settings_model("engine")
SpeculativeSpec = EngineSpec.model_fields["speculative"].annotation  # spec.engine.speculative, generated


class GPUSpec(KubeModel):
    """GPUs per pod."""

    count: int | None = Field(default=None, ge=0)
    """GPUs per pod. 0 runs on CPU. Default (omitted): the tensor-parallel ranks in each pod, i.e. one GPU per
    shard (parallelism.tensor / parallelism.nodes). When set above 0 it must be a multiple of that."""

    resource_name: str = Field(default=DEFAULT_GPU_RESOURCE, min_length=1, max_length=253)
    """The extended resource the pod requests, e.g. nvidia.com/gpu or amd.com/gpu."""

    product: str | None = Field(default=None, min_length=1, max_length=63)
    """Restrict pods to nodes with this GPU model, e.g. NVIDIA-A100-SXM4-80GB: becomes the node selector
    nvidia.com/gpu.product=<product> (the label NVIDIA GPU feature discovery sets)."""

    k8s_rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            rule="!has(self.product) || !has(self.count) || self.count > 0",
            message="resources.gpu.product selects GPU nodes, so it needs resources.gpu.count > 0",
            check=lambda s: s.product is None or s.count is None or s.count > 0,
            field_path=".product",
        ),
    )


class ResourceLimits(KubeModel):
    """Limits that differ from the requests."""

    cpu: Quantity | None = None
    """CPU limit. Default: equal to resources.cpu."""

    memory: Quantity | None = None
    """Memory limit. Default: equal to resources.memory."""


class ResourcesSpec(KubeModel):
    """Compute resources of each pod. CPU and memory are requests; the limits equal the requests (Guaranteed
    QoS, predictable out-of-memory behaviour) unless resources.limits says otherwise. GPUs are always
    requested and limited alike."""

    gpu: GPUSpec = nested(GPUSpec)
    """GPUs per pod."""

    cpu: Quantity | None = None
    """CPU request (and limit unless limits.cpu is set), e.g. 4 or 500m. Default: none."""

    memory: Quantity | None = None
    """Memory request (and limit unless limits.memory is set), e.g. 32Gi. Default: none."""

    limits: ResourceLimits | None = None
    """Limits that differ from the requests, e.g. a higher CPU limit to allow bursts."""


class AutoscalingSpec(KubeModel):
    """Queue-depth autoscaling. When enabled, the HPA (or KEDA ScaledObject) scales the child Deployment
    directly and the operator stops applying spec.replicas, so leave replicas out of your manifests (GitOps
    tools then never fight it). A change to spec.replicas made while autoscaling is enabled (kubectl scale, a
    manifest) must stay within [minReplicas, maxReplicas]; an unchanged value is always accepted, so you can
    edit the range freely."""

    enabled: bool = False
    """Scale on the runtime's per-pod queue depth (the kubellm:num_requests_waiting gauge)."""

    min_replicas: int = Field(default=1, ge=0)
    """Fewest replicas. 0 (scale to zero) needs backend keda."""

    max_replicas: int = Field(default=4, ge=1)
    """Most replicas."""

    target_queue_depth: int = Field(default=4, ge=1)
    """Requests waiting per pod (average) the autoscaler aims for."""

    scale_up_stabilization_seconds: int = Field(default=0, ge=0, le=3600)
    """Window of recommendations considered before scaling up (0: scale up at once)."""

    scale_down_stabilization_seconds: int = Field(default=300, ge=0, le=3600)
    """Window of recommendations considered before scaling down; keeps loaded models around through dips."""

    backend: Literal["hpa", "keda"] = "hpa"
    """hpa: a HorizontalPodAutoscaler on a Pods metric (needs a custom-metrics adapter such as
    prometheus-adapter); keda: a KEDA ScaledObject with a Prometheus trigger (supports scale to zero)."""

    scale_to_zero_after_seconds: int | None = Field(default=None, ge=60, le=86400)
    """With minReplicas 0: seconds without any request (none running or waiting in a pod, none held or
    forwarded by the activator) before the last pod goes (KEDA's cooldownPeriod). Default:
    scaleDownStabilizationSeconds. At least 60, so that a request the activator just forwarded shows up in
    the pods' metrics before it counts as idle."""

    k8s_rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            rule="self.minReplicas <= self.maxReplicas",
            message="autoscaling.minReplicas must be <= autoscaling.maxReplicas",
            check=lambda s: s.min_replicas <= s.max_replicas,
            field_path=".minReplicas",
        ),
        Rule(
            rule="self.minReplicas >= 1 || self.backend == 'keda'",
            message="autoscaling.minReplicas 0 (scale to zero) needs backend keda; the HPA cannot scale to zero",
            check=lambda s: s.min_replicas >= 1 or s.backend == "keda",
            field_path=".minReplicas",
        ),
        Rule(
            rule="!has(self.scaleToZeroAfterSeconds) || self.minReplicas == 0",
            message="autoscaling.scaleToZeroAfterSeconds needs minReplicas 0: it is the idle time before the last "
            "pod goes",
            check=lambda s: s.scale_to_zero_after_seconds is None or s.min_replicas == 0,
            field_path=".scaleToZeroAfterSeconds",
        ),
    )


class RolloutSpec(KubeModel):
    """How pods are replaced when the spec changes."""

    max_surge: IntOrPercent = 1
    """Pods above the desired count during a rollout (a number or a percentage such as 25%). Surge pods need
    their own GPUs."""

    max_unavailable: IntOrPercent = 0
    """Pods below the desired count during a rollout (a number or a percentage). 0 keeps full capacity."""

    drain_timeout_seconds: int = Field(default=30, ge=0, le=3600)
    """How long a terminating pod keeps serving in-flight requests before aborting them."""

    surge_timeout_seconds: int = Field(default=300, ge=0, le=86400)
    """How long a pod of the new revision may stay unschedulable for want of a GPU (the scheduler's
    "Insufficient <resources.gpu.resourceName>") before the rollout counts as blocked: no node has a spare
    GPU for the surge pod. Blocked rollouts are reported as Progressing=False, reason
    RolloutBlockedNoSpareGPU, and handled as onNoSpareGPU says. Applies to single-node replicas
    (parallelism.nodes 1); multi-node groups roll out as their LeaderWorkerSet decides."""

    on_no_spare_gpu: Literal["Wait", "ReplaceInPlace"] = Field(default="Wait", alias="onNoSpareGPU")
    """What a blocked rollout does. Wait: keep waiting for a GPU to free up (the rollout is reported Stalled
    until one does). ReplaceInPlace: switch this rollout to maxSurge 0 (maxUnavailable stays as set, 1 when
    it is 0), so an old pod is removed before its replacement starts, one GPU set at a time; capacity drops
    by those pods meanwhile. The spec's strategy is restored when the rollout completes."""

    k8s_rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            rule="!(string(self.maxSurge) in ['0', '0%'] && string(self.maxUnavailable) in ['0', '0%'])",
            message="rollout.maxSurge and rollout.maxUnavailable cannot both be 0: the rollout could never "
            "replace a pod",
            check=lambda s: not (str(s.max_surge) in ("0", "0%") and str(s.max_unavailable) in ("0", "0%")),
            field_path=".maxSurge",
        ),
    )


class ProbesSpec(KubeModel):
    """Health probes. Readiness runs a real one-token generation through the runtime."""

    startup_timeout_seconds: int = Field(default=600, ge=1)
    """Time a pod gets to download and load the model before it is restarted."""

    readiness_period_seconds: int = Field(default=10, ge=1)
    """How often readiness is probed."""

    readiness_timeout_seconds: int = Field(default=15, ge=RUNTIME_PROBE_DEADLINE_SECONDS + 1)
    """Readiness probe timeout. Must exceed the runtime's own 10 s deadline for the probe generation, so
    a slow-but-healthy answer is not cut off by the kubelet."""


class Toleration(KubeModel):
    """A core/v1 Toleration."""

    key: str | None = Field(default=None, max_length=316)
    """Taint key the toleration applies to; empty matches all keys (then operator must be Exists)."""

    operator: Literal["Exists", "Equal"] | None = None
    """Exists or Equal (default Equal)."""

    value: str | None = Field(default=None, max_length=63)
    """Taint value to match (Equal only)."""

    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match; empty matches all effects."""

    toleration_seconds: int | None = None
    """How long a NoExecute taint is tolerated before eviction; unset tolerates it forever."""

    k8s_rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            rule="!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
            message="a toleration with operator Exists must not set value",
            check=lambda s: s.operator != "Exists" or not s.value,
            field_path=".value",
        ),
        Rule(
            rule="(has(self.key) && self.key != '') || (has(self.operator) && self.operator == 'Exists')",
            message="a toleration without key must use operator Exists",
            check=lambda s: bool(s.key) or s.operator == "Exists",
            field_path=".operator",
        ),
        Rule(
            rule="!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
            message="tolerationSeconds applies to effect NoExecute only",
            check=lambda s: s.toleration_seconds is None or s.effect == "NoExecute",
            field_path=".tolerationSeconds",
        ),
    )


class EnvVar(KubeModel):
    """An environment variable of the runtime container (core/v1 EnvVar)."""

    name: str = Field(min_length=1, max_length=256)
    """Variable name."""

    value: str | None = None
    """Literal value."""

    value_from: FreeForm | None = None
    """A core/v1 EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef), kept verbatim."""

    k8s_rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            rule="!(has(self.value) && has(self.valueFrom))",
            message="env: set value or valueFrom, not both",
            check=lambda s: s.value is None or s.value_from is None,
            field_path=".valueFrom",
        ),
    )


class SecretKeyRef(KubeModel):
    """A key of a Secret in the LLMDeployment's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    """Secret name."""

    key: str = Field(default="api-key", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")
    """Key within the Secret. Its value is one API key, or several separated by commas (to rotate: add the
    new key, restart the pods, move clients, drop the old key, restart again)."""


class AuthSpec(KubeModel):
    """Who may call the OpenAI API (/v1/*). Health probes and /metrics stay open for the kubelet and
    Prometheus."""

    api_key_secret_ref: SecretKeyRef | None = None
    """Require `Authorization: Bearer <key>` with a key from this Secret (rendered into the runtime's
    KUBELLM_API_KEY). Unset: no key is required. The pods do not start (CreateContainerConfigError) until the
    Secret and key exist. Pods read the key at start-up: after changing the Secret, restart them
    (`kubectl rollout restart deployment/<name>`)."""


class ServiceSpec(KubeModel):
    """The Service in front of the pods (OpenAI-compatible HTTP API)."""

    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    """Service type."""

    port: int = Field(default=80, ge=1, le=65535)
    """Service port; it forwards to the runtime's container port 8000."""


# A Prometheus duration ("90s", "10m", "1h30m"), the form a PrometheusRule's `for` takes.
PROMETHEUS_DURATION_PATTERN = r"^([0-9]+(ms|s|m|h|d|w|y))+$"


class AlertsSpec(KubeModel):
    """A PrometheusRule (monitoring.coreos.com/v1, named like the LLMDeployment) with alerts on this
    LLMDeployment alone: no ready replicas, pods failing readiness, queue above target at maxReplicas, KV cache
    full with preemptions, TTFT p99 above an SLO, refused requests, failing reconciles. Needs the Prometheus
    operator's CRDs and the chart's rbac.prometheusRules; docs/operations.md lists the alerts."""

    enabled: bool = False
    """Create the PrometheusRule."""

    ttft_p99_seconds_slo: float | None = Field(default=None, gt=0, le=3600, alias="ttftP99SecondsSLO")
    """Time to first token, in seconds, that the 99th percentile must stay under (KubellmSlowFirstToken fires
    after 15 minutes above it). Unset: no TTFT alert."""

    error_ratio: float = Field(default=0.05, gt=0, le=1)
    """Share of requests refused with 429 (queue_full, kv_cache_full) above which KubellmShedding fires
    after 10 minutes."""

    kv_cache_usage: float = Field(default=0.95, gt=0, le=1)
    """KV-cache usage (0-1) above which, with sequences being preempted, KubellmKVCacheSaturated fires."""

    queue_at_max_for: str = Field(default="10m", max_length=32, pattern=PROMETHEUS_DURATION_PATTERN)
    """How long the queue per pod may stay above autoscaling.targetQueueDepth at maxReplicas before
    KubellmQueueAboveTargetAtMaxReplicas fires (a Prometheus duration such as 10m). Only with autoscaling."""

    labels: dict[str, str] | None = Field(default=None, json_schema_extra={"maxProperties": 16})
    """Labels added to every alert for Alertmanager's routing, e.g. {team: ml, severity: page} (severity here
    replaces each alert's own warning or critical)."""

    k8s_rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            # Prometheus label names, less the reserved __ prefix; alertname is the alert's own name.
            rule="!has(self.labels) || self.labels.all(k, k.matches('^[a-zA-Z_][a-zA-Z0-9_]*$') "
            "&& !k.startsWith('__') && k != 'alertname')",
            message="monitoring.alerts.labels: names must be Prometheus label names ([a-zA-Z_][a-zA-Z0-9_]*), "
            "not start with __ and not be alertname",
            check=lambda s: all(
                re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", k) and not k.startswith("__") and k != "alertname"
                for k in s.labels or ()
            ),
            field_path=".labels",
        ),
    )


class MonitoringSpec(KubeModel):
    """Prometheus integration."""

    service_monitor: Literal["Auto", "Enabled", "Disabled"] = "Auto"
    """Auto: create a ServiceMonitor when the monitoring.coreos.com CRDs are installed; Enabled: always
    (fail visibly without them); Disabled: never."""

    alerts: AlertsSpec = nested(AlertsSpec)
    """Prometheus alerts on this LLMDeployment (a PrometheusRule)."""


EPP_GRPC_PORT = 9002  # the endpoint picker's ext-proc gRPC port (the upstream EPP's default)


class EndpointPickerRef(KubeModel):
    """The endpoint picker (EPP) the gateway asks which pod takes each request: a Service in the
    LLMDeployment's namespace serving Envoy's external-processing gRPC protocol, e.g. the EPP of the
    llm-d inference scheduler (docs/gateway.md)."""

    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    """Name of the EPP's Service."""

    port: int = Field(default=EPP_GRPC_PORT, ge=1, le=65535)
    """Service port of the EPP's gRPC ext-proc endpoint."""

    failure_mode: Literal["FailOpen", "FailClose"] = "FailClose"
    """What the gateway does when the EPP does not answer: FailClose refuses the request, FailOpen sends it to
    a pod of the gateway's choosing."""


class InferencePoolSpec(KubeModel):
    """An InferencePool (inference.networking.k8s.io/v1, Gateway API Inference Extension) of the serving
    pods, for an HTTPRoute to use as its backend instead of the Service."""

    enabled: bool = False
    """Create the InferencePool (named like the LLMDeployment; its CRD must be installed)."""

    endpoint_picker_ref: EndpointPickerRef | None = None
    """The endpoint picker of the pool. Most gateways refuse a pool without one (Accepted=False,
    EndpointPickerRefMissing)."""


class GatewaySpec(KubeModel):
    """Gateway API integration."""

    inference_pool: InferencePoolSpec = nested(InferencePoolSpec)
    """Model-aware load balancing through the Gateway API Inference Extension."""


class LLMDeploymentSpec(KubeModel):
    """The desired state of an LLMDeployment."""

    model: ModelSpec
    """The model to serve (required)."""

    dtype: Dtype = _setting_field(setting("dtype"))[1]

    quantization: Quantization = _setting_field(setting("quantization"))[1]

    parallelism: ParallelismSpec = nested(ParallelismSpec)
    """Model sharding."""

    engine: EngineSpec = nested(EngineSpec)
    """Engine settings."""

    resources: ResourcesSpec = nested(ResourcesSpec)
    """Compute resources of each pod."""

    replicas: int = Field(default=1, ge=0)
    """Pods serving the model (the scale subresource's spec.replicas). With autoscaling enabled the
    autoscaler sizes the Deployment and this field is not applied; leave it out of manifests then."""

    autoscaling: AutoscalingSpec = nested(AutoscalingSpec)
    """Queue-depth autoscaling."""

    rollout: RolloutSpec = nested(RolloutSpec)
    """Rolling update behaviour."""

    probes: ProbesSpec = nested(ProbesSpec)
    """Startup and readiness probing."""

    image: str = Field(default=DEFAULT_IMAGE, min_length=1, max_length=1024)
    """Runtime container image."""

    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Image pull policy of the runtime container."""

    node_selector: dict[str, str] | None = None
    """Extra node selector labels (merged with the GPU product selector)."""

    tolerations: list[Toleration] | None = Field(
        default=None, max_length=64, json_schema_extra={"x-kubernetes-list-type": "atomic"}
    )
    """Pod tolerations (core/v1 Toleration), e.g. for tainted GPU nodes."""

    affinity: FreeForm | None = None
    """Pod affinity (core/v1 Affinity), kept verbatim."""

    priority_class_name: str | None = Field(default=None, min_length=1, max_length=253)
    """PriorityClass of the pods."""

    env: list[EnvVar] | None = Field(
        default=None,
        max_length=256,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    """Extra environment variables of the runtime container (unique names), e.g. HF_TOKEN from a Secret."""

    pod_labels: dict[str, str] | None = None
    """Extra labels on the pods."""

    pod_annotations: dict[str, str] | None = None
    """Extra annotations on the pods."""

    service: ServiceSpec = nested(ServiceSpec)
    """The Service in front of the pods."""

    auth: AuthSpec = nested(AuthSpec)
    """API keys for the OpenAI API."""

    monitoring: MonitoringSpec = nested(MonitoringSpec)
    """Prometheus integration."""

    gateway: GatewaySpec = nested(GatewaySpec)
    """Gateway API integration (InferencePool)."""

    k8s_rules: ClassVar[tuple[Rule, ...]] = (
        # Both count the ranks in one pod: tensor / nodes. The divisibility guard keeps CEL from dividing by 0
        # (tensor < nodes); the rule on parallelism reports that case.
        Rule(
            rule="self.parallelism.tensor % self.parallelism.nodes != 0 || !has(self.resources.gpu.count) "
            "|| self.resources.gpu.count == 0 "
            "|| self.resources.gpu.count % (self.parallelism.tensor / self.parallelism.nodes) == 0",
            message="resources.gpu.count must be 0 (CPU) or a multiple of the ranks in each pod, parallelism.tensor "
            "/ parallelism.nodes; omit it to get that many GPUs",
            check=lambda s: (
                s.parallelism.tensor % s.parallelism.nodes != 0
                or s.resources.gpu.count in (None, 0)
                or s.resources.gpu.count % s.parallelism.ranks_per_node == 0
            ),
            field_path=".resources.gpu.count",
        ),
        Rule(
            rule="self.parallelism.tensor % self.parallelism.nodes != 0 "
            "|| self.parallelism.tensor / self.parallelism.nodes == 1 || !has(self.resources.gpu.count) "
            "|| self.resources.gpu.count >= self.parallelism.tensor / self.parallelism.nodes",
            message="more than one tensor-parallel rank per pod (parallelism.tensor / parallelism.nodes) needs "
            "resources.gpu.count >= that many (one GPU per rank)",
            check=lambda s: (
                s.parallelism.tensor % s.parallelism.nodes != 0
                or s.parallelism.ranks_per_node == 1
                or s.resources.gpu.count is None
                or s.resources.gpu.count >= s.parallelism.ranks_per_node
            ),
            field_path=".parallelism.tensor",
        ),
        Rule(
            rule="!has(self.auth.apiKeySecretRef) || !has(self.env) "
            "|| !self.env.exists(e, e.name == 'KUBELLM_API_KEY')",
            message="env: KUBELLM_API_KEY is set from auth.apiKeySecretRef; remove one of them",
            check=lambda s: (
                s.auth.api_key_secret_ref is None or all(e.name != "KUBELLM_API_KEY" for e in s.env or ())
            ),
            field_path=".env",
        ),
        Rule(
            rule="!has(self.engine.speculative.model) || self.parallelism.tensor == 1",
            message="engine.speculative.model runs the draft beside an unsharded model; it needs "
            "parallelism.tensor 1 (use engine.speculative.ngram with tensor parallelism)",
            check=lambda s: s.engine.speculative.model is None or s.parallelism.tensor == 1,
            field_path=".engine.speculative.model",
        ),
        # Transition rule (updates only): the autoscaler's own writes always land in range and an unchanged
        # replicas is always accepted, so editing min/maxReplicas never gets a GitOps sync stuck; a manual
        # `kubectl scale` or a manifest that sets replicas outside the range is refused.
        Rule(
            rule="!self.autoscaling.enabled || self.replicas == oldSelf.replicas "
            "|| (self.replicas >= self.autoscaling.minReplicas && self.replicas <= self.autoscaling.maxReplicas)",
            message="autoscaling is enabled, so the autoscaler owns spec.replicas: a new replicas value must lie "
            "within [autoscaling.minReplicas, autoscaling.maxReplicas]; remove replicas from your manifest",
            message_expression="'replicas ' + string(self.replicas) + ' is outside autoscaling ['"
            " + string(self.autoscaling.minReplicas) + ', ' + string(self.autoscaling.maxReplicas)"
            " + ']: autoscaling is enabled, so the autoscaler owns spec.replicas; remove replicas from your "
            "manifest'",
            check=lambda s, old: (
                not s.autoscaling.enabled
                or s.replicas == old.replicas
                or s.autoscaling.min_replicas <= s.replicas <= s.autoscaling.max_replicas
            ),
            explain=lambda s: (
                f"replicas {s.replicas} is outside autoscaling [{s.autoscaling.min_replicas}, "
                f"{s.autoscaling.max_replicas}]: autoscaling is enabled, so the autoscaler owns spec.replicas; "
                "remove replicas from your manifest"
            ),
            field_path=".replicas",
        ),
    )

    @model_validator(mode="after")
    def _python_only(self) -> LLMDeploymentSpec:
        raise_violations(_python_only_checks(self))
        return self

    @property
    def gpu_count(self) -> int:
        """GPUs per pod with the default applied (omitted: the ranks in each pod, parallelism.tensor / nodes)."""
        count = self.resources.gpu.count
        return self.parallelism.ranks_per_node if count is None else count

    @property
    def served_model_name(self) -> str:
        return self.model.effective_served_model_name

    def resource_requirements(self) -> dict[str, dict[str, str]]:
        """The runtime container's core/v1 ResourceRequirements (requests and limits), as a dict."""
        requests: dict[str, str] = {}
        limits: dict[str, str] = {}
        for name in ("cpu", "memory"):
            request = getattr(self.resources, name)
            limit = getattr(self.resources.limits, name) if self.resources.limits else None
            if request is not None:
                requests[name] = str(request)
            if limit is not None or request is not None:
                limits[name] = str(limit if limit is not None else request)
        if self.gpu_count > 0:
            gpu = self.resources.gpu.resource_name
            requests[gpu] = limits[gpu] = str(self.gpu_count)
        out = {}
        if requests:
            out["requests"] = requests
        if limits:
            out["limits"] = limits
        return out


def _python_only_checks(spec: LLMDeploymentSpec) -> list[str]:
    """Checks CEL cannot express without Kubernetes' quantity library (the API server enforces the first
    through the env list-map keys, the pod's validation the second)."""
    problems = []
    names = [e.name for e in spec.env or ()]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"env: {name} appears more than once; names must be unique")
    if spec.resources.limits is not None:
        for name in ("cpu", "memory"):
            request, limit = getattr(spec.resources, name), getattr(spec.resources.limits, name)
            if request is not None and limit is not None and parse_quantity(limit) < parse_quantity(request):
                problems.append(f"resources.limits.{name} ({limit}) must be >= resources.{name} ({request})")
    return problems


def validate_update(old: LLMDeploymentSpec, new: LLMDeploymentSpec) -> list[str]:
    """Messages of the transition rules (CEL rules using oldSelf) that an update from ``old`` to ``new`` breaks."""
    return [
        m for r in LLMDeploymentSpec.k8s_rules if r.transition and (m := r.violation(new, old)) is not None
    ]


def all_rules() -> dict[str, tuple[Rule, ...]]:
    """Every rule by the model it is attached to (for docs and tests)."""
    models = (
        ModelSpec,
        DraftModelSpec,
        SpeculativeSpec,
        ParallelismSpec,
        GPUSpec,
        AutoscalingSpec,
        RolloutSpec,
        AlertsSpec,
        Toleration,
        EnvVar,
        LLMDeploymentSpec,
    )
    return {m.__name__: m.k8s_rules for m in models}
