"""Lost nodes: which nodes stopped answering, and what becomes of a job's pods on them.

A pod on a node that stops answering (powered off, partitioned, its kubelet dead) stays ``Running`` in the API
until the node lifecycle controller acts (``Ready=Unknown`` after ``node-monitor-grace-period``, then an eviction
after the pods' 300 s ``tolerationSeconds``), and even then stays ``Terminating`` until the kubelet it cannot reach
confirms. A pod with the job's deterministic name (``<job>-<type>-<index>``) cannot be made again while it is
there, so the operator replaces such pods itself:

* a node is *lost* when its ``Ready`` condition is ``Unknown``, when it carries the
  ``node.kubernetes.io/unreachable`` taint, when its Node object is gone, when its Lease in ``kube-node-lease``
  was not renewed for ``lost_after`` seconds while other nodes' were (the kubelet renews it every ~10 s; the
  times are the operator's own clock of when it saw the renewals, so clocks need not agree, and the newest
  renewal seen of any node is the reference, so a lagging or stalled operator does not call every node lost),
  or when it is ``Ready=False`` (or tainted ``not-ready``) for ``lost_after`` seconds;
* a live pod of the job on a lost node is shown to the planner as deleted (``deletionTimestamp`` set), so the
  planner's rules for a pod deleted by someone else apply: a parameter server means a chief restart from the
  latest checkpoint, a chief a chief restart, a worker a new worker, all recreated once gone, whatever the
  restart policy (as after an eviction);
* every pod of the job on a lost node that is (or is now taken as) being deleted is force-deleted (grace period
  0, its UID a precondition): :class:`~.actions.ForceDeletePod`;
* a pod made while nodes are lost gets a required node affinity that keeps it off them
  (:func:`keep_off`): a node whose Lease went stale still reads ``Ready`` for the scheduler until the node
  controller marks it (~50 s), and a replacement bound there would be lost again at once;
* when *every* known node is lost at once (:func:`all_lost`), nothing is decided on that basis (only a node
  whose Node object is gone still counts): as the node lifecycle controller stops evicting in a full disruption,
  the operator takes it that its own view is what failed (its watches lag, the API server is overloaded or cut
  off), and replacing pods there, or keeping new ones off every node, could only leave them Pending.

Pure: no I/O, no clock (``now`` is given). The shell (:mod:`kubeps.operator.controller.nodes`) watches Nodes and
Leases, hands what it saw to the planner as :class:`NodesSeen` (the planner applies these rules, once per
reconcile) and says when to look again (:attr:`Verdict.recheck_after`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Mapping, Sequence

from .actions import Action, CreatePod, Event, ForceDeletePod
from .observed import fmt_time, parse_time

TAINT_UNREACHABLE = "node.kubernetes.io/unreachable"
TAINT_NOT_READY = "node.kubernetes.io/not-ready"
#: The Event reason of a pod replaced because its node was lost.
R_NODE_LOST = "NodeLost"


@dataclass(frozen=True)
class NodeState:
    """What the operator knows of one node."""

    name: str
    #: The ``Ready`` condition's status (``True``, ``False``, ``Unknown``), None when it has none yet.
    ready: str | None = None
    #: When the ``Ready`` condition last changed (the node controller's or kubelet's clock).
    ready_since: datetime | None = None
    unreachable: bool = False  # tainted node.kubernetes.io/unreachable
    not_ready: bool = False  # tainted node.kubernetes.io/not-ready
    #: When the operator saw the node's Lease renewed (its own clock), None when it has seen no Lease.
    lease_seen: datetime | None = None


@dataclass(frozen=True)
class NodesSeen:
    """What the shell knows of the nodes at one reconcile, for the rules above."""

    #: The known nodes by name; None when the operator does not know them (not watched, or not listed yet):
    #: nothing is decided then.
    states: Mapping[str, NodeState] | None = None
    #: Seconds of a stale Lease or of ``Ready=False`` after which a node is lost (0: the node controller decides).
    lost_after: float = 0.0
    #: When the operator last saw any node's Lease renewed (:func:`assess`).
    leases_until: datetime | None = None
    #: The UIDs of the pods the shell force-deleted already: their NodeLost Event was posted.
    force_deleted: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Verdict:
    lost: bool
    why: str = ""
    #: Seconds after which the verdict may change with nothing else observed (a lease going stale), or None.
    recheck_after: float | None = None


def node_state(node: Mapping[str, Any]) -> NodeState:
    """A Node object's facts (any field may be missing); :attr:`NodeState.lease_seen` is the shell's to add."""
    meta = node.get("metadata") or {}
    ready, since = None, None
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            ready = cond.get("status")
            try:
                since = parse_time(cond.get("lastTransitionTime"))
            except (TypeError, ValueError):
                since = None
    taints = {t.get("key") for t in (node.get("spec") or {}).get("taints") or []}
    return NodeState(name=meta.get("name", ""), ready=ready, ready_since=since,
                     unreachable=TAINT_UNREACHABLE in taints, not_ready=TAINT_NOT_READY in taints)


def assess(state: NodeState | None, now: datetime, lost_after: float,
           leases_until: datetime | None = None) -> Verdict:
    """Whether a node is lost; ``state`` None: the node (named by a pod) no longer exists. ``lost_after`` 0 turns
    the time-based rules (stale Lease, long ``Ready=False``) off, leaving the node controller's verdict.

    ``leases_until``: when the operator last saw any node's Lease renewed. A Lease is stale when it was not
    renewed for ``lost_after`` seconds before that moment plus ``lost_after / 2`` (or before ``now``, if
    sooner): in a healthy cluster some kubelet renews every few seconds, so the reference follows the clock, but
    an operator whose watch lags or that was stalled (CPU-throttled, paused) sees no renewal at all for a while,
    and that must not make every node look lost. With one node the Lease rule never fires: the node
    controller's verdict decides."""
    if state is None:
        return Verdict(True, "no longer exists")
    if state.ready == "Unknown":
        return Verdict(True, f"stopped posting its status (Ready=Unknown since "
                             f"{fmt_time(state.ready_since) if state.ready_since else 'unknown'})")
    if state.unreachable:
        return Verdict(True, f"is tainted {TAINT_UNREACHABLE}")
    recheck: float | None = None
    if lost_after > 0 and state.lease_seen is not None:
        until = now if leases_until is None else min(now, leases_until + timedelta(seconds=lost_after / 2))
        stale = (until - state.lease_seen).total_seconds()
        if stale >= lost_after:
            return Verdict(True, f"did not renew its Lease for {stale:.0f} s while other nodes did (lost after "
                                 f"{lost_after:g} s)")
        # (looked at again no sooner than a tenth of lost_after: while no renewal is seen at all, `until` stands)
        recheck = max(lost_after - stale, lost_after / 10)
    if lost_after > 0 and (state.ready == "False" or state.not_ready):
        since = state.ready_since or now
        down = (now - since).total_seconds()
        if down >= lost_after:
            return Verdict(True, f"is not ready for {down:.0f} s (lost after {lost_after:g} s)")
        recheck = min(recheck if recheck is not None else lost_after, lost_after - down)
    return Verdict(False, recheck_after=recheck)


