"""``kubellm render -f FILE``: LLMDeployment manifests in, the children the operator would create out (YAML).

:func:`load` applies the CRD's defaults the way the API server does before the spec is rendered.
"""

from __future__ import annotations

import argparse
import copy
import functools
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kubellm.operator import api
from kubellm.operator.crd import schema as crd_schema
from kubellm.operator.render import InvalidSpec, render
from kubellm.operator.render.autoscaling import DEFAULT_PROMETHEUS_URL
from kubellm.operator.render.validation import format_validation_error


@functools.cache
def _crd_schema() -> dict[str, Any]:
    return crd_schema.crd_schema()  # read-only here: apply_defaults copies the defaults it inserts


def load(obj: dict[str, Any]) -> api.LLMDeployment:
    """An LLMDeployment from a manifest, with the CRD's defaults applied the way the API server applies them
    (``obj`` is not changed). Raises :class:`InvalidSpec` when it is not a valid LLMDeployment."""
    if not isinstance(obj, dict):
        raise InvalidSpec(f"expected a mapping, got {type(obj).__name__}")
    if obj.get("apiVersion") != api.API_VERSION or obj.get("kind") != api.KIND:
        raise InvalidSpec(
            f"expected apiVersion {api.API_VERSION} kind {api.KIND}, got apiVersion {obj.get('apiVersion')} "
            f"kind {obj.get('kind')}"
        )
    doc = crd_schema.apply_defaults(_crd_schema(), copy.deepcopy(obj))
    try:
        return api.LLMDeployment.model_validate(doc)
    except ValidationError as e:
        raise InvalidSpec(format_validation_error(e, "")) from None


def to_yaml(manifests: Iterable[dict[str, Any]]) -> str:
    """Multi-document YAML, every document starting with ``---``."""
    return "".join(
        "---\n"
        + yaml.safe_dump(m, sort_keys=False, width=2**16, allow_unicode=True, default_flow_style=False)
        for m in manifests
    )


def main(argv: list[str] | None = None) -> int:
    """``kubellm render -f FILE``: print the objects the operator would create, as multi-document YAML."""
    parser = argparse.ArgumentParser(
        prog="kubellm render",
        description="Print the Kubernetes objects the operator creates for LLMDeployments (multi-document "
        "YAML), with the CRD's defaults applied. Children get no ownerReferences when the input has no "
        "metadata.uid (files do not).",
    )
    parser.add_argument(
        "-f", "--filename", action="append", required=True,
        help="YAML file with one or more LLMDeployment documents, - for stdin; repeatable",
    )  # fmt: skip
    parser.add_argument(
        "-n", "--namespace",
        help="namespace of LLMDeployments that name none (default: default); one that names another is an error",
    )  # fmt: skip
    parser.add_argument(
        "--service-monitor-available", action="store_true",
        help="render ServiceMonitors for monitoring.serviceMonitor Auto, as if the CRD were installed",
    )  # fmt: skip
    parser.add_argument(
        "--prometheus-url", default=DEFAULT_PROMETHEUS_URL,
        help=f"Prometheus the KEDA trigger queries (default {DEFAULT_PROMETHEUS_URL})",
    )  # fmt: skip
    parser.add_argument(
        "--activator-url", default=None,
        help="the activator's admin base URL, as the operator's --activator-url (the chart's: "
        "http://kubellm-activator.kubellm-system.svc:9090); scale-to-zero ScaledObjects poll it (default: none)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    out: list[dict[str, Any]] = []
    for filename in args.filename:
        try:
            text = sys.stdin.read() if filename == "-" else Path(filename).read_text()
            docs = list(yaml.safe_load_all(text))
        except (OSError, yaml.YAMLError) as e:
            print(f"kubellm render: {filename}: {e}", file=sys.stderr)
            return 2
        for index, doc in enumerate(docs, start=1):
            if doc is None:
                continue
            where = f"{filename}: document {index}"
            try:
                if isinstance(doc, dict):
                    meta = doc.setdefault("metadata", {}) or {}
                    doc["metadata"] = meta
                    where += f" ({meta.get('name')})" if meta.get("name") else ""
                    if args.namespace and meta.get("namespace") not in (None, args.namespace):
                        raise InvalidSpec(
                            f"metadata.namespace {meta['namespace']} does not match --namespace {args.namespace}"
                        )
                    meta.setdefault("namespace", args.namespace or "default")
                ld = load(doc)
                out += render(
                    ld,
                    service_monitor_available=args.service_monitor_available,
                    prometheus_url=args.prometheus_url,
                    activator_url=args.activator_url,
                )
            except InvalidSpec as e:
                print(f"kubellm render: {where}: {e}", file=sys.stderr)
                return 2
    sys.stdout.write(to_yaml(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
