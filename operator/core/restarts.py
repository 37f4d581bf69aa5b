"""The replicas' lifecycle: when the job succeeds, which finished or deleted pod is recreated, what restarts with
it, what counts against ``backoffLimit``, and when the job is Running again.

Rules (documented for users in docs/operator.md):

* Chief exits 0 -> Succeeded (successPolicy ChiefOnly, the default); successPolicy AllWorkers: once the chief and
  every worker exited 0 (a worker failed for good -> Failed).
* Chief fails -> recreated when its restart policy retries the exit code (counts against backoffLimit), else
  Failed.
* PS fails -> the PS is recreated and the chief restarted (its epoch is bumped; a chief pod of an older epoch is
  deleted and recreated) so the coordinator rebuilds variables from the latest checkpoint. Counts against
  backoffLimit; Restarting names the PS.
* Worker or evaluator fails -> recreated per policy, the job keeps running; not counted against backoffLimit. When
  every worker has failed for good -> Failed.
* A chief or PS deleted by someone else is recreated once gone, whatever the policy, as after an eviction.
* backoffLimit: chief and PS recreations so far plus in-place container restarts (restartCount) of the live chief
  and PS pods; a restart that would go beyond it fails the job instead.

What an exit of which role restarts, and what counts, is the runtime's lifecycle table
(:mod:`kubeps.runtime.lifecycle`, which ``kubeps local --restart`` reads too), under the replica's restartPolicy
and with the exit classified by the spec's ExitCode rule (:func:`exit_of`). Functions of a :class:`~.draft.Draft`;
pure: no I/O.
"""

from __future__ import annotations

from datetime import datetime

from kubeps.runtime import lifecycle

from kubeps.operator.api.models import (ConditionType, PSTrainingJobSpec, ReplicaRestartPolicy, ReplicaType,
                                        SuccessPolicy)

from .draft import Draft
from .flow import On
from .observed import ObservedPod
from .status import COUNTED


def exit_of(d: Draft, pod: ObservedPod) -> str:
    """The lifecycle table's class of a finished pod's exit: its code per the spec's ExitCode rule
    (``runPolicy.retryableExitCodes``; a pod without a code, evicted or lost, is retryable)."""
    if pod.phase == "Succeeded":
        return lifecycle.SUCCESS
    return lifecycle.RETRYABLE if d.valid_spec.runPolicy.retryable(pod.exit_code) else lifecycle.PERMANENT


def decide(d: Draft, rt: ReplicaType, policy: ReplicaRestartPolicy, pod: ObservedPod) -> lifecycle.Decision:
    """The lifecycle table's decision for a finished pod under its replica's restart policy."""
    return lifecycle.decide(rt.task_type, exit_of(d, pod), policy.value)


def retries(d: Draft, rt: ReplicaType, policy: ReplicaRestartPolicy, pod: ObservedPod) -> bool:
    """Whether a replica's restart policy recreates this finished pod."""
    return bool(decide(d, rt, policy, pod).restarts)


def backoff_used(d: Draft) -> int:
    """The chief and PS restarts counted so far, with the in-place container restarts of their live pods."""
    # Pods already retired have their in-place restarts folded into backoffCount.
    live = sum(p.restart_count for p in d.pods if p.replica_type in COUNTED and not d.book.handled(p))
    return d.status.backoffCount + live


def restart_allowed(d: Draft, what: str) -> bool:
    """Whether backoffLimit leaves room for one more chief/PS restart; fails the job when not."""
    limit = d.valid_spec.runPolicy.backoffLimit
    used = backoff_used(d)
    if used >= limit:
        d.move(On.BACKOFF_EXCEEDED, f"{what}, but the job already restarted its chief and parameter servers "
                                    f"{used} time(s) and backoffLimit is {limit}.")
        return False
    return True


def succeeded(d: Draft, spec: PSTrainingJobSpec, deadline: datetime | None) -> bool:
    """Chief success ends the job, whatever else happened in the meantime; a chief that finished before the
    deadline succeeded even when the operator only sees it after the deadline (restart, lag). Returns whether the
    job succeeded now."""
    chief = d.by_key.get((ReplicaType.CHIEF, 0))
    if chief is None or chief.terminating or chief.phase != "Succeeded":
        return False
    if not (deadline is None or d.now < deadline or chief.finished_at is None or chief.finished_at <= deadline):
        return False
    if spec.successPolicy is SuccessPolicy.CHIEF_ONLY:
        d.move(On.CHIEF_SUCCEEDED, f"The chief ({chief.name}) exited with code 0.")
        return True
    workers = d.desired_counts()[ReplicaType.WORKER]
    if all(d.exited_0(ReplicaType.WORKER, i) for i in range(workers)):
        d.move(On.ALL_WORKERS_SUCCEEDED,
               f"The chief and all {workers} worker(s) exited with code 0 (successPolicy AllWorkers).")
        return True
    return False


