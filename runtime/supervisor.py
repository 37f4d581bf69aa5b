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

:class:`RestartPolicy` is the pure decision table ("task X exited with status S after N restarts: what now?"),
:class:`RestartingLocalCluster` applies it to :class:`kubeps.runtime.launcher.LocalCluster` (``kubeps local
--restart``): failed workers and evaluators are restarted, a failed ps is restarted together with the chief, and a
chief exiting with a retryable status is restarted. Every failure and restart is recorded in ``events`` with its
time, which is how the chaos tests measure detection and recovery.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from .errors import PSUnavailableError

__all__ = [
    "EXIT_PS_UNAVAILABLE",
    "Action",
    "RestartPolicy",
    "RestartingLocalCluster",
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


def _local_cluster_class():
    from .launcher import LocalCluster  # noqa: PLC0415 - the launcher sits above this module

    return LocalCluster


def restarting_cluster_class(policy: RestartPolicy | None = None):
    """A :class:`LocalCluster` subclass that applies ``policy`` (for ``run_local(cluster_factory=...)``)."""
    base = _local_cluster_class()

    class _Restarting(RestartingLocalClusterMixin, base):  # type: ignore[misc, valid-type]
        pass

    _Restarting.__name__ = "RestartingLocalCluster"
    _Restarting.default_policy = policy or RestartPolicy()
    return _Restarting


class RestartingLocalClusterMixin:
    """The restart behaviour, mixed into :class:`~kubeps.runtime.launcher.LocalCluster`."""

    default_policy: RestartPolicy = RestartPolicy()

    def __init__(self, *args: Any, policy: RestartPolicy | None = None, ps_ready_timeout: float = 30.0,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)  # evaluator_grace: LocalCluster.wait lets the evaluator finish
        self.policy = policy or self.default_policy
        #: how long a restarting chief waits for every parameter server to answer a Ping (0: not at all)
        self.ps_ready_timeout = ps_ready_timeout
        self.restarts: dict[tuple[str, int], int] = {}
        self.events: list[SupervisorEvent] = []
        self._events_lock = threading.Lock()
        self._timers: list[threading.Timer] = []
        self._job_failed: str | None = None

    def _record(self, kind: str, task: str, status: int | None = None, reason: str = "",
                at: float | None = None) -> None:
        with self._events_lock:
            self.events.append(SupervisorEvent(time.time() if at is None else at, kind, task, status, reason))

    def _apply(self, actions: list[Action]) -> int | None:
        """Carry out the policy's actions; returns an exit status when the job is over."""
        for action in actions:
            name = f"{action.task[0]}-{action.task[1]}" if action.task else "job"
            if action.kind == "restart":
                self.restarts[action.task] = self.restarts.get(action.task, 0) + 1
                self.report(f"restarting {name} in {action.delay:.1f} s ({action.reason}; restart "
                            f"{self.restarts[action.task]})")
                self._schedule_restart(action.task, action.delay)
            elif action.kind == "kill":
                task = self.tasks.get(action.task)
                if task is not None and task.running:
                    self.report(f"stopping {name}: {action.reason}")
                    self._record("kill", name, reason=action.reason)
                    try:
                        os.killpg(task.pid, signal.SIGKILL)  # still running: its process group is ours
                    except (ProcessLookupError, PermissionError):
                        pass
            elif action.kind == "report":
                self.report(action.reason)
            elif action.kind in ("finish", "fail"):
                self._record(action.kind, name, reason=action.reason)
                if action.kind == "fail":
                    self.report(f"the job failed: {action.reason}")
                    self._job_failed = action.reason
                    chief = self.tasks.get(("chief", 0))
                    if action.task != ("chief", 0) and chief is not None and chief.running:
                        try:
                            os.killpg(chief.pid, signal.SIGKILL)  # the job is over: wait() returns once it exits
                        except (ProcessLookupError, PermissionError):
                            pass
        return None

    def _parameter_servers_answer(self, timeout: float) -> bool:
        """Wait until every ps task runs and answers a Ping (a restarted chief restores into them at once)."""
        from .errors import RemoteError  # noqa: PLC0415
        from .rpc import PS_SERVICE, Client  # noqa: PLC0415

        deadline = time.monotonic() + timeout
        for index, address in enumerate(self.cluster.get("ps", [])):
            client = Client(address, PS_SERVICE, self.job_token, timeout=1.0)
            try:
                while True:
                    task = self.tasks.get(("ps", index))
                    if task is not None and task.running:
                        try:
                            client.call("Ping", timeout=1.0)
                            break
                        except RemoteError:
                            pass
                    if time.monotonic() > deadline or self._stopping:
                        return False
                    time.sleep(0.05)
            finally:
                client.close()
        return True

    def _schedule_restart(self, key: tuple[str, int], delay: float) -> None:
        def go() -> None:
            if key[0] == "chief" and self.ps_ready_timeout > 0 \
                    and not self._parameter_servers_answer(self.ps_ready_timeout):
                self.report(f"the parameter servers did not answer within {self.ps_ready_timeout:.0f} s; "
                            "restarting the chief anyway")
            try:
                task = self.start_task(*key)
            except Exception as err:  # noqa: BLE001 - the cluster is stopping, or the start failed
                self.report(f"could not restart {key[0]}-{key[1]}: {err}")
                return
            self._record("restart", task.name, reason=f"pid {task.pid}")

        if delay <= 0 and key[0] != "chief":
            go()
        else:  # the chief waits for the parameter servers in its own thread: wait() keeps handling exits
            timer = threading.Timer(delay, go)
            timer.daemon = True
            self._timers.append(timer)
            timer.start()

    def on_task_exit(self, task) -> None:  # called by LocalCluster.wait for every non-chief exit
        from .launcher import exit_status  # noqa: PLC0415

        task.exit_handled = True
        status = exit_status(task.returncode if task.returncode is not None else -1)
        self._record("exit", task.name, status)
        key = (task.task_type, task.index)
        self._apply(self.policy.on_exit(task.task_type, task.index, status, self.restarts.get(key, 0)))

    def wait(self, timeout: float | None = None) -> int:
        """Until the job is over: the chief succeeds, fails permanently, or runs out of restarts."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            status = super().wait(remaining)
            self._record("exit", "chief-0", status, at=self.chief_exit_time)
            if self._job_failed is not None:
                return status if status else 1
            actions = self.policy.on_exit("chief", 0, status, self.restarts.get(("chief", 0), 0))
            self._apply(actions)
            if any(a.kind == "finish" for a in actions):
                return status
            if any(a.kind == "fail" for a in actions):
                return status

    def stop(self) -> None:
        for timer in self._timers:
            timer.cancel()
        super().stop()


def __getattr__(name: str):
    # ``RestartingLocalCluster`` is built on first use: the launcher module imports lazily (layering)
    if name == "RestartingLocalCluster":
        cls = restarting_cluster_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
