"""kopf wiring of the LLMDeployment operator: thin glue between the API server, :mod:`kubellm.operator.render` and
:mod:`kubellm.operator.status`.

* **Reconcile** (``@kopf.on.create/update/resume``): parse the object and check it once, render its children
  once and apply them (:func:`.children.apply_children`: server-side apply, field manager ``kubellm-operator``, forced; owned
  children no longer rendered are deleted). An invalid spec (a pydantic error, a transition rule, or render's
  ``InvalidSpec``) touches no child: the status says InvalidSpec, a Warning Event says why, and the handler
  returns (no retry: the next spec change runs it again). API errors raise ``kopf.TemporaryError`` with a
  backoff; anything unexpected is logged and retried the same way, and the status says ReconcileFailed.
* **Observe** (``@kopf.daemon`` per LLMDeployment): :func:`.observer.observe_once` reads the owned Deployment,
  the HPA and the pods, calls :func:`.observe.observe`, patches the status subresource when it changed and
  posts the Events. It runs every ``OBSERVE_INTERVAL`` seconds and at once (debounced) when an owned
  Deployment, HPA or pod changes (``@kopf.on.event`` handlers poke it, found through the ``by_label`` index)
  or a reconcile finishes. It observes a new generation only after the reconcile of that generation finished
  (:meth:`.tracking.Tracked.due`), so ``observedGeneration`` means "the children reflect this spec".

kopf stores its progress and last-handled configuration in ``kubellm.io/*`` annotations (the status schema is
structural, so kopf's default ``status.kopf`` would be pruned) and, because daemons need it, the finalizer
``kubellm.io/finalizer``. Only warnings and errors of kopf's own logs become Events. API access is
:mod:`.kube`, the status writes :mod:`.observer`, what the operator remembers per object :mod:`.tracking`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

import kopf
from pydantic import ValidationError

from kubellm.operator import api
from kubellm.operator.control import metrics, observer
from kubellm.operator.control.children import LABEL, apply_children, read_deployment
from kubellm.operator.control.kube import ApiError, Kube
from kubellm.operator.control.tracking import Key, OperatorState, Reconciled, key_of
from kubellm.operator.render import InvalidSpec, naming, render_validated, validate
from kubellm.operator.render import autoscaling as autoscaling_mod
from kubellm.operator.status import observe as status_mod
from kubellm.operator.status import rollout_guard

logger = logging.getLogger(__name__)

FIELD_MANAGER = "kubellm-operator"
ANNOTATION_PREFIX = api.GROUP  # kubellm.io/... annotations for kopf's bookkeeping
FINALIZER = f"{api.GROUP}/finalizer"
OBSERVE_INTERVAL = 15.0  # seconds between observations without a child event
OBSERVE_DEBOUNCE = 0.5  # child events arriving within this window trigger one observation


def _state(memo: Any) -> OperatorState:
    state = getattr(memo, "kubellm", None)
    if state is None:
        raise kopf.TemporaryError("the operator has not finished starting up", delay=5)
    return state


def _plain(body: Any) -> dict[str, Any]:
    return json.loads(json.dumps(dict(body), default=str))


# --------------------------------------------------------------------------------------------------
# Reconcile
# --------------------------------------------------------------------------------------------------


def _backoff(retry: int) -> float:
    return float(min(2 ** min(retry, 6), 60))


def _validate(body: Mapping[str, Any], old: Mapping[str, Any] | None) -> api.LLMDeployment:
    """The LLMDeployment in ``body``, checked once for the whole reconcile: the API's rules, the transition rules
    against ``old`` (an update's previous object) and what rendering needs (:func:`.render.validate`)."""
    ld = status_mod.parse(body)
    if old and old.get("spec"):
        try:
            old_spec = api.LLMDeploymentSpec.model_validate(old["spec"])
        except ValidationError:
            old_spec = None  # the previous spec was invalid: nothing to compare with
        if old_spec is not None and (problems := api.validate_update(old_spec, ld.spec)):
            raise InvalidSpec("; ".join(problems))
    validate(ld)
    return ld


def _render(ld: api.LLMDeployment, state: OperatorState, replace_in_place: str | None) -> list[dict[str, Any]]:
    """The children of an ``ld`` that passed :func:`_validate`."""
    return render_validated(
        ld, service_monitor_available=state.service_monitor_available, prometheus_url=state.prometheus_url,
        replace_in_place=replace_in_place, activator_url=state.activator_url,
    )  # fmt: skip


@kopf.on.resume(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.create(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.update(api.GROUP, api.VERSION, api.PLURAL)
async def reconcile(
    body: kopf.Body, old: Any, reason: kopf.Reason, memo: Any, retry: int, logger: Any, **_: Any
) -> None:
    with metrics.reconciling() as outcome:
        state = _state(memo)
        raw = _plain(body)
        key = key_of(raw)
        generation = raw["metadata"].get("generation")
        # Whether this generation changed the pod template is sticky across attempts: a retry (or a second
        # reconcile of the same generation) finds the template already applied, which is no reason to
        # forget it.
        prev = state.track(key).reconciled
        seen: list[bool] = (
            [prev.template_changed] if prev and prev.generation == generation and prev.template_changed else []
        )

        def failed(message: str, delay: float) -> kopf.TemporaryError:
            """Record the failure for the observer (ReconcileFailed), wake it, and retry after ``delay``."""
            state.track(key).reconciled = Reconciled(
                generation, template_changed=any(seen) if seen else None, error=message
            )
            state.poke(key)
            metrics.note_reconcile_failing(key, True)
            return kopf.TemporaryError(message, delay=delay)

        try:
            ld = _validate(raw, old if reason == kopf.Reason.UPDATE else None)
        except (ValidationError, InvalidSpec) as e:
            message = status_mod.describe_invalid(e)
            logger.warning(f"invalid spec, children left as they are: {message}")
            state.track(key).reconciled = Reconciled(generation, invalid=message)
            try:
                await observer.report_invalid(state, key, message)
            except ApiError as api_error:
                raise kopf.TemporaryError(
                    f"could not report the invalid spec: {api_error}", delay=_backoff(retry)
                ) from e
            outcome.result = "invalid_spec"
            metrics.note_reconcile_failing(key, False)  # nothing failed to apply; InvalidSpec says the rest
            return  # not retried: only a new spec can fix it
        except Exception as e:  # a bug in parsing or validating: log it, say so in the status, retry slowly
            logger.exception("validating failed unexpectedly")
            raise failed(f"internal error: {type(e).__name__}: {e}", 60) from e

        try:
            # A rollout the guard switched to replacing pods in place keeps that strategy through a reconcile
            # (an operator restart resumes every object); render drops it when the template changed.
            carried = None
            if rollout_guard.may_replace_in_place(ld.spec):
                carried = rollout_guard.carried_in_place(await read_deployment(state.kube, ld))
            children = _render(ld, state, replace_in_place=carried)
            await apply_children(state.kube, ld, children, note_template=seen.append)
        except ApiError as e:
            raise failed(f"applying the children failed: {e}", _backoff(retry)) from e
        except Exception as e:  # a bug: log it, say so in the status, retry slowly
            logger.exception("reconcile failed unexpectedly")
            raise failed(f"internal error: {type(e).__name__}: {e}", 60) from e
        state.track(key).reconciled = Reconciled(generation, template_changed=any(seen) if seen else None)
        state.poke(key)
        metrics.note_reconcile_failing(key, False)


# --------------------------------------------------------------------------------------------------
# Observe
# --------------------------------------------------------------------------------------------------


@kopf.daemon(api.GROUP, api.VERSION, api.PLURAL, id="observe", cancellation_timeout=1.0)
async def observe_daemon(name: str, namespace: str, memo: Any, stopped: Any, logger: Any, **_: Any) -> None:
    state = _state(memo)
    key = (namespace or "default", name)
    poke = state.track(key).poke
    failures = 0
    metrics.MANAGED.inc()
    try:
        while not stopped:
            poke.clear()
            delay = state.observe_interval
            try:
                await observer.observe_once(state, key)
                failures = 0
                metrics.OBSERVATIONS.labels(result="ok").inc()
            except ApiError as e:
                failures += 1
                delay = min(state.observe_interval, _backoff(failures))
                metrics.OBSERVATIONS.labels(result="error").inc()
                logger.warning(f"observing failed (retrying in {delay:g}s): {e}")
            except Exception as e:  # never let one object kill its observer
                metrics.OBSERVATIONS.labels(result="error").inc()
                logger.exception("observing failed unexpectedly")
                await observer.report_failure(state, key, f"internal error while observing: {type(e).__name__}: {e}")
            try:
                await asyncio.wait_for(poke.wait(), timeout=delay)
                await asyncio.sleep(state.debounce)  # let a burst of child events settle
            except TimeoutError:
                pass
    finally:
        metrics.MANAGED.dec()
        metrics.note_rollout_blocked(key, False)
        metrics.note_reconcile_failing(key, None)
        state.forget(key)


@kopf.index(api.GROUP, api.VERSION, api.PLURAL)
async def by_label(namespace: str, name: str, **_: Any) -> dict[tuple[str, str], Key]:
    """LLMDeployments by (namespace, the kubellm.io/llmdeployment label value their children carry)."""
    namespace = namespace or "default"
    return {(namespace, naming.name_label_value(name)): (namespace, name)}


@kopf.on.event("apps", "v1", "deployments", labels={LABEL: kopf.PRESENT})
@kopf.on.event("autoscaling", "v2", "horizontalpodautoscalers", labels={LABEL: kopf.PRESENT})
@kopf.on.event("v1", "pods", labels={LABEL: kopf.PRESENT})
async def child_changed(
    namespace: str, labels: Mapping[str, str], memo: Any, by_label: kopf.Index, **_: Any
) -> None:
    """A child changed: wake its LLMDeployment's observer (it reads everything afresh)."""
    state = getattr(memo, "kubellm", None)
    if state is None:
        return
    for key in by_label.get((namespace or "default", labels.get(LABEL, "")), ()):
        if key in state.objects:
            state.poke(key)


# --------------------------------------------------------------------------------------------------
# Startup and entry point
# --------------------------------------------------------------------------------------------------


def configure_settings(settings: kopf.OperatorSettings) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.WARNING  # kopf's own "handler succeeded" logs stay out of Events
    settings.posting.reporting_component = FIELD_MANAGER
    settings.posting.event_name_prefix = "kubellm-"
    settings.watching.server_timeout = settings.watching.server_timeout or 300
    settings.watching.client_timeout = settings.watching.client_timeout or 330
    settings.watching.connect_timeout = settings.watching.connect_timeout or 30


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: Any, logger: Any, **_: Any) -> None:
    configure_settings(settings)
    kube = await Kube.connect(FIELD_MANAGER)
    try:
        available = await kube.serves("monitoring.coreos.com/v1", "ServiceMonitor")
    except ApiError as e:
        logger.warning(f"could not check for the ServiceMonitor CRD, assuming it is absent: {e}")
        available = False
    logger.info(f"ServiceMonitor CRD {'found' if available else 'not found'}; field manager {kube.field_manager}")
    memo.kubellm = OperatorState(
        kube=kube,
        service_monitor_available=available,
        prometheus_url=getattr(memo, "prometheus_url", None) or autoscaling_mod.DEFAULT_PROMETHEUS_URL,
        activator_service=getattr(memo, "activator_service", None),
        activator_url=getattr(memo, "activator_url", None),
        observe_interval=OBSERVE_INTERVAL,
        debounce=OBSERVE_DEBOUNCE,
    )


@kopf.on.cleanup()
async def cleanup(memo: Any, **_: Any) -> None:
    state = getattr(memo, "kubellm", None)
    if state is not None:
        state.kube.close()


def parse_activator_service(value: str) -> Key:
    """``NAMESPACE/NAME`` → (namespace, name)."""
    namespace, _, name = value.partition("/")
    if not namespace or not name or "/" in name:
        raise ValueError(f"--activator-service must be NAMESPACE/NAME, not {value!r}")
    return namespace, name


def run(
    namespaces: list[str] | None,
    all_namespaces: bool,
    liveness: str | None,
    standalone: bool,
    *,
    metrics_port: int = 0,
    prometheus_url: str = autoscaling_mod.DEFAULT_PROMETHEUS_URL,
    activator_service: str | None = None,
    activator_url: str | None = None,
) -> None:
    """Run the operator until interrupted (``kubellm operator``).

    ``namespaces``: namespaces (or kopf patterns such as ``team-*``) to serve; ``all_namespaces``: serve the
    whole cluster (exactly one of the two must be given). ``liveness``: kopf's liveness endpoint, e.g.
    ``http://0.0.0.0:8080/healthz``. ``standalone``: skip kopf peering (one operator replica).
    ``metrics_port``: serve the operator's Prometheus metrics (:mod:`.metrics`) there, 0 for none.
    ``prometheus_url``: the Prometheus that rendered KEDA ScaledObjects query.
    ``activator_service``: ``NAMESPACE/NAME`` of the activator's Service, whose ready pods the Service of a
    deployment scaled to zero is routed to; ``activator_url``: the activator's admin base URL (KEDA polls its
    activity counts). Both None: no activator (docs/autoscaling.md, "Scale from zero").
    """
    activator_key = parse_activator_service(activator_service) if activator_service else None
    if all_namespaces and namespaces:
        raise ValueError("pass either namespaces or all_namespaces, not both")
    if not all_namespaces and not namespaces:
        raise ValueError("pass namespaces to watch or all_namespaces")
    metrics.serve(metrics_port)
    kopf.configure(verbose=False)
    kopf.run(
        clusterwide=all_namespaces,
        namespaces=list(namespaces or ()),
        liveness_endpoint=liveness,
        standalone=standalone,
        memo=kopf.Memo(prometheus_url=prometheus_url, activator_service=activator_key, activator_url=activator_url),
    )
