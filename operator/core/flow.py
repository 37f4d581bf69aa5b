"""The job's state table: every move of a job between its states, written once as rows of ``from``, ``event``,
``to``, ``reason`` and ``counted`` (as DLRover's ``master/node/status_flow.py`` writes a node's).

Two kinds of state share the table:

* the job's **phase**, what its conditions say (:func:`phase_of`): New (no condition yet), Created, Running,
  Restarting, Suspended, Succeeded, Failed. A row's ``reason`` is the reason of the condition it sets, and of the
  Event it posts unless the row names another (``note``); ``counted`` rows count one restart against
  ``backoffLimit`` (the lifecycle table's counted roles, :data:`kubeps.runtime.lifecycle.ROLES`).
* the **elastic waits**, which the phase does not show: Draining (a scaled-away worker's pod is kept while the
  chief drains it) and Checkpointing (a ps count change waits for the checkpoint it asked the chief for), each
  left for Settled when the chief acknowledges, or when its deadline (:data:`WAITS`, data rather than a timer of
  its own) passes.

:class:`~.draft.Draft` consults the table for every move (``Draft.move``) and applies the row it finds; a move the
table does not name is refused (:class:`TransitionError`): a rule that tries one is a bug, not a job's fate.

Pure data and lookups: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Iterable, Mapping

from kubeps.runtime import lifecycle

from kubeps.operator.api.models import ConditionType

from .kueue import R_EVICTED, R_QUEUED
from .status import (R_ALL_WORKERS_FAILED, R_ALL_WORKERS_SUCCEEDED, R_BACKOFF, R_CHECKPOINT_REQUESTED,
                     R_CHIEF_FAILED, R_CREATED, R_DEADLINE, R_INVALID, R_INVALID_TEMPLATE, R_PS_FAILED, R_PS_SCALED,
                     R_RESUMED, R_RUNNING, R_SECRET_LOST, R_SUCCEEDED, R_SUSPENDED, R_WORKER_FAILED, StatusBook)

__all__ = ["ACTIVE", "FAILING", "HOLDING", "PHASES", "ROWS", "TABLE", "WAITS", "On", "Row", "State", "TransitionError", "Wait",
           "phase_of", "row"]


class State(str, Enum):
    """A job's states: its phases (as its conditions show them) and its elastic waits."""

    NEW = "New"
    CREATED = "Created"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    #: no elastic wait under way
    SETTLED = "Settled"
    DRAINING = "Draining"
    CHECKPOINTING = "Checkpointing"


class On(str, Enum):
    """What happened: the events of the table."""

    CREATE = "create"
    SUSPEND = "suspend"
    QUEUE = "queue"  # Kueue holds the job (its Workload is not admitted)
    EVICT = "evict"  # Kueue evicted the job's Workload
    RESUME = "resume"
    ALL_RUNNING = "all-running"
    RUNNING_AGAIN = "running-again"
    CHIEF_RESTART = "chief-restart"
    PS_RESTART = "ps-restart"
    SECRET_LOST = "secret-lost"
    PS_SCALED = "ps-scaled"
    CHIEF_SUCCEEDED = "chief-succeeded"
    ALL_WORKERS_SUCCEEDED = "all-workers-succeeded"
    INVALID_SPEC = "invalid-spec"
    INVALID_TEMPLATE = "invalid-template"
    REFUSED_SERVICE = "refused-service"  # the API server refused a Service built from the job
    REFUSED_POD_GROUP = "refused-pod-group"
    REFUSED_WORKLOAD = "refused-workload"
    BACKOFF_EXCEEDED = "backoff-exceeded"
    DEADLINE_EXCEEDED = "deadline-exceeded"
    CHIEF_FAILED = "chief-failed"  # for good: its policy does not retry it
    PS_FAILED = "ps-failed"
    WORKER_FAILED = "worker-failed"  # successPolicy AllWorkers: one worker failed for good
    ALL_WORKERS_FAILED = "all-workers-failed"
    # the elastic waits
    WORKER_DRAINED = "worker-drained"  # the chief's ack names a scaled-away worker draining no more
    #: the wait ends without the chief's word: past its deadline, or the chief gone or acknowledging no membership
    DRAIN_GIVEN_UP = "drain-given-up"
    PS_COUNT_CHANGED = "ps-count-changed"
    CHECKPOINT_SERVED = "checkpoint-served"
    #: the wait ends without the checkpoint: past its deadline, the chief gone, or the ps count changed back
    CHECKPOINT_GIVEN_UP = "checkpoint-given-up"


