"""Run a parameter-server training program as a local cluster of processes: ``kubeps local``.

:class:`LocalCluster` starts the chief, the parameter servers, the workers and (optionally) the evaluator of one
job as child processes of this one, each running ``python SCRIPT ARGS`` with its own ``TF_CONFIG`` (built with
:meth:`kubeps.runtime.cluster.TFConfig.for_task`, so the evaluator is never part of the training cluster) on free
loopback ports. Every task's output is streamed line by line with a ``[type-index]`` prefix. Every task serves its
Prometheus metrics on a free port of its own (``KUBEPS_METRICS_PORT``; the start lines name the URLs) unless
``metrics=False`` (``--no-metrics``).

The tasks talk mutual TLS: a throw-away CA and the tasks' certificate (for the ``--host`` address and
``localhost``) are made in a temporary directory (mode 0700) that :meth:`LocalCluster.stop` removes (or the
cluster's collection, or the interpreter's exit, for a cluster nothing stopped; a launcher killed by SIGKILL leaves
it); the CA's key is never written. ``tls=False`` (``--insecure-plaintext``) runs them plaintext; TLS files named
in the environment (``KUBEPS_TLS_*_FILE``) are used as they are.

The workers can change while the job runs: :meth:`LocalCluster.scale_workers` (``kubeps local scale --workers N``
from another shell, :mod:`kubeps.runtime.local.scaling`) starts new workers at new free ports, or drains and stops
the highest ones, through the chief's membership document: the chief is not restarted (docs/elastic.md).

The chief decides the outcome: when it exits, every other task is stopped (SIGTERM to its process group, SIGKILL
after a grace period) and its exit status is the cluster's. After a chief that succeeded, a running sidecar
evaluator first gets up to ``evaluator_grace`` seconds (``--evaluator-grace``, default 60) to evaluate the final
checkpoint and exit by itself. A ps or worker that dies before the chief is reported
through :meth:`LocalCluster.on_task_exit` -- the hook a restart policy overrides; without one, a ps that exits ends
the run with its status.

No process is left behind: each task runs in its own session (process group), a task's exit is observed with
``waitid(WNOWAIT)`` so its process group id stays reserved until :meth:`LocalCluster.stop` has signalled the group
and reaped the task, and :func:`run_local` stops the cluster on success, failure, SIGINT, SIGTERM, SIGHUP and at
interpreter exit.

:class:`LocalCluster` is the sum of its parts: the job's :class:`~kubeps.runtime.local.spec.LocalJobSpec`
(``spec``), its addresses and each task's environment (``environment``,
:mod:`kubeps.runtime.local.environment`), the processes (``processes``, :mod:`kubeps.runtime.local.processes`),
the scaler (``scaler``, :mod:`kubeps.runtime.local.scaler`) and the two output streams (``console``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import threading
import time
import weakref
from types import FrameType
from typing import IO, Any, Callable, Mapping, Sequence

from kubeps.runtime.cluster import MembershipAck
from kubeps.runtime.local import scaling
from kubeps.runtime.local.console import Console
from kubeps.runtime.local.credentials import tls_settings
from kubeps.runtime.local.environment import JobEnvironment, job_settings, task_keys
from kubeps.runtime.local.errors import LauncherArgumentError, LauncherError
from kubeps.runtime.local.ports import PortAllocator, free_port_runs, free_ports, max_port_base
from kubeps.runtime.local.processes import Signalled, TaskLauncher, TaskProcess, exit_status
from kubeps.runtime.local.scaler import Scaler
from kubeps.runtime.local.spec import DEFAULT_EVALUATOR_GRACE_S, DEFAULT_GRACE_PERIOD_S, LocalJobSpec
from kubeps.runtime.ops.kernels import DEVICE_ENV, cupy_available
from kubeps.runtime.settings import TaskSettings

__all__ = [
    "DEFAULT_EVALUATOR_GRACE_S",
    "DEFAULT_GRACE_PERIOD_S",
    "LauncherError",
    "LauncherArgumentError",
    "LocalCluster",
    "LocalJobSpec",
    "TaskProcess",
    "exit_status",
    "free_port_runs",
    "free_ports",
    "max_port_base",
    "run_local",
]


def _workers_share_a_gpu(settings: TaskSettings) -> bool:
    """Whether this machine's GPU is there for the workers; a :class:`LauncherError` where they were asked to
    compute on one (``KUBEPS_DEVICE=gpu``) and there is none: every task of kubeps local runs here."""
    gpu, why = cupy_available() if settings.device != "cpu" else (False, "")
    if settings.device == "gpu" and not gpu:
        raise LauncherError(f"{DEVICE_ENV}=gpu: the workers would compute on a GPU, but {why}; no task was "
                            f"started (set {DEVICE_ENV}=cpu to run on the CPU)")
    return gpu


def _remove_trees(directories: list[str]) -> None:
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


class LocalCluster:
    """The processes of one local job, supervised.

    Built from a :class:`LocalJobSpec` (``LocalCluster(spec)``), or from the spec's fields as keyword arguments
    (``LocalCluster(script, script_args, num_ps=2, ...)``, the settings read from ``env``, default this process's
    environment). ``env`` is the environment the tasks inherit (their task settings are rendered over it);
    ``output`` and ``log`` the streams of the tasks' lines and of the launcher's messages (default stdout, stderr).

    ``start()`` starts every task, ``wait()`` blocks until the chief exits and returns its exit status (after a
    successful chief, first letting a running evaluator finish for up to ``evaluator_grace`` seconds), ``stop()``
    ends whatever is still running. ``start_task(type, index)`` (re)starts one task at its fixed address, and
    ``on_task_exit(task)`` is called for every task that exits before the chief: override it to restart tasks.
    """

    def __init__(self, script: str | LocalJobSpec, script_args: Sequence[str] = (), *,
                 env: Mapping[str, str] | None = None, output: IO[str] | None = None, log: IO[str] | None = None,
                 **options: Any):
        environ = dict(os.environ if env is None else env)
        if isinstance(script, LocalJobSpec):
            if script_args or options:
                raise TypeError("LocalCluster(spec): the script's arguments and the options are the spec's fields")
            self.spec = script
        else:
            self.spec = LocalJobSpec.from_arguments(script, script_args, environ, **options)
        spec = self.spec
        self.console = Console(output, log)
        gpu = _workers_share_a_gpu(spec.settings)
        #: the private directories of this run (TLS files, the run directory), removed by stop() or with the cluster
        self._directories: list[str] = []
        self._remove_directories = weakref.finalize(self, _remove_trees, self._directories)
        ports = PortAllocator(spec.host)
        cluster = ports.cluster(spec.counts(), spec.server_processes, spec.port_base)
        #: the throw-away directory of this run's CA and certificate, if one was made
        self.tls_dir, tls = tls_settings(spec)
        if self.tls_dir is not None:
            self._directories.append(self.tls_dir)
        keys = task_keys(cluster)
        metrics_ports = dict(zip(keys, ports.free(len(keys)))) if spec.metrics else {}
        #: this run's private directory: the chief's membership document and its ack, scale requests
        self.run_dir = scaling.make_run_dir()
        self._directories.append(self.run_dir)
        self.environment = JobEnvironment(job_settings(spec, gpu, tls), environ, spec.host, cluster, metrics_ports,
                                          scaling.membership_files(self.run_dir))
        self.processes = TaskLauncher([spec.python, spec.script, *spec.script_args], self.console,
                                      spec.grace_period)
        self.scaler = Scaler(self.run_dir, self.environment, self.processes, ports,
                             lambda index: self._start_and_report("worker", index))
        self._started = False
        #: ``time.time()`` when the chief's exit was seen last (before any evaluator grace)
        self.chief_exit_time: float | None = None

    # -- what the parts hold --------------------------------------------------------------------------------------
    @property
    def cluster(self) -> dict[str, list[str]]:
        """The addresses of the job's tasks by type (the evaluator's too)."""
        return self.environment.cluster

    @property
    def tasks(self) -> dict[tuple[str, int], TaskProcess]:
        """The latest process of each ``(type, index)``."""
        return self.processes.tasks

    @property
    def metrics_ports(self) -> dict[tuple[str, int], int]:
        """Each task's Prometheus metrics port (none with ``metrics=False``)."""
        return self.environment.metrics_ports

    @property
    def settings(self) -> TaskSettings:
        """What every task is told (TF_CONFIG and the metrics port apart: :meth:`task_settings`)."""
        return self.environment.settings

    @property
    def job_token(self) -> str | None:
        return self.settings.job_token

    def task_keys(self) -> list[tuple[str, int]]:
        """Every ``(type, index)`` of the job, in start order."""
        return self.environment.task_keys()

    def tf_config(self, task_type: str, index: int) -> str:
        """The TF_CONFIG JSON of one task (the evaluator's cluster is just itself)."""
        return self.environment.tf_config(task_type, index)

    def task_settings(self, task_type: str, index: int) -> TaskSettings:
        """The settings of one task (:meth:`JobEnvironment.task_settings`)."""
        return self.environment.task_settings(task_type, index)

    def task_env(self, task_type: str, index: int) -> dict[str, str]:
        """The environment of one task: the launcher's (or ``env``), its settings rendered over it."""
        return self.environment.task_env(task_type, index)

    def metrics_url(self, task_type: str, index: int) -> str | None:
        """``http://host:port/metrics`` of one task, None without metrics."""
        return self.environment.metrics_url(task_type, index)

    def report(self, message: str) -> None:
        """A launcher message, ``[kubeps] ...``, on the log stream (stderr by default)."""
        self.console.report(message)

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def start_task(self, task_type: str, index: int) -> TaskProcess:
        """Start (or restart, once the previous process has exited) one task at its address."""
        addresses = self.cluster.get(task_type, [])
        if not 0 <= index < len(addresses):
            raise LauncherError(f"the cluster has {len(addresses)} '{task_type}' task(s); no index {index}")
        return self.processes.start(task_type, index, addresses[index], self.task_env(task_type, index))

    def _start_and_report(self, task_type: str, index: int) -> TaskProcess:
        task = self.start_task(task_type, index)
        url = self.metrics_url(task_type, index)
        self.report(f"{task.name} pid {task.pid} at {task.address}" + (f", metrics {url}" if url else ""))
        return task

    def start(self) -> None:
        """Start every task: parameter servers, workers, the evaluator, then the chief."""
        if self._started:
            raise LauncherError("this LocalCluster was already started")
        self._started = True
        summary = ", ".join(f"{t} {' '.join(a)}" for t, a in self.cluster.items())
        self.report(f"starting {self.spec.script} on {summary}")
        self.scaler.write_membership()
        for task_type, index in self.task_keys():
            self._start_and_report(task_type, index)

    def wait(self, timeout: float | None = None) -> int:
        """Block until the chief exits; return its exit status (``128 + signal`` if killed). Tasks that exit
        before it go to :meth:`on_task_exit`. With ``timeout`` (seconds), raise ``TimeoutError`` if the chief is
        still running then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"the chief is still running after {timeout} s")
            self.scaler.take_request()
            # short waits keep the main thread responsive to SIGINT/SIGTERM
            task = self.processes.next_exit(0.2 if remaining is None else min(0.2, remaining))
            if task is None or not self.processes.is_current(task):
                continue  # nothing yet, an old incarnation of a restarted task, or a worker scaled away
            task.join_output()  # its last lines first
            if task.task_type == "chief":
                self.report(f"chief-0 exited with status {task.status}")
                self.chief_exit_time = time.time()
                if task.status == 0:
                    self.let_evaluator_finish(None if deadline is None else deadline - time.monotonic())
                return task.status
            ended = self.on_task_exit(task)
            if ended is not None:
                return ended

    def let_evaluator_finish(self, timeout: float | None = None) -> bool:
        """After the chief succeeded: wait up to ``evaluator_grace`` seconds (and ``timeout``) for a running
        evaluator to exit by itself -- a sidecar evaluator stops after the final checkpoint. True if it did (or
        there is none running)."""
        task = self.tasks.get(("evaluator", 0))
        if task is None:
            return True
        if not task.running:
            # exited about when the chief did: its exit may still be queued behind the chief's, unreported
            if not task.exit_handled:
                self._report_evaluator_exit(task)
            return True
        evaluator_grace = self.spec.evaluator_grace
        grace = evaluator_grace if timeout is None else max(0.0, min(evaluator_grace, timeout))
        if grace <= 0:
            return False
        self.report(f"waiting up to {grace:.0f} s for the evaluator to finish the final checkpoint")
        deadline = time.monotonic() + grace
        while task.running and time.monotonic() < deadline:
            time.sleep(0.05)
        if task.running:
            self.report(f"the evaluator did not finish within {grace:.0f} s (--evaluator-grace); stopping it")
            return False
        self._report_evaluator_exit(task)
        return True

    def _report_evaluator_exit(self, task: TaskProcess) -> None:
        task.join_output()  # its last lines first
        task.exit_handled = True
        self.report(f"{task.name} (pid {task.pid}) exited with status {task.status}")

    def on_task_exit(self, task: TaskProcess) -> int | None:
        """Called when a task other than the chief exits while the chief runs; returns None to go on, or the exit
        status that ends the run. Without a restart policy (which overrides this and calls :meth:`start_task`): a
        ps that exits ends the run with its status (1 if it was 0), said in one line -- the chief cannot finish
        without it and would only wait for it; a worker or evaluator is reported and the run goes on."""
        if task.task_type == "evaluator":
            self._report_evaluator_exit(task)
            return None
        task.exit_handled = True
        if task.task_type == "ps":
            self.report(f"{task.name} (pid {task.pid}) exited with status {task.status} before the chief; ending the "
                        f"run with it (the chief cannot finish without its ps; --restart restarts them)")
            return task.status or 1
        self.report(
            f"{task.name} (pid {task.pid}) exited with status {task.status} before the chief; it is not restarted "
            f"(the chief may fail or hang without it)"
        )
        return None

    def stop(self) -> None:
        """Stop every task: SIGTERM to each process group, SIGKILL to what is left after the grace period, then
        reap, then remove the run's private directories. Safe to call more than once and from an ``atexit``
        hook."""
        try:
            self.processes.stop_all()
        finally:
            self._remove_directories()  # a finalizer runs once: later calls do nothing

    # -- scaling ------------------------------------------------------------------------------------------------
    def membership_ack(self) -> MembershipAck | None:
        """What the chief last acknowledged (None: nothing yet)."""
        return self.scaler.ack()

    def scale_workers(self, count: int, timeout: float = 120.0) -> MembershipAck:
        """Run ``count`` workers from now on, without restarting the chief (:meth:`Scaler.scale`): new workers
        start at new free ports, or the highest indexes are drained and stopped."""
        return self.scaler.scale(count, timeout)

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- the command --------------------------------------------------------------------------------------------------
def run_local(
    script: str | LocalJobSpec,
    script_args: Sequence[str] = (),
    *,
    cluster_factory: Callable[..., LocalCluster] = LocalCluster,
    **options: object,
) -> int:
    """Run a local cluster to completion and return the chief's exit status (130 on SIGINT, 143 on SIGTERM,
    129 on SIGHUP); every task is stopped before this returns. Raises :class:`LauncherError` on bad options."""
    cluster = cluster_factory(script, script_args, **options)
    atexit.register(cluster.stop)
    previous: dict[signal.Signals, Callable[[int, FrameType | None], Any] | int | None] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, lambda signum, frame: cluster.processes.on_signal(signum))
    try:
        cluster.start()
        return cluster.wait()
    except (Signalled, KeyboardInterrupt) as err:
        signum: int = err.signum if isinstance(err, Signalled) else signal.SIGINT
        cluster.report(f"received {signal.Signals(signum).name}")
        return 128 + signum
    finally:
        # a second ^C during shutdown must not leave tasks behind
        if threading.current_thread() is threading.main_thread():
            for sig in previous:
                signal.signal(sig, signal.SIG_IGN)
        try:
            cluster.stop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            atexit.unregister(cluster.stop)
