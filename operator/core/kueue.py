"""Kueue admission for a ``PSTrainingJob``: the Workload protocol of Kueue's job framework, spoken from Python.

Kueue's integrations for Job-like resources are a Go library (``pkg/controller/jobframework``); a kopf operator
speaks the protocol it implements directly, over the public ``kueue.x-k8s.io/v1beta2`` Workload API:

* A job labelled ``kueue.x-k8s.io/queue-name`` (on an operator with Kueue on) is *queued*: it gets one Workload,
  owned by the job (controller ownerRef), with one podSet per role (chief, ps, worker, evaluator) carrying the role's
  pod template and count, and no pod runs until the Workload is ``Admitted``.
* Admitted: the pods get the admitted flavors' ``nodeLabels`` (as nodeSelector) and ``tolerations``, the label
  ``kueue.x-k8s.io/podset`` and every ``podSetUpdates`` entry of the admission checks (labels, annotations,
  nodeSelector, tolerations).
* The operator writes ``PodsReady`` (Kueue's ``waitForPodsReady`` evicts a workload without it) and, once the job has
  ended, ``Finished`` (``Succeeded``/``Failed``), by server-side apply on ``workloads/status``.
* ``Evicted`` (preemption, PodsReadyTimeout, a stopped queue, deactivation): the job's pods are deleted and, once none
  is left, the operator clears the admission itself (``QuotaReserved=False``, ``Requeued``), as Kueue's job
  framework does. Re-admitted, the pods start again: a chief resumes from its latest checkpoint as after any restart.
* ``runPolicy.suspend`` deactivates the Workload (``spec.active: false``: Kueue evicts it and frees its quota); a
  queue-name change while not admitted moves the Workload; a change of the podSets (Worker replicas) while admitted
  deletes the Workload, which is made again and queued anew (Kueue's own rule for a Job whose parallelism changes).

Pure: the planner (its :mod:`.timeline` rules) calls :class:`Queueing` with what the shell observed
(:class:`QueueView`); the actions it returns are carried out by :mod:`kubeps.operator.controller.control`.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from kubeps.operator.api import models
from kubeps.operator.api.models import PSTrainingJobSpec, ReplicaType

from .actions import ApplyWorkloadStatus, CreateWorkload, DeleteWorkload, PatchWorkload
from .children import LABEL_JOB, owner_reference

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
API_VERSION = f"{GROUP}/{VERSION}"
#: on the job: the LocalQueue it waits in
LABEL_QUEUE = "kueue.x-k8s.io/queue-name"
#: on the job: a WorkloadPriorityClass
LABEL_PRIORITY_CLASS = "kueue.x-k8s.io/priority-class"
#: on the Workload: the job's UID, as Kueue's own integrations label theirs
LABEL_JOB_UID = "kueue.x-k8s.io/job-uid"
#: on every pod of an admitted job: its podSet
LABEL_PODSET = "kueue.x-k8s.io/podset"
#: the field manager Kueue itself writes admission status with (its scheduler and job framework alike)
FIELD_MANAGER = "kueue-admission"

#: Workload conditions.
QUOTA_RESERVED, ADMITTED, EVICTED, FINISHED, PODS_READY, REQUEUED = (
    "QuotaReserved", "Admitted", "Evicted", "Finished", "PodsReady", "Requeued")
#: The conditions Kueue's admission status patch carries (``patching.admissionManagedConditions``).
_ADMISSION_CONDITIONS = (QUOTA_RESERVED, "BlockedOnPreemptionGates", EVICTED, ADMITTED, "Preempted", REQUEUED,
                         "DeactivationTarget", FINISHED, PODS_READY)
#: Eviction reasons after which Kueue's job framework marks the Workload Requeued=True.
_REQUEUE_REASONS = ("Preempted", "NodeFailures")

#: Job condition reasons while the job waits for Kueue.
R_QUEUED = "Queued"
R_EVICTED = "Evicted"


@dataclass(frozen=True)
class Priority:
    """The job's priority as Kueue reads it: a WorkloadPriorityClass (job label) or a PriorityClass (a template's
    ``priorityClassName``), resolved to its value by the shell."""

    group: str
    kind: str
    name: str
    value: int


@dataclass(frozen=True)
class QueueView:
    """What the shell observed for a queued job: its Workload (None: none yet), the ResourceFlavors its admission
    names (name -> spec) and its priority (None: none named, or not found)."""

    workload: Mapping[str, Any] | None = None
    flavors: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    priority: Priority | None = None


def queue_name(job: Mapping[str, Any]) -> str | None:
    """The LocalQueue a job asks for (its ``kueue.x-k8s.io/queue-name`` label), or None."""
    value = ((job.get("metadata") or {}).get("labels") or {}).get(LABEL_QUEUE)
    return str(value) if value else None


def workload_name(job: Mapping[str, Any]) -> str:
    """``pstrainingjob-<name>-<5 hex>``, Kueue's own naming (``workload_names.go``): the hash of kind, group, name
    and UID keeps a re-created job of the same name from adopting the old job's Workload."""
    meta = job.get("metadata") or {}
    name = str(meta.get("name", ""))
    digest = hashlib.sha1(f"{models.KIND}/{models.GROUP}/{name}/{meta.get('uid', '')}".encode()).hexdigest()[:5]
    prefix = f"{models.KIND.lower()}-{name}"[:253 - 6]
    return f"{prefix}-{digest}"


