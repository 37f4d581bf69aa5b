"""The job's status as one reconcile rewrites it: its conditions (with their reasons), the pods already accounted
for, the per-role counts.

:class:`StatusBook` keeps the bookkeeping rules the planner's decisions rely on, apart from the decisions:

* a condition's ``lastTransitionTime`` moves only when its status flips, ``lastUpdateTime`` whenever its reason or
  message changes; a condition never set is not written as False;
* a finished job (Succeeded or Failed) has no condition Running or Restarting left True;
* a pod of a counted role (:data:`COUNTED`: the chief, a PS) that goes away is *retired* once: marked handled (by UID, so a restarted operator never counts
  it again) with its in-place container restarts folded into ``backoffCount``.

Pure: the time is given (``now``), nothing is read or written elsewhere.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Mapping

from kubeps.runtime import lifecycle

from kubeps.operator.api import models
from kubeps.operator.api.models import ConditionType, PSTrainingJobStatus, ReplicaStatus, ReplicaType

from .observed import ObservedPod, fmt_time

#: Covers every pod a job can have (chief, 100 PS, 1000 workers, evaluator), twice: a terminating pod and its
#: replacement. Dropping a UID still observed would count that pod again at every reconcile.
HANDLED_LIMIT = 4096

#: The replica types whose restarts count against backoffLimit: the lifecycle table's counted roles (the chief and
#: the parameter servers).
COUNTED = frozenset(rt for rt in models.REPLICA_TYPES if lifecycle.ROLES[rt.task_type].counted)

#: Condition reasons.
R_CREATED = "PSTrainingJobCreated"
R_RUNNING = "PSTrainingJobRunning"
R_SUCCEEDED = "ChiefSucceeded"
R_CHIEF_FAILED = "ChiefFailed"
R_PS_FAILED = "PSFailed"
R_PS_SCALED = "PSReplicasChanged"
R_CHECKPOINT_REQUESTED = "CheckpointRequested"
R_ALL_WORKERS_FAILED = "AllWorkersFailed"
#: successPolicy AllWorkers: the chief and every worker exited 0; one worker failed for good
R_ALL_WORKERS_SUCCEEDED = "AllWorkersSucceeded"
R_WORKER_FAILED = "WorkerFailed"
R_BACKOFF = "BackoffLimitExceeded"
R_DEADLINE = "DeadlineExceeded"
R_INVALID = "InvalidSpec"
R_INVALID_TEMPLATE = "InvalidPodTemplate"
R_SUSPENDED = "Suspended"
R_RESUMED = "Resumed"
R_SECRET_LOST = "TokenSecretLost"
R_PODS_WAITING = "PodsCannotStart"

#: The condition that names the job's state (``status.state``, the State column), first true one wins.
_STATE_ORDER = (ConditionType.FAILED, ConditionType.SUCCEEDED, ConditionType.SUSPENDED,
                ConditionType.RESTARTING, ConditionType.RUNNING, ConditionType.CREATED)


class StatusBook:
    """The status of one job being rewritten at ``now``; :attr:`status` is the model the planner edits."""

    def __init__(self, raw: Mapping[str, Any] | None, now: datetime):
        self.now_text = fmt_time(now)
        try:
            self.status = PSTrainingJobStatus.model_validate(raw or {})
        except Exception:  # noqa: BLE001 - a status we cannot read is rebuilt from what we observe
            self.status = PSTrainingJobStatus()

    # -- conditions ---------------------------------------------------------------------------------------------
    def condition(self, ctype: ConditionType) -> models.Condition | None:
        for cond in self.status.conditions:
            if cond.type == ctype:
                return cond
        return None

    def is_true(self, ctype: ConditionType) -> bool:
        cond = self.condition(ctype)
        return cond is not None and cond.status == "True"

    def set_condition(self, ctype: ConditionType, status: bool, reason: str, message: str) -> bool:
        """Set a condition; returns True when its status changed."""
        text = "True" if status else "False"
        cond = self.condition(ctype)
        if cond is None:
            if not status:
                return False
            cond = models.Condition(type=ctype, status=text, reason=reason, message=message,
                                    lastTransitionTime=self.now_text, lastUpdateTime=self.now_text)
            self.status.conditions.append(cond)
            return True
        changed = cond.status != text
        if changed:
            cond.lastTransitionTime = self.now_text
        if changed or cond.reason != reason or cond.message != message:
            cond.status, cond.reason, cond.message = text, reason, message
            cond.lastUpdateTime = self.now_text
        return changed

    @property
    def terminal(self) -> bool:
        return self.is_true(ConditionType.SUCCEEDED) or self.is_true(ConditionType.FAILED)

    def finish(self) -> None:
        """The job just succeeded or failed: nothing runs or restarts any more, and it completed now."""
        for ctype in (ConditionType.RUNNING, ConditionType.RESTARTING):
            cond = self.condition(ctype)
            if cond is not None and cond.status == "True":
                self.set_condition(ctype, False, cond.reason or "", cond.message or "")
        self.status.completionTime = self.status.completionTime or self.now_text

    def state(self) -> str:
        """The job's state for ``status.state``: the first true condition of failed, succeeded, suspended,
        restarting, running, created."""
        for ctype in _STATE_ORDER:
            if self.is_true(ctype):
                return ctype.value
        return ""

    # -- counts and handled pods --------------------------------------------------------------------------------
    def replica_status(self, rt: ReplicaType) -> ReplicaStatus:
        return self.status.replicaStatuses.setdefault(rt.value, ReplicaStatus())

    def handled(self, pod: ObservedPod) -> bool:
        return pod.uid is not None and pod.uid in self.status.handledPods

    def mark_handled(self, pod: ObservedPod) -> None:
        if pod.uid is not None and pod.uid not in self.status.handledPods:
            self.status.handledPods.append(pod.uid)

    def retire(self, pod: ObservedPod) -> bool:
        """Account for a chief or PS pod that goes away (restarted, deleted, suspended) once: mark it handled and
        keep its in-place container restarts in ``backoffCount``, which would otherwise vanish with the pod.
        Returns False when it was already retired."""
        if self.handled(pod):
            return False
        self.mark_handled(pod)
        if pod.replica_type in COUNTED:
            self.status.backoffCount += pod.restart_count
        return True

    def forget_unobserved(self, observed_uids: set[str | None]) -> None:
        """Keep only the handled UIDs of pods still observed (at most :data:`HANDLED_LIMIT`)."""
        self.status.handledPods = [u for u in self.status.handledPods if u in observed_uids][-HANDLED_LIMIT:]

    def to_json(self) -> dict[str, Any]:
        return self.status.model_dump(mode="json", exclude_none=True)
