"""The restart policy of ``kubeps local --restart``: a pure decision ("task X exited with status S after N
restarts: what now?") that :class:`~kubeps.runtime.local.restarting.RestartingLocalCluster` applies, restarting
tasks as the operator restarts pods. What an exit means (which exits restart what, which end the job) is the
lifecycle table the operator reads too (:mod:`kubeps.runtime.lifecycle`); this adds the switch (``restart``) and a
per-task budget with exponential backoff.
"""

from __future__ import annotations

from dataclasses import dataclass

from kubeps.runtime import lifecycle
from kubeps.runtime.checks import NonNegativeInt, NonNegativeSeconds, check

__all__ = ["Action", "RestartPolicy", "SupervisorEvent"]


@dataclass(frozen=True)
class Action:
    """One step of the policy's answer. ``kind``: ``restart`` a task after ``delay`` seconds, ``kill`` it (it will
    be restarted when its exit is seen), ``finish`` the job, ``fail`` it, or just ``report``."""

    kind: str
    task: tuple[str, int] | None = None
    delay: float = 0.0
    reason: str = ""


@dataclass(frozen=True)
class RestartPolicy:
    """Which failed tasks come back, how often and how soon (exponential backoff per task)."""

    restart: bool = True
    max_restarts: int = 20
    backoff_initial: float = 0.2
    backoff_max: float = 10.0

    def __post_init__(self) -> None:
        check("max_restarts", self.max_restarts, NonNegativeInt, owner="RestartPolicy")
        for name in ("backoff_initial", "backoff_max"):
            check(name, getattr(self, name), NonNegativeSeconds, owner="RestartPolicy")

    def backoff(self, restarts: int) -> float:
        """Delay before restart number ``restarts + 1`` of a task."""
        return min(self.backoff_max, self.backoff_initial * (2 ** restarts)) if restarts else 0.0

    def on_exit(self, task_type: str, index: int, status: int, restarts: int) -> list[Action]:
        """What to do when task ``(task_type, index)`` exited with ``status`` after ``restarts`` restarts: the
        lifecycle table's decision (:func:`kubeps.runtime.lifecycle.decide`, under the role's own policy), within
        this policy's switch and per-task budget."""
        task = (task_type, index)
        name = f"{task_type}-{index}"
        decision = lifecycle.decide(task_type, lifecycle.exit_class(status))
        role = lifecycle.ROLES[task_type]
        who = f"the {task_type}" if role.decides_job else name
        if decision.outcome == lifecycle.SUCCEEDED:
            return [Action("finish", task, reason=f"{who} succeeded")]
        if not decision.restarts:
            if decision.outcome == lifecycle.FAILED:
                return [Action("fail", task, reason=f"{who} exited with permanent status {status}")]
            return [Action("report", task, reason=f"{name} finished")]
        if not self.restart:
            if role.decides_job:
                return [Action("fail", task, reason=f"{who} exited with status {status} and restarts are off")]
            return [Action("report", task, reason=f"{name} exited with status {status}; restarts are off")]
        if restarts >= self.max_restarts:
            spent = f"{name} was restarted {restarts} time(s) already (max_restarts={self.max_restarts})"
            if role.vital:
                return [Action("fail", task, reason=spent)]
            return [Action("report", task, reason=spent + "; not restarting it")]
        why = (f"{who} exited with retryable status {status}" if role.decides_job
               else f"{name} exited with status {status}")
        return [Action("restart", task, self.backoff(restarts), why)] + [
            Action("kill", (other, 0), reason=f"{name} lost its variables: the {other} restarts from the latest "
                                              "checkpoint")
            for other in decision.restarts[1:]]


@dataclass
class SupervisorEvent:
    """A failure or a restart, for logs and for measuring recovery."""

    time: float
    kind: str  # "exit", "restart", "kill", "finish", "fail"
    task: str
    status: int | None = None
    reason: str = ""
