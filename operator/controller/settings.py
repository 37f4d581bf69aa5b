"""Operator settings: environment variables, overridden by command-line flags (see :mod:`kubeps.operator.main`).

=============================  ===========================  ==========================================
Environment                    Flag                         Meaning (default)
=============================  ===========================  ==========================================
KUBEPS_NAMESPACES              --namespace (repeatable)     namespaces to watch (comma-separated)
KUBEPS_ALL_NAMESPACES          --all-namespaces             watch the whole cluster (the default when
                                                            no namespace is given)
KUBEPS_DEFAULT_IMAGE           --default-image              image of containers that name none
KUBEPS_CLUSTER_DOMAIN          --cluster-domain             appended to TF_CONFIG hosts (none)
KUBEPS_GANG_SCHEDULER         --gang-scheduler             gang scheduling backend: none, native,
                                                            volcano, scheduler-plugins (none)
KUBEPS_GANG_SCHEDULER_NAME     --gang-scheduler-name        schedulerName of the gang's pods whose
                                                            template names none (volcano:
                                                            volcano; scheduler-plugins:
                                                            scheduler-plugins-scheduler)
KUBEPS_API_QPS / _BURST        --api-qps / --api-burst      client-side API rate limit (100 / 200)
KUBEPS_WORKERS                 --workers                    concurrent reconciles and API calls (16)
KUBEPS_METRICS_PORT            --metrics-port               Prometheus /metrics port 1..65535, 0 = off
                                                            (8080); a task reads its own the same way
KUBEPS_LIVENESS_PORT           --liveness-port              /healthz port, 0 = off (8081)
KUBEPS_BIND_ADDRESS            --bind-address               address of both endpoints (0.0.0.0)
KUBEPS_LOG_LEVEL               --log-level                  DEBUG, INFO, WARNING, ERROR (INFO)
KUBEPS_KUEUE                   --kueue                      Kueue integration: on, off, or auto (on when
                                                            the API server serves kueue.x-k8s.io/v1beta2)
KOPF_RUN_PEERING               --peering NAME               run with this kopf peering object, so that
                                                            two operators never reconcile at once; the
                                                            peering CRDs must be installed (standalone)
KOPF_RUN_PRIORITY              --peering-priority           peering priority: the highest live replica
                                                            acts (default: the longest-running one;
                                                            minus its start time in ms, x1000, plus a
                                                            random tie-break)
KUBEPS_PEERING_LIFETIME        --peering-lifetime           seconds a silent peer counts as alive, i.e.
                                                            about the longest take-over after a crash (10)
KUBEPS_WATCH_SERVER_TIMEOUT    (env only)                   watch request timeout asked of the server (120 s)
KUBEPS_WATCH_CLIENT_TIMEOUT    (env only)                   client-side watch timeout (150 s)
KUBEPS_WATCH_CONNECT_TIMEOUT   (env only)                   connection timeout of watches (10 s)
KUBEPS_WATCH_INACTIVITY        (env only)                   restart a watch silent this long (180 s)
KUBEPS_NODE_LOST_AFTER         --node-lost-after            seconds without a Lease renewal (or with
                                                            Ready=False) after which a node is lost and
                                                            its pods are replaced; 0: only the node
                                                            controller's Ready=Unknown; negative: Nodes
                                                            are not watched at all (20; docs/nodes.md)
=============================  ===========================  ==========================================
"""

from __future__ import annotations

import functools
import logging
import os
import random
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Iterable, Literal, Mapping

from kubeps.operator.api.models import GangScheduler, NetworkPolicyMode
from kubeps.operator.core.children import DEFAULT_IMAGE
from kubeps.runtime.checks import (MetricsPort, PortOrZero, PositiveFloat, PositiveInt, Seconds, check, from_text,
                                   integer, number)

if TYPE_CHECKING:  # kopf itself is imported late (see kopf_settings)
    import kopf  # written once, where the pod bodies use it


def _bool(text: str | None) -> bool:
    return (text or "").strip().lower() in ("1", "true", "yes", "on")


def _read(env: Mapping[str, str], name: str, type_: Any, default: Any) -> Any:
    """Variable ``name`` checked as ``type_`` (:mod:`kubeps.runtime.checks`: the refusal names the variable, the
    value and what is allowed), or ``default`` when it is unset or blank."""
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    return check(name, raw, from_text(type_))


#: a number of seconds that may also be 0 or negative (each with its own meaning)
_ANY_SECONDS = number(allowed="a number of seconds")


