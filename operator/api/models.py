"""The PSTrainingJob API (``kubeps.dev/v1alpha1``) as pydantic models.

These models are the source of truth: the CRD's OpenAPI schema, defaults and CEL rules are generated from them
(:mod:`kubeps.operator.api.crd`), and the planner parses every observed job with them. Field names are the API's
(camelCase, role keys ``Chief``/``PS``/``Worker``/``Evaluator`` as in TFJob's ``tfReplicaSpecs``).

``json_schema_extra`` carries what only the CRD needs: ``x-kubernetes-*`` markers and CEL rules
(``x-kubernetes-validations``). Anything the API server cannot check is checked again by :func:`parse_spec`,
whose errors name the field, so the planner can fail the job with a clear message instead of crash looping.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, JsonValue, PlainValidator, ValidationError, WithJsonSchema
from pydantic.json_schema import JsonDict

from kubeps.runtime import lifecycle
from kubeps.runtime.cluster import MembershipAck
from kubeps.runtime.contract import FIRST_RETRYABLE_EXIT

GROUP = "kubeps.dev"
VERSION = "v1alpha1"
KIND = "PSTrainingJob"
PLURAL = "pstrainingjobs"
SINGULAR = "pstrainingjob"
SHORT_NAMES = ["psjob"]
API_VERSION = f"{GROUP}/{VERSION}"

#: Default port of every task, and the name of the container port the operator looks for (TFJob's name too).
DEFAULT_PORT = 2222
PORT_NAME = "kubeps-port"
TFJOB_PORT_NAME = "tfjob-port"
#: The container port every task serves its Prometheus metrics on (``KUBEPS_METRICS_PORT``), and its name: the
#: chart's PodMonitor scrapes the port of that name
DEFAULT_METRICS_PORT = 9090
METRICS_PORT_NAME = "metrics"

MAX_PS = 100
MAX_WORKERS = 1000
#: ``<job>-evaluator-0`` (12 more characters) and ``<job>-worker-999`` (11 more) must stay DNS labels (63).
MAX_JOB_NAME = 63 - len("-evaluator-0")
JOB_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"

_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_PORT_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class ReplicaType(str, Enum):
    CHIEF = "Chief"
    PS = "PS"
    WORKER = "Worker"
    EVALUATOR = "Evaluator"

    @property
    def task_type(self) -> str:
        """The TF_CONFIG task type and the lower-case name used in child names and labels."""
        return _TASK_TYPES[self]


_TASK_TYPES = {
    ReplicaType.CHIEF: "chief",
    ReplicaType.PS: "ps",
    ReplicaType.WORKER: "worker",
    ReplicaType.EVALUATOR: "evaluator",
}
REPLICA_TYPES = tuple(ReplicaType)
BY_TASK_TYPE = {rt.task_type: rt for rt in ReplicaType}


# A replica's ``restartPolicy`` (the CRD field keeps its name). Not the runtime's local restart policy
# (kubeps.runtime.supervisor.RestartPolicy). No docstring: it would become the schema's description, and move it.
class ReplicaRestartPolicy(str, Enum):
    NEVER = "Never"
    ON_FAILURE = "OnFailure"
    ALWAYS = "Always"
    EXIT_CODE = "ExitCode"


class CleanPodPolicy(str, Enum):
    ALL = "All"
    RUNNING = "Running"
    NONE = "None"


class DisruptionBudgetPolicy(str, Enum):
    NONE = "None"
    CHIEF_AND_PS = "ChiefAndPS"


# ---------------------------------------------------------------------------------------------- pod template
_PRESERVE: JsonDict = {"x-kubernetes-preserve-unknown-fields": True}


class ContainerPort(BaseModel):
    """A container port; the operator looks for the one named kubeps-port (or tfjob-port), default 2222."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_PRESERVE)

    name: str | None = Field(None, max_length=15, pattern=_PORT_NAME)
    containerPort: int = Field(..., ge=1, le=65535)


