"""The actuator: carries out a plan's actions against the API server (Kubeflow's PodControl and ServiceControl,
plus the job itself), with its parts for the rest: :mod:`.credentials` (the token Secret, its certificate, the
NetworkPolicy), :mod:`.membership` (the membership ConfigMap) and :mod:`.scheduling` (the PodGroup, Kueue's
Workload, the PodDisruptionBudget).

* The Events the planner decided are posted first; then the Secret is created (with a fresh random token and a
  new CA and task certificate, :mod:`kubeps.runtime.certs`: the only randomness of the operator, kept out of the
  pure core), or its certificate re-issued for added Workers, the NetworkPolicy created, and the gang's PodGroup
  created; then the pod, Service and PodGroup creates and deletes run together, at most half the API client's
  connections of them at once (:data:`JOB_SHARE`); then the job is deleted if its TTL passed.
* That bound is what keeps jobs fair to each other: the client's connections and its token bucket serve requests
  in the order they come, so a job that asked for 2,100 creates (or a lost node's 1,000 force-deletes) at once
  would make every other job's few requests wait behind all of them (~20 s at 100/s). With each job holding at
  most half the connections, another job's request waits for a handful.
* Without the job's own Secret no pod is made: one started with another owner's token would disagree with the
  pods started after it. Without the job's own PodGroup (when the plan asks for one) no pod is made either: a gang
  scheduler would see members of a group it does not know.
* A repeated action is a no-op: a create answered 409 (already there), a delete answered 404 or 409 (gone, or
  replaced: pod deletes carry the UID as a precondition).
* What no retry can fix (the API server refuses a pod built from the template: 400, 422) fails the job; what a
  retry may fix (403, 404, 429, 500, 503) posts a Warning and tries again in 5 s.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

from kubeps.operator.core.actions import (
    AnnotatePod,
    ApplyMembership,
    ApplyWorkloadStatus,
    CreateNetworkPolicy,
    CreatePod,
    CreatePodGroup,
    CreateSecret,
    CreateService,
    CreateWorkload,
    DeleteJob,
    DeletePod,
    DeletePodGroup,
    DeleteService,
    DeleteWorkload,
    Event,
    ForceDeletePod,
    PatchWorkload,
    Plan,
    ReissueCertificate,
)
from kubeps.operator.core.children import LABEL_ROLE
from kubeps.operator.kube.client import ApiError, KubeClient

from .cache import Body, Cache, Key
from .credentials import SecretControl
from .membership import MembershipControl
from .recorder import Recorder
from .scheduling import SchedulingControl
from .writes import RETRY_CREATE_AFTER, ControlPart, api_message, bounded

log = logging.getLogger("kubeps.operator")

#: The share of the API client's connections one job's creates and deletes may hold at once.
JOB_SHARE = 0.5


class Control(ControlPart):
    """Creates and deletes a job's pods and Services and the job itself, through ``kube``, and carries out a
    plan with its parts, named as fields: ``secrets`` (the token Secret, its certificate, the NetworkPolicy),
    ``membership`` (the membership ConfigMap) and ``scheduling`` (the PodGroup, the Workload, the
    PodDisruptionBudget). ``retry(key, delay)`` reconciles the job again later, ``fail(key, reason, message)``
    fails it (the reconciler's)."""

    def __init__(self, kube: KubeClient, cache: Cache, recorder: Recorder, retry: Callable[[Key, float], None],
                 fail: Callable[[Key, str, str], Awaitable[None]]):
        super().__init__(kube, cache, recorder, retry, fail)
        self.secrets = SecretControl(kube, cache, recorder, retry, fail)
        self.membership = MembershipControl(kube, cache, recorder, retry, fail)
        self.scheduling = SchedulingControl(kube, cache, recorder, retry, fail)
        #: at most this many of one job's creates and deletes run at once (JOB_SHARE)
        self.per_job = max(1, int(kube.pool_size * JOB_SHARE))

    async def apply(self, key: Key, job: Body, plan: Plan) -> None:
        """Carry out the plan's actions (its status is already written)."""
        for event in plan.of(Event):
            self.recorder.event(job, event.type, event.reason, event.message)
        secret_ready = True
        for secret in plan.of(CreateSecret):
            secret_ready = await self.secrets.create_secret(key, job, secret)
        for reissue in plan.of(ReissueCertificate):
            secret_ready = await self.secrets.reissue_certificate(key, job, reissue) and secret_ready
        for policy in plan.of(CreateNetworkPolicy):
            await self.secrets.create_network_policy(key, job, policy)
        written = True
        for membership in plan.of(ApplyMembership):
            written = await self.membership.apply_membership(key, job, membership) and written
        for annotate in plan.of(AnnotatePod):
            if written:  # the pod's kubelet refreshes the ConfigMap on it: not before it holds the generation
                await self.membership.annotate_pod(key, annotate)
        group_ready = True
        for group in plan.of(CreatePodGroup):
            group_ready = await self.scheduling.create_pod_group(key, job, group)
        for action in plan.actions:
            if isinstance(action, (CreateWorkload, PatchWorkload, ApplyWorkloadStatus, DeleteWorkload)):
                await self.scheduling.workload(key, job, action)
        # Without the job's own Secret no pod is made: one started with another owner's token would disagree with
        # the pods started after it. Nor without its PodGroup, when the plan made one.
        creates = [self.create_child(key, job, a) for a in plan.actions
                   if isinstance(a, CreateService) or (secret_ready and group_ready and isinstance(a, CreatePod))]
        deletes = [self.delete_child(key, job, a) for a in plan.actions if isinstance(a, (DeletePod, DeleteService))]
        deletes += [self.scheduling.delete_pod_group(key, job, a) for a in plan.of(DeletePodGroup)]
        results = await bounded([*creates, *deletes], self.per_job)
        self.recorder.summaries(job, [r for r in results if isinstance(r, tuple)])
        for result in results:
            if isinstance(result, BaseException):
                raise result
        for delete_job in plan.of(DeleteJob):
            await self.delete_job(key, job, delete_job)

    async def create_child(self, key: Key, job: Body, action: CreatePod | CreateService) -> tuple[str, str] | None:
        """Create a pod or Service; returns ``(reason, name)`` for the reconcile's Event when it was made."""
        is_pod = isinstance(action, CreatePod)
        kind = "Pod" if is_pod else "Service"
        try:
            if is_pod:
                await self.kube.create_pod(key[0], action.body)
            else:
                await self.kube.create_service(key[0], action.body)
        except ApiError as err:
            if err.status == 409:
                return None  # already there: a repeated create is a no-op
            self.recorder.api_error(f"create-{kind.lower()}", err.status)
            if err.status in (400, 422):
                # The API server refused what the template makes: no retry can fix it.
                message = f"The API server rejected {kind} {action.name} built from the template: {api_message(err)}"
                await self.fail(key, "InvalidPodTemplate" if is_pod else "InvalidService", message)
                return None
            if err.status in (403, 404, 429, 500, 503):
                self.recorder.event(job, "Warning", f"{kind}CreateFailed",
                                    f"Could not create {kind} {action.name}: {api_message(err)}; retrying")
                self.retry(key, RETRY_CREATE_AFTER)
                return None
            raise
        if is_pod:
            self.recorder.pod_created(action.body["metadata"]["labels"][LABEL_ROLE])
        else:
            self.recorder.service_created()
        return f"{kind}Created", action.name

    async def delete_child(self, key: Key, job: Body, action: DeletePod | DeleteService) -> tuple[str, str] | None:
        """Delete a pod or Service; returns ``(reason, what)`` for the reconcile's Event when it was deleted."""
        kind = "Pod" if isinstance(action, DeletePod) else "Service"
        try:
            if isinstance(action, DeletePod):
                await self.kube.delete_pod(key[0], action.name, action.uid)
            else:
                await self.kube.delete_service(key[0], action.name)
        except ApiError as err:
            if err.status in (404, 409):
                return None  # already gone, or replaced (UID precondition)
            self.recorder.api_error(f"delete-{kind.lower()}", err.status)
            raise
        if isinstance(action, DeletePod):
            self.recorder.pod_deleted(action.reason)
        return f"{kind}Deleted", f"{action.name} ({action.reason})"

    async def force_delete_pods(self, key: Key, deletes: list[ForceDeletePod]) -> None:
        """Delete pods of lost nodes at once (grace period 0, the UID a precondition): their kubelets will never
        confirm a graceful delete, and the pods' names are needed for their replacements."""
        async def one(action: ForceDeletePod) -> None:
            try:
                await self.kube.delete_pod(key[0], action.name, action.uid, grace_seconds=0)
            except ApiError as err:
                if err.status in (404, 409):
                    return  # gone, or replaced
                self.recorder.api_error("delete-pod", err.status)
                raise
            if action.uid:
                self.cache.force_deleted.add(action.uid)
            self.recorder.pod_deleted("node lost")
            log.info("force-deleted pod %s/%s: %s", key[0], action.name, action.reason)

        results = await bounded([one(a) for a in deletes], self.per_job)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def delete_job(self, key: Key, job: Body, action: DeleteJob) -> None:
        try:
            await self.kube.delete_job(key[0], key[1], job["metadata"].get("uid"))
        except ApiError as err:
            if err.status not in (404, 409):
                raise
            return
        self.recorder.job_deleted()
        log.info("deleted %s/%s: %s", key[0], key[1], action.reason)