KUEUE_MODES = ("auto", "on", "off")
#: the operator's log formats (``--log-format``, ``KUBEPS_LOG_FORMAT``)
LOG_FORMATS = ("text", "json")


def _choice(name: str, raw: str | None, choices: Iterable[Any], default: str) -> str:
    """``raw`` if it is one of ``choices`` (strings, or an Enum's members), else ``default`` when unset; else a
    :class:`~kubeps.runtime.errors.RuntimeConfigError` naming the variable, the value and what is allowed."""
    allowed = [getattr(m, "value", m) for m in choices]
    if not raw:
        return default
    return str(check(name, raw, Literal[tuple(allowed)], allowed=f"one of {', '.join(allowed)}"))


@dataclass(frozen=True)
class Settings:
    namespaces: tuple[str, ...] = ()
    all_namespaces: bool = False
    default_image: str = DEFAULT_IMAGE
    cluster_domain: str | None = None
    #: ``SameJob`` or ``None``: the NetworkPolicy of a job whose spec sets no ``security.networkPolicy.mode``
    job_network_policy: str = "None"
    #: the gang scheduling backend (``none``, ``native``, ``volcano``, ``scheduler-plugins``) and the
    #: ``schedulerName`` of the gang's pods ("": the backend's own, see :mod:`kubeps.operator.core.gang`)
    gang_scheduler: str = "none"
    gang_scheduler_name: str = ""
    api_qps: float = 100.0
    api_burst: int = 200
    workers: int = 16
    metrics_port: int = 8080
    liveness_port: int = 8081
    bind_address: str = "0.0.0.0"
    log_level: str = "INFO"
    #: ``text`` or ``json``: the operator's log lines (JSON: kopf's objects, a job's lines with its ``job`` ref)
    log_format: str = "text"
    #: ``auto``, ``on`` or ``off``: whether jobs labelled ``kueue.x-k8s.io/queue-name`` wait for Kueue's admission
    kueue: str = "auto"
    peering: str | None = None
    peering_priority: int | None = None
    peering_lifetime: int = 10
    watch_server_timeout: float = 120.0
    watch_client_timeout: float = 150.0
    watch_connect_timeout: float = 10.0
    watch_inactivity_timeout: float = 180.0
    node_lost_after: float = 20.0
    #: seconds between two reads of every running job's chief's metrics (status.progress), and the most status
    #: writes a second they may cause over all jobs
    progress_interval: float = 10.0
    progress_writes_per_second: float = 20.0
    #: where a job's chief serves its metrics, with ``{job}``, ``{namespace}``, ``{domain}`` (``.cluster.local`` or
    #: empty) and ``{port}`` filled in; "": its Service (an operator outside the cluster names a proxy here)
    chief_metrics_url: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def clusterwide(self) -> bool:
        return self.all_namespaces or not self.namespaces

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        namespaces = tuple(n.strip() for n in env.get("KUBEPS_NAMESPACES", "").split(",") if n.strip())
        return cls(
            namespaces=namespaces,
            all_namespaces=_bool(env.get("KUBEPS_ALL_NAMESPACES")),
            default_image=env.get("KUBEPS_DEFAULT_IMAGE") or DEFAULT_IMAGE,
            cluster_domain=env.get("KUBEPS_CLUSTER_DOMAIN") or None,
            job_network_policy=_choice("KUBEPS_JOB_NETWORK_POLICY", env.get("KUBEPS_JOB_NETWORK_POLICY"),
                                       NetworkPolicyMode, NetworkPolicyMode.NONE.value),
            gang_scheduler=_choice("KUBEPS_GANG_SCHEDULER", env.get("KUBEPS_GANG_SCHEDULER"), GangScheduler,
                                   GangScheduler.NONE.value),
            gang_scheduler_name=env.get("KUBEPS_GANG_SCHEDULER_NAME") or "",
            api_qps=_read(env, "KUBEPS_API_QPS", PositiveFloat, 100.0),
            api_burst=_read(env, "KUBEPS_API_BURST", PositiveInt, 200),
            workers=_read(env, "KUBEPS_WORKERS", PositiveInt, 16),
            metrics_port=_read(env, "KUBEPS_METRICS_PORT", MetricsPort, 8080),
            liveness_port=_read(env, "KUBEPS_LIVENESS_PORT", PortOrZero, 8081),
            bind_address=env.get("KUBEPS_BIND_ADDRESS") or "0.0.0.0",
            log_level=(env.get("KUBEPS_LOG_LEVEL") or "INFO").upper(),
            log_format=_choice("KUBEPS_LOG_FORMAT", env.get("KUBEPS_LOG_FORMAT"), LOG_FORMATS, "text"),
            kueue=_choice("KUBEPS_KUEUE", env.get("KUBEPS_KUEUE"), KUEUE_MODES, "auto"),
            peering=env.get("KOPF_RUN_PEERING") or None,
            peering_priority=_read(env, "KOPF_RUN_PRIORITY", integer(), None),
            peering_lifetime=_read(env, "KUBEPS_PEERING_LIFETIME", integer(ge=2), 10),
            watch_server_timeout=_read(env, "KUBEPS_WATCH_SERVER_TIMEOUT", Seconds, 120.0),
            watch_client_timeout=_read(env, "KUBEPS_WATCH_CLIENT_TIMEOUT", Seconds, 150.0),
            watch_connect_timeout=_read(env, "KUBEPS_WATCH_CONNECT_TIMEOUT", Seconds, 10.0),
            watch_inactivity_timeout=_read(env, "KUBEPS_WATCH_INACTIVITY", Seconds, 180.0),
            node_lost_after=_read(env, "KUBEPS_NODE_LOST_AFTER", _ANY_SECONDS, 20.0),
            progress_interval=_read(env, "KUBEPS_PROGRESS_INTERVAL", _ANY_SECONDS, 10.0),
            progress_writes_per_second=_read(env, "KUBEPS_PROGRESS_WRITES_PER_SECOND", PositiveFloat, 20.0),
            chief_metrics_url=env.get("KUBEPS_CHIEF_METRICS_URL") or "",
        )

    def with_overrides(self, **overrides: Any) -> "Settings":
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


