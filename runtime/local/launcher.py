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
"""

from __future__ import annotations

import atexit
import json
import os
import random
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import IO, Any, Callable, Mapping, Sequence

from kubeps.runtime import certs
from kubeps.runtime.cluster import Membership, MembershipAck, TFConfig
from kubeps.runtime.util.files import write_atomically
from kubeps.runtime.local import scaling
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.ops.kernels import DEVICE_ENV, cupy_available
from kubeps.runtime.settings import TaskSettings
from kubeps.runtime.util.threads import cpu_budget

__all__ = [
    "DEFAULT_EVALUATOR_GRACE_S",
    "DEFAULT_GRACE_PERIOD_S",
    "LauncherError",
    "LauncherArgumentError",
    "LocalCluster",
    "TaskProcess",
    "exit_status",
    "free_port_runs",
    "free_ports",
    "max_port_base",
    "run_local",
]

#: Seconds between SIGTERM and SIGKILL when stopping a task (``--grace-period``).
DEFAULT_GRACE_PERIOD_S = 5.0
#: After the chief succeeded, how long a running evaluator may take to finish the final checkpoint (seconds).
DEFAULT_EVALUATOR_GRACE_S = 60.0
#: Start order: servers first, so the chief finds them listening (it retries anyway).
START_ORDER = ("ps", "worker", "evaluator", "chief")


class LauncherError(RuntimeError):
    """The local cluster could not be set up (bad arguments, ports in use, a script that cannot start)."""


class LauncherArgumentError(RuntimeConfigError, LauncherError):
    """A bad argument of :class:`LocalCluster`: the message names the parameter, its value and what is allowed
    (``kubeps local`` checks its own flags before, and words its errors with them)."""


def max_port_base(num_ps: int, num_workers: int, evaluator: bool, ps_processes: int = 1) -> int:
    """The highest first port of a job whose tasks take consecutive ports (``port_base``, ``--port-base``; a ps
    task of several processes takes one port per process)."""
    return 65535 - (1 + num_ps * ps_processes + num_workers + (1 if evaluator else 0)) + 1


# -- ports --------------------------------------------------------------------------------------------------------
#: the lowest port handed to a task: ports are picked from here up to the kernel's ephemeral range, where every
#: outgoing connection takes its local port. A port picked inside that range and released until the task binds it
#: (seconds later, after its imports) can be taken meanwhile by any process's connect(); seen when tests ran beside
#: each other ("Failed to add port to server"), which left the chief waiting for a worker that never started.
_LISTEN_FLOOR = 10000
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_rng = random.Random()  # its own seed: a program seeding the random module must not make two runs pick alike


def _ephemeral_low(path: str = _EPHEMERAL_RANGE) -> int | None:
    """The first port of the kernel's ephemeral range, or None where it cannot be read."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bind(host: str, port: int) -> socket.socket | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        return None
    return s


