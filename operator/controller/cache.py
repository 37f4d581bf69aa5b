"""What the operator knows of the cluster between reconciles: the latest body of every job, slim copies of their
pods and Services, and whose token Secrets are known to exist (Kubeflow's informer caches, kept by hand).

* Jobs come from kopf's event handler (:meth:`Cache.store_job`); an event older than what the operator's own
  status write returned is ignored.
* Pods and Services come from the scopes' watches (:mod:`.scope`): a full list replaces what was known in the
  scope (:meth:`Cache.children_listed`: what is missing was deleted while the watch was away), each event updates
  one copy (:meth:`Cache.child_event`). A copy keeps only what the planner reads (:func:`_slim`) and the node a
  pod is bound to (for :mod:`kubeps.operator.core.nodes`), so a change that neither can see triggers no
  reconcile.

Plain dicts, no I/O: the methods say which jobs' children changed; the reconciler decides what to do about it.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from kubeps.runtime.cluster import Membership

from kubeps.operator.core.children import ANNOTATION_EPOCH, ANNOTATION_MEMBERSHIP, LABEL_JOB
from kubeps.operator.core.observed import STUCK_REASONS

Key = tuple[str, str]  # (namespace, job name)
Body = dict[str, Any]  # an object as the API server returns it: JSON, read with .get() (values typed Any below)


class Cache:
    """The jobs by key; their children's slim copies by job key, then UID; the uid of each job whose Secret is
    known to exist."""

    def __init__(self) -> None:
        self.jobs: dict[Key, Body] = {}
        self.pods: dict[Key, dict[str, Body]] = {}
        self.services: dict[Key, dict[str, Body]] = {}
        self.secrets: dict[Key, str | None] = {}  # job key -> uid of the job whose Secret is known to exist
        #: job key -> the Secret's annotations the planner reads (how many Workers its certificate names)
        self.secret_annotations: dict[Key, dict[str, str]] = {}
        #: jobs whose NetworkPolicy is known to exist (NetworkPolicies are not watched)
        self.network_policies: set[Key] = set()
        #: job key -> (uid of the job, the membership document its ConfigMap holds, None: none), once read or
        #: written (the operator is the ConfigMap's only writer: it is not watched)
        self.memberships: dict[Key, tuple[str | None, Membership | None]] = {}
        #: Kueue's Workloads of queued jobs, by job key (whole bodies: the planner reads their status and podSets)
        self.workloads: dict[Key, Body] = {}
        #: job key -> (uid of the job, whether its own PodGroup exists), once read or made (PodGroups are not watched)
        self.pod_groups: dict[Key, tuple[str | None, bool]] = {}
        #: job key -> whether its PodDisruptionBudget is known to exist (not watched either)
        self.disruption_budgets: dict[Key, bool] = {}
        #: UIDs of pods force-deleted (lost nodes) whose DELETED event has not come yet: their NodeLost Event is
        #: posted once
        self.force_deleted: set[str] = set()

    # -- jobs ---------------------------------------------------------------------------------------------------
    def store_job(self, key: Key, body: Body) -> bool:
        """Keep a job's latest body; False (and nothing kept) for an event older than the body known."""
        meta = body.get("metadata") or {}
        current = self.jobs.get(key)
        if current is not None and (current.get("metadata") or {}).get("uid") == meta.get("uid"):
            old, new = _rv(current), _rv(body)
            if old is not None and new is not None and new < old:
                return False  # an event older than what our own write returned
        self.jobs[key] = body
        return True

    def forget_job(self, key: Key) -> None:
        self.jobs.pop(key, None)
        self.secrets.pop(key, None)
        self.secret_annotations.pop(key, None)
        self.network_policies.discard(key)
        self.memberships.pop(key, None)
        self.pod_groups.pop(key, None)
        self.disruption_budgets.pop(key, None)

    def has_job(self, key: Key) -> bool:
        return key in self.jobs

    def jobs_within(self, where: str | None) -> list[Key]:
        """The known jobs of the scope ``where`` (a namespace, or None: the whole cluster)."""
        return [key for key in self.jobs if within(where, key)]

    def children(self, key: Key) -> tuple[list[Body], list[Body]]:
        """The slim copies of a job's pods and Services (private copies that the planner only reads)."""
        return list(self.pods.get(key, {}).values()), list(self.services.get(key, {}).values())

    # -- children -----------------------------------------------------------------------------------------------
    def child_event(self, is_pod: bool, kind: str, obj: Body) -> Key | None:
        """A watch event of a labelled pod or Service: keep its slim copy (or forget it); returns its job's key
        when the planner would see something new, else None."""
        meta = obj.get("metadata") or {}
        key = child_key(meta)
        store = self.pods if is_pod else self.services
        known = store.get(key)
        uid: Any = meta.get("uid")
        if kind == "DELETED":
            self.force_deleted.discard(uid)
            if known is None or known.pop(uid, None) is None:
                return None
            if not known:
                del store[key]
        else:
            slim = _slim(obj, with_status=is_pod)
            if known is None:
                known = store[key] = {}
            elif known.get(uid) == slim:
                return None
            known[uid] = slim
        return key

    def children_listed(self, where: str | None, is_pod: bool, items: Iterable[Body]) -> list[Key]:
        """A scope's full list of labelled pods or Services: replace what was known there; returns the keys of the
        jobs whose children changed."""
        fresh: dict[Key, dict[str, Body]] = {}
        for obj in items:
            meta = obj.get("metadata") or {}
            uid: Any = meta.get("uid")
            fresh.setdefault(child_key(meta), {})[uid] = _slim(obj, with_status=is_pod)
        store = self.pods if is_pod else self.services
        changed = []
        for key in {k for k in store if within(where, k)} | set(fresh):
            if store.get(key) == fresh.get(key):
                continue
            if key in fresh:
                store[key] = fresh[key]
            else:
                del store[key]
            changed.append(key)
        return changed

    def jobs_on_node(self, node: str) -> list[Key]:
        """The known jobs with a pod bound to ``node``."""
        return [key for key, pods in self.pods.items() if key in self.jobs
                and any((p.get("spec") or {}).get("nodeName") == node for p in pods.values())]

    def drop_children(self, where: str | None) -> None:
        """Forget the children of a scope whose watches stopped."""
        for store in (self.pods, self.services, self.workloads):
            for key in [k for k in store if within(where, k)]:
                del store[key]

    # -- Kueue's Workloads ---------------------------------------------------------------------------------------
    def workload_event(self, kind: str, obj: Body) -> Key | None:
        """A watch event of a labelled Workload; returns its job's key when it changed."""
        key = child_key(obj.get("metadata") or {})
        if kind == "DELETED":
            known = self.workloads.get(key)
            if known is None or (known.get("metadata") or {}).get("uid") != (obj.get("metadata") or {}).get("uid"):
                return None
            del self.workloads[key]
            return key
        if self.workloads.get(key) == obj:
            return None
        self.workloads[key] = obj
        return key

    def workloads_listed(self, where: str | None, items: Iterable[Body]) -> list[Key]:
        """A scope's full list of labelled Workloads: replace what was known there; the keys whose changed."""
        fresh = {child_key(obj.get("metadata") or {}): obj for obj in items}
        changed = []
        for key in {k for k in self.workloads if within(where, k)} | set(fresh):
            if self.workloads.get(key) == fresh.get(key):
                continue
            if key in fresh:
                self.workloads[key] = fresh[key]
            else:
                del self.workloads[key]
            changed.append(key)
        return changed


