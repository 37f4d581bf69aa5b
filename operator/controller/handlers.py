"""The kopf shell: observe, call the planner, apply its actions. ``kopf run -m kubeps.operator.controller.handlers`` works.

Level-based and finalizer-free:

* ``@kopf.on.event`` for PSTrainingJobs keeps the latest body of every job and triggers its reconcile; no
  create/update handlers, timers or daemons, so kopf adds no finalizer and a job deletes (with its children, by
  ownerReference garbage collection) even while the operator is down. kopf also does the peering, the namespace
  patterns, the liveness probe and the Events.
* The pods and Services are watched outside kopf (:mod:`kubeps.operator.kube.watch`), one list-then-watch each per
  :class:`Scope` (the cluster, or each namespace where a job was seen), started with the scope's first job. The
  reconciler keeps a slim copy of every labelled one and triggers the owning job's reconcile when the copy
  changes in what the planner reads. No job of a scope is planned before both lists are in (a restarted operator
  never plans from a half-known world), nor while the scope's peering :class:`~kubeps.operator.kube.peering.Gate` is
  closed (another replica is in charge: kopf has paused the jobs' watch, and this keeps the children's quiet too).
* One reconcile per job at a time (later triggers coalesce into one more pass); deadlines and TTLs are timers
  of the event loop, re-armed by every reconcile.
* The status is written (with the observed resourceVersion as precondition) before any action runs, so a
  restart counted once is never counted again, and a stale cache only costs a re-read.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import functools
import json
import logging
import secrets
import time
from datetime import datetime, timezone
from typing import Any

import kopf

from kubeps.operator.api import models
from kubeps.operator.core import actions, children, observed, planner
from kubeps.operator.kube import client
from kubeps.operator.kube.client import ApiError, KubeClient
from kubeps.operator.kube.peering import Gate
from kubeps.operator.kube.watch import Watcher

from . import metrics
from .settings import Settings, kopf_settings

log = logging.getLogger("kubeps.operator")

Key = tuple[str, str]  # (namespace, job name)
SUMMARY_NAMES = 12  # children named in one Event's message; the rest are counted
RETIRE_AFTER = 60.0  # seconds a namespace's watches outlive its last job


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
        self.config = children.PlanConfig(default_image=settings.default_image,
                                          cluster_domain=settings.cluster_domain)
        self.jobs: dict[Key, dict] = {}
        # The slim copies of every pod and Service, by job and UID, kept by the scopes' watches.
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
        # Set from kopf's settings at start-up (they hold kopf's CLI options under `kopf run` too).
        self.clusterwide = settings.clusterwide
        self.peering: tuple[str, int] | None = None  # (name, priority) when replicas peer
        self.scopes: dict[str | None, Scope] = {}  # by namespace; None: the whole cluster

    def configure(self, clusterwide: bool, peering: tuple[str, int] | None) -> None:
        self.clusterwide, self.peering = clusterwide, peering

    def where(self, namespace: str) -> str | None:
        """The key of the scope that holds ``namespace``'s children (None: the whole cluster)."""
        return None if self.clusterwide else namespace

    def scope(self, namespace: str) -> "Scope":
        """The scope that holds ``namespace``'s children, its watches started on first use."""
        where = self.where(namespace)
        found = self.scopes.get(where)
        if found is None:
            found = self.scopes[where] = Scope(self, where).start()
        found.retire_at = None
        return found

    def _retire_idle_scopes(self) -> None:
        """Stop the watches of namespaces that have had no job for RETIRE_AFTER seconds."""
        now = time.monotonic()
        busy = {namespace for namespace, _ in self.jobs}
        for where, scope in list(self.scopes.items()):
            if where is None or where in busy:
                scope.retire_at = None
            elif scope.retire_at is None:
                scope.retire_at = now + RETIRE_AFTER
                asyncio.get_running_loop().call_later(RETIRE_AFTER + 0.5, self._retire_idle_scopes)
            elif scope.retire_at <= now:
                del self.scopes[where]
                for store in (self.pods, self.services):
                    for key in [k for k in store if _within(where, k)]:
                        del store[key]
                asyncio.get_running_loop().create_task(scope.stop())

    def gate_changed(self, where: str | None, now_open: bool) -> None:
        """A scope's peering gate opened or closed. Closed: forget its jobs (kopf lists them again on resuming,
        and until then they belong to the replica in charge)."""
        if not now_open:
            for key in [k for k in self.jobs if _within(where, k)]:
                self.forget(key)

    # -- observing -----------------------------------------------------------------------------------------------
    def observe_job(self, event_type: str | None, body: dict) -> None:
        meta = body.get("metadata") or {}
        key = (meta.get("namespace"), meta.get("name"))
        if event_type == "DELETED":
            self.forget(key)
            return
        self.scope(key[0])
        current = self.jobs.get(key)
        if current is not None and (current.get("metadata") or {}).get("uid") == meta.get("uid"):
            old, new = _rv(current), _rv(body)
            if old is not None and new is not None and new < old:
                return  # an event older than what our own write returned
        self.jobs[key] = body
        self.trigger(key)

    def child_event(self, is_pod: bool, kind: str, obj: dict) -> None:
        """A watch event of a labelled pod or Service: keep its slim copy (or forget it) and reconcile its job if
        the planner would see something new (the scheduler's binding of a pod, say, changes nothing it reads)."""
        meta = obj.get("metadata") or {}
        key = _child_key(meta)
        store = self.pods if is_pod else self.services
        known = store.get(key)
        uid = meta.get("uid")
        if kind == "DELETED":
            if known is None or known.pop(uid, None) is None:
                return
            if not known:
                del store[key]
        else:
            slim = _slim(obj, with_status=is_pod)
            if known is None:
                known = store[key] = {}
            elif known.get(uid) == slim:
                return
            known[uid] = slim
        if key in self.jobs:
            self.trigger(key)

    def children_listed(self, where: str | None, is_pod: bool, items: list[dict]) -> None:
        """A scope's full list of labelled pods or Services: replace what was known there (what is missing was
        deleted while the watch was away) and reconcile the jobs whose children changed."""
        fresh: dict[Key, dict[str, dict]] = {}
        for obj in items:
            meta = obj.get("metadata") or {}
            fresh.setdefault(_child_key(meta), {})[meta.get("uid")] = _slim(obj, with_status=is_pod)
        store = self.pods if is_pod else self.services
        for key in {k for k in store if _within(where, k)} | set(fresh):
            if store.get(key) == fresh.get(key):
                continue
            if key in fresh:
                store[key] = fresh[key]
            else:
                del store[key]
            if key in self.jobs:
                self.trigger(key)

    def forget(self, key: Key) -> None:
        self.jobs.pop(key, None)
        self.secrets.pop(key, None)
        timer = self.timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        if key[0] in self.scopes and not any(k[0] == key[0] for k in self.jobs):
            self._retire_idle_scopes()

    def trigger(self, key: Key) -> None:
        self.dirty.add(key)
        if key not in self.tasks:
            self.tasks[key] = asyncio.get_running_loop().create_task(self._worker(key))

    async def _worker(self, key: Key) -> None:
        try:
            while key in self.dirty:
                scope = self.scopes.get(self.where(key[0]))
                if scope is not None:
                    await scope.ready()
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
        if cached:
            secret = {"metadata": {"name": children.secret_name(name)}}
        elif not pods and not job.get("status"):
            # A job never reconciled: plan to create its Secret without reading first (creating one that exists
            # answers 409, and create_secret then checks whose it is); one GET fewer per new job.
            secret = None
        else:
            secret = await self.read_own_secret(key, uid)
        now = datetime.now(timezone.utc)
        plan = planner.plan(job, pods, services, secret, now, self.config)
        if cached and plan.of(actions.CreatePod) and await self.read_own_secret(key, uid) is None:
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
            created = observed.parse_time(job["metadata"].get("creationTimestamp"))
            if created is not None:
                metrics.CHILDREN_LATENCY.observe(max(0.0, (datetime.now(timezone.utc) - created).total_seconds()))
        if plan.requeue_after is not None:
            self.schedule(key, plan.requeue_after + 0.5)
        metrics.RECONCILE_SECONDS.observe(time.perf_counter() - started)

    async def read_own_secret(self, key: Key, uid: str | None) -> dict | None:
        """The job's token Secret if it exists and belongs to this job (remembered), else None (forgotten)."""
        secret = await self.kube.read_secret(key[0], children.secret_name(key[1]))
        if secret is not None and observed.controlled_by(secret, uid):
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

    async def apply(self, key: Key, job: dict, plan: actions.Plan) -> None:
        namespace, name = key
        for action in plan.of(actions.Event):
            kopf.event(job, type=action.type, reason=action.reason, message=action.message)
        secret_ready = True
        for action in plan.of(actions.CreateSecret):
            secret_ready = await self.create_secret(key, job, action)
        # Without the job's own Secret no pod is made: one started with another owner's token would disagree with
        # the pods started after it.
        kinds = (actions.CreateService, actions.CreatePod) if secret_ready else (actions.CreateService,)
        creates = [self.create_child(key, job, a) for a in plan.actions if isinstance(a, kinds)]
        deletes = [self.delete_child(key, job, a) for a in plan.actions
                   if isinstance(a, (actions.DeletePod, actions.DeleteService))]
        results = await asyncio.gather(*creates, *deletes, return_exceptions=True)
        self.post_summaries(job, [r for r in results if isinstance(r, tuple)])
        for result in results:
            if isinstance(result, BaseException):
                raise result
        for action in plan.of(actions.DeleteJob):
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

    async def create_secret(self, key: Key, job: dict, action: actions.CreateSecret) -> bool:
        """Create the job's Secret; returns whether the job's own Secret exists now."""
        uid = job["metadata"]["uid"]
        body = copy.deepcopy(action.body)
        token = secrets.token_urlsafe(32)
        body["data"] = {children.TOKEN_KEY: base64.b64encode(token.encode()).decode()}
        try:
            await self.kube.create_secret(key[0], body)
        except ApiError as err:
            if err.status != 409:
                metrics.API_ERRORS.labels("create-secret", str(err.status)).inc()
                raise
            existing = await self.kube.read_secret(key[0], action.name)
            if existing is None or not observed.controlled_by(existing, uid):
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
        is_pod = isinstance(action, actions.CreatePod)
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
            metrics.PODS_CREATED.labels(action.body["metadata"]["labels"][children.LABEL_ROLE]).inc()
        else:
            metrics.SERVICES_CREATED.inc()
        return f"{kind}Created", action.name

    async def delete_child(self, key: Key, job: dict, action) -> tuple[str, str] | None:
        """Delete a pod or Service; returns ``(reason, what)`` for the reconcile's Event when it was deleted."""
        is_pod = isinstance(action, actions.DeletePod)
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

    async def delete_job(self, key: Key, job: dict, action: actions.DeleteJob) -> None:
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
        scopes, self.scopes = list(self.scopes.values()), {}
        await asyncio.gather(*(scope.stop() for scope in scopes))
        await self.kube.close()


