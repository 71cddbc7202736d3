"""Scale from zero with the operator running against kmock (see test_operator_kmock.py for what kmock is and
is not): KEDA's step to zero and the activator's wake are simulated by writing the Deployment as they would.

Reaching zero gives the ScaledToZero Event, status.autoscaling.scaledToZeroSince and an EndpointSlice that
routes the Service to the activator's pods; the activator's wake (its real ScaleWaker, through the scale
subresource) posts Activated on the LLMDeployment; a ready pod routes the Service back to its pods.
"""

from __future__ import annotations

import asyncio

import kmock
import kubernetes.client
import kubernetes.config
import kubernetes.config.kube_config
import pytest
import pytest_asyncio
from test_operator_kmock import (
    CLOSE,
    DEPLOYMENTS,
    NAME,
    NS,
    SERVICES,
    VERBS,
    ApiServer,
    child_path,
    create,
    declare_resources,
    events,
    ld_object,
    live,
    llmdeployment,
    owned_by_ld,
    patch,
    simulate_deployment_status,
    the_deployment,
    until,
    write_kubeconfig,
)
from test_operator_rbac import checks as rbac_checks

from kubellm.operator.activator import Catalog, ScaleWaker, SecretKeys, Target
from kubellm.operator.control import rbac
from kubellm.operator.control.kube import Kube
from kubellm.operator.render import activation
from kubellm.operator.testing import operator_running

pytestmark = pytest.mark.kmock(cls=ApiServer)

ACTIVATOR_NS, ACTIVATOR_SERVICE = "kubellm-system", "kubellm-activator"
ACTIVATOR_URL = "http://kubellm-activator.kubellm-system.svc:9090"
SLICES = kmock.resource("discovery.k8s.io", "v1", "endpointslices")
SCALED_OBJECTS = kmock.resource("keda.sh", "v1alpha1", "scaledobjects")


@pytest_asyncio.fixture
async def cluster(kmock, tmp_path, monkeypatch):
    """kmock with EndpointSlices, KEDA and the activator's Service slice; the operator told where it is."""
    server = kmock
    declare_resources(server)
    for res, kind in (("discovery.k8s.io/v1/endpointslices", "EndpointSlice"),
                      ("keda.sh/v1alpha1/scaledobjects", "ScaledObject"), ("v1/secrets", "Secret")):
        server.resources[res] = kmock.ResourceInfo(kind=kind, namespaced=True, verbs=VERBS)
    server.resources["apps/v1/deployments"] = kmock.ResourceInfo(
        kind="Deployment", namespaced=True, verbs=VERBS, subresources={"status", "scale"})
    # Discovery is read once at start-up: declare the kinds first, then start the operator (as the operator
    # fixture of test_operator_kmock.py does).
    async with operator_running(server, tmp_path, monkeypatch) as memo:
        await configure(server, memo.kubellm)
        yield server, memo.kubellm, str(write_kubeconfig(server, tmp_path / "activator", user="activator"))


async def configure(server, operator) -> None:
    operator.activator_service = (ACTIVATOR_NS, ACTIVATOR_SERVICE)
    operator.activator_url = ACTIVATOR_URL
    activator_slice = {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": "kubellm-activator-x7k2p", "namespace": ACTIVATOR_NS,
                     "labels": {activation.SERVICE_NAME_LABEL: ACTIVATOR_SERVICE}},
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}, {"name": "admin", "port": 9090}],
        "endpoints": [{"addresses": ["10.1.0.5"], "conditions": {"ready": True}},
                      {"addresses": ["10.1.0.6"], "conditions": {"ready": False}}],
    }  # fmt: skip
    async with server.post(f"/apis/discovery.k8s.io/v1/namespaces/{ACTIVATOR_NS}/endpointslices", headers=CLOSE,
                           json=activator_slice) as resp:  # fmt: skip
        assert resp.status < 300, await resp.text()


def our_slices(server) -> dict[str, dict]:
    return {n: s for n, s in live(server, SLICES).items() if owned_by_ld(s)}


def autoscaling_status(server) -> dict:
    return (ld_object(server).get("status") or {}).get("autoscaling") or {}


