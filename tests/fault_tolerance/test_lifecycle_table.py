"""The lifecycle table (kubeps.runtime.lifecycle), row by row, and ``kubeps local --restart`` following it. The
operator's planner is checked against the same table in tests/operator/test_planner.py."""

from __future__ import annotations

import dataclasses

import pytest

from kubeps.runtime import lifecycle as L
from kubeps.runtime.contract import EXIT_PS_UNAVAILABLE
from kubeps.runtime.local.policy import RestartPolicy

#: every role x class of exit under the role's own policy: (what restarts, counted, the job's outcome)
TABLE = {
    ("chief", L.SUCCESS): ((), False, L.SUCCEEDED),
    ("chief", L.RETRYABLE): (("chief",), True, None),
    ("chief", L.PERMANENT): ((), False, L.FAILED),
    ("ps", L.SUCCESS): (("ps", "chief"), True, None),
    ("ps", L.RETRYABLE): (("ps", "chief"), True, None),
    ("ps", L.PERMANENT): (("ps", "chief"), True, None),
    ("worker", L.SUCCESS): ((), False, None),
    ("worker", L.RETRYABLE): (("worker",), False, None),
    ("worker", L.PERMANENT): (("worker",), False, None),
    ("evaluator", L.SUCCESS): ((), False, None),
    ("evaluator", L.RETRYABLE): (("evaluator",), False, None),
    ("evaluator", L.PERMANENT): (("evaluator",), False, None),
}
#: an exit status of each class
STATUS = {L.SUCCESS: 0, L.RETRYABLE: EXIT_PS_UNAVAILABLE, L.PERMANENT: 1}


def test_the_table_covers_every_role_and_exit():
    assert set(TABLE) == {(role, exit) for role in L.ROLES for exit in L.EXIT_CLASSES}


@pytest.mark.parametrize("role, exit", list(TABLE))
def test_each_exit_of_each_role(role, exit):
    assert dataclasses.astuple(L.decide(role, exit)) == TABLE[role, exit]


@pytest.mark.parametrize("policy, restarted", [
    ("Never", set()),
    ("OnFailure", {L.RETRYABLE, L.PERMANENT}),
    ("ExitCode", {L.RETRYABLE}),
    ("Always", {L.SUCCESS, L.RETRYABLE, L.PERMANENT}),
])
def test_a_policy_restarts_the_classes_it_names(policy, restarted):
    for role in ("ps", "worker"):
        assert {e for e in L.EXIT_CLASSES if L.decide(role, e, policy).restarts} == restarted
    # a vital role's failure that its policy does not restart fails the job; a worker's leaves it running
    assert [L.decide("ps", e, policy).outcome for e in (L.RETRYABLE, L.PERMANENT)] == [
        None if e in restarted else L.FAILED for e in (L.RETRYABLE, L.PERMANENT)]
    assert all(L.decide("worker", e, policy).outcome is None for e in L.EXIT_CLASSES)


@pytest.mark.parametrize("status, exit", [(0, L.SUCCESS), (1, L.PERMANENT), (127, L.PERMANENT),
                                          (128, L.RETRYABLE), (137, L.RETRYABLE), (255, L.RETRYABLE),
                                          (256, L.PERMANENT), (-9, L.PERMANENT)])
def test_exit_classes_follow_the_pod_contract(status, exit):
    assert L.exit_class(status) == exit


@pytest.mark.parametrize("role, exit, policy, field", [
    ("master", L.SUCCESS, None, "role='master'"),
    ("worker", "crashed", None, "exit='crashed'"),
    ("worker", L.SUCCESS, "Sometimes", "policy='Sometimes'"),
])
def test_an_unknown_name_is_named_with_what_is_allowed(role, exit, policy, field):
    with pytest.raises(ValueError, match="allowed are") as err:
        L.decide(role, exit, policy)
    assert field in str(err.value)


@pytest.mark.parametrize("role, exit", list(TABLE))
def test_kubeps_local_follows_the_table(role, exit):
    actions = RestartPolicy().on_exit(role, 0, STATUS[exit], restarts=0)
    restarts, _, outcome = TABLE[role, exit]
    assert tuple(a.task[0] for a in actions if a.kind in ("restart", "kill")) == restarts
    assert [a.kind for a in actions if a.kind in ("finish", "fail")] == (
        ["finish"] if outcome == L.SUCCEEDED else ["fail"] if outcome == L.FAILED else [])


@pytest.mark.parametrize("role", list(L.ROLES))
def test_kubeps_local_gives_up_on_a_spent_budget_as_the_table_says(role):
    """A task out of restarts ends for good: the job fails for a vital role, goes on for another."""
    exit = L.RETRYABLE
    [action] = RestartPolicy(max_restarts=2).on_exit(role, 0, STATUS[exit], restarts=2)
    assert action.kind == ("fail" if L.ROLES[role].vital else "report")
