"""The kopf shell: observe, call the planner, apply its actions. ``kopf run -m kubeps.operator.handlers`` works.

Level-based and finalizer-free:

* ``@kopf.on.event`` for PSTrainingJobs keeps the latest body of every job and triggers its reconcile; no
  create/update handlers, timers or daemons, so kopf adds no finalizer and a job deletes (with its children, by
  ownerReference garbage collection) even while the operator is down.
* ``@kopf.index`` handlers keep a slim copy of every labelled pod and Service in the reconciler (kopf runs them
  for every listed object before any other handler, so a restarted operator never plans from a half-known world)
  and trigger the owning job's reconcile when the copy changes; ``@kopf.on.event``, filtered to deletions,
  forgets them.
* One reconcile per job at a time (later triggers coalesce into one more pass); deadlines and TTLs are timers
  of the event loop, re-armed by every reconcile.
* The status is written (with the observed resourceVersion as precondition) before any action runs, so a
  restart counted once is never counted again, and a stale cache only costs a re-read.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import logging
import secrets
import time
from datetime import datetime, timezone
from typing import Any

import kopf

from . import client, metrics, models, planner
from .client import ApiError, KubeClient
from .settings import Settings, kopf_settings

log = logging.getLogger("kubeps.operator")

Key = tuple[str, str]  # (namespace, job name)
SUMMARY_NAMES = 12  # children named in one Event's message; the rest are counted


def _rv(obj: dict) -> int | None:
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion"))
    except (TypeError, ValueError):
        return None


def _api_message(err: Exception) -> str:
    body = getattr(err, "body", None)
    try:
        return json.loads(body)["message"]
    except Exception:  # noqa: BLE001
        return str(err)


class Reconciler:
    """The operator's state (kopf's ``memo.reconciler``): the latest job bodies, per-job reconcile tasks, timers."""

    def __init__(self, settings: Settings, kube: KubeClient | None = None):
        self.settings = settings
        self.kube = kube or KubeClient(qps=settings.api_qps, burst=settings.api_burst, pool_size=settings.workers)
        self.config = planner.PlanConfig(default_image=settings.default_image,
                                          cluster_domain=settings.cluster_domain)
        self.jobs: dict[Key, dict] = {}
        # The slim copies of every pod and Service, by job and UID: filled by kopf's index handlers, which kopf
        # runs for every listed object before any other handler (so a restarted operator never plans from a
        # half-known world), emptied by the deletion handler.
        self.pods: dict[Key, dict[str, dict]] = {}
        self.services: dict[Key, dict[str, dict]] = {}
        self.secrets: dict[Key, str] = {}  # job key -> uid of the job whose Secret is known to exist
        self.dirty: set[Key] = set()
        self.tasks: dict[Key, asyncio.Task] = {}
        self.timers: dict[Key, asyncio.TimerHandle] = {}
        self.children_seen: set[str] = set()
        self.limit = asyncio.Semaphore(settings.workers)
        self.reconciles = 0
        self.last_error: str | None = None

    # -- observing -----------------------------------------------------------------------------------------------
    def observe_job(self, event_type: str | None, body: dict) -> None:
        meta = body.get("metadata") or {}
        key = (meta.get("namespace"), meta.get("name"))
        if event_type == "DELETED":
            self.forget(key)
            return
        current = self.jobs.get(key)
        if current is not None and (current.get("metadata") or {}).get("uid") == meta.get("uid"):
            old, new = _rv(current), _rv(body)
            if old is not None and new is not None and new < old:
                return  # an event older than what our own write returned
        self.jobs[key] = body
        self.trigger(key)

    def observe_child(self, body: kopf.Body, namespace: str, labels: dict, is_pod: bool) -> None:
        """A pod or Service was listed or changed: keep its slim copy; reconcile its job if the planner would see
        something new (a pod has 3-4 events on its way to Running; the scheduler's binding changes nothing the
        planner reads)."""
        key = (namespace, labels[planner.LABEL_JOB])
        slim = _slim(body, with_status=is_pod)
        known = (self.pods if is_pod else self.services).setdefault(key, {})
        uid = slim["metadata"].get("uid")
        if known.get(uid) != slim:
            known[uid] = slim
            if key in self.jobs:
                self.trigger(key)

    def forget_child(self, namespace: str, labels: dict, uid: str, is_pod: bool) -> None:
        key = (namespace, labels[planner.LABEL_JOB])
        known = (self.pods if is_pod else self.services).get(key)
        if known is not None and known.pop(uid, None) is not None and not known:
            del (self.pods if is_pod else self.services)[key]
        if key in self.jobs:
            self.trigger(key)

    def forget(self, key: Key) -> None:
        self.jobs.pop(key, None)
        self.secrets.pop(key, None)
        timer = self.timers.pop(key, None)
        if timer is not None:
            timer.cancel()

    def trigger(self, key: Key) -> None:
        self.dirty.add(key)
        if key not in self.tasks:
            self.tasks[key] = asyncio.get_running_loop().create_task(self._worker(key))

    async def _worker(self, key: Key) -> None:
        try:
            while key in self.dirty:
                self.dirty.discard(key)
                async with self.limit:
                    try:
                        await self.reconcile(key)
                    except Exception as err:  # noqa: BLE001 - logged; retried by the next trigger or timer
                        self.last_error = f"{key[0]}/{key[1]}: {err}"
                        log.exception("reconcile of %s/%s failed; retrying in 5 s", *key)
                        self.schedule(key, 5.0)
        finally:
            self.tasks.pop(key, None)

    def schedule(self, key: Key, delay: float) -> None:
        old = self.timers.pop(key, None)
        if old is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        self.timers[key] = loop.call_later(delay, self._fire, key)

    def _fire(self, key: Key) -> None:
        self.timers.pop(key, None)
        if key in self.jobs:
            self.trigger(key)

    # -- one reconcile -------------------------------------------------------------------------------------------
    async def reconcile(self, key: Key) -> None:
        job = self.jobs.get(key)
        if job is None:
            return
        started = time.perf_counter()
        namespace, name = key
        uid = job["metadata"].get("uid")
        # Index values are private slim copies (see _slim) that the planner only reads.
        pods = list(self.pods.get(key, {}).values())
        services = list(self.services.get(key, {}).values())
        cached = self.secrets.get(key) == uid
        secret = {"metadata": {"name": planner.secret_name(name)}} if cached else await self.read_own_secret(key, uid)
        now = datetime.now(timezone.utc)
        plan = planner.plan(job, pods, services, secret, now, self.config)
        if cached and plan.of(planner.CreatePod) and await self.read_own_secret(key, uid) is None:
            # A new pod reads its token from the Secret, which someone may have deleted since it was made (Secrets
            # are not watched: that would need rights to read every Secret). Without it the planner restarts the
            # pods that hold the old token, with a new Secret.
            plan = planner.plan(job, pods, services, None, now, self.config)
        self.reconciles += 1

        old_status = job.get("status") or {}
        if plan.status != old_status:
            written = await self.write_status(key, job, plan.status)
            if written is None:
                return  # conflict or gone: re-read and re-planned by the next pass
            self.count_transitions(old_status, plan.status)
            job = written
        await self.apply(key, job, plan)
        if plan.all_children_present and uid not in self.children_seen:
            self.children_seen.add(uid)
            created = planner.parse_time(job["metadata"].get("creationTimestamp"))
            if created is not None:
                metrics.CHILDREN_LATENCY.observe(max(0.0, (datetime.now(timezone.utc) - created).total_seconds()))
        if plan.requeue_after is not None:
            self.schedule(key, plan.requeue_after + 0.5)
        metrics.RECONCILE_SECONDS.observe(time.perf_counter() - started)

    async def read_own_secret(self, key: Key, uid: str | None) -> dict | None:
        """The job's token Secret if it exists and belongs to this job (remembered), else None (forgotten)."""
        secret = await self.kube.read_secret(key[0], planner.secret_name(key[1]))
        if secret is not None and planner.controlled_by(secret, uid):
            self.secrets[key] = uid
            return secret
        # None, or a leftover of an older job of the same name that garbage collection removes
        self.secrets.pop(key, None)
        return None

    async def write_status(self, key: Key, job: dict, status: dict) -> dict | None:
        old = job.get("status") or {}
        body_status = dict(status)
        for gone in set(old) - set(status):
            body_status[gone] = None
        body = {"metadata": {"resourceVersion": job["metadata"]["resourceVersion"]}, "status": body_status}
        try:
            written = await self.kube.patch_job_status(key[0], key[1], body)
        except ApiError as err:
            metrics.API_ERRORS.labels("patch-status", str(err.status)).inc()
            if err.status == 404:
                self.forget(key)
                return None
            if err.status == 409:
                fresh = await self.kube.get_job(key[0], key[1])
                self.jobs[key] = fresh
                self.dirty.add(key)
                return None
            raise
        if key in self.jobs and (self.jobs[key].get("metadata") or {}).get("uid") == written["metadata"].get("uid"):
            self.jobs[key] = written
        return written

    def count_transitions(self, old: dict, new: dict) -> None:
        def true_conditions(status: dict) -> dict[str, dict]:
            return {c["type"]: c for c in status.get("conditions") or [] if c.get("status") == "True"}

        before, after = true_conditions(old), true_conditions(new)
        if "Created" in after and "Created" not in before:
            metrics.JOBS_CREATED.inc()
        if "Succeeded" in after and "Succeeded" not in before:
            metrics.JOBS_SUCCEEDED.inc()
        if "Failed" in after and "Failed" not in before:
            metrics.JOBS_FAILED.labels(after["Failed"].get("reason") or "").inc()
        old_rs, new_rs = old.get("replicaStatuses") or {}, new.get("replicaStatuses") or {}
        for role, rs in new_rs.items():
            delta = rs.get("restarts", 0) - (old_rs.get(role) or {}).get("restarts", 0)
            if delta > 0:
                metrics.RESTARTS.labels(role).inc(delta)

    async def apply(self, key: Key, job: dict, plan: planner.Plan) -> None:
        namespace, name = key
        for action in plan.of(planner.Event):
            kopf.event(job, type=action.type, reason=action.reason, message=action.message)
        secret_ready = True
        for action in plan.of(planner.CreateSecret):
            secret_ready = await self.create_secret(key, job, action)
        # Without the job's own Secret no pod is made: one started with another owner's token would disagree with
        # the pods started after it.
        kinds = (planner.CreateService, planner.CreatePod) if secret_ready else (planner.CreateService,)
        creates = [self.create_child(key, job, a) for a in plan.actions if isinstance(a, kinds)]
        deletes = [self.delete_child(key, job, a) for a in plan.actions
                   if isinstance(a, (planner.DeletePod, planner.DeleteService))]
        results = await asyncio.gather(*creates, *deletes, return_exceptions=True)
        self.post_summaries(job, [r for r in results if isinstance(r, tuple)])
        for result in results:
            if isinstance(result, BaseException):
                raise result
        for action in plan.of(planner.DeleteJob):
            await self.delete_job(key, job, action)

    @staticmethod
    def post_summaries(job: dict, done: list[tuple[str, str]]) -> None:
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
            kopf.event(job, type="Normal", reason=reason, message=message)

    async def create_secret(self, key: Key, job: dict, action: planner.CreateSecret) -> bool:
        """Create the job's Secret; returns whether the job's own Secret exists now."""
        uid = job["metadata"]["uid"]
        body = copy.deepcopy(action.body)
        token = secrets.token_urlsafe(32)
        body["data"] = {planner.TOKEN_KEY: base64.b64encode(token.encode()).decode()}
        try:
            await self.kube.create_secret(key[0], body)
        except ApiError as err:
            if err.status != 409:
                metrics.API_ERRORS.labels("create-secret", str(err.status)).inc()
                raise
            existing = await self.kube.read_secret(key[0], action.name)
            if existing is None or not planner.controlled_by(existing, uid):
                # Someone else's, e.g. the Secret of a deleted job of the same name that the garbage collector has
                # not removed yet: not ours to use. Retry until it is gone (Secrets are not watched).
                log.info("Secret %s/%s exists but is not controlled by job %s; retrying", key[0], action.name, uid)
                kopf.event(job, type="Warning", reason="SecretConflict",
                           message=f"Secret {action.name} exists but belongs to another owner; waiting for it to "
                                   f"be removed before creating pods")
                self.schedule(key, 2.0)
                return False
        else:
            kopf.event(job, type="Normal", reason="SecretCreated", message=f"Created Secret {action.name}")
        self.secrets[key] = uid
        return True

    async def create_child(self, key: Key, job: dict, action) -> tuple[str, str] | None:
        """Create a pod or Service; returns ``(reason, name)`` for the reconcile's Event when it was made."""
        is_pod = isinstance(action, planner.CreatePod)
        kind = "Pod" if is_pod else "Service"
        try:
            if is_pod:
                await self.kube.create_pod(key[0], action.body)
            else:
                await self.kube.create_service(key[0], action.body)
        except ApiError as err:
            if err.status == 409:
                return None  # already there: a repeated create is a no-op
            metrics.API_ERRORS.labels(f"create-{kind.lower()}", str(err.status)).inc()
            if err.status in (400, 422):
                # The API server refused what the template makes: no retry can fix it.
                message = f"The API server rejected {kind} {action.name} built from the template: {_api_message(err)}"
                await self.fail(key, "InvalidPodTemplate" if is_pod else "InvalidService", message)
                return None
            if err.status in (403, 404, 429, 500, 503):
                kopf.event(job, type="Warning", reason=f"{kind}CreateFailed",
                           message=f"Could not create {kind} {action.name}: {_api_message(err)}; retrying")
                self.schedule(key, 5.0)
                return None
            raise
        if is_pod:
            metrics.PODS_CREATED.labels(action.body["metadata"]["labels"][planner.LABEL_ROLE]).inc()
        else:
            metrics.SERVICES_CREATED.inc()
        return f"{kind}Created", action.name

    async def delete_child(self, key: Key, job: dict, action) -> tuple[str, str] | None:
        """Delete a pod or Service; returns ``(reason, what)`` for the reconcile's Event when it was deleted."""
        is_pod = isinstance(action, planner.DeletePod)
        kind = "Pod" if is_pod else "Service"
        try:
            if is_pod:
                await self.kube.delete_pod(key[0], action.name, action.uid)
            else:
                await self.kube.delete_service(key[0], action.name)
        except ApiError as err:
            if err.status in (404, 409):
                return None  # already gone, or replaced (UID precondition)
            metrics.API_ERRORS.labels(f"delete-{kind.lower()}", str(err.status)).inc()
            raise
        if is_pod:
            metrics.PODS_DELETED.labels(action.reason).inc()
        return f"{kind}Deleted", f"{action.name} ({action.reason})"

    async def delete_job(self, key: Key, job: dict, action: planner.DeleteJob) -> None:
        try:
            await self.kube.delete_job(key[0], key[1], job["metadata"].get("uid"))
        except ApiError as err:
            if err.status not in (404, 409):
                raise
            return
        metrics.JOBS_DELETED.inc()
        log.info("deleted %s/%s: %s", key[0], key[1], action.reason)

    async def fail(self, key: Key, reason: str, message: str) -> None:
        job = self.jobs.get(key)
        if job is None:
            return
        status = planner.fail_status(job, reason, message, datetime.now(timezone.utc))
        if status != (job.get("status") or {}):
            written = await self.write_status(key, job, status)
            if written is not None:
                self.count_transitions(job.get("status") or {}, status)
                kopf.event(written, type="Warning", reason=reason, message=message)
        self.trigger(key)  # clean up per cleanPodPolicy

    async def close(self) -> None:
        for timer in self.timers.values():
            timer.cancel()
        self.timers.clear()
        await self.kube.close()


