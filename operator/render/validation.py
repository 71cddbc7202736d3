"""Validation beyond the API's rules: what a spec needs before it can be rendered, checked once per render.

:func:`validate` is the only check; :func:`.render` runs it first and every ``render_<kind>`` function takes an
LLMDeployment that passed it.
"""

from __future__ import annotations

import re

from pydantic import ValidationError

from kubellm.operator import api
from kubellm.operator.render.naming import (
    DNS1123_SUBDOMAIN,
    MAX_NAME_LENGTH,
    PODS_SERVICE_SUFFIX,
    SPEC_HASH_ANNOTATION,
    InvalidSpec,
    is_multi_node,
    labels,
    object_name,
    pods_service_name,
    scales_to_zero,
)
from kubellm.operator.render.pods import CACHE_DIR, SHM_DIR, TMP_DIR

_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def _label_key_problem(key: str) -> str | None:
    prefix, _, name = key.rpartition("/")
    if "/" in prefix:
        return "has more than one '/'"
    if prefix and (len(prefix) > 253 or not DNS1123_SUBDOMAIN.match(prefix)):
        return "has a prefix that is not a DNS subdomain (lowercase, e.g. example.com)"
    if not name or len(name) > 63 or not _QUALIFIED_NAME.match(name):
        return (
            "needs a name part of at most 63 alphanumerics, '-', '_' or '.', starting and ending alphanumeric"
        )
    return None


def _check_labels(field: str, values: dict[str, str]) -> list[str]:
    problems = []
    for key, value in values.items():
        if (why := _label_key_problem(key)) is not None:
            problems.append(f"{field}: key {key!r} {why}")
        if len(value) > 63 or not _LABEL_VALUE.match(value):
            problems.append(
                f"{field}: value {value!r} of {key!r} must be at most 63 alphanumerics, '-', '_' or '.', "
                "starting and ending alphanumeric"
            )
    return problems


def format_validation_error(error: ValidationError, prefix: str) -> str:
    lines = []
    for e in error.errors():
        where = ".".join(str(p) for p in (prefix, *e["loc"]) if p != "")
        lines.append(f"{where}: {e['msg']}")
    return lines[0] if len(lines) == 1 else "\n".join(f"- {line}" for line in lines)


def validate(ld: api.LLMDeployment) -> None:
    """Raise :class:`InvalidSpec` when ``ld`` cannot be rendered.

    Re-runs the API's own validators (the CEL rules' Python twins, so specs from API servers without CEL or
    objects built without validation are caught too), then the checks only rendering needs: metadata.name,
    podLabels/podAnnotations/nodeSelector syntax, no overriding of the labels, annotation and environment
    variable the operator manages, model paths the pod's own volumes would hide, the name of the Service a
    deployment that scales to zero adds, and what a LeaderWorkerSet refuses that a Deployment accepts.
    """
    object_name(ld)
    spec = ld.spec
    try:
        api.LLMDeploymentSpec.model_validate(spec.model_dump(mode="json", by_alias=True, exclude_none=True))
    except ValidationError as e:
        raise InvalidSpec(format_validation_error(e, "spec")) from None
    problems: list[str] = []
    managed = labels(ld)
    problems += _check_labels("spec.podLabels", spec.pod_labels or {})
    for key in spec.pod_labels or {}:
        if key in managed:
            problems.append(f"spec.podLabels: {key} is set by the operator; remove it")
    problems += _check_labels("spec.nodeSelector", spec.node_selector or {})
    product = spec.resources.gpu.product
    chosen = (spec.node_selector or {}).get(api.GPU_PRODUCT_LABEL)
    if product is not None and spec.gpu_count > 0 and chosen is not None and chosen != product:
        problems.append(
            f"spec.nodeSelector[{api.GPU_PRODUCT_LABEL}]={chosen} contradicts resources.gpu.product={product}; "
            "set only resources.gpu.product"
        )
    for key in spec.pod_annotations or {}:
        if (why := _label_key_problem(key)) is not None:
            problems.append(f"spec.podAnnotations: key {key!r} {why}")
        if key == SPEC_HASH_ANNOTATION:
            problems.append(f"spec.podAnnotations: {key} is set by the operator; remove it")
    for env in spec.env or ():
        if env.name == "KUBELLM_CACHE":
            problems.append(
                f"spec.env: KUBELLM_CACHE is set by the operator (the {CACHE_DIR} volume); remove it"
            )
    problems += _check_model_uri("spec.model.uri", spec.model.uri)
    if (draft := spec.engine.speculative.model) is not None:
        problems += _check_model_uri("spec.engine.speculative.model.uri", draft.uri)
    if problems:
        raise InvalidSpec(problems[0] if len(problems) == 1 else "\n".join(f"- {p}" for p in problems))
    if scales_to_zero(ld):
        _check_pods_service_name(ld)
    if is_multi_node(ld):
        _check_leader_worker_set(ld)


def _check_model_uri(field: str, uri: str) -> list[str]:
    """Model paths the pod's own volumes would hide, or that leave their claim."""
    problems = []
    if uri.startswith("pvc://"):
        _, _, sub = uri.removeprefix("pvc://").partition("/")
        if ".." in sub.split("/"):
            problems.append(f"{field}: {uri} has a '..' path element; give a path inside the claim")
    elif uri.startswith("file://"):
        path = uri.removeprefix("file://")
        for hidden in (CACHE_DIR, TMP_DIR, SHM_DIR):
            if path == hidden or path.startswith(f"{hidden}/"):
                problems.append(
                    f"{field}: {uri} lies under {hidden}, which the pod mounts an empty volume over; "
                    "put the model elsewhere in the image"
                )
    return problems


def _check_pods_service_name(ld: api.LLMDeployment) -> None:
    """The activator reaches the pods through ``<name>-pods``, a DNS-1035 label of at most 63 characters."""
    name = pods_service_name(ld)
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidSpec(
            f"autoscaling.minReplicas 0 needs a Service {name!r} for the activator to reach the pods, which is "
            f"longer than {MAX_NAME_LENGTH} characters: shorten metadata.name to at most "
            f"{MAX_NAME_LENGTH - len(PODS_SERVICE_SUFFIX)} characters"
        )


def _check_leader_worker_set(ld: api.LLMDeployment) -> None:
    """What the LWS admission webhook refuses that a Deployment accepts: rollout percentages above 100%."""
    for field in ("max_surge", "max_unavailable"):
        value = getattr(ld.spec.rollout, field)
        if isinstance(value, str) and value.endswith("%") and int(value[:-1]) > 100:
            camel = "maxSurge" if field == "max_surge" else "maxUnavailable"
            raise InvalidSpec(
                f"spec.rollout.{camel} {value}: a LeaderWorkerSet (parallelism.nodes > 1) takes at most 100%"
            )