class Scope:
    """The watches behind the jobs of one namespace (or, ``namespace`` None, of the whole cluster): their pods,
    their Services and, when replicas peer, the peering object."""

    def __init__(self, reconciler: Reconciler, namespace: str | None):
        settings = reconciler.settings
        self.namespace = namespace
        self.retire_at: float | None = None
        self.timeouts = dict(server_timeout=settings.watch_server_timeout,
                             client_timeout=settings.watch_client_timeout,
                             connect_timeout=settings.watch_connect_timeout,
                             inactivity_timeout=settings.watch_inactivity_timeout)
        self.kube = reconciler.kube
        self.pods = self._watch("pods", functools.partial(reconciler.children_listed, namespace, True),
                                functools.partial(reconciler.child_event, True))
        self.services = self._watch("services", functools.partial(reconciler.children_listed, namespace, False),
                                    functools.partial(reconciler.child_event, False))
        self.gate = None
        if reconciler.peering is not None:
            name, priority = reconciler.peering
            self.gate = Gate(self.kube, namespace, name, priority,
                             functools.partial(reconciler.gate_changed, namespace), **self.timeouts)

    def _watch(self, plural: str, on_list, on_event) -> Watcher:
        where = "" if self.namespace is None else f"/namespaces/{self.namespace}"
        return Watcher(self.kube, f"/api/v1{where}/{plural}", label_selector=children.LABEL_JOB, on_list=on_list,
                       on_event=on_event, **self.timeouts)

    def start(self) -> "Scope":
        self.pods.start()
        self.services.start()
        if self.gate is not None:
            self.gate.start()
        return self

    async def ready(self) -> None:
        """Wait until both lists are in and, when peering, this replica may act here."""
        await self.pods.synced.wait()
        await self.services.synced.wait()
        if self.gate is not None:
            await self.gate.open.wait()

    async def stop(self) -> None:
        await asyncio.gather(self.pods.stop(), self.services.stop(), *([self.gate.stop()] if self.gate else []))


