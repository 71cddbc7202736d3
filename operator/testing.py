"""kmock, the kopf author's Kubernetes API emulator, set up for the kubellm operator: the emulator subclass,
its resources, a kubeconfig pointing at it and kopf running the handlers in the caller's event loop.

Test support (as ``kopf.testing`` is kopf's), shared by tests/operator/ and benchmarks/operator_kmock.py. It needs
the ``dev`` extra (kmock); nothing the operator runs imports it, and the operator image leaves kmock out
(tests/delivery/test_dockerfile.py checks both).
``ApiServer`` adds to kmock just two behaviours every API server has: server-side apply creates a missing
object, and ``generateName`` gets a name (kopf's Events use it).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kmock
import kopf
import kubernetes.config.kube_config
import yaml

from kubellm.operator import api
from kubellm.operator.control import handlers

NS = "ml"
NAME = "llama"
UID = "0b8e1c1e-0000-4000-8000-000000000001"
LD_RESOURCE = kmock.resource(api.GROUP, api.VERSION, api.PLURAL)
DEPLOYMENTS = kmock.resource("apps", "v1", "deployments")
REPLICASETS = kmock.resource("apps", "v1", "replicasets")
SERVICES = kmock.resource("", "v1", "services")
PDBS = kmock.resource("policy", "v1", "poddisruptionbudgets")
HPAS = kmock.resource("autoscaling", "v2", "horizontalpodautoscalers")
PODS = kmock.resource("", "v1", "pods")
LEADER_WORKER_SETS = kmock.resource("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")
EVENTS = kmock.resource("", "v1", "events")
LD_PATH = f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{NS}/{api.PLURAL}"
CLOSE = {"Connection": "close"}  # no keep-alive: kopf waits for the server's connection tasks at exit
VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}


class ApiServer(kmock.KubernetesEmulator):
    """kmock plus server-side apply creating missing objects and generateName."""

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is not None and isinstance(request.data, dict):
            if request.action == kmock.action.CREATE:
                meta = request.data.setdefault("metadata", {})
                if not meta.get("name") and meta.get("generateName"):
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:6]
            elif request.action == kmock.action.UPDATE and "apply-patch" in request.headers.get(
                "Content-Type", ""
            ):
                key = (request.resource, request.namespace, request.name)
                async with self._lock:
                    if key not in self._objects or self._objects[key].deleted:
                        if key in self._objects:
                            self._objects[key].create(request.data)
                        else:
                            self._objects[key] = request.data
                        event = {"type": "ADDED", "object": self._objects[key].raw}
                        await self._buses[request.resource].put(event)
        return await super()._handle(request)


def declare_resources(server: kmock.KubernetesEmulator) -> None:
    info = kmock.ResourceInfo
    server.resources["v1/namespaces"] = info(kind="Namespace", namespaced=False, verbs=VERBS)
    server.resources[f"{api.GROUP}/{api.VERSION}/{api.PLURAL}"] = info(
        kind=api.KIND, singular=api.SINGULAR, namespaced=True, verbs=VERBS, subresources={"status", "scale"}
    )
    for res, kind in (
        ("apps/v1/deployments", "Deployment"),
        ("apps/v1/replicasets", "ReplicaSet"),
        ("v1/services", "Service"),
        ("policy/v1/poddisruptionbudgets", "PodDisruptionBudget"),
        ("autoscaling/v2/horizontalpodautoscalers", "HorizontalPodAutoscaler"),
        ("v1/pods", "Pod"),
        ("v1/events", "Event"),
    ):
        server.resources[res] = info(kind=kind, namespaced=True, verbs=VERBS, subresources={"status"})


def declare_leader_worker_sets(server: kmock.KubernetesEmulator) -> None:
    """The LeaderWorkerSet CRD installed (the LWS controller is not: tests patch the status in)."""
    server.resources["leaderworkerset.x-k8s.io/v1/leaderworkersets"] = kmock.ResourceInfo(
        kind="LeaderWorkerSet", namespaced=True, verbs=VERBS, subresources={"status", "scale"}
    )


def write_kubeconfig(server, path: Path, user: str = "test") -> Path:
    """A kubeconfig pointing the official client (and so the operator) at the kmock server."""
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": str(server.url).rstrip("/")}}],
                "users": [{"name": user, "user": {"token": f"{user}-token"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": user}}],
                "current-context": "kmock",
            }
        )
    )
    return path


async def start_operator(
    *, clusterwide: bool = True, namespaces: list[str] | None = None, scanning: bool = False
) -> tuple[kopf.Memo, asyncio.Event, asyncio.Task, set]:
    """Run kopf with the kubellm handlers in this event loop; returns (memo, stop flag, runner, ignored tasks).
    ``scanning``: CRD and namespace scanning as ``kubellm operator`` has it (off: the tests declare resources).

    kopf.operator() waits 5 s at exit for "hung" tasks started after it (a fixture's own teardown task among
    them) and then cancels them: run its parts directly and tell it which tasks are ours (add to ``ignored``).
    """
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = not scanning
    settings.watching.reconnect_backoff = 0.1
    settings.posting.default_backoffs = [0.1]
    memo = kopf.Memo()
    stop, ready = asyncio.Event(), asyncio.Event()
    ignored = set(asyncio.all_tasks())
    tasks = await kopf.spawn_tasks(
        registry=kopf.get_default_registry(),
        settings=settings,
        clusterwide=clusterwide,
        namespaces=namespaces or [],
        standalone=True,
        stop_flag=stop,
        ready_flag=ready,
        memo=memo,
    )
    runner = asyncio.create_task(kopf.run_tasks(tasks, ignored=ignored))
    ignored.add(runner)
    await asyncio.wait_for(ready.wait(), timeout=15)
    await until(lambda: getattr(memo, "kubellm", None), "the startup handler to run")
    return memo, stop, runner, ignored


@contextlib.asynccontextmanager
async def operator_running(server, tmp_path: Path, monkeypatch, *, observe_interval: float = 2.0,
                           **start: Any) -> AsyncIterator[kopf.Memo]:
    """kopf running the handlers in this event loop, logged in to ``server`` through a kubeconfig (pytest's
    ``monkeypatch`` points the official client at it and shortens the observer's timers); yields the whole
    memo and stops the operator on exit. ``start``: :func:`start_operator`'s keywords."""
    kubeconfig = write_kubeconfig(server, tmp_path / "kubeconfig")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    monkeypatch.setattr(handlers, "OBSERVE_INTERVAL", observe_interval)
    monkeypatch.setattr(handlers, "OBSERVE_DEBOUNCE", 0.05)
    memo, stop, runner, ignored = await start_operator(**start)
    try:
        yield memo
    finally:
        ignored.add(asyncio.current_task())
        stop.set()
        await asyncio.wait_for(runner, timeout=15)


async def until(predicate: Callable[[], Any], what: str, timeout: float = 15.0) -> Any:
    """Poll ``predicate`` until it returns something truthy (its value), or fail after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    last_error: Exception | None = None
    while asyncio.get_running_loop().time() < deadline:
        try:
            result = predicate()
            if result:
                return result
        except (KeyError, LookupError, TypeError, ValueError, AttributeError) as e:
            last_error = e
        await asyncio.sleep(0.05)
    raise AssertionError(
        f"timed out waiting for {what}" + (f" (last error: {last_error!r})" if last_error else "")
    )


async def create(server, body: dict) -> None:
    async with server.post(LD_PATH, json=body, headers=CLOSE) as resp:
        assert resp.status < 300, await resp.text()
