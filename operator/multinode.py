"""Multi-node replicas (``parallelism.nodes > 1``): the pure render of a ``leaderworkerset.x-k8s.io/v1``
LeaderWorkerSet (github.com/kubernetes-sigs/lws) in place of the Deployment.

One replica is one LWS *group* of ``nodes`` pods that together hold one tensor-parallel group: the leader
(worker index 0) runs ``kubellm serve --node-rank 0``, serves the API and hosts the ranks' rendezvous on
``parallelism.rendezvousPort``; worker ``k`` runs ``--node-rank k`` and only its ranks. Both templates are the
Deployment path's pod template (:func:`.render.pod_template`) with these differences:

* Addresses come from the LWS controller, which injects ``LWS_LEADER_ADDRESS`` (the leader's stable DNS name,
  ``<lws>-<group>.<lws>.<namespace>``, through the headless Service named like the LWS) and ``LWS_WORKER_INDEX``
  into every container; the kubelet expands ``$(VAR)`` in ``args`` from them.
* Workers serve no HTTP: no ports, no probes, no preStop sleep (no endpoints to leave). A worker whose leader
  is gone exits 1, and the leader's probes see a dead rank, so ``RecreateGroupOnPodRestart`` recreates the
  whole group whichever pod fails (a tensor-parallel group cannot lose a member and go on).
* ``startupPolicy: LeaderCreated``: the leader cannot become ready before its workers joined it, so
  ``LeaderReady`` would never start them.
* The LWS is not named like the Service clients call: the LWS controller creates a headless Service with the
  LWS's own name (the leader address resolves through it) and silently adopts an existing one of that name.
  :func:`lws_name` leaves room for what the StatefulSets derive from it (pod hostnames and
  ``controller-revision-hash`` label values are limited to 63 characters).
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

from kubellm.operator import api
from kubellm.operator import render as render_mod

API_VERSION = "leaderworkerset.x-k8s.io/v1"
KIND = "LeaderWorkerSet"
# Labels and environment variables the LWS controller puts on every pod of a group.
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"  # "0" on leaders
REVISION_LABEL = "leaderworkerset.sigs.k8s.io/template-revision-hash"
LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"
WORKER_INDEX_ENV = "LWS_WORKER_INDEX"
RENDEZVOUS_PORT_NAME = "rendezvous"
RESTART_POLICY = "RecreateGroupOnPodRestart"
STARTUP_POLICY = "LeaderCreated"
NAME_SUFFIX = "-group"
# Worker StatefulSets are named <lws>-<group>, and their pods carry controller-revision-hash=<sts>-<10 hex>:
# 46 + "-" + 5 group digits + "-" + 10 = 63.
MAX_LWS_NAME_LENGTH = 46
INSTALL_URL = "https://lws.sigs.k8s.io/docs/installation/"  # named by children.addon_hint when the CRD is missing


def is_multi_node(ld: api.LLMDeployment) -> bool:
    return ld.spec.parallelism.nodes > 1


def lws_name(ld: api.LLMDeployment) -> str:
    """``<child name>-group``, cut and suffixed with a hash of the full name when it would be too long."""
    base = render_mod.child_name(ld)
    name = base + NAME_SUFFIX
    if len(name) <= MAX_LWS_NAME_LENGTH:
        return name
    digest = hashlib.sha256(base.encode()).hexdigest()[:8]
    head = base[: MAX_LWS_NAME_LENGTH - len(NAME_SUFFIX) - len(digest) - 1].rstrip("-")
    return f"{head}-{digest}{NAME_SUFFIX}"


def leader_selector(ld: api.LLMDeployment) -> dict[str, str]:
    """The labels that select the leader pods only: the Service's selector (workers serve no HTTP)."""
    return {**render_mod.selector_labels(ld), WORKER_INDEX_LABEL: "0"}


def validate(ld: api.LLMDeployment) -> None:
    """What the LWS admission webhook refuses that a Deployment accepts: rollout percentages above 100%."""
    for field in ("max_surge", "max_unavailable"):
        value = getattr(ld.spec.rollout, field)
        if isinstance(value, str) and value.endswith("%") and int(value[:-1]) > 100:
            camel = "maxSurge" if field == "max_surge" else "maxUnavailable"
            raise render_mod.InvalidSpec(
                f"spec.rollout.{camel} {value}: a LeaderWorkerSet (parallelism.nodes > 1) takes at most 100%"
            )


def _node_args(ld: api.LLMDeployment, node_rank: str) -> list[str]:
    port = ld.spec.parallelism.rendezvous_port
    return ["--node-rank", node_rank, "--dist-init-addr", f"$({LEADER_ADDRESS_ENV}):{port}"]


def _group_template(ld: api.LLMDeployment, base: dict[str, Any], *, leader: bool) -> dict[str, Any]:
    template = copy.deepcopy(base)
    pod = template["spec"]
    (container,) = pod["containers"]
    if leader:
        container["args"] += _node_args(ld, "0")
        container["ports"].append(
            {"name": RENDEZVOUS_PORT_NAME, "containerPort": ld.spec.parallelism.rendezvous_port, "protocol": "TCP"}
        )
    else:
        container["args"] += _node_args(ld, f"$({WORKER_INDEX_ENV})")
        for key in ("ports", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle"):
            container.pop(key, None)
    for constraint in pod.get("topologySpreadConstraints", ()):
        constraint["matchLabelKeys"] = [REVISION_LABEL]  # LWS pods carry no pod-template-hash
    annotations = template["metadata"]["annotations"]
    annotations[render_mod.SPEC_HASH_ANNOTATION] = render_mod.spec_hash(template)
    return template


def render_leader_worker_set(ld: api.LLMDeployment) -> dict[str, Any]:
    """The LeaderWorkerSet running ``kubellm serve`` over ``parallelism.nodes`` pods per replica."""
    render_mod.validate(ld)
    validate(ld)
    spec = ld.spec
    base = render_mod.pod_template(ld)
    lws_spec: dict[str, Any] = {}
    if not spec.autoscaling.enabled:  # else the HPA / KEDA owns replicas (the LWS has a scale subresource)
        lws_spec["replicas"] = spec.replicas
    lws_spec.update(
        {
            "leaderWorkerTemplate": {
                "size": spec.parallelism.nodes,
                "restartPolicy": RESTART_POLICY,
                "leaderTemplate": _group_template(ld, base, leader=True),
                "workerTemplate": _group_template(ld, base, leader=False),
            },
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {
                    "maxSurge": spec.rollout.max_surge,
                    "maxUnavailable": spec.rollout.max_unavailable,
                },
            },
            "startupPolicy": STARTUP_POLICY,
            "networkConfig": {"subdomainPolicy": "Shared"},  # LWS_LEADER_ADDRESS resolves through <lws>.<ns>
        }
    )
    metadata = {**render_mod.child_metadata(ld), "name": lws_name(ld)}
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": lws_spec}