@pytest.mark.asyncio
async def test_zero_routes_to_the_activator_and_a_ready_pod_routes_back(cluster):
    server, state, activator_kubeconfig = cluster
    spec = {"autoscaling": {"enabled": True, "backend": "keda", "minReplicas": 0, "scaleToZeroAfterSeconds": 300}}
    await create(server, llmdeployment(**spec))
    await until(lambda: any(owned_by_ld(d) for d in live(server, DEPLOYMENTS).values()), "the Deployment")
    services = await until(lambda: {n for n, s in live(server, SERVICES).items() if owned_by_ld(s)} >= {NAME, f"{NAME}-pods"}
                           and live(server, SERVICES), "both Services")  # fmt: skip
    client_service = dict(services[NAME])
    (so,) = await until(lambda: [o for o in live(server, SCALED_OBJECTS).values() if owned_by_ld(o)],
                        "the ScaledObject")  # fmt: skip
    assert so["spec"]["cooldownPeriod"] == 300
    assert so["spec"]["triggers"][-1]["metadata"]["url"] == f"{ACTIVATOR_URL}/activity/{NS}/{NAME}"

    # KEDA took the last pod away after the idle time.
    deployment = the_deployment(server)
    await patch(server, child_path("apps/v1", "deployments", NAME), {"spec": {"replicas": 0}})
    await simulate_deployment_status(server, deployment, replicas=0, readyReplicas=0, updatedReplicas=0,
                                     availableReplicas=0)  # fmt: skip
    await until(lambda: our_slices(server), "the activator's EndpointSlice")
    (s,) = our_slices(server).values()
    assert s["metadata"]["labels"][activation.SERVICE_NAME_LABEL] == NAME
    assert [e["addresses"] for e in s["endpoints"]] == [["10.1.0.5"]]  # the ready activator pod only
    assert s["ports"] == [{"name": "http", "port": 8000, "protocol": "TCP", "appProtocol": "http"}]
    await until(lambda: autoscaling_status(server).get("activation", {}).get("route") == "Activator",
                "status.autoscaling.activation.route Activator")  # fmt: skip
    assert autoscaling_status(server)["scaledToZeroSince"]
    assert autoscaling_status(server)["activation"]["activatorEndpoints"] == 1
    await until(lambda: events(server, "ScaledToZero"), "a ScaledToZero Event")
    # The client-facing Service itself is untouched: same name, same selector.
    assert live(server, SERVICES)[NAME]["spec"] == client_service["spec"]

    # A request reaches the activator, which wakes the deployment through the scale subresource. (kmock keeps
    # no resourceVersions and answers /scale with the Deployment: give it the one a server would have.)
    await patch(server, child_path("apps/v1", "deployments", NAME), {"metadata": {"resourceVersion": "7"}})
    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=activator_kubeconfig, client_configuration=configuration)
    kube = await Kube.connect("kubellm-activator", configuration)
    try:
        catalog = Catalog(kube, [NS])
        await catalog.refresh()  # the activator serves this deployment, on its own pods' Service
        target = catalog.targets[NS, NAME]
        assert target.upstream == f"http://{NAME}-pods.{NS}.svc:80"
        await ScaleWaker(kube)(target, 3)
        assert await SecretKeys(kube)(Target(NS, NAME, "", api_key=("absent", "api-key"))) is None
    finally:
        kube.close()
    assert the_deployment(server)["spec"]["replicas"] == 1
    (activated,) = events(server, "Activated")
    assert activated["involvedObject"]["kind"] == "LLMDeployment" and "3 request(s) waiting" in activated["message"]
    await until(lambda: autoscaling_status(server).get("activation", {}).get("lastActivationTime"),
                "status.autoscaling.activation.lastActivationTime")  # fmt: skip
    assert "scaledToZeroSince" not in autoscaling_status(server)
    assert our_slices(server), "the pod is not ready yet: requests must stay with the activator"

    # The pod is ready: the Service is routed back to its pods.
    await simulate_deployment_status(server, deployment, replicas=1, readyReplicas=1, updatedReplicas=1,
                                     availableReplicas=1)  # fmt: skip
    await until(lambda: not our_slices(server), "the activator's EndpointSlice deleted")
    await until(lambda: autoscaling_status(server).get("activation", {}).get("route") == "Pods",
                "status.autoscaling.activation.route Pods")  # fmt: skip
    assert len(events(server, "ScaledToZero")) == 1

    # Each side asked for exactly what the chart grants it (operator/control/rbac.py).
    def checks_of(token: str) -> set:
        return {c for r in list(server) if r.headers.get("Authorization") == f"Bearer {token}"
                for c in rbac_checks(r.method.value, r.url.path, dict(r.params), r.headers.get("Content-Type", ""))}

    activator_checks = checks_of("activator-token")
    assert {c.namespace for c in activator_checks} == {NS}
    assert {(c.group, c.resource, c.verb) for c in activator_checks} == rbac.triples(rbac.ACTIVATOR)
    operator_checks = checks_of("test-token")
    slices = {(c.namespace, c.verb) for c in operator_checks if c.resource == "endpointslices"}
    assert slices == {(ACTIVATOR_NS, "list"), (NS, "list"), (NS, "patch"), (NS, "create"), (NS, "delete")}
    granted = rbac.triples(rbac.namespaced_grants(keda=True, service_monitors=False, activator=True))
    for c in operator_checks:
        where = rbac.ACTIVATOR_ENDPOINTS if c.namespace == ACTIVATOR_NS else ()
        assert (c.group, c.resource, c.verb) in granted | rbac.triples(rbac.cluster_grants(all_namespaces=True)
                                                                       + where), c  # fmt: skip


@pytest.mark.asyncio
async def test_without_scale_to_zero_no_slice_and_no_pods_service(cluster):
    server, _, _ = cluster
    await create(server, llmdeployment(autoscaling={"enabled": True, "backend": "keda", "minReplicas": 1}))
    await until(lambda: any(owned_by_ld(d) for d in live(server, DEPLOYMENTS).values()), "the Deployment")
    deployment = the_deployment(server)
    await simulate_deployment_status(server, deployment, replicas=0, readyReplicas=0)
    await until(lambda: (ld_object(server).get("status") or {}).get("readyText") is not None, "a status")
    await asyncio.sleep(0.3)
    assert not our_slices(server)
    assert {n for n, s in live(server, SERVICES).items() if owned_by_ld(s)} == {NAME}
    assert "activation" not in autoscaling_status(server)