# ------------------------------------------------------------------------------------------------ kopf handlers
@kopf.on.login()
def _login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    """kopf's credentials are ours (service account, kubeconfig, kubeconfig exec plugins): no client library."""
    return client.login(settings)


@kopf.on.startup()
async def _startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    if "reconciler" not in memo:
        # `kopf run -m kubeps.operator.controller.handlers`: our settings from the environment, kopf's CLI decides the peering.
        ours = Settings.from_env()
        kopf_settings(ours, target=settings, peering=False)
        memo.reconciler = Reconciler(ours)
    ours = memo.reconciler.settings
    memo.reconciler.configure(
        clusterwide=settings.peering.clusterwide,
        peering=None if settings.peering.standalone else (settings.peering.name, settings.peering.priority))
    log.info("kubeps operator starting: namespaces=%s default image=%s cluster domain=%s qps=%s peering=%s",
             ",".join(ours.namespaces) or "(all)", ours.default_image, ours.cluster_domain, ours.api_qps,
             "off" if settings.peering.standalone else f"{settings.peering.name} (priority {settings.peering.priority})")


@kopf.on.cleanup()
async def _cleanup(memo: kopf.Memo, **_: Any) -> None:
    if "reconciler" in memo:
        await memo.reconciler.close()


def _child_key(meta: dict) -> Key:
    """The job a labelled pod or Service belongs to."""
    return meta.get("namespace"), (meta.get("labels") or {}).get(children.LABEL_JOB)


