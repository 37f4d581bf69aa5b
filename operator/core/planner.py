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
* Chief exits 0 -> Succeeded (successPolicy ChiefOnly, the default). With successPolicy AllWorkers: once the chief
  and every worker exited 0 (a worker failed for good -> Failed). cleanPodPolicy then deletes pods (and their
  Services): Running (default) what still runs, All everything, None nothing.
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
* Kueue (operator setting on, job labelled ``kueue.x-k8s.io/queue-name``): no pod runs until the job's Workload is
  Admitted; the job is Suspended (reason Queued or Evicted) meanwhile. :mod:`.kueue` is the protocol.
* Gang scheduling (:mod:`.gang`): the job's PodGroup is made with its pods while it runs, deleted when it is
  suspended or finished.

Parts: what the children are is :mod:`.children`; what the planner reads of a pod is :mod:`.observed`; the
actions and :class:`~.actions.Plan` it returns are :mod:`.actions`; the status bookkeeping (conditions, reasons,
handled pods) is :mod:`.status`. What stays here is one class, the state machine (``_Planner``: one method per
rule above, sharing the observed state); splitting it further would spread one decision over several files.
"""

from __future__ import annotations

import copy
from datetime import datetime, timedelta
from typing import Any, Iterable, Mapping

from kubeps.operator.api import models
from kubeps.operator.api.models import (
    CleanPodPolicy,
    ConditionType,
    NetworkPolicyMode,
    PSTrainingJobSpec,
    ReplicaStatus,
    ReplicaType,
    ReplicaRestartPolicy,
    SpecError,
    SuccessPolicy,
)

from . import gang
from .actions import (CreateNetworkPolicy, CreatePod, CreateSecret, CreateService, DeleteJob, DeletePod, DeleteService,
                      Event, Plan, ReissueCertificate)
from . import kueue
from .children import (ANNOTATION_NETWORK_POLICY, ANNOTATION_TLS_WORKERS, PlanConfig, child_name, network_policy_body, network_policy_mode,
                       network_policy_name, pod_body, secret_body, secret_name, service_body, tls_enabled, tls_hosts)
from .observed import ObservedPod, controlled_by, fmt_time, observe_pod, parse_time
from .status import (
    R_ALL_WORKERS_FAILED,
    R_ALL_WORKERS_SUCCEEDED,
    R_BACKOFF,
    R_CHIEF_FAILED,
    R_CREATED,
    R_DEADLINE,
    R_INVALID,
    R_INVALID_TEMPLATE,
    R_PODS_WAITING,
    R_PS_FAILED,
    R_RESUMED,
    R_RUNNING,
    R_SECRET_LOST,
    R_SUCCEEDED,
    R_SUSPENDED,
    R_WORKER_FAILED,
    StatusBook,
)


# ---------------------------------------------------------------------------------------------- the planner
def _covered_workers(secret: Mapping[str, Any]) -> int:
    """How many Worker indices the Secret's task certificate names (its annotation; unknown: as many as needed,
    for a Secret the shell has not told about)."""
    value = ((secret.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_TLS_WORKERS)
    try:
        return int(str(value))
    except ValueError:  # None, or not a number
        return 1 << 30


class _Planner:
    def __init__(self, job: Mapping[str, Any], pods: list[Mapping[str, Any]], services: list[Mapping[str, Any]],
                 secret: Mapping[str, Any] | None, now: datetime, config: PlanConfig,
                 pod_group: Mapping[str, Any] | None = None, queue: kueue.QueueView | None = None):
        self.job = job
        self.queue_view = queue or kueue.QueueView()
        #: the job's Kueue admission, for a queued job once its spec parsed
        self.queueing: kueue.Queueing | None = None
        self.meta: Mapping[str, Any] = job.get("metadata") or {}
        self.name: str = self.meta.get("name", "")
        self.now = now
        self.config = config
        self.book = StatusBook(job.get("status"), now)
        self.status = self.book.status  # the model the rules below edit
        uid = self.meta.get("uid")
        self.pods = [
            observe_pod(p)
            for p in pods
            if controlled_by(p, uid)
        ]
        self.services: dict[str, Mapping[str, Any]] = {
            _name(s): s for s in services if controlled_by(s, uid)
        }
        self.secret = secret
        self.pod_group = pod_group
        self.plan = Plan()
        self.by_key: dict[tuple[ReplicaType, int], ObservedPod] = {}
        for pod in self.pods:
            if pod.replica_type is not None and pod.index is not None:
                self.by_key[(pod.replica_type, pod.index)] = pod
        self.spec: PSTrainingJobSpec | None = None

    @property
    def valid_spec(self) -> PSTrainingJobSpec:
        """The parsed spec, for the rules that run only once it parsed (pods are made, restarts decided)."""
        assert self.spec is not None, "a rule that needs the spec ran before it parsed"
        return self.spec

    # -- events and terminal transitions -------------------------------------------------------------------
    def event(self, etype: str, reason: str, message: str) -> None:
        self.plan.actions.append(Event(etype, reason, message))

    def fail(self, reason: str, message: str) -> None:
        self.book.set_condition(ConditionType.FAILED, True, reason, message)
        self.book.finish()
        self.event("Warning", reason, message)

    def succeed(self, message: str, reason: str = R_SUCCEEDED) -> None:
        self.book.set_condition(ConditionType.SUCCEEDED, True, reason, message)
        self.book.finish()
        self.event("Normal", reason, message)

    # -- helpers ------------------------------------------------------------------------------------------------
    def desired_counts(self) -> dict[ReplicaType, int]:
        counts = {rt: 0 for rt in models.REPLICA_TYPES}
        if self.spec is None:
            return counts
        for rt in models.REPLICA_TYPES:
            rs = self.spec.replicaSpecs.get(rt)
            counts[rt] = rs.replicas if rs is not None else 0
        return counts

    def delete_pod(self, pod: ObservedPod, reason: str) -> None:
        self.plan.actions.append(DeletePod(pod.name, pod.uid, reason))

    def requeue(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        if self.plan.requeue_after is None or seconds < self.plan.requeue_after:
            self.plan.requeue_after = seconds

    def retries(self, policy: ReplicaRestartPolicy, pod: ObservedPod) -> bool:
        """Whether a replica's restart policy recreates this finished pod."""
        if pod.phase == "Succeeded":
            return policy is ReplicaRestartPolicy.ALWAYS
        if policy is ReplicaRestartPolicy.NEVER:
            return False
        if policy is ReplicaRestartPolicy.EXIT_CODE:
            return self.valid_spec.runPolicy.retryable(pod.exit_code)
        return True

    def backoff_used(self) -> int:
        # Pods already retired have their in-place restarts folded into backoffCount.
        live = sum(
            p.restart_count
            for p in self.pods
            if p.replica_type in (ReplicaType.CHIEF, ReplicaType.PS) and not self.book.handled(p)
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

    def raw_run_policy(self) -> dict[str, Any]:
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
        if not self.book.terminal:
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
        if not self.book.terminal:
            self.check_templates()
        if not self.book.terminal:
            self.reconcile()
            if self.queueing is not None and not self.book.terminal:
                desired = self.desired_counts()
                ready = self.queueing.pods_ready(all(
                    (pod := self.by_key.get((rt, i))) is not None and pod.ready and not pod.terminating
                    for rt in models.REPLICA_TYPES for i in range(desired[rt])))
                if ready is not None:
                    self.plan.actions.append(ready)
        if self.book.terminal:
            self.finish_workload()
            self.cleanup()
            self.ttl()
            self.plan.terminal = True
        self.plan_pod_group()
        self.summarise()
        return self.plan

    def queued(self) -> bool:
        """Whether Kueue decides when this job runs (the operator's setting and the job's queue label)."""
        return self.config.kueue and kueue.queue_name(self.job) is not None

    def finish_workload(self) -> None:
        """Tell Kueue a queued job has ended (its Workload's Finished condition), once."""
        if not self.queued():
            return
        succeeded = self.book.is_true(ConditionType.SUCCEEDED)
        cond = self.book.condition(ConditionType.SUCCEEDED if succeeded else ConditionType.FAILED)
        action = kueue.finish(self.queue_view, succeeded, (cond.message if cond else None) or "", self.book.now_text)
        if action is not None:
            self.plan.actions.append(action)

    def plan_pod_group(self) -> None:
        """The gang's PodGroup (:mod:`.gang`): made with the pods of a running job, deleted once it stops."""
        stopped = None
        if self.book.terminal:
            stopped = "job finished"
        elif self.spec is not None and self.spec.runPolicy.suspend:
            stopped = "suspended"
        elif self.queueing is not None and self.queueing.hold is not None:
            # Kueue first, the gang after admission: no PodGroup holds nodes for a job that is queued or evicted.
            stopped = f"waiting for Kueue ({self.queueing.hold[0]})"
        self.plan.actions.extend(gang.pod_group_actions(
            self.job, self.spec, self.config, self.pod_group is not None, stopped=stopped,
            creating_pods=bool(self.plan.of(CreatePod))))

    def check_templates(self) -> None:
        """Fail the job when a template cannot be made into a pod (the CRD preserves unknown fields, so e.g.
        ``metadata.labels: "a=b"`` or ``env: "X=1"`` reach the planner) instead of raising on every reconcile."""
        spec = self.spec
        assert spec is not None  # checked after the spec parsed
        for rt in models.REPLICA_TYPES:
            if spec.replicaSpecs.get(rt) is None:
                continue
            try:
                pod_body(self.job, spec, rt, 0, self.status.chiefEpoch, self.config)
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
        if self.book.set_condition(ConditionType.CREATED, True, R_CREATED,
                              f"PSTrainingJob {self.meta.get('namespace')}/{self.name} is created."):
            self.event("Normal", R_CREATED, f"PSTrainingJob {self.name} is created")
        desired = self.desired_counts()
        workers = desired[ReplicaType.WORKER]
        if self.secret is None:
            self.plan.actions.append(CreateSecret(secret_name(self.name), secret_body(self.job),
                                                  tuple(tls_hosts(self.job, spec, self.config, workers)), workers))
        elif tls_enabled(spec) and workers > _covered_workers(self.secret) and not run_policy.suspend:
            self.plan.actions.append(ReissueCertificate(secret_name(self.name),
                                                        tuple(tls_hosts(self.job, spec, self.config, workers)),
                                                        workers))
        if network_policy_mode(spec, self.config) is NetworkPolicyMode.SAME_JOB and not run_policy.suspend and (
                self.secret is None or ANNOTATION_NETWORK_POLICY not in (self.secret.get("metadata") or {}).get(
                    "annotations", {})):
            # not watched: asked for until the shell saw it made (a create that finds it there is a no-op)
            self.plan.actions.append(CreateNetworkPolicy(network_policy_name(self.name), network_policy_body(self.job)))

        # Kueue: a queued job runs only once its Workload is admitted.
        hold: tuple[str, str] | None = None
        if self.queued():
            def templates() -> dict[ReplicaType, dict[str, Any]]:
                return {rt: pod_body(self.job, spec, rt, 0, self.status.chiefEpoch, self.config)
                        for rt in models.REPLICA_TYPES if spec.replicaSpecs.get(rt) is not None}

            self.queueing = kueue.Queueing(self.job, spec, self.queue_view, templates, len(self.pods),
                                           self.book.now_text)
            self.plan.actions.extend(self.queueing.actions)
            hold = self.queueing.hold
        if run_policy.suspend:
            hold = (R_SUSPENDED, "The job is suspended.")

        # Suspend / resume.
        if hold is not None:
            reason, message = hold
            changed = self.book.set_condition(ConditionType.SUSPENDED, True, reason, message)
            if changed:
                self.event("Normal", reason, f"{message} Deleting the job's pods and Services." if self.pods
                           else message)
            for ctype in (ConditionType.RUNNING, ConditionType.RESTARTING):
                self.book.set_condition(ctype, False, reason, message)
            for pod in sorted(self.pods, key=lambda p: p.name):
                if pod.replica_type in (ReplicaType.CHIEF, ReplicaType.PS):
                    self.book.retire(pod)  # so that a pod still terminating at resume is not taken for a lost one
                if not pod.terminating:
                    self.delete_pod(pod, "suspended")
            for svc_name in sorted(self.services):
                self.plan.actions.append(DeleteService(svc_name, "suspended"))
            return
        if self.book.is_true(ConditionType.SUSPENDED):
            resumed = "The job is resumed." if self.queueing is None else "Kueue admitted the job's Workload."
            self.book.set_condition(ConditionType.SUSPENDED, False, R_RESUMED, resumed)
            self.status.startTime = self.book.now_text
            self.event("Normal", R_RESUMED, f"{resumed} Creating its pods and Services.")
        if self.status.startTime is None:
            self.status.startTime = self.book.now_text

        # Chief success ends the job, whatever else happened in the meantime; a chief that finished before the
        # deadline succeeded even when the operator only sees it after the deadline (restart, lag).
        chief = self.by_key.get((ReplicaType.CHIEF, 0))
        succeeded = chief is not None and not chief.terminating and chief.phase == "Succeeded"
        deadline = None
        if run_policy.activeDeadlineSeconds is not None:
            started = parse_time(self.status.startTime) or self.now
            deadline = started + timedelta(seconds=run_policy.activeDeadlineSeconds)
        if succeeded and chief is not None and (deadline is None or self.now < deadline or chief.finished_at is None
                                                or chief.finished_at <= deadline):
            if spec.successPolicy is SuccessPolicy.CHIEF_ONLY:
                self.succeed(f"The chief ({chief.name}) exited with code 0.")
                return
            workers = desired[ReplicaType.WORKER]
            if all(self.exited_0(ReplicaType.WORKER, i) for i in range(workers)):
                self.succeed(f"The chief and all {workers} worker(s) exited with code 0 (successPolicy AllWorkers).",
                             R_ALL_WORKERS_SUCCEEDED)
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

    def exited_0(self, rt: ReplicaType, index: int) -> bool:
        pod = self.by_key.get((rt, index))
        return pod is not None and not pod.terminating and pod.phase == "Succeeded"

    def create_pod(self, rt: ReplicaType, index: int) -> None:
        body = pod_body(self.job, self.valid_spec, rt, index, self.status.chiefEpoch, self.config)
        if self.queueing is not None and rt.task_type in self.queueing.infos:
            self.queueing.infos[rt.task_type].apply(body)
        gang.join(body, self.valid_spec, rt, self.config)
        self.plan.actions.append(CreatePod(body["metadata"]["name"], body, rt.value, index))

    def restart_allowed(self, what: str) -> bool:
        """Whether backoffLimit leaves room for one more chief/PS restart; fails the job when not."""
        limit = self.valid_spec.runPolicy.backoffLimit
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
                if self.book.handled(pod):
                    continue  # our own delete (restart, suspend): recreated once gone
                # Deleted by someone else (kubectl delete, a drain, the node lifecycle controller): the PS's
                # variables are lost as surely as after a failure, so the chief must restart too. Recreated once
                # gone, like an evicted pod (no exit code), whatever the policy; counted against backoffLimit.
                what = f"ps {index} (pod {pod.name}) was deleted"
                retry, delete = True, False
            else:
                if not pod.finished:
                    continue
                if pod.phase == "Succeeded" and policy is not ReplicaRestartPolicy.ALWAYS:
                    continue  # a PS that chose to exit; the chief decides the job's fate
                if self.book.handled(pod):
                    self.delete_pod(pod, "restart")
                    continue
                what = _ended(pod, f"ps {index}")
                retry, delete = self.retries(policy, pod), True
            if not retry:
                self.fail(R_PS_FAILED, f"{what}; restartPolicy {policy.value} does not retry it.")
                return True
            if not self.restart_allowed(what):
                return True
            self.book.retire(pod)
            self.status.backoffCount += 1
            self.status.chiefEpoch += 1
            ps_status = self.book.replica_status(ReplicaType.PS)
            ps_status.restarts += 1
            if pod.phase == "Failed" or not delete:
                ps_status.failed += 1
            message = f"{what}; restarting it and the chief, which restores the latest checkpoint."
            self.book.set_condition(ConditionType.RESTARTING, True, R_PS_FAILED, message)
            self.book.set_condition(ConditionType.RUNNING, False, R_PS_FAILED, message)
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
        self.book.set_condition(ConditionType.RESTARTING, True, R_SECRET_LOST, message)
        self.book.set_condition(ConditionType.RUNNING, False, R_SECRET_LOST, message)
        self.event("Warning", R_SECRET_LOST, message)
        for pod in sorted(present, key=lambda p: p.name):
            if pod.replica_type in (ReplicaType.CHIEF, ReplicaType.PS) and self.book.retire(pod):
                self.book.replica_status(pod.replica_type).restarts += 1
            else:
                self.book.mark_handled(pod)
            self.delete_pod(pod, "token Secret lost")
        return True

    def restart_chief_for_epoch(self, pod: ObservedPod) -> None:
        """Delete a chief pod of an older epoch (a PS restarted); counted as one chief restart, once per pod."""
        if self.book.retire(pod):
            self.book.replica_status(ReplicaType.CHIEF).restarts += 1
            self.event("Normal", "ChiefRestarting", f"Restarting the chief ({pod.name}) after a parameter server "
                                                    f"restart")
        self.delete_pod(pod, "restart after a parameter server restart")

    def reconcile_chief(self, spec: PSTrainingJobSpec) -> bool:
        policy = spec.replicaSpecs.Chief.restartPolicy
        pod = self.by_key.get((ReplicaType.CHIEF, 0))
        if pod is None:
            self.create_pod(ReplicaType.CHIEF, 0)
            return False
        if spec.successPolicy is SuccessPolicy.ALL_WORKERS and self.exited_0(ReplicaType.CHIEF, 0):
            return False  # done: the job succeeds once every worker has exited 0 too
        if pod.terminating:
            if self.book.handled(pod):
                return False  # our own delete: recreated once gone
            if pod.epoch < self.status.chiefEpoch:
                # Restarted for a PS restart (by an operator that did not mark it handled yet).
                if self.book.retire(pod):
                    self.book.replica_status(ReplicaType.CHIEF).restarts += 1
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
        if self.book.handled(pod):
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
        self.book.retire(pod)
        self.status.backoffCount += 1
        chief_status = self.book.replica_status(ReplicaType.CHIEF)
        chief_status.restarts += 1
        chief_status.failed += 1
        message = f"{what}; restarting it."
        self.book.set_condition(ConditionType.RESTARTING, True, R_CHIEF_FAILED, message)
        self.book.set_condition(ConditionType.RUNNING, False, R_CHIEF_FAILED, message)
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
            if not self.book.handled(pod):
                self.book.mark_handled(pod)
                status = self.book.replica_status(rt)
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
        if rt is ReplicaType.WORKER and done_for_good and spec.successPolicy is SuccessPolicy.ALL_WORKERS:
            self.fail(R_WORKER_FAILED, f"{done_for_good} worker(s) failed and their restartPolicy {policy.value} "
                                       f"does not recreate them; successPolicy AllWorkers needs every worker to exit 0.")
            return True
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
            and chief is not None and chief.epoch >= self.status.chiefEpoch
            and all(running(ReplicaType.PS, i) for i in range(desired[ReplicaType.PS]))
        )
        if not core:
            return
        if self.book.is_true(ConditionType.RESTARTING):
            self.book.set_condition(ConditionType.RESTARTING, False, R_RUNNING,
                                    "The chief and parameter servers run again.")
            self.book.set_condition(ConditionType.RUNNING, True, R_RUNNING, "The job is running again.")
            self.event("Normal", R_RUNNING, "The chief and all parameter servers run again")
            return
        if self.book.is_true(ConditionType.RUNNING):
            return
        workers = []
        worker_policy = self.valid_spec.replicaSpecs.Worker.restartPolicy
        for index in range(desired[ReplicaType.WORKER]):
            pod = self.by_key.get((ReplicaType.WORKER, index))
            if pod is not None and pod.finished and not self.retries(worker_policy, pod):
                continue  # done for good
            workers.append(running(ReplicaType.WORKER, index))
        if workers and all(workers):
            self.book.set_condition(ConditionType.RUNNING, True, R_RUNNING,
                                    "The chief, parameter servers and workers run.")
            self.event("Normal", R_RUNNING, "All replicas are running")

    def report_stuck_pods(self) -> None:
        """Pods whose containers cannot start (STUCK_REASONS) are named in a ``Running: False`` condition, with a
        Warning Event when that begins: a TFJob in the same state just stays Created. Only while the job has not
        run yet (or this condition is the one that says why); it goes away when the pods start."""
        cond = self.book.condition(ConditionType.RUNNING)
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
                lastTransitionTime=self.book.now_text, lastUpdateTime=self.book.now_text))
            self.event("Warning", R_PODS_WAITING, message)
        elif cond.message != message:
            cond.message, cond.lastUpdateTime = message, self.book.now_text

    def summarise(self) -> None:
        desired = self.desired_counts()
        live_pods = [p for p in self.pods if not p.terminating]
        deleted = {a.name for a in self.plan.actions if isinstance(a, DeletePod)}
        for rt in models.REPLICA_TYPES:
            mine = [p for p in live_pods if p.replica_type is rt and p.name not in deleted]
            if not mine and desired[rt] == 0 and rt.value not in self.status.replicaStatuses:
                continue
            rs = self.book.replica_status(rt)
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
        self.status.state = self.book.state()
        observed_uids = {p.uid for p in self.pods}
        self.book.forget_unobserved(observed_uids)
        self.plan.status = self.book.to_json()
        if not self.book.terminal and self.spec is not None and not self.spec.runPolicy.suspend:
            have_pods = all(
                (rt, i) in self.by_key for rt in models.REPLICA_TYPES for i in range(desired[rt])
            )
            have_svcs = all(
                child_name(self.name, rt, i) in self.services for rt in models.REPLICA_TYPES for i in range(desired[rt])
            )
            self.plan.all_children_present = have_pods and have_svcs and self.secret is not None