@dataclass
class NodeLoss:
    """What :func:`replace_lost_pods` decided: the pods as the planner is to see them, and what to do."""

    pods: list[Mapping[str, Any]]
    deletes: list[ForceDeletePod] = field(default_factory=list)
    #: a Warning Event per pod newly taken as deleted, by the pod's UID (the shell posts it once per UID)
    events: dict[str | None, Event] = field(default_factory=dict)
    #: node name -> why it is lost, for the nodes of the job's pods that are
    lost: dict[str, str] = field(default_factory=dict)


def replace_lost_pods(pods: Sequence[Mapping[str, Any]], nodes: Mapping[str, NodeState] | None, now: datetime,
                      lost_after: float, leases_until: datetime | None = None) -> NodeLoss:
    """The job's pods with those on lost nodes taken as deleted, and their force deletes. ``nodes`` None: the
    operator does not know the nodes (not watched, or not listed yet): nothing is decided."""
    loss = NodeLoss(pods=list(pods))
    if nodes is None:
        return loss
    if all_lost(nodes, now, lost_after, leases_until):
        nodes = _none_lost(nodes)
    shown: list[Mapping[str, Any]] = []
    fine: set[str] = set()  # nodes found not lost: each node is assessed once, not once per pod on it
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        if not node or node in fine:
            shown.append(pod)
            continue
        if node not in loss.lost:
            verdict = assess(nodes.get(node), now, lost_after, leases_until)
            if not verdict.lost:
                fine.add(node)
                shown.append(pod)
                continue
            loss.lost[node] = verdict.why
        meta = pod.get("metadata") or {}
        phase = (pod.get("status") or {}).get("phase")
        terminating = bool(meta.get("deletionTimestamp"))
        if not terminating and phase in ("Succeeded", "Failed"):
            shown.append(pod)  # finished: the planner decides; a delete of it comes back here, terminating
            continue
        name = meta.get("name", "")
        if not terminating:
            pod = copy.deepcopy(dict(pod))
            pod["metadata"]["deletionTimestamp"] = fmt_time(now)
            message = (f"Pod {name} runs on node {node}, which {loss.lost[node]}: deleting it at once (grace "
                       f"period 0) to replace it")
            loss.events[meta.get("uid")] = Event("Warning", R_NODE_LOST, message)
        loss.deletes.append(ForceDeletePod(name, meta.get("uid"), node, f"node {node} {loss.lost[node]}"))
        shown.append(pod)
    loss.pods = shown
    return loss


