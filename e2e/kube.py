"""kubectl for the end-to-end suite: every call names one context, reads JSON, and waits with a deadline.

The suite talks to the cluster only through the kubectl binary (the same path a user takes), never through
a client library, so what it exercises is what `kubectl apply` / `kubectl wait` / `kubectl describe` show.
"""

from __future__ import annotations

import json
import queue
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


class KubectlError(RuntimeError):
    """kubectl exited non-zero; the message holds the command and its stderr."""


@dataclass(frozen=True)
class Kubectl:
    """kubectl bound to one context (never the ambient current-context) and optionally one namespace."""

    context: str
    namespace: str | None = None

    def in_namespace(self, namespace: str) -> Kubectl:
        return Kubectl(self.context, namespace)

    def command(self, *args: str) -> list[str]:
        cmd = ["kubectl", "--context", self.context]
        if self.namespace:
            cmd += ["--namespace", self.namespace]
        return [*cmd, *args]

    def run(self, *args: str, stdin: str | None = None, timeout: float = 120, check: bool = True) -> str:
        """Run kubectl; return stdout. Raises :class:`KubectlError` on a non-zero exit when ``check``."""
        cmd = self.command(*args)
        try:
            result = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise KubectlError(f"{' '.join(cmd)}: no answer in {timeout:.0f}s") from e
        if check and result.returncode != 0:
            raise KubectlError(f"{' '.join(cmd)} exited {result.returncode}: {result.stderr.strip()}")
        return result.stdout

    def json(self, *args: str, timeout: float = 60) -> Any:
        return json.loads(self.run(*args, "--output", "json", timeout=timeout))

    def get(self, kind: str, name: str) -> dict | None:
        """The object, or None when it does not exist."""
        out = self.run("get", kind, name, "--ignore-not-found", "--output", "json")
        return json.loads(out) if out.strip() else None

    def apply(self, manifest: dict) -> None:
        """``kubectl apply -f -`` of one object (JSON is YAML, so no temp file and no yaml dump)."""
        self.run("apply", "--filename", "-", stdin=json.dumps(manifest))

    def events_for(self, kind: str, name: str) -> list[dict]:
        """Events whose involvedObject is this object, oldest first."""
        items = self.json(
            "get", "events", "--field-selector", f"involvedObject.kind={kind},involvedObject.name={name}"
        )["items"]
        return sorted(items, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")

    def diagnostics(self, kind: str, name: str) -> str:
        """What a human would look at when a wait fails: describe of the object and of its pods."""
        parts = []
        for args in (("describe", kind, name), ("get", "pods", "--output", "wide"),
                     ("describe", "pods", "--selector", f"kubellm.io/llmdeployment={name}")):
            try:
                parts.append(f"$ kubectl {' '.join(args)}\n{self.run(*args, timeout=30)}")
            except KubectlError as e:
                parts.append(str(e))
        return "\n".join(parts)


def wait_until(
    probe: Callable[[], T | None],
    *,
    timeout: float,
    what: str,
    interval: float = 5.0,
    diagnostics: Callable[[], str] | None = None,
) -> T:
    """Call ``probe`` until it returns something truthy (returned), or fail after ``timeout`` seconds.

    A probe that raises :class:`KubectlError` counts as "not yet" (the API server may be briefly busy); the
    last such error goes into the failure message together with ``diagnostics()``.
    """
    deadline = time.monotonic() + timeout
    last_error: str | None = None
    while True:
        try:
            value = probe()
            if value:
                return value
        except KubectlError as e:
            last_error = str(e)
        if time.monotonic() >= deadline:
            detail = f"\nlast kubectl error: {last_error}" if last_error else ""
            extra = f"\n{diagnostics()}" if diagnostics else ""
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{detail}{extra}")
        time.sleep(interval)


@contextmanager
def _background_kubectl(kube: Kubectl, args: list[str], ready: re.Pattern[str], timeout: float) -> Iterator[int]:
    """Start a long-running kubectl (port-forward, proxy), yield the local port its first output line names."""
    proc = subprocess.Popen(
        kube.command(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:  # keeps the pipe drained for the whole life of the process
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    seen = []
    try:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or proc.poll() is not None:
                raise KubectlError(f"kubectl {' '.join(args)} did not start: {''.join(seen).strip()}")
            try:
                line = lines.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            seen.append(line)
            if match := ready.search(line):
                break
        yield int(match.group(1))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def port_forward(kube: Kubectl, target: str, remote_port: int, timeout: float = 30) -> AbstractContextManager[int]:
    """``kubectl port-forward TARGET :PORT``; yields the local port. One pod behind it for its whole life."""
    return _background_kubectl(
        kube, ["port-forward", target, f":{remote_port}"], re.compile(r"Forwarding from 127\.0\.0\.1:(\d+)"), timeout
    )


def api_proxy(kube: Kubectl, timeout: float = 30) -> AbstractContextManager[int]:
    """``kubectl proxy`` on a free local port; yields the port.

    Requests to ``service_proxy_url`` go through the API server's service proxy, which picks a ready endpoint
    for each request, so traffic follows a rollout the way in-cluster clients of the Service see it (a
    port-forward stays pinned to the pod it first chose and breaks when that pod goes away).
    """
    return _background_kubectl(
        kube, ["proxy", "--port", "0"], re.compile(r"Starting to serve on 127\.0\.0\.1:(\d+)"), timeout
    )


def service_proxy_url(proxy_port: int, namespace: str, service: str, port_name: str, path: str = "") -> str:
    return f"http://127.0.0.1:{proxy_port}/api/v1/namespaces/{namespace}/services/http:{service}:{port_name}/proxy{path}"


def cluster_problem(context: str | None) -> str | None:
    """Why the suite cannot run against ``context`` (None when it can), in words for a skip message."""
    if shutil.which("kubectl") is None:
        return "kubectl is not on PATH"
    if not context:
        return (
            "KUBELLM_E2E_CONTEXT is not set. e2e/kind.sh builds the images, starts a kind cluster and sets it; "
            "to use a cluster of your own, set it to a kubectl context of a disposable cluster that runs the "
            "kubellm chart and the images under test"
        )
    contexts = subprocess.run(["kubectl", "config", "get-contexts", "--output", "name"],
                              capture_output=True, text=True, timeout=30)
    if contexts.returncode != 0 or context not in contexts.stdout.split():
        detail = contexts.stderr.strip() or f"known contexts: {contexts.stdout.split() or 'none'}"
        return f"no kubeconfig context {context!r} ({detail}); is KUBECONFIG set?"
    try:
        info = subprocess.run(["kubectl", "--context", context, "cluster-info", "--request-timeout", "10s"],
                              capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return f"the cluster of context {context!r} did not answer kubectl cluster-info in 30s"
    if info.returncode != 0:
        last = (info.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"the cluster of context {context!r} is not reachable: {last}"
    return None
