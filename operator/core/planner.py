"""The reconcile planner: ``plan(job, pods, services, secret, now) -> Plan(actions, status)``.

Pure: no I/O, no clock, no randomness. Everything it decides follows from what it is given, so an operator
restarted at any moment recomputes the same plan from what it observes, and a repeated action is a no-op
(children have deterministic names; deletes carry the pod's UID as a precondition).

The children's names, labels, TF_CONFIG and bodies are :mod:`kubeps.operator.core.children`; this module is the state
machine that decides when to create and delete them.

Rules (documented for users in docs/operator.md):

* Children: per replica one pod and one headless Service named ``<job>-<type>-<index>``; one Secret per job.
  Every pod is created with ``restartPolicy: Never``: the operator itself recreates pods to implement the
  replica's restart policy, so it sees every failure.
* Chief exits 0 -> Succeeded. cleanPodPolicy then deletes pods (and their Services): Running (default) what still
  runs, All everything, None nothing.
* Chief fails -> recreated when its restart policy retries the exit code (counts against backoffLimit), else
  Failed.
* PS fails -> the PS is recreated and the chief restarted (its epoch is bumped; a chief pod of an older epoch is
  deleted and recreated) so the coordinator rebuilds variables from the latest checkpoint. Counts against
  backoffLimit; Restarting names the PS.
* Worker fails -> recreated per policy, the job keeps running; not counted against backoffLimit. When every worker
  has failed for good -> Failed.
* backoffLimit: chief and PS recreations so far plus in-place container restarts (restartCount) of the live chief
  and PS pods; a restart that would go beyond it fails the job instead.
* Suspend deletes pods and Services; resume recreates them and resets startTime. activeDeadlineSeconds counts from
  startTime. ttlSecondsAfterFinished deletes the finished job.
* Once Succeeded or Failed, conditions are frozen; only cleanup, counts and TTL go on.

Size: most of this module is one class, the state machine (``_Planner``: one method per rule above, sharing the
observed state); splitting it would spread one decision over several files, so it stays whole.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable, Mapping


from kubeps.operator.api import models
from kubeps.operator.api.models import (
    CleanPodPolicy,
    ConditionType,
    PSTrainingJobSpec,
    PSTrainingJobStatus,
    ReplicaStatus,
    ReplicaType,
    RestartPolicy,
    SpecError,
)

from .children import (  # the handlers read the label names and PlanConfig from here too
    ANNOTATION_EPOCH as ANNOTATION_EPOCH,
    LABEL_INDEX,
    LABEL_JOB as LABEL_JOB,
    LABEL_ROLE as LABEL_ROLE,
    LABEL_TYPE,
    MAIN_CONTAINER_NAMES,
    TOKEN_KEY as TOKEN_KEY,
    PlanConfig as PlanConfig,
    child_name,
    pod_body,
    secret_body,
    secret_name as secret_name,
    service_body,
)

#: Covers every pod a job can have (chief, 100 PS, 1000 workers, evaluator), twice: a terminating pod and its
#: replacement. Dropping a UID still observed would count that pod again at every reconcile.
HANDLED_LIMIT = 4096

#: Condition reasons.
R_CREATED = "PSTrainingJobCreated"
R_RUNNING = "PSTrainingJobRunning"
R_SUCCEEDED = "ChiefSucceeded"
R_CHIEF_FAILED = "ChiefFailed"
R_PS_FAILED = "PSFailed"
R_ALL_WORKERS_FAILED = "AllWorkersFailed"
R_BACKOFF = "BackoffLimitExceeded"
R_DEADLINE = "DeadlineExceeded"
R_INVALID = "InvalidSpec"
R_INVALID_TEMPLATE = "InvalidPodTemplate"
R_SUSPENDED = "Suspended"
R_RESUMED = "Resumed"
R_SECRET_LOST = "TokenSecretLost"
R_PODS_WAITING = "PodsCannotStart"

#: Container waiting reasons that no wait fixes (a missing or unpullable image, a bad container config): they are
#: named in the Running condition and a Warning Event. Plain ContainerCreating and PodInitializing are not.
STUCK_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName",
                           "CreateContainerConfigError", "CreateContainerError"})


# ---------------------------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class CreateSecret:
    name: str
    body: dict  # without the token: the shell adds a random one under data[TOKEN_KEY]


@dataclass(frozen=True)
class CreateService:
    name: str
    body: dict


@dataclass(frozen=True)
class CreatePod:
    name: str
    body: dict
    replica_type: str
    index: int


@dataclass(frozen=True)
class DeletePod:
    name: str
    uid: str | None
    reason: str


@dataclass(frozen=True)
class DeleteService:
    name: str
    reason: str


@dataclass(frozen=True)
class DeleteJob:
    reason: str


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Plan:
    actions: list = field(default_factory=list)
    #: The whole new ``status`` (JSON-ready); compare with the old one to decide whether to write it.
    status: dict = field(default_factory=dict)
    #: Reconcile again after this many seconds (deadline, TTL), or None.
    requeue_after: float | None = None
    #: Every desired pod, Service and the Secret are observed.
    all_children_present: bool = False
    terminal: bool = False

    def of(self, kind: type) -> list:
        return [a for a in self.actions if isinstance(a, kind)]


# ---------------------------------------------------------------------------------------------- helpers
def fmt_time(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)


@dataclass
class ObservedPod:
    name: str
    uid: str | None
    replica_type: ReplicaType | None
    index: int | None
    phase: str
    terminating: bool
    ready: bool
    exit_code: int | None
    restart_count: int
    epoch: int
    reason: str | None
    #: When the main container (else the last container) terminated, if the kubelet said.
    finished_at: datetime | None = None
    #: Why a container of the pod cannot start ("container c: ErrImagePull: ..."), for STUCK_REASONS only.
    waiting: str | None = None

    @property
    def finished(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @property
    def live(self) -> bool:
        return not self.terminating and not self.finished


def observe_pod(pod: Mapping[str, Any]) -> ObservedPod:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    status = pod.get("status") or {}
    rt = models.BY_TASK_TYPE.get(labels.get(LABEL_TYPE, ""))
    try:
        index = int(labels.get(LABEL_INDEX, ""))
    except ValueError:
        index = None
    statuses = list(status.get("containerStatuses") or [])
    restart_count = sum(int(s.get("restartCount") or 0) for s in statuses)
    restart_count += sum(int(s.get("restartCount") or 0) for s in status.get("initContainerStatuses") or [])
    exit_code = None
    finished_at = None
    ordered = sorted(statuses, key=lambda s: s.get("name") not in MAIN_CONTAINER_NAMES)
    for s in ordered:  # the main container's code first, else the first non-zero one, else any
        term = (s.get("state") or {}).get("terminated")
        if term is not None and (exit_code is None or (exit_code == 0 and term.get("exitCode"))):
            exit_code = int(term.get("exitCode", 0))
            try:
                finished_at = parse_time(term.get("finishedAt"))
            except (TypeError, ValueError):
                finished_at = None
            if s.get("name") in MAIN_CONTAINER_NAMES and exit_code:
                break
    waiting = None
    for s in [*(status.get("initContainerStatuses") or []), *statuses]:
        w = (s.get("state") or {}).get("waiting") or {}
        if w.get("reason") in STUCK_REASONS:
            detail = str(w.get("message") or "")[:200]
            waiting = f"container {s.get('name')}: {w['reason']}" + (f": {detail}" if detail else "")
            break
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    try:
        epoch = int((meta.get("annotations") or {}).get(ANNOTATION_EPOCH, "0"))
    except ValueError:
        epoch = 0
    return ObservedPod(
        name=meta.get("name", ""),
        uid=meta.get("uid"),
        replica_type=rt,
        index=index,
        phase=status.get("phase") or "Pending",
        terminating=bool(meta.get("deletionTimestamp")),
        ready=ready and status.get("phase") == "Running",
        exit_code=exit_code,
        restart_count=restart_count,
        epoch=epoch,
        reason=status.get("reason"),
        finished_at=finished_at,
        waiting=waiting,
    )


# ---------------------------------------------------------------------------------------------- the planner
class _Planner:
    def __init__(self, job, pods, services, secret, now: datetime, config: PlanConfig):
        self.job = job
        self.meta = job.get("metadata") or {}
        self.name = self.meta.get("name", "")
        self.now = now
        self.now_text = fmt_time(now)
        self.config = config
        try:
            self.status = PSTrainingJobStatus.model_validate(job.get("status") or {})
        except Exception:  # noqa: BLE001 - a status we cannot read is rebuilt from what we observe
            self.status = PSTrainingJobStatus()
        uid = self.meta.get("uid")
        self.pods = [
            observe_pod(p)
            for p in pods
            if controlled_by(p, uid)
        ]
        self.services = {
            (s.get("metadata") or {}).get("name"): s for s in services if controlled_by(s, uid)
        }
        self.secret = secret
        self.plan = Plan()
        self.by_key: dict[tuple[ReplicaType, int], ObservedPod] = {}
        for pod in self.pods:
            if pod.replica_type is not None and pod.index is not None:
                self.by_key[(pod.replica_type, pod.index)] = pod
        self.spec: PSTrainingJobSpec | None = None

    # -- conditions ---------------------------------------------------------------------------------------------
    def condition(self, ctype: ConditionType):
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

    def event(self, etype: str, reason: str, message: str) -> None:
        self.plan.actions.append(Event(etype, reason, message))

    @property
    def terminal(self) -> bool:
        return self.is_true(ConditionType.SUCCEEDED) or self.is_true(ConditionType.FAILED)

    # -- terminal transitions -----------------------------------------------------------------------------------
    def fail(self, reason: str, message: str) -> None:
        self.set_condition(ConditionType.FAILED, True, reason, message)
        self._finish()
        self.event("Warning", reason, message)

    def succeed(self, message: str) -> None:
        self.set_condition(ConditionType.SUCCEEDED, True, R_SUCCEEDED, message)
        self._finish()
        self.event("Normal", R_SUCCEEDED, message)

    def _finish(self) -> None:
        for ctype in (ConditionType.RUNNING, ConditionType.RESTARTING):
            cond = self.condition(ctype)
            if cond is not None and cond.status == "True":
                self.set_condition(ctype, False, cond.reason or "", cond.message or "")
        self.status.completionTime = self.status.completionTime or self.now_text

    # -- helpers ------------------------------------------------------------------------------------------------
    def desired_counts(self) -> dict[ReplicaType, int]:
        counts = {rt: 0 for rt in models.REPLICA_TYPES}
        if self.spec is None:
            return counts
        for rt in models.REPLICA_TYPES:
            rs = self.spec.replicaSpecs.get(rt)
            counts[rt] = rs.replicas if rs is not None else 0
        return counts

    def replica_status(self, rt: ReplicaType) -> ReplicaStatus:
        return self.status.replicaStatuses.setdefault(rt.value, ReplicaStatus())

    def delete_pod(self, pod: ObservedPod, reason: str) -> None:
        self.plan.actions.append(DeletePod(pod.name, pod.uid, reason))

    def requeue(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        if self.plan.requeue_after is None or seconds < self.plan.requeue_after:
            self.plan.requeue_after = seconds

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
        if pod.replica_type in (ReplicaType.CHIEF, ReplicaType.PS):
            self.status.backoffCount += pod.restart_count
        return True

    def retries(self, policy: RestartPolicy, pod: ObservedPod) -> bool:
        """Whether a replica's restart policy recreates this finished pod."""
        if pod.phase == "Succeeded":
            return policy is RestartPolicy.ALWAYS
        if policy is RestartPolicy.NEVER:
            return False
        if policy is RestartPolicy.EXIT_CODE:
            return self.spec.runPolicy.retryable(pod.exit_code)
        return True

    def backoff_used(self) -> int:
        # Pods already retired have their in-place restarts folded into backoffCount.
        live = sum(
            p.restart_count
            for p in self.pods
            if p.replica_type in (ReplicaType.CHIEF, ReplicaType.PS) and not self.handled(p)
        )
        return self.status.backoffCount + live

    # -- cleanup & TTL ------------------------------------------------------------------------------------------
    def cleanup(self) -> None:
        policy = CleanPodPolicy.RUNNING
        if self.spec is not None:
            policy = self.spec.runPolicy.cleanPodPolicy
        else:
            raw = self.raw_run_policy().get("cleanPodPolicy")
            if isinstance(raw, str) and raw in {p.value for p in CleanPodPolicy}:
                policy = CleanPodPolicy(raw)
        if policy is CleanPodPolicy.NONE:
            return
        removed: set[str] = set()
        for pod in sorted(self.pods, key=lambda p: p.name):
            if pod.terminating:
                removed.add(pod.name)
                continue
            if policy is CleanPodPolicy.ALL or not pod.finished:
                self.delete_pod(pod, "cleanPodPolicy " + policy.value)
                removed.add(pod.name)
        for svc_name in sorted(self.services):
            if policy is CleanPodPolicy.ALL or svc_name in removed:
                self.plan.actions.append(DeleteService(svc_name, "cleanPodPolicy " + policy.value))

    def raw_run_policy(self) -> dict:
        """``spec.runPolicy`` as written, for a job whose spec the models rejected (any shape)."""
        spec = self.job.get("spec")
        run_policy = spec.get("runPolicy") if isinstance(spec, dict) else None
        return run_policy if isinstance(run_policy, dict) else {}

    def ttl(self) -> None:
        if self.spec is not None:
            raw = self.spec.runPolicy.ttlSecondsAfterFinished
        else:
            raw = self.raw_run_policy().get("ttlSecondsAfterFinished")
            if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
                return  # an invalid spec with an unusable TTL: keep the failed job
        if raw is None:
            return
        finished = parse_time(self.status.completionTime) or self.now
        due = finished + timedelta(seconds=int(raw))
        if self.now >= due:
            self.plan.actions.append(DeleteJob(f"ttlSecondsAfterFinished={raw} passed since {fmt_time(finished)}"))
        else:
            self.requeue((due - self.now).total_seconds())

    # -- main ---------------------------------------------------------------------------------------------------
    def run(self) -> Plan:
        if self.meta.get("deletionTimestamp"):
            # Being deleted (foreground cascade, or a finalizer of someone else's): the garbage collector removes
            # the children; recreating them would fight it. Nothing to do, nothing to write.
            self.plan.status = copy.deepcopy(dict(self.job.get("status") or {}))
            return self.plan
        if not self.terminal:
            try:
                models.check_name(self.name)
                self.spec = models.parse_spec(self.job.get("spec"))
            except SpecError as err:
                self.fail(R_INVALID, str(err))
        else:
            try:
                self.spec = models.parse_spec(self.job.get("spec"))
            except SpecError:
                self.spec = None
        if not self.terminal:
            self.check_templates()
        if not self.terminal:
            self.reconcile()
        if self.terminal:
            self.cleanup()
            self.ttl()
            self.plan.terminal = True
        self.summarise()
        return self.plan

    def check_templates(self) -> None:
        """Fail the job when a template cannot be made into a pod (the CRD preserves unknown fields, so e.g.
        ``metadata.labels: "a=b"`` or ``env: "X=1"`` reach the planner) instead of raising on every reconcile."""
        for rt in models.REPLICA_TYPES:
            if self.spec.replicaSpecs.get(rt) is None:
                continue
            try:
                pod_body(self.job, rt, 0, self.status.chiefEpoch, self.config)
                service_body(self.job, rt, 0)
            except (TypeError, ValueError, AttributeError, KeyError, IndexError) as err:
                self.fail(R_INVALID_TEMPLATE, f"spec.replicaSpecs.{rt.value}.template cannot be made into a pod: "
                                              f"{type(err).__name__}: {err}")
                return

    def reconcile(self) -> None:
        spec = self.spec
        assert spec is not None
        run_policy = spec.runPolicy
        self.status.observedGeneration = self.meta.get("generation")
        if self.set_condition(ConditionType.CREATED, True, R_CREATED,
                              f"PSTrainingJob {self.meta.get('namespace')}/{self.name} is created."):
            self.event("Normal", R_CREATED, f"PSTrainingJob {self.name} is created")
        if self.secret is None:
            self.plan.actions.append(CreateSecret(secret_name(self.name), secret_body(self.job)))
        desired = self.desired_counts()

        # Suspend / resume.
        if run_policy.suspend:
            if self.set_condition(ConditionType.SUSPENDED, True, R_SUSPENDED, "The job is suspended."):
                self.event("Normal", R_SUSPENDED, "Job suspended: deleting its pods and Services")
            for ctype in (ConditionType.RUNNING, ConditionType.RESTARTING):
                self.set_condition(ctype, False, R_SUSPENDED, "The job is suspended.")
            for pod in sorted(self.pods, key=lambda p: p.name):
                if pod.replica_type in (ReplicaType.CHIEF, ReplicaType.PS):
                    self.retire(pod)  # so that a pod still terminating at resume is not taken for a lost one
                if not pod.terminating:
                    self.delete_pod(pod, "suspended")
            for svc_name in sorted(self.services):
                self.plan.actions.append(DeleteService(svc_name, "suspended"))
            return
        if self.is_true(ConditionType.SUSPENDED):
            self.set_condition(ConditionType.SUSPENDED, False, R_RESUMED, "The job is resumed.")
            self.status.startTime = self.now_text
            self.event("Normal", R_RESUMED, "Job resumed: recreating its pods and Services")
        if self.status.startTime is None:
            self.status.startTime = self.now_text

        # Chief success ends the job, whatever else happened in the meantime; a chief that finished before the
        # deadline succeeded even when the operator only sees it after the deadline (restart, lag).
        chief = self.by_key.get((ReplicaType.CHIEF, 0))
        succeeded = chief is not None and not chief.terminating and chief.phase == "Succeeded"
        deadline = None
        if run_policy.activeDeadlineSeconds is not None:
            started = parse_time(self.status.startTime) or self.now
            deadline = started + timedelta(seconds=run_policy.activeDeadlineSeconds)
        if succeeded and (deadline is None or self.now < deadline or chief.finished_at is None
                          or chief.finished_at <= deadline):
            self.succeed(f"The chief ({chief.name}) exited with code 0.")
            return

        # Deadline.
        if deadline is not None:
            elapsed = (self.now - started).total_seconds()
            if self.now >= deadline:
                self.fail(R_DEADLINE, f"The job ran {int(elapsed)} s, longer than activeDeadlineSeconds="
                                      f"{run_policy.activeDeadlineSeconds}.")
                return
            self.requeue((deadline - self.now).total_seconds())

        # The job's token Secret is gone (deleted by hand) while its pods run with the token it held. A pod started
        # now would get the new token the operator creates, which the running ones refuse: restart them all.
        if self.secret is None and self.restart_for_lost_secret():
            return

        # Pods that should not exist: replica types or indices beyond the spec (Worker scale-down).
        for pod in sorted(self.pods, key=lambda p: (p.replica_type is None, str(p.replica_type), -(p.index or 0))):
            if pod.terminating:
                continue
            if pod.replica_type is None or pod.index is None or pod.index >= desired[pod.replica_type]:
                self.delete_pod(pod, "scaled down")
                self.event("Normal", "ScaledDown", f"Deleting pod {pod.name}: beyond the spec's replicas")

        if self.reconcile_ps(desired[ReplicaType.PS], spec):
            return
        if self.reconcile_chief(spec):
            return
        if self.reconcile_replicas(ReplicaType.WORKER, desired[ReplicaType.WORKER], spec):
            return
        self.reconcile_replicas(ReplicaType.EVALUATOR, desired[ReplicaType.EVALUATOR], spec)
        self.reconcile_services(desired)
        self.update_running(desired)
        self.report_stuck_pods()

    def create_pod(self, rt: ReplicaType, index: int) -> None:
        body = pod_body(self.job, rt, index, self.status.chiefEpoch, self.config)
        self.plan.actions.append(CreatePod(body["metadata"]["name"], body, rt.value, index))

    def restart_allowed(self, what: str) -> bool:
        """Whether backoffLimit leaves room for one more chief/PS restart; fails the job when not."""
        limit = self.spec.runPolicy.backoffLimit
        used = self.backoff_used()
        if used >= limit:
            self.fail(R_BACKOFF, f"{what}, but the job already restarted its chief and parameter servers {used} "
                                 f"time(s) and backoffLimit is {limit}.")
            return False
        return True

    def reconcile_ps(self, count: int, spec: PSTrainingJobSpec) -> bool:
        """PS replicas; returns True when the job failed."""
        policy = spec.replicaSpecs.PS.restartPolicy
        for index in range(count):
            pod = self.by_key.get((ReplicaType.PS, index))
            if pod is None:
                self.create_pod(ReplicaType.PS, index)
                continue
            if pod.terminating:
                if self.handled(pod):
                    continue  # our own delete (restart, suspend): recreated once gone
                # Deleted by someone else (kubectl delete, a drain, the node lifecycle controller): the PS's
                # variables are lost as surely as after a failure, so the chief must restart too. Recreated once
                # gone, like an evicted pod (no exit code), whatever the policy; counted against backoffLimit.
                what = f"ps {index} (pod {pod.name}) was deleted"
                retry, delete = True, False
            else:
                if not pod.finished:
                    continue
                if pod.phase == "Succeeded" and policy is not RestartPolicy.ALWAYS:
                    continue  # a PS that chose to exit; the chief decides the job's fate
                if self.handled(pod):
                    self.delete_pod(pod, "restart")
                    continue
                what = _ended(pod, f"ps {index}")
                retry, delete = self.retries(policy, pod), True
            if not retry:
                self.fail(R_PS_FAILED, f"{what}; restartPolicy {policy.value} does not retry it.")
                return True
            if not self.restart_allowed(what):
                return True
            self.retire(pod)
            self.status.backoffCount += 1
            self.status.chiefEpoch += 1
            ps_status = self.replica_status(ReplicaType.PS)
            ps_status.restarts += 1
            if pod.phase == "Failed" or not delete:
                ps_status.failed += 1
            message = f"{what}; restarting it and the chief, which restores the latest checkpoint."
            self.set_condition(ConditionType.RESTARTING, True, R_PS_FAILED, message)
            self.set_condition(ConditionType.RUNNING, False, R_PS_FAILED, message)
            self.event("Warning", "PSRestarting", message)
            if delete:
                self.delete_pod(pod, "restart")
        return False

    def restart_for_lost_secret(self) -> bool:
        """Delete every pod of the job after its token Secret vanished; returns whether any was deleted. Not a
        failure of the job's: nothing is counted against backoffLimit."""
        present = [p for p in self.pods if not p.terminating]
        if not present:
            return False
        message = (f"Secret {secret_name(self.name)} was deleted while {len(present)} pod(s) held its token; "
                   f"restarting them all with a new token, the chief restores the latest checkpoint.")
        self.set_condition(ConditionType.RESTARTING, True, R_SECRET_LOST, message)
        self.set_condition(ConditionType.RUNNING, False, R_SECRET_LOST, message)
        self.event("Warning", R_SECRET_LOST, message)
        for pod in sorted(present, key=lambda p: p.name):
            if pod.replica_type in (ReplicaType.CHIEF, ReplicaType.PS) and self.retire(pod):
                self.replica_status(pod.replica_type).restarts += 1
            else:
                self.mark_handled(pod)
            self.delete_pod(pod, "token Secret lost")
        return True

    def restart_chief_for_epoch(self, pod: ObservedPod) -> None:
        """Delete a chief pod of an older epoch (a PS restarted); counted as one chief restart, once per pod."""
        if self.retire(pod):
            self.replica_status(ReplicaType.CHIEF).restarts += 1
            self.event("Normal", "ChiefRestarting", f"Restarting the chief ({pod.name}) after a parameter server "
                                                    f"restart")
        self.delete_pod(pod, "restart after a parameter server restart")

    def reconcile_chief(self, spec: PSTrainingJobSpec) -> bool:
        policy = spec.replicaSpecs.Chief.restartPolicy
        pod = self.by_key.get((ReplicaType.CHIEF, 0))
        if pod is None:
            self.create_pod(ReplicaType.CHIEF, 0)
            return False
        if pod.terminating:
            if self.handled(pod):
                return False  # our own delete: recreated once gone
            if pod.epoch < self.status.chiefEpoch:
                # Restarted for a PS restart (by an operator that did not mark it handled yet).
                if self.retire(pod):
                    self.replica_status(ReplicaType.CHIEF).restarts += 1
                return False
            # Deleted by someone else: recreated once gone, like an evicted chief, within backoffLimit.
            return self.chief_restart(f"the chief (pod {pod.name}) was deleted", pod, delete=False)
        if not pod.finished:
            if pod.epoch < self.status.chiefEpoch:
                self.restart_chief_for_epoch(pod)
            elif self.backoff_used() > spec.runPolicy.backoffLimit:
                self.fail(R_BACKOFF, f"The chief and parameter servers restarted {self.backoff_used()} time(s) "
                                     f"(including in-place container restarts), more than backoffLimit "
                                     f"{spec.runPolicy.backoffLimit}.")
                return True
            return False
        # Failed (Succeeded was handled before).
        if self.handled(pod):
            self.delete_pod(pod, "restart")
            return False
        if pod.epoch < self.status.chiefEpoch:
            self.restart_chief_for_epoch(pod)  # part of the PS restart: not counted twice against backoffLimit
            return False
        what = _ended(pod, "the chief")
        if not self.retries(policy, pod):
            self.fail(R_CHIEF_FAILED, f"{what}; restartPolicy {policy.value} does not retry it.")
            return True
        return self.chief_restart(what, pod, delete=True)

    def chief_restart(self, what: str, pod: ObservedPod, delete: bool) -> bool:
        """Count one chief restart against backoffLimit; returns True when the job failed instead."""
        if not self.restart_allowed(what):
            return True
        self.retire(pod)
        self.status.backoffCount += 1
        chief_status = self.replica_status(ReplicaType.CHIEF)
        chief_status.restarts += 1
        chief_status.failed += 1
        message = f"{what}; restarting it."
        self.set_condition(ConditionType.RESTARTING, True, R_CHIEF_FAILED, message)
        self.set_condition(ConditionType.RUNNING, False, R_CHIEF_FAILED, message)
        self.event("Warning", "ChiefRestarting", message)
        if delete:
            self.delete_pod(pod, "restart")
        return False

    def reconcile_replicas(self, rt: ReplicaType, count: int, spec: PSTrainingJobSpec) -> bool:
        """Workers or the evaluator: replaced per policy, never restarting the job; returns True if it failed."""
        replica_spec = spec.replicaSpecs.get(rt)
        if replica_spec is None or count == 0:
            return False
        policy = replica_spec.restartPolicy
        done_for_good = 0
        for index in range(count):
            pod = self.by_key.get((rt, index))
            if pod is None:
                self.create_pod(rt, index)
                continue
            if pod.terminating or not pod.finished:
                continue
            retry = self.retries(policy, pod)
            if not self.handled(pod):
                self.mark_handled(pod)
                status = self.replica_status(rt)
                what = _ended(pod, f"{rt.task_type} {index}")
                if pod.phase == "Failed":
                    status.failed += 1
                if retry:
                    status.restarts += 1
                    self.event("Warning" if pod.phase == "Failed" else "Normal",
                               f"{rt.value}Restarting", f"{what}; replacing it.")
                else:
                    self.event("Warning" if pod.phase == "Failed" else "Normal", f"{rt.value}Finished",
                               f"{what}; restartPolicy {policy.value} does not recreate it.")
            if retry:
                self.delete_pod(pod, "restart")
            elif pod.phase == "Failed":
                done_for_good += 1
        if rt is ReplicaType.WORKER and done_for_good == count:
            self.fail(R_ALL_WORKERS_FAILED, f"All {count} worker(s) failed and their restartPolicy "
                                            f"{policy.value} does not recreate them.")
            return True
        return False

    def reconcile_services(self, desired: dict[ReplicaType, int]) -> None:
        wanted: dict[str, tuple[ReplicaType, int]] = {}
        for rt in models.REPLICA_TYPES:
            for index in range(desired[rt]):
                wanted[child_name(self.name, rt, index)] = (rt, index)
        for svc_name, (rt, index) in wanted.items():
            svc = self.services.get(svc_name)
            if svc is None:
                body = service_body(self.job, rt, index)
                self.plan.actions.append(CreateService(svc_name, body))
        for svc_name in sorted(self.services, reverse=True):
            if svc_name not in wanted and not (self.services[svc_name].get("metadata") or {}).get(
                "deletionTimestamp"
            ):
                self.plan.actions.append(DeleteService(svc_name, "scaled down"))

    def update_running(self, desired: dict[ReplicaType, int]) -> None:
        def running(rt: ReplicaType, index: int) -> bool:
            pod = self.by_key.get((rt, index))
            return pod is not None and not pod.terminating and pod.phase == "Running"

        chief = self.by_key.get((ReplicaType.CHIEF, 0))
        core = (
            running(ReplicaType.CHIEF, 0)
            and chief.epoch >= self.status.chiefEpoch
            and all(running(ReplicaType.PS, i) for i in range(desired[ReplicaType.PS]))
        )
        if not core:
            return
        if self.is_true(ConditionType.RESTARTING):
            self.set_condition(ConditionType.RESTARTING, False, R_RUNNING, "The chief and parameter servers run again.")
            self.set_condition(ConditionType.RUNNING, True, R_RUNNING, "The job is running again.")
            self.event("Normal", R_RUNNING, "The chief and all parameter servers run again")
            return
        if self.is_true(ConditionType.RUNNING):
            return
        workers = []
        for index in range(desired[ReplicaType.WORKER]):
            pod = self.by_key.get((ReplicaType.WORKER, index))
            if pod is not None and pod.finished and not self.retries(self.spec.replicaSpecs.Worker.restartPolicy, pod):
                continue  # done for good
            workers.append(running(ReplicaType.WORKER, index))
        if workers and all(workers):
            self.set_condition(ConditionType.RUNNING, True, R_RUNNING, "The chief, parameter servers and workers run.")
            self.event("Normal", R_RUNNING, "All replicas are running")

    def report_stuck_pods(self) -> None:
        """Pods whose containers cannot start (STUCK_REASONS) are named in a ``Running: False`` condition, with a
        Warning Event when that begins: a TFJob in the same state just stays Created. Only while the job has not
        run yet (or this condition is the one that says why); it goes away when the pods start."""
        cond = self.condition(ConditionType.RUNNING)
        if cond is not None and cond.reason != R_PODS_WAITING:
            return  # running, or not running for a reason of its own (restarting, suspended)
        stuck = sorted((p for p in self.pods if p.live and p.waiting), key=lambda p: p.name)
        if not stuck:
            if cond is not None:
                self.status.conditions.remove(cond)
            return
        message = f"{len(stuck)} pod(s) cannot start; {stuck[0].name}: {stuck[0].waiting}"
        if cond is None:
            self.status.conditions.append(models.Condition(
                type=ConditionType.RUNNING, status="False", reason=R_PODS_WAITING, message=message,
                lastTransitionTime=self.now_text, lastUpdateTime=self.now_text))
            self.event("Warning", R_PODS_WAITING, message)
        elif cond.message != message:
            cond.message, cond.lastUpdateTime = message, self.now_text

    def summarise(self) -> None:
        desired = self.desired_counts()
        live_pods = [p for p in self.pods if not p.terminating]
        deleted = {a.name for a in self.plan.actions if isinstance(a, DeletePod)}
        for rt in models.REPLICA_TYPES:
            mine = [p for p in live_pods if p.replica_type is rt and p.name not in deleted]
            if not mine and desired[rt] == 0 and rt.value not in self.status.replicaStatuses:
                continue
            rs = self.replica_status(rt)
            rs.active = sum(1 for p in mine if p.phase in ("Pending", "Running"))
            rs.ready = sum(1 for p in mine if p.ready)
            rs.succeeded = sum(1 for p in mine if p.phase == "Succeeded")
        chief = self.by_key.get((ReplicaType.CHIEF, 0))
        self.status.chief = chief.phase if chief is not None and chief.name not in deleted else "-"
        ps = self.status.replicaStatuses.get(ReplicaType.PS.value, ReplicaStatus())
        workers = self.status.replicaStatuses.get(ReplicaType.WORKER.value, ReplicaStatus())
        self.status.ps = f"{ps.ready}/{desired[ReplicaType.PS]}"
        self.status.workers = f"{workers.ready}/{desired[ReplicaType.WORKER]}"
        self.status.restarts = sum(rs.restarts for rs in self.status.replicaStatuses.values())
        self.status.state = _state(self)
        observed_uids = {p.uid for p in self.pods}
        self.status.handledPods = [u for u in self.status.handledPods if u in observed_uids][-HANDLED_LIMIT:]
        self.plan.status = self.status.model_dump(mode="json", exclude_none=True)
        if not self.terminal and self.spec is not None and not self.spec.runPolicy.suspend:
            have_pods = all(
                (rt, i) in self.by_key for rt in models.REPLICA_TYPES for i in range(desired[rt])
            )
            have_svcs = all(
                child_name(self.name, rt, i) in self.services for rt in models.REPLICA_TYPES for i in range(desired[rt])
            )
            self.plan.all_children_present = have_pods and have_svcs and self.secret is not None