def all_lost(nodes: Mapping[str, NodeState] | None, now: datetime, lost_after: float,
             leases_until: datetime | None = None) -> bool:
    """Whether every known node (one at least) is lost now: a full disruption, in which no node counts as lost
    but one whose Node object is gone."""
    return nodes is not None and len(nodes) > 0 and all(assess(state, now, lost_after, leases_until).lost
                                                        for state in nodes.values())


def _none_lost(nodes: Mapping[str, NodeState]) -> dict[str, NodeState]:
    """The nodes as healthy ones: Ready, untainted, their Leases not watched."""
    return {name: NodeState(name=name, ready="True") for name in nodes}


def lost_nodes(nodes: Mapping[str, NodeState] | None, now: datetime, lost_after: float,
               leases_until: datetime | None = None) -> list[str]:
    """The names of the known nodes that are lost now (sorted); none in a full disruption (:func:`all_lost`)."""
    if nodes is None or all_lost(nodes, now, lost_after, leases_until):
        return []
    return sorted(name for name, state in nodes.items() if assess(state, now, lost_after, leases_until).lost)


def keep_off(actions: list[Action], lost: Sequence[str]) -> list[Action]:
    """The actions with every pod to create kept off the ``lost`` nodes: ``metadata.name NotIn lost`` added to each
    of its template's required node selector terms (terms are ORed, a term's requirements ANDed), or one term of
    its own when the template has none."""
    if not lost:
        return actions
    requirement = {"key": "metadata.name", "operator": "NotIn", "values": list(lost)}
    out: list[Action] = []
    for action in actions:
        if isinstance(action, CreatePod):
            body = copy.deepcopy(action.body)
            spec = body.setdefault("spec", {})
            node_affinity = spec.setdefault("affinity", {}).setdefault("nodeAffinity", {})
            required = node_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
            terms = required.get("nodeSelectorTerms") or [{}]
            for term in terms:
                term["matchFields"] = [*(term.get("matchFields") or []), requirement]
            required["nodeSelectorTerms"] = terms
            action = replace(action, body=body)
        out.append(action)
    return out
