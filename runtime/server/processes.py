"""The extra server processes of a ps task that uses several cores (``KUBEPS_PS_PROCESSES``).

One Python process serves about one core of ps work: request decoding, validation and the optimizer's small numpy
updates run under the GIL, so a ps pod given 4 cores used ~1.1 of them (``docs/scaling.md``). A ps task of N
processes is N parameter servers to the chief and the workers
(:meth:`kubeps.runtime.cluster.TFConfig.with_ps_processes`: its port and the next N-1 ports), and variables are
sharded over all of them as over more ps tasks. The task's own process (the one the user's program or
``python -m kubeps.runtime.server`` runs) starts the N-1 others as ``python -m kubeps.runtime.server`` with their
own, already expanded ``TF_CONFIG``, and stays their supervisor: the task lives and dies as one.

* a process the task started that exits while the task serves ends the task (exit status 1): the launcher or the
  pod restarts the whole task, and the chief, seeing its ps restarted, restores the job from its checkpoint as
  for any lost ps;
* the task's own process dying kills the others, so a restarted task finds its ports free: each sets
  ``PR_SET_PDEATHSIG`` on itself as it starts (:func:`die_with_task`, told the task's pid by
  ``KUBEPS_PS_TASK_PID``). Nothing runs in a child between fork and exec: the task's process has gRPC's threads
  by then, and a forked child that ran Python code there (a ``preexec_fn``) was aborted by gRPC's fork handling in
  about 1 start in 5 on a loaded machine;
* ``stop()`` terminates them, then kills what is left after the grace period.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
from typing import Callable

from kubeps.runtime.cluster import ClusterSpec, TFConfig, TFConfigError
from kubeps.runtime.contract import PS_PROCESSES_ENV
from kubeps.runtime.settings import TaskSettings

__all__ = ["PSProcesses", "EXIT_PROCESS_LOST", "die_with_task"]

log = logging.getLogger("kubeps.server")

#: the exit status of a ps task whose other process exited while it served
EXIT_PROCESS_LOST = 1
_PR_SET_PDEATHSIG = 1


def die_with_task(task_pid: int) -> None:
    """In a server process a ps task started: be killed when the task's process ``task_pid`` ends, and end at once
    if it has ended already (this process then has another parent)."""
    try:
        ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux/glibc: the task's stop() still ends it
        pass
    if os.getppid() != task_pid:
        log.error("the ps task's process %d ended before this process of it started: exiting", task_pid)
        os._exit(EXIT_PROCESS_LOST)


class PSProcesses:
    """The processes ``1..N-1`` of ps task ``task_index`` of ``cluster_spec`` (already holding every process's
    address: P x N ps), started with ``settings`` (their ``KUBEPS_PS_PROCESSES`` is 1: they start no others)."""

    def __init__(self, cluster_spec: ClusterSpec, task_index: int, settings: TaskSettings,
                 on_lost: Callable[[int, int], None] | None = None):
        processes = settings.ps_processes
        total = cluster_spec.num_tasks("ps")
        if total % processes:
            raise TFConfigError(PS_PROCESSES_ENV, processes,
                                f"a divisor of the cluster's {total} ps addresses: a ps task with several processes "
                                f"needs the cluster as kubeps tasks read it (TFConfig.with_ps_processes)")
        tasks = total // processes
        if not 0 <= task_index < tasks:
            raise TFConfigError("task_index", task_index,
                                f"a ps task in 0..{tasks - 1}: indices from {tasks} up are the processes that ps "
                                f"tasks start themselves ({PS_PROCESSES_ENV}={processes})")
        self.indices = [task_index + shift * tasks for shift in range(1, processes)]
        self.cluster = cluster_spec.as_dict()
        self.settings = settings
        self.grace_s = 5.0
        self._on_lost = on_lost or self._exit_task
        self._procs: list[subprocess.Popen[bytes]] = []
        self._stopping = threading.Event()

    def start(self) -> None:
        ours = set(TaskSettings.variables().values())
        for index in self.indices:
            # one core's work each (no math thread pool to share): the task's cores are its processes. The metrics
            # port is the task's own process's (the one the pod names): the others serve none (the chief's hot-ps
            # detector still sees their traffic through ListVariables)
            child = self.settings.model_copy(update={
                "ps_processes": 1, "cpus": 1, "tf_config": TFConfig.for_task(self.cluster, "ps", index).to_json(),
                "metrics_port": None, "ps_task_pid": os.getpid(),
            })
            env = {k: v for k, v in os.environ.items() if k not in ours}
            env.update(child.to_env())
            # no preexec_fn: the child is spawned (vfork and exec), never a forked copy running Python (see above)
            proc = subprocess.Popen([sys.executable, "-m", "kubeps.runtime.server"], env=env)
            self._procs.append(proc)
            threading.Thread(target=self._watch, args=(index, proc), daemon=True,
                             name=f"kubeps-ps-process-{index}").start()
        log.info("ps process(es) %s started (%s=%d), pid(s) %s", self.indices, PS_PROCESSES_ENV,
                 self.settings.ps_processes, [p.pid for p in self._procs])

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _watch(self, index: int, proc: subprocess.Popen[bytes]) -> None:
        status = proc.wait()
        if not self._stopping.is_set():
            self._on_lost(index, status)

    def _exit_task(self, index: int, status: int) -> None:
        log.error("ps process /job:ps/task:%d (pid %s) exited with status %d while its task served: the task ends "
                  "so that it is restarted whole (the chief restores the job from its checkpoint)",
                  index, [p.pid for p in self._procs], status)
        self.stop(grace=0)
        os._exit(EXIT_PROCESS_LOST)

    def stop(self, grace: float | None = None) -> None:
        self._stopping.set()
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(timeout=self.grace_s if grace is None else grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