@dataclass(frozen=True)
class Row:
    """One move: from ``from_`` on ``on`` to ``to``, for ``reason`` (the condition's and the Event's, or ``note``
    for the Event), counted against ``backoffLimit`` or not."""

    from_: State
    on: On
    to: State
    reason: str = ""
    counted: bool = False
    #: the Event's reason, when it is not the condition's
    note: str = ""


@dataclass(frozen=True)
class Wait:
    """An elastic wait's deadline: seconds after it began (``deadline_s``), or ``unacked_deadline_s`` for a chief
    that has acknowledged no membership (a TensorFlow program: no kubeps ack comes)."""

    deadline_s: float
    unacked_deadline_s: float

    def left(self, elapsed_s: float, acked: bool = True) -> float:
        """Seconds left of the wait ``elapsed_s`` after it began (<= 0: over)."""
        return (self.deadline_s if acked else self.unacked_deadline_s) - elapsed_s


#: the elastic waits and their deadlines: a scaled-away worker is kept for the chief to drain it 120 s at most
#: (and not at all for a chief that acknowledges no membership); a ps count change waits for the checkpoint it
#: asked for 60 s at most (5 s for a chief that acknowledged no membership)
WAITS: Mapping[State, Wait] = MappingProxyType({
    State.DRAINING: Wait(120.0, 0.0),
    State.CHECKPOINTING: Wait(60.0, 5.0),
})

#: the phases in which a job runs (or is to): restarts, success and failures start there
ACTIVE = (State.CREATED, State.RUNNING, State.RESTARTING)
#: the phases before an end: a spec or template found bad, or the API server refusing what the job asks for, fails
#: the job from any of them
NOT_ENDED = (State.NEW, *ACTIVE, State.SUSPENDED)
#: the states of the job's phase (the rest are the elastic waits)
PHASES = (State.NEW, *ACTIVE, State.SUSPENDED, State.SUCCEEDED, State.FAILED)


def _rows(froms: Iterable[State], on: On, to: State, reason: str = "", counted: bool = False,
          note: str = "") -> list[Row]:
    return [Row(f, on, to, reason, counted, note) for f in froms]


_COUNTED_CHIEF = lifecycle.ROLES[lifecycle.CHIEF].counted
_COUNTED_PS = lifecycle.ROLES[lifecycle.PS].counted

