"""The reconciler: observe, plan, write the status, apply. kopf's ``memo.reconciler``.

Level-based and finalizer-free (see :mod:`.handlers` for what kopf does): every reconcile of a job builds one
:class:`~kubeps.operator.core.state.Observed` from its cache and a few reads (:meth:`Reconciler.observe`) and
makes one plan from it (:func:`kubeps.operator.core.planner.plan`), so a restarted operator converges to the same
state. The status is written (with the observed resourceVersion as precondition) before any action runs, so a
restart counted once is never counted again, and a stale cache only costs a re-read.

:class:`Reconciler` is the sum of its collaborators, named as fields as Kubeflow's ``JobController`` names its
own: :attr:`~Reconciler.cache` (what is known), :attr:`~Reconciler.queue` (when to reconcile),
:attr:`~Reconciler.scopes` (the watches that feed the cache), :attr:`~Reconciler.nodes` (the watch of Nodes and
their Leases, for pods on lost nodes), :attr:`~Reconciler.control` (the actuator) and
:attr:`~Reconciler.recorder` (Events and metrics). What it keeps for itself is one reconcile and the status write.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from datetime import datetime, timezone
from typing import Awaitable, Callable

from kubeps.operator.api.models import GangScheduler, NetworkPolicyMode
from kubeps.operator.core import disruption, gang, kueue, nodes, planner
from kubeps.operator.core.actions import CreatePod
from kubeps.operator.core.children import PlanConfig
from kubeps.operator.core.observed import controlled_by
from kubeps.operator.core.state import Observed, SecretFacts
from kubeps.operator.kube.client import ApiError, KubeClient

from .cache import Body, Cache, Key, job_key
from .control import Control
from .nodes import NodeWatch
from .progress import ProgressReader, chief_metrics_url
from .queue import WorkQueue
from .recorder import Recorder
from .scope import Scopes
from .settings import Settings

log = logging.getLogger("kubeps.operator")

#: Seconds a ResourceFlavor or priority class read for a queued job is reused.
KUEUE_OBJECT_TTL = 10.0


class Reconciler:
    """The operator's state and its parts: the cache of jobs and children, the work queue, the scopes' watches,
    the actuator and the recorder."""

    def __init__(self, settings: Settings, kube: KubeClient | None = None):
        self.settings = settings
        self.kube = kube or KubeClient(qps=settings.api_qps, burst=settings.api_burst, pool_size=settings.workers)
        self.config = PlanConfig(default_image=settings.default_image, cluster_domain=settings.cluster_domain,
                                 network_policy=NetworkPolicyMode(settings.job_network_policy),
                                 gang_scheduler=GangScheduler(settings.gang_scheduler),
                                 gang_scheduler_name=settings.gang_scheduler_name)
        self.cache = Cache()
        self.recorder = Recorder()
        #: writes status.progress from the chiefs' metrics (started with the operator, :meth:`start_progress`)
        self.progress = ProgressReader(
            self.cache, self.recorder, self.kube.patch_job_status, interval=settings.progress_interval,
            writes_per_second=settings.progress_writes_per_second,
            url=lambda job: chief_metrics_url(job, settings.cluster_domain, settings.chief_metrics_url))
        # `self.reconcile` is looked up at each call (not bound here), so a test may replace it on the instance.
        self.queue = WorkQueue(settings.workers, reconcile=lambda key: self.reconcile(key), ready=self._ready,
                               wanted=self.cache.has_job)
        self.scopes = Scopes(self.kube, settings, self.cache, on_list=self.children_listed,
                             on_event=self.child_event, on_gate=self.gate_changed,
                             workloads=(self.workloads_listed, self.workload_event))
        #: ResourceFlavors and priority classes read for queued jobs: (kind, name) -> (read at, object or None)
        self._kueue_objects: dict[tuple[str, str], tuple[float, Body | None]] = {}
        self.control = Control(self.kube, self.cache, self.recorder, retry=self.queue.schedule, fail=self.fail)
        self.nodes: NodeWatch | None = None
        if settings.node_lost_after >= 0:
            self.nodes = NodeWatch(self.kube, settings.node_lost_after, self.scopes.timeouts(),
                                   on_change=self.node_changed)
        self.reconciles = 0

    def configure(self, clusterwide: bool, peering: tuple[str, int] | None) -> None:
        """kopf's scope and peering, read at start-up (they hold kopf's CLI options under ``kopf run`` too)."""
        self.scopes.configure(clusterwide, peering)

    async def start_kueue(self) -> bool:
        """Turn the Kueue integration on per the ``kueue`` setting (``auto``: when the API server serves Kueue's
        Workload API); at start-up, before any job is seen. Returns whether it is on."""
        mode = self.settings.kueue
        on = mode == "on" or (mode == "auto" and await self.kube.served(f"{kueue.GROUP}/{kueue.VERSION}"))
        if on:
            self.config = dataclasses.replace(self.config, kueue=True)
            self.scopes.watch_workloads()
        return on

    # -- observing -----------------------------------------------------------------------------------------------
    def observe_job(self, event_type: str | None, body: Body) -> None:
        key = job_key(body)
        if event_type == "DELETED":
            self.forget(key)
            return
        self.scopes.enter(key[0])
        if self.nodes is not None and self.nodes.nodes.task is None:
            # Started here, as the scopes' watches are, so that what it triggers runs in kopf's context (Events).
            self.nodes.start()
        if self.cache.store_job(key, body):
            self.queue.trigger(key)

    def child_event(self, is_pod: bool, kind: str, obj: Body) -> None:
        """A watch event of a labelled pod or Service: reconcile its job if the planner would see something new
        (the scheduler's binding of a pod, say, changes nothing it reads)."""
        key = self.cache.child_event(is_pod, kind, obj)
        if key is not None and key in self.cache.jobs:
            self.queue.trigger(key)

    def children_listed(self, where: str | None, is_pod: bool, items: list[Body]) -> None:
        """A scope's full list of labelled pods or Services: reconcile the jobs whose children changed."""
        for key in self.cache.children_listed(where, is_pod, items):
            if key in self.cache.jobs:
                self.queue.trigger(key)

    def gate_changed(self, where: str | None, now_open: bool) -> None:
        """A scope's peering gate opened or closed. Closed: forget its jobs (kopf lists them again on resuming,
        and until then they belong to the replica in charge)."""
        if not now_open:
            for key in self.cache.jobs_within(where):
                self.forget(key)

    def workload_event(self, kind: str, obj: Body) -> None:
        key = self.cache.workload_event(kind, obj)
        if key is not None and key in self.cache.jobs:
            self.queue.trigger(key)

    def workloads_listed(self, where: str | None, items: list[Body]) -> None:
        for key in self.cache.workloads_listed(where, items):
            if key in self.cache.jobs:
                self.queue.trigger(key)

    def node_changed(self, node: str) -> None:
        """A node's verdict may have changed (lost, back): reconcile the jobs with pods on it."""
        for key in self.cache.jobs_on_node(node):
            self.queue.trigger(key)

    def forget(self, key: Key) -> None:
        self.cache.forget_job(key)
        self.queue.cancel(key)
        if key[0] in self.scopes.active and not any(k[0] == key[0] for k in self.cache.jobs):
            self.scopes.retire_idle()

    async def _ready(self, key: Key) -> None:
        """Wait until the job's scope may be planned (both lists in, the peering gate open)."""
        scope = self.scopes.get(key[0])
        if scope is not None:
            await scope.ready()

    # -- one reconcile -------------------------------------------------------------------------------------------
    async def reconcile(self, key: Key) -> None:
        """Observe the job once (:meth:`observe`), plan once, write the status, apply the plan.

        A Secret taken from the cache is verified before a plan that creates pods is acted on: a new pod reads its
        token from the Secret, which someone may have deleted since it was seen (Secrets are not watched: that would
        need rights to read every Secret). When it is gone, this reconcile writes and does nothing and the job is
        reconciled again at once; the read forgot the Secret, so that pass plans with it absent (the planner then
        restarts the pods that hold the old token, with a new Secret)."""
        job = self.cache.jobs.get(key)
        if job is None:
            return
        started = time.perf_counter()
        uid = job["metadata"].get("uid")
        cached = self.cache.secrets.get(key) == uid
        observed = await self.observe(key, job, cached)
        plan = planner.plan(observed)
        if cached and plan.of(CreatePod) and await self.control.secrets.read_own_secret(key, uid) is None:
            self.queue.again(key)
            return
        self.reconciles += 1

        old_status = job.get("status") or {}
        if plan.status != old_status:
            written = await self.write_status(key, job, plan.status)
            if written is None:
                return  # conflict or gone: re-read and re-planned by the next pass
            self.recorder.transitions(old_status, plan.status, job)
            job = written
        await self.control.apply(key, job, plan)
        await self.control.force_delete_pods(key, plan.force_deletes)
        await self.control.scheduling.sync_disruption_budget(key, job, disruption.wanted(job, plan.terminal))
        if plan.all_children_present:
            self.recorder.all_children_present(job)
        if plan.requeue_after is not None:
            self.queue.schedule(key, plan.requeue_after + 0.5)
        self.recorder.reconciled(time.perf_counter() - started)

    async def observe(self, key: Key, job: Body, secret_cached: bool) -> Observed:
        """Everything the planner decides from, for one reconcile: the cache's children, the Secret (from the cache
        when ``secret_cached``, else read), the NetworkPolicy the shell saw made, the nodes, the PodGroup and the
        Kueue view; the clock."""
        uid = job["metadata"].get("uid")
        pods, services = self.cache.children(key)
        secret: SecretFacts | None
        if secret_cached:
            secret = SecretFacts.from_annotations(self.cache.secret_annotations.get(key) or {})
        elif not pods and not job.get("status"):
            # A job never reconciled: plan to create its Secret without reading first (creating one that exists
            # answers 409, and create_secret then checks whose it is); one GET fewer per new job.
            secret = None
        else:
            body = await self.control.secrets.read_own_secret(key, uid)
            secret = SecretFacts.of(body) if body is not None else None
        # a job never reconciled has no ConfigMap yet: one GET fewer per new job, as for the Secret
        membership = await self.control.membership.read_membership(key, uid) if pods or job.get("status") else None
        queue = await self.queue_view(key, job) if self.config.kueue and kueue.queue_name(job) else None
        pod_group = None
        if self.config.gang_scheduler is not GangScheduler.NONE and (pods or job.get("status")):
            # (a job never reconciled has none: one fewer GET per new job, as for the Secret)
            pod_group = await self.control.scheduling.read_own_pod_group(key, uid, gang.API_VERSIONS[self.config.gang_scheduler])
        seen = nodes.NodesSeen()
        if self.nodes is not None:
            seen = nodes.NodesSeen(self.nodes.view(), self.settings.node_lost_after, self.nodes.leases_until,
                                   frozenset(self.cache.force_deleted))
        return Observed(job=job, now=datetime.now(timezone.utc), pods=pods, services=services, secret=secret,
                        network_policy=key in self.cache.network_policies, membership=membership, nodes=seen,
                        pod_group=pod_group,
                        queue=queue, config=self.config)

    async def queue_view(self, key: Key, job: Body) -> kueue.QueueView:
        """What the planner needs of Kueue for a queued job: its Workload (from the watch; one of an older job of
        the same name is not its), the ResourceFlavors the admission names, and, before the Workload is made, the
        job's priority."""
        workload = self.cache.workloads.get(key)
        if workload is not None and not controlled_by(workload, job["metadata"].get("uid")):
            workload = None
        flavors = {}
        for name in kueue.missing_flavors(workload):
            flavor = await self._cached(("flavor", name), self.kube.read_resource_flavor)
            if flavor is not None:
                flavors[name] = flavor.get("spec") or {}
        priority = None if workload is not None else await self._priority(job)
        return kueue.QueueView(workload=workload, flavors=flavors, priority=priority)

    async def _priority(self, job: Body) -> kueue.Priority | None:
        """The job's priority as Kueue's job framework reads it: the WorkloadPriorityClass its
        ``kueue.x-k8s.io/priority-class`` label names, else the PriorityClass of its templates' first
        ``priorityClassName``; None when neither names one that exists."""
        labels = (job.get("metadata") or {}).get("labels") or {}
        name = labels.get(kueue.LABEL_PRIORITY_CLASS)
        if name:
            found = await self._cached(("workload-priority-class", name), self.kube.read_workload_priority_class)
            if found is not None:
                return kueue.Priority(kueue.GROUP, "WorkloadPriorityClass", name, int(found.get("value", 0)))
        for replica in ((job.get("spec") or {}).get("replicaSpecs") or {}).values():
            pod_name = (((replica or {}).get("template") or {}).get("spec") or {}).get("priorityClassName")
            if pod_name:
                found = await self._cached(("priority-class", pod_name), self.kube.read_priority_class)
                if found is not None:
                    return kueue.Priority("scheduling.k8s.io", "PriorityClass", pod_name, int(found.get("value", 0)))
                break
        return None

    async def _cached(self, what: tuple[str, str], read: Callable[[str], Awaitable[Body | None]]) -> Body | None:
        """A cluster-scoped object a queued job names (a ResourceFlavor, a priority class), read at most every
        :data:`KUEUE_OBJECT_TTL` seconds; None when it does not exist or cannot be read (logged)."""
        known = self._kueue_objects.get(what)
        now = time.monotonic()
        if known is not None and now - known[0] < KUEUE_OBJECT_TTL:
            return known[1]
        try:
            found = await read(what[1])
        except ApiError as err:
            self.recorder.api_error(f"read-{what[0]}", err.status)
            log.warning("could not read %s %s: %s", what[0], what[1], err)
            found = None
        self._kueue_objects[what] = (now, found)
        return found

    async def write_status(self, key: Key, job: Body, status: Body) -> Body | None:
        """Write the job's new status over the one observed (its resourceVersion a precondition); None when the
        job is gone (forgotten) or changed since (re-read, and planned again by one more pass)."""
        old = job.get("status") or {}
        body_status = dict(status)
        for gone in set(old) - set(status):
            body_status[gone] = None
        body = {"metadata": {"resourceVersion": job["metadata"]["resourceVersion"]}, "status": body_status}
        try:
            written = await self.kube.patch_job_status(key[0], key[1], body)
        except ApiError as err:
            self.recorder.api_error("patch-status", err.status)
            if err.status == 404:
                self.forget(key)
                return None
            if err.status == 409:
                fresh = await self.kube.get_job(key[0], key[1])
                self.cache.jobs[key] = fresh
                self.queue.again(key)
                return None
            raise
        known = self.cache.jobs.get(key)
        if known is not None and (known.get("metadata") or {}).get("uid") == written["metadata"].get("uid"):
            self.cache.jobs[key] = written
        return written

    async def fail(self, key: Key, reason: str, message: str) -> None:
        """Fail the job for a reason found while applying its plan (the API server refused a child)."""
        job = self.cache.jobs.get(key)
        if job is None:
            return
        status = planner.fail_status(job, reason, message, datetime.now(timezone.utc))
        if status != (job.get("status") or {}):
            written = await self.write_status(key, job, status)
            if written is not None:
                self.recorder.transitions(job.get("status") or {}, status, job)
                self.recorder.event(written, "Warning", reason, message)
        self.queue.trigger(key)  # clean up per cleanPodPolicy

    def start_progress(self) -> None:
        """Start reading the running jobs' progress (on the operator's event loop)."""
        self.progress.start()

    async def close(self) -> None:
        await self.progress.close()
        self.queue.close()
        await self.scopes.close()
        if self.nodes is not None:
            await self.nodes.stop()
        await self.kube.close()
