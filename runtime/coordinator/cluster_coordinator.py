"""``ClusterCoordinator``: schedules functions on workers, as TensorFlow's class of the same name.

* ``schedule(fn, args, kwargs)`` pickles ``fn`` with cloudpickle (variables travel as handles, per-worker
  iterators as references) and queues it; it returns a :class:`RemoteValue` at once.
* One dispatch thread per worker takes closures from the :class:`~kubeps.runtime.coordinator.closure_queue.ClosureQueue`
  (its tagged queue first) and runs them with a ``RunClosure`` RPC; the result is copied back as soon as the
  closure finishes.
* A monitor thread pings every parameter server and every busy worker, all in parallel, each ping with a short
  deadline (the failure detector): a peer without an answered ping for ``heartbeat_failures x heartbeat_interval``
  seconds is declared dead, so one hung peer never delays the detection of another. It also compares each
  parameter server's incarnation with the one its variables were created in: a ps that restarted empty fails the
  job at once (restart the chief from a checkpoint).
* With ``watchdog_timeout`` (or a :class:`~kubeps.runtime.coordinator.watchdog.Watchdog`), every thread's stack is dumped when
  no closure finished for that long while work is pending.
* Workers join and leave while it runs (:meth:`ClusterCoordinator.apply_membership`, driven by the membership
  document the :mod:`~kubeps.runtime.coordinator.membership` watcher reads): a joining worker gets a dispatch
  thread, which waits for it to answer and builds every per-worker resource on it (datasets, iterators) before
  its first closure; a leaving worker is handed nothing more, finishes the closure it runs (re-queued if it fails
  on the way) and is closed: nothing in flight is wasted.

Failure handling (each step a method named for it, for subclasses and the fault-tolerance layer):
``handle_worker_failure`` (re-queue the closure: at-least-once), ``wait_for_worker`` (reconnect with backoff),
``rebuild_worker_resources`` (datasets and iterators re-created from scratch), ``handle_ps_error`` (retry while a
PS blip lasts: errors closer than ``ps_error_interval`` count once, the job fails after more than
``max_transient_ps_errors`` counted errors), ``mark_ps_failed`` (:class:`~kubeps.runtime.errors.PSUnavailableError` through
``schedule``/``join``/``done``).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import os
import pickle
import sys
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import cloudpickle
import grpc
import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kubeps.runtime.checkpoint.manager import newest_manager
from kubeps.runtime.cluster import Membership, MembershipAck
from kubeps.runtime.util import nest
from kubeps.runtime.util.gil import hold_switch_interval
from kubeps.runtime.coordinator.closure_queue import Closure, ClosureQueue, ClosureState, RemoteValue
from kubeps.runtime.coordinator.failure import FailureDetector, Heartbeat
from kubeps.runtime.coordinator.membership import MembershipWatcher
from kubeps.runtime.coordinator.hotspots import DEFAULT_HOTSPOT_THRESHOLD, HotSpotDetector
from kubeps.runtime.observe import logs as _logs
from kubeps.runtime.observe import metrics as _metrics
from kubeps.runtime.data.distribute import DistributedDataset
from kubeps.runtime.variables.context import current_input_context
from kubeps.runtime.errors import (
    ClosureError,
    OutOfRangeError,
    PSUnavailableError,
    RemoteError,
    ResourceMissingError,
    RuntimeConfigError,
    WorkerUnavailableError,
)
from kubeps.runtime.rpc.client import Client
from kubeps.runtime.rpc.protocol import (PING, PS, WORKER, WORKER_SERVICE, CreateResourceRequest, RunClosureRequest,
                                        RunClosuresRequest)
from kubeps.runtime.coordinator.strategy import ParameterServerStrategy
from kubeps.runtime.coordinator.values import PerWorkerDataset, PerWorkerIterator, PerWorkerValues
from kubeps.runtime.coordinator.watchdog import Watchdog
from kubeps.runtime.rpc.codec import join_structure

__all__ = ["ClusterCoordinator", "PerWorkerDataset", "PerWorkerIterator", "PerWorkerValues", "RemoteValue"]

log = logging.getLogger("kubeps.runtime.coordinator.cluster_coordinator")

#: worker RPC failures that are the request's fault, not the worker's: the closure fails instead of re-running
_NON_RETRYABLE_CODES = frozenset({"UNAUTHENTICATED", "PERMISSION_DENIED", "INVALID_ARGUMENT", "NOT_FOUND",
                                  "UNIMPLEMENTED", "FAILED_PRECONDITION"})
#: raw gRPC errors that can escape a transport instead of a RemoteError: the call did not complete (a cancelled
#: future, a failed call), so the worker is treated as lost and the closure re-run, as for a RemoteError
_GRPC_CALL_ERRORS = (grpc.RpcError, grpc.FutureCancelledError, grpc.FutureTimeoutError)
#: the most queued functions one call to a worker carries (``max_closures_per_call``)
DEFAULT_CLOSURES_PER_CALL = 8
#: the GIL switch interval the coordinator holds while it runs (seconds; ``gil_switch_interval``, util/gil.py)
DEFAULT_GIL_SWITCH_INTERVAL = 0.05


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


# -- shipping functions ----------------------------------------------------------------------------------------------
#: modules ``_ship_by_value`` has decided on, by name, with the module object it saw: the decision resolves paths
#: (a few hundred microseconds), and ``schedule`` asks it for every function
_shipping_decided: dict[str, Any] = {}


def _ship_by_value(fn: Any) -> None:
    """Pickle the user's own modules by value, so workers need not import them (``__main__`` always is)."""
    module_name = getattr(fn, "__module__", None)
    if not module_name or module_name == "__main__" or module_name.startswith(("kubeps.", "cloudpickle")):
        return
    module = sys.modules.get(module_name)
    if module is None or _shipping_decided.get(module_name) is module:
        return
    _shipping_decided[module_name] = module
    path = getattr(module, "__file__", None)
    if path is None:
        return
    path = os.path.realpath(path)
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    if any(path.startswith(p + os.sep) for p in prefixes) or "site-packages" in path:
        return  # installed: the worker image has it
    try:
        cloudpickle.register_pickle_by_value(module)
    except ValueError:
        pass


