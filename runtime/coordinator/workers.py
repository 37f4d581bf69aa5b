"""The chief's workers, as TensorFlow's ``Cluster`` and ``Worker`` in ``cluster_coordinator.py``: the
:class:`WorkerSet` owns the workers dispatched to, the failure handling (its
:class:`~kubeps.runtime.coordinator.failure.FailureDetector`) and the per-worker resources every worker builds;
each :class:`Worker` owns its dispatch thread.

A worker's thread takes closures from the :class:`~kubeps.runtime.coordinator.closure_queue.ClosureQueue` (its
tagged queue first), sends them in one ``RunClosure`` call, or several in one ``RunClosures`` call while the queue
holds more than its fair share, and settles each from its typed answer
(:class:`~kubeps.runtime.rpc.protocol.ClosureAnswer`, :class:`~kubeps.runtime.rpc.protocol.RunClosuresAnswer`):
finished, failed, or handed to the failure handling. A worker that fails is waited for (pinged with backoff), its
per-worker resources are rebuilt, and the closure it ran is re-queued (at-least-once).

What a worker's answers say about its iterators' passes (records read again after a reshard or a restart) is
counted by whoever the set is given as its :class:`RecordsAccount` (the membership controller).
"""

from __future__ import annotations

import functools
import itertools
import logging
import pickle
import threading
import time
from typing import Any, Callable, Protocol

import grpc
import numpy as np

from kubeps.runtime.coordinator.closure_queue import Closure, ClosureQueue, ClosureState
from kubeps.runtime.coordinator.failure import FailureDetector, Heartbeat
from kubeps.runtime.coordinator.leases import InputLeases
from kubeps.runtime.coordinator.options import CoordinatorOptions
from kubeps.runtime.coordinator.shipping import build_dataset, dumps
from kubeps.runtime.errors import ClosureError, OutOfRangeError, RemoteError, ResourceMissingError, \
    WorkerUnavailableError
from kubeps.runtime.observe import metrics as _metrics
from kubeps.runtime.rpc.client import Client
from kubeps.runtime.rpc.codec import join_structure
from kubeps.runtime.rpc.protocol import (PING, WORKER, WORKER_SERVICE, ClosureAnswer, CreateResourceRequest,
                                         RunClosureRequest, RunClosuresAnswer, RunClosuresRequest)

__all__ = ["RecordsAccount", "Worker", "WorkerSet"]

log = logging.getLogger("kubeps.runtime.coordinator.workers")

#: worker RPC failures that are the request's fault, not the worker's: the closure fails instead of re-running
NON_RETRYABLE_CODES = frozenset({"UNAUTHENTICATED", "PERMISSION_DENIED", "INVALID_ARGUMENT", "NOT_FOUND",
                                 "UNIMPLEMENTED", "FAILED_PRECONDITION"})
#: raw gRPC errors that can escape a transport instead of a RemoteError: the call did not complete (a cancelled
#: future, a failed call), so the worker is treated as lost and the closure re-run, as for a RemoteError
_GRPC_CALL_ERRORS = (grpc.RpcError, grpc.FutureCancelledError, grpc.FutureTimeoutError)


class RecordsAccount(Protocol):
    """Who counts the records a reshard, a leaving worker or a restarted worker makes read again."""

    def answered(self, worker: Worker, in_pass: int | None, reread: int | None) -> None:
        """A worker's ``ok`` answer: where its iterators stand (``in_pass``), what an iterator built again replaced
        (``reread``)."""

    def add(self, worker: Worker, records: int, why: str) -> None:
        """``records`` of ``worker``'s passes under way are read again by the new shards."""