#: every move, once
ROWS: tuple[Row, ...] = tuple([
    Row(State.NEW, On.CREATE, State.CREATED, R_CREATED),
    *_rows((*ACTIVE, State.SUSPENDED), On.SUSPEND, State.SUSPENDED, R_SUSPENDED),
    *_rows((*ACTIVE, State.SUSPENDED), On.QUEUE, State.SUSPENDED, R_QUEUED),
    *_rows((*ACTIVE, State.SUSPENDED), On.EVICT, State.SUSPENDED, R_EVICTED),
    Row(State.SUSPENDED, On.RESUME, State.CREATED, R_RESUMED),
    Row(State.CREATED, On.ALL_RUNNING, State.RUNNING, R_RUNNING),
    Row(State.RESTARTING, On.RUNNING_AGAIN, State.RUNNING, R_RUNNING),
    *_rows(ACTIVE, On.CHIEF_RESTART, State.RESTARTING, R_CHIEF_FAILED, _COUNTED_CHIEF, "ChiefRestarting"),
    *_rows(ACTIVE, On.PS_RESTART, State.RESTARTING, R_PS_FAILED, _COUNTED_PS, "PSRestarting"),
    *_rows(ACTIVE, On.SECRET_LOST, State.RESTARTING, R_SECRET_LOST),
    *_rows(ACTIVE, On.PS_SCALED, State.RESTARTING, R_PS_SCALED),
    *_rows(ACTIVE, On.CHIEF_SUCCEEDED, State.SUCCEEDED, R_SUCCEEDED),
    *_rows(ACTIVE, On.ALL_WORKERS_SUCCEEDED, State.SUCCEEDED, R_ALL_WORKERS_SUCCEEDED),
    *_rows(NOT_ENDED, On.INVALID_SPEC, State.FAILED, R_INVALID),
    *_rows(NOT_ENDED, On.INVALID_TEMPLATE, State.FAILED, R_INVALID_TEMPLATE),
    *_rows(NOT_ENDED, On.REFUSED_SERVICE, State.FAILED, "InvalidService"),
    *_rows(NOT_ENDED, On.REFUSED_POD_GROUP, State.FAILED, "InvalidPodGroup"),
    *_rows(NOT_ENDED, On.REFUSED_WORKLOAD, State.FAILED, "InvalidWorkload"),
    *_rows(ACTIVE, On.BACKOFF_EXCEEDED, State.FAILED, R_BACKOFF),
    *_rows(ACTIVE, On.DEADLINE_EXCEEDED, State.FAILED, R_DEADLINE),
    *_rows(ACTIVE, On.CHIEF_FAILED, State.FAILED, R_CHIEF_FAILED),
    *_rows(ACTIVE, On.PS_FAILED, State.FAILED, R_PS_FAILED),
    *_rows(ACTIVE, On.WORKER_FAILED, State.FAILED, R_WORKER_FAILED),
    *_rows(ACTIVE, On.ALL_WORKERS_FAILED, State.FAILED, R_ALL_WORKERS_FAILED),
    # the elastic waits: a scaled-away worker's pod is Draining from the moment the spec no longer names it
    Row(State.DRAINING, On.WORKER_DRAINED, State.SETTLED),
    Row(State.DRAINING, On.DRAIN_GIVEN_UP, State.SETTLED),
    Row(State.SETTLED, On.PS_COUNT_CHANGED, State.CHECKPOINTING, R_CHECKPOINT_REQUESTED),
    Row(State.CHECKPOINTING, On.CHECKPOINT_SERVED, State.SETTLED),
    Row(State.CHECKPOINTING, On.CHECKPOINT_GIVEN_UP, State.SETTLED),
])

#: the rows by ``(from, event)``
TABLE: Mapping[tuple[State, On], Row] = MappingProxyType({(r.from_, r.on): r for r in ROWS})

#: the events that hold a job (suspend it), by the reason of its Suspended condition
HOLDING: Mapping[str, On] = MappingProxyType({r.reason: r.on for r in ROWS if r.to is State.SUSPENDED
                                             and r.on is not On.RESUME})

#: the events that fail a job, by the reason of its Failed condition (the shell fails a job by reason)
FAILING: Mapping[str, On] = MappingProxyType({r.reason: r.on for r in ROWS if r.to is State.FAILED})


class TransitionError(ValueError):
    """A move the table does not name."""


def row(current: State, on: On) -> Row:
    """The row for ``on`` in state ``current``; :class:`TransitionError` when the table has none."""
    found = TABLE.get((current, on))
    if found is None:
        allowed = sorted(r.on.value for r in ROWS if r.from_ is current)
        raise TransitionError(f"job state table: no move on {on.value!r} from {current.value!r}; from "
                              f"{current.value!r} the table allows {', '.join(allowed) or 'nothing'}")
    return found


_BY_CONDITION = {ConditionType.FAILED: State.FAILED, ConditionType.SUCCEEDED: State.SUCCEEDED,
                 ConditionType.SUSPENDED: State.SUSPENDED, ConditionType.RESTARTING: State.RESTARTING,
                 ConditionType.RUNNING: State.RUNNING, ConditionType.CREATED: State.CREATED}


def phase_of(book: StatusBook) -> State:
    """The job's phase: the state its first true condition names (``status.state``), New with none."""
    state = book.state()
    return _BY_CONDITION[ConditionType(state)] if state else State.NEW