def kopf_settings(ours: Settings, target: kopf.OperatorSettings | None = None,
                  peering: bool = True) -> kopf.OperatorSettings:
    """kopf's ``OperatorSettings`` for our settings: the one place that maps them (``main`` passes the result to
    ``kopf.run(settings=...)``; under ``kopf run -m kubeps.operator.controller.handlers`` the start-up handler
    applies it to kopf's own object with ``peering=False``, leaving the peering to kopf's
    ``--peering``/``--standalone``)."""
    import kopf  # noqa: PLC0415 - main reads the settings before it hides the kubernetes package from kopf

    target = kopf.OperatorSettings() if target is None else target
    if peering:
        target.peering.standalone = ours.peering is None
        target.peering.clusterwide = ours.clusterwide
        if ours.peering is not None:
            target.peering.mandatory = True  # a missing peering object pauses the operator instead of going solo
            target.peering.name = ours.peering
        # Equal priorities pause every replica (kopf cannot pick one), so each replica gets its own: the
        # longest-running one stays in charge and a restarted or added replica waits behind it.
        target.peering.priority = (ours.peering_priority if ours.peering_priority is not None
                                   else -(int(time.time() * 1000) * 1000 + random.randrange(1000)))
    # Keep-alives every 1-5 s (kopf renews lifetime minus 5-10 s): a SIGKILLed leader is taken over within about
    # the lifetime, not kopf's default 60 s.
    target.peering.lifetime = ours.peering_lifetime
    target.peering.stealth = True  # no log line per keep-alive
    target.posting.level = logging.WARNING  # kopf's own log lines become Events only from WARNING up
    target.watching.server_timeout = int(ours.watch_server_timeout)  # the API server wants an integer
    target.watching.client_timeout = ours.watch_client_timeout
    target.watching.connect_timeout = ours.watch_connect_timeout
    target.watching.inactivity_timeout = ours.watch_inactivity_timeout
    target.execution.max_workers = max(4, ours.workers)
    target.queueing.idle_timeout = 1.0
    # kopf keeps a "diff base" (a deep copy of each object's spec, labels and annotations, rebuilt on every event)
    # for on.create/update/field handlers; the operator has none (only event handlers), and building
    # it was ~5% of the operator's CPU in a burst of pod events.
    target.persistence.diffbase_storage = _no_diff_base()
    return target


@functools.cache
def _no_diff_base():
    import kopf  # noqa: PLC0415 - as in kopf_settings

    class NoDiffBase(kopf.DiffBaseStorage):
        def build(self, *, body, extra_fields=None):
            return {}

        def fetch(self, *, body):
            return None

        def store(self, *, body, patch, essence):
            pass

    return NoDiffBase()
