"""When the job may run, and what happens once it stopped: suspension, Kueue's admission, the deadline, the gang's
PodGroup, and cleanup and TTL after the end.

Rules (documented for users in docs/operator.md):

* Suspend deletes pods and Services; resume recreates them and resets startTime.
* Kueue (operator setting on, job labelled ``kueue.x-k8s.io/queue-name``): no pod runs until the job's Workload is
  Admitted; the job is Suspended (reason Queued or Evicted) meanwhile. :mod:`.kueue` is the protocol.
* activeDeadlineSeconds counts from startTime; past it the job fails.
* Gang scheduling (:mod:`.gang`): the job's PodGroup is made with its pods while it runs, deleted when it is
  suspended, queued or finished.
* Once Succeeded or Failed: cleanPodPolicy deletes pods (and their Services): Running (default) what still runs,
  All everything, None nothing; ttlSecondsAfterFinished deletes the finished job. With Running, after a success an
  evaluator still running is left up to runPolicy.evaluatorGraceSeconds to evaluate the final checkpoint (it exits
  by itself once it has).

Functions of a :class:`~.draft.Draft`; pure: no I/O, the time is the observed one.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from kubeps.runtime.checks import NonNegativeInt, check

from kubeps.operator.api import models
from kubeps.operator.api.models import CleanPodPolicy, ConditionType, PSTrainingJobSpec, ReplicaType, RunPolicy

from . import gang, kueue
from .actions import CreatePod, DeleteJob, DeleteService
from .children import pod_body
from .draft import Draft
from .observed import fmt_time, parse_time
from .flow import HOLDING, On
from .status import COUNTED, R_SUSPENDED


def queued(d: Draft) -> bool:
    """Whether Kueue decides when this job runs (the operator's setting and the job's queue label)."""
    return d.config.kueue and kueue.queue_name(d.job) is not None


def hold(d: Draft, spec: PSTrainingJobSpec) -> bool:
    """Keep the job from running while Kueue has not admitted it or it is suspended: its pods and Services are
    deleted and it is Suspended. Returns whether it is held."""
    why: tuple[str, str] | None = None
    if queued(d):
        def templates() -> dict[ReplicaType, dict[str, Any]]:
            return {rt: pod_body(d.job, spec, rt, 0, d.status.chiefEpoch, d.config)
                    for rt in models.REPLICA_TYPES if spec.replicaSpecs.get(rt) is not None}

        d.queueing = kueue.Queueing(d.job, spec, d.queue_view, templates, len(d.pods), d.book.now_text)
        d.plan.actions.extend(d.queueing.actions)
        why = d.queueing.hold
    if spec.runPolicy.suspend:
        why = (R_SUSPENDED, "The job is suspended.")
    if why is None:
        return False
    reason, message = why
    d.move(HOLDING[reason], message,
           event_message=f"{message} Deleting the job's pods and Services." if d.pods else message)
    for pod in sorted(d.pods, key=lambda p: p.name):
        if pod.replica_type in COUNTED:
            d.book.retire(pod)  # so that a pod still terminating at resume is not taken for a lost one
        if not pod.terminating:
            d.delete_pod(pod, "suspended")
    for svc_name in sorted(d.services):
        d.plan.actions.append(DeleteService(svc_name, "suspended"))
    return True


def start(d: Draft) -> None:
    """The job runs: resumed when it was Suspended (startTime reset), started when it had not."""
    if d.book.is_true(ConditionType.SUSPENDED):
        resumed = "The job is resumed." if d.queueing is None else "Kueue admitted the job's Workload."
        d.move(On.RESUME, resumed, event_message=f"{resumed} Creating its pods and Services.")
    if d.status.startTime is None:
        d.status.startTime = d.book.now_text


def deadline(d: Draft, run_policy: RunPolicy) -> datetime | None:
    """When activeDeadlineSeconds ends, counted from startTime; None without one."""
    if run_policy.activeDeadlineSeconds is None:
        return None
    return _started(d) + timedelta(seconds=run_policy.activeDeadlineSeconds)


def past_deadline(d: Draft, run_policy: RunPolicy, due: datetime | None) -> bool:
    """Fail the job once its deadline passed (else reconcile again then); returns whether it failed."""
    if due is None:
        return False
    if d.now >= due:
        elapsed = (d.now - _started(d)).total_seconds()
        d.move(On.DEADLINE_EXCEEDED, f"The job ran {int(elapsed)} s, longer than activeDeadlineSeconds="
                                     f"{run_policy.activeDeadlineSeconds}.")
        return True
    d.requeue((due - d.now).total_seconds())
    return False


def _started(d: Draft) -> datetime:
    return parse_time(d.status.startTime) or d.now


def report_pods_ready(d: Draft) -> None:
    """Tell Kueue whether every pod of an admitted job is ready (its Workload's PodsReady condition)."""
    if d.queueing is None or d.book.terminal:
        return
    desired = d.desired_counts()
    ready = d.queueing.pods_ready(all(
        (pod := d.by_key.get((rt, i))) is not None and pod.ready and not pod.terminating
        for rt in models.REPLICA_TYPES for i in range(desired[rt])))
    if ready is not None:
        d.plan.actions.append(ready)


def finish_workload(d: Draft) -> None:
    """Tell Kueue a queued job has ended (its Workload's Finished condition), once."""
    if not queued(d):
        return
    succeeded = d.book.is_true(ConditionType.SUCCEEDED)
    cond = d.book.condition(ConditionType.SUCCEEDED if succeeded else ConditionType.FAILED)
    action = kueue.finish(d.queue_view, succeeded, (cond.message if cond else None) or "", d.book.now_text)
    if action is not None:
        d.plan.actions.append(action)


def plan_pod_group(d: Draft) -> None:
    """The gang's PodGroup (:mod:`.gang`): made with the pods of a running job, deleted once it stops."""
    stopped = None
    if d.book.terminal:
        stopped = "job finished"
    elif d.spec is not None and d.spec.runPolicy.suspend:
        stopped = "suspended"
    elif d.queueing is not None and d.queueing.hold is not None:
        # Kueue first, the gang after admission: no PodGroup holds nodes for a job that is queued or evicted.
        stopped = f"waiting for Kueue ({d.queueing.hold[0]})"
    d.plan.actions.extend(gang.pod_group_actions(
        d.job, d.spec, d.config, d.observed.pod_group is not None, stopped=stopped,
        creating_pods=bool(d.plan.of(CreatePod))))


def cleanup(d: Draft) -> None:
    """Delete a finished job's pods and Services per its cleanPodPolicy."""
    policy = CleanPodPolicy.RUNNING
    if d.spec is not None:
        policy = d.spec.runPolicy.cleanPodPolicy
    else:
        raw = _raw_run_policy(d).get("cleanPodPolicy")
        if isinstance(raw, str) and raw in {p.value for p in CleanPodPolicy}:
            policy = CleanPodPolicy(raw)
    if policy is CleanPodPolicy.NONE:
        return
    grace = _evaluator_grace(d) if policy is CleanPodPolicy.RUNNING else None
    removed: set[str] = set()
    for pod in sorted(d.pods, key=lambda p: p.name):
        if pod.terminating:
            removed.add(pod.name)
            continue
        if grace is not None and pod.replica_type is ReplicaType.EVALUATOR and not pod.finished:
            seconds, until = grace
            if d.now < until:
                d.requeue((until - d.now).total_seconds())
                continue
            d.delete_pod(pod, f"cleanPodPolicy Running: still running {seconds} s after the job succeeded "
                         "(runPolicy.evaluatorGraceSeconds)")
            removed.add(pod.name)
            continue
        if policy is CleanPodPolicy.ALL or not pod.finished:
            d.delete_pod(pod, "cleanPodPolicy " + policy.value)
            removed.add(pod.name)
    for svc_name in sorted(d.services):
        if policy is CleanPodPolicy.ALL or svc_name in removed:
            d.plan.actions.append(DeleteService(svc_name, "cleanPodPolicy " + policy.value))


def _evaluator_grace(d: Draft) -> tuple[int, datetime] | None:
    """``(runPolicy.evaluatorGraceSeconds, until when)`` a succeeded job's evaluator is left to finish the final
    checkpoint; None: not at all (the job failed: no final checkpoint is coming). A spec the models rejected (edited
    after the job ended) gets the default."""
    if not d.book.is_true(ConditionType.SUCCEEDED):
        return None
    seconds = (d.spec.runPolicy if d.spec is not None else RunPolicy()).evaluatorGraceSeconds
    finished = parse_time(d.status.completionTime) or d.now
    return seconds, finished + timedelta(seconds=seconds)


def ttl(d: Draft) -> None:
    """Delete a finished job once ttlSecondsAfterFinished passed (else reconcile again then)."""
    raw: int | None
    if d.spec is not None:
        raw = d.spec.runPolicy.ttlSecondsAfterFinished
    else:
        try:
            raw = check("spec.runPolicy.ttlSecondsAfterFinished", _raw_run_policy(d).get("ttlSecondsAfterFinished"),
                        NonNegativeInt, owner="PSTrainingJob")
        except ValueError:  # RuntimeConfigError: absent, or an invalid spec with an unusable TTL: keep the job
            return
    if raw is None:
        return
    finished = parse_time(d.status.completionTime) or d.now
    due = finished + timedelta(seconds=int(raw))
    if d.now >= due:
        d.plan.actions.append(DeleteJob(f"ttlSecondsAfterFinished={raw} passed since {fmt_time(finished)}"))
    else:
        d.requeue((due - d.now).total_seconds())


def _raw_run_policy(d: Draft) -> dict[str, Any]:
    """``spec.runPolicy`` as written, for a job whose spec the models rejected (any shape)."""
    spec = d.job.get("spec")
    run_policy = spec.get("runPolicy") if isinstance(spec, dict) else None
    return run_policy if isinstance(run_policy, dict) else {}