def reconcile_ps(d: Draft, count: int, spec: PSTrainingJobSpec) -> bool:
    """PS replicas; returns True when the job failed."""
    policy = spec.replicaSpecs.PS.restartPolicy
    for index in range(count):
        pod = d.by_key.get((ReplicaType.PS, index))
        if pod is None:
            d.create_pod(ReplicaType.PS, index)
            continue
        if pod.terminating:
            if d.book.handled(pod):
                continue  # our own delete (restart, suspend): recreated once gone
            # Deleted by someone else (kubectl delete, a drain, the node lifecycle controller): the PS's
            # variables are lost as surely as after a failure, so the chief must restart too. Recreated once
            # gone, like an evicted pod (no exit code), whatever the policy; counted against backoffLimit.
            what = f"ps {index} (pod {pod.name}) was deleted"
            decision = lifecycle.decide(lifecycle.PS, lifecycle.RETRYABLE, ReplicaRestartPolicy.ALWAYS.value)
            delete = False
        else:
            if not pod.finished:
                continue
            decision = decide(d, ReplicaType.PS, policy, pod)
            if not decision.restarts and decision.outcome is None:
                continue  # a PS that chose to exit; the chief decides the job's fate
            if d.book.handled(pod):
                d.delete_pod(pod, "restart")
                continue
            what = _ended(pod, f"ps {index}")
            delete = True
        if not decision.restarts:
            d.move(On.PS_FAILED, f"{what}; restartPolicy {policy.value} does not retry it.")
            return True
        if decision.counted and not restart_allowed(d, what):
            return True
        d.book.retire(pod)
        if lifecycle.CHIEF in decision.restarts:
            d.status.chiefEpoch += 1  # the chief's pods of older epochs are restarted (restart_chief_for_epoch)
        ps_status = d.book.replica_status(ReplicaType.PS)
        ps_status.restarts += 1
        if pod.phase == "Failed" or not delete:
            ps_status.failed += 1
        d.move(On.PS_RESTART, f"{what}; restarting it and the chief, which restores the latest checkpoint.")
        if delete:
            d.delete_pod(pod, "restart")
    return False


def restart_chief_for_epoch(d: Draft, pod: ObservedPod) -> None:
    """Delete a chief pod of an older epoch (a PS restarted); counted as one chief restart, once per pod."""
    if d.book.retire(pod):
        d.book.replica_status(ReplicaType.CHIEF).restarts += 1
        d.event("Normal", "ChiefRestarting", f"Restarting the chief ({pod.name}) after a parameter server restart")
    d.delete_pod(pod, "restart after a parameter server restart")


def reconcile_chief(d: Draft, spec: PSTrainingJobSpec) -> bool:
    """The chief; returns True when the job failed."""
    policy = spec.replicaSpecs.Chief.restartPolicy
    pod = d.by_key.get((ReplicaType.CHIEF, 0))
    if pod is None:
        d.create_pod(ReplicaType.CHIEF, 0)
        return False
    if spec.successPolicy is SuccessPolicy.ALL_WORKERS and d.exited_0(ReplicaType.CHIEF, 0):
        return False  # done: the job succeeds once every worker has exited 0 too
    if pod.terminating:
        if d.book.handled(pod):
            return False  # our own delete: recreated once gone
        if pod.epoch < d.status.chiefEpoch:
            # Restarted for a PS restart (by an operator that did not mark it handled yet).
            if d.book.retire(pod):
                d.book.replica_status(ReplicaType.CHIEF).restarts += 1
            return False
        # Deleted by someone else: recreated once gone, like an evicted chief, within backoffLimit.
        return _chief_restart(d, f"the chief (pod {pod.name}) was deleted", pod, delete=False)
    if not pod.finished:
        if pod.epoch < d.status.chiefEpoch:
            restart_chief_for_epoch(d, pod)
        elif backoff_used(d) > spec.runPolicy.backoffLimit:
            d.move(On.BACKOFF_EXCEEDED, f"The chief and parameter servers restarted {backoff_used(d)} time(s) "
                                        f"(including in-place container restarts), more than backoffLimit "
                                        f"{spec.runPolicy.backoffLimit}.")
            return True
        return False
    # Failed (Succeeded was handled before).
    if d.book.handled(pod):
        d.delete_pod(pod, "restart")
        return False
    if pod.epoch < d.status.chiefEpoch:
        restart_chief_for_epoch(d, pod)  # part of the PS restart: not counted twice against backoffLimit
        return False
    what = _ended(pod, "the chief")
    if not retries(d, ReplicaType.CHIEF, policy, pod):
        d.move(On.CHIEF_FAILED, f"{what}; restartPolicy {policy.value} does not retry it.")
        return True
    return _chief_restart(d, what, pod, delete=True)


