"""The job's PodDisruptionBudget (``spec.runPolicy.podDisruptionBudget``): what keeps a drain from evicting its
chief and parameter servers.

An eviction (``kubectl drain``, the cluster autoscaler, a node upgrade) of a parameter server costs the whole job a
restart from its latest checkpoint, of the chief a chief restart; a worker's costs only that worker. With
``ChiefAndPS`` the job gets one PodDisruptionBudget, ``<job>-chief-ps``, over its chief and parameter server pods
with ``minAvailable`` all of them (an integer: ``maxUnavailable`` would need a scale subresource on the pods'
controller, which the disruption controller looks for and a PSTrainingJob does not have): the Eviction API refuses to evict them (a drain waits and retries) until the job has
finished, when the budget is deleted; it is owned by the job, so deleting the job deletes it too. A node that is
lost is not a disruption a budget can refuse (:mod:`.nodes`).

Pure: the body and whether the job wants one; the shell creates and deletes it.
"""

from __future__ import annotations

from typing import Any, Mapping

from kubeps.operator.api import models
from kubeps.operator.api.models import DisruptionBudgetPolicy, ReplicaType, SpecError

from .children import LABEL_JOB, LABEL_ROLE, owner_reference

#: The roles (pod label ``kubeps.dev/job-role``) the budget covers.
PROTECTED_ROLES = (ReplicaType.CHIEF.task_type, ReplicaType.PS.task_type)


def pdb_name(job_name: str) -> str:
    return f"{job_name}-chief-ps"


def wanted(job: Mapping[str, Any], terminal: bool) -> bool | None:
    """Whether the job should have its budget now: True while it asks for one and runs, False once it finished
    (or is being deleted), None when it does not ask for one (a spec that does not parse asks for none)."""
    try:
        spec = models.parse_spec(job.get("spec"))
    except SpecError:
        return None
    if spec.runPolicy.podDisruptionBudget is not DisruptionBudgetPolicy.CHIEF_AND_PS:
        return None
    return not (terminal or (job.get("metadata") or {}).get("deletionTimestamp"))


def pdb_body(job: Mapping[str, Any]) -> dict[str, Any]:
    """A budget that allows no voluntary disruption of the job's chief and parameter servers (of a job whose spec
    parses)."""
    meta = job["metadata"]
    spec = models.parse_spec(job.get("spec"))
    protected = sum(rs.replicas for rt in (ReplicaType.CHIEF, ReplicaType.PS)
                    if (rs := spec.replicaSpecs.get(rt)) is not None)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": pdb_name(meta["name"]), "namespace": meta["namespace"],
                     "labels": {LABEL_JOB: meta["name"]}, "ownerReferences": [owner_reference(job)]},
        "spec": {
            "minAvailable": protected,
            "selector": {"matchLabels": {LABEL_JOB: meta["name"]},
                         "matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": list(PROTECTED_ROLES)}]},
        },
    }