class Worker:
    """One worker: its client, health, in-flight call, and the dispatch thread that runs closures on it."""

    def __init__(self, workers: WorkerSet, index: int, address: str, client: Client):
        self.cluster = workers  # the WorkerSet (TensorFlow's Cluster)
        self.index = index
        self.address = address
        self.client = client
        self.healthy = False
        self.incarnation: str | None = None
        self.call: Any = None  # the in-flight RPC (cancelled by the monitor when the worker stops answering)
        self.failures = 0
        self.thread: threading.Thread | None = None
        self.heartbeat = Heartbeat()
        #: joined a running coordinator (if it never answers, the job goes on without it)
        self.joined = False
        #: every per-worker resource is to be built on it before its first closure (a joining worker)
        self.needs_resources = False
        #: left the membership: it finishes the closure it runs, takes nothing more, and its thread ends
        self.retiring = False
        #: records its iterators had handed out in their passes under way, after its last function (its answer)
        self.in_pass = 0

    def __repr__(self) -> str:
        return f"Worker({self.index}, {self.address!r})"

    def start(self) -> None:
        self.thread = threading.Thread(target=self._dispatch_loop, daemon=True, name=f"kubeps-worker-{self.index}")
        self.thread.start()

    # -- the dispatch thread -------------------------------------------------------------------------------------
    def _dispatch_loop(self) -> None:
        """The worker's dispatch thread. It ends only when the coordinator stops (or the worker left the
        membership): an unexpected error in an iteration is logged and fails the closure the thread held
        (:meth:`_dispatch_failed`), so no closure is ever left in flight by a dead thread (``join`` would wait
        forever)."""
        workers, queue = self.cluster, self.cluster.queue
        stopping, most = workers.stopping, workers.options.max_closures_per_call - 1
        while not stopping.is_set() and not self.retiring:
            closure, attempt = None, 0
            try:
                if not self.healthy and not self._recover():
                    continue
                closure = queue.get(self.index, timeout=0.5)
                if closure is None:
                    continue
                attempt = closure.attempts
                more = queue.take_more(self.index, most) if closure.kind == "closure" and closure.worker is None \
                    else []
                if more:
                    self._run_batch([closure, *more])
                else:
                    self._run_closure(closure)
            except BaseException as err:  # noqa: BLE001 - the thread must outlive any error (see _dispatch_failed)
                self._dispatch_failed(closure, attempt, err)
        if self.retiring and not stopping.is_set():
            workers.drained(self)

    def _recover(self) -> bool:
        """Wait for the worker to answer, then rebuild its per-worker resources where it lost them or never had
        them; True when it may take closures."""
        if not self.wait():
            return False
        if (self.failures or self.needs_resources) and not self.rebuild_resources():
            self.healthy = False
            self.cluster.stopping.wait(1.0)  # do not hammer a worker whose rebuild keeps failing
            return False
        if self.needs_resources:
            self.needs_resources = False
            log.info("worker %d (%s) joined: per-worker resources built, taking closures", self.index, self.address)
        return True

    def _run_batch(self, closures: list[Closure]) -> None:
        taken = [(extra, extra.attempts) for extra in closures[1:]]
        try:
            self._run_closures(closures)
        except BaseException as err:
            # the last resort of the loop knows only the first closure: fail the others still held here
            for extra, extra_attempt in taken:
                if self.cluster.queue.fail_if_running(extra, extra_attempt, err):
                    self.cluster.closure_done()
            raise

    def _dispatch_failed(self, closure: Closure | None, attempt: int, error: BaseException) -> None:
        """An iteration of the dispatch thread raised ``error`` (a bug, a malformed answer...): log it and fail
        the closure the thread still held with it -- not re-run, as the same error would likely come back forever;
        while stopping it is cancelled. A closure the iteration had already handed on (finished, failed,
        re-queued) is left alone. Then the thread goes on, after a pause when no closure was involved (e.g.
        reconnecting raised) so that a persistent error does not spin."""
        self.call = None
        queue, stopping = self.cluster.queue, self.cluster.stopping
        held = closure is not None and closure.state is ClosureState.RUNNING and closure.attempts == attempt
        log.error("dispatch thread of worker %d (%s) caught an unexpected error%s", self.index, self.address,
                  f" running {closure!r}" if held else "", exc_info=error)
        try:
            if closure is not None:
                if stopping.is_set():
                    if held:
                        queue.requeue(closure)  # cancels it: the queue is stopped
                elif queue.fail_if_running(closure, attempt, error):
                    self.cluster.closure_done()
            if not held:
                self.healthy = False  # reconnect (and rebuild) before taking more work
                stopping.wait(1.0)
        except BaseException:  # noqa: BLE001 - last resort: never let the handler itself end the thread
            log.exception("dispatch thread of worker %d could not recover from %r", self.index, error)

    # -- one call ----------------------------------------------------------------------------------------------------
    def _call(self, closures: list[Closure], method: str, request: Any,
              timeout: float) -> tuple[Any, list[np.ndarray]] | None:
        """Send ``closures`` in one ``method`` call and return the answer; None when the call did not happen or
        failed, its closures then handled: re-queued (cancelled while stopping), failed (a non-retryable code: the
        first, the others cancelled by that error), or re-run after the worker's failure (at-least-once: any of
        them may have run)."""
        queue, stopping = self.cluster.queue, self.cluster.stopping
        if stopping.is_set():
            for closure in closures:
                queue.requeue(closure)  # cancels it: taken just as the coordinator stopped
            return None
        try:
            try:
                self.call = self.client.start(method, request, [c.payload for c in closures], timeout=timeout)
                return self.client.finish(self.call)
            except _GRPC_CALL_ERRORS as raw:  # the transport should have made it a RemoteError
                log.warning("worker %d: %s escaped the transport; handled as %s", self.index,
                            type(raw).__name__, "a failed call")
                raise _as_remote_error(raw, self.address) from raw
        except RemoteError as err:
            self.call = None
            first, rest = closures[0], closures[1:]
            if stopping.is_set():
                for closure in closures:
                    queue.requeue(closure)  # cancels it: the queue is stopped
            elif err.code in NON_RETRYABLE_CODES:
                queue.mark_failed(first, err)
                queue.give_back(rest)  # cancelled: the error is pending
            else:
                for closure in rest:  # the worker may have run them before it failed, as the first
                    closure.info["input_lost"] = bool(self.cluster.leases)
                    queue.requeue(closure)
                self.handle_failure(first, err)
            return None
        finally:
            self.call = None

    def _run_closure(self, closure: Closure) -> None:
        request: RunClosureRequest | CreateResourceRequest
        leases = self.cluster.leases
        if closure.kind == "closure":
            request = RunClosureRequest(closure_id=closure.id)
            if leases:
                request["leases"] = leases.grants(self.index)
            method = WORKER.RUN_CLOSURE
        else:
            request = CreateResourceRequest(closure_id=closure.id, resource_id=closure.info["resource_id"])
            leases.release(self.index)  # a dataset or an iterator built: the feeds read from the commits on
            method = WORKER.CREATE_RESOURCE
        started = time.perf_counter()
        got = self._call([closure], method, request, self.cluster.options.closure_timeout)
        if got is None:
            return
        answer: ClosureAnswer = got[0]
        arrays = got[1]
        self._settle(closure, answer, arrays, time.perf_counter() - started)
        if answer.get("status") == "ok":
            self.cluster.records.answered(self, answer.get("in_pass"), answer.get("reread"))

    def _run_closures(self, closures: list[Closure]) -> None:
        """Several closures in one ``RunClosures`` call (``max_closures_per_call``): the worker runs them one after
        the other and stops after the first that does not finish; those after it go back to the front of the
        queue, untouched. A failed call is a failure of each closure, as for one."""
        queue = self.cluster.queue
        request: RunClosuresRequest = {"closure_ids": [closure.id for closure in closures]}
        if self.cluster.leases:
            request["leases"] = self.cluster.leases.grants(self.index)
        started = time.perf_counter()
        got = self._call(closures, WORKER.RUN_CLOSURES, request, self.cluster.options.closure_timeout * len(closures))
        if got is None:
            return
        answer: RunClosuresAnswer = got[0]
        arrays = got[1]
        answers, counts = answer.get("answers"), answer.get("counts")
        if not (answer.get("status") == "ok" and isinstance(answers, list) and isinstance(counts, list)
                and len(answers) == len(counts) and 0 < len(answers) <= len(closures)
                and all(isinstance(c, int) and c >= 0 for c in counts) and sum(counts) == len(arrays)):
            error = ValueError(f"malformed {WORKER.RUN_CLOSURES} answer from worker {self.index}: "
                               f"{len(closures)} function(s) sent, {len(arrays)} tensor(s) and {answer!r:.200} back")
            queue.mark_failed(closures[0], error)
            queue.give_back(closures[1:])  # cancelled: the error is pending
            self.cluster.closure_done()
            return
        queue.give_back(closures[len(answers):])
        seconds = (time.perf_counter() - started) / len(answers)
        offset = 0
        for closure, one, count in zip(closures, answers, counts):
            self._settle(closure, one, arrays[offset:offset + count], seconds)
            offset += count
        self.cluster.records.answered(self, answer.get("in_pass"), None)

    def _settle(self, closure: Closure, answer: ClosureAnswer, arrays: list[np.ndarray], seconds: float) -> None:
        """One closure's answer: finished, failed, or handed to the failure handling."""
        queue = self.cluster.queue
        status = answer.get("status")
        if closure.kind == "closure":  # what its steps read, failed or not (their pushes applied)
            self.cluster.leases.commit(self.index, answer.get("positions"), bool(closure.info.get("input_lost")))
        if status == "ok":
            try:
                result = closure_result(arrays)
            except Exception as err:  # noqa: BLE001 - a result we cannot rebuild fails the closure
                queue.mark_failed(closure, err)
                return
            queue.mark_finished(closure, result)
            self.cluster.closure_done()
            if _metrics.ENABLED and closure.kind == "closure":
                _metrics.CLOSURE_SECONDS.labels(str(self.index)).observe(seconds)
        elif status == "resource_missing":
            self.handle_failure(closure, ResourceMissingError(answer.get("message", "")))
        elif status == "ps_unavailable":
            self.cluster.failures.handle_ps_error(closure, int(answer.get("ps_index", -1)), answer.get("message", ""),
                                              restarted=bool(answer.get("restarted")))
            self.rewind_input()
        elif status == "needs_input":  # run again with more shards (or elsewhere, if the data is nearly done)
            self.cluster.leases.ran_out(self.index)
            queue.requeue(closure)
            self.rewind_input()
            self.cluster.stopping.wait(0.05)  # the others may hold the last shards: no busy loop meanwhile
        else:
            queue.mark_failed(closure, closure_error(answer, arrays, self))
            self.cluster.closure_done()
            self.rewind_input()

    def rewind_input(self) -> None:
        """A function did not finish: what it took up to its last write is committed (its answer's positions), and
        the worker's exactly-once shards go back from there while its iterators are built again, so what its pipeline
        had read ahead is read by whoever runs the function (or the next one)."""
        if self.cluster.leases and not self.rebuild_resources():  # rebuilding takes the shards back
            self.healthy = False  # rebuilt when it answers again

    # -- failures ----------------------------------------------------------------------------------------------------
    def handle_failure(self, closure: Closure | None, error: BaseException) -> None:
        """The worker failed while running ``closure``: re-queue it (at-least-once) and mark the worker down."""
        log.warning("worker %d (%s) failed: %s", self.index, self.address, error)
        queue = self.cluster.queue
        self.healthy = False
        self.failures += 1
        self.cluster.leases.release(self.index)
        if closure is not None and self.cluster.leases:
            closure.info["input_lost"] = True  # its re-run trains records the lost run may have trained
        if closure is not None:
            if closure.kind == "resource":
                queue.mark_finished(closure, None)  # rebuilt with all the others when the worker returns
            else:
                queue.requeue(closure)
        queue.drop_per_worker(self.index)

    def wait(self) -> bool:
        """Ping the worker with backoff until it answers (True), or the coordinator stops or the worker leaves the
        membership (False)."""
        options, queue, stopping = self.cluster.options, self.cluster.queue, self.cluster.stopping
        delay = 0.05
        deadline = time.monotonic() + options.worker_wait_timeout
        reported = False
        while not stopping.is_set() and not self.retiring:
            try:
                meta, _ = self.client.call(PING, timeout=max(2.0, options.ping_timeout))
            except RemoteError as err:
                if err.code in NON_RETRYABLE_CODES and not reported:
                    queue.set_error(err)  # e.g. wrong job token: no point in waiting quietly
                    reported = True
                # a worker that joined and never answered is not the job's loss: it may wait for a node or a quota,
                # and the others go on meanwhile
                never_seen = self.joined and self.incarnation is None
                if time.monotonic() > deadline and not reported and not never_seen:
                    queue.set_error(WorkerUnavailableError(
                        f"worker {self.index} at {self.address} did not come back within "
                        f"{options.worker_wait_timeout:.0f} s: {err}", code=err.code, address=self.address))
                    reported = True
                stopping.wait(delay)
                delay = min(delay * 2, 2.0)
                continue
            previous = self.incarnation
            self.incarnation = meta.get("incarnation")
            self.heartbeat.last_ok = time.monotonic()
            self.healthy = True
            if previous is not None and previous != self.incarnation:
                log.info("worker %d came back as a new process", self.index)
            return True
        return False

    def rebuild_resources(self) -> bool:
        """Re-create every per-worker resource on the worker (in creation order): it came back, or it joined."""
        replaced, read_before = False, self.in_pass
        self.cluster.leases.release(self.index)  # the exactly-once datasets read from their commits on
        for resource_id, payload in self.cluster.resources_for(self):
            try:
                answer, arrays = self.client.call(WORKER.CREATE_RESOURCE,
                                                  CreateResourceRequest(resource_id=resource_id), [payload],
                                                  timeout=self.cluster.options.closure_timeout)
            except RemoteError as err:
                log.warning("rebuilding %s on worker %d failed: %s", resource_id, self.index, err)
                return False
            if answer.get("status") != "ok":
                error = closure_error(answer, arrays, self)
                log.error("rebuilding %s on worker %d raised %r", resource_id, self.index, error)
                if answer.get("status") == "error":
                    self.cluster.queue.set_error(error)
                return False
            replaced = replaced or "reread" in answer
            self.cluster.records.answered(self, answer.get("in_pass"), answer.get("reread"))
        if not replaced and read_before:
            # the worker restarted (it had none of its iterators): its last answer said how far it had read
            self.cluster.records.add(self, read_before, "restarted")
        return True


