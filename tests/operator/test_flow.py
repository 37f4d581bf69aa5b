"""The job state table (operator/core/flow.py): every row is reachable from a new job, every row is applied by
``Draft.move`` as written (the state it leads to, its reason on the condition and the Event, its count against
backoffLimit), every move the table does not name is refused, and every event is one some rule of the planner
raises."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kubeps.operator.api.models import ConditionType
from kubeps.operator.core import actions as A
from kubeps.operator.core import flow
from kubeps.operator.core.draft import Draft
from kubeps.operator.core.flow import ROWS, TABLE, WAITS, On, Row, State, TransitionError

from .test_planner import NOW, make_job, observe

CORE = Path(__file__).resolve().parents[2] / "operator" / "core"

#: the conditions that put a job in each phase (as the status shows them)
_CONDITIONS = {
    State.NEW: [],
    State.CREATED: [("Created", "True")],
    State.RUNNING: [("Created", "True"), ("Running", "True")],
    State.RESTARTING: [("Created", "True"), ("Restarting", "True"), ("Running", "False")],
    State.SUSPENDED: [("Created", "True"), ("Suspended", "True"), ("Running", "False")],
    State.SUCCEEDED: [("Created", "True"), ("Succeeded", "True")],
    State.FAILED: [("Created", "True"), ("Failed", "True")],
}
_ELASTIC = (State.SETTLED, State.DRAINING, State.CHECKPOINTING)


def draft_in(state: State) -> Draft:
    """A draft of a job in ``state`` (a phase by its conditions; Checkpointing by an outstanding request)."""
    status: dict = {"conditions": [{"type": t, "status": s, "reason": "Before", "message": "before"}
                                   for t, s in _CONDITIONS.get(state, _CONDITIONS[State.RUNNING])],
                    "backoffCount": 1}
    if state is State.CHECKPOINTING:
        status.update(checkpointRequest=2, checkpointRequestTime="2025-01-01T11:59:00Z")
    return Draft(observe(make_job(status=status)))


def test_the_table_names_each_move_once_and_only_between_known_states():
    assert len(TABLE) == len(ROWS)
    for r in ROWS:
        assert (r.from_ in flow.PHASES) == (r.to in flow.PHASES), r  # a row stays in its kind of state
    assert set(WAITS) == {State.DRAINING, State.CHECKPOINTING}


def test_every_row_is_reachable_from_a_new_job():
    reached, frontier = {State.NEW, State.SETTLED}, [State.NEW, State.SETTLED]
    while frontier:
        state = frontier.pop()
        for r in ROWS:
            if r.from_ is state and r.to not in reached:
                reached.add(r.to)
                frontier.append(r.to)
    # Draining has no row in: a scaled-away worker's pod is Draining from the moment the spec no longer names it
    assert {r.from_ for r in ROWS} <= reached | {State.DRAINING}
    assert set(State) == reached | {State.DRAINING}


@pytest.mark.parametrize("r", ROWS, ids=lambda r: f"{r.from_.value}-{r.on.value}")
def test_every_row_is_applied_as_written(r: Row):
    d = draft_in(r.from_)
    current = None if r.from_ in flow.PHASES else r.from_
    applied = d.move(r.on, "why", current=current, settled_message="settled")
    assert applied is r
    assert d.status.backoffCount == 1 + int(r.counted)
    events = d.plan.of(A.Event)
    if r.from_ in flow.PHASES:
        assert d.phase is r.to
        if r.to is not r.from_:  # the condition the row flips carries its reason (Resumed: Suspended, now False)
            flipped = ConditionType.SUSPENDED if r.on is On.RESUME else ConditionType(d.book.state())
            cond = d.book.condition(flipped)
            assert cond is not None and (cond.reason, cond.message) == (r.reason, "why")
            assert [(e.reason, e.message) for e in events] == [(r.note or r.reason, "why")]
        if r.to in (State.SUCCEEDED, State.FAILED):
            assert not d.book.is_true(ConditionType.RUNNING) and not d.book.is_true(ConditionType.RESTARTING)
            assert d.status.completionTime is not None
    elif r.to is State.CHECKPOINTING:
        assert [(e.reason, e.message) for e in events] == [(r.reason, "why")]
    else:
        assert events == []
        assert d.status.checkpointRequest is None and d.status.checkpointRequestTime is None


@pytest.mark.parametrize("state", list(State))
def test_every_move_the_table_does_not_name_is_refused(state: State):
    for on in On:
        if (state, on) in TABLE:
            continue
        d = draft_in(state)
        before = d.status.model_dump()
        with pytest.raises(TransitionError, match=f"no move on '{on.value}' from '{state.value}'"):
            d.move(on, "why", current=None if state in flow.PHASES else state)
        assert d.status.model_dump() == before and d.plan.actions == []


def test_the_shell_fails_a_job_by_the_reason_of_a_failing_row():
    d = draft_in(State.RUNNING)
    d.fail("InvalidWorkload", "Kueue refused it")
    assert d.phase is State.FAILED and d.status.conditions[-1].reason == "InvalidWorkload"
    assert set(flow.FAILING) == {r.reason for r in ROWS if r.to is State.FAILED}


def test_every_event_is_raised_by_a_rule_of_the_planner():
    source = "\n".join(p.read_text() for p in CORE.glob("*.py") if p.name != "flow.py")
    raised = set(re.findall(r"On\.([A-Z_]+)", source))
    by_table = {on.name for on in On if on not in (*flow.FAILING.values(), *flow.HOLDING.values())}
    assert by_table - raised == set()
    # the failing and holding events are raised by reason (Draft.fail, timeline.hold): each reason is one in use
    assert {"Queued", "Evicted", "Suspended"} == set(flow.HOLDING)


def test_a_wait_s_deadline_is_data():
    draining, checkpointing = WAITS[State.DRAINING], WAITS[State.CHECKPOINTING]
    assert (draining.deadline_s, checkpointing.deadline_s, checkpointing.unacked_deadline_s) == (120.0, 60.0, 5.0)
    assert checkpointing.left(59.0) == 1.0 and checkpointing.left(4.0, acked=False) == 1.0
    assert draining.left(0.0, acked=False) <= 0  # a chief that acknowledges nothing is not waited for
    assert NOW  # the drafts above read the planner tests' clock