class Container(BaseModel):
    """A container of the template; only what the operator reads is typed, the rest is kept as written."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_PRESERVE)

    name: str = Field(..., min_length=1, max_length=63, pattern=_DNS_LABEL)
    image: str | None = None
    ports: list[ContainerPort] | None = None


class PodSpec(BaseModel):
    """A pod spec; the operator reads its containers, every other field is kept as written."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_PRESERVE)

    containers: list[Container] = Field(
        ...,
        min_length=1,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )


class PodTemplateSpec(BaseModel):
    """A PodTemplateSpec; ``metadata`` and every pod field the operator does not read are preserved as written."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_PRESERVE)

    metadata: dict[str, Any] | None = Field(None, json_schema_extra=_PRESERVE)
    spec: PodSpec


# ---------------------------------------------------------------------------------------------- replica specs
_RESTART_POLICY_DOC = (
    "What to do when a replica's pod ends: Never, OnFailure (recreate it after a failure), Always (also after "
    "exit 0; ignored for the Chief, whose exit 0 ends the job), ExitCode (recreate only for runPolicy."
    "retryableExitCodes)."
)


def default_restart_policy(role: str) -> ReplicaRestartPolicy:
    """A role's default ``restartPolicy``: the lifecycle table's (:data:`kubeps.runtime.lifecycle.ROLES`), which
    ``kubeps local --restart`` follows too: one default per role for both."""
    return ReplicaRestartPolicy(lifecycle.ROLES[role].policy)


def _restart_policy(role: str) -> Any:
    default = default_restart_policy(role)
    return Field(default, description=f"{_RESTART_POLICY_DOC} Default: {default.value}.")


class ReplicaSpec(BaseModel):
    """What every role's spec has; each role's class below sets its own count, bounds, default restartPolicy and
    documentation."""

    model_config = ConfigDict(extra="ignore")

    replicas: int
    restartPolicy: ReplicaRestartPolicy
    template: PodTemplateSpec


class ChiefSpec(ReplicaSpec):
    """The chief (coordinator): exactly one."""

    replicas: int = Field(1, ge=1, le=1, description="Number of replicas (1..1).")
    restartPolicy: ReplicaRestartPolicy = _restart_policy(lifecycle.CHIEF)


class PSSpec(ReplicaSpec):
    """Parameter servers: at least one."""

    replicas: int = Field(1, ge=1, le=MAX_PS, description=f"Number of replicas (1..{MAX_PS}).")
    restartPolicy: ReplicaRestartPolicy = _restart_policy(lifecycle.PS)


class WorkerSpec(ReplicaSpec):
    """Workers: at least one."""

    replicas: int = Field(1, ge=1, le=MAX_WORKERS, description=f"Number of replicas (1..{MAX_WORKERS}).")
    restartPolicy: ReplicaRestartPolicy = _restart_policy(lifecycle.WORKER)


class EvaluatorSpec(ReplicaSpec):
    """A sidecar evaluator: none or one."""

    replicas: int = Field(1, ge=0, le=1, description="Number of replicas (0..1).")
    restartPolicy: ReplicaRestartPolicy = _restart_policy(lifecycle.EVALUATOR)


class ReplicaSpecs(BaseModel):
    """The job's roles, as TFJob's tfReplicaSpecs: Chief (exactly 1), PS (1 or more), Worker (1 or more) and an
    optional Evaluator (0 or 1), each with its replicas, restartPolicy and pod template."""

    model_config = ConfigDict(extra="ignore")

    Chief: ChiefSpec
    PS: PSSpec
    Worker: WorkerSpec
    Evaluator: EvaluatorSpec | None = None

    def get(self, replica_type: ReplicaType) -> ReplicaSpec | None:
        spec: ReplicaSpec | None = getattr(self, replica_type.value)
        return spec


ExitCode = Annotated[int, Field(ge=1, le=255)]


#: A Kubernetes resource quantity (``2``, ``500m``, ``4Gi``), as the API server's own ``resource.Quantity`` pattern.
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")


def _quantity(value: Any) -> int | str:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or (
            isinstance(value, str) and re.fullmatch(QUANTITY_PATTERN, value) is None):
        raise ValueError("expected a resource quantity such as 2, 500m or 4Gi")
    return value


Quantity = Annotated[
    int | str,
    PlainValidator(_quantity),
    WithJsonSchema({"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN}),
]


class SchedulingPolicy(BaseModel):
    """Gang scheduling, as TFJob's runPolicy.schedulingPolicy: what the PodGroup of the job asks of the gang
    scheduler the operator is set up for (--gang-scheduler; none: these fields are ignored)."""

    model_config = ConfigDict(extra="ignore")

    minAvailable: int | None = Field(
        None, ge=1,
        description="Pods of the gang that must be schedulable together before any of them is bound. The gang is "
        "the chief, the parameter servers and the workers (the evaluator stays outside it); default and at most: "
        "all of them.",
    )
    queue: str | None = Field(None, min_length=1, description="Volcano queue of the PodGroup (Volcano's default: "
                              "default). Other backends ignore it.")
    priorityClass: str | None = Field(
        None, min_length=1,
        description="PriorityClass of the gang: the Volcano PodGroup's priorityClassName; with the native and "
        "scheduler-plugins backends, the priorityClassName of the gang's pods whose template names none.",
    )
    scheduleTimeoutSeconds: int | None = Field(
        None, ge=1,
        description="scheduler-plugins only: seconds the PodGroup may wait for its pods to be scheduled together "
        "before the scheduler gives up on that attempt (the PodGroup's scheduleTimeoutSeconds).",
    )
    minResources: dict[str, Quantity] | None = Field(
        None,
        description="Resources the gang needs as a whole before the scheduler tries it (Volcano and "
        "scheduler-plugins). Default: the sum of the container requests (limits where a request is unset) of the "
        "first minAvailable pods of the gang, Chief then PS then Worker.",
    )


class RunPolicy(BaseModel):
    """How the job runs as a whole: cleanup, restarts allowed, deadlines, TTL, suspension, gang scheduling and
    retryable exit codes."""

    model_config = ConfigDict(extra="ignore")

    cleanPodPolicy: CleanPodPolicy = Field(
        CleanPodPolicy.RUNNING,
        description="Which pods to delete once the job has finished: All, Running (default: what still runs, "
        "so PS, workers and evaluator do not idle) or None.",
    )
    evaluatorGraceSeconds: int = Field(
        60, ge=0, le=86400,
        description="After the job succeeded: seconds its evaluator may still run to evaluate the final checkpoint "
        "(it stops by itself once it has) before cleanPodPolicy Running deletes it; the parameter servers and "
        "workers are deleted at once. 0: at once too.",
    )
    backoffLimit: int = Field(
        6, ge=0, le=10000,
        description="Chief and PS restarts (pod recreations and in-place container restarts) allowed before the "
        "job fails. Worker replacements do not count.",
    )
    activeDeadlineSeconds: int | None = Field(
        None, ge=1, description="Seconds the job may run (since start or resume) before it fails."
    )
    ttlSecondsAfterFinished: int | None = Field(
        None, ge=0, description="Seconds after the job finished when it is deleted, with its children."
    )
    suspend: bool = Field(False, description="Delete the pods and Services and keep the job; false resumes it.")
    schedulingPolicy: SchedulingPolicy | None = Field(
        None, description="Gang scheduling of the chief, PS and workers (used when the operator runs with a gang "
        "scheduler backend, --gang-scheduler).")
    podDisruptionBudget: DisruptionBudgetPolicy | None = Field(
        None,
        description="ChiefAndPS: a PodDisruptionBudget (minAvailable: all of them) over the chief and parameter servers while "
        "the job runs, so that a drain or another eviction waits instead of restarting the job from its checkpoint; "
        "None or unset (default): no budget.",
    )
    retryableExitCodes: list[ExitCode] | None = Field(
        None,
        max_length=255,
        description=f"Exit codes that the ExitCode restart policy retries; default: {FIRST_RETRYABLE_EXIT} and above "
        "(signals).",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )

    def retryable(self, exit_code: int | None) -> bool:
        """Whether ExitCode retries this code; an unknown code (evicted, lost pod) is retried."""
        if exit_code is None:
            return True
        if self.retryableExitCodes is None:
            # the pod contract's rule (kubeps.runtime.contract.is_retryable_exit); a status above 255, which no
            # Linux container reports, is retried too
            return exit_code >= FIRST_RETRYABLE_EXIT
        return exit_code in self.retryableExitCodes


class SuccessPolicy(str, Enum):
    CHIEF_ONLY = "ChiefOnly"
    ALL_WORKERS = "AllWorkers"


class GangScheduler(str, Enum):
    """The operator's gang scheduling backend (its --gang-scheduler setting, not a spec field)."""

    NONE = "none"
    NATIVE = "native"
    VOLCANO = "volcano"
    SCHEDULER_PLUGINS = "scheduler-plugins"


