"""``RestartingLocalCluster``: ``kubeps local --restart``, the operator's restart behaviour on one machine.

A plain subclass of :class:`~kubeps.runtime.local.launcher.LocalCluster` that applies
:class:`~kubeps.runtime.local.policy.RestartPolicy` (the lifecycle table within a per-task budget): failed workers
and evaluators are restarted, a failed ps is restarted together with the chief, and a chief exiting with a
retryable status is restarted. Every failure and restart is recorded in ``events`` with its time,
which is how the chaos tests measure detection and recovery.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

from kubeps.runtime.errors import RemoteError
from kubeps.runtime.local.launcher import LocalCluster
from kubeps.runtime.local.processes import TaskProcess
from kubeps.runtime.rpc.client import Client
from kubeps.runtime.rpc.protocol import PING, PS_SERVICE
from kubeps.runtime.rpc.tls import load_tls
from kubeps.runtime.local.policy import Action, RestartPolicy, SupervisorEvent

__all__ = ["RestartingLocalCluster"]


class RestartingLocalCluster(LocalCluster):
    """A :class:`~kubeps.runtime.local.launcher.LocalCluster` that applies a :class:`RestartPolicy` (``kubeps local
    --restart``); ``policy`` defaults to ``RestartPolicy()``.

    For ``run_local(cluster_factory=...)`` with another policy: ``functools.partial(RestartingLocalCluster,
    policy=...)``.
    """

    def __init__(self, *args: Any, policy: RestartPolicy | None = None, ps_ready_timeout: float = 30.0,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)  # evaluator_grace: LocalCluster.wait lets the evaluator finish
        self.policy = policy or RestartPolicy()
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
                assert action.task is not None, "the policy names the task of every restart"
                self.restarts[action.task] = self.restarts.get(action.task, 0) + 1
                self.report(f"restarting {name} in {action.delay:.1f} s ({action.reason}; restart "
                            f"{self.restarts[action.task]})")
                self._schedule_restart(action.task, action.delay)
            elif action.kind == "kill":
                task = self.tasks.get(action.task) if action.task is not None else None
                if task is not None and task.running:
                    self.report(f"stopping {name}: {action.reason}")
                    self._record("kill", name, reason=action.reason)
                    self.processes.signal_group(task, signal.SIGKILL)  # still running: its process group is ours
            elif action.kind == "report":
                self.report(action.reason)
            elif action.kind in ("finish", "fail"):
                self._record(action.kind, name, reason=action.reason)
                if action.kind == "fail":
                    self.report(f"the job failed: {action.reason}")
                    self._job_failed = action.reason
                    chief = self.tasks.get(("chief", 0))
                    if action.task != ("chief", 0) and chief is not None and chief.running:
                        # the job is over: wait() returns once it exits
                        self.processes.signal_group(chief, signal.SIGKILL)
        return None

    def _parameter_servers_answer(self, timeout: float) -> bool:
        """Wait until every ps task runs and answers a Ping (a restarted chief restores into them at once)."""
        deadline = time.monotonic() + timeout
        for index, address in enumerate(self.cluster.get("ps", [])):
            client = Client(address, PS_SERVICE, self.job_token, timeout=1.0, tls=load_tls(self.settings))
            try:
                while True:
                    task = self.tasks.get(("ps", index))
                    if task is not None and task.running:
                        try:
                            client.call(PING, timeout=1.0)
                            break
                        except RemoteError:
                            pass
                    if time.monotonic() > deadline or self.processes.stopping:
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

    def on_task_exit(self, task: TaskProcess) -> int | None:  # called by LocalCluster.wait for every non-chief exit
        task.exit_handled = True
        self._record("exit", task.name, task.status)
        key = (task.task_type, task.index)
        self._apply(self.policy.on_exit(task.task_type, task.index, task.status, self.restarts.get(key, 0)))
        return None  # the policy restarted what it restarts: the run goes on

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
