"""``Scaler``: a running local job's workers changed without restarting the chief (``kubeps local scale``).

New workers start at new free ports (indexes after the last), or the highest indexes are drained and stopped. The
chief learns the worker set from its membership document (:class:`~kubeps.runtime.cluster.Membership`, written
atomically into the run directory) and answers with a :class:`~kubeps.runtime.cluster.MembershipAck` file, parsed
with ``MembershipAck.model_validate_json`` -- the one acknowledgement both launchers (this one and the operator)
read. The requests of ``kubeps local scale`` arrive as files (:mod:`kubeps.runtime.local.scaling`); the launcher's
wait loop hands them here (:meth:`Scaler.take_request`), and each is served in a thread of its own.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Callable

from kubeps.runtime.cluster import Membership, MembershipAck
from kubeps.runtime.local import scaling
from kubeps.runtime.local.environment import JobEnvironment
from kubeps.runtime.local.errors import LauncherError
from kubeps.runtime.local.ports import PortAllocator
from kubeps.runtime.local.processes import TaskLauncher
from kubeps.runtime.local.spec import WorkerCount, check_argument
from kubeps.runtime.util.files import write_atomically

__all__ = ["Scaler"]


class Scaler:
    """Scales the workers of the job whose run directory is ``run_dir``: their addresses and metrics ports in
    ``environment``, their processes in ``processes`` (a new worker is started with ``start_worker(index)``), new
    ports from ``ports``."""

    def __init__(self, run_dir: str, environment: JobEnvironment, processes: TaskLauncher, ports: PortAllocator,
                 start_worker: Callable[[int], object]):
        self.run_dir = run_dir
        self.membership_path, self.membership_ack_path = scaling.membership_files(run_dir)
        #: the generation of the membership document last written (0: the workers the run started with)
        self.generation = 0
        self._environment = environment
        self._processes = processes
        self._ports = ports
        self._start_worker = start_worker
        self._lock = threading.Lock()
        self._serving: threading.Thread | None = None

    def _report(self, message: str) -> None:
        self._processes.console.report(message)

    def write_membership(self, workers: list[str] | None = None) -> None:
        """The membership document of the current generation: ``workers``, or every worker of the job."""
        workers = list(self._environment.cluster["worker"]) if workers is None else workers
        write_atomically(self.membership_path, Membership(generation=self.generation, workers=workers).to_json())

    def ack(self) -> MembershipAck | None:
        """What the chief last acknowledged (None: nothing yet)."""
        try:
            with open(self.membership_ack_path, "rb") as fh:
                return MembershipAck.model_validate_json(fh.read())
        except (OSError, ValueError):
            return None

    def take_request(self) -> None:
        """Start on a pending ``kubeps local scale`` request, one at a time (called by the launcher's wait loop)."""
        if self._serving is not None and self._serving.is_alive():
            return
        try:
            request = scaling.read_request(self.run_dir)
        except ValueError as err:
            self._report(f"scale request ignored: {err}")
            return
        if request is None:
            return
        self._serving = threading.Thread(target=self._serve, args=(request,), name="kubeps-scale", daemon=True)
        self._serving.start()

    def _serve(self, request: scaling.ScaleRequest) -> None:
        started = time.monotonic()
        generation: int | None = None
        try:
            ack = self.scale(request.workers)
            generation = ack.generation
            message = f"{len(ack.workers)} worker(s), membership generation {generation}"
        except (LauncherError, TimeoutError) as err:
            message = f"scaling to {request.workers} worker(s) failed: {err}"
            self._report(message)
        result = {"id": request.id, "workers": len(self._environment.cluster["worker"]), "generation": generation,
                  "seconds": time.monotonic() - started, "message": message}
        try:
            write_atomically(os.path.join(self.run_dir, scaling.SCALE_RESULT_FILE), json.dumps(result))
        except OSError:
            pass  # the run ended meanwhile

    def scale(self, count: int, timeout: float = 120.0) -> MembershipAck:
        """Run ``count`` workers from now on and return the chief's acknowledgement. Scaling down waits (up to
        ``timeout`` seconds) until the chief says the leaving workers finished their last closure, then stops
        them; a chief that does not answer in time is said so and the workers are stopped all the same (their
        closures re-run elsewhere)."""
        count = check_argument("workers", count, WorkerCount)
        with self._lock:
            if self._processes.stopping:
                raise LauncherError("the cluster is stopping; not scaling")
            old = len(self._environment.cluster["worker"])
            before = self.ack()
            if count > old:
                addresses = [self._ports.address(p) for p in self._ports.free(count - old)]
                metrics = self._ports.free(count - old) if self._environment.metrics_ports else []
                for index in self._environment.add_workers(addresses, metrics):
                    self._start_worker(index)
            self.generation += 1
            leaving = list(range(count, old))
            self.write_membership(self._environment.cluster["worker"][:count])
            self._report(f"scaling workers {old} -> {count} (membership generation {self.generation})")
            ack = self._wait_for_ack(self.generation, leaving, before, timeout)
            if leaving:
                with self._processes.lock:
                    retired = self._processes.retire(("worker", index) for index in leaving)
                    self._environment.keep_workers(count)
                self._processes.stop(retired)
            return ack if ack is not None else MembershipAck(generation=self.generation, workers=list(range(count)))

    def _wait_for_ack(self, generation: int, leaving: list[int], before: MembershipAck | None,
                      timeout: float) -> MembershipAck | None:
        """The chief's ack of ``generation`` once every index of ``leaving`` drained (once more than ``before``
        says), or None after ``timeout`` seconds (said in a line)."""
        drained_before = list(before.drained) if before else []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._processes.stopping:
            ack = self.ack()
            if ack is not None and ack.generation >= generation and all(
                    ack.drained.count(i) > drained_before.count(i) for i in leaving):
                return ack
            chief = self._processes.tasks.get(("chief", 0))
            if chief is None or not chief.running:
                break
            time.sleep(0.05)
        self._report(f"the chief did not acknowledge membership generation {generation} "
                     + (f"with workers {leaving} drained " if leaving else "")
                     + f"within {timeout:.0f} s" + (": stopping them anyway (their closures re-run elsewhere)"
                                                    if leaving else ""))
        return None
