"""The Kubernetes API permissions the operator needs, written down once: what the Helm chart's RBAC grants.

Every request the operator sends (its own :class:`~kubellm.operator.control.kube.Kube` client and kopf's watches,
patches and Events) must be allowed by these grants, and every grant must be used by some request.
``tests/operator/test_operator_rbac.py`` checks both directions against the requests the operator really
makes to an emulated API server; ``tests/delivery/test_chart.py`` checks that the chart's Roles and
ClusterRoles (``charts/kubellm/templates/rbac.yaml``) grant exactly this, nothing more. A handler that starts
calling the API differently fails the first test until this table and the chart change with it.

Verbs are RBAC verbs, not HTTP methods: a GET is ``get`` (one object), ``list`` or ``watch``; server-side
apply is a PATCH, which the API server authorizes as ``patch`` and, when it creates the object, also as
``create``. Discovery (``/api``, ``/apis/...``, ``/version``) needs no grant: every authenticated user may read
it (the ``system:discovery`` ClusterRole).
"""

from __future__ import annotations

from dataclasses import dataclass

from kubellm.operator import api


@dataclass(frozen=True)
class Grant:
    """Verbs on one resource (``plural`` or ``plural/subresource``) of one API group (``""``: core)."""

    group: str
    resource: str
    verbs: tuple[str, ...]
    why: str

    def triples(self) -> set[tuple[str, str, str]]:
        return {(self.group, self.resource, verb) for verb in self.verbs}


Grants = tuple[Grant, ...]

# Children are applied (patch, create), listed by owner label to find the stale ones, and deleted when no
# longer rendered.
CHILD_VERBS = ("list", "create", "patch", "delete")

# In each watched namespace: a Role there, or part of the ClusterRole when the operator watches every namespace.
NAMESPACED: Grants = (
    Grant(api.GROUP, api.PLURAL, ("get", "list", "watch", "patch"),
          "kopf watches them and patches its finalizer and kubellm.io/* annotations; the observer re-reads one "
          "before writing its status"),
    Grant(api.GROUP, f"{api.PLURAL}/status", ("patch",), "the observer writes status (conditions, replicas)"),
    Grant("", "events", ("create",), "kopf posts the operator's Events (RolloutStarted, InvalidSpec, ...)"),
    Grant("", "pods", ("list", "watch"),
          "the observer reads the pods (readiness, crash loops); kopf watches them to wake it"),
    Grant("", "services", CHILD_VERBS, "child Service"),
    Grant("apps", "deployments", ("list", "watch", "create", "patch", "delete"),
          "child Deployment; kopf watches it to wake the observer"),
    Grant("apps", "replicasets", ("list",),
          "the observer tells a rollout's new pods from the old ones (a surge pod waiting for a GPU)"),
    Grant("policy", "poddisruptionbudgets", CHILD_VERBS, "child PodDisruptionBudget"),
    Grant("autoscaling", "horizontalpodautoscalers", ("get", "list", "watch", "create", "patch", "delete"),
          "child HPA (backend hpa); the observer reads KEDA's HPA by name; kopf watches them"),
)  # fmt: skip

# Namespaced too, granted only when the chart is asked to (rbac.keda, rbac.serviceMonitors, rbac.prometheusRules,
# rbac.inferencePools, rbac.leaderWorkerSets): without them the operator still runs, and LLMDeployments that need
# these kinds say so in their status.
KEDA: Grants = (
    Grant("keda.sh", "scaledobjects", CHILD_VERBS, "child ScaledObject (autoscaling.backend keda)"),
)
SERVICE_MONITORS: Grants = (
    Grant("monitoring.coreos.com", "servicemonitors", CHILD_VERBS,
          "child ServiceMonitor (monitoring.serviceMonitor Enabled, or Auto with the Prometheus operator)"),
)  # fmt: skip
PROMETHEUS_RULES: Grants = (
    Grant("monitoring.coreos.com", "prometheusrules", CHILD_VERBS,
          "child PrometheusRule (monitoring.alerts.enabled, the Prometheus operator)"),
)  # fmt: skip
INFERENCE_POOLS: Grants = (
    Grant("inference.networking.k8s.io", "inferencepools", CHILD_VERBS,
          "child InferencePool (gateway.inferencePool.enabled, the Gateway API Inference Extension)"),
)  # fmt: skip
LEADER_WORKER_SETS: Grants = (
    Grant("leaderworkerset.x-k8s.io", "leaderworkersets", CHILD_VERBS,
          "child LeaderWorkerSet (parallelism.nodes > 1); the observer lists it for its status"),
)  # fmt: skip

