"""Gang scheduling: the job's PodGroup for the operator's backend, how a pod joins it, and when the planner asks for
it to be created or deleted.

Pure (no I/O, no clock), like the rest of :mod:`kubeps.operator.core`. The backend is the operator's setting
(``--gang-scheduler``, :class:`~kubeps.operator.api.models.GangScheduler`); the job's
``spec.runPolicy.schedulingPolicy`` says what the gang needs. As training-operator does (``SyncPodGroup``), one PodGroup
per job, named after the job, owned by it (controller ownerReference):

* ``native``: Kubernetes' own ``scheduling.k8s.io/v1alpha2`` PodGroup with ``schedulingPolicy.gang.minCount``; pods
  join with ``spec.schedulingGroup.podGroupName``. The spec is immutable: the PodGroup keeps the count it was made
  with until the job is suspended (which deletes it) and resumed.
* ``volcano``: ``scheduling.volcano.sh/v1beta1`` PodGroup (``minMember``, ``queue``, ``priorityClassName``,
  ``minResources``); pods get the ``scheduling.k8s.io/group-name`` and ``volcano.sh/task-spec`` annotations and
  ``schedulerName`` volcano where the template names none.
* ``scheduler-plugins``: ``scheduling.x-k8s.io/v1alpha1`` PodGroup (``minMember``, ``minResources``,
  ``scheduleTimeoutSeconds``); pods get the ``scheduling.x-k8s.io/pod-group`` label and the scheduler's name.

The gang is the chief, the parameter servers and the workers; the evaluator stays outside it (its pod is left as its
template says). When the planner asks: the PodGroup is created with the pods, only while the job runs (never while
``runPolicy.suspend`` is true: a job held suspended by an admission controller such as Kueue gets its gang only
once admitted), and deleted when the job is suspended or finished.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any, Mapping

from kubeps.operator.api.models import GangScheduler, PSTrainingJobSpec, ReplicaType, gang_size

from .actions import Action, CreatePodGroup, DeletePodGroup
from .children import LABEL_JOB, PlanConfig, owner_reference

API_VERSIONS = {
    GangScheduler.NATIVE: "scheduling.k8s.io/v1alpha2",
    GangScheduler.VOLCANO: "scheduling.volcano.sh/v1beta1",
    GangScheduler.SCHEDULER_PLUGINS: "scheduling.x-k8s.io/v1alpha1",
}
#: The ``schedulerName`` given to the gang's pods whose template names none (``--gang-scheduler-name`` overrides).
DEFAULT_SCHEDULER_NAMES = {
    GangScheduler.VOLCANO: "volcano",
    GangScheduler.SCHEDULER_PLUGINS: "scheduler-plugins-scheduler",
}
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
VOLCANO_TASK_ANNOTATION = "volcano.sh/task-spec"
SCHEDULER_PLUGINS_LABEL = "scheduling.x-k8s.io/pod-group"
#: The gang's roles, in the order its first minAvailable pods are counted for minResources.
GANG_ROLES = (ReplicaType.CHIEF, ReplicaType.PS, ReplicaType.WORKER)


def pod_group_name(job_name: str) -> str:
    return job_name


def scheduler_name(config: PlanConfig) -> str | None:
    """The ``schedulerName`` of the gang's pods (None: the backend is the default scheduler's own plugin)."""
    return config.gang_scheduler_name or DEFAULT_SCHEDULER_NAMES.get(config.gang_scheduler)


def min_member(spec: PSTrainingJobSpec) -> int:
    policy = spec.runPolicy.schedulingPolicy
    if policy is not None and policy.minAvailable is not None:
        return policy.minAvailable
    return gang_size(spec)


# -- quantities -----------------------------------------------------------------------------------------------
_SUFFIXES = {
    "Ki": Fraction(2**10), "Mi": Fraction(2**20), "Gi": Fraction(2**30), "Ti": Fraction(2**40),
    "Pi": Fraction(2**50), "Ei": Fraction(2**60),
    "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": Fraction(1),
    "k": Fraction(10**3), "M": Fraction(10**6), "G": Fraction(10**9), "T": Fraction(10**12),
    "P": Fraction(10**15), "E": Fraction(10**18),
}


def parse_quantity(value: Any) -> Fraction:
    """A Kubernetes quantity (``2``, ``500m``, ``1.5Gi``, ``1e3``) as an exact number; ValueError if it is none."""
    text = str(value).strip()
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if suffix and text.endswith(suffix):
            return Fraction(text[: -len(suffix)]) * _SUFFIXES[suffix]
    return Fraction(text)  # plain or with an exponent (Fraction reads "1e3")


def format_quantity(value: Fraction) -> str:
    """A quantity the API server reads back as ``value``: whole units, else milli-units, else nano-units (rounded up)."""
    if value.denominator == 1:
        return str(value.numerator)
    milli = value * 1000
    if milli.denominator == 1:
        return f"{milli.numerator}m"
    nano = value * 10**9
    return f"{-(-nano.numerator // nano.denominator)}n"


def _pod_resources(template: Mapping[str, Any]) -> dict[str, Fraction]:
    """The summed requests of a template's containers (a limit where a request is unset, as Kubernetes defaults it)."""
    total: dict[str, Fraction] = {}
    for container in (template.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        requests = dict(resources.get("limits") or {})
        requests.update(resources.get("requests") or {})
        for name, quantity in requests.items():
            total[name] = total.get(name, Fraction(0)) + parse_quantity(quantity)
    return total


def min_resources(job: Mapping[str, Any], spec: PSTrainingJobSpec) -> dict[str, Any] | None:
    """The PodGroup's minResources: the spec's, else the summed requests of the first minAvailable pods of the gang
    (Chief, then PS, then Worker), as training-operator's ``CalcPGMinResources`` sums them; None when they ask for
    nothing."""
    policy = spec.runPolicy.schedulingPolicy
    if policy is not None and policy.minResources is not None:
        return dict(policy.minResources)
    left = min_member(spec)
    total: dict[str, Fraction] = {}
    for rt in GANG_ROLES:
        replicas = spec.replicaSpecs.get(rt)
        count = min(left, replicas.replicas if replicas is not None else 0)
        left -= count
        if count <= 0:
            continue
        for name, quantity in _pod_resources(job["spec"]["replicaSpecs"][rt.value].get("template") or {}).items():
            total[name] = total.get(name, Fraction(0)) + quantity * count
    return {name: format_quantity(value) for name, value in sorted(total.items())} or None


# -- bodies ---------------------------------------------------------------------------------------------------
def pod_group_body(job: Mapping[str, Any], spec: PSTrainingJobSpec, config: PlanConfig) -> dict[str, Any]:
    """The job's PodGroup for the operator's backend."""
    backend = config.gang_scheduler
    name = job["metadata"]["name"]
    policy = spec.runPolicy.schedulingPolicy
    body: dict[str, Any] = {
        "apiVersion": API_VERSIONS[backend],
        "kind": "PodGroup",
        "metadata": {
            "name": pod_group_name(name),
            "namespace": job["metadata"]["namespace"],
            "labels": {LABEL_JOB: name},
            "ownerReferences": [owner_reference(job)],
        },
    }
    if backend is GangScheduler.NATIVE:
        body["spec"] = {"schedulingPolicy": {"gang": {"minCount": min_member(spec)}}}
        return body
    group_spec: dict[str, Any] = {"minMember": min_member(spec)}
    resources = min_resources(job, spec)
    if resources:
        group_spec["minResources"] = resources
    if backend is GangScheduler.VOLCANO:
        if policy is not None and policy.queue:
            group_spec["queue"] = policy.queue
        if policy is not None and policy.priorityClass:
            group_spec["priorityClassName"] = policy.priorityClass
    elif policy is not None and policy.scheduleTimeoutSeconds is not None:
        group_spec["scheduleTimeoutSeconds"] = policy.scheduleTimeoutSeconds
    body["spec"] = group_spec
    return body


def join(pod: dict[str, Any], spec: PSTrainingJobSpec, replica_type: ReplicaType, config: PlanConfig) -> None:
    """Make a pod body of the job a member of its gang (the evaluator is left as it is)."""
    backend = config.gang_scheduler
    if backend is GangScheduler.NONE or replica_type not in GANG_ROLES:
        return
    group = pod_group_name(pod["metadata"]["labels"][LABEL_JOB])
    pod_spec = pod["spec"]
    policy = spec.runPolicy.schedulingPolicy
    if backend is GangScheduler.NATIVE:
        pod_spec["schedulingGroup"] = {"podGroupName": group}
    elif backend is GangScheduler.VOLCANO:
        annotations = pod["metadata"].setdefault("annotations", {})
        annotations[VOLCANO_GROUP_ANNOTATION] = group
        annotations[VOLCANO_TASK_ANNOTATION] = replica_type.task_type
    else:
        pod["metadata"]["labels"][SCHEDULER_PLUGINS_LABEL] = group
    name = scheduler_name(config)
    if name and not pod_spec.get("schedulerName"):
        pod_spec["schedulerName"] = name
    if (backend is not GangScheduler.VOLCANO and policy is not None and policy.priorityClass
            and not pod_spec.get("priorityClassName")):
        pod_spec["priorityClassName"] = policy.priorityClass


# -- when -----------------------------------------------------------------------------------------------------
def pod_group_actions(job: Mapping[str, Any], spec: PSTrainingJobSpec | None, config: PlanConfig, present: bool, *,
                      stopped: str | None, creating_pods: bool) -> list[Action]:
    """What the plan asks of the job's PodGroup: created with the pods of a running job, deleted once the job stops
    (``stopped`` says why: suspended, finished; None while it runs). ``present``: the shell saw the job's own
    PodGroup."""
    if config.gang_scheduler is GangScheduler.NONE:
        return []
    name = pod_group_name(job["metadata"]["name"])
    if stopped is not None:
        return [DeletePodGroup(name, API_VERSIONS[config.gang_scheduler], stopped)] if present else []
    if creating_pods and not present and spec is not None:
        return [CreatePodGroup(name, pod_group_body(job, spec, config))]
    return []
