"""One reconcile's plan as it is drafted: :class:`Draft`, the working state every rule of the planner shares.

It reads the :class:`~.state.Observed` job once (its pods projected and keyed by replica, its Services by name, its
status as a :class:`~.status.StatusBook`) and carries the moves every rule makes: post an Event, fail or succeed the
job, create or delete a pod, ask to be reconciled again. The rules themselves are functions of their own modules
(:mod:`.restarts`, :mod:`.timeline`, :mod:`.security`, :mod:`.scale`), which :mod:`.planner` calls in order, as
TensorFlow's ``Dataset`` delegates each transformation to its own module.

Pure: no I/O; the time is the observed one.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from kubeps.operator.api import models
from kubeps.operator.api.models import ConditionType, PSTrainingJobSpec, ReplicaType

from . import gang, kueue
from .actions import CreatePod, DeletePod, Event, Plan
from .children import pod_body
from .observed import ObservedPod, observe_pods, owned
from .state import Observed
from .status import R_SUCCEEDED, StatusBook


class Draft:
    """The job observed, its status being rewritten, and the plan so far."""

    def __init__(self, observed: Observed, pods: Sequence[Mapping[str, Any]] | None = None):
        """``pods``: the pods as the rules are to see them (those on lost nodes taken as deleted, :mod:`.nodes`);
        default: as observed."""
        job = observed.job
        self.observed = observed
        self.job = job
        self.queue_view = observed.queue or kueue.QueueView()
        #: the job's Kueue admission, for a queued job once its spec parsed
        self.queueing: kueue.Queueing | None = None
        self.meta: Mapping[str, Any] = job.get("metadata") or {}
        self.name: str = self.meta.get("name", "")
        self.now = observed.now
        self.config = observed.config
        self.book = StatusBook(job.get("status"), observed.now)
        self.status = self.book.status  # the model the rules edit
        uid = self.meta.get("uid")
        self.pods = observe_pods(observed.pods if pods is None else pods, uid)
        self.services: dict[str, Mapping[str, Any]] = {
            _name(s): s for s in owned(observed.services, uid)
        }
        self.plan = Plan()
        self.by_key: dict[tuple[ReplicaType, int], ObservedPod] = {}
        for pod in self.pods:
            if pod.replica_type is not None and pod.index is not None:
                self.by_key[(pod.replica_type, pod.index)] = pod
        self.spec: PSTrainingJobSpec | None = None

    @property
    def valid_spec(self) -> PSTrainingJobSpec:
        """The parsed spec, for the rules that run only once it parsed (pods are made, restarts decided)."""
        assert self.spec is not None, "a rule that needs the spec ran before it parsed"
        return self.spec

    def desired_counts(self) -> dict[ReplicaType, int]:
        """The replicas the spec asks for, by type (none of any while the spec has not parsed)."""
        counts = {rt: 0 for rt in models.REPLICA_TYPES}
        if self.spec is None:
            return counts
        for rt in models.REPLICA_TYPES:
            rs = self.spec.replicaSpecs.get(rt)
            counts[rt] = rs.replicas if rs is not None else 0
        return counts

    def exited_0(self, rt: ReplicaType, index: int) -> bool:
        pod = self.by_key.get((rt, index))
        return pod is not None and not pod.terminating and pod.phase == "Succeeded"

    # -- events and terminal transitions -------------------------------------------------------------------
    def event(self, etype: str, reason: str, message: str) -> None:
        self.plan.actions.append(Event(etype, reason, message))

    def fail(self, reason: str, message: str) -> None:
        self.book.set_condition(ConditionType.FAILED, True, reason, message)
        self.book.finish()
        self.event("Warning", reason, message)

    def succeed(self, message: str, reason: str = R_SUCCEEDED) -> None:
        self.book.set_condition(ConditionType.SUCCEEDED, True, reason, message)
        self.book.finish()
        self.event("Normal", reason, message)

    def restarting(self, reason: str, event_reason: str, message: str) -> None:
        """The job restarts some of its pods: Restarting (and not Running) for ``reason``, a Warning Event."""
        self.book.set_condition(ConditionType.RESTARTING, True, reason, message)
        self.book.set_condition(ConditionType.RUNNING, False, reason, message)
        self.event("Warning", event_reason, message)

    # -- children and timers ------------------------------------------------------------------------------------
    def create_pod(self, rt: ReplicaType, index: int) -> None:
        """Create the pod of a replica: its body per the spec, the Kueue admission's placement, the gang's
        PodGroup."""
        body = pod_body(self.job, self.valid_spec, rt, index, self.status.chiefEpoch, self.config)
        if self.queueing is not None and rt.task_type in self.queueing.infos:
            self.queueing.infos[rt.task_type].apply(body)
        gang.join(body, self.valid_spec, rt, self.config)
        self.plan.actions.append(CreatePod(body["metadata"]["name"], body, rt.value, index))

    def delete_pod(self, pod: ObservedPod, reason: str) -> None:
        self.plan.actions.append(DeletePod(pod.name, pod.uid, reason))

    def requeue(self, seconds: float) -> None:
        """Reconcile again after ``seconds`` at the latest (the soonest of all asked for wins)."""
        seconds = max(seconds, 0.0)
        if self.plan.requeue_after is None or seconds < self.plan.requeue_after:
            self.plan.requeue_after = seconds


def _name(obj: Mapping[str, Any]) -> str:
    name: str = (obj.get("metadata") or {}).get("name", "")
    return name