def _name(obj: Mapping[str, Any]) -> str:
    name: str = (obj.get("metadata") or {}).get("name", "")
    return name


def _ended(pod: ObservedPod, what: str) -> str:
    if pod.phase == "Succeeded":
        return f"{what} (pod {pod.name}) exited with code 0"
    if pod.exit_code is not None:
        return f"{what} (pod {pod.name}) failed with exit code {pod.exit_code}"
    return f"{what} (pod {pod.name}) failed ({pod.reason or 'no exit code'})"



def plan(
    job: Mapping[str, Any],
    pods: Iterable[Mapping[str, Any]],
    services: Iterable[Mapping[str, Any]],
    secret: Mapping[str, Any] | None,
    now: datetime,
    config: PlanConfig = PlanConfig(),
    *,
    pod_group: Mapping[str, Any] | None = None,
    queue: kueue.QueueView | None = None,
) -> Plan:
    """Decide what to do for one job from what is observed (``pod_group``: the job's own PodGroup, if the shell saw
    one; ``queue``: a queued job's Workload and what it names); see the module docstring for the rules."""
    return _Planner(job, list(pods), list(services), secret, now, config, pod_group, queue).run()


def fail_status(job: Mapping[str, Any], reason: str, message: str, now: datetime) -> dict[str, Any]:
    """The job's status once failed for a reason found while applying a plan (e.g. the API server refused a pod
    built from the template)."""
    planner = _Planner(job, [], [], None, now, PlanConfig())
    if not planner.book.terminal:
        planner.fail(reason, message)
    planner.status.state = planner.book.state()
    return planner.book.to_json()
