"""The operator never takes over an object it does not own (issue 25, section 2), against kmock (see
test_operator_kmock.py for what kmock is and is not).

An object of a child's name without the LLMDeployment's owner reference is left as it is: the LLMDeployment
says ReconcileFailed naming it (and a Warning Event), nothing of it is applied, until the object's owner hands
it over with the annotation kubellm.io/adopt=<LLMDeployment name>. Two LLMDeployments whose children would
share a name (``llama`` scaling to zero renders the Service ``llama-pods``; an LLMDeployment ``llama-pods``
renders one too) are told apart the same way: the second is refused by name.
"""

from __future__ import annotations

import kmock
import pytest
import pytest_asyncio
from test_operator_kmock import (
    CLOSE,
    DEPLOYMENTS,
    EVENTS,
    LD_RESOURCE,
    NAME,
    NS,
    SERVICES,
    UID,
    VERBS,
    ApiServer,
    child_path,
    condition,
    create,
    declare_resources,
    events,
    live,
    llmdeployment,
    owned_by_ld,
    patch,
    until,
)

from kubellm.operator.control.children import ADOPT_ANNOTATION
from kubellm.operator.testing import operator_running

pytestmark = pytest.mark.kmock(cls=ApiServer)

PAYMENTS = {"app": "payments"}


@pytest_asyncio.fixture
async def server(kmock):
    declare_resources(kmock)
    kmock.resources["keda.sh/v1alpha1/scaledobjects"] = kmock_resource("ScaledObject")
    return kmock


def kmock_resource(kind: str) -> kmock.ResourceInfo:
    return kmock.ResourceInfo(kind=kind, namespaced=True, verbs=VERBS)


@pytest_asyncio.fixture
async def operator(server, tmp_path, monkeypatch):
    async with operator_running(server, tmp_path, monkeypatch) as memo:
        yield memo.kubellm


async def post_service(server, name: str, selector: dict) -> None:
    body = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": NS},
            "spec": {"selector": selector, "ports": [{"port": 80}]}}  # fmt: skip
    async with server.post(f"/api/v1/namespaces/{NS}/services", json=body, headers=CLOSE) as resp:
        assert resp.status < 300, await resp.text()


def writes_to(server, path: str) -> list:
    return [r for r in list(server) if r.method.value in ("PATCH", "PUT", "POST", "DELETE") and r.url.path == path]


@pytest.mark.asyncio
async def test_an_existing_service_is_not_taken_over_until_its_owner_hands_it_over(server, operator):
    await post_service(server, NAME, PAYMENTS)
    await create(server, llmdeployment(replicas=1))
    ready = await until(lambda: (c := condition(server, "Ready")) and c["reason"] == "ReconcileFailed" and c,
                        "Ready=ReconcileFailed")  # fmt: skip
    assert f"Service {NS}/{NAME} already exists and is not owned by this LLMDeployment (no owner)" in ready["message"]
    assert f"{ADOPT_ANNOTATION}={NAME}" in ready["message"]
    (warning,) = await until(lambda: events(server, "ReconcileFailed"), "a ReconcileFailed Event")
    assert warning["type"] == "Warning" and f"Service {NS}/{NAME}" in warning["message"]
    # Nothing was applied: not the Service (its selector and owners are the payments team's), nor any other child.
    service = live(server, SERVICES)[NAME]
    assert service["spec"]["selector"] == PAYMENTS and not service["metadata"].get("ownerReferences")
    assert not writes_to(server, child_path("v1", "services", NAME))
    assert not [d for d in live(server, DEPLOYMENTS).values() if owned_by_ld(d)]

    # Its owner hands it over: the next retry adopts it.
    await patch(server, child_path("v1", "services", NAME), {"metadata": {"annotations": {ADOPT_ANNOTATION: NAME}}})
    await until(lambda: owned_by_ld(live(server, SERVICES)[NAME]), "the Service adopted", timeout=30)
    await until(lambda: condition(server, "Ready")["reason"] != "ReconcileFailed", "ReconcileFailed to clear")
    assert [d for d in live(server, DEPLOYMENTS).values() if owned_by_ld(d)]


@pytest.mark.asyncio
async def test_an_annotation_naming_another_llmdeployment_adopts_nothing(server, operator):
    await post_service(server, NAME, PAYMENTS)
    await patch(server, child_path("v1", "services", NAME), {"metadata": {"annotations": {ADOPT_ANNOTATION: "other"}}})
    await create(server, llmdeployment(replicas=1))
    await until(lambda: condition(server, "Ready")["reason"] == "ReconcileFailed", "Ready=ReconcileFailed")
    assert not writes_to(server, child_path("v1", "services", NAME))[1:]  # only the test's own annotation patch


@pytest.mark.asyncio
async def test_colliding_child_names_of_two_llmdeployments_are_refused_by_name(server, operator):
    """`llama` scales to zero (its Service for the activator is `llama-pods`); an LLMDeployment `llama-pods`
    would render a Service of that name with another selector: it is refused, naming the Service and its owner."""
    await create(server, llmdeployment(autoscaling={"enabled": True, "backend": "keda", "minReplicas": 0}))
    pods_service = f"{NAME}-pods"
    await until(lambda: owned_by_ld(live(server, SERVICES).get(pods_service) or {}), "llama's llama-pods Service")
    before = live(server, SERVICES)[pods_service]

    other = llmdeployment(replicas=1)
    other["metadata"].update(name=pods_service, uid="0b8e1c1e-0000-4000-8000-000000000002")
    await create(server, other)

    def other_ready() -> dict | None:
        status = server.objects[LD_RESOURCE, NS, pods_service].raw.get("status") or {}
        return next((c for c in status.get("conditions") or () if c["type"] == "Ready"), None)

    ready = await until(lambda: (c := other_ready()) and c["reason"] == "ReconcileFailed" and c,
                        "llama-pods Ready=ReconcileFailed")  # fmt: skip
    assert f"Service {NS}/{pods_service} already exists" in ready["message"]
    assert f"owned by LLMDeployment {NAME}" in ready["message"]
    await until(lambda: [e for e in live(server, EVENTS).values() if e.get("reason") == "ReconcileFailed"
                         and e["involvedObject"]["name"] == pods_service], "a ReconcileFailed Event on llama-pods")
    after = live(server, SERVICES)[pods_service]
    assert after["spec"]["selector"] == before["spec"]["selector"]
    assert [r["uid"] for r in after["metadata"]["ownerReferences"]] == [UID]