# ------------------------------------------------------------------------------------------------ kopf handlers
@kopf.on.login()
def _login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    """kopf's credentials are ours (service account, kubeconfig, kubeconfig exec plugins): no client library."""
    return client.login(settings)


@kopf.on.startup()
async def _startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    if "reconciler" not in memo:
        # `kopf run -m kubeps.operator.handlers`: our settings from the environment, kopf's CLI decides the peering.
        ours = Settings.from_env()
        kopf_settings(ours, target=settings, peering=False)
        memo.reconciler = Reconciler(ours)
    ours = memo.reconciler.settings
    log.info("kubeps operator starting: namespaces=%s default image=%s cluster domain=%s qps=%s peering=%s",
             ",".join(ours.namespaces) or "(all)", ours.default_image, ours.cluster_domain, ours.api_qps,
             "off" if settings.peering.standalone else f"{settings.peering.name} (priority {settings.peering.priority})")


@kopf.on.cleanup()
async def _cleanup(memo: kopf.Memo, **_: Any) -> None:
    if "reconciler" in memo:
        await memo.reconciler.close()


# The handlers are coroutines: kopf runs a plain function in a thread pool, a hop per event of every pod.
# The children are kept by the index handlers (kopf's own index stays empty: it would hold the same copies);
# index handlers are not called for deletions, which one event handler, filtered to them, reports.
@kopf.index("", "v1", "pods", labels={planner.LABEL_JOB: kopf.PRESENT})
async def kubeps_pods(namespace: str, labels: dict, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    memo.reconciler.observe_child(body, namespace, labels, is_pod=True)


@kopf.index("", "v1", "services", labels={planner.LABEL_JOB: kopf.PRESENT})
async def kubeps_services(namespace: str, labels: dict, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    memo.reconciler.observe_child(body, namespace, labels, is_pod=False)


def _deleted(event: dict, **_: Any) -> bool:
    return event.get("type") == "DELETED"


@kopf.on.event("", "v1", "pods", labels={planner.LABEL_JOB: kopf.PRESENT}, when=_deleted)
@kopf.on.event("", "v1", "services", labels={planner.LABEL_JOB: kopf.PRESENT}, when=_deleted)
async def _child_deleted(namespace: str, labels: dict, uid: str, resource: kopf.Resource, memo: kopf.Memo,
                         **_: Any) -> None:
    """A pod or Service of a job is gone: forget it and reconcile its job."""
    memo.reconciler.forget_child(namespace, labels, uid, is_pod=resource.plural == "pods")


def _slim(body: kopf.Body, with_status: bool) -> dict:
    """Only what the planner reads of a child (keeps the operator small with thousands of pods)."""
    meta = body.get("metadata") or {}
    # Copies one level deep are enough: kopf hands each event a new body parsed from the watch stream.
    slim_meta = {key: meta[key] for key in ("name", "namespace", "uid", "deletionTimestamp") if key in meta}
    if "labels" in meta:
        slim_meta["labels"] = dict(meta["labels"])
    if "ownerReferences" in meta:
        slim_meta["ownerReferences"] = [dict(ref) for ref in meta["ownerReferences"]]
    epoch = (meta.get("annotations") or {}).get(planner.ANNOTATION_EPOCH)
    if epoch is not None:
        slim_meta["annotations"] = {planner.ANNOTATION_EPOCH: epoch}
    slim: dict[str, Any] = {"metadata": slim_meta}
    if with_status:
        status = body.get("status") or {}
        slim["status"] = {
            "phase": status.get("phase"),
            "reason": status.get("reason"),
            "conditions": [{"type": c.get("type"), "status": c.get("status")}
                           for c in status.get("conditions") or [] if c.get("type") == "Ready"],
            "containerStatuses": [_slim_container(c) for c in status.get("containerStatuses") or []],
            "initContainerStatuses": [_slim_container(c) for c in status.get("initContainerStatuses") or []],
        }
    return slim


def _slim_container(status: dict) -> dict:
    terminated = (status.get("state") or {}).get("terminated")
    slim = {"name": status.get("name"), "restartCount": status.get("restartCount", 0), "state": {}}
    if terminated is not None:
        slim["state"]["terminated"] = {"exitCode": terminated.get("exitCode"), "reason": terminated.get("reason")}
    return slim


def _plain(body: kopf.Body) -> dict:
    raw = {key: copy.deepcopy(value) for key, value in body.items()}
    meta = raw.get("metadata") or {}
    meta.pop("managedFields", None)
    return raw


@kopf.on.event(models.GROUP, models.VERSION, models.PLURAL)
async def _job_event(event: dict, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    memo.reconciler.observe_job(event.get("type"), _plain(body))


@kopf.on.probe(id="reconciler")
async def _probe(memo: kopf.Memo, **_: Any) -> dict:
    reconciler = memo.reconciler
    return {
        "jobs": len(reconciler.jobs),
        "reconciles": reconciler.reconciles,
        "in_flight": len(reconciler.tasks),
        "last_error": reconciler.last_error,
    }