def _dumps(obj: Any, what: str) -> np.ndarray:
    try:
        blob = cloudpickle.dumps(obj)
    except Exception as err:  # noqa: BLE001 - tell the user what could not be shipped
        raise TypeError(f"cannot send {what} to the workers: pickling failed with {type(err).__name__}: {err}") from err
    return np.frombuffer(blob, dtype=np.uint8)


def _build_dataset(dataset_fn: Callable, num_workers: int) -> Any:
    """Runs on a worker: call ``dataset_fn()`` or ``dataset_fn(input_context)``."""
    try:
        params = [p for p in inspect.signature(dataset_fn).parameters.values()
                  if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    if params:
        return dataset_fn(current_input_context(num_workers))
    return dataset_fn()


# -- the coordinator ---------------------------------------------------------------------------------------------------
class _WorkerHandle:
    """The coordinator's view of one worker: its client, health, in-flight call and dispatch thread."""

    def __init__(self, index: int, address: str, client: Client):
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


class ClusterCoordinator:
    """``ClusterCoordinator(strategy)``: dispatches functions to the strategy's workers.

    kubeps extras (keyword-only):

    * ``closure_timeout``: deadline of one function run (default an hour).
    * ``heartbeat_interval`` (1 s), ``heartbeat_failures`` (3), ``ping_timeout`` (1 s): every parameter server and
      every busy worker is pinged every ``heartbeat_interval`` seconds, in parallel, each ping with a
      ``ping_timeout`` deadline; a peer whose pings went unanswered for ``heartbeat_failures x heartbeat_interval``
      seconds is dead (a busy worker's call is cancelled and its closure re-queued; a ps fails the job).
    * ``max_transient_ps_errors`` (3, as TF's) and ``ps_error_interval`` (1 s): a closure that cannot reach a ps
      is retried; errors from one ps less than ``ps_error_interval`` apart count once, counted errors expire after
      ``ps_error_window`` (60 s), and one more counted error than ``max_transient_ps_errors`` fails the job. So
      a ps unreachable for about ``max_transient_ps_errors x ps_error_interval`` seconds is survived.
    * ``worker_wait_timeout``: how long a lost worker is waited for before the job fails.
    * ``watchdog_timeout`` (None: off) or ``watchdog`` (a :class:`~kubeps.runtime.coordinator.watchdog.Watchdog`): dump every
      thread's stack when no closure finished for that long while work is pending (diagnosis only).
    * ``hotspot_interval`` (default: the settings' ``KUBEPS_HOTSPOT_INTERVAL_S``, 10 s) and ``hotspot_threshold`` (2): every ``hotspot_interval`` seconds the ps' traffic
      is compared; a ps serving more than ``hotspot_threshold`` times the others' mean is reported
      (:mod:`~kubeps.runtime.coordinator.hotspots`; ``hotspots.latest`` is the last verdict).
    * ``max_closures_per_call`` (8): while more functions are queued than there are workers, a worker's call carries
      up to this many of them, its fair share of the queue (``RunClosures``; the worker runs them one after the
      other), so the chief's cost per function falls with the backlog; a queue no longer than the worker count is
      sent one function per call. A function's value is there when its call ends; the call's deadline is
      ``closure_timeout`` times the functions it carries. 1 sends every function alone.
    * ``gil_switch_interval`` (0.05 s): while the coordinator runs, the interpreter's GIL switch interval is at least
      this (``sys.setswitchinterval``; never lowered, put back by :meth:`shutdown`). At CPython's 5 ms, hundreds of
      dispatch threads take the GIL from each other by force; at 50 ms a function cost the chief about half the CPU
      at 256 workers (:mod:`kubeps.runtime.util.gil`). None leaves the interpreter's setting alone.

    With a membership file in the strategy's settings (``KUBEPS_MEMBERSHIP_FILE``: the operator's ConfigMap, or
    ``kubeps local``'s file), the workers follow that document while the coordinator runs
    (:meth:`apply_membership`, docs/elastic.md); without one they are TF_CONFIG's for its whole life.

    With a metrics port in the strategy's settings (``KUBEPS_METRICS_PORT``), the chief serves its Prometheus
    metrics there (:mod:`kubeps.runtime.observe.metrics`): the closure queue's counters, each worker's closure
    time, the RPCs to the ps, the hot-spot verdicts.
    """

    def __init__(self, strategy: Any, *, closure_timeout: float = 3600.0, heartbeat_interval: float = 1.0,
                 heartbeat_failures: int = 3, ping_timeout: float = 1.0, max_transient_ps_errors: int = 3,
                 ps_error_interval: float = 1.0, ps_error_window: float = 60.0,
                 worker_wait_timeout: float = 3600.0, watchdog_timeout: float | None = None,
                 watchdog: Watchdog | None = None, hotspot_interval: float | None = None,
                 hotspot_threshold: float = DEFAULT_HOTSPOT_THRESHOLD,
                 max_closures_per_call: int = DEFAULT_CLOSURES_PER_CALL,
                 gil_switch_interval: float | None = DEFAULT_GIL_SWITCH_INTERVAL):
        if not isinstance(strategy, ParameterServerStrategy):
            raise RuntimeConfigError("strategy", type(strategy).__name__,
                                     "ClusterCoordinator needs a ParameterServerStrategy")
        for name, value in (("closure_timeout", closure_timeout), ("heartbeat_interval", heartbeat_interval),
                            ("ping_timeout", ping_timeout), ("ps_error_window", ps_error_window),
                            ("worker_wait_timeout", worker_wait_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise RuntimeConfigError(name, value, "must be a number of seconds > 0")
        if isinstance(ps_error_interval, bool) or not isinstance(ps_error_interval, (int, float)) \
                or not ps_error_interval >= 0:
            raise RuntimeConfigError("ps_error_interval", ps_error_interval, "must be a number of seconds >= 0")
        for name, value, low in (("heartbeat_failures", heartbeat_failures, 1),
                                 ("max_transient_ps_errors", max_transient_ps_errors, 0),
                                 ("max_closures_per_call", max_closures_per_call, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise RuntimeConfigError(name, value, f"must be an integer >= {low}")
        if gil_switch_interval is not None and (isinstance(gil_switch_interval, bool)
                                                or not isinstance(gil_switch_interval, (int, float))
                                                or not 0 < gil_switch_interval <= 1):
            raise RuntimeConfigError("gil_switch_interval", gil_switch_interval,
                                     "must be None (the interpreter's own) or a number of seconds in (0, 1]")
        if watchdog is not None and watchdog_timeout is not None:
            raise RuntimeConfigError("watchdog", watchdog, "pass either watchdog_timeout or a Watchdog, not both")
        if watchdog is not None and not isinstance(watchdog, Watchdog):
            raise RuntimeConfigError("watchdog", type(watchdog).__name__, "must be a kubeps.runtime.coordinator.watchdog.Watchdog")
        self.strategy = strategy
        self.closure_timeout = closure_timeout
        self.heartbeat_interval = float(heartbeat_interval)
        self.heartbeat_failures = heartbeat_failures
        self.ping_timeout = float(ping_timeout)
        self.max_transient_ps_errors = max_transient_ps_errors
        self.ps_error_interval = float(ps_error_interval)
        self.ps_error_window = float(ps_error_window)
        self.worker_wait_timeout = worker_wait_timeout
        self.max_closures_per_call = max_closures_per_call
        self._queue = ClosureQueue()
        # the watchdog: created here from a timeout, or the caller's (given a progress probe if it has none)
        self.watchdog: Watchdog | None = watchdog
        if watchdog_timeout is not None:
            self.watchdog = Watchdog(watchdog_timeout, progress=self._watchdog_progress)
        elif watchdog is not None and watchdog.progress is None:
            watchdog.progress = self._watchdog_progress
        self._finished = 0  # closures that finished (ok or raised): the watchdog's measure of progress
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._resources: list[tuple[str, np.ndarray]] = []  # (resource_id, pickled creator), creation order
        self._dataset_fns: dict[str, Callable] = {}  # resource_id -> dataset_fn of each per-worker dataset
        self._resource_ids = itertools.count()
        #: the workers dispatched to (the membership), in index order
        self._workers = [self._new_worker(i, address) for i, address in enumerate(strategy.worker_addresses)]
        #: every worker with a dispatch thread: the membership's and the leaving ones still finishing a closure
        #: (the failure detector watches them all)
        self._handles: list[_WorkerHandle] = list(self._workers)
        #: indexes of the workers that left and finished their last closure, in the order they did
        self._drained: list[int] = []
        #: the generation of the last membership document applied (None: TF_CONFIG's workers)
        self.membership_generation: int | None = None
        #: times the per-worker datasets were sharded again for a new membership
        self._reshards = 0
        #: records read in a pass that a reshard, a worker's departure or a worker's restart cut short: the new
        #: shards read them again from their start (kubeps.runtime.data.passes)
        self._records_reread = 0
        #: the last checkpoint request served (Membership.checkpoint)
        self._checkpoint_served = 0
        self._membership_lock = threading.Lock()
        #: heartbeats of every ps and busy worker, and the accounting of ps errors (coordinator/failure.py)
        self.failures = FailureDetector(
            strategy, self._queue, self._handles, self._stopping,
            heartbeat_interval=self.heartbeat_interval, heartbeat_failures=heartbeat_failures,
            ping_timeout=self.ping_timeout, max_transient_ps_errors=max_transient_ps_errors,
            ps_error_interval=self.ps_error_interval, ps_error_window=self.ps_error_window)
        #: lets go of the raised GIL switch interval (shutdown); None: the interpreter's left alone
        self._switch_interval = (hold_switch_interval(gil_switch_interval) if gil_switch_interval is not None
                                 else None)
        for worker in self._workers:
            self._start_dispatch(worker)
        self.failures.start()
        #: the hot-ps detector (coordinator/hotspots.py)
        self.hotspots = HotSpotDetector(
            strategy.num_ps, self._ps_variables, threshold=hotspot_threshold,
            interval=strategy.settings.hotspot_interval_s if hotspot_interval is None else hotspot_interval)
        self.hotspots.start()
        if strategy.settings.log_format == "json":  # asked for: the chief's lines as JSON too
            _logs.configure(strategy.settings)
        self._collector = None
        if _metrics.serve(strategy.settings) is not None:
            self._collector = _metrics.add_collector(self._metric_families)
        self._stop_watchdog = False
        if self.watchdog is not None and not self.watchdog.running:
            self.watchdog.start()
            self._stop_watchdog = True  # started here, so stopped by shutdown()
        #: the membership watcher (coordinator/membership.py), when the settings name a membership file
        self.membership_watcher: MembershipWatcher | None = None
        if strategy.settings.membership_file:
            self.watch_membership(strategy.settings.membership_file, strategy.settings.membership_ack_file)

    # -- public API (TF's) -----------------------------------------------------------------------------------
    def schedule(self, fn: Callable, args: Any = None, kwargs: Any = None) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` for some worker; non-blocking. Raises the first pending error, if any."""
        if not callable(fn):
            raise RuntimeConfigError("fn", fn, "schedule() needs a callable")
        if args is not None and not isinstance(args, (tuple, list)):
            raise RuntimeConfigError("args", type(args).__name__, "must be a tuple or list of positional arguments")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise RuntimeConfigError("kwargs", type(kwargs).__name__, "must be a dict of keyword arguments")
        self._check_open()
        _ship_by_value(fn)
        payload = _dumps((fn, tuple(args or ()), dict(kwargs or {})), f"function {getattr(fn, '__name__', fn)!r}")
        closure = Closure(payload)
        self._queue.put(closure)
        return closure.remote_value

    def join(self) -> None:
        """Block until every scheduled function finished; raises the first error (and cancels the rest)."""
        self._queue.wait()

    def done(self) -> bool:
        """Whether every scheduled function finished; raises the first error like ``join``."""
        return self._queue.done()

    def fetch(self, val: Any) -> Any:
        """Fetch every RemoteValue in a nested structure (others pass through)."""

        def leaf(item: Any) -> Any:
            if isinstance(item, RemoteValue):
                return item.fetch()
            if isinstance(item, PerWorkerValues):
                return tuple(self.fetch(v) for v in item)
            return item

        return nest.map_structure(leaf, val)

    def create_per_worker_dataset(self, dataset_fn: Any) -> PerWorkerDataset:
        """Build ``dataset_fn()`` (or ``dataset_fn(input_context)``) on every worker; or build a
        ``DistributedDataset`` from ``strategy.experimental_distribute_dataset`` /
        ``strategy.distribute_datasets_from_function`` there."""
        if isinstance(dataset_fn, PerWorkerDataset):
            return dataset_fn
        if isinstance(dataset_fn, DistributedDataset):
            _ship_by_value(dataset_fn.per_worker_fn)
            dataset_fn = dataset_fn.build  # a function of the worker's InputContext
        if not callable(dataset_fn):
            raise RuntimeConfigError("dataset_fn", type(dataset_fn).__name__,
                                     "must be a function that returns a dataset (an iterable) on the worker")
        _ship_by_value(dataset_fn)
        dataset = self.create_per_worker_resource(
            functools.partial(_build_dataset, dataset_fn, self.num_workers), "dataset", PerWorkerDataset
        )
        with self._lock:
            # a worker that joins later builds it for the membership of then (docs/elastic.md, "Data")
            self._dataset_fns[dataset.resource_id] = dataset_fn
        return dataset

    @property
    def num_workers(self) -> int:
        """The workers dispatched to now (they change when the membership does)."""
        with self._lock:
            return len(self._workers)

    # -- membership ----------------------------------------------------------------------------------------------
    def apply_membership(self, membership: Membership | Sequence[str]) -> MembershipAck:
        """Dispatch to the workers ``membership`` names from now on (``workers[i]`` is worker ``i``): a new index
        joins (a dispatch thread that waits for it, builds the per-worker resources on it, then takes closures);
        an index beyond the new count, or whose address changed, leaves (it finishes the closure it runs and takes
        nothing more; a failure on the way re-queues the closure). Scaling down therefore drops the highest
        indexes. Returns the state after the change (:meth:`membership_status`)."""
        with self._membership_lock:  # one change at a time (the watcher's thread, the program's)
            return self._apply_membership(membership)

    def _apply_membership(self, membership: Membership | Sequence[str]) -> MembershipAck:
        if not isinstance(membership, Membership):
            membership = Membership(generation=(self.membership_generation or 0) + 1, workers=list(membership),
                                    checkpoint=self._checkpoint_served)
        self._check_open()
        first = self.membership_generation is None
        joined: list[_WorkerHandle] = []
        left: list[_WorkerHandle] = []
        with self._lock:
            current = {w.index: w for w in self._workers}
            keep = []
            for index, address in enumerate(membership.workers):
                worker = current.pop(index, None)
                if worker is not None and worker.address == address:
                    keep.append(worker)
                    continue
                if worker is not None:
                    left.append(worker)
                new = self._new_worker(index, address)
                new.joined = new.needs_resources = True
                keep.append(new)
                joined.append(new)
            left.extend(current.values())
            for worker in left:
                worker.retiring = True
            self._workers = keep
            self._handles.extend(joined)
            self.membership_generation = membership.generation
        for worker in left:
            self._queue.retire_worker(worker.index)
            log.info("worker %d (%s) leaves (membership generation %d): it finishes what it runs and takes "
                     "nothing more", worker.index, worker.address, membership.generation)
        if joined or left:
            self._reshard([w for w in self._workers if w not in joined])
        for worker in joined:
            self._queue.admit_worker(worker.index)
            self._start_dispatch(worker)
            log.info("worker %d (%s) joins (membership generation %d)", worker.index, worker.address,
                     membership.generation)
        if joined or left:
            # a warning so that a chief without a logging configuration shows it too (as the strategy's start-up
            # lines): the one line that says what the job's workers are now
            with self._lock:
                datasets = len(self._dataset_fns)
            log.warning("membership generation %d: %d worker(s); joining %s, leaving %s (each finishes what it runs)"
                        "%s", membership.generation, len(membership.workers), sorted(w.index for w in joined),
                        sorted(w.index for w in left),
                        f"; {datasets} per-worker dataset(s) sharded again for {len(membership.workers)} workers "
                        "(at-least-once: what the current pass read before may be read again)" if datasets else "")
        self._serve_checkpoint(membership.checkpoint, first)
        return self.membership_status()

    def _serve_checkpoint(self, request: int, first: bool) -> None:
        """A checkpoint request above the last one served: save with the newest ``CheckpointManager`` of the
        program (while functions run: the variables hold every update applied until the save; the step saved is the
        program's ``StepCounter``), then report it served. In the first document a chief applies, the request was
        its predecessor's: taken as served, nothing saved. A program without a manager, or a save that fails, is
        logged and reported served too: the operator then restarts with the latest checkpoint there is."""
        if request <= self._checkpoint_served:
            return
        if not first:
            manager = newest_manager()
            if manager is None:
                log.warning("checkpoint request %d: the program made no CheckpointManager, nothing saved", request)
            else:
                started = time.perf_counter()
                try:
                    path = manager.save()
                except Exception:  # noqa: BLE001 - reported served: the restart restores the latest checkpoint
                    log.exception("checkpoint request %d: the save failed", request)
                else:
                    log.warning("checkpoint request %d: saved %s in %.2f s", request, path,
                                time.perf_counter() - started)
        with self._lock:
            self._checkpoint_served = request

    def watch_membership(self, path: str, ack_path: str | None = None) -> MembershipWatcher:
        """Apply the membership document at ``path`` whenever it changes (the settings' ``KUBEPS_MEMBERSHIP_FILE``
        does this at construction); acknowledge at ``ack_path``."""
        if self.membership_watcher is not None:
            self.membership_watcher.stop()
        self.membership_watcher = MembershipWatcher(self, path, ack_path=ack_path)
        self.membership_watcher.poll()  # what the file says now, before the first function is scheduled
        return self.membership_watcher.start()

    def membership_status(self) -> MembershipAck:
        """The generation applied, the workers dispatched to, those still draining and those drained."""
        with self._lock:
            return MembershipAck(
                generation=self.membership_generation or 0, workers=[w.index for w in self._workers],
                draining=sorted(w.index for w in self._handles if w.retiring), drained=list(self._drained),
                checkpoint=self._checkpoint_served)

    def _resources_for(self, worker: _WorkerHandle) -> list[tuple[str, np.ndarray]]:
        """Every per-worker resource as ``worker`` builds it now, in creation order: each dataset sharded for the
        membership of now (``InputContext(num_workers, worker.index)``), which may not be that of its creation."""
        with self._lock:
            resources = list(self._resources)
            datasets = dict(self._dataset_fns)
            count = max(len(self._workers), worker.index + 1)
        return [(rid, _dumps(functools.partial(_build_dataset, datasets[rid], count), "the dataset function")
                 if rid in datasets else payload) for rid, payload in resources]

    def _reshard(self, workers: list[_WorkerHandle]) -> None:
        """The membership changed: every per-worker resource is built again on ``workers`` (the ones that stay),
        before their next closure, so that the datasets are sharded for the new membership: the workers of now
        split every record between them (none is left to a worker that left; those read in the current pass
        before the change may be read again: at-least-once)."""
        with self._lock:
            has_datasets = bool(self._dataset_fns)
        if not has_datasets:
            return
        for worker in workers:
            for resource_id, payload in self._resources_for(worker):
                closure = Closure(payload, kind="resource", info={"resource_id": resource_id})
                self._queue.put_per_worker(worker.index, closure, raise_error=False)
        with self._lock:
            self._reshards += 1

    def _new_worker(self, index: int, address: str) -> _WorkerHandle:
        strategy = self.strategy
        return _WorkerHandle(index, address, Client(address, WORKER_SERVICE, strategy.job_token,
                                                    timeout=self.closure_timeout, tls=strategy.tls, blocking=True))

    def _start_dispatch(self, worker: _WorkerHandle) -> None:
        worker.thread = threading.Thread(target=self._dispatch_loop, args=(worker,), daemon=True,
                                         name=f"kubeps-worker-{worker.index}")
        worker.thread.start()

    def _worker_left(self, worker: _WorkerHandle) -> None:
        """A leaving worker's dispatch thread ended: nothing of the job runs on it any more."""
        with self._lock:
            resharded = bool(self._dataset_fns)
        if worker.in_pass and resharded:  # the workers that stay read its share again, from their shards' start
            self._add_reread(worker, worker.in_pass, "left")
        with self._lock:
            if worker in self._handles:
                self._handles.remove(worker)
            self._drained.append(worker.index)
        worker.client.close()
        log.info("worker %d (%s) drained: it may be stopped", worker.index, worker.address)

    @property
    def ps_incarnations(self) -> dict[int, str | None]:
        """The incarnation of every parameter server that its variables were created in (None: not seen yet)."""
        transport = self.strategy.transport
        return {ps: transport.incarnation(ps) for ps in range(transport.num_ps)}

    def shutdown(self) -> None:
        """Stop the dispatch threads (queued functions are cancelled) and close connections."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self.membership_watcher is not None:
            self.membership_watcher.stop()
        self._queue.stop()
        with self._lock:
            handles = list(self._handles)
        for worker in handles:
            call = worker.call
            if call is not None:
                call.cancel()
        for worker in handles:
            if worker.thread is not None:
                worker.thread.join(timeout=5)
            worker.client.close()
        self.failures.stop()
        self.hotspots.stop()
        if self._collector is not None:
            _metrics.remove_collector(self._collector)
            self._collector = None
        if self._stop_watchdog and self.watchdog is not None:
            self.watchdog.stop()
        if self._switch_interval is not None:
            self._switch_interval()

    close = shutdown

    def __reduce__(self):
        raise TypeError("a ClusterCoordinator cannot be sent to a worker: a scheduled function must not capture it")

    def __enter__(self) -> "ClusterCoordinator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # -- per-worker resources ----------------------------------------------------------------------------------
    def create_per_worker_resource(self, creator: Callable[[], Any], kind: str, cls: type) -> Any:
        """Run ``creator`` on every worker (rebuilt on a worker that restarts); ``cls`` stands for the results
        (kubeps's hook behind ``create_per_worker_dataset`` and per-worker iterators)."""
        self._check_open()
        resource_id = f"{kind}-{next(self._resource_ids)}"
        payload = _dumps(creator, f"the {kind} function")
        with self._lock:
            self._resources.append((resource_id, payload))
            workers = list(self._workers)
        values = []
        for worker in workers:
            closure = Closure(payload, kind="resource", info={"resource_id": resource_id})
            self._queue.put_per_worker(worker.index, closure)
            values.append(closure.remote_value)
        return cls(self, resource_id, PerWorkerValues(tuple(values)))

    def rebuild_worker_resources(self, worker: _WorkerHandle) -> bool:
        """Re-create every per-worker resource on a worker that came back (in creation order)."""
        replaced, read_before = False, worker.in_pass
        for resource_id, payload in self._resources_for(worker):
            try:
                meta, arrays = worker.client.call(WORKER.CREATE_RESOURCE, CreateResourceRequest(resource_id=resource_id), [payload],
                                                  timeout=self.closure_timeout)
            except RemoteError as err:
                log.warning("rebuilding %s on worker %d failed: %s", resource_id, worker.index, err)
                return False
            if meta.get("status") != "ok":
                error = self._closure_error(meta, arrays, worker)
                log.error("rebuilding %s on worker %d raised %r", resource_id, worker.index, error)
                if meta.get("status") == "error":
                    self._queue.set_error(error)
                return False
            replaced = replaced or "reread" in meta
            self._count_records(worker, meta)
        if not replaced and read_before:
            # the worker restarted (it had none of its iterators): its last answer said how far it had read
            self._add_reread(worker, read_before, "restarted")
        return True

    def _count_records(self, worker: _WorkerHandle, meta: Mapping[str, Any]) -> None:
        """A worker's answer: where its iterators stand, and what an iterator built again had read in its pass."""
        worker.in_pass = int(meta.get("in_pass", worker.in_pass))
        if meta.get("reread"):
            self._add_reread(worker, int(meta["reread"]), "had its dataset sharded again")

    def _add_reread(self, worker: _WorkerHandle, records: int, why: str) -> None:
        with self._lock:
            self._records_reread += records
            total = self._records_reread
        log.warning("worker %d %s after reading %d record(s) of its pass under way: the new shards read them "
                    "again (at-least-once; %d record(s) read again in this job so far)", worker.index, why,
                    records, total)

    # -- dispatch ----------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._stopping.is_set():
            raise RuntimeError("this ClusterCoordinator was shut down")

    def _dispatch_loop(self, worker: _WorkerHandle) -> None:
        """The worker's dispatch thread. It ends only when the coordinator stops: an unexpected error in an
        iteration is logged and fails the closure the thread held (:meth:`_dispatch_failed`), so no closure is
        ever left in flight by a dead thread (``join`` would wait forever)."""
        while not self._stopping.is_set() and not worker.retiring:
            closure, attempt = None, 0
            try:
                if not worker.healthy:
                    if not self.wait_for_worker(worker):
                        continue
                    if (worker.failures or worker.needs_resources) and not self.rebuild_worker_resources(worker):
                        worker.healthy = False
                        self._stopping.wait(1.0)  # do not hammer a worker whose rebuild keeps failing
                        continue
                    if worker.needs_resources:
                        worker.needs_resources = False
                        log.info("worker %d (%s) joined: per-worker resources built, taking closures", worker.index,
                                 worker.address)
                closure = self._queue.get(worker.index, timeout=0.5)
                if closure is None:
                    continue
                attempt = closure.attempts
                more = (self._queue.take_more(worker.index, self.max_closures_per_call - 1)
                        if closure.kind == "closure" and closure.worker is None else [])
                if more:
                    taken = [(extra, extra.attempts) for extra in more]
                    try:
                        self._run_closures(worker, [closure, *more])
                    except BaseException as err:
                        # the last resort below knows only the first closure: fail the others still held here
                        for extra, extra_attempt in taken:
                            if self._queue.fail_if_running(extra, extra_attempt, err):
                                self._closure_done()
                        raise
                else:
                    self._run_closure(worker, closure)
            except BaseException as err:  # noqa: BLE001 - the thread must outlive any error (see _dispatch_failed)
                self._dispatch_failed(worker, closure, attempt, err)
        if worker.retiring and not self._stopping.is_set():
            self._worker_left(worker)

    def _dispatch_failed(self, worker: _WorkerHandle, closure: Closure | None, attempt: int,
                         error: BaseException) -> None:
        """An iteration of ``worker``'s dispatch thread raised ``error`` (a bug, a malformed answer...): log it
        and fail the closure the thread still held with it -- not re-run, as the same error would likely come
        back forever; while stopping it is cancelled. A closure the iteration had already handed on (finished,
        failed, re-queued) is left alone. Then the thread goes on, after a pause when no closure was involved
        (e.g. reconnecting raised) so that a persistent error does not spin."""
        worker.call = None
        held = closure is not None and closure.state is ClosureState.RUNNING and closure.attempts == attempt
        log.error("dispatch thread of worker %d (%s) caught an unexpected error%s", worker.index, worker.address,
                  f" running {closure!r}" if held else "", exc_info=error)
        try:
            if closure is not None:
                if self._stopping.is_set():
                    if held:
                        self._queue.requeue(closure)  # cancels it: the queue is stopped
                elif self._queue.fail_if_running(closure, attempt, error):
                    self._closure_done()
            if not held:
                worker.healthy = False  # reconnect (and rebuild) before taking more work
                self._stopping.wait(1.0)
        except BaseException:  # noqa: BLE001 - last resort: never let the handler itself end the thread
            log.exception("dispatch thread of worker %d could not recover from %r", worker.index, error)

    def _call(self, worker: _WorkerHandle, closures: list[Closure], method: str, request: Any,
              timeout: float) -> tuple[dict[str, Any], list[np.ndarray]] | None:
        """Send ``closures`` to ``worker`` in one ``method`` call and return its answer; None when the call did not
        happen or failed, its closures then handled: re-queued (cancelled while stopping), failed (a non-retryable
        code: the first, the others cancelled by that error), or re-run after the worker's failure (at-least-once:
        any of them may have run)."""
        if self._stopping.is_set():
            for closure in closures:
                self._queue.requeue(closure)  # cancels it: taken just as the coordinator stopped
            return None
        try:
            try:
                worker.call = worker.client.start(method, request, [c.payload for c in closures], timeout=timeout)
                return worker.client.finish(worker.call)
            except _GRPC_CALL_ERRORS as raw:  # the transport should have made it a RemoteError
                log.warning("worker %d: %s escaped the transport; handled as %s", worker.index,
                            type(raw).__name__, "a failed call")
                raise _as_remote_error(raw, worker.address) from raw
        except RemoteError as err:
            worker.call = None
            first, rest = closures[0], closures[1:]
            if self._stopping.is_set():
                for closure in closures:
                    self._queue.requeue(closure)  # cancels it: the queue is stopped
            elif err.code in _NON_RETRYABLE_CODES:
                self._queue.mark_failed(first, err)
                self._queue.give_back(rest)  # cancelled: the error is pending
            else:
                for closure in rest:
                    self._queue.requeue(closure)
                self.handle_worker_failure(worker, first, err)
            return None
        finally:
            worker.call = None

    def _run_closure(self, worker: _WorkerHandle, closure: Closure) -> None:
        method = WORKER.RUN_CLOSURE if closure.kind == "closure" else WORKER.CREATE_RESOURCE
        meta_in: RunClosureRequest | CreateResourceRequest = (
            RunClosureRequest(closure_id=closure.id) if closure.kind == "closure"
            else CreateResourceRequest(closure_id=closure.id, resource_id=closure.info["resource_id"]))
        started = time.perf_counter()
        answer = self._call(worker, [closure], method, meta_in, self.closure_timeout)
        if answer is None:
            return
        meta, arrays = answer
        self._settle(worker, closure, meta, arrays, time.perf_counter() - started)
        if meta.get("status") == "ok":
            self._count_records(worker, meta)

    def _run_closures(self, worker: _WorkerHandle, closures: list[Closure]) -> None:
        """Several closures for any worker in one ``RunClosures`` call (``max_closures_per_call``): the worker runs
        them one after the other and stops after the first that does not finish; those after it go back to the
        front of the queue, untouched. A failed call is a failure of each closure, as for one."""
        request: RunClosuresRequest = {"closure_ids": [closure.id for closure in closures]}
        started = time.perf_counter()
        answer = self._call(worker, closures, WORKER.RUN_CLOSURES, request, self.closure_timeout * len(closures))
        if answer is None:
            return
        meta, arrays = answer
        answers, counts = meta.get("answers"), meta.get("counts")
        if not (meta.get("status") == "ok" and isinstance(answers, list) and isinstance(counts, list)
                and len(answers) == len(counts) and 0 < len(answers) <= len(closures)
                and all(isinstance(c, int) and c >= 0 for c in counts) and sum(counts) == len(arrays)):
            error = ValueError(f"malformed {WORKER.RUN_CLOSURES} answer from worker {worker.index}: "
                               f"{len(closures)} function(s) sent, {len(arrays)} tensor(s) and {meta!r:.200} back")
            self._queue.mark_failed(closures[0], error)
            self._queue.give_back(closures[1:])  # cancelled: the error is pending
            self._closure_done()
            return
        self._queue.give_back(closures[len(answers):])
        seconds = (time.perf_counter() - started) / len(answers)
        offset = 0
        for closure, answer, count in zip(closures, answers, counts):
            self._settle(worker, closure, answer, arrays[offset:offset + count], seconds)
            offset += count
        self._count_records(worker, meta)

    def _settle(self, worker: _WorkerHandle, closure: Closure, meta: dict[str, Any], arrays: list[np.ndarray],
                seconds: float) -> None:
        """One closure's answer from its worker: finished, failed, or handed to the failure handling."""
        status = meta.get("status")
        if status == "ok":
            try:
                result = self._closure_result(arrays)
            except Exception as err:  # noqa: BLE001 - a result we cannot rebuild fails the closure
                self._queue.mark_failed(closure, err)
                return
            self._queue.mark_finished(closure, result)
            self._closure_done()
            if _metrics.ENABLED and closure.kind == "closure":
                _metrics.CLOSURE_SECONDS.labels(str(worker.index)).observe(seconds)
        elif status == "resource_missing":
            self.handle_worker_failure(worker, closure, ResourceMissingError(meta.get("message", "")))
        elif status == "ps_unavailable":
            self.failures.handle_ps_error(closure, int(meta.get("ps_index", -1)), meta.get("message", ""),
                                 restarted=bool(meta.get("restarted")))
        else:
            self._queue.mark_failed(closure, self._closure_error(meta, arrays, worker))
            self._closure_done()

    # -- metrics -----------------------------------------------------------------------------------------------
    def _ps_variables(self, ps: int) -> list[Any]:
        """``ListVariables`` of one ps: what the hot-spot detector compares."""
        meta, _ = self.strategy.transport.call(ps, PS.LIST_VARIABLES, timeout=self.ping_timeout * 5)
        return list(meta.get("variables", []))

    def _metric_families(self) -> Any:
        """The closure queue's counters and sizes, read at each scrape."""
        counts = self._queue.counters()
        for name, text in (("scheduled", "Functions scheduled"), ("finished", "Scheduled functions that finished"),
                           ("failed", "Scheduled functions that failed (non-retryable)"),
                           ("retried", "Scheduled functions re-queued after their worker was lost"),
                           ("cancelled", "Scheduled functions cancelled"),
                           ("batched", "Scheduled functions sent to a worker in the call of the function before them")):
            family = CounterMetricFamily(f"kubeps_closures_{name}", text)
            family.add_metric([], counts[name])
            yield family
        stats = self._queue.stats()
        queued = GaugeMetricFamily("kubeps_closures_queued", "Scheduled functions waiting for a worker")
        queued.add_metric([], stats["queued"] + stats["per_worker"])
        yield queued
        inflight = GaugeMetricFamily("kubeps_closures_in_flight", "Scheduled functions running on a worker")
        inflight.add_metric([], stats["inflight"])
        yield inflight
        status = self.membership_status()
        for name, text, value in (
                ("kubeps_workers", "Workers the chief dispatches to", len(status.workers)),
                ("kubeps_workers_draining", "Workers that left and still finish their last function",
                 len(status.draining)),
                ("kubeps_membership_generation", "Generation of the membership document applied", status.generation),
                ("kubeps_checkpoint_request", "The last checkpoint request of the membership document served",
                 status.checkpoint)):
            gauge = GaugeMetricFamily(name, text)
            gauge.add_metric([], value)
            yield gauge
        reshards = CounterMetricFamily("kubeps_dataset_reshards",
                                       "Times the per-worker datasets were sharded again for a new membership")
        reshards.add_metric([], self._reshards)
        yield reshards
        reread = CounterMetricFamily(
            "kubeps_dataset_records_reread",
            "Records read in a pass that a reshard, a worker leaving or a worker restarting cut short, which the new "
            "shards read again (at-least-once)")
        reread.add_metric([], self._records_reread)
        yield reread

    # -- watchdog ----------------------------------------------------------------------------------------------
    def _closure_done(self) -> None:
        with self._lock:
            self._finished += 1
        if self.watchdog is not None:
            self.watchdog.notify()

    def _watchdog_progress(self) -> Any:
        """What the watchdog polls: the finished-closure count while work is pending; with nothing scheduled a
        fresh object every time (always "progress"), so an idle coordinator never triggers a dump."""
        stats = self._queue.stats()
        if not (stats["queued"] or stats["inflight"] or stats["per_worker"]):
            return object()
        return self._finished

    @staticmethod
    def _closure_result(arrays: list[np.ndarray]) -> Any:
        if not arrays:
            raise ValueError("malformed RunClosure answer: no result skeleton")
        skeleton = pickle.loads(arrays[0].tobytes())
        return join_structure(skeleton, arrays[1:])

    @staticmethod
    def _closure_error(meta: Mapping[str, Any], arrays: list[np.ndarray], worker: _WorkerHandle) -> BaseException:
        """The exception a function raised on ``worker``, rebuilt, with a note naming the worker and holding its
        traceback (``ClosureError`` when it cannot be rebuilt). A ``StopIteration`` -- a per-worker iterator that ran
        out -- becomes ``OutOfRangeError``, as in TensorFlow."""
        blob = arrays[0].tobytes() if arrays else b""
        remote_tb = meta.get("traceback", "")
        where = f"worker {worker.index} (/job:worker/task:{worker.index} at {worker.address})"
        error: Any = None
        if blob:
            try:
                error = pickle.loads(blob)
            except Exception:  # noqa: BLE001 - fall back to the text
                error = None
        if isinstance(error, StopIteration) or (error is None and meta.get("type") == "StopIteration"):
            error = OutOfRangeError(
                f"End of sequence on {where}: a scheduled function called next() on an iterator that ran out (a "
                f"per-worker dataset without .repeat()); make the dataset repeat, or schedule no more steps than "
                f"it has batches")
        if not isinstance(error, BaseException):
            error = ClosureError(meta.get("type", "Error"), f"{meta.get('message', '')} (raised on {where})", remote_tb)
        if hasattr(error, "add_note"):
            error.add_note(f"raised on {where}" + (f":\n{remote_tb.rstrip()}" if remote_tb else ""))
        elif error.args and isinstance(error.args[0], str) and where not in error.args[0]:
            # Python 3.10 has no exception notes: the message itself names the worker
            error.args = (f"{error.args[0]} (raised on {where})", *error.args[1:])
        return error

    # -- worker failures ---------------------------------------------------------------------------------------
    def handle_worker_failure(self, worker: _WorkerHandle, closure: Closure | None, error: BaseException) -> None:
        """A worker failed while running ``closure``: re-queue it (at-least-once) and mark the worker down."""
        log.warning("worker %d (%s) failed: %s", worker.index, worker.address, error)
        worker.healthy = False
        worker.failures += 1
        if closure is not None:
            if closure.kind == "resource":
                self._queue.mark_finished(closure, None)  # rebuilt with all the others when the worker returns
            else:
                self._queue.requeue(closure)
        self._queue.drop_per_worker(worker.index)

    def wait_for_worker(self, worker: _WorkerHandle) -> bool:
        """Ping the worker with backoff until it answers (True), or the coordinator stops or the worker leaves the
        membership (False)."""
        delay = 0.05
        deadline = time.monotonic() + self.worker_wait_timeout
        reported = False
        while not self._stopping.is_set() and not worker.retiring:
            try:
                meta, _ = worker.client.call(PING, timeout=max(2.0, self.ping_timeout))
            except RemoteError as err:
                if err.code in _NON_RETRYABLE_CODES and not reported:
                    self._queue.set_error(err)  # e.g. wrong job token: no point in waiting quietly
                    reported = True
                # a worker that joined and never answered is not the job's loss: it may wait for a node or a quota,
                # and the others go on meanwhile
                never_seen = worker.joined and worker.incarnation is None
                if time.monotonic() > deadline and not reported and not never_seen:
                    self._queue.set_error(WorkerUnavailableError(
                        f"worker {worker.index} at {worker.address} did not come back within "
                        f"{self.worker_wait_timeout:.0f} s: {err}", code=err.code, address=worker.address))
                    reported = True
                self._stopping.wait(delay)
                delay = min(delay * 2, 2.0)
                continue
            previous = worker.incarnation
            worker.incarnation = meta.get("incarnation")
            worker.heartbeat.last_ok = time.monotonic()
            worker.healthy = True
            if previous is not None and previous != worker.incarnation:
                log.info("worker %d came back as a new process", worker.index)
            return True
        return False

    # -- parameter-server failures (the failure detector decides) --------------------------------------------------
    def handle_ps_error(self, closure: Closure, ps_index: int, message: str, restarted: bool = False) -> None:
        """A closure could not reach a ps: see :meth:`FailureDetector.handle_ps_error`."""
        self.failures.handle_ps_error(closure, ps_index, message, restarted)

    def mark_ps_failed(self, ps_index: int, error: PSUnavailableError) -> None:
        """The ps is gone: see :meth:`FailureDetector.mark_ps_failed`."""
        self.failures.mark_ps_failed(ps_index, error)
