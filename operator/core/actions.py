"""What a plan asks of the shell: the actions (create or delete a child, delete the job, post an Event) and
:class:`Plan`, which carries them with the job's new status and the force deletes of pods on lost nodes.

Plain frozen data: the planner makes them, the shell (:mod:`kubeps.operator.controller`) carries them out in the
order it chooses (the status first, then the Secret and the PodGroup, then pods and Services at once). Repeating one is harmless:
children have deterministic names, and a pod's delete carries its UID as a precondition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar, Union


@dataclass(frozen=True)
class CreateSecret:
    name: str
    body: dict[str, Any]  # without the token: the shell adds a random one under data[TOKEN_KEY]
    #: the names the job's task certificate must be valid for (the shell makes a new CA and issues it: its keys
    #: are random, kept out of the pure core), and how many Worker and PS indices they cover
    tls_hosts: tuple[str, ...] = ()
    tls_workers: int = 0
    tls_ps: int = 0


@dataclass(frozen=True)
class ReissueCertificate:
    """Workers or parameter servers were added beyond the names of the Secret's task certificate: issue a new one,
    from the job's CA (pods running keep theirs: the CA is the same, so they trust the new one)."""

    name: str  # the Secret
    tls_hosts: tuple[str, ...]
    tls_workers: int
    tls_ps: int = 0


@dataclass(frozen=True)
class CreateNetworkPolicy:
    name: str
    body: dict[str, Any]


@dataclass(frozen=True)
class ApplyMembership:
    """Write the job's membership ConfigMap (created, or its document replaced): the workers the chief dispatches
    to, which it applies without a restart (:class:`kubeps.runtime.cluster.Membership`)."""

    name: str
    body: dict[str, Any]
    generation: int
    workers: int


@dataclass(frozen=True)
class AnnotatePod:
    """Set annotations on a running pod (its UID a precondition): the chief's membership generation, so that the
    kubelet refreshes the mounted membership ConfigMap now."""

    name: str
    uid: str | None
    annotations: dict[str, str]


@dataclass(frozen=True)
class CreateService:
    name: str
    body: dict[str, Any]


@dataclass(frozen=True)
class CreatePod:
    name: str
    body: dict[str, Any]
    replica_type: str
    index: int


@dataclass(frozen=True)
class DeletePod:
    name: str
    uid: str | None
    reason: str


@dataclass(frozen=True)
class DeleteService:
    name: str
    reason: str


@dataclass(frozen=True)
class CreatePodGroup:
    """The job's PodGroup for the gang scheduler (its apiVersion says which); made before the pods."""

    name: str
    body: dict[str, Any]


@dataclass(frozen=True)
class DeletePodGroup:
    name: str
    api_version: str
    reason: str


@dataclass(frozen=True)
class DeleteJob:
    reason: str


@dataclass(frozen=True)
class CreateWorkload:
    """Kueue's Workload of a queued job (:mod:`.kueue`)."""

    name: str
    body: dict[str, Any]


@dataclass(frozen=True)
class PatchWorkload:
    """A merge patch of the Workload's ``spec`` (queue name, active, podSets)."""

    name: str
    patch: dict[str, Any]


@dataclass(frozen=True)
class ApplyWorkloadStatus:
    """A server-side apply of the Workload's status, as Kueue's admission manager (conditions, admission)."""

    name: str
    status: dict[str, Any]


@dataclass(frozen=True)
class DeleteWorkload:
    name: str
    uid: str | None
    reason: str


@dataclass(frozen=True)
class ForceDeletePod:
    """Delete a pod with grace period 0 (its UID a precondition): it runs on a lost node (:mod:`.nodes`), whose
    kubelet will never confirm a delete."""

    name: str
    uid: str | None
    node: str
    reason: str


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


Action = Union[CreateSecret, ReissueCertificate, CreateNetworkPolicy, ApplyMembership, AnnotatePod, CreateService, CreatePod, DeletePod, DeleteService,
               CreatePodGroup, DeletePodGroup, DeleteJob, CreateWorkload, PatchWorkload, ApplyWorkloadStatus,
               DeleteWorkload, Event]
_A = TypeVar("_A")


@dataclass
class Plan:
    """What one reconcile of one job decided."""

    actions: list[Action] = field(default_factory=list)
    #: The whole new ``status`` (JSON-ready); compare with the old one to decide whether to write it.
    status: dict[str, Any] = field(default_factory=dict)
    #: Reconcile again after this many seconds (deadline, TTL), or None.
    requeue_after: float | None = None
    #: Every desired pod, Service and the Secret are observed.
    all_children_present: bool = False
    terminal: bool = False
    #: The pods on lost nodes to delete at once (after the other actions: :mod:`.nodes`).
    force_deletes: list[ForceDeletePod] = field(default_factory=list)

    def of(self, kind: type[_A]) -> list[_A]:
        """The actions of one kind, in the order decided."""
        return [a for a in self.actions if isinstance(a, kind)]
