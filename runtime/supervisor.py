"""What happens when a task fails: the exit-code contract of the chief, and the restart policy of ``kubeps local``.

The contract (the same in Kubernetes and locally):

- A worker that fails is restarted at the same address; the coordinator re-queues its closures and rebuilds its
  datasets when it comes back. Training goes on.
- A parameter server that fails loses its variables. The chief cannot recover in place: schedule/join/done raise
  :class:`~kubeps.runtime.errors.PSUnavailableError` and the chief exits with :data:`EXIT_PS_UNAVAILABLE` (133).
  Exit codes >= 128 are *retryable* for the operator's default ``ExitCode`` restart policy (as for Kubeflow's
  training operators: 1-127 permanent, 128-255 retryable), so the chief is restarted, re-creates its variables and
  restores the latest checkpoint; at most the steps since that checkpoint are lost.
- The chief exiting 0 ends the job; 1-127 fails it.

:func:`run_coordinator` gives a training program that behaviour: it runs ``main_fn`` and turns a
``PSUnavailableError`` into exit status 133. :func:`install_excepthook` does the same for programs that do not wrap
their main function.

:class:`RestartPolicy` is the pure decision table ("task X exited with status S after N restarts: what now?");
:class:`~kubeps.runtime.restarting.RestartingLocalCluster`, next to the launcher, applies it to ``kubeps local
--restart``.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from .errors import PSUnavailableError

__all__ = [
    "EXIT_PS_UNAVAILABLE",
    "Action",
    "RestartPolicy",
    "SupervisorEvent",
    "install_excepthook",
    "is_retryable_exit",
    "ps_unavailable_cause",
    "run_coordinator",
]

log = logging.getLogger(__name__)

#: Exit status of a chief that lost a parameter server: retryable (>= 128), not a signal number the kernel uses
#: for crashes kubeps can produce by itself (134 abort, 137 kill/OOM, 139 segfault, 143 term).
EXIT_PS_UNAVAILABLE = 133


def is_retryable_exit(status: int) -> bool:
    """Exit statuses 128-255 (signals, :data:`EXIT_PS_UNAVAILABLE`) are retryable; 1-127 are permanent."""
    return 128 <= status <= 255


def ps_unavailable_cause(exc: BaseException | None) -> PSUnavailableError | None:
    """The :class:`PSUnavailableError` in ``exc``'s cause/context chain, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, PSUnavailableError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _exit_for_ps_loss(err: PSUnavailableError, exit: Callable[[int], Any]) -> Any:
    sys.stderr.write(
        f"kubeps: {err}\nkubeps: the chief exits with status {EXIT_PS_UNAVAILABLE} (retryable): restart it after the "
        "parameter server is back, and it resumes from the latest checkpoint\n"
    )
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream
            pass
    return exit(EXIT_PS_UNAVAILABLE)


def run_coordinator(main_fn: Callable[[], Any], *, hard_exit: bool = True) -> Any:
    """Run the chief's ``main_fn``; a lost parameter server ends the process with :data:`EXIT_PS_UNAVAILABLE`.

    With ``hard_exit`` (default) the process ends at once with ``os._exit`` after printing the error and flushing
    stdout/stderr: coordinator threads blocked on a dead parameter server cannot delay it past the detection
    budget. Other exceptions propagate unchanged (exit status 1: permanent).
    """
    try:
        return main_fn()
    except BaseException as exc:  # noqa: BLE001 - inspected, re-raised unless it is a PS loss
        err = ps_unavailable_cause(exc)
        if err is None:
            raise
        traceback.print_exc()
        return _exit_for_ps_loss(err, os._exit if hard_exit else sys.exit)


def install_excepthook() -> None:
    """Make an uncaught :class:`PSUnavailableError` (in the main thread) exit with :data:`EXIT_PS_UNAVAILABLE`."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        err = ps_unavailable_cause(exc)
        if err is not None:
            _exit_for_ps_loss(err, os._exit)

    sys.excepthook = hook


# -- the restart policy -----------------------------------------------------------------------------------------
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
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"RestartPolicy: max_restarts={self.max_restarts!r} is invalid; allowed is an int >= 0")
        for name in ("backoff_initial", "backoff_max"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"RestartPolicy: {name}={value!r} is invalid; allowed is a number of seconds >= 0")

    def backoff(self, restarts: int) -> float:
        """Delay before restart number ``restarts + 1`` of a task."""
        return min(self.backoff_max, self.backoff_initial * (2 ** restarts)) if restarts else 0.0

    def on_exit(self, task_type: str, index: int, status: int, restarts: int) -> list[Action]:
        """What to do when task ``(task_type, index)`` exited with ``status`` after ``restarts`` restarts."""
        task = (task_type, index)
        name = f"{task_type}-{index}"
        budget = self.restart and restarts < self.max_restarts
        spent = f"{name} was restarted {restarts} time(s) already (max_restarts={self.max_restarts})"
        if task_type == "chief":
            if status == 0:
                return [Action("finish", task, reason="the chief succeeded")]
            if not is_retryable_exit(status):
                return [Action("fail", task, reason=f"the chief exited with permanent status {status}")]
            if not self.restart:
                return [Action("fail", task, reason=f"the chief exited with status {status} and restarts are off")]
            if not budget:
                return [Action("fail", task, reason=spent)]
            return [Action("restart", task, self.backoff(restarts), f"the chief exited with retryable status {status}")]
        if task_type == "ps":
            if not self.restart:
                return [Action("report", task, reason=f"{name} exited with status {status}; restarts are off")]
            if not budget:
                return [Action("fail", task, reason=spent)]
            return [
                Action("restart", task, self.backoff(restarts), f"{name} exited with status {status}"),
                Action("kill", ("chief", 0), reason=f"{name} lost its variables: the chief restarts from the "
                                                    "latest checkpoint"),
            ]
        # workers and the evaluator
        if status == 0:
            return [Action("report", task, reason=f"{name} finished")]
        if not self.restart:
            return [Action("report", task, reason=f"{name} exited with status {status}; restarts are off")]
        if not budget:
            return [Action("report", task, reason=spent + "; not restarting it")]
        return [Action("restart", task, self.backoff(restarts), f"{name} exited with status {status}")]


@dataclass
class SupervisorEvent:
    """A failure or a restart, for logs and for measuring recovery."""

    time: float
    kind: str  # "exit", "restart", "kill", "finish", "fail"
    task: str
    status: int | None = None
    reason: str = ""