class TLSMode(str, Enum):
    MUTUAL = "MutualTLS"
    DISABLED = "Disabled"


class NetworkPolicyMode(str, Enum):
    SAME_JOB = "SameJob"
    NONE = "None"


class TLSSpec(BaseModel):
    """Encryption of the traffic between the job's tasks."""

    model_config = ConfigDict(extra="ignore")

    mode: TLSMode = Field(
        TLSMode.MUTUAL,
        description="MutualTLS (default): every task serves and dials TLS with the job's certificate, issued by a CA "
        "made for this job and kept in its Secret; a connection without a certificate of that CA is refused. "
        "Disabled: plaintext between the tasks (the job token still authenticates every call).",
    )


class NetworkPolicySpec(BaseModel):
    """A NetworkPolicy that isolates the job's pods."""

    model_config = ConfigDict(extra="ignore")

    mode: NetworkPolicyMode | None = Field(
        None,
        description="SameJob: the operator creates a NetworkPolicy <job>-kubeps that lets the job's pods accept "
        "traffic only from pods of the same job. None: no NetworkPolicy. Unset: the operator's default "
        "(--job-network-policy, chart value networkPolicy.jobs).",
    )


class SecuritySpec(BaseModel):
    """How the job's tasks are protected from the rest of the cluster (immutable unless the job is suspended)."""

    model_config = ConfigDict(extra="ignore")

    tls: TLSSpec = Field(default_factory=TLSSpec, json_schema_extra={"default": {}})
    networkPolicy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec, json_schema_extra={"default": {}})