def _state(planner: _Planner) -> str:
    for ctype in (ConditionType.FAILED, ConditionType.SUCCEEDED, ConditionType.SUSPENDED,
                  ConditionType.RESTARTING, ConditionType.RUNNING, ConditionType.CREATED):
        if planner.is_true(ctype):
            return ctype.value
    return ""


def _ended(pod: ObservedPod, what: str) -> str:
    if pod.phase == "Succeeded":
        return f"{what} (pod {pod.name}) exited with code 0"
    if pod.exit_code is not None:
        return f"{what} (pod {pod.name}) failed with exit code {pod.exit_code}"
    return f"{what} (pod {pod.name}) failed ({pod.reason or 'no exit code'})"


def controlled_by(obj: Mapping[str, Any], uid: str | None) -> bool:
    """Whether ``obj`` names the job with ``uid`` as its controller (an owner reference with controller true)."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("controller") and ref.get("uid") == uid for ref in refs)


def plan(
    job: Mapping[str, Any],
    pods: Iterable[Mapping[str, Any]],
    services: Iterable[Mapping[str, Any]],
    secret: Mapping[str, Any] | None,
    now: datetime,
    config: PlanConfig = PlanConfig(),
) -> Plan:
    """Decide what to do for one job from what is observed; see the module docstring for the rules."""
    return _Planner(job, list(pods), list(services), secret, now, config).run()


def fail_status(job: Mapping[str, Any], reason: str, message: str, now: datetime) -> dict:
    """The job's status once failed for a reason found while applying a plan (e.g. the API server refused a pod
    built from the template)."""
    planner = _Planner(job, [], [], None, now, PlanConfig())
    if not planner.terminal:
        planner.fail(reason, message)
    planner.status.state = _state(planner)
    return planner.status.model_dump(mode="json", exclude_none=True)