def _conditions(obj: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    status = (obj or {}).get("status") or {}
    return {str(c.get("type")): c for c in status.get("conditions") or [] if isinstance(c, Mapping)}


def _is_true(obj: Mapping[str, Any] | None, ctype: str) -> bool:
    return _conditions(obj).get(ctype, {}).get("status") == "True"


def pod_sets(spec: PSTrainingJobSpec,
              templates: Mapping[ReplicaType, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One podSet per role with replicas: its name (the task type), count, and the pod template the operator makes
    the role's pods from (``templates``: a pod body per role; Kueue reads the requests of its containers)."""
    result = []
    for rt in models.REPLICA_TYPES:
        replica_spec = spec.replicaSpecs.get(rt)
        if replica_spec is None or not replica_spec.replicas or rt not in templates:
            continue
        body = templates[rt]
        meta = body.get("metadata") or {}
        template: dict[str, Any] = {"spec": copy.deepcopy(body.get("spec") or {})}
        tmeta = {k: dict(meta[k]) for k in ("labels", "annotations") if meta.get(k)}
        if tmeta:
            template["metadata"] = tmeta
        result.append({"name": rt.task_type, "count": replica_spec.replicas, "template": template})
    return result


def workload_body(job: Mapping[str, Any], sets: list[dict[str, Any]], active: bool,
                  priority: Priority | None) -> dict[str, Any]:
    meta = job["metadata"]
    spec: dict[str, Any] = {"queueName": queue_name(job), "podSets": sets, "active": active}
    if priority is not None:
        spec["priorityClassRef"] = {"group": priority.group, "kind": priority.kind, "name": priority.name}
        spec["priority"] = priority.value
    return {
        "apiVersion": API_VERSION,
        "kind": "Workload",
        "metadata": {
            "name": workload_name(job),
            "namespace": meta["namespace"],
            "labels": {LABEL_JOB: meta["name"], LABEL_JOB_UID: str(meta.get("uid", ""))},
            "ownerReferences": [owner_reference(job)],
        },
        "spec": spec,
    }


@dataclass
class PodSetInfo:
    """What an admission adds to the pods of one podSet (Kueue's ``podset.PodSetInfo``)."""

    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)

    def apply(self, pod: dict[str, Any]) -> None:
        """Merge into a pod body (the admission's values win over the template's, as Kueue's ``podset.Merge``)."""
        meta = pod.setdefault("metadata", {})
        if self.labels:
            meta["labels"] = {**(meta.get("labels") or {}), **self.labels}
        if self.annotations:
            meta["annotations"] = {**(meta.get("annotations") or {}), **self.annotations}
        spec = pod.setdefault("spec", {})
        if self.node_selector:
            spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **self.node_selector}
        if self.tolerations:
            known = list(spec.get("tolerations") or [])
            spec["tolerations"] = known + [t for t in self.tolerations if t not in known]


def admission_info(workload: Mapping[str, Any], flavors: Mapping[str, Mapping[str, Any]]) -> dict[str, PodSetInfo]:
    """Per podSet name what the admission adds: the node labels and tolerations of its assigned flavors, the podset
    label, then every admission check's ``podSetUpdates`` for it."""
    status = workload.get("status") or {}
    infos: dict[str, PodSetInfo] = {}
    for assignment in (status.get("admission") or {}).get("podSetAssignments") or []:
        name = str(assignment.get("name"))
        info = infos.setdefault(name, PodSetInfo())
        info.labels[LABEL_PODSET] = name
        for flavor_name in sorted(set((assignment.get("flavors") or {}).values())):
            flavor = flavors.get(flavor_name) or {}
            info.node_selector.update({str(k): str(v) for k, v in (flavor.get("nodeLabels") or {}).items()})
            for toleration in flavor.get("tolerations") or []:
                if toleration not in info.tolerations:
                    info.tolerations.append(dict(toleration))
    for check in status.get("admissionChecks") or []:
        for update in check.get("podSetUpdates") or []:
            info = infos.setdefault(str(update.get("name")), PodSetInfo())
            info.labels.update({str(k): str(v) for k, v in (update.get("labels") or {}).items()})
            info.annotations.update({str(k): str(v) for k, v in (update.get("annotations") or {}).items()})
            info.node_selector.update({str(k): str(v) for k, v in (update.get("nodeSelector") or {}).items()})
            for toleration in update.get("tolerations") or []:
                if toleration not in info.tolerations:
                    info.tolerations.append(dict(toleration))
    return infos


def missing_flavors(workload: Mapping[str, Any] | None) -> list[str]:
    """The ResourceFlavors an admitted Workload names (the shell reads them before planning)."""
    names: set[str] = set()
    for assignment in (((workload or {}).get("status") or {}).get("admission") or {}).get("podSetAssignments") or []:
        names.update(str(v) for v in (assignment.get("flavors") or {}).values())
    return sorted(names)


def _condition(ctype: str, status: bool, reason: str, message: str, generation: Any, now: str) -> dict[str, Any]:
    cond = {"type": ctype, "status": "True" if status else "False", "reason": reason, "message": message[:32768],
            "lastTransitionTime": now}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def status_apply(workload: Mapping[str, Any], conditions: list[dict[str, Any]],
                 clear_admission: bool = False) -> dict[str, Any]:
    """The status Kueue's admission manager would apply for ``conditions`` set (and the admission cleared): what it
    owns of the observed status (``patching.admissionStatusPatch``), with the changes. A condition whose status is
    unchanged keeps its transition time."""
    status = dict(workload.get("status") or {})
    out: dict[str, Any] = {}
    for key in ("requeueState", "admissionChecks", "accumulatedPastExecutionTimeSeconds", "schedulingStats",
                "clusterName", "nominatedClusterNames", "unhealthyNodes", "preemptionGates"):
        if status.get(key) is not None:
            out[key] = copy.deepcopy(status[key])
    admission = None if clear_admission else status.get("admission")
    if admission is not None:
        out["admission"] = copy.deepcopy(admission)
    elif status.get("resourceRequests"):
        out["resourceRequests"] = copy.deepcopy(status["resourceRequests"])
    known = _conditions(workload)
    merged = {name: dict(known[name]) for name in _ADMISSION_CONDITIONS if name in known}
    for cond in conditions:
        old = merged.get(cond["type"])
        new = dict(cond)
        if old is not None and old.get("status") == new["status"] and old.get("lastTransitionTime"):
            new["lastTransitionTime"] = old["lastTransitionTime"]
        merged[cond["type"]] = new
    out["conditions"] = list(merged.values())
    return out


class Queueing:
    """One reconcile's view of a queued job: whether its pods may run, and what to tell Kueue.

    ``hold`` is the reason the job may not run (``(reason, message)``), or None when it is admitted; ``infos`` what
    the admission adds to each podSet's pods; ``actions`` the Workload's creation and updates."""

    def __init__(self, job: Mapping[str, Any], spec: PSTrainingJobSpec, view: QueueView,
                 templates: Callable[[], Mapping[ReplicaType, Mapping[str, Any]]], pods_left: int, now: str):
        self.job, self.spec, self.view, self.now = job, spec, view, now
        self.actions: list[Any] = []
        self.infos: dict[str, PodSetInfo] = {}
        self.hold: tuple[str, str] | None = None
        workload = view.workload
        queue = queue_name(job) or ""
        active = not spec.runPolicy.suspend
        if workload is None:
            sets = pod_sets(spec, templates())
            self.actions.append(CreateWorkload(workload_name(job), workload_body(job, sets, active, view.priority)))
            self.hold = (R_QUEUED, f"Waiting for Kueue: Workload {workload_name(job)} was created in LocalQueue "
                                   f"{queue}.")
            return
        name = str((workload.get("metadata") or {}).get("name"))
        uid = (workload.get("metadata") or {}).get("uid")
        wspec = workload.get("spec") or {}
        reserved = _is_true(workload, QUOTA_RESERVED) or bool((workload.get("status") or {}).get("admission"))
        if (workload.get("metadata") or {}).get("deletionTimestamp"):
            self.hold = (R_QUEUED, f"Workload {name} is being deleted; a new one is made once it is gone.")
            return
        if _is_true(workload, FINISHED):
            # Finished by someone else (Kueue finishes a Workload whose job cannot start): nothing more runs.
            reason = _conditions(workload)[FINISHED].get("reason") or "Finished"
            self.hold = (R_EVICTED, f"Workload {name} is finished ({reason}); delete and resubmit the job to run "
                                    f"it again.")
            return
        if self._sync_spec(name, uid, wspec, reserved, queue, active, templates):
            return
        if self._evicted(workload, name, reserved, pods_left):
            return
        if not _is_true(workload, ADMITTED):
            where = wspec.get("queueName") or queue
            if reserved:
                self.hold = (R_QUEUED, f"Waiting for the admission checks of Workload {name} (LocalQueue {where}).")
            else:
                self.hold = (R_QUEUED, f"Waiting for Kueue to admit Workload {name} (LocalQueue {where}).")
            return
        self.infos = admission_info(workload, view.flavors)

    def _sync_spec(self, name: str, uid: Any, wspec: Mapping[str, Any], reserved: bool, queue: str, active: bool,
                   templates: Callable[[], Mapping[ReplicaType, Mapping[str, Any]]]) -> bool:
        """Keep the Workload's podSets, ``active`` and queue those of the job; returns True when the job's replicas
        changed while it was admitted (the Workload is replaced, the job held)."""
        # The pod bodies are made only when the Workload is written: most reconciles compare the counts alone.
        if _pod_set_shape(wspec.get("podSets")) != _spec_shape(self.spec):
            if reserved:
                self.actions.append(DeleteWorkload(name, uid, "the job's replicas changed while it was admitted"))
                self.hold = (R_QUEUED, f"The job's replicas changed: Workload {name} is replaced and queued anew.")
                return True
            self.actions.append(PatchWorkload(name, {"spec": {"podSets": pod_sets(self.spec, templates())}}))
        patch: dict[str, Any] = {}
        if wspec.get("active", True) != active:
            patch["active"] = active
        if wspec.get("queueName") != queue and not reserved:
            patch["queueName"] = queue
        if patch:
            self.actions.append(PatchWorkload(name, {"spec": patch}))
        return False

    def _evicted(self, workload: Mapping[str, Any], name: str, reserved: bool, pods_left: int) -> bool:
        """Hold a job whose Workload Kueue evicted; once none of its pods is left, give the quota back and requeue
        (the job controller's half of an eviction). Returns whether it was evicted."""
        evicted = _conditions(workload).get(EVICTED)
        if evicted is None or evicted.get("status") != "True":
            return False
        generation, now = (workload.get("metadata") or {}).get("generation"), self.now
        why = str(evicted.get("reason") or "Evicted")
        message = str(evicted.get("message") or "")
        self.hold = (R_EVICTED, f"Kueue evicted Workload {name} ({why}): {message}".rstrip(": "))
        if reserved and pods_left == 0:
            self.actions.append(ApplyWorkloadStatus(name, status_apply(workload, [
                _condition(REQUEUED, why in _REQUEUE_REASONS, why, message, generation, now),
                _condition(QUOTA_RESERVED, False, "PendingEvaluation", message, generation, now),
                _condition(ADMITTED, False, "NoReservation", "The workload has no reservation", generation, now),
            ], clear_admission=True)))
        return True

    def pods_ready(self, ready: bool) -> ApplyWorkloadStatus | None:
        """What tells Kueue whether every pod of the admitted job is ready (its ``PodsReady`` condition), when that
        changed."""
        workload = self.view.workload
        if workload is None or self.hold is not None:
            return None
        current = _conditions(workload).get(PODS_READY)
        if ready:
            reason = "Recovered" if current is not None and current.get("reason") in ("WaitForRecovery",
                                                                                     "Recovered") else "Started"
            message = "All pods reached readiness and the workload is running"
        elif current is not None and (current.get("status") == "True" or current.get("reason") == "WaitForRecovery"):
            reason, message = "WaitForRecovery", "At least one pod has failed, waiting for recovery"
        else:
            reason, message = "WaitForStart", "Not all pods are ready or succeeded"
        status = "True" if ready else "False"
        if current is not None and current.get("status") == status and current.get("reason") == reason:
            return None
        generation = (workload.get("metadata") or {}).get("generation")
        name = str((workload.get("metadata") or {}).get("name"))
        return ApplyWorkloadStatus(name, status_apply(workload, [
            _condition(PODS_READY, ready, reason, message, generation, self.now)]))


def finish(view: QueueView, succeeded: bool, message: str, now: str) -> ApplyWorkloadStatus | None:
    """``Finished`` on the Workload of a job that has ended (once)."""
    workload = view.workload
    if workload is None or _is_true(workload, FINISHED):
        return None
    generation = (workload.get("metadata") or {}).get("generation")
    name = str((workload.get("metadata") or {}).get("name"))
    return ApplyWorkloadStatus(name, status_apply(workload, [
        _condition(FINISHED, True, "Succeeded" if succeeded else "Failed", message, generation, now)]))


def _spec_shape(spec: PSTrainingJobSpec) -> list[tuple[str, int]]:
    """The podSets' names and counts the spec asks for (what :func:`pod_sets` makes, without the templates)."""
    return [(rt.task_type, rs.replicas) for rt in models.REPLICA_TYPES
            if (rs := spec.replicaSpecs.get(rt)) is not None and rs.replicas]


def _pod_set_shape(sets: Any) -> list[tuple[str, int]]:
    """What decides whether a Workload still describes the job: its podSets' names and counts."""
    return [(str(s.get("name")), int(s.get("count", 1))) for s in sets or [] if isinstance(s, Mapping)]
