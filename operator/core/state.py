"""What one reconcile observed of a job, as one value: :class:`Observed`, the planner's only input.

The shell (:mod:`kubeps.operator.controller.reconciler`) builds it once per reconcile from its cache and the few
reads it makes, and :func:`.planner.plan` decides from it alone. Everything the rules read is here, as facts rather
than forged objects: the job's Secret as :class:`SecretFacts` (present or not, and how many Worker indices its
task certificate covers), whether the job's NetworkPolicy exists, the membership document its chief watches, the nodes as :class:`~.nodes.NodesSeen` (the
lost-node rules of :mod:`.nodes` run inside the planner), the gang's PodGroup, the Kueue view, the clock and the
operator's settings.

Pure data: frozen, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Mapping, Sequence

from kubeps.runtime.cluster import Membership

from .children import ANNOTATION_TLS_PS, ANNOTATION_TLS_WORKERS, PlanConfig
from .kueue import QueueView
from .nodes import NodesSeen


@dataclass(frozen=True)
class SecretFacts:
    """The job's own token Secret, known to exist, as the planner reads it."""

    #: How many Worker indices its task certificate names (its ``kubeps.dev/tls-workers`` annotation); None when
    #: not known, taken as covering as many as needed.
    tls_workers: int | None = None
    #: How many PS indices it names (``kubeps.dev/tls-ps``); None when not known (a Secret made before the
    #: annotation existed names the PS count its job was created with), taken as covering.
    tls_ps: int | None = None

    @classmethod
    def of(cls, secret: Mapping[str, Any]) -> SecretFacts:
        """The facts of a Secret's body."""
        return cls.from_annotations((secret.get("metadata") or {}).get("annotations") or {})

    @classmethod
    def from_annotations(cls, annotations: Mapping[str, str]) -> SecretFacts:
        """The facts of a Secret's annotations (the one read may be missing, or not a number: not known)."""
        def count(key: str) -> int | None:
            try:
                return int(str(annotations.get(key)))
            except ValueError:  # None, or not a number
                return None

        return cls(count(ANNOTATION_TLS_WORKERS), count(ANNOTATION_TLS_PS))

    def covers(self, workers: int, ps: int = 0) -> bool:
        """Whether the task certificate names Worker indices 0 to ``workers - 1`` and PS indices 0 to ``ps - 1``."""
        return (self.tls_workers is None or workers <= self.tls_workers) and (self.tls_ps is None or ps <= self.tls_ps)


@dataclass(frozen=True)
class Observed:
    """Everything one reconcile of one job decides from."""

    #: The job's body as last read (its status is the one the plan rewrites).
    job: Mapping[str, Any]
    #: The reconcile's clock: every time the plan writes or compares is this one.
    now: datetime
    #: The pods and Services labelled with the job's name (those the job does not control are ignored).
    pods: Sequence[Mapping[str, Any]] = ()
    services: Sequence[Mapping[str, Any]] = ()
    #: The job's own token Secret, None when it does not exist (or the shell has not seen it yet).
    secret: SecretFacts | None = None
    #: Whether the job's NetworkPolicy is known to exist (not watched: the plan asks for it until the shell saw it
    #: made, and a create that finds it there is a no-op).
    network_policy: bool = False
    #: The document of the job's membership ConfigMap (the workers its chief dispatches to), None when it does not
    #: exist or holds none (the shell read it, or remembers what it wrote).
    membership: Membership | None = None
    #: The nodes, for the lost-node rules (default: not known, nothing decided).
    nodes: NodesSeen = field(default_factory=NodesSeen)
    #: The job's own PodGroup, when the gang scheduler is on and the shell saw one.
    pod_group: Mapping[str, Any] | None = None
    #: A queued job's Workload and what it names (:mod:`.kueue`); None for a job Kueue does not queue.
    queue: QueueView | None = None
    #: The operator's settings the plan follows.
    config: PlanConfig = field(default_factory=PlanConfig)
