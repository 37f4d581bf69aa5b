"""Scopes: the watches behind the jobs of one namespace (or of the whole cluster), and their lifecycle.

The pods and Services are watched outside kopf (:mod:`kubeps.operator.kube.watch`), one list-then-watch each per
:class:`Scope`, plus, when replicas peer, the scope's peering :class:`~kubeps.operator.kube.peering.Gate`.
:class:`Scopes` starts a scope with its first job and retires a namespace's scope :data:`RETIRE_AFTER` seconds
after its last job is gone (the cluster-wide scope stays). No job of a scope is planned before both lists are in
(a restarted operator never plans from a half-known world), nor while its gate is closed (another replica is in
charge: kopf has paused the jobs' watch, and this keeps the children's quiet too).
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any, Callable

from kubeps.operator.core.children import LABEL_JOB
from kubeps.operator.kube.client import KubeClient
from kubeps.operator.kube.peering import Gate
from kubeps.operator.kube.watch import Timeouts, Watcher

from .cache import Body, Cache
from .settings import Settings

RETIRE_AFTER = 60.0  # seconds a namespace's watches outlive its last job

#: ``on_list(where, is_pod, items)``, ``on_event(is_pod, kind, obj)``, ``on_gate(where, now_open)``
OnList = Callable[[str | None, bool, list[Body]], Any]
OnEvent = Callable[[bool, str, Body], Any]
OnGate = Callable[[str | None, bool], Any]
#: Kueue's Workloads: ``on_workloads(where, items)``, ``on_workload(kind, obj)``
OnWorkloads = Callable[[str | None, list[Body]], Any]
OnWorkload = Callable[[str, Body], Any]


class Scope:
    """The watches behind the jobs of one namespace (or, ``namespace`` None, of the whole cluster): their pods,
    their Services and, when replicas peer, the peering object."""

    def __init__(self, kube: KubeClient, settings: Settings, namespace: str | None, peering: tuple[str, int] | None,
                 on_list: OnList, on_event: OnEvent, on_gate: OnGate,
                 workloads: tuple[OnWorkloads, OnWorkload] | None = None):
        self.namespace = namespace
        self.retire_at: float | None = None
        self.timeouts = Timeouts(server_timeout=settings.watch_server_timeout,
                                 client_timeout=settings.watch_client_timeout,
                                 connect_timeout=settings.watch_connect_timeout,
                                 inactivity_timeout=settings.watch_inactivity_timeout)
        self.kube = kube
        self.pods = self._watch("pods", functools.partial(on_list, namespace, True),
                                functools.partial(on_event, True))
        self.services = self._watch("services", functools.partial(on_list, namespace, False),
                                    functools.partial(on_event, False))
        #: the jobs' Kueue Workloads, watched when the operator's Kueue integration is on
        self.workloads: Watcher | None = None
        if workloads is not None:
            on_workloads, on_workload = workloads
            self.workloads = self._watch(f"/apis/kueue.x-k8s.io/v1beta2{self._where()}/workloads",
                                         functools.partial(on_workloads, namespace), on_workload)
        self.gate = None
        if peering is not None:
            name, priority = peering
            self.gate = Gate(self.kube, namespace, name, priority, functools.partial(on_gate, namespace),
                             **self.timeouts)

    def _watch(self, plural: str, on_list: Callable[[list[Body]], Any],
               on_event: Callable[[str, Body], Any]) -> Watcher:
        path = plural if plural.startswith("/") else f"/api/v1{self._where()}/{plural}"
        return Watcher(self.kube, path, label_selector=LABEL_JOB, on_list=on_list, on_event=on_event,
                       **self.timeouts)

    def _where(self) -> str:
        return "" if self.namespace is None else f"/namespaces/{self.namespace}"

    @property
    def watchers(self) -> list[Watcher]:
        return [self.pods, self.services] + ([self.workloads] if self.workloads is not None else [])

    def start(self) -> "Scope":
        for watcher in self.watchers:
            watcher.start()
        if self.gate is not None:
            self.gate.start()
        return self

    async def ready(self) -> None:
        """Wait until every list is in and, when peering, this replica may act here."""
        for watcher in self.watchers:
            await watcher.synced.wait()
        if self.gate is not None:
            await self.gate.open.wait()

    async def stop(self) -> None:
        await asyncio.gather(*(w.stop() for w in self.watchers), *([self.gate.stop()] if self.gate else []))


class Scopes:
    """The live scopes by namespace (None: the whole cluster), started and retired with the jobs of ``cache``."""

    def __init__(self, kube: KubeClient, settings: Settings, cache: Cache, on_list: OnList, on_event: OnEvent,
                 on_gate: OnGate, workloads: tuple[OnWorkloads, OnWorkload] | None = None):
        self.kube, self.settings, self.cache = kube, settings, cache
        self.on_list, self.on_event, self.on_gate = on_list, on_event, on_gate
        #: the Workload callbacks once the Kueue integration is on (:meth:`watch_workloads`)
        self.workloads: tuple[OnWorkloads, OnWorkload] | None = None
        self._workload_callbacks = workloads
        # Set from kopf's settings at start-up (they hold kopf's CLI options under `kopf run` too).
        self.clusterwide = settings.clusterwide
        self.peering: tuple[str, int] | None = None  # (name, priority) when replicas peer
        self.active: dict[str | None, Scope] = {}

    def configure(self, clusterwide: bool, peering: tuple[str, int] | None) -> None:
        self.clusterwide, self.peering = clusterwide, peering

    def watch_workloads(self) -> None:
        """Watch the jobs' Kueue Workloads too, in every scope started from now on (at start-up, before any)."""
        self.workloads = self._workload_callbacks

    def where(self, namespace: str) -> str | None:
        """The key of the scope that holds ``namespace``'s children (None: the whole cluster)."""
        return None if self.clusterwide else namespace

    def timeouts(self) -> Timeouts:
        """The watch timeouts of the settings, for a watch outside the scopes."""
        s = self.settings
        return Timeouts(server_timeout=s.watch_server_timeout, client_timeout=s.watch_client_timeout,
                        connect_timeout=s.watch_connect_timeout, inactivity_timeout=s.watch_inactivity_timeout)

    def get(self, namespace: str) -> Scope | None:
        return self.active.get(self.where(namespace))

    def enter(self, namespace: str) -> Scope:
        """The scope that holds ``namespace``'s children, its watches started on first use."""
        where = self.where(namespace)
        found = self.active.get(where)
        if found is None:
            found = self.active[where] = Scope(self.kube, self.settings, where, self.peering, self.on_list,
                                               self.on_event, self.on_gate, self.workloads).start()
        found.retire_at = None
        return found

    def retire_idle(self) -> None:
        """Stop the watches of namespaces that have had no job for RETIRE_AFTER seconds."""
        now = time.monotonic()
        busy = {namespace for namespace, _ in self.cache.jobs}
        for where, scope in list(self.active.items()):
            if where is None or where in busy:
                scope.retire_at = None
            elif scope.retire_at is None:
                scope.retire_at = now + RETIRE_AFTER
                asyncio.get_running_loop().call_later(RETIRE_AFTER + 0.5, self.retire_idle)
            elif scope.retire_at <= now:
                del self.active[where]
                self.cache.drop_children(where)
                asyncio.get_running_loop().create_task(scope.stop())

    async def close(self) -> None:
        scopes, self.active = list(self.active.values()), {}
        await asyncio.gather(*(scope.stop() for scope in scopes))