def job_key(body: Mapping[str, Any]) -> Key:
    meta = body.get("metadata") or {}
    namespace: Any = meta.get("namespace")
    name: Any = meta.get("name")
    return namespace, name


def child_key(meta: Mapping[str, Any]) -> Key:
    """The job a labelled pod or Service belongs to."""
    namespace: Any = meta.get("namespace")
    job: Any = (meta.get("labels") or {}).get(LABEL_JOB)
    return namespace, job


def within(where: str | None, key: Key) -> bool:
    """Whether the job ``key`` is in the scope ``where`` (a namespace, or None: the whole cluster)."""
    return where is None or key[0] == where


def _rv(obj: Mapping[str, Any]) -> int | None:
    version: Any = (obj.get("metadata") or {}).get("resourceVersion")
    try:
        return int(version)
    except (TypeError, ValueError):
        return None


def _slim(body: Mapping[str, Any], with_status: bool) -> Body:
    """Only what the planner reads of a child (keeps the operator small with thousands of pods)."""
    meta = body.get("metadata") or {}
    # Copies one level deep are enough: every event is a new body parsed from the watch stream.
    slim_meta = {key: meta[key] for key in ("name", "namespace", "uid", "deletionTimestamp") if key in meta}
    if "labels" in meta:
        slim_meta["labels"] = dict(meta["labels"])
    if "ownerReferences" in meta:
        slim_meta["ownerReferences"] = [dict(ref) for ref in meta["ownerReferences"]]
    kept = {k: v for k, v in (meta.get("annotations") or {}).items() if k in (ANNOTATION_EPOCH, ANNOTATION_MEMBERSHIP)}
    if kept:
        slim_meta["annotations"] = kept
    slim: Body = {"metadata": slim_meta}
    node = (body.get("spec") or {}).get("nodeName")
    if node:
        slim["spec"] = {"nodeName": node}
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


def _slim_container(status: Mapping[str, Any]) -> Body:
    state = status.get("state") or {}
    terminated = state.get("terminated")
    slim_state: Body = {}
    slim = {"name": status.get("name"), "restartCount": status.get("restartCount", 0), "state": slim_state}
    if terminated is not None:
        slim_state["terminated"] = {"exitCode": terminated.get("exitCode"), "reason": terminated.get("reason"),
                                    "finishedAt": terminated.get("finishedAt")}
    waiting = state.get("waiting") or {}
    if waiting.get("reason") in STUCK_REASONS:  # not the usual ContainerCreating: no reconcile for those
        slim_state["waiting"] = {"reason": waiting["reason"], "message": waiting.get("message")}
    return slim