def _suspended_or_same(path: str, optional: bool = False) -> JsonDict:
    new, old = f"self.replicaSpecs{path}", f"oldSelf.replicaSpecs{path}"
    same = f"{new} == {old}"
    if optional:
        role = path.split(".")[1]
        same = (
            f"(has(self.replicaSpecs.{role}) == has(oldSelf.replicaSpecs.{role})) && "
            f"(!has(self.replicaSpecs.{role}) || {same})"
        )
    return {
        "rule": f"(has(oldSelf.runPolicy) && has(oldSelf.runPolicy.suspend) && oldSelf.runPolicy.suspend) || ({same})",
        "message": f"spec.replicaSpecs{path} is immutable unless the job is suspended "
        "(only Worker and PS replicas and runPolicy may change on a running job)",
        "fieldPath": f".replicaSpecs{path}",
        "reason": "FieldValueForbidden",
    }


#: Immutable fields of a job that is not suspended: everything in replicaSpecs but Worker.replicas (workers join
#: and leave the running chief) and PS.replicas (the operator restarts the job from its checkpoint into the new
#: count; docs/elastic.md). runPolicy stays mutable (suspend, TTL, deadline, backoffLimit, cleanPodPolicy,
#: retryableExitCodes).
IMMUTABILITY_RULES: list[JsonValue] = [
    _suspended_or_same(".Chief"),
    _suspended_or_same(".PS.template"),
    _suspended_or_same(".PS.restartPolicy"),
    _suspended_or_same(".Evaluator", optional=True),
    _suspended_or_same(".Worker.template"),
    _suspended_or_same(".Worker.restartPolicy"),
    {
        "rule": "(has(oldSelf.runPolicy) && has(oldSelf.runPolicy.suspend) && oldSelf.runPolicy.suspend) || "
        "(has(self.security) == has(oldSelf.security) && (!has(self.security) || self.security == oldSelf.security))",
        "message": "spec.security is immutable unless the job is suspended (pods made before and after a change "
        "could not talk to each other)",
        "fieldPath": ".security",
        "reason": "FieldValueForbidden",
    },
]