def _within(where: str | None, key: Key) -> bool:
    """Whether the job ``key`` is in the scope ``where`` (a namespace, or None: the whole cluster)."""
    return where is None or key[0] == where


def _slim(body: dict, with_status: bool) -> dict:
    """Only what the planner reads of a child (keeps the operator small with thousands of pods)."""
    meta = body.get("metadata") or {}
    # Copies one level deep are enough: every event is a new body parsed from the watch stream.
    slim_meta = {key: meta[key] for key in ("name", "namespace", "uid", "deletionTimestamp") if key in meta}
    if "labels" in meta:
        slim_meta["labels"] = dict(meta["labels"])
    if "ownerReferences" in meta:
        slim_meta["ownerReferences"] = [dict(ref) for ref in meta["ownerReferences"]]
    epoch = (meta.get("annotations") or {}).get(children.ANNOTATION_EPOCH)
    if epoch is not None:
        slim_meta["annotations"] = {children.ANNOTATION_EPOCH: epoch}
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
    state = status.get("state") or {}
    terminated = state.get("terminated")
    slim = {"name": status.get("name"), "restartCount": status.get("restartCount", 0), "state": {}}
    if terminated is not None:
        slim["state"]["terminated"] = {"exitCode": terminated.get("exitCode"), "reason": terminated.get("reason"),
                                       "finishedAt": terminated.get("finishedAt")}
    waiting = state.get("waiting") or {}
    if waiting.get("reason") in observed.STUCK_REASONS:  # not the usual ContainerCreating: no reconcile for those
        slim["state"]["waiting"] = {"reason": waiting["reason"], "message": waiting.get("message")}
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
