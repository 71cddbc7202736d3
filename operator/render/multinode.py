"""Multi-node replicas (``parallelism.nodes > 1``): the pure render of a ``leaderworkerset.x-k8s.io/v1``
LeaderWorkerSet (github.com/kubernetes-sigs/lws) in place of the Deployment.

One replica is one LWS *group* of ``nodes`` pods that together hold one tensor-parallel group: the leader
(worker index 0) runs ``kubellm serve --node-rank 0``, serves the API and hosts the ranks' rendezvous on
``parallelism.rendezvousPort``; worker ``k`` runs ``--node-rank k`` and only its ranks. Both templates are the
Deployment path's pod template (:func:`.pods.pod_template`) with these differences:

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
  :func:`.naming.lws_name` leaves room for what the StatefulSets derive from it (pod hostnames and
  ``controller-revision-hash`` label values are limited to 63 characters).
"""

from __future__ import annotations

import copy
from typing import Any

from kubellm.operator import api
from kubellm.operator.render.naming import (
    LWS_API_VERSION,
    LWS_KIND,
    SPEC_HASH_ANNOTATION,
    child_metadata,
    lws_name,
)
from kubellm.operator.render.pods import pod_template, spec_hash

# Labels and environment variables the LWS controller puts on every pod of a group (the worker index label is
# :data:`.naming.WORKER_INDEX_LABEL`).
REVISION_LABEL = "leaderworkerset.sigs.k8s.io/template-revision-hash"
LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"
WORKER_INDEX_ENV = "LWS_WORKER_INDEX"
RENDEZVOUS_PORT_NAME = "rendezvous"
RESTART_POLICY = "RecreateGroupOnPodRestart"
STARTUP_POLICY = "LeaderCreated"
INSTALL_URL = "https://lws.sigs.k8s.io/docs/installation/"  # named by children.addon_hint when the CRD is missing


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
    annotations[SPEC_HASH_ANNOTATION] = spec_hash(template)
    return template


def render_leader_worker_set(ld: api.LLMDeployment) -> dict[str, Any]:
    """The LeaderWorkerSet running ``kubellm serve`` over ``parallelism.nodes`` pods per replica."""
    spec = ld.spec
    base = pod_template(ld)
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
    metadata = {**child_metadata(ld), "name": lws_name(ld)}
    return {"apiVersion": LWS_API_VERSION, "kind": LWS_KIND, "metadata": metadata, "spec": lws_spec}
