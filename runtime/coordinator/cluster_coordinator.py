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

The parts, as TensorFlow's coordinator package has them: the :class:`~kubeps.runtime.coordinator.workers.WorkerSet`
(TF's ``Cluster``: the workers, each :class:`~kubeps.runtime.coordinator.workers.Worker` with its dispatch thread, and
the failure handling), the :class:`~kubeps.runtime.coordinator.closure_queue.ClosureQueue`, the
:class:`~kubeps.runtime.coordinator.membership_controller.MembershipController` and the options
(:class:`~kubeps.runtime.coordinator.options.CoordinatorOptions`). This class is the facade that wires them.

Failure handling (each step a method named for it, kept here for the fault-tolerance layer; the worker's own
methods do the work):
``handle_worker_failure`` (re-queue the closure: at-least-once), ``wait_for_worker`` (reconnect with backoff),
``rebuild_worker_resources`` (datasets and iterators re-created from scratch), ``handle_ps_error`` (retry while a
PS blip lasts: errors closer than ``ps_error_interval`` count once, the job fails after more than
``max_transient_ps_errors`` counted errors), ``mark_ps_failed`` (:class:`~kubeps.runtime.errors.PSUnavailableError` through
``schedule``/``join``/``done``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from kubeps.runtime.cluster import Membership, MembershipAck
from kubeps.runtime.contract import MEMBERSHIP_ACK_PATH
from kubeps.runtime.coordinator.closure_queue import Closure, ClosureQueue, RemoteValue
from kubeps.runtime.coordinator.membership import MembershipWatcher
from kubeps.runtime.coordinator.membership_controller import MembershipController, RecordsReread
from kubeps.runtime.coordinator.hotspots import HotSpotDetector
from kubeps.runtime.coordinator.options import DEFAULT_CLOSURES_PER_CALL, DEFAULT_GIL_SWITCH_INTERVAL, \
    CoordinatorOptions
from kubeps.runtime.checks import Flag, PositiveInt, check
from kubeps.runtime.coordinator.leases import DEFAULT_SHARD_RECORDS, ShardBook
from kubeps.runtime.coordinator.shipping import build_dataset, build_leased, call_dataset_fn, dumps, ship_by_value
from kubeps.runtime.coordinator.strategy import ParameterServerStrategy
from kubeps.runtime.coordinator.values import PerWorkerDataset, PerWorkerIterator, PerWorkerValues
from kubeps.runtime.coordinator.watchdog import Watchdog
from kubeps.runtime.coordinator.workers import Worker, WorkerSet
from kubeps.runtime.data import leases
from kubeps.runtime.data.distribute import DistributedDataset, as_dataset
from kubeps.runtime.data.options import InputContext
from kubeps.runtime.errors import PSUnavailableError, RuntimeConfigError
from kubeps.runtime.observe import logs as _logs
from kubeps.runtime.observe import metrics as _metrics
from kubeps.runtime.observe.chief_metrics import chief_families
from kubeps.runtime.rpc.client import Client
from kubeps.runtime.rpc.protocol import PS, WORKER_SERVICE
from kubeps.runtime.util import nest
from kubeps.runtime.util.gil import hold_switch_interval

__all__ = ["DEFAULT_CLOSURES_PER_CALL", "DEFAULT_GIL_SWITCH_INTERVAL", "ClusterCoordinator", "PerWorkerDataset",
           "PerWorkerIterator", "PerWorkerValues", "RemoteValue"]


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
    * ``max_closures_per_call`` (8): a worker's call carries up to this many queued functions, its fair share of
      the queue (``RunClosures``; the worker runs them one after the other), so the chief's cost per function falls
      with the backlog. While the program schedules, the share is over the workers that could take functions now
      (the queue is refilled as it drains); once it waits (``join``, ``done``), over every worker, so a queue no
      longer than the worker count is then sent one function per call. A function's value is there when its call
      ends; the call's deadline is ``closure_timeout`` times the functions it carries. 1 sends every function
      alone.
    * ``gil_switch_interval`` (0.05 s): while the coordinator runs, the interpreter's GIL switch interval is at least
      this (``sys.setswitchinterval``; never lowered, put back by :meth:`shutdown`). At CPython's 5 ms, hundreds of
      dispatch threads take the GIL from each other by force; at 50 ms a function cost the chief about half the CPU
      at 256 workers (:mod:`kubeps.runtime.util.gil`). None leaves the interpreter's setting alone.

    With a membership file in the strategy's settings (``KUBEPS_MEMBERSHIP_FILE``: the operator's ConfigMap, or
    ``kubeps local``'s file), the workers follow that document while the coordinator runs
    (:meth:`apply_membership`, docs/elastic.md); without one they are TF_CONFIG's for its whole life.

    With a metrics port in the strategy's settings (``KUBEPS_METRICS_PORT``), the chief serves its Prometheus
    metrics there (:mod:`kubeps.runtime.observe.metrics`): the closure queue's counters, each worker's closure
    time, the RPCs to the ps, the hot-spot verdicts (:mod:`kubeps.runtime.observe.chief_metrics`); and, at
    :data:`kubeps.runtime.contract.MEMBERSHIP_ACK_PATH`, its :class:`~kubeps.runtime.cluster.MembershipAck` as
    JSON (:meth:`membership_status`), the same document as the ack file.
    """

    def __init__(self, strategy: Any, *, watchdog: Watchdog | None = None, **options: Any):
        if not isinstance(strategy, ParameterServerStrategy):
            raise RuntimeConfigError("strategy", type(strategy).__name__,
                                     "ClusterCoordinator needs a ParameterServerStrategy")
        self.options = opts = _options(options, watchdog)
        self.strategy = strategy
        self._queue = ClosureQueue()
        records = RecordsReread()
        self.workers = WorkerSet(strategy, self._queue, opts, self._connect, records)
        self.membership = MembershipController(self.workers, records)
        self.failures = self.workers.failures
        self.watchdog = self.workers.watchdog = _watchdog(watchdog, opts.watchdog_timeout, self.workers.progress)
        #: lets go of the raised GIL switch interval (shutdown); None: the interpreter's left alone
        self._switch_interval = (hold_switch_interval(opts.gil_switch_interval)
                                 if opts.gil_switch_interval is not None else None)
        self.workers.start()
        #: the hot-ps detector (coordinator/hotspots.py)
        self.hotspots = HotSpotDetector(
            strategy.num_ps, self._ps_variables, threshold=opts.hotspot_threshold,
            interval=strategy.settings.hotspot_interval_s if opts.hotspot_interval is None else opts.hotspot_interval)
        self.hotspots.start()
        if strategy.settings.log_format == "json":  # asked for: the chief's lines as JSON too
            _logs.configure(strategy.settings)
        self._collector = None
        if _metrics.serve(strategy.settings) is not None:
            self._collector = _metrics.add_collector(
                functools.partial(chief_families, self._queue, self.membership.figures, self.workers.leases.figures))
            _metrics.add_document(MEMBERSHIP_ACK_PATH, self.membership.ack_json)
        self._stop_watchdog = False
        if self.watchdog is not None and not self.watchdog.running:
            self.watchdog.start()
            self._stop_watchdog = True  # started here, so stopped by shutdown()
        #: the membership watcher (coordinator/membership.py), when the settings name a membership file
        self.membership_watcher: MembershipWatcher | None = None
        if strategy.settings.membership_file:
            self.watch_membership(strategy.settings.membership_file, strategy.settings.membership_ack_file)

    def __getattr__(self, name: str) -> Any:
        """The options read as attributes, as before they had an object of their own (``closure_timeout``, ...)."""
        options = self.__dict__.get("options")
        if options is not None and name in CoordinatorOptions.__dataclass_fields__:
            return getattr(options, name)
        raise AttributeError(f"'ClusterCoordinator' object has no attribute '{name}'")

    def _connect(self, address: str) -> Client:
        strategy = self.strategy
        return Client(address, WORKER_SERVICE, strategy.job_token, timeout=self.options.closure_timeout,
                      tls=strategy.tls, blocking=True)

    # -- public API (TF's) -----------------------------------------------------------------------------------
    def schedule(self, fn: Callable, args: Any = None, kwargs: Any = None) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` for some worker; non-blocking. Raises the first pending error, if any."""
        if not callable(fn):
            raise RuntimeConfigError("fn", fn, "schedule() needs a callable")
        if args is not None and not isinstance(args, (tuple, list)):
            raise RuntimeConfigError("args", type(args).__name__, "must be a tuple or list of positional arguments")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise RuntimeConfigError("kwargs", type(kwargs).__name__, "must be a dict of keyword arguments")
        self.workers.check_open()
        ship_by_value(fn)
        payload = dumps((fn, tuple(args or ()), dict(kwargs or {})), f"function {getattr(fn, '__name__', fn)!r}")
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

    def create_per_worker_dataset(self, dataset_fn: Any, *, exactly_once: bool = False,
                                  shard_records: int = DEFAULT_SHARD_RECORDS) -> PerWorkerDataset:
        """Build ``dataset_fn()`` (or ``dataset_fn(input_context)``) on every worker; or build a
        ``DistributedDataset`` from ``strategy.experimental_distribute_dataset`` /
        ``strategy.distribute_datasets_from_function`` there.

        ``exactly_once=True`` (kubeps): each record of every epoch is trained on once, whatever workers join, leave
        or fail (docs/elastic.md): the chief leases shards of ``shard_records`` rows (``from_tensor_slices``) or one
        file (``from_files``) with the functions it sends and commits the positions their answers report. The
        function is called with one input pipeline (``InputContext(1, 0)``): the leases split it, not the
        function; its pipeline may only ``map``, ``batch``, ``prefetch`` and ``repeat`` the records (the number of
        epochs), and the epochs are the chief's: a new ``iter()`` goes on where they stand."""
        exactly_once = check("exactly_once", exactly_once, Flag)
        shard_records = check("shard_records", shard_records, PositiveInt)
        if isinstance(dataset_fn, PerWorkerDataset):
            return dataset_fn
        if isinstance(dataset_fn, DistributedDataset):
            ship_by_value(dataset_fn.per_worker_fn)
            dataset_fn = dataset_fn.build  # a function of the worker's InputContext
        if not callable(dataset_fn):
            raise RuntimeConfigError("dataset_fn", type(dataset_fn).__name__,
                                     "must be a function that returns a dataset (an iterable) on the worker")
        ship_by_value(dataset_fn)
        if exactly_once:
            return self._create_leased_dataset(dataset_fn, shard_records)
        dataset = self.create_per_worker_resource(
            functools.partial(build_dataset, dataset_fn, self.num_workers), "dataset", PerWorkerDataset
        )
        # a worker that joins later builds it for the membership of then (docs/elastic.md, "Data")
        self.workers.add_dataset_fn(dataset.resource_id, dataset_fn)
        return dataset

    def _create_leased_dataset(self, dataset_fn: Callable[..., Any], shard_records: int) -> PerWorkerDataset:
        """The exactly-once dataset: its shards planned here from the pipeline ``dataset_fn`` builds (lazily: no
        record is read), then built on every worker (coordinator/leases.py)."""
        plan = leases.plan(as_dataset(call_dataset_fn(
            dataset_fn, lambda: InputContext(num_input_pipelines=1, input_pipeline_id=0))))
        book = ShardBook(plan.sizes, plan.epochs, shard_records)
        if not book.shards_per_epoch:
            raise RuntimeConfigError("dataset_fn", "an empty dataset", "exactly_once needs at least one record")
        dataset = self.create_per_worker_resource(functools.partial(build_leased, dataset_fn), "dataset",
                                                  PerWorkerDataset)
        self.workers.leases.add(dataset.resource_id, book)
        return dataset

    def create_per_worker_resource(self, creator: Callable[[], Any], kind: str, cls: type) -> Any:
        """Run ``creator`` on every worker (rebuilt on a worker that restarts); ``cls`` stands for the results
        (kubeps's hook behind ``create_per_worker_dataset`` and per-worker iterators)."""
        self.workers.check_open()
        payload = dumps(creator, f"the {kind} function")
        resource_id = self.workers.add_resource(kind, payload)
        with self.workers.lock:
            members = list(self.workers.members)
        values = []
        for worker in members:
            closure = Closure(payload, kind="resource", info={"resource_id": resource_id})
            self._queue.put_per_worker(worker.index, closure)
            values.append(closure.remote_value)
        return cls(self, resource_id, PerWorkerValues(tuple(values)))

    @property
    def num_workers(self) -> int:
        """The workers dispatched to now (they change when the membership does)."""
        with self.workers.lock:
            return len(self.workers.members)

    # -- membership (coordinator/membership_controller.py) --------------------------------------------------------
    def apply_membership(self, membership: Membership | Sequence[str]) -> MembershipAck:
        """Dispatch to the workers ``membership`` names from now on (``workers[i]`` is worker ``i``): a new index
        joins (a dispatch thread that waits for it, builds the per-worker resources on it, then takes closures);
        an index beyond the new count, or whose address changed, leaves (it finishes the closure it runs and takes
        nothing more; a failure on the way re-queues the closure). Scaling down therefore drops the highest
        indexes. Returns the state after the change (:meth:`membership_status`)."""
        return self.membership.apply_membership(membership)

    def membership_status(self) -> MembershipAck:
        """The generation applied, the workers dispatched to, those still draining and those drained."""
        return self.membership.membership_status()

    @property
    def membership_generation(self) -> int | None:
        """The generation of the last membership document applied (None: TF_CONFIG's workers)."""
        return self.membership.generation

    def watch_membership(self, path: str, ack_path: str | None = None) -> MembershipWatcher:
        """Apply the membership document at ``path`` whenever it changes (the settings' ``KUBEPS_MEMBERSHIP_FILE``
        does this at construction); acknowledge at ``ack_path``."""
        if self.membership_watcher is not None:
            self.membership_watcher.stop()
        self.membership_watcher = MembershipWatcher(self.membership, path, ack_path=ack_path)
        self.membership_watcher.poll()  # what the file says now, before the first function is scheduled
        return self.membership_watcher.start()

    # -- failures (the worker set's, coordinator/workers.py and coordinator/failure.py) -----------------------------
    def handle_worker_failure(self, worker: Worker, closure: Closure | None, error: BaseException) -> None:
        """A worker failed while running ``closure``: re-queue it (at-least-once) and mark the worker down."""
        worker.handle_failure(closure, error)

    def wait_for_worker(self, worker: Worker) -> bool:
        """Ping the worker with backoff until it answers (True), or the coordinator stops or it leaves (False)."""
        return worker.wait()

    def rebuild_worker_resources(self, worker: Worker) -> bool:
        """Re-create every per-worker resource on a worker that came back (in creation order)."""
        return worker.rebuild_resources()

    def handle_ps_error(self, closure: Closure, ps_index: int, message: str, restarted: bool = False) -> None:
        """A closure could not reach a ps: see :meth:`FailureDetector.handle_ps_error`."""
        self.failures.handle_ps_error(closure, ps_index, message, restarted)

    def mark_ps_failed(self, ps_index: int, error: PSUnavailableError) -> None:
        """The ps is gone: see :meth:`FailureDetector.mark_ps_failed`."""
        self.failures.mark_ps_failed(ps_index, error)

    @property
    def ps_incarnations(self) -> dict[int, str | None]:
        """The incarnation of every parameter server that its variables were created in (None: not seen yet)."""
        transport = self.strategy.transport
        return {ps: transport.incarnation(ps) for ps in range(transport.num_ps)}

    def _ps_variables(self, ps: int) -> list[Any]:
        """``ListVariables`` of one ps: what the hot-spot detector compares."""
        meta, _ = self.strategy.transport.call(ps, PS.LIST_VARIABLES, timeout=self.options.ping_timeout * 5)
        return list(meta.get("variables", []))

    # -- the end ---------------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the dispatch threads (queued functions are cancelled) and close connections."""
        if self.workers.stopping.is_set():
            return
        self.workers.stopping.set()
        if self.membership_watcher is not None:
            self.membership_watcher.stop()
        self.workers.stop()
        self.hotspots.stop()
        if self._collector is not None:
            _metrics.remove_collector(self._collector)
            _metrics.remove_document(MEMBERSHIP_ACK_PATH, self.membership.ack_json)
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


def _options(options: dict[str, Any], watchdog: Watchdog | None) -> CoordinatorOptions:
    """The keyword arguments as :class:`CoordinatorOptions` (an unknown one is a ``TypeError``, as for any
    function), the watchdog checked against them."""
    try:
        opts = CoordinatorOptions(**options)
    except TypeError as err:
        raise TypeError(f"ClusterCoordinator: {err}".replace("CoordinatorOptions.__init__() ", "")) from None
    if watchdog is not None and opts.watchdog_timeout is not None:
        raise RuntimeConfigError("watchdog", watchdog, "pass either watchdog_timeout or a Watchdog, not both")
    if watchdog is not None and not isinstance(watchdog, Watchdog):
        raise RuntimeConfigError("watchdog", type(watchdog).__name__,
                                 "must be a kubeps.runtime.coordinator.watchdog.Watchdog")
    return opts


def _watchdog(watchdog: Watchdog | None, timeout: float | None, progress: Callable[[], Any]) -> Watchdog | None:
    """The watchdog: made here from a timeout, or the caller's (given the progress probe if it has none)."""
    if timeout is not None:
        return Watchdog(timeout, progress=progress)
    if watchdog is not None and watchdog.progress is None:
        watchdog.progress = progress
    return watchdog
