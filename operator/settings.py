"""Operator settings: environment variables, overridden by command-line flags (see :mod:`kubeps.operator.main`).

=============================  ===========================  ==========================================
Environment                    Flag                         Meaning (default)
=============================  ===========================  ==========================================
KUBEPS_NAMESPACES              --namespace (repeatable)     namespaces to watch (comma-separated)
KUBEPS_ALL_NAMESPACES          --all-namespaces             watch the whole cluster (the default when
                                                            no namespace is given)
KUBEPS_DEFAULT_IMAGE           --default-image              image of containers that name none
KUBEPS_CLUSTER_DOMAIN          --cluster-domain             appended to TF_CONFIG hosts (none)
KUBEPS_API_QPS / _BURST        --api-qps / --api-burst      client-side API rate limit (100 / 200)
KUBEPS_WORKERS                 --workers                    concurrent reconciles and API calls (16)
KUBEPS_METRICS_PORT            --metrics-port               Prometheus /metrics port, 0 = off (8080)
KUBEPS_LIVENESS_PORT           --liveness-port              /healthz port, 0 = off (8081)
KUBEPS_BIND_ADDRESS            --bind-address               address of both endpoints (0.0.0.0)
KUBEPS_LOG_LEVEL               --log-level                  DEBUG, INFO, WARNING, ERROR (INFO)
KOPF_RUN_PEERING               --peering NAME               run with this kopf peering object, so that
                                                            two operators never reconcile at once; the
                                                            peering CRDs must be installed (standalone)
KUBEPS_WATCH_SERVER_TIMEOUT    (env only)                   watch request timeout asked of the server (120 s)
KUBEPS_WATCH_CLIENT_TIMEOUT    (env only)                   client-side watch timeout (150 s)
KUBEPS_WATCH_CONNECT_TIMEOUT   (env only)                   connection timeout of watches (10 s)
KUBEPS_WATCH_INACTIVITY        (env only)                   restart a watch silent this long (180 s)
=============================  ===========================  ==========================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Mapping

from .children import DEFAULT_IMAGE  # written once, where the pod bodies use it


def _bool(text: str | None) -> bool:
    return (text or "").strip().lower() in ("1", "true", "yes", "on")


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r}: must be > 0")
    return value


def _int(env: Mapping[str, str], name: str, default: int, minimum: int = 0) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={raw!r}: must be >= {minimum}")
    return value


@dataclass(frozen=True)
class Settings:
    namespaces: tuple[str, ...] = ()
    all_namespaces: bool = False
    default_image: str = DEFAULT_IMAGE
    cluster_domain: str | None = None
    api_qps: float = 100.0
    api_burst: int = 200
    workers: int = 16
    metrics_port: int = 8080
    liveness_port: int = 8081
    bind_address: str = "0.0.0.0"
    log_level: str = "INFO"
    peering: str | None = None
    watch_server_timeout: float = 120.0
    watch_client_timeout: float = 150.0
    watch_connect_timeout: float = 10.0
    watch_inactivity_timeout: float = 180.0
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
            api_qps=_float(env, "KUBEPS_API_QPS", 100.0),
            api_burst=_int(env, "KUBEPS_API_BURST", 200, 1),
            workers=_int(env, "KUBEPS_WORKERS", 16, 1),
            metrics_port=_int(env, "KUBEPS_METRICS_PORT", 8080),
            liveness_port=_int(env, "KUBEPS_LIVENESS_PORT", 8081),
            bind_address=env.get("KUBEPS_BIND_ADDRESS") or "0.0.0.0",
            log_level=(env.get("KUBEPS_LOG_LEVEL") or "INFO").upper(),
            peering=env.get("KOPF_RUN_PEERING") or None,
            watch_server_timeout=_float(env, "KUBEPS_WATCH_SERVER_TIMEOUT", 120.0),
            watch_client_timeout=_float(env, "KUBEPS_WATCH_CLIENT_TIMEOUT", 150.0),
            watch_connect_timeout=_float(env, "KUBEPS_WATCH_CONNECT_TIMEOUT", 10.0),
            watch_inactivity_timeout=_float(env, "KUBEPS_WATCH_INACTIVITY", 180.0),
        )

    def with_overrides(self, **overrides) -> "Settings":
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})
