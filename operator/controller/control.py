"""The actuator: carries out a plan's actions against the API server (Kubeflow's PodControl and ServiceControl,
plus the job's token Secret and the job itself).

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

import asyncio
import base64
import copy
import json
import logging
import secrets
from typing import Awaitable, Callable, TypeVar

from kubeps.runtime import certs

from kubeps.operator.core import kueue
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
    PatchWorkload,
    Plan,
    ReissueCertificate,
)
from kubeps.operator.core import disruption
from kubeps.operator.core.actions import ForceDeletePod
from kubeps.operator.core.children import (ANNOTATION_TLS_PS, ANNOTATION_TLS_WORKERS, LABEL_ROLE, TOKEN_KEY, membership_name,
                                           membership_of, secret_name)
from kubeps.runtime.cluster import Membership
from kubeps.operator.core.observed import controlled_by
from kubeps.operator.kube.client import ApiError, KubeClient

from .cache import Body, Cache, Key
from .recorder import Recorder

log = logging.getLogger("kubeps.operator")
T = TypeVar("T")

#: Seconds before a create the API server refused for a reason that may pass (or a foreign Secret) is retried.
RETRY_CREATE_AFTER = 5.0
RETRY_SECRET_AFTER = 2.0
#: The share of the API client's connections one job's creates and deletes may hold at once.
JOB_SHARE = 0.5


async def bounded(calls: list[Awaitable[T]], limit: int) -> list[T | BaseException]:
    """``asyncio.gather(*calls, return_exceptions=True)`` with at most ``limit`` of them running at once."""
    slots = asyncio.Semaphore(max(1, limit))

    async def one(call: Awaitable[T]) -> T:
        async with slots:
            return await call

    return await asyncio.gather(*(one(c) for c in calls), return_exceptions=True)


class Control:
    """Creates and deletes a job's children and the job, through ``kube``; ``retry(key, delay)`` reconciles the
    job again later, ``fail(key, reason, message)`` fails it (the reconciler's)."""

    def __init__(self, kube: KubeClient, cache: Cache, recorder: Recorder, retry: Callable[[Key, float], None],
                 fail: Callable[[Key, str, str], Awaitable[None]]):
        self.kube, self.cache, self.recorder = kube, cache, recorder
        self.retry, self.fail = retry, fail
        #: at most this many of one job's creates and deletes run at once (JOB_SHARE)
        self.per_job = max(1, int(kube.pool_size * JOB_SHARE))

    async def apply(self, key: Key, job: Body, plan: Plan) -> None:
        """Carry out the plan's actions (its status is already written)."""
        for event in plan.of(Event):
            self.recorder.event(job, event.type, event.reason, event.message)
        secret_ready = True
        for secret in plan.of(CreateSecret):
            secret_ready = await self.create_secret(key, job, secret)
        for reissue in plan.of(ReissueCertificate):
            secret_ready = await self.reissue_certificate(key, job, reissue) and secret_ready
        for policy in plan.of(CreateNetworkPolicy):
            await self.create_network_policy(key, job, policy)
        written = True
        for membership in plan.of(ApplyMembership):
            written = await self.apply_membership(key, job, membership) and written
        for annotate in plan.of(AnnotatePod):
            if written:  # the pod's kubelet refreshes the ConfigMap on it: not before it holds the generation
                await self.annotate_pod(key, annotate)
        group_ready = True
        for group in plan.of(CreatePodGroup):
            group_ready = await self.create_pod_group(key, job, group)
        for action in plan.actions:
            if isinstance(action, (CreateWorkload, PatchWorkload, ApplyWorkloadStatus, DeleteWorkload)):
                await self.workload(key, job, action)
        # Without the job's own Secret no pod is made: one started with another owner's token would disagree with
        # the pods started after it. Nor without its PodGroup, when the plan made one.
        creates = [self.create_child(key, job, a) for a in plan.actions
                   if isinstance(a, CreateService) or (secret_ready and group_ready and isinstance(a, CreatePod))]
        deletes = [self.delete_child(key, job, a) for a in plan.actions if isinstance(a, (DeletePod, DeleteService))]
        deletes += [self.delete_pod_group(key, job, a) for a in plan.of(DeletePodGroup)]
        results = await bounded([*creates, *deletes], self.per_job)
        self.recorder.summaries(job, [r for r in results if isinstance(r, tuple)])
        for result in results:
            if isinstance(result, BaseException):
                raise result
        for delete_job in plan.of(DeleteJob):
            await self.delete_job(key, job, delete_job)

    async def read_own_secret(self, key: Key, uid: str | None) -> Body | None:
        """The job's token Secret if it exists and belongs to this job (remembered), else None (forgotten)."""
        secret = await self.kube.read_secret(key[0], secret_name(key[1]))
        if secret is not None and controlled_by(secret, uid):
            self._remember_secret(key, uid, secret)
            return secret
        # None, or a leftover of an older job of the same name that garbage collection removes
        self.cache.secrets.pop(key, None)
        self.cache.secret_annotations.pop(key, None)
        return None

    def _remember_secret(self, key: Key, uid: str | None, secret: Body) -> None:
        self.cache.secrets[key] = uid
        annotations = (secret.get("metadata") or {}).get("annotations") or {}
        self.cache.secret_annotations[key] = {k: v for k, v in annotations.items()
                                              if k in (ANNOTATION_TLS_WORKERS, ANNOTATION_TLS_PS)}

    async def create_secret(self, key: Key, job: Body, action: CreateSecret) -> bool:
        """Create the job's Secret; returns whether the job's own Secret exists now."""
        uid = job["metadata"]["uid"]
        body = copy.deepcopy(action.body)
        token = secrets.token_urlsafe(32)
        made = certs.issue_job_credentials(key[1], action.tls_hosts or [f"{key[1]}.{key[0]}.svc"])
        body["data"] = {TOKEN_KEY: _b64(token.encode()), **{k: _b64(v) for k, v in made.files().items()}}
        body["metadata"].setdefault("annotations", {}).update(
            {ANNOTATION_TLS_WORKERS: str(action.tls_workers), ANNOTATION_TLS_PS: str(action.tls_ps)})
        try:
            await self.kube.create_secret(key[0], body)
        except ApiError as err:
            if err.status != 409:
                self.recorder.api_error("create-secret", err.status)
                raise
            existing = await self.kube.read_secret(key[0], action.name)
            if existing is None or not controlled_by(existing, uid):
                # Someone else's, e.g. the Secret of a deleted job of the same name that the garbage collector has
                # not removed yet: not ours to use. Retry until it is gone (Secrets are not watched).
                log.info("Secret %s/%s exists but is not controlled by job %s; retrying", key[0], action.name, uid)
                self.recorder.event(job, "Warning", "SecretConflict",
                                    f"Secret {action.name} exists but belongs to another owner; waiting for it to "
                                    f"be removed before creating pods")
                self.retry(key, RETRY_SECRET_AFTER)
                return False
            self._remember_secret(key, uid, existing)
        else:
            self.recorder.event(job, "Normal", "SecretCreated", f"Created Secret {action.name}")
            self._remember_secret(key, uid, body)
        return True

    async def reissue_certificate(self, key: Key, job: Body, action: ReissueCertificate) -> bool:
        """Issue the job's task certificate again, from its CA, for the names the added Workers are dialed by;
        returns whether the Secret now covers them (else the reconcile is retried and no pod is made)."""
        uid = job["metadata"]["uid"]
        secret = await self.kube.read_secret(key[0], action.name)
        if secret is None or not controlled_by(secret, uid):
            self.cache.secrets.pop(key, None)  # lost: the next reconcile restarts the job with a new Secret
            self.retry(key, RETRY_SECRET_AFTER)
            return False
        data = secret.get("data") or {}
        try:
            ca_cert, ca_key = (base64.b64decode(data[k]) for k in (certs.CA_CERT_KEY, certs.CA_KEY_KEY))
            cert, tls_key = certs.issue_task_certificate(ca_cert, ca_key, action.tls_hosts, f"kubeps job {key[1]}")
        except (KeyError, ValueError) as err:
            message = (f"Secret {action.name} holds no usable job CA ({type(err).__name__}: {err}); delete the "
                       f"Secret to restart the job with a new one")
            self.recorder.event(job, "Warning", "CertificateNotIssued", message)
            self.retry(key, RETRY_CREATE_AFTER)
            return False
        patch = {"metadata": {"resourceVersion": secret["metadata"]["resourceVersion"],
                              "annotations": {ANNOTATION_TLS_WORKERS: str(action.tls_workers),
                                              ANNOTATION_TLS_PS: str(action.tls_ps)}},
                 "data": {certs.TLS_CERT_KEY: _b64(cert), certs.TLS_KEY_KEY: _b64(tls_key)}}
        try:
            written = await self.kube.patch_secret(key[0], action.name, patch)
        except ApiError as err:
            if err.status not in (404, 409):
                self.recorder.api_error("patch-secret", err.status)
                raise
            self.retry(key, RETRY_SECRET_AFTER)  # changed or deleted meanwhile: plan again
            return False
        self._remember_secret(key, uid, written)
        self.recorder.event(job, "Normal", "CertificateIssued",
                            f"Issued the task certificate in Secret {action.name} again for {action.tls_workers} "
                            f"workers and {action.tls_ps} ps")
        return True

    async def create_network_policy(self, key: Key, job: Body, action: CreateNetworkPolicy) -> None:
        try:
            await self.kube.create_network_policy(key[0], action.body)
        except ApiError as err:
            if err.status == 409:
                self.cache.network_policies.add(key)
                return  # already there
            self.recorder.api_error("create-networkpolicy", err.status)
            self.recorder.event(job, "Warning", "NetworkPolicyCreateFailed",
                                f"Could not create NetworkPolicy {action.name}: {_api_message(err)}; the job's pods "
                                f"are not isolated")
            if err.status in (403, 429, 500, 503):
                self.retry(key, RETRY_CREATE_AFTER)
            return
        self.cache.network_policies.add(key)
        self.recorder.event(job, "Normal", "NetworkPolicyCreated", f"Created NetworkPolicy {action.name}")

    async def read_membership(self, key: Key, uid: str | None) -> Membership | None:
        """The document of the job's membership ConfigMap (None: none, or another job's), read once, then
        remembered, absent too (a queued job is not read again at each reconcile): the operator is its only
        writer."""
        known = self.cache.memberships.get(key)
        if known is not None and known[0] == uid:
            return known[1]
        try:
            body = await self.kube.read_config_map(key[0], membership_name(key[1]))
        except ApiError as err:
            # not known (e.g. an install whose RBAC predates configmaps): planned as absent, so the write is tried
            # and its failure said in an Event, and the job's other children go on
            self.recorder.api_error("read-configmap", err.status)
            log.warning("could not read ConfigMap %s/%s: %s", key[0], membership_name(key[1]), err)
            return None
        document = membership_of(body) if body is not None and controlled_by(body, uid) else None
        self.cache.memberships[key] = (uid, document)
        return document

    async def apply_membership(self, key: Key, job: Body, action: ApplyMembership) -> bool:
        """Write the membership ConfigMap (created, or its document replaced); the chief sees it when the kubelet
        refreshes the mounted file."""
        try:
            await self.kube.write_config_map(key[0], action.body)
        except ApiError as err:
            self.recorder.api_error("apply-configmap", err.status)
            self.cache.memberships.pop(key, None)
            self.recorder.event(job, "Warning", "MembershipWriteFailed",
                                f"Could not write ConfigMap {action.name}: {_api_message(err)}; the chief keeps "
                                f"dispatching to the workers it knows")
            self.retry(key, RETRY_CREATE_AFTER)
            return False
        document = membership_of(action.body)
        if document is not None:
            self.cache.memberships[key] = (job["metadata"].get("uid"), document)
        return True

    async def annotate_pod(self, key: Key, action: AnnotatePod) -> None:
        """Annotate a pod (its UID a precondition); one that is gone or changed is left to the next reconcile."""
        body = {"metadata": {"uid": action.uid, "annotations": action.annotations}}
        try:
            await self.kube.patch_pod(key[0], action.name, body)
        except ApiError as err:
            self.recorder.api_error("patch-pod", err.status)
            if err.status not in (404, 409, 422):
                self.retry(key, RETRY_CREATE_AFTER)

    async def read_own_pod_group(self, key: Key, uid: str | None, api_version: str) -> Body | None:
        """The job's PodGroup if it exists and belongs to this job, else None; read once, then remembered (PodGroups
        are not watched: the operator makes and deletes them itself)."""
        known = self.cache.pod_groups.get(key)
        if known is not None and known[0] == uid:
            return {"metadata": {"name": key[1]}} if known[1] else None
        group = await self.kube.read_pod_group(api_version, key[0], key[1])
        if group is not None and (group.get("metadata") or {}).get("deletionTimestamp"):
            # Being deleted (Kubernetes keeps a native PodGroup until no running pod uses it): no pod may join it,
            # and a new one can be made only once it is gone. Read again next time.
            self.cache.pod_groups.pop(key, None)
            return None
        mine = group is not None and controlled_by(group, uid)
        self.cache.pod_groups[key] = (uid, mine)
        return group if mine else None

    async def create_pod_group(self, key: Key, job: Body, action: CreatePodGroup) -> bool:
        """Create the job's PodGroup; returns whether the job's own PodGroup exists now (else no pod is made)."""
        uid = job["metadata"]["uid"]
        api_version = action.body["apiVersion"]
        try:
            await self.kube.create_pod_group(key[0], action.body)
        except ApiError as err:
            if err.status == 409:
                self.cache.pod_groups.pop(key, None)
                if await self.read_own_pod_group(key, uid, api_version) is not None:
                    return True
                if key in self.cache.pod_groups:  # not being deleted: someone else's
                    self.recorder.event(job, "Warning", "PodGroupConflict",
                                        f"PodGroup {action.name} exists but belongs to another owner; waiting for "
                                        f"it to be removed before creating pods")
                else:  # e.g. the job's previous one, kept by Kubernetes until its last pod has stopped
                    self.recorder.event(job, "Normal", "PodGroupTerminating",
                                        f"PodGroup {action.name} is being deleted; waiting for it to be gone before "
                                        f"creating pods")
                self.retry(key, RETRY_SECRET_AFTER)
                return False
            self.recorder.api_error("create-podgroup", err.status)
            message = f"Could not create {api_version} PodGroup {action.name}: {_api_message(err)}"
            if err.status in (400, 422):
                await self.fail(key, "InvalidPodGroup", f"The API server rejected the {api_version} PodGroup "
                                                        f"{action.name}: {_api_message(err)}")
                return False
            if err.status == 404:
                message += (" (is the gang scheduler's PodGroup CRD installed? The operator's --gang-scheduler "
                            "names its backend)")
            self.recorder.event(job, "Warning", "PodGroupCreateFailed", message + "; retrying")
            self.retry(key, RETRY_CREATE_AFTER)
            return False
        self.cache.pod_groups[key] = (uid, True)
        self.recorder.pod_group_created()
        self.recorder.event(job, "Normal", "PodGroupCreated", f"Created {api_version} PodGroup {action.name}")
        return True

    async def delete_pod_group(self, key: Key, job: Body, action: DeletePodGroup) -> tuple[str, str] | None:
        try:
            await self.kube.delete_pod_group(action.api_version, key[0], action.name)
        except ApiError as err:
            if err.status != 404:
                self.recorder.api_error("delete-podgroup", err.status)
                raise
            self.cache.pod_groups[key] = (job["metadata"].get("uid"), False)
            return None
        self.cache.pod_groups[key] = (job["metadata"].get("uid"), False)
        self.recorder.pod_group_deleted()
        return "PodGroupDeleted", f"{action.name} ({action.reason})"

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
                message = f"The API server rejected {kind} {action.name} built from the template: {_api_message(err)}"
                await self.fail(key, "InvalidPodTemplate" if is_pod else "InvalidService", message)
                return None
            if err.status in (403, 404, 429, 500, 503):
                self.recorder.event(job, "Warning", f"{kind}CreateFailed",
                                    f"Could not create {kind} {action.name}: {_api_message(err)}; retrying")
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

    async def workload(self, key: Key, job: Body,
                       action: CreateWorkload | PatchWorkload | ApplyWorkloadStatus | DeleteWorkload) -> None:
        """Create, patch, apply the status of, or delete the job's Kueue Workload. A create that finds it there
        and a delete that finds it gone are no-ops; a conflict or a refusal that may pass is retried (Warning);
        a Workload Kueue's webhooks refuse (400, 422) fails the job, as a refused pod does."""
        what = type(action).__name__
        try:
            if isinstance(action, CreateWorkload):
                await self.kube.create_workload(key[0], action.body)
            elif isinstance(action, PatchWorkload):
                await self.kube.patch_workload(key[0], action.name, action.patch)
            elif isinstance(action, ApplyWorkloadStatus):
                await self.kube.apply_workload_status(key[0], action.name, action.status, kueue.FIELD_MANAGER)
            else:
                await self.kube.delete_workload(key[0], action.name, action.uid)
        except ApiError as err:
            if (err.status == 409 and isinstance(action, CreateWorkload)) or (
                    err.status in (404, 409) and isinstance(action, DeleteWorkload)):
                return
            self.recorder.api_error(what.lower(), err.status)
            if err.status in (400, 422) and isinstance(action, CreateWorkload):
                await self.fail(key, "InvalidWorkload", f"Kueue refused Workload {action.name}: {_api_message(err)}")
                return
            if err.status in (400, 403, 404, 409, 422, 429, 500, 503):
                self.recorder.event(job, "Warning", "WorkloadUpdateFailed",
                                    f"{what} {action.name}: {_api_message(err)}; retrying")
                self.retry(key, RETRY_SECRET_AFTER)
                return
            raise
        if isinstance(action, CreateWorkload):
            self.recorder.event(job, "Normal", "WorkloadCreated",
                                f"Created Kueue Workload {action.name} in LocalQueue {action.body['spec']['queueName']}")
        elif isinstance(action, DeleteWorkload):
            self.recorder.event(job, "Normal", "WorkloadDeleted", f"Deleted Workload {action.name}: {action.reason}")

    async def sync_disruption_budget(self, key: Key, job: Body, wanted: bool | None) -> None:
        """Create the job's PodDisruptionBudget while it is wanted (True), delete it once the job finished (False)
        or no longer asks for one (None, after this operator made it); once known either way, nothing more is
        asked of the API server (budgets are not watched; a restarted operator checks once more)."""
        known = self.cache.disruption_budgets.get(key)
        if wanted is None:
            if known is not True:
                return  # never asked for, as far as this operator knows: no API call
            wanted = False
        if known is wanted:
            return
        name = disruption.pdb_name(key[1])
        try:
            if wanted:
                await self.kube.create_pod_disruption_budget(key[0], disruption.pdb_body(job))
            else:
                await self.kube.delete_pod_disruption_budget(key[0], name)
        except ApiError as err:
            if err.status not in (404, 409):
                self.recorder.api_error("create-pdb" if wanted else "delete-pdb", err.status)
                self.recorder.event(job, "Warning", "DisruptionBudgetFailed",
                                    f"Could not {'create' if wanted else 'delete'} PodDisruptionBudget {name}: "
                                    f"{_api_message(err)}; retrying")
                self.retry(key, RETRY_CREATE_AFTER)
                return
        else:
            self.recorder.event(job, "Normal", "DisruptionBudgetCreated" if wanted else "DisruptionBudgetDeleted",
                                f"{'Created' if wanted else 'Deleted'} PodDisruptionBudget {name} (chief and "
                                f"parameter servers)")
        self.cache.disruption_budgets[key] = wanted

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


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _api_message(err: ApiError) -> str:
    try:
        return str(json.loads(err.body)["message"])
    except Exception:  # noqa: BLE001 - any answer that is not a Status object: say what the error says
        return str(err)