# Scale from zero, when the chart runs the activator (activator.enabled): in each watched namespace the operator
# routes the Service of a deployment at zero to the activator with an EndpointSlice of its own, and in the
# activator's namespace (the release's) it reads the activator's ready pods from its Service's slices.
ACTIVATOR_ROUTING: Grants = (
    Grant("discovery.k8s.io", "endpointslices", CHILD_VERBS,
          "the EndpointSlice that routes a Service to the activator while its deployment has no ready pod"),
)  # fmt: skip
ACTIVATOR_ENDPOINTS: Grants = (
    Grant("discovery.k8s.io", "endpointslices", ("list",), "the activator's ready pods, from its Service's slices"),
)

# The activator's own ServiceAccount, in each namespace it serves (operator/activator.py: Catalog,
# SecretKeys, ScaleWaker). A Role in each by default; a ClusterRole only with activator.allNamespaces.
ACTIVATOR: Grants = (
    Grant("apps", "deployments/scale", ("get", "patch"), "wakes a Deployment at zero: reads its scale, sets 1"),
    Grant(api.GROUP, api.PLURAL, ("get", "list"),
          "lists the LLMDeployments that scale to zero (only those are served); gets one to post an Event on"),
    Grant("", "secrets", ("get",), "reads a deployment's spec.auth.apiKeySecretRef to check the key before waking"),
    Grant("", "events", ("create",), "posts Activated with the number of waiting requests"),
)  # fmt: skip

# Cluster-scoped, whatever the operator watches.
CLUSTER: Grants = (
    Grant("apiextensions.k8s.io", "customresourcedefinitions", ("list", "watch"),
          "kopf follows CRDs being installed and removed (the LLMDeployment CRD among them)"),
)  # fmt: skip

# Cluster-scoped, only when the operator watches a list of namespaces (kopf resolves them, patterns included).
NAMESPACE_DISCOVERY: Grants = (
    Grant("", "namespaces", ("list", "watch"), "kopf follows the watched namespaces being created and deleted"),
)


def namespaced_grants(
    *, keda: bool, service_monitors: bool, inference_pools: bool = False, leader_worker_sets: bool = False,
    activator: bool = False, prometheus_rules: bool = False,
) -> Grants:
    """What the operator needs in each namespace it watches."""
    return (NAMESPACED + (KEDA if keda else ()) + (SERVICE_MONITORS if service_monitors else ())
            + (PROMETHEUS_RULES if prometheus_rules else ())
            + (INFERENCE_POOLS if inference_pools else ()) + (LEADER_WORKER_SETS if leader_worker_sets else ())
            + (ACTIVATOR_ROUTING if activator else ()))  # fmt: skip


def cluster_grants(*, all_namespaces: bool) -> Grants:
    """What the operator needs cluster-wide besides the namespaced grants (which a ClusterRole holds too
    when it watches every namespace)."""
    return CLUSTER + (() if all_namespaces else NAMESPACE_DISCOVERY)


def triples(grants: Grants) -> set[tuple[str, str, str]]:
    """``{(group, resource, verb)}`` of ``grants``, the form RBAC comparisons are made in."""
    return {t for g in grants for t in g.triples()}
