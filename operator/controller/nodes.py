"""The nodes the operator watches, so that it can replace the pods of a lost node (:mod:`kubeps.operator.core.nodes`
decides what is lost and what to do; this is the I/O).

One cluster-wide list-then-watch of Nodes and one of the Leases in ``kube-node-lease`` (the kubelet renews its
node's every ~10 s), started with the operator when ``node_lost_after`` is not negative. Each Lease renewal is
stamped with the operator's own clock when it is seen (as the node lifecycle controller does), and a timer per node
fires when its verdict may change with nothing else seen (a Lease going stale): ``on_change(node)`` then reconciles
the jobs with pods there. Node events that change the verdict call it too.

Rights: get/list/watch on ``nodes`` (cluster-scoped) and on ``leases`` in ``kube-node-lease``; the chart grants
them in both of its modes (``nodeLoss.watch``). Without them the lists fail (logged, retried) and :meth:`NodeWatch.view`
stays None: pods on lost nodes are then replaced only when the node controller deletes them and the API server
lets them go.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any, Callable

from kubeps.operator.core.nodes import NodeState, all_lost, assess, lost_nodes, node_state
from kubeps.operator.kube.client import KubeClient
from kubeps.operator.kube.watch import Timeouts, Watcher

from .cache import Body

log = logging.getLogger("kubeps.operator.nodes")

LEASES = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"


class NodeWatch:
    """The known nodes (:meth:`view`), kept by two watches; ``on_change(node name)`` when a node's verdict may
    have changed."""

    def __init__(self, kube: KubeClient, lost_after: float, timeouts: Timeouts, on_change: Callable[[str], Any],
                 clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc)):
        self.lost_after = lost_after
        self.on_change = on_change
        self.clock = clock
        #: every known node, with when its Lease was last seen renewed (kept up to date, read as is: no copy)
        self.states: dict[str, NodeState] = {}
        self.renewed: dict[str, tuple[Any, datetime]] = {}  # node -> (the Lease's renewTime, when we saw it)
        #: when a renewal of any node's Lease was last seen (the reference of the Lease rule, see nodes.assess)
        self.leases_until: datetime | None = None
        self.disrupted = False  # every known node looked lost when last looked at (nodes.all_lost)
        self.timers: dict[str, asyncio.TimerHandle] = {}
        self.nodes = Watcher(kube, "/api/v1/nodes", on_list=self._nodes_listed, on_event=self._node_event,
                             **timeouts)
        self.leases = Watcher(kube, LEASES, on_list=self._leases_listed, on_event=self._lease_event, **timeouts)

    def start(self) -> "NodeWatch":
        self.nodes.start()
        self.leases.start()
        return self

    async def stop(self) -> None:
        for timer in self.timers.values():
            timer.cancel()
        self.timers.clear()
        await asyncio.gather(self.nodes.stop(), self.leases.stop())

    def view(self) -> dict[str, NodeState] | None:
        """Every known node with its Lease's renewal time (to be read, not changed), or None before the Nodes
        are listed."""
        return self.states if self.nodes.synced.is_set() else None

    def _with_lease(self, state: NodeState) -> NodeState:
        seen = self.renewed.get(state.name)
        return replace(state, lease_seen=seen[1] if seen is not None else None)

    # -- Nodes ----------------------------------------------------------------------------------------------------
    def _nodes_listed(self, items: list[Body]) -> None:
        fresh = {s.name: self._with_lease(s) for s in map(node_state, items)}
        changed = {n for n in set(fresh) | set(self.states) if fresh.get(n) != self.states.get(n)}
        self.states = fresh
        for name in changed:
            self._changed(name)

    def _node_event(self, kind: str, obj: Body) -> None:
        state = self._with_lease(node_state(obj))
        if kind == "DELETED":
            if self.states.pop(state.name, None) is not None:
                self._changed(state.name)
            return
        if self.states.get(state.name) != state:
            self.states[state.name] = state
            self._changed(state.name)

    # -- Leases ---------------------------------------------------------------------------------------------------
    def _leases_listed(self, items: list[Body]) -> None:
        for item in items:
            self._lease_event("ADDED", item)

    def _lease_event(self, kind: str, obj: Body) -> None:
        name = (obj.get("metadata") or {}).get("name", "")
        if kind == "DELETED":
            self.renewed.pop(name, None)
            return
        renew = (obj.get("spec") or {}).get("renewTime")
        known = self.renewed.get(name)
        if known is not None and known[0] == renew:
            return
        seen = self.clock()
        self.renewed[name] = (renew, seen)
        self.leases_until = seen if self.leases_until is None else max(self.leases_until, seen)
        if name in self.states:
            self.states[name] = self._with_lease(self.states[name])
        self._schedule(name)
        if self.disrupted:  # (only then: a look at every node per renewal would cost a big cluster dearly)
            self._note_disruption()

    # -- timers ---------------------------------------------------------------------------------------------------
    def _changed(self, name: str) -> None:
        self._note_disruption()
        self.on_change(name)
        self._schedule(name)

    def _note_disruption(self) -> None:
        """Note when every node starts (or stops) looking lost: nothing is decided on that basis meanwhile, so when
        it stops, the jobs on the nodes still lost are reconciled (their timers ended when they were found lost)."""
        view = self.view()
        now = self.clock()
        disrupted = all_lost(view, now, self.lost_after, self.leases_until)
        if disrupted == self.disrupted:
            return
        self.disrupted = disrupted
        if disrupted:
            log.warning("all %d nodes look lost: the operator takes it that its own view of them failed and "
                        "replaces no pod until one is seen healthy again", len(view or ()))
            return
        lost = lost_nodes(view, now, self.lost_after, self.leases_until)
        log.info("not every node looks lost any more: acting on the %d lost ones", len(lost))
        for name in lost:
            self.on_change(name)

    def _schedule(self, name: str) -> None:
        """Look at the node again when its verdict may change with nothing else seen."""
        old = self.timers.pop(name, None)
        if old is not None:
            old.cancel()
        view = self.view()
        if view is None:
            return
        verdict = assess(view.get(name), self.clock(), self.lost_after, self.leases_until)
        if verdict.recheck_after is not None:
            self.timers[name] = asyncio.get_running_loop().call_later(verdict.recheck_after + 0.2, self._fire, name)

    def _fire(self, name: str) -> None:
        """The node's verdict may have changed with nothing seen: its jobs are reconciled if it is lost now."""
        self.timers.pop(name, None)
        view = self.view()
        if view is not None and assess(view.get(name), self.clock(), self.lost_after, self.leases_until).lost:
            self._changed(name)
        else:
            self._schedule(name)
