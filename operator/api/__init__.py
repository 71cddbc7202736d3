"""The LLMDeployment API (kubellm.io/v1alpha1): spec and status models, the single source of truth.

The CRD's OpenAPI schema is generated from these models (:mod:`kubellm.operator.crd.schema`), so field
docstrings are what ``kubectl explain llmdeployment.spec...`` prints; write them for users.

Conventions:

* JSON names are camelCase (``model_dump()`` and ``model_validate()`` use them; snake_case attribute
  names are accepted on input too). Dump with :meth:`KubeModel.to_k8s` for API payloads: it leaves
  out ``None`` fields, because Kubernetes expresses "unset" by absence, never by ``null``.
* Spec models forbid unknown fields (``extra="forbid"``): the API server prunes unknown fields before
  the operator sees an object, so an unknown field here means a typo in a file we were handed
  directly (``kubellm render``, tests) or an operator older than its CRD; both should fail loudly.
  Status models ignore unknown fields (a newer operator may have written more).
* Cross-field checks are :class:`Rule` objects attached to the model they constrain (``k8s_rules``).
  Each rule carries its CEL expression (emitted as ``x-kubernetes-validations`` in the CRD, enforced by
  the API server) and a Python twin with the same message (enforced by ``model_validate``, so the
  operator rejects the same specs on API servers without CEL and for objects it did not get through
  the API server). A few checks CEL cannot express are Python-only (:func:`.spec._python_only_checks`).

Layout: :mod:`.identity` (group, version, kind), :mod:`.rules` (:class:`Rule`, :class:`KubeModel`),
:mod:`.fields` (quantities, int-or-percent), :mod:`.spec`, :mod:`.status`, :mod:`.llmdeployment` (the object).
This package re-exports their public names, so code reads ``api.LLMDeployment``, ``api.GROUP``.
"""

from __future__ import annotations

from kubellm.operator.api.fields import (
    PERCENT_PATTERN,
    QUANTITY_PATTERN,
    FreeForm,
    IntOrPercent,
    Quantity,
    parse_quantity,
)
from kubellm.operator.api.identity import (
    API_VERSION,
    CATEGORIES,
    CRD_NAME,
    GROUP,
    KIND,
    LIST_KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
)
from kubellm.operator.api.llmdeployment import (
    LLMDeployment,
)
from kubellm.operator.api.rules import (
    KubeModel,
    Rule,
    StatusModel,
    nested,
    raise_violations,
)
from kubellm.operator.api.spec import (
    DEFAULT_GPU_RESOURCE,
    DEFAULT_IMAGE,
    DEFAULT_RENDEZVOUS_PORT,
    EPP_GRPC_PORT,
    GPU_PRODUCT_LABEL,
    MODEL_URI_MESSAGE,
    MODEL_URI_PATTERN,
    PROMETHEUS_DURATION_PATTERN,
    QUANTIZATIONS,
    QUEUE_DEPTH_METRIC,
    RUNTIME_PORT,
    RUNTIME_PROBE_DEADLINE_SECONDS,
    RUNTIME_VERSION,
    AlertsSpec,
    AuthSpec,
    AutoscalingSpec,
    DraftModelSpec,
    Dtype,
    EndpointPickerRef,
    EngineSpec,
    EnvVar,
    GatewaySpec,
    GPUSpec,
    InferencePoolSpec,
    LLMDeploymentSpec,
    ModelSpec,
    MonitoringSpec,
    ParallelismSpec,
    ProbesSpec,
    Quantization,
    ResourceLimits,
    ResourcesSpec,
    RolloutSpec,
    SecretKeyRef,
    ServiceSpec,
    SpeculativeSpec,
    Toleration,
    all_rules,
    default_served_model_name,
    model_source_rules,
    validate_update,
)
from kubellm.operator.api.status import (
    ActivationStatus,
    AutoscalingStatus,
    Condition,
    ConditionStatus,
    ConditionType,
    InferencePoolStatus,
    LLMDeploymentStatus,
    PoolParentStatus,
    parse_time,
    ready_text,
    utc_now,
)

__all__ = [
    "API_VERSION",
    "ActivationStatus",
    "AlertsSpec",
    "AuthSpec",
    "AutoscalingSpec",
    "AutoscalingStatus",
    "CATEGORIES",
    "CRD_NAME",
    "Condition",
    "ConditionStatus",
    "ConditionType",
    "DEFAULT_GPU_RESOURCE",
    "DEFAULT_IMAGE",
    "DEFAULT_RENDEZVOUS_PORT",
    "DraftModelSpec",
    "Dtype",
    "EPP_GRPC_PORT",
    "EndpointPickerRef",
    "EngineSpec",
    "EnvVar",
    "FreeForm",
    "GPUSpec",
    "GPU_PRODUCT_LABEL",
    "GROUP",
    "GatewaySpec",
    "InferencePoolSpec",
    "InferencePoolStatus",
    "IntOrPercent",
    "KIND",
    "KubeModel",
    "LIST_KIND",
    "LLMDeployment",
    "LLMDeploymentSpec",
    "LLMDeploymentStatus",
    "MODEL_URI_MESSAGE",
    "MODEL_URI_PATTERN",
    "ModelSpec",
    "MonitoringSpec",
    "PERCENT_PATTERN",
    "PLURAL",
    "PROMETHEUS_DURATION_PATTERN",
    "ParallelismSpec",
    "PoolParentStatus",
    "ProbesSpec",
    "QUANTITY_PATTERN",
    "QUANTIZATIONS",
    "QUEUE_DEPTH_METRIC",
    "Quantity",
    "Quantization",
    "RUNTIME_PORT",
    "RUNTIME_PROBE_DEADLINE_SECONDS",
    "RUNTIME_VERSION",
    "ResourceLimits",
    "ResourcesSpec",
    "RolloutSpec",
    "Rule",
    "SHORT_NAMES",
    "SINGULAR",
    "SecretKeyRef",
    "ServiceSpec",
    "SpeculativeSpec",
    "StatusModel",
    "Toleration",
    "VERSION",
    "all_rules",
    "default_served_model_name",
    "model_source_rules",
    "nested",
    "parse_quantity",
    "parse_time",
    "raise_violations",
    "ready_text",
    "utc_now",
    "validate_update",
]
