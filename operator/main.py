"""``kubeps operator`` / ``python -m kubeps.operator.main``: start the operator (kopf with our handlers)."""

from __future__ import annotations

import argparse
import logging
import platform
import sys
from typing import Any, Mapping

from kubeps.runtime.contract import VERSION

from .api.models import GangScheduler
from .controller import settings as settings_module
from .controller.settings import Settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kubeps operator",
        description="Run the kubeps operator: reconcile PSTrainingJobs into pods, Services and TF_CONFIG. "
        "Flags override the KUBEPS_* environment variables (see kubeps.operator.controller.settings).",
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", dest="namespaces", metavar="NS",
                       help="namespace to watch (repeatable); default: all namespaces")
    scope.add_argument("--all-namespaces", "-A", action="store_true", default=None,
                       help="watch every namespace")
    parser.add_argument("--default-image", help="image for containers of a template that name none")
    parser.add_argument("--cluster-domain", help="cluster DNS domain appended to TF_CONFIG hosts, e.g. cluster.local")
    parser.add_argument("--job-network-policy", choices=["SameJob", "None"],
                        help="NetworkPolicy of a job whose spec sets no security.networkPolicy.mode: SameJob (its "
                        "pods accept traffic from its own pods only) or None (default)")
    parser.add_argument("--gang-scheduler", choices=[g.value for g in GangScheduler],
                        help="gang scheduling backend: one PodGroup per job for Kubernetes' own gang scheduling "
                        "(native, scheduling.k8s.io/v1alpha2), Volcano or scheduler-plugins' coscheduling; none "
                        "(default) makes none")
    parser.add_argument("--gang-scheduler-name", metavar="NAME",
                        help="schedulerName of the gang's pods whose template names none (default: volcano for "
                        "volcano, scheduler-plugins-scheduler for scheduler-plugins; native needs none)")
    parser.add_argument("--metrics-port", type=int, help="port of /metrics (0 disables)")
    parser.add_argument("--liveness-port", type=int, help="port of /healthz (0 disables)")
    parser.add_argument("--bind-address", help="address the metrics and liveness endpoints listen on")
    parser.add_argument("--api-qps", type=float, help="client-side rate limit of API calls per second")
    parser.add_argument("--api-burst", type=int, help="burst of the API rate limit")
    parser.add_argument("--workers", type=int, help="concurrent reconciles and API calls")
    parser.add_argument("--kueue", choices=["auto", "on", "off"],
                        help="Kueue integration: jobs labelled kueue.x-k8s.io/queue-name wait for their Workload's "
                        "admission; auto (default) turns it on when the API server serves kueue.x-k8s.io/v1beta2")
    parser.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], type=str.upper)
    parser.add_argument("--log-format", choices=["text", "json"],
                        help="text lines (default) or one JSON object per line with the job's reference")
    parser.add_argument("--peering", metavar="NAME",
                        help="kopf peering object to coordinate with other operator replicas (needs kopf's "
                        "peering CRDs); default: standalone")
    parser.add_argument("--peering-priority", type=int, metavar="N",
                        help="peering priority (the highest live replica acts); default: the earliest started")
    parser.add_argument("--peering-lifetime", type=int, metavar="SECONDS",
                        help="seconds a silent replica counts as alive: about the longest take-over (10)")
    parser.add_argument("--node-lost-after", type=float, metavar="SECONDS",
                        help="seconds without a Lease renewal after which a node is lost and its pods replaced; "
                        "0: only the node controller's verdict; negative: nodes not watched (20)")
    return parser


def settings_from_args(argv: list[str] | None, env: Mapping[str, str] | None = None) -> Settings:
    args = build_parser().parse_args(argv)
    base = Settings.from_env(env)
    settings = base.with_overrides(
        namespaces=tuple(args.namespaces) if args.namespaces else None,
        all_namespaces=args.all_namespaces,
        default_image=args.default_image,
        cluster_domain=args.cluster_domain,
        job_network_policy=args.job_network_policy,
        gang_scheduler=args.gang_scheduler,
        gang_scheduler_name=args.gang_scheduler_name,
        metrics_port=args.metrics_port,
        liveness_port=args.liveness_port,
        bind_address=args.bind_address,
        api_qps=args.api_qps,
        api_burst=args.api_burst,
        workers=args.workers,
        log_level=args.log_level,
        log_format=args.log_format,
        kueue=args.kueue,
        peering=args.peering,
        peering_priority=args.peering_priority,
        peering_lifetime=args.peering_lifetime,
        node_lost_after=args.node_lost_after,
    )
    if args.all_namespaces:
        settings = settings.with_overrides(namespaces=())
    if settings.api_qps <= 0 or settings.api_burst < 1 or settings.workers < 1 or settings.peering_lifetime < 2:
        build_parser().error("--api-qps must be > 0, --api-burst and --workers >= 1, --peering-lifetime >= 2")
    return settings