#: Rules that relate fields of different parts of the spec (checked again by :func:`parse_spec`, with the values).
CROSS_FIELD_RULES: list[JsonValue] = [
    {
        "rule": "!has(self.runPolicy) || !has(self.runPolicy.schedulingPolicy) || "
        "!has(self.runPolicy.schedulingPolicy.minAvailable) || self.runPolicy.schedulingPolicy.minAvailable <= "
        "1 + (has(self.replicaSpecs.PS.replicas) ? self.replicaSpecs.PS.replicas : 1) + "
        "(has(self.replicaSpecs.Worker.replicas) ? self.replicaSpecs.Worker.replicas : 1)",
        "message": "spec.runPolicy.schedulingPolicy.minAvailable must be at most the gang's size: 1 (Chief) + PS "
        "replicas + Worker replicas (the evaluator is not in the gang); a larger gang could never be scheduled",
        "fieldPath": ".runPolicy.schedulingPolicy.minAvailable",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": "!has(self.successPolicy) || self.successPolicy != 'AllWorkers' || "
        "!has(self.replicaSpecs.Worker.restartPolicy) || self.replicaSpecs.Worker.restartPolicy != 'Always'",
        "message": "spec.successPolicy AllWorkers needs every worker to exit 0 for good, which Worker restartPolicy "
        "Always never allows (it recreates a worker that exited 0): use OnFailure, Never or ExitCode",
        "fieldPath": ".successPolicy",
        "reason": "FieldValueForbidden",
    },
]


#: ``runPolicy`` may be left out: the CRD defaults it to ``{}`` (so its own fields get their defaults).
_EMPTY_DEFAULT: JsonDict = {"default": {}}


class PSTrainingJobSpec(BaseModel):
    """The desired job: its roles (replicaSpecs) and how it runs (runPolicy). Only Worker and PS replicas and
    runPolicy may change while the job is not suspended."""

    model_config = ConfigDict(extra="ignore",
                              json_schema_extra={"x-kubernetes-validations": IMMUTABILITY_RULES + CROSS_FIELD_RULES})

    replicaSpecs: ReplicaSpecs
    runPolicy: RunPolicy = Field(default_factory=RunPolicy, json_schema_extra=_EMPTY_DEFAULT)
    successPolicy: SuccessPolicy = Field(
        SuccessPolicy.CHIEF_ONLY,
        description="When the job has succeeded. ChiefOnly (default): when the chief exits 0. AllWorkers (TFJob's, "
        "for programs in which every worker trains and exits, as TF1-style between-graph replication): when the "
        "chief and every worker have exited 0; a chief that exits 0 first is not restarted, and one worker that "
        "fails for good fails the job.",
    )
    security: SecuritySpec = Field(default_factory=SecuritySpec, json_schema_extra=_EMPTY_DEFAULT)


#: CEL rules on the whole object (the only place where metadata.name is visible).
NAME_RULES: list[JsonValue] = [
    {
        "rule": f"size(self.metadata.name) <= {MAX_JOB_NAME}",
        "message": f"metadata.name must be at most {MAX_JOB_NAME} characters, so that <job>-evaluator-0 and "
        "<job>-worker-<index> are valid DNS labels (63 characters)",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": f"self.metadata.name.matches('{JOB_NAME_PATTERN}')",
        "message": "metadata.name must start with a lower-case letter and hold only lower-case letters, digits "
        "and '-' (child Services are named <job>-<type>-<index>, which must be a DNS-1035 label)",
        "reason": "FieldValueInvalid",
    },
]


