"""The InferencePool as the gateways report it: pure functions, like :mod:`.status`.

A gateway that uses the pool (through an HTTPRoute's backendRef) writes an entry in the pool's
``status.parents`` with two conditions: ``Accepted`` (it routes to the pool) and ``ResolvedRefs`` (it found
the endpoint picker). :func:`pool_status` copies them into the LLMDeployment's ``status.inferencePool``, and
:func:`pool_events` turns their changes into Events, so that ``kubectl describe llmd`` says why a gateway does
not route (for example ``EndpointPickerRefMissing``, or an EPP Service that does not exist) without anyone
having to know the pool is there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubellm.operator import api
from kubellm.operator.status.observe import Event

CONDITIONS = ("Accepted", "ResolvedRefs")  # the pool's parent conditions, in the order a failure is named


def _truth(conditions: list[Mapping[str, Any]], type_: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions if c.get("type") == type_), None)


def _parent(entry: Mapping[str, Any], namespace: str) -> api.PoolParentStatus:
    ref = entry.get("parentRef") or {}
    conditions = [c for c in entry.get("conditions") or [] if isinstance(c, Mapping)]
    found = {t: _truth(conditions, t) for t in CONDITIONS}
    flags = {t: {"True": True, "False": False}.get((c or {}).get("status")) for t, c in found.items()}
    failed = next((found[t] for t in CONDITIONS if flags[t] is False), None) or {}
    return api.PoolParentStatus(
        parent=f"{ref.get('kind') or 'Gateway'} {ref.get('namespace') or namespace}/{ref.get('name', '')}",
        accepted=flags["Accepted"],
        resolved_refs=flags["ResolvedRefs"],
        reason=failed.get("reason") or None,
        message=failed.get("message") or None,
    )


def pool_status(pool: Mapping[str, Any] | None) -> api.InferencePoolStatus | None:
    """``status.inferencePool`` from the owned InferencePool as the API returns it (None: not there yet)."""
    if pool is None:
        return None
    meta = pool.get("metadata") or {}
    entries = [e for e in (pool.get("status") or {}).get("parents") or [] if isinstance(e, Mapping)]
    parents = [_parent(e, meta.get("namespace") or "default") for e in entries]
    return api.InferencePoolStatus(name=meta.get("name"), parents=parents or None)


def _refused(parent: api.PoolParentStatus) -> bool:
    return parent.accepted is False or parent.resolved_refs is False


def pool_events(
    previous: api.InferencePoolStatus | None, new: api.InferencePoolStatus | None
) -> list[Event]:
    """A Warning when a gateway newly refuses the pool (or refuses it for a new reason), a Normal Event when one
    newly takes it; nothing while a parent stays as it was (the observer runs every few seconds)."""
    if new is None:
        return []
    before = {p.parent: p for p in (previous.parents if previous else None) or []}
    events = []
    for parent in new.parents or []:
        old = before.get(parent.parent)
        if _refused(parent):
            if old is None or not _refused(old) or (old.reason, old.message) != (parent.reason, parent.message):
                condition = "Accepted" if parent.accepted is False else "ResolvedRefs"
                events.append(Event("Warning", "InferencePoolNotAccepted",
                                    f"{parent.parent} does not route to InferencePool {new.name}: {condition}=False "
                                    f"{parent.reason or ''}: {parent.message or ''}".rstrip(": ")))  # fmt: skip
        elif parent.accepted and (old is None or not old.accepted or _refused(old)):
            events.append(Event("Normal", "InferencePoolAccepted", f"{parent.parent} routes to InferencePool {new.name}"))
    return events
