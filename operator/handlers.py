"""The kopf shell: observe, call the planner, apply its actions. ``kopf run -m kubeps.operator.handlers`` works.

Level-based and finalizer-free:

* ``@kopf.on.event`` for PSTrainingJobs keeps the latest body of every job and triggers its reconcile; no
  create/update handlers, timers or daemons, so kopf adds no finalizer and a job deletes (with its children, by
  ownerReference garbage collection) even while the operator is down.
* ``@kopf.index`` keeps every labelled pod and Service in memory (kopf fills the indexes before any handler
  runs, so a restarted operator never plans from a half-known world); ``@kopf.on.event`` for them triggers the
  owning job's reconcile.
* One reconcile per job at a time (later triggers coalesce into one more pass); deadlines and TTLs are timers
  of the event loop, re-armed by every reconcile.
* The status is written (with the observed resourceVersion as precondition) before any action runs, so a
  restart counted once is never counted again, and a stale cache only costs a re-read.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import copy
import json
import logging
import secrets
import time
from datetime import datetime, timezone
from typing import Any, Callable

import kopf
from kubernetes.client.exceptions import ApiException

from . import metrics, models, planner
from .client import KubeClient, load_api_client
from .settings import Settings

log = logging.getLogger("kubeps.operator")

Key = tuple[str, str]  # (namespace, job name)

_configured: Settings | None = None


def configure(settings: Settings) -> None:
    """Use these settings at the next start-up (``main`` calls it; ``kopf run`` reads the environment)."""
    global _configured
    _configured = settings


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
    def __init__(self, settings: Settings, kube: KubeClient):
        self.settings = settings
        self.kube = kube
        self.config = planner.PlanConfig(default_image=settings.default_image,
                                          cluster_domain=settings.cluster_domain)
        self.jobs: dict[Key, dict] = {}
        self.pods_index: Any = None
        self.services_index: Any = None
        self.secrets: dict[Key, str] = {}  # job key -> uid of the job whose Secret is known to exist
        self.dirty: set[Key] = set()
        self.tasks: dict[Key, asyncio.Task] = {}
        self.timers: dict[Key, asyncio.TimerHandle] = {}
        self.children_seen: set[str] = set()
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=settings.workers,
                                                              thread_name_prefix="kubeps-api")
        self.limit = asyncio.Semaphore(settings.workers)
        self.reconciles = 0
        self.last_error: str | None = None

    # -- observing -----------------------------------------------------------------------------------------------
    def capture_indexes(self, kwargs: dict) -> None:
        if self.pods_index is None:
            self.pods_index = kwargs.get("kubeps_pods")
            self.services_index = kwargs.get("kubeps_services")

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

    async def call(self, fn: Callable, *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # -- one reconcile -------------------------------------------------------------------------------------------
    async def reconcile(self, key: Key) -> None:
        job = self.jobs.get(key)
        if job is None:
            return
        started = time.perf_counter()
        namespace, name = key
        uid = job["metadata"].get("uid")
        # Index values are private slim copies (see _slim) that the planner only reads.
        pods = list(self.pods_index.get(key, [])) if self.pods_index else []
        services = list(self.services_index.get(key, [])) if self.services_index else []
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
        secret = await self.call(self.kube.read_secret, key[0], planner.secret_name(key[1]))
        if secret is not None and planner._controlled_by(secret, uid):
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
            written = await self.call(self.kube.patch_job_status, key[0], key[1], body)
        except ApiException as err:
            metrics.API_ERRORS.labels("patch-status", str(err.status)).inc()
            if err.status == 404:
                self.forget(key)
                return None
            if err.status == 409:
                fresh = await self.call(self.kube.get_job, key[0], key[1])
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
        for result in results:
            if isinstance(result, BaseException):
                raise result
        for action in plan.of(planner.DeleteJob):
            await self.delete_job(key, job, action)

    async def create_secret(self, key: Key, job: dict, action: planner.CreateSecret) -> bool:
        """Create the job's Secret; returns whether the job's own Secret exists now."""
        uid = job["metadata"]["uid"]
        body = copy.deepcopy(action.body)
        token = secrets.token_urlsafe(32)
        body["data"] = {planner.TOKEN_KEY: base64.b64encode(token.encode()).decode()}
        try:
            await self.call(self.kube.create_secret, key[0], body)
        except ApiException as err:
            if err.status != 409:
                metrics.API_ERRORS.labels("create-secret", str(err.status)).inc()
                raise
            existing = await self.call(self.kube.read_secret, key[0], action.name)
            if existing is None or not planner._controlled_by(existing, uid):
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

    async def create_child(self, key: Key, job: dict, action) -> None:
        is_pod = isinstance(action, planner.CreatePod)
        kind = "Pod" if is_pod else "Service"
        try:
            if is_pod:
                await self.call(self.kube.create_pod, key[0], action.body)
            else:
                await self.call(self.kube.create_service, key[0], action.body)
        except ApiException as err:
            if err.status == 409:
                return  # already there: a repeated create is a no-op
            metrics.API_ERRORS.labels(f"create-{kind.lower()}", str(err.status)).inc()
            if err.status in (400, 422):
                # The API server refused what the template makes: no retry can fix it.
                message = f"The API server rejected {kind} {action.name} built from the template: {_api_message(err)}"
                await self.fail(key, "InvalidPodTemplate" if is_pod else "InvalidService", message)
                return
            if err.status in (403, 404, 429, 500, 503):
                kopf.event(job, type="Warning", reason=f"{kind}CreateFailed",
                           message=f"Could not create {kind} {action.name}: {_api_message(err)}; retrying")
                self.schedule(key, 5.0)
                return
            raise
        if is_pod:
            metrics.PODS_CREATED.labels(action.body["metadata"]["labels"][planner.LABEL_ROLE]).inc()
        else:
            metrics.SERVICES_CREATED.inc()
        kopf.event(job, type="Normal", reason=f"{kind}Created", message=f"Created {kind} {action.name}")

    async def delete_child(self, key: Key, job: dict, action) -> None:
        is_pod = isinstance(action, planner.DeletePod)
        kind = "Pod" if is_pod else "Service"
        try:
            if is_pod:
                await self.call(self.kube.delete_pod, key[0], action.name, action.uid)
            else:
                await self.call(self.kube.delete_service, key[0], action.name)
        except ApiException as err:
            if err.status in (404, 409):
                return  # already gone, or replaced (UID precondition)
            metrics.API_ERRORS.labels(f"delete-{kind.lower()}", str(err.status)).inc()
            raise
        if is_pod:
            metrics.PODS_DELETED.labels(action.reason).inc()
        kopf.event(job, type="Normal", reason=f"{kind}Deleted", message=f"Deleted {kind} {action.name} ({action.reason})")

    async def delete_job(self, key: Key, job: dict, action: planner.DeleteJob) -> None:
        try:
            await self.call(self.kube.delete_job, key[0], key[1], job["metadata"].get("uid"))
        except ApiException as err:
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

    def close(self) -> None:
        for timer in self.timers.values():
            timer.cancel()
        self.timers.clear()
        self.executor.shutdown(wait=False, cancel_futures=True)


RECONCILER: Reconciler | None = None


def _reconciler() -> Reconciler:
    if RECONCILER is None:
        raise kopf.PermanentError("the kubeps operator is not started")
    return RECONCILER


# ------------------------------------------------------------------------------------------------ kopf handlers
@kopf.on.startup()
async def _startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    global RECONCILER
    ours = _configured or Settings.from_env()
    settings.peering.standalone = True  # one replica (Deployment strategy Recreate); no peering CRDs needed
    settings.posting.level = logging.WARNING  # kopf's own log lines become Events only from WARNING up
    settings.watching.server_timeout = int(ours.watch_server_timeout)  # the API server wants an integer
    settings.watching.client_timeout = ours.watch_client_timeout
    settings.watching.connect_timeout = ours.watch_connect_timeout
    settings.watching.inactivity_timeout = ours.watch_inactivity_timeout
    settings.execution.max_workers = max(4, ours.workers)
    settings.batching.idle_timeout = 5.0
    settings.batching.batch_window = 0.05
    api_client = load_api_client(pool_size=ours.workers)
    RECONCILER = Reconciler(ours, KubeClient(api_client, qps=ours.api_qps, burst=ours.api_burst))
    log.info("kubeps operator starting: namespaces=%s default image=%s cluster domain=%s qps=%s",
             ",".join(ours.namespaces) or "(all)", ours.default_image, ours.cluster_domain, ours.api_qps)


@kopf.on.cleanup()
async def _cleanup(**_: Any) -> None:
    global RECONCILER
    if RECONCILER is not None:
        RECONCILER.close()
        RECONCILER = None


@kopf.index("", "v1", "pods", labels={planner.LABEL_JOB: kopf.PRESENT})
def kubeps_pods(namespace: str, labels: dict, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, labels[planner.LABEL_JOB]): _slim(body, with_status=True)}


@kopf.index("", "v1", "services", labels={planner.LABEL_JOB: kopf.PRESENT})
def kubeps_services(namespace: str, labels: dict, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, labels[planner.LABEL_JOB]): _slim(body, with_status=False)}


def _slim(body: kopf.Body, with_status: bool) -> dict:
    """Only what the planner reads of a child (keeps the operator small with thousands of pods)."""
    meta = body.get("metadata") or {}
    slim_meta = {key: copy.deepcopy(meta[key]) for key in
                 ("name", "namespace", "uid", "labels", "ownerReferences", "deletionTimestamp") if key in meta}
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
async def _job_event(event: dict, body: kopf.Body, **kwargs: Any) -> None:
    reconciler = _reconciler()
    reconciler.capture_indexes(kwargs)
    reconciler.observe_job(event.get("type"), _plain(body))


@kopf.on.event("", "v1", "pods", labels={planner.LABEL_JOB: kopf.PRESENT})
@kopf.on.event("", "v1", "services", labels={planner.LABEL_JOB: kopf.PRESENT})
async def _child_event(namespace: str, labels: dict, **kwargs: Any) -> None:
    """A pod or Service of a job changed: reconcile its job."""
    reconciler = _reconciler()
    reconciler.capture_indexes(kwargs)
    key = (namespace, labels[planner.LABEL_JOB])
    if key in reconciler.jobs:
        reconciler.trigger(key)


@kopf.on.probe(id="reconciler")
def _probe(**_: Any) -> dict:
    reconciler = _reconciler()
    return {
        "jobs": len(reconciler.jobs),
        "reconciles": reconciler.reconciles,
        "in_flight": len(reconciler.tasks),
        "last_error": reconciler.last_error,
    }