# ---------------------------------------------------------------------------------------------- status
class ConditionType(str, Enum):
    CREATED = "Created"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"


class Condition(BaseModel):
    """One condition of the job (Created, Running, Restarting, Succeeded, Failed, Suspended), as in TFJob."""

    model_config = ConfigDict(extra="ignore")

    type: ConditionType
    status: str = Field(..., pattern="^(True|False|Unknown)$")
    reason: str | None = None
    message: str | None = None
    lastTransitionTime: str | None = None
    lastUpdateTime: str | None = None


class ReplicaStatus(BaseModel):
    """Pod counts of one role."""

    model_config = ConfigDict(extra="ignore")

    active: int = 0
    ready: int = 0
    succeeded: int = 0
    failed: int = 0
    restarts: int = 0


class Progress(BaseModel):
    """How far training is, read by the operator from the chief's metrics and its membership ack (``kubectl get
    psjob`` shows it)."""

    model_config = ConfigDict(extra="ignore")

    #: the step the chief last reported (``kubeps_train_step``)
    step: int | None = None
    #: examples per second between the operator's last two reads of the chief's metrics, as text ("12345")
    examplesPerSecond: str | None = None
    #: the step of the last checkpoint the chief wrote (``kubeps_checkpoint_step``)
    lastCheckpointStep: int | None = None
    #: the membership generation the chief applied (its membership ack's ``generation``; docs/elastic.md)
    membershipGeneration: int | None = None
    #: workers that left the membership and still finish their last function (how many the ack names ``draining``)
    workersDraining: int | None = None
    #: the last checkpoint request of the membership document the chief served (the ack's ``checkpoint``)
    checkpointRequest: int | None = None
    #: when the operator read them
    lastUpdateTime: str | None = None


class PSTrainingJobStatus(BaseModel):
    """What the operator observed: conditions, per-role counts, times and restart counters (written by the
    operator only)."""

    model_config = ConfigDict(extra="ignore")

    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    replicaStatuses: dict[str, ReplicaStatus] = Field(default_factory=dict)
    startTime: str | None = None
    completionTime: str | None = None
    observedGeneration: int | None = None
    #: Summary for printer columns.
    state: str | None = None
    chief: str | None = None
    ps: str | None = None
    workers: str | None = None
    restarts: int = 0
    #: Chief and PS restarts counted against backoffLimit (pod recreations; in-place restarts are added live).
    backoffCount: int = 0
    #: Bumped at every PS restart; a chief pod of an older epoch is restarted so it rebuilds its variables.
    chiefEpoch: int = 0
    #: UIDs of failed or finished pods already accounted for (so a restarted operator never counts twice).
    handledPods: list[str] = Field(default_factory=list, max_length=4096)
    #: Training progress from the chief's metrics (absent until the chief serves a step).
    progress: Progress | None = None
    #: The label selector of the Worker pods: the ``scale`` subresource's (``kubectl scale``, an HPA).
    workerSelector: str | None = None
    #: The PS replicas the chief's epoch runs with: a spec that changes them restarts the chief into the new count.
    psReplicas: int | None = None
    #: When the membership ConfigMap last changed: scaled-away workers are drained by the chief until this plus the
    #: drain timeout, then deleted.
    membershipTime: str | None = None
    #: A PS replicas change waits for the chief to serve this checkpoint request (the membership document's
    #: ``checkpoint``), for at most a minute from ``checkpointRequestTime``, before the chief restarts into the new
    #: count; cleared at that restart.
    checkpointRequest: int | None = None
    checkpointRequestTime: str | None = None
    #: The chief's membership ack as last read (the document ``kubeps local`` reads too): the generation it
    #: applied, the workers it dispatches to, drains and drained, the checkpoint request it served. The planner
    #: decides from it when a scaled-away worker's pod goes and when the chief restarts into a new ps count.
    membershipAck: MembershipAck | None = None