def configure_logging(settings: Settings) -> None:
    """Text lines, or (``--log-format json``) kopf's JSON lines: one object per line with ``timestamp``, ``severity``,
    ``message`` and, for what is logged about a job, its reference under ``job`` (namespace, name, uid)."""
    if settings.log_format == "json":
        import kopf  # noqa: PLC0415 - main imports kopf only after hiding the kubernetes package

        kopf.configure(log_format=kopf.LogFormat.JSON, log_refkey="job")
        logging.getLogger().setLevel(settings.log_level)
    else:
        logging.basicConfig(level=settings.log_level,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    settings = settings_from_args(argv)
    _skip_kubernetes_package()
    import kopf  # noqa: PLC0415 - arguments are checked, and the kubernetes package hidden, before kopf loads

    from .controller import handlers, metrics  # noqa: PLC0415, F401 - importing handlers registers them with kopf
    from .controller.reconciler import Reconciler  # noqa: PLC0415

    configure_logging(settings)
    log_versions(settings, kopf.__version__)
    for noisy in ("aiohttp", "kopf.objects"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(settings.log_level)))
    reconciler = Reconciler(settings)
    if settings.metrics_port:
        metrics.watch_jobs(lambda: reconciler.cache.jobs.values())  # kubeps_jobs{phase}, at each scrape
        metrics.serve(settings.metrics_port, settings.bind_address)
    kopf.run(**kopf_run_options(settings), memo=kopf.Memo(reconciler=reconciler))
    return 0


def log_versions(settings: Settings, kopf_version: str) -> None:
    """What runs, first in the operator's log: its version, the runtime image its pods get by default (the runtime's
    version unless ``--default-image`` names another), Python's and kopf's."""
    logging.getLogger("kubeps.operator").info(
        "kubeps operator %s starting; pods that name no image run %s; Python %s, kopf %s", VERSION,
        settings.default_image, platform.python_version(), kopf_version)


def _skip_kubernetes_package() -> None:
    """The operator never uses the ``kubernetes`` package (see :mod:`kubeps.operator.kube.client`), but kopf imports it
    when it is installed, for type checks only: about 20 MB and 0.5 s. Make it look absent to kopf."""
    for name in ("kubernetes", "kubernetes_asyncio", "pykube"):
        # None in sys.modules makes `import name` raise ImportError (importlib's documented way to block a module);
        # typeshed types the values as modules only
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]


def kopf_run_options(settings: Settings) -> dict[str, Any]:
    """The keyword arguments of ``kopf.run`` for these settings (without ``memo``).

    ``settings`` is kopf's ``OperatorSettings`` built by
    :func:`kubeps.operator.controller.settings.kopf_settings`. Without a
    peering name the operator runs standalone (one replica); with one, kopf keeps a (Cluster)KopfPeering object
    and only the replica with the highest priority acts, the others pause until it stops renewing its record.
    """
    kopf_settings = settings_module.kopf_settings(settings)
    options = {
        "settings": kopf_settings,
        # kopf.run writes these into the settings again: pass what the settings already say.
        "standalone": kopf_settings.peering.standalone,
        "priority": kopf_settings.peering.priority,
        "clusterwide": settings.clusterwide,
        "namespaces": () if settings.clusterwide else settings.namespaces,
        "liveness_endpoint": (f"http://{settings.bind_address}:{settings.liveness_port}/healthz"
                              if settings.liveness_port else None),
    }
    if settings.peering is not None:
        options["peering_name"] = settings.peering
    return options


if __name__ == "__main__":
    raise SystemExit(main())