def _free_socket(host: str, low: int | None, span: int = 1) -> socket.socket:
    """A socket bound to a free port on ``host`` whose ``span - 1`` next ports are below the ephemeral range (which
    starts at ``low``, :func:`_ephemeral_low`): a random one between :data:`_LISTEN_FLOOR` and that range when there
    is room, else the kernel's choice."""
    if low is not None and low - span - _LISTEN_FLOOR >= 1000:
        for _ in range(200):
            s = _bind(host, _rng.randrange(_LISTEN_FLOOR, low - span + 1))
            if s is not None:
                return s
    s = _bind(host, 0)
    if s is None:
        raise LauncherError(f"no free TCP port on {host}")
    return s


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct free TCP ports on ``host``, below the kernel's ephemeral range where there is room; the
    sockets are held together so no port is repeated."""
    sockets = []
    low = _ephemeral_low()
    try:
        for _ in range(count):
            sockets.append(_free_socket(host, low))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port_runs(count: int, length: int, host: str = "127.0.0.1", attempts: int = 200) -> list[int]:
    """The first ports of ``count`` runs of ``length`` consecutive free TCP ports on ``host`` (a ps task of
    ``length`` processes serves on its port and the next ones)."""
    if length == 1:
        return free_ports(count, host)
    held: list[socket.socket] = []
    firsts: list[int] = []
    low = _ephemeral_low()
    try:
        for _ in range(attempts):
            if len(firsts) == count:
                break
            first = _free_socket(host, low, span=length)
            run = [first]
            port = first.getsockname()[1]
            for shift in range(1, length):
                s = _bind(host, port + shift) if port + shift <= 65535 else None
                if s is None:
                    break
                run.append(s)
            if len(run) < length:
                for s in run:
                    s.close()
                continue
            held.extend(run)
            firsts.append(port)
        if len(firsts) < count:
            raise LauncherError(f"found only {len(firsts)} of {count} runs of {length} consecutive free ports on "
                                f"{host} in {attempts} attempts: give --port-base")
        return firsts
    finally:
        for s in held:
            s.close()


def _check_ports_free(host: str, ports: Sequence[int]) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in ports:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError as err:
                raise LauncherError(
                    f"--port-base: port {port} on {host} is not free ({err.strerror}); the cluster needs ports "
                    f"{ports[0]}..{ports[-1]}: pick another --port-base or leave it out to use free ports"
                ) from None


def exit_status(returncode: int) -> int:
    """A shell-style exit status: the code itself, or ``128 + signal`` for a process killed by a signal."""
    return 128 - returncode if returncode < 0 else returncode


# -- one task -----------------------------------------------------------------------------------------------------
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


def _wait_without_reaping(pid: int) -> int:
    """Block until ``pid`` exits and return its Popen-style return code, leaving it a zombie (not reaped): its
    pid -- and so its process group id -- cannot be reused until :meth:`LocalCluster.stop` reaps it."""
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


# -- the cluster --------------------------------------------------------------------------------------------------
class LocalCluster:
    """The processes of one local job, supervised.

    ``start()`` starts every task, ``wait()`` blocks until the chief exits and returns its exit status (after a
    successful chief, first letting a running evaluator finish for up to ``evaluator_grace`` seconds), ``stop()``
    ends whatever is still running. ``start_task(type, index)`` (re)starts one task at its fixed address, and
    ``on_task_exit(task)`` is called for every task that exits before the chief: override it to restart tasks.
    """

    def __init__(
        self,
        script: str,
        script_args: Sequence[str] = (),
        *,
        num_ps: int = 2,
        num_workers: int = 2,
        evaluator: bool = False,
        host: str = "127.0.0.1",
        port_base: int | None = None,
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
        grace_period: float = DEFAULT_GRACE_PERIOD_S,
        evaluator_grace: float = DEFAULT_EVALUATOR_GRACE_S,
        output: IO[str] | None = None,
        log: IO[str] | None = None,
        tls: bool = True,
        metrics: bool = True,
        ps_processes: int | None = None,
    ):
        if num_ps < 1:
            raise LauncherArgumentError("num_ps", num_ps, "allowed is a number of parameter servers >= 1")
        if num_workers < 1:
            raise LauncherArgumentError("num_workers", num_workers, "allowed is a number of workers >= 1")
        if not grace_period >= 0:
            raise LauncherArgumentError("grace_period", grace_period, "allowed is a number of seconds >= 0")
        if not evaluator_grace >= 0:
            raise LauncherArgumentError("evaluator_grace", evaluator_grace, "allowed is a number of seconds >= 0")
        if ps_processes is not None and not (isinstance(ps_processes, int) and ps_processes >= 1):
            raise LauncherArgumentError("ps_processes", ps_processes,
                                        "allowed is a number of server processes per ps task >= 1, or None (the "
                                        "ps task's CPU share decides)")
        if not os.path.isfile(script):
            raise LauncherError(f"script file not found: {script}")
        self.script = script
        self.script_args = list(script_args)
        self.python = python
        self.host = host
        self.grace_period = grace_period
        #: after the chief succeeded, how long the evaluator may take to evaluate the final checkpoint and exit
        self.evaluator_grace = evaluator_grace
        self._output = output
        self._log = log
        self._write_lock = threading.Lock()

        environ = dict(os.environ if env is None else env)
        try:
            given = TaskSettings.from_env(environ)  # the user's settings, checked before any task starts
        except RuntimeConfigError as err:
            raise LauncherError(str(err)) from None
        # every task of kubeps local runs here: no GPU here means no worker could compute where it was asked to
        gpu, why = cupy_available() if given.device != "cpu" else (False, "")
        if given.device == "gpu" and not gpu:
            raise LauncherError(f"{DEVICE_ENV}=gpu: the workers would compute on a GPU, but {why}; no task was "
                                f"started (set {DEVICE_ENV}=cpu to run on the CPU)")
        decided: dict[str, Any] = {}
        if gpu and given.gpu_tasks == 1 and num_workers > 1:
            # the workers (KUBEPS_DEVICE=gpu, or unset: they take the GPU they see) share this machine's GPU: each
            # gets its share of the memory
            decided["gpu_tasks"] = num_workers
        if given.job_token is None and given.job_token_file is None:
            decided["job_token"] = secrets.token_hex(24)
        if given.bind_host is None:
            decided["bind_host"] = host
        if not given.checkpoint_root:
            # the parameter servers write checkpoint shards only below these: the directory kubeps local runs in and
            # the temporary directory (where the examples write); set KUBEPS_CHECKPOINT_ROOT to choose others
            decided["checkpoint_root"] = (os.getcwd(), tempfile.gettempdir())
        if given.cpus is None:
            # the machine's CPUs shared by the tasks that compute (ps and workers): math thread pools sized to
            # one task's share instead of every task starting one thread per core (see kubeps.runtime.util.threads)
            decided["cpus"] = max(1, int(cpu_budget(given)) // (num_ps + num_workers))
        if ps_processes is not None:
            # one server process per ps task unless asked: on 16 cores several per task served less than one
            # (docs/benchmarks.md#scaling-benchscalingpy-benchps_capacitypy)
            decided["ps_processes"] = ps_processes
        processes = decided.get("ps_processes", given.ps_processes)
        counts = {"chief": 1, "ps": num_ps, "worker": num_workers, "evaluator": 1 if evaluator else 0}
        total = sum(counts.values())
        # a ps task of several processes takes one port per process: its own and the next ones
        widths = {"chief": 1, "ps": processes, "worker": 1, "evaluator": 1}
        if port_base is not None:
            highest = max_port_base(num_ps, num_workers, evaluator, processes)
            if not 1 <= port_base <= highest:
                raise LauncherArgumentError("port_base", port_base,
                                            f"allowed is a port in 1..{highest}: {total} tasks take consecutive ports")
            ports: list[int] = []
            taken: list[int] = []
            port = port_base
            for t in ("chief", "ps", "worker", "evaluator"):
                for _ in range(counts[t]):
                    ports.append(port)
                    taken.extend(range(port, port + widths[t]))
                    port += widths[t]
            _check_ports_free(host, taken)
        else:
            ps_ports = iter(free_port_runs(num_ps, processes, host))
            others = iter(free_ports(total - num_ps, host))
            ports = [next(ps_ports) if t == "ps" else next(others)
                     for t in ("chief", "ps", "worker", "evaluator") for _ in range(counts[t])]
        host_part = f"[{host}]" if ":" in host else host
        addresses = iter(f"{host_part}:{p}" for p in ports)
        self.cluster: dict[str, list[str]] = {
            t: [next(addresses) for _ in range(counts[t])] for t in ("chief", "ps", "worker", "evaluator") if counts[t]
        }
        #: the throw-away directory of this run's CA and certificate (removed by stop(), or when the cluster is
        #: garbage-collected or the interpreter exits without a stop()), if one was made
        self.tls_dir: str | None = None
        self._remove_tls_dir: Callable[[], Any] = lambda: None
        if not tls:
            decided.update(tls_ca_file=None, tls_cert_file=None, tls_key_file=None)
        elif not (given.tls_ca_file or given.tls_cert_file or given.tls_key_file):
            self.tls_dir, files = _throwaway_credentials(host)
            self._remove_tls_dir = weakref.finalize(self, shutil.rmtree, self.tls_dir, ignore_errors=True)
            decided.update(files)
        #: each task's Prometheus metrics port (free ports; ``metrics=False``, ``--no-metrics``: none, and no
        #: task records metrics)
        self.metrics_ports: dict[tuple[str, int], int] = {}
        if metrics:
            keys = [(t, i) for t in START_ORDER for i in range(counts[t])]
            self.metrics_ports = dict(zip(keys, free_ports(len(keys), host)))
        decided["metrics_port"] = None
        #: what every task is told (TF_CONFIG and the metrics port apart: :meth:`task_settings`), rendered into
        #: its environment
        self.settings = given.model_copy(update=decided)
        # the rest of the environment passes through; the task's settings are only ever the rendered ones
        self._base_env = {k: v for k, v in environ.items() if k not in set(TaskSettings.variables().values())}
        self._base_env["PYTHONUNBUFFERED"] = "1"

        #: this run's private directory: the chief's membership document and its ack, scale requests
        #: (:mod:`kubeps.runtime.local.scaling`); removed by stop()
        self.run_dir = tempfile.mkdtemp(prefix=f"{scaling.RUN_DIR_PREFIX}{os.getpid()}-")
        self._remove_run_dir = weakref.finalize(self, shutil.rmtree, self.run_dir, ignore_errors=True)
        self.membership_path = os.path.join(self.run_dir, scaling.MEMBERSHIP_FILE)
        self.membership_ack_path = os.path.join(self.run_dir, scaling.MEMBERSHIP_ACK_FILE)
        #: the generation of the membership document last written (0: the workers the run started with)
        self.membership_generation = 0
        self._scale_lock = threading.Lock()
        self._scaler: threading.Thread | None = None

        self.tasks: dict[tuple[str, int], TaskProcess] = {}
        self._events: "queue.Queue[TaskProcess]" = queue.Queue()
        self._lock = threading.RLock()
        self._stopping = False
        self._started = False
        #: ``time.time()`` when the chief's exit was seen last (before any evaluator grace)
        self.chief_exit_time: float | None = None
        # signals that arrive while a process is being started are held until it is tracked (see run_local)
        self._defer_signals = 0
        self._pending_signal: int | None = None

    # -- configuration ------------------------------------------------------------------------------------------
    @property
    def job_token(self) -> str | None:
        return self.settings.job_token

    def task_keys(self) -> list[tuple[str, int]]:
        """Every ``(type, index)`` of the job, in start order."""
        return [(t, i) for t in START_ORDER for i in range(len(self.cluster.get(t, [])))]

    def tf_config(self, task_type: str, index: int) -> str:
        """The TF_CONFIG JSON of one task (the evaluator's cluster is just itself)."""
        return TFConfig.for_task(self.cluster, task_type, index).to_json()

    def task_settings(self, task_type: str, index: int) -> TaskSettings:
        """The settings of one task: the cluster's, with the task's TF_CONFIG and metrics port (and for the chief,
        its membership document and ack file)."""
        update: dict[str, Any] = {"tf_config": self.tf_config(task_type, index),
                                  "metrics_port": self.metrics_ports.get((task_type, index))}
        if task_type == "chief":
            update.update(membership_file=self.membership_path, membership_ack_file=self.membership_ack_path)
        return self.settings.model_copy(update=update)

    def _metrics_host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host

    def metrics_url(self, task_type: str, index: int) -> str | None:
        """``http://host:port/metrics`` of one task, None without metrics."""
        port = self.metrics_ports.get((task_type, index))
        return f"http://{self._metrics_host()}:{port}/metrics" if port else None

    def task_env(self, task_type: str, index: int) -> dict[str, str]:
        """The environment of one task: this process's (or ``env``), its settings rendered over it."""
        return {**self._base_env, **self.task_settings(task_type, index).to_env()}

    # -- output -------------------------------------------------------------------------------------------------
    def _out(self) -> IO[str]:
        return self._output if self._output is not None else sys.stdout

    def _err(self) -> IO[str]:
        return self._log if self._log is not None else sys.stderr

    def report(self, message: str) -> None:
        """A launcher message, ``[kubeps] ...``, on the log stream (stderr by default)."""
        with self._write_lock:
            stream = self._err()
            stream.write(f"[kubeps] {message}\n")
            stream.flush()

    def _pump_output(self, task: TaskProcess) -> None:
        prefix = f"[{task.name}] "
        stream = task.popen.stdout
        assert stream is not None
        try:
            for raw in iter(stream.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                with self._write_lock:
                    try:
                        out = self._out()
                        out.write(prefix + line + "\n")
                        out.flush()
                    except (OSError, ValueError):
                        pass  # our own stdout is gone (a closed pipe): keep draining so the task never blocks
        except (OSError, ValueError):  # the task's pipe was closed under us during shutdown
            pass
        finally:
            try:
                stream.close()
            except OSError:
                pass

    def _watch(self, task: TaskProcess) -> None:
        task.returncode = _wait_without_reaping(task.pid)
        self._events.put(task)

    # -- lifecycle ----------------------------------------------------------------------------------------------
    @contextmanager
    def _signals_deferred(self):
        self._defer_signals += 1
        try:
            yield
        finally:
            self._defer_signals -= 1
            if not self._defer_signals and self._pending_signal is not None:
                signum, self._pending_signal = self._pending_signal, None
                raise _Signalled(signum)

    def start_task(self, task_type: str, index: int) -> TaskProcess:
        """Start (or restart, once the previous process has exited) one task at its address."""
        addresses = self.cluster.get(task_type, [])
        if not 0 <= index < len(addresses):
            raise LauncherError(f"the cluster has {len(addresses)} '{task_type}' task(s); no index {index}")
        with self._lock, self._signals_deferred():
            if self._stopping:
                raise LauncherError(f"the cluster is stopping; not starting {task_type}-{index}")
            previous = self.tasks.get((task_type, index))
            if previous is not None:
                if previous.running:
                    raise LauncherError(f"{previous.name} is still running (pid {previous.pid})")
                # what the previous run left in its process group goes with it: once reaped, its group id is
                # free and nothing could reach those processes any more
                self._signal_group(previous, signal.SIGKILL)
                self._reap(previous)
            try:
                popen = subprocess.Popen(
                    [self.python, self.script, *self.script_args],
                    env=self.task_env(task_type, index),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: signalled as a whole, immune to our tty's ^C
                    close_fds=True,
                )
            except OSError as err:
                raise LauncherError(f"cannot start {task_type}-{index} with {self.python!r}: {err}") from None
            task = TaskProcess(task_type, index, addresses[index], popen)
            self.tasks[(task_type, index)] = task
            task.output_thread = threading.Thread(
                target=self._pump_output, args=(task,), name=f"kubeps-out-{task.name}", daemon=True
            )
            task.waiter_thread = threading.Thread(
                target=self._watch, args=(task,), name=f"kubeps-wait-{task.name}", daemon=True
            )
            task.output_thread.start()
            task.waiter_thread.start()
            return task

    def start(self) -> None:
        """Start every task: parameter servers, workers, the evaluator, then the chief."""
        if self._started:
            raise LauncherError("this LocalCluster was already started")
        self._started = True
        summary = ", ".join(f"{t} {' '.join(a)}" for t, a in self.cluster.items())
        self.report(f"starting {self.script} on {summary}")
        self._write_membership()
        for task_type, index in self.task_keys():
            task = self.start_task(task_type, index)
            port = self.metrics_ports.get((task_type, index))
            metrics = f", metrics http://{self._metrics_host()}:{port}/metrics" if port else ""
            self.report(f"{task.name} pid {task.pid} at {task.address}{metrics}")

    def wait(self, timeout: float | None = None) -> int:
        """Block until the chief exits; return its exit status (``128 + signal`` if killed). Tasks that exit
        before it go to :meth:`on_task_exit`. With ``timeout`` (seconds), raise ``TimeoutError`` if the chief is
        still running then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"the chief is still running after {timeout} s")
            self._take_scale_request()
            try:
                # short waits keep the main thread responsive to SIGINT/SIGTERM
                task = self._events.get(timeout=0.2 if remaining is None else min(0.2, remaining))
            except queue.Empty:
                continue
            if self.tasks.get((task.task_type, task.index)) is not task or task.retired:
                continue  # an old incarnation of a restarted task, or a worker scaled away
            if task.output_thread is not None:
                task.output_thread.join(timeout=2.0)  # its last lines first
            if task.task_type == "chief":
                status = exit_status(task.returncode if task.returncode is not None else -1)
                self.report(f"chief-0 exited with status {status}")
                self.chief_exit_time = time.time()
                if status == 0:
                    self.let_evaluator_finish(None if deadline is None else deadline - time.monotonic())
                return status
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
        grace = self.evaluator_grace if timeout is None else max(0.0, min(self.evaluator_grace, timeout))
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
        if task.output_thread is not None:
            task.output_thread.join(timeout=2.0)  # its last lines first
        task.exit_handled = True
        self.report(f"{task.name} (pid {task.pid}) exited with status "
                    f"{exit_status(task.returncode if task.returncode is not None else -1)}")

    def on_task_exit(self, task: TaskProcess) -> int | None:
        """Called when a task other than the chief exits while the chief runs; returns None to go on, or the exit
        status that ends the run. Without a restart policy (which overrides this and calls :meth:`start_task`): a
        ps that exits ends the run with its status (1 if it was 0), said in one line -- the chief cannot finish
        without it and would only wait for it; a worker or evaluator is reported and the run goes on."""
        if task.task_type == "evaluator":
            self._report_evaluator_exit(task)
            return None
        task.exit_handled = True
        status = exit_status(task.returncode if task.returncode is not None else -1)
        if task.task_type == "ps":
            self.report(f"{task.name} (pid {task.pid}) exited with status {status} before the chief; ending the run "
                        f"with it (the chief cannot finish without its ps; --restart restarts them)")
            return status or 1
        self.report(
            f"{task.name} (pid {task.pid}) exited with status {status} before the chief; it is not restarted "
            f"(the chief may fail or hang without it)"
        )
        return None

    def _signal_group(self, task: TaskProcess, sig: int) -> None:
        if task.reaped:
            return  # its process group id may belong to someone else now
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

    def stop(self) -> None:
        """Stop every task: SIGTERM to each process group, SIGKILL to what is left after the grace period, then
        reap, then remove the throw-away TLS directory. Safe to call more than once and from an ``atexit`` hook."""
        with self._lock:
            self._stopping = True
            tasks = list(self.tasks.values())
        try:
            self._stop_tasks(tasks)
        finally:
            self._remove_tls_dir()  # a finalizer runs once: later calls do nothing
            self._remove_run_dir()

    # -- scaling ------------------------------------------------------------------------------------------------
    def _write_membership(self) -> None:
        workers = list(self.cluster["worker"])
        write_atomically(self.membership_path,
                         Membership(generation=self.membership_generation, workers=workers).to_json())

    def membership_ack(self) -> MembershipAck | None:
        """What the chief last acknowledged (None: nothing yet)."""
        try:
            with open(self.membership_ack_path, "rb") as fh:
                return MembershipAck.model_validate_json(fh.read())
        except (OSError, ValueError):
            return None

    def _take_scale_request(self) -> None:
        """Called by :meth:`wait`: start on a pending ``kubeps local scale`` request, one at a time."""
        if self._scaler is not None and self._scaler.is_alive():
            return
        try:
            request = scaling.read_request(self.run_dir)
        except ValueError as err:
            self.report(f"scale request ignored: {err}")
            return
        if request is None:
            return

        def scale() -> None:
            started = time.monotonic()
            try:
                ack = self.scale_workers(request.workers)
                message = f"{len(ack.workers)} worker(s), membership generation {ack.generation}"
            except (LauncherError, TimeoutError) as err:
                ack, message = None, f"scaling to {request.workers} worker(s) failed: {err}"
                self.report(message)
            result = {"id": request.id, "workers": len(self.cluster["worker"]),
                      "generation": ack.generation if ack else None, "seconds": time.monotonic() - started,
                      "message": message}
            try:
                write_atomically(os.path.join(self.run_dir, scaling.SCALE_RESULT_FILE), json.dumps(result))
            except OSError:
                pass  # the run ended meanwhile

        self._scaler = threading.Thread(target=scale, name="kubeps-scale", daemon=True)
        self._scaler.start()

    def scale_workers(self, count: int, timeout: float = 120.0) -> MembershipAck:
        """Run ``count`` workers from now on, without restarting the chief: new workers start at new free ports
        (indexes after the last), or the highest indexes are drained and stopped. The chief learns it from its
        membership document; returns its acknowledgement. Scaling down waits (up to ``timeout`` seconds) until
        the chief says the leaving workers finished their last closure, then stops them; a chief that does not
        answer in time is said so and the workers are stopped all the same (their closures re-run elsewhere)."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise LauncherArgumentError("workers", count, "allowed is a number of workers >= 1")
        with self._scale_lock:
            if self._stopping:
                raise LauncherError("the cluster is stopping; not scaling")
            old = len(self.cluster["worker"])
            before = self.membership_ack()
            if count > old:
                ports = free_ports(count - old, self.host)
                host = f"[{self.host}]" if ":" in self.host else self.host
                self.cluster["worker"].extend(f"{host}:{p}" for p in ports)
                if self.metrics_ports:
                    for index, port in zip(range(old, count), free_ports(count - old, self.host)):
                        self.metrics_ports[("worker", index)] = port
                for index in range(old, count):
                    task = self.start_task("worker", index)
                    url = self.metrics_url("worker", index)
                    self.report(f"{task.name} pid {task.pid} at {task.address}" + (f", metrics {url}" if url else ""))
            self.membership_generation += 1
            generation = self.membership_generation
            leaving = list(range(count, old))
            kept = self.cluster["worker"][:count]
            write_atomically(self.membership_path, Membership(generation=generation, workers=kept).to_json())
            self.report(f"scaling workers {old} -> {count} (membership generation {generation})")
            ack = self._wait_for_ack(generation, leaving, before, timeout)
            if leaving:
                retired = []
                with self._lock:
                    for index in leaving:
                        if ("worker", index) in self.tasks:
                            task = self.tasks.pop(("worker", index))
                            task.retired = task.exit_handled = True
                            retired.append(task)
                        self.metrics_ports.pop(("worker", index), None)
                    del self.cluster["worker"][count:]
                self._stop_tasks(retired)
            return ack if ack is not None else MembershipAck(generation=generation, workers=list(range(count)))

    def _wait_for_ack(self, generation: int, leaving: list[int], before: MembershipAck | None,
                      timeout: float) -> MembershipAck | None:
        """The chief's ack of ``generation`` once every index of ``leaving`` drained (once more than ``before``
        says), or None after ``timeout`` seconds (said in a line)."""
        drained_before = list(before.drained) if before else []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._stopping:
            ack = self.membership_ack()
            if ack is not None and ack.generation >= generation and all(
                    ack.drained.count(i) > drained_before.count(i) for i in leaving):
                return ack
            chief = self.tasks.get(("chief", 0))
            if chief is None or not chief.running:
                break
            time.sleep(0.05)
        self.report(f"the chief did not acknowledge membership generation {generation} "
                    + (f"with workers {leaving} drained " if leaving else "")
                    + f"within {timeout:.0f} s" + (": stopping them anyway (their closures re-run elsewhere)"
                                                   if leaving else ""))
        return None

    def _stop_tasks(self, tasks: list[TaskProcess]) -> None:
        if not tasks:
            return
        live = [t for t in tasks if t.running and not t.reaped]
        if live:
            self.report("stopping " + ", ".join(t.name for t in live))
        for task in tasks:
            if task.running:
                self._signal_group(task, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_period
        while any(t.running for t in tasks) and time.monotonic() < deadline:
            time.sleep(0.02)
        for task in tasks:
            if task.running:
                self.report(f"{task.name} (pid {task.pid}) did not stop within {self.grace_period} s: SIGKILL")
            # also catches anything a task left behind in its process group
            self._signal_group(task, signal.SIGKILL)
        for task in tasks:
            self._reap(task)
            if task.output_thread is not None:
                task.output_thread.join(timeout=2.0)
            if task.waiter_thread is not None:
                task.waiter_thread.join(timeout=2.0)

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- TLS ------------------------------------------------------------------------------------------------------------
def _throwaway_credentials(host: str) -> tuple[str, dict[str, str]]:
    """Make a CA and the tasks' certificate for ``host`` in a new private directory: the directory, and the
    settings' fields (``tls_*_file``) naming the files."""
    directory = tempfile.mkdtemp(prefix="kubeps-tls-")  # mode 0700
    try:
        made = certs.issue_job_credentials("local", [host, "localhost"])
        files = {"tls_ca_file": (certs.CA_CERT_KEY, made.ca_cert), "tls_cert_file": (certs.TLS_CERT_KEY, made.cert),
                 "tls_key_file": (certs.TLS_KEY_KEY, made.key)}
        paths = {}
        for field, (filename, data) in files.items():
            path = os.path.join(directory, filename)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            paths[field] = path
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory, paths


# -- the command --------------------------------------------------------------------------------------------------
class _Signalled(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _signal_handler(cluster: LocalCluster) -> Callable[[int, object], None]:
    def handle(signum: int, frame: object) -> None:  # noqa: ARG001 - signal handler signature
        if cluster._defer_signals:
            cluster._pending_signal = signum  # raised once the process being started is tracked
            return
        raise _Signalled(signum)

    return handle


def run_local(
    script: str,
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
            previous[sig] = signal.signal(sig, _signal_handler(cluster))
    try:
        cluster.start()
        return cluster.wait()
    except (_Signalled, KeyboardInterrupt) as err:
        signum: int = err.signum if isinstance(err, _Signalled) else signal.SIGINT
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