class SpecError(ValueError):
    """The spec breaks a rule; ``field`` is the dotted path, the message says what is allowed."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"spec.{field}: {message}" if field else message)


def parse_spec(spec: Any) -> PSTrainingJobSpec:
    """Validate a job's ``spec`` (as read from the API); raises :class:`SpecError` naming the first bad field."""
    if not isinstance(spec, dict):
        raise SpecError("", f"spec must be an object, got {type(spec).__name__}")
    try:
        parsed = PSTrainingJobSpec.model_validate(spec)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        field = ".".join(str(part) for part in first["loc"])
        value = first.get("input")
        text = repr(value)
        if len(text) > 80:
            text = text[:77] + "..."
        raise SpecError(field, f"{first['msg']} (got {text})") from None
    _check_cross_field_rules(parsed)
    return parsed


def gang_size(spec: PSTrainingJobSpec) -> int:
    """Pods in the job's gang: the chief, the parameter servers and the workers (not the evaluator)."""
    replicas = spec.replicaSpecs
    return replicas.Chief.replicas + replicas.PS.replicas + replicas.Worker.replicas


def _check_cross_field_rules(spec: PSTrainingJobSpec) -> None:
    """:data:`CROSS_FIELD_RULES`, for API servers that did not enforce them, naming the values."""
    policy = spec.runPolicy.schedulingPolicy
    size = gang_size(spec)
    if policy is not None and policy.minAvailable is not None and policy.minAvailable > size:
        replicas = spec.replicaSpecs
        raise SpecError("runPolicy.schedulingPolicy.minAvailable",
                        f"{policy.minAvailable} is more than the gang's {size} pods (Chief {replicas.Chief.replicas} "
                        f"+ PS {replicas.PS.replicas} + Worker {replicas.Worker.replicas}; the evaluator is not in "
                        f"the gang): allowed 1..{size}")
    if (spec.successPolicy is SuccessPolicy.ALL_WORKERS
            and spec.replicaSpecs.Worker.restartPolicy is ReplicaRestartPolicy.ALWAYS):
        raise SpecError("successPolicy", "AllWorkers needs every worker to exit 0 for good, but Worker "
                        "restartPolicy is Always (it recreates a worker that exited 0): use OnFailure, Never or "
                        "ExitCode with AllWorkers, or successPolicy ChiefOnly")


def name_problem(name: str) -> str | None:
    """What makes ``name`` an invalid job name (a DNS-1035 label of at most :data:`MAX_JOB_NAME` characters), in
    words that point at the culprit (``'_' at index 3``), or None when it is valid."""
    if not name:
        return "it is empty; a name starts with a lower-case letter"
    problems = []
    if len(name) > MAX_JOB_NAME:
        problems.append(f"it has {len(name)} characters, at most {MAX_JOB_NAME} are allowed (so that "
                        "<job>-evaluator-0 and <job>-worker-<index> are DNS labels of at most 63)")
    bad = [(i, c) for i, c in enumerate(name) if not (c.islower() and c.isascii() or c.isdigit() or c == "-")]
    if bad:
        shown = ", ".join(f"{c!r} at index {i}" for i, c in bad[:5]) + (", ..." if len(bad) > 5 else "")
        problems.append(f"{shown}: only lower-case letters a-z, digits and '-' are allowed")
    if not ("a" <= name[0] <= "z"):
        problems.append(f"it starts with {name[0]!r}: a name starts with a lower-case letter")
    if name[-1] == "-":
        problems.append("it ends with '-': a name ends with a letter or digit")
    return "; ".join(problems) or None


def check_name(name: str) -> None:
    """The job-name rules of :data:`NAME_RULES`, for API servers that did not enforce them."""
    problem = name_problem(name)
    if problem is not None:
        raise SpecError("", f"metadata.name {name!r} is not a valid job name (a DNS-1035 label): {problem}")
