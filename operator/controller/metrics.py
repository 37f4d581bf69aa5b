"""Prometheus metrics of the operator, served on ``/metrics`` by :func:`serve`."""

from __future__ import annotations

from prometheus_client import Counter, Histogram, start_http_server

JOBS_CREATED = Counter("kubeps_jobs_created_total", "PSTrainingJobs seen for the first time (Created condition set)")
JOBS_SUCCEEDED = Counter("kubeps_jobs_succeeded_total", "PSTrainingJobs that succeeded")
JOBS_FAILED = Counter("kubeps_jobs_failed_total", "PSTrainingJobs that failed", ["reason"])
JOBS_DELETED = Counter("kubeps_jobs_deleted_total", "PSTrainingJobs deleted by ttlSecondsAfterFinished")
RESTARTS = Counter("kubeps_restarts_total", "Replica restarts decided by the operator", ["role"])
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


def serve(port: int, address: str = "0.0.0.0") -> None:
    """Serve the default registry on ``http://address:port/metrics`` from a daemon thread."""
    start_http_server(port, addr=address)
