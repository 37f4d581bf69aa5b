"""The lifecycle table: what one task's exit means, for every role and class of exit, declared once as data.

Both restarters read it: ``kubeps local --restart`` (:meth:`kubeps.runtime.local.policy.RestartPolicy.on_exit`)
and the operator's planner (``kubeps.operator.core.restarts``). Three tables:

* :data:`EXIT_CLASSES` by :func:`exit_class`: an exit is a ``success`` (0), ``retryable`` (128-255,
  :func:`~kubeps.runtime.contract.is_retryable_exit`) or ``permanent`` (1-127);
* :data:`POLICIES`: which exit classes each restart policy restarts the task for (the names are the operator's
  ``restartPolicy`` values: ``Never``, ``OnFailure``, ``ExitCode``, ``Always``);
* :data:`ROLES`: per role (chief, ps, worker, evaluator) its default policy (``kubeps local``'s; a replica's
  ``restartPolicy`` replaces it in the operator), what restarts with it (a ps: the chief, which restores the latest
  checkpoint), whether its restarts count against the job's restart budget (the operator's ``backoffLimit``),
  whether its exit decides the job (the chief: its success ends it), and whether the job fails when the task ends
  for good (the chief and a ps: the job cannot go on without them; a worker's or the evaluator's end leaves it
  running).

:func:`decide` reads them for one exit: ``decide("ps", "permanent")`` restarts the ps and the chief, counted.

>>> decide("ps", PERMANENT).restarts, decide("chief", PERMANENT).outcome, decide("worker", SUCCESS).restarts
(('ps', 'chief'), 'failed', ())

Pure data and two functions: no I/O, no third-party import.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from kubeps.runtime.contract import is_retryable_exit

__all__ = [
    "CHIEF",
    "EVALUATOR",
    "EXIT_CLASSES",
    "FAILED",
    "PERMANENT",
    "POLICIES",
    "PS",
    "RETRYABLE",
    "ROLES",
    "SUCCEEDED",
    "SUCCESS",
    "WORKER",
    "Decision",
    "Role",
    "decide",
    "exit_class",
]

# -- exit classes --------------------------------------------------------------------------------------------------
SUCCESS = "success"
RETRYABLE = "retryable"
PERMANENT = "permanent"
EXIT_CLASSES = (SUCCESS, RETRYABLE, PERMANENT)


def exit_class(status: int) -> str:
    """The class of an exit status: 0 a success, 128-255 retryable, any other permanent."""
    if status == 0:
        return SUCCESS
    return RETRYABLE if is_retryable_exit(status) else PERMANENT


# -- restart policies: the exit classes each restarts the task for --------------------------------------------------
POLICIES: Mapping[str, frozenset[str]] = MappingProxyType({
    "Never": frozenset(),
    "OnFailure": frozenset({RETRYABLE, PERMANENT}),
    "ExitCode": frozenset({RETRYABLE}),
    "Always": frozenset({SUCCESS, RETRYABLE, PERMANENT}),
})

# -- roles ---------------------------------------------------------------------------------------------------------
CHIEF = "chief"
PS = "ps"
WORKER = "worker"
EVALUATOR = "evaluator"

#: the job's outcomes an exit may decide
SUCCEEDED = "succeeded"
FAILED = "failed"


@dataclass(frozen=True)
class Role:
    """What a task of one role means to the job."""

    #: the restart policy of ``kubeps local`` (a key of :data:`POLICIES`); the operator's replica spec names its own
    policy: str
    #: the roles restarted with it (their task 0): a ps holds variables only the chief can restore
    restarts_with: tuple[str, ...] = ()
    #: its restarts count against the job's restart budget (the operator's ``backoffLimit``)
    counted: bool = False
    #: its exit decides the job: a success ends the job, succeeded
    decides_job: bool = False
    #: the job fails when the task ends for good (a failure its policy does not restart, or a spent budget)
    vital: bool = False


ROLES: Mapping[str, Role] = MappingProxyType({
    CHIEF: Role(policy="ExitCode", counted=True, decides_job=True, vital=True),
    PS: Role(policy="Always", restarts_with=(CHIEF,), counted=True, vital=True),
    WORKER: Role(policy="OnFailure"),
    EVALUATOR: Role(policy="OnFailure"),
})


@dataclass(frozen=True)
class Decision:
    """What one exit of one task means."""

    #: the roles restarted (the task's own first, then those restarted with it); () when the task is not restarted
    restarts: tuple[str, ...]
    #: the restart counts against the job's restart budget
    counted: bool
    #: the job's outcome this exit decides (:data:`SUCCEEDED`, :data:`FAILED`), or None: the job goes on
    outcome: str | None


def decide(role: str, exit: str, policy: str | None = None) -> Decision:
    """What an exit of class ``exit`` of a task of ``role`` means under ``policy`` (default: the role's own)."""
    try:
        spec = ROLES[role]
    except KeyError:
        raise ValueError(f"lifecycle: role={role!r} is unknown; allowed are {', '.join(ROLES)}") from None
    if exit not in EXIT_CLASSES:
        raise ValueError(f"lifecycle: exit={exit!r} is unknown; allowed are {', '.join(EXIT_CLASSES)}")
    name = spec.policy if policy is None else policy
    if name not in POLICIES:
        raise ValueError(f"lifecycle: policy={name!r} is unknown; allowed are {', '.join(POLICIES)}")
    if exit == SUCCESS and spec.decides_job:
        return Decision((), False, SUCCEEDED)
    if exit in POLICIES[name]:
        return Decision((role, *spec.restarts_with), spec.counted, None)
    return Decision((), False, FAILED if spec.vital and exit != SUCCESS else None)