class WorkerSet:
    """The workers of one coordinator: those dispatched to (the membership, in index order), every worker with a
    dispatch thread (those and the leaving ones still finishing a closure: the failure detector watches them all),
    those drained, the per-worker resources each builds, and the failure handling."""

    def __init__(self, strategy: Any, queue: ClosureQueue, options: CoordinatorOptions,
                 connect: Callable[[str], Client], records: RecordsAccount, watchdog: Any = None):
        self.strategy, self.queue, self.options = strategy, queue, options
        self.records, self.watchdog = records, watchdog
        self._connect = connect
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        #: the workers dispatched to (the membership), in index order
        self.members: list[Worker] = [self.new(i, address) for i, address in enumerate(strategy.worker_addresses)]
        #: every worker with a dispatch thread (the failure detector reads this list as it changes)
        self.handles: list[Worker] = list(self.members)
        #: indexes of the workers that left and finished their last closure, in the order they did
        self.drained_indexes: list[int] = []
        self.finished = 0  # closures that finished (ok or raised): the watchdog's measure of progress
        self._resources: list[tuple[str, np.ndarray]] = []  # (resource_id, pickled creator), creation order
        self._dataset_fns: dict[str, Callable[..., Any]] = {}  # resource_id -> dataset_fn of each dataset
        self._resource_ids = itertools.count()
        #: the shards of the exactly-once datasets leased to each worker (coordinator/leases.py)
        self.leases = InputLeases()
        #: heartbeats of every ps and busy worker, and the accounting of ps errors (coordinator/failure.py)
        self.failures = FailureDetector(
            strategy, queue, self.handles, self.stopping, heartbeat_interval=options.heartbeat_interval,
            heartbeat_failures=options.heartbeat_failures, ping_timeout=options.ping_timeout,
            max_transient_ps_errors=options.max_transient_ps_errors, ps_error_interval=options.ps_error_interval,
            ps_error_window=options.ps_error_window)

    def new(self, index: int, address: str) -> Worker:
        return Worker(self, index, address, self._connect(address))

    def start(self) -> None:
        for worker in self.members:
            worker.start()
        self.failures.start()

    def check_open(self) -> None:
        if self.stopping.is_set():
            raise RuntimeError("this ClusterCoordinator was shut down")

    def closure_done(self) -> None:
        with self.lock:
            self.finished += 1
        if self.watchdog is not None:
            self.watchdog.notify()

    def progress(self) -> Any:
        """What the watchdog polls: the finished-closure count while work is pending; with nothing scheduled a
        fresh object every time (always "progress"), so an idle coordinator never triggers a dump."""
        stats = self.queue.stats()
        if not (stats["queued"] or stats["inflight"] or stats["per_worker"]):
            return object()
        return self.finished

    # -- per-worker resources ----------------------------------------------------------------------------------------
    def add_resource(self, kind: str, payload: np.ndarray) -> str:
        """Register a per-worker resource (built on every worker, rebuilt where lost); returns its id."""
        resource_id = f"{kind}-{next(self._resource_ids)}"
        with self.lock:
            self._resources.append((resource_id, payload))
        return resource_id

    def add_dataset_fn(self, resource_id: str, dataset_fn: Callable[..., Any]) -> None:
        """A per-worker dataset's function: a worker that joins later builds it for the membership of then."""
        with self.lock:
            self._dataset_fns[resource_id] = dataset_fn

    def dataset_count(self) -> int:
        with self.lock:
            return len(self._dataset_fns)

    def resources_for(self, worker: Worker) -> list[tuple[str, np.ndarray]]:
        """Every per-worker resource as ``worker`` builds it now, in creation order: each dataset sharded for the
        membership of now (``InputContext(num_workers, worker.index)``), which may not be that of its creation."""
        with self.lock:
            resources = list(self._resources)
            datasets = dict(self._dataset_fns)
            count = max(len(self.members), worker.index + 1)
        return [(rid, dumps(functools.partial(build_dataset, datasets[rid], count), "the dataset function")
                 if rid in datasets else payload) for rid, payload in resources]

    # -- leaving and stopping ----------------------------------------------------------------------------------------
    def drained(self, worker: Worker) -> None:
        """A leaving worker's dispatch thread ended: nothing of the job runs on it any more."""
        if worker.in_pass and self.dataset_count():  # the workers that stay read its share again
            self.records.add(worker, worker.in_pass, "left")
        self.leases.release(worker.index)  # its shards' records not trained go to the workers that stay
        with self.lock:
            if worker in self.handles:
                self.handles.remove(worker)
            self.drained_indexes.append(worker.index)
        worker.client.close()
        log.info("worker %d (%s) drained: it may be stopped", worker.index, worker.address)

    def stop(self) -> None:
        """Stop every dispatch thread (cancelling the calls in flight), close the clients, stop the detector."""
        self.stopping.set()
        self.queue.stop()
        with self.lock:
            handles = list(self.handles)
        for worker in handles:
            call = worker.call
            if call is not None:
                call.cancel()
        for worker in handles:
            if worker.thread is not None:
                worker.thread.join(timeout=5)
            worker.client.close()
        self.failures.stop()


