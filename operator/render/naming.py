"""Names, labels and metadata every child of an LLMDeployment carries: the one module every render module imports.

* Names: every child is named :func:`child_name` (the LLMDeployment name when it is a valid DNS-1035 label
  of at most 63 characters, else a sanitised, truncated form with a short hash of the full name, so two
  LLMDeployments never share children). Label values get the same treatment (:func:`label_value`).
* Selector: :func:`selector_labels` only (name, instance, component), constant for the life of the object:
  a Deployment's selector is immutable, and the spec-hash, model or image never appear in it.
* The shape a spec gives its children's names and selectors: multi-node replicas (:func:`is_multi_node`) run in
  a LeaderWorkerSet named :func:`lws_name` whose leaders alone serve; a deployment that scales to zero
  (:func:`scales_to_zero`) gets a second Service, :func:`pods_service_name`.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from kubellm.operator import api


class InvalidSpec(ValueError):
    """The LLMDeployment passed the API server's validation but cannot be rendered; the message says why."""


APP_NAME = "kubellm"
COMPONENT = "runtime"
MANAGED_BY = "kubellm-operator"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_LLMDEPLOYMENT = "kubellm.io/llmdeployment"
SPEC_HASH_ANNOTATION = "kubellm.io/spec-hash"
PORT_NAME = "http"  # the runtime serves the API, the probes and /metrics on this one port
# The pod label kubellm.io/llmdeployment as scraped series carry it: the ServiceMonitor's podTargetLabels copy it
# under this sanitised name (a hand-written scrape config with the usual labelmap of
# __meta_kubernetes_pod_label_(.+) produces the same name). KEDA queries and alerts select on it.
PROMETHEUS_LLMDEPLOYMENT_LABEL = "kubellm_io_llmdeployment"
INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"  # Gateway API Inference Extension, GA
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
# Every kind the operator may own, in apply order (render() leaves out the ones a spec does not need).
CHILD_KINDS: tuple[tuple[str, str], ...] = (
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
    (LWS_API_VERSION, LWS_KIND),  # instead of the Deployment when parallelism.nodes > 1
    ("policy/v1", "PodDisruptionBudget"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"),
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),  # monitoring.alerts.enabled (:mod:`.alerts`)
    (INFERENCE_POOL_API_VERSION, "InferencePool"),
)
MAX_NAME_LENGTH = 63  # DNS-1035 label (Service names) and label values
_HASH_LENGTH = 8

# Multi-node groups (:mod:`.multinode`). The LWS controller labels every pod of a group with its worker index.
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"  # "0" on leaders
LWS_NAME_SUFFIX = "-group"
# Worker StatefulSets are named <lws>-<group>, and their pods carry controller-revision-hash=<sts>-<10 hex>:
# 46 + "-" + 5 group digits + "-" + 10 = 63.
MAX_LWS_NAME_LENGTH = 46
PODS_SERVICE_SUFFIX = "-pods"  # the activator's default upstream (activator.DEFAULT_UPSTREAM) names it so
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _short_hash(text: str, length: int = _HASH_LENGTH) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def object_name(ld: api.LLMDeployment) -> str:
    name = ld.name
    if not name:
        raise InvalidSpec("metadata.name is required")
    if len(name) > 253 or not DNS1123_SUBDOMAIN.match(name):
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
    name = object_name(ld)
    if len(name) <= MAX_NAME_LENGTH and _DNS1035_LABEL.match(name):
        return name
    base = name.replace(".", "-")
    if not base[0].isalpha():
        base = f"llm-{base}"
    return _shorten(base, name)


def label_value(ld: api.LLMDeployment) -> str:
    """The LLMDeployment's name as a label value: itself when at most 63 characters, else cut and hashed."""
    return name_label_value(object_name(ld))


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
    return leader_selector(ld) if is_multi_node(ld) else selector_labels(ld)


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
        "name": object_name(ld),
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


def is_multi_node(ld: api.LLMDeployment) -> bool:
    return ld.spec.parallelism.nodes > 1


def lws_name(ld: api.LLMDeployment) -> str:
    """``<child name>-group``, cut and suffixed with a hash of the full name when it would be too long."""
    base = child_name(ld)
    name = base + LWS_NAME_SUFFIX
    if len(name) <= MAX_LWS_NAME_LENGTH:
        return name
    digest = hashlib.sha256(base.encode()).hexdigest()[:8]
    head = base[: MAX_LWS_NAME_LENGTH - len(LWS_NAME_SUFFIX) - len(digest) - 1].rstrip("-")
    return f"{head}-{digest}{LWS_NAME_SUFFIX}"


def leader_selector(ld: api.LLMDeployment) -> dict[str, str]:
    """The labels that select the leader pods only: the Service's selector (workers serve no HTTP)."""
    return {**selector_labels(ld), WORKER_INDEX_LABEL: "0"}


def scales_to_zero(ld: api.LLMDeployment) -> bool:
    auto = ld.spec.autoscaling
    return auto.enabled and auto.min_replicas == 0


def pods_service_name(ld: api.LLMDeployment) -> str:
    return child_name(ld) + PODS_SERVICE_SUFFIX
