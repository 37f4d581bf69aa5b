"""Prometheus metrics of the operator, served on ``/metrics`` by :func:`serve`.

The job counters are named as Kubeflow training-operator's (``training_operator_jobs_created_total``,
``..._jobs_successful_total``, ``..._jobs_failed_total``, ``..._jobs_restarted_total``, ``..._jobs_deleted_total``)
with the ``kubeps_`` prefix and a ``namespace`` label; beside them what its users miss: the jobs in each phase
(:func:`watch_jobs`, read at each scrape), the time from a job's creation to Running and to its first training step, and restarts per role and
reason. docs/observability.md lists them.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

from prometheus_client import REGISTRY, Counter, Histogram, disable_created_metrics, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

JOBS_CREATED = Counter("kubeps_jobs_created_total", "PSTrainingJobs seen for the first time (Created condition set)",
                       ["namespace"])
JOBS_SUCCESSFUL = Counter("kubeps_jobs_successful_total", "PSTrainingJobs that succeeded", ["namespace"])
JOBS_FAILED = Counter("kubeps_jobs_failed_total", "PSTrainingJobs that failed", ["namespace", "reason"])
JOBS_RESTARTED = Counter("kubeps_jobs_restarted_total", "Times a PSTrainingJob began restarting replicas",
                         ["namespace"])
JOBS_DELETED = Counter("kubeps_jobs_deleted_total", "PSTrainingJobs deleted by ttlSecondsAfterFinished")
RESTARTS = Counter("kubeps_restarts_total", "Replica restarts decided by the operator, by role and reason",
                   ["role", "reason"])
TIME_TO_RUNNING = Histogram(
    "kubeps_job_time_to_running_seconds", "From a job's creationTimestamp (1 s resolution) to its Running condition",
    buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600),
)
TIME_TO_FIRST_STEP = Histogram(
    "kubeps_job_time_to_first_step_seconds",
    "From a job's creationTimestamp (1 s resolution) to the first read of its chief's metrics that shows a step "
    "(the reads are progress_interval seconds apart)",
    buckets=(5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600),
)
PODS_CREATED = Counter("kubeps_pods_created_total", "Pods created", ["role"])
PODS_DELETED = Counter("kubeps_pods_deleted_total", "Pods deleted", ["reason"])
SERVICES_CREATED = Counter("kubeps_services_created_total", "Services created")
POD_GROUPS_CREATED = Counter("kubeps_pod_groups_created_total", "PodGroups created for gang scheduling")
POD_GROUPS_DELETED = Counter("kubeps_pod_groups_deleted_total", "PodGroups deleted (job suspended or finished)")
API_ERRORS = Counter("kubeps_api_errors_total", "Kubernetes API calls that failed", ["verb", "status"])
RECONCILE_SECONDS = Histogram(
    "kubeps_reconcile_duration_seconds", "Time to plan and apply one reconcile of one job",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
CHILDREN_LATENCY = Histogram(
    "kubeps_job_children_created_seconds",
    "From the job's creationTimestamp (1 s resolution) to all its pods, Services and Secret observed",
    buckets=(0.25, 0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120),
)


#: the phases of :func:`phase_of`, all shown (0 when no job is in one)
PHASES = ("Pending", "Created", "Running", "Restarting", "Suspended", "Succeeded", "Failed")


def phase_of(job: Mapping[str, Any]) -> str:
    """A job's phase: the type of its last True condition (``Pending`` before the first)."""
    true = [c.get("type") for c in (job.get("status") or {}).get("conditions") or [] if c.get("status") == "True"]
    return str(true[-1]) if true and true[-1] in PHASES else "Pending"


class _JobPhases(Collector):
    def __init__(self, jobs: Callable[[], Iterable[Mapping[str, Any]]]):
        self.jobs = jobs

    def collect(self) -> Iterable[Any]:
        counts = dict.fromkeys(PHASES, 0)
        for job in list(self.jobs()):
            counts[phase_of(job)] += 1
        family = GaugeMetricFamily("kubeps_jobs", "PSTrainingJobs the operator watches, by phase", labels=["phase"])
        for phase, count in counts.items():
            family.add_metric([phase], count)
        yield family

    def describe(self) -> Iterable[Any]:
        return []


def watch_jobs(jobs: Callable[[], Iterable[Mapping[str, Any]]]) -> Collector:
    """Show ``kubeps_jobs{phase}`` from ``jobs()`` (the operator's cache of the jobs it watches) at each scrape."""
    collector = _JobPhases(jobs)
    REGISTRY.register(collector)
    return collector


def serve(port: int, address: str = "0.0.0.0") -> None:
    """Serve the default registry on ``http://address:port/metrics`` from a daemon thread (without the
    ``*_created`` series beside every counter)."""
    disable_created_metrics()
    start_http_server(port, addr=address)
