"""The processes of a local job's tasks: started, their output pumped, their exits observed, signalled and reaped.

Each task runs in its own session (process group). Its exit is observed with ``waitid(WNOWAIT)``, which leaves it
unreaped, so its process group id stays reserved until :meth:`TaskLauncher.stop` has signalled the group and
reaped the task. A signal that arrives while a process is being started is held until the process is tracked
(:meth:`TaskLauncher.on_signal`), so no task is left behind by a ^C at the wrong moment.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Sequence

from kubeps.runtime.local.console import Console
from kubeps.runtime.local.errors import LauncherError

__all__ = ["Signalled", "TaskLauncher", "TaskProcess", "exit_status"]


def exit_status(returncode: int | None) -> int:
    """A shell-style exit status: the code itself, or ``128 + signal`` for a process killed by a signal (None,
    unknown, counts as killed by signal 1)."""
    code = -1 if returncode is None else returncode
    return 128 - code if code < 0 else code


@dataclass
class TaskProcess:
    """A running (or finished) task of the local cluster."""

    task_type: str
    index: int
    address: str
    popen: subprocess.Popen
    #: the exit code once the process has exited (negative: killed by that signal), as Popen reports it
    returncode: int | None = None
    output_thread: threading.Thread | None = None
    waiter_thread: threading.Thread | None = None
    reaped: bool = False
    #: its exit was reported (or handled by a restart policy): not to be reported again
    exit_handled: bool = False
    #: scaled away: stopped by the launcher after the chief drained it, not a failure
    retired: bool = False

    @property
    def name(self) -> str:
        return f"{self.task_type}-{self.index}"

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def running(self) -> bool:
        return self.returncode is None

    @property
    def status(self) -> int:
        """Its exit status (:func:`exit_status`)."""
        return exit_status(self.returncode)

    def join_output(self) -> None:
        """Wait (briefly) until its last lines are written."""
        if self.output_thread is not None:
            self.output_thread.join(timeout=2.0)


def _wait_without_reaping(pid: int) -> int:
    """Block until ``pid`` exits and return its Popen-style return code, leaving it a zombie (not reaped): its
    pid -- and so its process group id -- cannot be reused until :meth:`TaskLauncher.stop` reaps it."""
    while True:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # already reaped elsewhere
            return -1
        except InterruptedError:  # pragma: no cover - PEP 475 retries for us
            continue
        if info is None:  # pragma: no cover - only with WNOHANG
            continue
        if info.si_code == os.CLD_EXITED:
            return info.si_status
        return -info.si_status  # CLD_KILLED / CLD_DUMPED: the signal number


class Signalled(Exception):
    """SIGINT, SIGTERM or SIGHUP reached the launcher (raised in its main thread)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class TaskLauncher:
    """Runs ``command`` as each task of a job: starts a task's process with the environment it is given, pumps its
    output through ``console``, queues its exit, and stops tasks (SIGTERM to the process group, SIGKILL after
    ``grace_period`` seconds, then reaping). ``tasks`` holds the latest process of each ``(type, index)``."""

    def __init__(self, command: Sequence[str], console: Console, grace_period: float):
        self.command = list(command)
        self.console = console
        self.grace_period = grace_period
        self.tasks: dict[tuple[str, int], TaskProcess] = {}
        #: guards ``tasks`` and ``stopping``
        self.lock = threading.RLock()
        #: set by :meth:`stop_all`: no task starts any more
        self.stopping = False
        self._exits: "queue.Queue[TaskProcess]" = queue.Queue()
        self._deferring = 0
        self._pending_signal: int | None = None

    # -- signals ------------------------------------------------------------------------------------------------
    def on_signal(self, signum: int) -> None:
        """A signal handler's work: raise :class:`Signalled`, or, while a process is being started, hold the signal
        and raise it once that process is tracked."""
        if self._deferring:
            self._pending_signal = signum
            return
        raise Signalled(signum)

    @contextmanager
    def _signals_deferred(self) -> Iterator[None]:
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
            if not self._deferring and self._pending_signal is not None:
                signum, self._pending_signal = self._pending_signal, None
                raise Signalled(signum)

    # -- starting -----------------------------------------------------------------------------------------------
    def start(self, task_type: str, index: int, address: str, env: Mapping[str, str]) -> TaskProcess:
        """Start (or restart, once the previous process has exited) one task, listening at ``address``."""
        with self.lock, self._signals_deferred():
            if self.stopping:
                raise LauncherError(f"the cluster is stopping; not starting {task_type}-{index}")
            previous = self.tasks.get((task_type, index))
            if previous is not None:
                if previous.running:
                    raise LauncherError(f"{previous.name} is still running (pid {previous.pid})")
                # what the previous run left in its process group goes with it: once reaped, its group id is
                # free and nothing could reach those processes any more
                self.signal_group(previous, signal.SIGKILL)
                self._reap(previous)
            try:
                popen = subprocess.Popen(
                    self.command, env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: signalled as a whole, immune to our tty's ^C
                    close_fds=True,
                )
            except OSError as err:
                raise LauncherError(f"cannot start {task_type}-{index} with {self.command[0]!r}: {err}") from None
            task = TaskProcess(task_type, index, address, popen)
            self.tasks[(task_type, index)] = task
            assert popen.stdout is not None
            task.output_thread = threading.Thread(target=self.console.pump, args=(task.name, popen.stdout),
                                                  name=f"kubeps-out-{task.name}", daemon=True)
            task.waiter_thread = threading.Thread(target=self._watch, args=(task,), name=f"kubeps-wait-{task.name}",
                                                  daemon=True)
            task.output_thread.start()
            task.waiter_thread.start()
            return task

    def _watch(self, task: TaskProcess) -> None:
        task.returncode = _wait_without_reaping(task.pid)
        self._exits.put(task)

    def next_exit(self, timeout: float) -> TaskProcess | None:
        """The next task whose exit was seen (an old incarnation or a retired task too), or None after
        ``timeout`` seconds."""
        try:
            return self._exits.get(timeout=timeout)
        except queue.Empty:
            return None

    def is_current(self, task: TaskProcess) -> bool:
        """Whether ``task`` is the latest process of its task and not scaled away."""
        return self.tasks.get((task.task_type, task.index)) is task and not task.retired

    # -- stopping -----------------------------------------------------------------------------------------------
    def signal_group(self, task: TaskProcess, sig: int) -> None:
        """Send ``sig`` to the task's process group, unless the task was reaped (its group id may be another's)."""
        if task.reaped:
            return
        try:
            os.killpg(task.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _reap(self, task: TaskProcess) -> None:
        if task.reaped:
            return
        try:
            task.popen.wait(timeout=max(self.grace_period, 1.0))
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL was sent; the kernel is slow
            os.kill(task.pid, signal.SIGKILL)
            task.popen.wait()
        task.reaped = True
        if task.returncode is None:
            task.returncode = task.popen.returncode

    def retire(self, keys: Iterable[tuple[str, int]]) -> list[TaskProcess]:
        """Take the tasks of ``keys`` out of ``tasks`` as scaled away (their exits are no failures); stop them
        with :meth:`stop`."""
        retired = []
        with self.lock:
            for key in keys:
                task = self.tasks.pop(key, None)
                if task is not None:
                    task.retired = task.exit_handled = True
                    retired.append(task)
        return retired

    def stop(self, tasks: list[TaskProcess]) -> None:
        """SIGTERM to each task's process group, SIGKILL to what is left after the grace period (and to anything
        a task left behind in its group), then reap them."""
        if not tasks:
            return
        live = [t for t in tasks if t.running and not t.reaped]
        if live:
            self.console.report("stopping " + ", ".join(t.name for t in live))
        for task in tasks:
            if task.running:
                self.signal_group(task, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_period
        while any(t.running for t in tasks) and time.monotonic() < deadline:
            time.sleep(0.02)
        for task in tasks:
            if task.running:
                self.console.report(f"{task.name} (pid {task.pid}) did not stop within {self.grace_period} s: SIGKILL")
            self.signal_group(task, signal.SIGKILL)
        for task in tasks:
            self._reap(task)
            task.join_output()
            if task.waiter_thread is not None:
                task.waiter_thread.join(timeout=2.0)

    def stop_all(self) -> None:
        """Start no task any more and stop every one (safe to call more than once)."""
        with self.lock:
            self.stopping = True
            tasks = list(self.tasks.values())
        self.stop(tasks)