# -- answers -------------------------------------------------------------------------------------------------------
def closure_result(arrays: list[np.ndarray]) -> Any:
    """A finished function's value, from its answer's tensors (a pickled skeleton, then its arrays)."""
    if not arrays:
        raise ValueError("malformed RunClosure answer: no result skeleton")
    skeleton = pickle.loads(arrays[0].tobytes())
    return join_structure(skeleton, arrays[1:])


def closure_error(answer: ClosureAnswer, arrays: list[np.ndarray], worker: Worker) -> BaseException:
    """The exception a function raised on ``worker``, rebuilt, with a note naming the worker and holding its
    traceback (``ClosureError`` when it cannot be rebuilt). A ``StopIteration`` -- a per-worker iterator that ran
    out -- becomes ``OutOfRangeError``, as in TensorFlow."""
    blob = arrays[0].tobytes() if arrays else b""
    remote_tb = answer.get("traceback", "")
    where = f"worker {worker.index} (/job:worker/task:{worker.index} at {worker.address})"
    error: Any = None
    if blob:
        try:
            error = pickle.loads(blob)
        except Exception:  # noqa: BLE001 - fall back to the text
            error = None
    if isinstance(error, StopIteration) or (error is None and answer.get("type") == "StopIteration"):
        error = OutOfRangeError(
            f"End of sequence on {where}: a scheduled function called next() on an iterator that ran out (a "
            f"per-worker dataset without .repeat()); make the dataset repeat, or schedule no more steps than "
            f"it has batches")
    if not isinstance(error, BaseException):
        error = ClosureError(answer.get("type", "Error"), f"{answer.get('message', '')} (raised on {where})",
                             remote_tb)
    if hasattr(error, "add_note"):
        error.add_note(f"raised on {where}" + (f":\n{remote_tb.rstrip()}" if remote_tb else ""))
    elif error.args and isinstance(error.args[0], str) and where not in error.args[0]:
        # Python 3.10 has no exception notes: the message itself names the worker
        error.args = (f"{error.args[0]} (raised on {where})", *error.args[1:])
    return error


def _as_remote_error(err: BaseException, address: str) -> RemoteError:
    """A raw gRPC error that escaped the transport, as the :class:`RemoteError` it should have been."""
    if isinstance(err, grpc.FutureCancelledError):
        code = "CANCELLED"
    elif isinstance(err, grpc.FutureTimeoutError):
        code = "DEADLINE_EXCEEDED"
    else:
        code_of = getattr(err, "code", None)
        status = code_of() if callable(code_of) else None
        code = getattr(status, "name", None) or "UNKNOWN"
    error = RemoteError(f"{WORKER_SERVICE} at {address} failed with {code}: {type(err).__name__}: {err}",
                        code=code, address=address)
    error.reason = None
    return error
