"""Validation rules, written once for two enforcers: CEL in the API server, Python in the operator.

:class:`Rule` holds a cross-field check as CEL (emitted as ``x-kubernetes-validations`` in the CRD) and its
Python twin with the same message; :class:`KubeModel`, the base of every API model, enforces the rules in
``k8s_rules`` on validation and emits them into its JSON schema.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError


@dataclass(frozen=True)
class Rule:
    """A cross-field check, written once for both the API server and the operator.

    ``rule`` is CEL with ``self`` bound to the object the rule is attached to (and ``oldSelf`` to its
    previous value: such *transition* rules run on updates only). ``check`` is its Python twin on the
    pydantic model: it returns True when the object is valid (a transition rule's check takes
    ``(new, old)``). When the message depends on the object, ``message_expression`` (CEL) and
    ``explain`` (Python) build it; ``message`` is then the fallback older API servers show.
    Keep ``rule`` to core CEL (has, size, comparisons, ternary, in, matches, string()); the test suite
    evaluates it with cel-python, which has no Kubernetes extension libraries.
    """

    rule: str
    message: str
    check: Callable[..., bool]
    message_expression: str | None = None
    explain: Callable[..., str] | None = None
    field_path: str | None = None  # the field the API server blames, relative to the rule's object

    @property
    def transition(self) -> bool:
        return "oldSelf" in self.rule

    def violation(self, obj: Any, old: Any = None) -> str | None:
        """The message when ``obj`` breaks this rule, else None (transition rules need ``old``)."""
        if self.transition:
            if old is None or self.check(obj, old):
                return None
        elif self.check(obj):
            return None
        return self.explain(obj) if self.explain else self.message

    def to_crd(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rule": self.rule, "message": self.message}
        if self.message_expression:
            out["messageExpression"] = self.message_expression
        if self.field_path:
            out["fieldPath"] = self.field_path
        return out


def _add_rules_to_schema(schema: dict[str, Any], cls: type) -> None:
    rules = getattr(cls, "k8s_rules", ())
    if rules:
        schema["x-kubernetes-validations"] = [r.to_crd() for r in rules]


def raise_violations(messages: list[str]) -> None:
    if messages:
        text = messages[0] if len(messages) == 1 else "\n".join(f"- {m}" for m in messages)
        raise PydanticCustomError("kubellm_rule", "{messages}", {"messages": text})


class KubeModel(BaseModel):
    """Base of every API model: camelCase JSON names, rules from ``k8s_rules`` enforced on validation."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        use_attribute_docstrings=True,
        json_schema_extra=_add_rules_to_schema,
        extra="forbid",
    )
    k8s_rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_k8s_rules(self) -> KubeModel:
        raise_violations([m for r in self.k8s_rules if (m := r.violation(self)) is not None])
        return self

    def to_k8s(self) -> dict[str, Any]:
        """The JSON object the API server would hold: camelCase names, unset (None) fields left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class StatusModel(KubeModel):
    model_config = ConfigDict(extra="ignore")


def nested(factory: type[KubeModel]) -> Any:
    """A nested object that is always present: defaulted to ``{}`` so the API server fills in its defaults."""
    return Field(default_factory=factory, json_schema_extra={"default": {}})