def _chief_restart(d: Draft, what: str, pod: ObservedPod, delete: bool) -> bool:
    """Count one chief restart against backoffLimit; returns True when the job failed instead."""
    if not restart_allowed(d, what):
        return True
    d.book.retire(pod)
    chief_status = d.book.replica_status(ReplicaType.CHIEF)
    chief_status.restarts += 1
    chief_status.failed += 1
    d.move(On.CHIEF_RESTART, f"{what}; restarting it.")  # counted against backoffLimit
    if delete:
        d.delete_pod(pod, "restart")
    return False


def reconcile_replicas(d: Draft, rt: ReplicaType, count: int, spec: PSTrainingJobSpec) -> bool:
    """Workers or the evaluator: replaced per policy, never restarting the job; returns True if it failed."""
    replica_spec = spec.replicaSpecs.get(rt)
    if replica_spec is None or count == 0:
        return False
    policy = replica_spec.restartPolicy
    done_for_good = 0
    for index in range(count):
        pod = d.by_key.get((rt, index))
        if pod is None:
            d.create_pod(rt, index)
            continue
        if pod.terminating or not pod.finished:
            continue
        retry = retries(d, rt, policy, pod)
        if not d.book.handled(pod):
            d.book.mark_handled(pod)
            status = d.book.replica_status(rt)
            what = _ended(pod, f"{rt.task_type} {index}")
            if pod.phase == "Failed":
                status.failed += 1
            if retry:
                status.restarts += 1
                d.event("Warning" if pod.phase == "Failed" else "Normal",
                        f"{rt.value}Restarting", f"{what}; replacing it.")
            else:
                d.event("Warning" if pod.phase == "Failed" else "Normal", f"{rt.value}Finished",
                        f"{what}; restartPolicy {policy.value} does not recreate it.")
        if retry:
            d.delete_pod(pod, "restart")
        elif pod.phase == "Failed":
            done_for_good += 1
    if rt is ReplicaType.WORKER and done_for_good and spec.successPolicy is SuccessPolicy.ALL_WORKERS:
        d.move(On.WORKER_FAILED, f"{done_for_good} worker(s) failed and their restartPolicy {policy.value} "
                                 f"does not recreate them; successPolicy AllWorkers needs every worker to exit 0.")
        return True
    if rt is ReplicaType.WORKER and done_for_good == count:
        d.move(On.ALL_WORKERS_FAILED, f"All {count} worker(s) failed and their restartPolicy "
                                      f"{policy.value} does not recreate them.")
        return True
    return False


def update_running(d: Draft, desired: dict[ReplicaType, int]) -> None:
    """The Running (and Restarting) condition: running once the chief, every PS and every worker still meant to
    run do; running again once the chief and every PS do after a restart."""
    def running(rt: ReplicaType, index: int) -> bool:
        pod = d.by_key.get((rt, index))
        return pod is not None and not pod.terminating and pod.phase == "Running"

    chief = d.by_key.get((ReplicaType.CHIEF, 0))
    core = (
        running(ReplicaType.CHIEF, 0)
        and chief is not None and chief.epoch >= d.status.chiefEpoch
        and all(running(ReplicaType.PS, i) for i in range(desired[ReplicaType.PS]))
    )
    if not core:
        return
    if d.book.is_true(ConditionType.RESTARTING):
        d.move(On.RUNNING_AGAIN, "The job is running again.", settled_message="The chief and parameter servers run again.",
               event_message="The chief and all parameter servers run again")
        return
    if d.book.is_true(ConditionType.RUNNING):
        return
    workers = []
    worker_policy = d.valid_spec.replicaSpecs.Worker.restartPolicy
    for index in range(desired[ReplicaType.WORKER]):
        pod = d.by_key.get((ReplicaType.WORKER, index))
        if pod is not None and pod.finished and not retries(d, ReplicaType.WORKER, worker_policy, pod):
            continue  # done for good
        workers.append(running(ReplicaType.WORKER, index))
    if workers and all(workers):
        d.move(On.ALL_RUNNING, "The chief, parameter servers and workers run.",
               event_message="All replicas are running")


def _ended(pod: ObservedPod, what: str) -> str:
    if pod.phase == "Succeeded":
        return f"{what} (pod {pod.name}) exited with code 0"
    if pod.exit_code is not None:
        return f"{what} (pod {pod.name}) failed with exit code {pod.exit_code}"
    return f"{what} (pod {pod.name}) failed ({pod.reason or 'no exit code'})"
