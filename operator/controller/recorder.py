"""What the operator tells about its work (Kubeflow's Recorder): Events on the job and Prometheus metrics.

* Events are posted by kopf (:func:`kopf.event`); the children a reconcile created or deleted are summed up in one
  Event per reason (:meth:`Recorder.summaries`), not one per child.
* Status transitions are counted from the old and the new status (:meth:`Recorder.transitions`): jobs created,
  successful, failed (by reason), restarted, the time to Running, replica restarts (by role and reason).
* Every other metric of :mod:`.metrics` is observed here, so the actuator and the reconciler name what happened,
  not how it is counted.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Mapping

import kopf

from kubeps.operator.core.observed import parse_time

from . import metrics

SUMMARY_NAMES = 12  # children named in one Event's message; the rest are counted


class Recorder:
    """Events and metrics; remembers which jobs already had all their children observed (counted once)."""

    def __init__(self) -> None:
        self.children_seen: set[str] = set()

    @staticmethod
    def event(job: Mapping[str, Any], etype: str, reason: str, message: str) -> None:
        """Post an Event (``etype`` Normal or Warning) on the job."""
        # kopf types the object as its own Body, and reads a plain dict the same way (apiVersion, kind, metadata)
        kopf.event(job, type=etype, reason=reason, message=message)  # type: ignore[arg-type]

    def summaries(self, job: Mapping[str, Any], done: list[tuple[str, str]]) -> None:
        """One Event per reason for the children a reconcile created or deleted (``(reason, what)`` pairs), not
        one per child: a 1 chief + 2 PS + 8 worker job made 22 Events (22 API requests) on its first reconcile."""
        by_reason: dict[str, list[str]] = {}
        for reason, what in done:
            by_reason.setdefault(reason, []).append(what)
        for reason, items in by_reason.items():
            kind, verb = reason[:-7], reason[-7:]  # "PodCreated" -> "Pod", "Created"
            if len(items) == 1:
                message = f"{verb} {kind} {items[0]}"
            else:
                shown = ", ".join(items[:SUMMARY_NAMES])
                more = f" and {len(items) - SUMMARY_NAMES} more" if len(items) > SUMMARY_NAMES else ""
                message = f"{verb} {len(items)} {kind}s: {shown}{more}"
            self.event(job, "Normal", reason, message)

    @staticmethod
    def transitions(old: Mapping[str, Any], new: Mapping[str, Any], job: Mapping[str, Any]) -> None:
        """Count what changed from the ``old`` status to the ``new`` one of ``job``."""
        def true_conditions(status: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
            return {c["type"]: c for c in status.get("conditions") or [] if c.get("status") == "True"}

        namespace = str(job.get("metadata", {}).get("namespace") or "")
        before, after = true_conditions(old), true_conditions(new)
        began = {kind for kind in after if kind not in before}
        if "Created" in began:
            metrics.JOBS_CREATED.labels(namespace).inc()
        if "Succeeded" in began:
            metrics.JOBS_SUCCESSFUL.labels(namespace).inc()
        if "Failed" in began:
            metrics.JOBS_FAILED.labels(namespace, after["Failed"].get("reason") or "").inc()
        if "Restarting" in began:
            metrics.JOBS_RESTARTED.labels(namespace).inc()
        if "Running" in began and not (old.get("conditions") and any(
                c.get("type") == "Running" for c in old.get("conditions") or [])):  # the first time only
            created = parse_time(job.get("metadata", {}).get("creationTimestamp"))
            if created is not None:
                metrics.TIME_TO_RUNNING.observe(max(0.0, (datetime.now(timezone.utc) - created).total_seconds()))
        reason = str((after.get("Restarting") or {}).get("reason") or "")
        old_rs, new_rs = old.get("replicaStatuses") or {}, new.get("replicaStatuses") or {}
        for role, rs in new_rs.items():
            delta = rs.get("restarts", 0) - (old_rs.get(role) or {}).get("restarts", 0)
            if delta > 0:
                metrics.RESTARTS.labels(role, reason).inc(delta)

    @staticmethod
    def first_step(job: Mapping[str, Any]) -> None:
        """The job's chief reported its first training step (read from its metrics): the job's age, once per job
        (the caller observes it when ``status.progress`` is written for the first time)."""
        created = parse_time(job.get("metadata", {}).get("creationTimestamp"))
        if created is not None:
            metrics.TIME_TO_FIRST_STEP.observe(max(0.0, (datetime.now(timezone.utc) - created).total_seconds()))

    def all_children_present(self, job: Mapping[str, Any]) -> None:
        """The job's pods, Services and Secret are all observed: the time since its creation, once per job."""
        uid = job["metadata"].get("uid")
        if uid in self.children_seen:
            return
        self.children_seen.add(uid)
        created = parse_time(job["metadata"].get("creationTimestamp"))
        if created is not None:
            metrics.CHILDREN_LATENCY.observe(max(0.0, (datetime.now(timezone.utc) - created).total_seconds()))

    @staticmethod
    def reconciled(seconds: float) -> None:
        metrics.RECONCILE_SECONDS.observe(seconds)

    @staticmethod
    def api_error(verb: str, status: int) -> None:
        metrics.API_ERRORS.labels(verb, str(status)).inc()

    @staticmethod
    def pod_created(role: str) -> None:
        metrics.PODS_CREATED.labels(role).inc()

    @staticmethod
    def service_created() -> None:
        metrics.SERVICES_CREATED.inc()

    @staticmethod
    def pod_group_created() -> None:
        metrics.POD_GROUPS_CREATED.inc()

    @staticmethod
    def pod_group_deleted() -> None:
        metrics.POD_GROUPS_DELETED.inc()

    @staticmethod
    def pod_deleted(reason: str) -> None:
        metrics.PODS_DELETED.labels(reason).inc()

    @staticmethod
    def job_deleted() -> None:
        metrics.JOBS_DELETED.inc()
