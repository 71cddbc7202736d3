"""Field types Kubernetes has and pydantic lacks: quantities, int-or-percent, core/v1 objects kept verbatim."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any

from pydantic import AfterValidator, WithJsonSchema

# Kubernetes resource.Quantity without a sign, as the API server's own regex writes it.
QUANTITY_PATTERN = (  # fmt: skip
    r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
PERCENT_PATTERN = r"^[0-9]+%$"
_QUANTITY_SUFFIXES = {
    "": 1, "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": 10**3, "M": 10**6,
    "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
    "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip


def parse_quantity(value: int | str) -> Decimal:
    """A Kubernetes quantity (``2``, ``"500m"``, ``"16Gi"``, ``"1e3"``) as a Decimal in base units."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"quantity {value} is negative")
        return Decimal(value)
    text = str(value)
    if not re.fullmatch(QUANTITY_PATTERN, text):
        raise ValueError(f"{text!r} is not a Kubernetes quantity (e.g. 500m, 2, 16Gi, 1.5G)")
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", text)
    try:
        if m and m.group(2) in _QUANTITY_SUFFIXES:
            return Decimal(m.group(1)) * Decimal(_QUANTITY_SUFFIXES[m.group(2)])
        return Decimal(text)  # exponent form, 1e3
    except InvalidOperation as e:  # pragma: no cover - the pattern rules these out
        raise ValueError(f"{text!r} is not a Kubernetes quantity") from e


def _quantity(value: int | str) -> int | str:
    parse_quantity(value)
    return value


def _int_or_percent(value: int | str) -> int | str:
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"must be >= 0, got {value}")
    elif not re.fullmatch(PERCENT_PATTERN, value):
        raise ValueError(f"must be a non-negative integer or a percentage like '25%', got {value!r}")
    return value


Quantity = Annotated[
    int | str,
    AfterValidator(_quantity),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "x-kubernetes-int-or-string": True,
            "pattern": QUANTITY_PATTERN,
            "minimum": 0,
        }
    ),
]
IntOrPercent = Annotated[
    int | str,
    AfterValidator(_int_or_percent),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "x-kubernetes-int-or-string": True,
            "pattern": PERCENT_PATTERN,
            "minimum": 0,
        }
    ),
]


def _sorted_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted_keys(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted_keys(v) for v in value]
    return value


# A core/v1 object kept verbatim (affinity, env valueFrom): the API server keeps its fields unpruned
# and the pod's own validation checks them. Keys are sorted, so rendered manifests do not depend on the key
# order of the input (GitOps diffs of `kubellm render` stay stable).
FreeForm = Annotated[
    dict[str, Any],
    AfterValidator(_sorted_keys),
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]
