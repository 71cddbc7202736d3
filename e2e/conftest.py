"""Fixtures of the end-to-end suite: the cluster (or a skip that says why there is none), a fresh namespace.

Settings come from the environment; e2e/kind.sh sets them all:

* ``KUBELLM_E2E_CONTEXT``: the kubectl context to test against. Nothing runs without it, so the suite
  never touches whatever cluster happens to be the current context.
* ``KUBELLM_E2E_RUNTIME_IMAGE``: the runtime-cpu image the LLMDeployments run (default
  kubellm/runtime-cpu:e2e), built with BAKE_DEMO_MODEL=1; ``KUBELLM_E2E_PULL_POLICY`` (IfNotPresent).
* ``KUBELLM_E2E_STRICT=1``: a missing cluster fails the run instead of skipping it (kind.sh, CI).
* ``KUBELLM_E2E_ARTIFACTS``: a folder for the namespace's objects, Events and pod logs, written at the end.
* ``KUBELLM_E2E_KEEP_NAMESPACE=1``: leave the test namespace behind for a look.
* ``KUBELLM_E2E_READY_TIMEOUT``: seconds an LLMDeployment gets to become Ready (default 900).
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# e2e/ is not a package; make its helper modules importable whatever pytest's import mode.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kube import Kubectl, KubectlError, cluster_problem  # noqa: E402


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0", "false")


@pytest.fixture(scope="session")
def kube() -> Kubectl:
    """kubectl bound to KUBELLM_E2E_CONTEXT; skips the test (or fails it, when strict) without a cluster."""
    context = os.environ.get("KUBELLM_E2E_CONTEXT")
    problem = cluster_problem(context)
    if problem is not None:
        if _env_flag("KUBELLM_E2E_STRICT"):
            pytest.fail(f"no cluster to test against: {problem}", pytrace=False)
        pytest.skip(f"end-to-end tests need a Kubernetes cluster: {problem}")
    assert context is not None
    return Kubectl(context)


@pytest.fixture(scope="session")
def runtime_image() -> str:
    return os.environ.get("KUBELLM_E2E_RUNTIME_IMAGE", "kubellm/runtime-cpu:e2e")


@pytest.fixture(scope="session")
def pull_policy() -> str:
    return os.environ.get("KUBELLM_E2E_PULL_POLICY", "IfNotPresent")


@pytest.fixture(scope="session")
def ready_timeout() -> float:
    return float(os.environ.get("KUBELLM_E2E_READY_TIMEOUT", "900"))


@pytest.fixture(scope="session")
def namespace(kube: Kubectl) -> Iterator[Kubectl]:
    """A new namespace enforcing Pod Security "restricted" (what the operator's pods are built to pass).

    Removed at the end (unless KUBELLM_E2E_KEEP_NAMESPACE=1), after its objects, Events and logs are written
    to KUBELLM_E2E_ARTIFACTS when that is set.
    """
    name = f"kubellm-e2e-{secrets.token_hex(3)}"
    kube.run("create", "namespace", name)
    kube.run("label", "namespace", name, "pod-security.kubernetes.io/enforce=restricted",
             "app.kubernetes.io/part-of=kubellm-e2e")
    ns = kube.in_namespace(name)
    try:
        yield ns
    finally:
        if artifacts := os.environ.get("KUBELLM_E2E_ARTIFACTS"):
            _save_namespace(ns, Path(artifacts) / name)
        if not _env_flag("KUBELLM_E2E_KEEP_NAMESPACE"):
            kube.run("delete", "namespace", name, "--wait=false", check=False)


def _save_namespace(ns: Kubectl, folder: Path) -> None:
    """Best effort: a failing kubectl here must not hide the test's own failure."""
    folder.mkdir(parents=True, exist_ok=True)
    dumps = {
        "objects.yaml": ("get", "llmd,deployments,replicasets,pods,services,hpa,pdb,endpointslices",
                         "--output", "yaml"),
        "llmd-describe.txt": ("describe", "llmd"),
        "hpa-describe.txt": ("describe", "hpa"),
        "pods-describe.txt": ("describe", "pods"),
        "events.txt": ("get", "events", "--sort-by", ".lastTimestamp"),
        "pod-logs.txt": ("logs", "--selector", "app.kubernetes.io/name=kubellm", "--all-containers",
                         "--prefix", "--tail", "2000", "--max-log-requests", "20"),
    }
    for filename, args in dumps.items():
        try:
            (folder / filename).write_text(ns.run(*args, timeout=60, check=False))
        except KubectlError as e:
            (folder / filename).write_text(str(e))
