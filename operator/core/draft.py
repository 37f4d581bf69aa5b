"""One reconcile's plan as it is drafted: :class:`Draft`, the working state every rule of the planner shares.

It reads the :class:`~.state.Observed` job once (its pods projected and keyed by replica, its Services by name, its
status as a :class:`~.status.StatusBook`) and carries the moves every rule makes: post an Event, move the job
between its states (:meth:`Draft.move`, which applies the row of the job state table, :mod:`.flow`, as written),
create or delete a pod, ask to be reconciled again. The rules themselves are functions of their own modules
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
from .flow import FAILING, On, Row, State, phase_of, row
from .observed import ObservedPod, observe_pods, owned
from .state import Observed
from .status import StatusBook


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

    # -- events and moves between states ------------------------------------------------------------------
    def event(self, etype: str, reason: str, message: str) -> None:
        self.plan.actions.append(Event(etype, reason, message))

    @property
    def phase(self) -> State:
        """The job's phase as its conditions say now (:func:`.flow.phase_of`)."""
        return phase_of(self.book)

    def move(self, on: On, message: str, *, current: State | None = None, event_message: str | None = None,
             settled_message: str = "") -> Row:
        """Move the job on ``on`` by the row of the job state table (:mod:`.flow`) from its phase (or from
        ``current``, an elastic wait's state, which the status does not keep), and apply it as written: its
        conditions with the row's reason and ``message``, ``backoffCount`` for a counted row, its Event
        (``event_message``, default ``message``). A move the table does not name raises
        :class:`~.flow.TransitionError`. Returns the row applied."""
        r = row(self.phase if current is None else current, on)
        book, note = self.book, event_message if event_message is not None else message
        if r.to is State.FAILED or r.to is State.SUCCEEDED:
            book.set_condition(ConditionType.FAILED if r.to is State.FAILED else ConditionType.SUCCEEDED, True,
                               r.reason, message)
            book.finish()
            self.event("Warning" if r.to is State.FAILED else "Normal", r.reason, note)
        elif r.to is State.RESTARTING:
            book.set_condition(ConditionType.RESTARTING, True, r.reason, message)
            book.set_condition(ConditionType.RUNNING, False, r.reason, message)
            self.event("Warning", r.note or r.reason, note)
        elif r.to is State.RUNNING:
            if r.from_ is State.RESTARTING:
                book.set_condition(ConditionType.RESTARTING, False, r.reason, settled_message)
            book.set_condition(ConditionType.RUNNING, True, r.reason, message)
            self.event("Normal", r.reason, note)
        elif r.to is State.SUSPENDED:
            if book.set_condition(ConditionType.SUSPENDED, True, r.reason, message):
                self.event("Normal", r.reason, note)
            for ctype in (ConditionType.RUNNING, ConditionType.RESTARTING):
                book.set_condition(ctype, False, r.reason, message)
        elif r.to is State.CREATED:
            if r.from_ is State.SUSPENDED:
                book.set_condition(ConditionType.SUSPENDED, False, r.reason, message)
                self.status.startTime = book.now_text
            else:
                book.set_condition(ConditionType.CREATED, True, r.reason, message)
            self.event("Normal", r.reason, note)
        elif r.to is State.CHECKPOINTING:
            self.event("Normal", r.reason, note)
        elif r.from_ is State.CHECKPOINTING:  # settled: the restart into the new ps count follows
            self.status.checkpointRequest = self.status.checkpointRequestTime = None
        if r.counted:
            self.status.backoffCount += 1
        return r

    def fail(self, reason: str, message: str) -> None:
        """Fail the job for ``reason`` (the table's failing event of that reason)."""
        self.move(FAILING[reason], message)

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
