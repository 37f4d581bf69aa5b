"""Where code is running: the strategy scope on the coordinator, and the closure context on a worker.

* :class:`ClosureContext` exists while a worker unpickles and runs one scheduled function: the variable handles
  that arrive with the function register in it, and the first read pulls every registered dense variable in one
  RPC per parameter server (folded into the embedding lookup's call when there is one); a push waits for the
  next step's first call to the same parameter server and rides on it (``PushRead``), so a training step costs one
  round trip per parameter server. It sees variables only through
  the small :class:`RemoteHandle` protocol, so this module does not import :mod:`kubeps.runtime.variables.variable`
  (which imports it).
* :func:`get_current_worker_index` tells a dataset fn or scheduled fn which worker runs it.
* :func:`current_strategy` is the strategy whose ``scope()`` is active on the coordinator.

The parameter servers are reached through :class:`~kubeps.runtime.rpc.transport.PSTransport`.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence, TypeVar

import numpy as np

from kubeps.runtime.data.options import InputContext
from kubeps.runtime.errors import ResourceMissingError
from kubeps.runtime.rpc.protocol import PS, NamesRequest, PushLookupDynamicRequest, PushReadRequest, PushRequest
from kubeps.runtime.rpc.transport import DeclaredRequest, PSTransport

__all__ = [
    "ClosureContext",
    "KeptReads",
    "RemoteHandle",
    "current_closure_context",
    "current_input_context",
    "current_strategy",
    "get_current_worker_index",
    "resolve_resource",
]

AnswerT = TypeVar("AnswerT")


class RemoteHandle(Protocol):
    """What the closure context needs of a variable on a parameter server (:class:`~kubeps.runtime.Variable`
    provides it)."""

    @property
    def key(self) -> str:
        """The variable's unique name on its parameter server."""

    @property
    def ps_index(self) -> int | None:
        """The index of the parameter server holding it."""

    @property
    def prefetch(self) -> bool:
        """Whether a closure's batched pull fetches it (dense variables; not embedding tables)."""

    @property
    def staleness(self) -> int:
        """How many of this worker's later steps may reuse a value of it pulled in one step (0: pulled every
        step; ``ParameterServerStrategy(dense_staleness=...)``)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype: ...


#: variables of at most this many bytes (dense weights, sharded or not: a 1024 x 1024 float32 kernel is 4 MiB) are
#: pulled whole with a step's first call to their parameter server, and a bounded staleness (``dense_staleness``)
#: may keep them on a worker from step to step; bigger ones, and any variable a worker has looked rows up in (an
#: embedding table: :meth:`ClosureContext.note_rows`), are read only where a step asks (rows or ``read_value``)
PREFETCH_MAX_BYTES = 16 << 20
#: methods that only read: a deferred push to the same parameter server rides on them (``PushRead``)
_READS = PS.READS

_local = threading.local()
_scope_lock = threading.Lock()
_scope_stack: list[Any] = []  # strategies, innermost last (scopes are process-wide, as in TF's default graph)
_worker_processes: set[int] = set()  # the worker index(es) this process serves (one, except in tests)


class ClosureContext:
    """The per-closure variable registry, read cache and deferred pushes on a worker.

    A training step's calls are batched and ride on each other, so that a step costs **one round trip per
    parameter server**:

    * the first read of a dense variable pulls **every** registered dense variable, one call per PS;
    * an ``embedding_lookup`` that needs rows while that pull is still due folds it into its own call
      (``ReadMany``: the dense values and the rows in one answer per PS);
    * ``apply_gradients`` does not call at once: it leaves one ``Push`` per PS here (:meth:`defer_push`) and
      clears the cache. The next call the closure makes to that PS -- the next step's lookup and pull -- carries it
      (``PushRead``: the PS applies the push, then reads, so the step sees its own update); any other method, a
      second push, and the end of the closure (:meth:`flush`) send it on its own first. Program order per PS is
      kept; a push reaches the PS as late as the start of the next step's first call.

    Semantics (TF's async parameter-server training): a value read in a step is the PS's value when it was read,
    which includes every push this worker made before; updates other workers push in between are seen from the
    next read, i.e. at most one step stale, as in TF's async PS training. A new closure starts with an empty cache.
    A push's error (a parameter server gone) surfaces at the call that carries it.

    Bounded staleness (``kept``, a :class:`KeptReads` the worker keeps between closures): a variable whose handle
    says ``staleness = s > 0`` keeps the value pulled in one step for this worker's next ``s`` steps (pushes), across
    closures, before it is pulled again; its pushes still go every step.
    """

    def __init__(self, worker_index: int, transport: PSTransport, resources: dict[str, Any],
                 kept: "KeptReads | None" = None):
        self.worker_index = worker_index
        self.transport = transport
        self.resources = resources
        self.registered: dict[str, RemoteHandle] = {}
        self.kept = kept
        self.cache: dict[str, np.ndarray] = {} if kept is None else kept.values()
        self._batched = False  # whether the registered variables were pulled since the last invalidation
        self._deferred: dict[int, tuple[PushRequest, list[Any]]] = {}  # ps -> (Push request, tensors)
        self.pulls = 0  # calls that pulled dense values (Read, ReadMany, PushRead); tests check batching
        #: called when the closure writes to a variable (a push or an assign): its exactly-once datasets' feeds
        #: count the records taken so far as trained (:meth:`~kubeps.runtime.data.leases.ShardFeed.wrote`)
        self.on_write: list[Callable[[], None]] = []

    def register(self, var: RemoteHandle) -> None:
        self.registered.setdefault(var.key, var)

    def read(self, variables: Sequence[RemoteHandle]) -> list[np.ndarray]:
        missing = [v for v in variables if v.key not in self.cache]
        if missing:
            wanted = {v.key: v for v in missing}
            for var in self.take_prefetch():
                wanted.setdefault(var.key, var)
            self._pull(list(wanted.values()))
        return [self.cache[v.key] for v in variables]

    def take_prefetch(self) -> list[RemoteHandle]:
        """The registered dense variables a batched pull is still due for (none once pulled); the caller pulls
        them (and :meth:`store` s them)."""
        if self._batched:
            return []
        self._batched = True
        tables = self.kept.tables if self.kept is not None else ()
        return [var for key, var in self.registered.items()
                if var.prefetch and key not in self.cache and key not in tables]

    def note_rows(self, keys: Sequence[str]) -> None:
        """``keys`` are looked up by rows (an embedding table's shards): never pulled whole with the dense values,
        on this worker from now on (the worker remembers them across scheduled functions)."""
        if self.kept is not None:
            self.kept.tables.update(keys)

    def store(self, keys: Sequence[str], arrays: Sequence[np.ndarray]) -> None:
        for key, array in zip(keys, arrays):
            self.cache[key] = array

    def _pull(self, variables: list[RemoteHandle]) -> None:
        by_ps: dict[int, list[str]] = {}
        for var in variables:
            assert var.ps_index is not None, "the closure context registers remote variables only"
            by_ps.setdefault(var.ps_index, []).append(var.key)
        results = self.call_many({ps: (PS.READ, NamesRequest(names=names), ()) for ps, names in by_ps.items()})
        self.pulls += len(results)
        for ps, (_, arrays) in results.items():
            self.store(by_ps[ps], arrays)

    def invalidate(self, keys: Sequence[str] | None = None) -> None:
        """Forget cached values: ``keys`` (written by this worker), or after a push (``None``) every value but those
        a bounded staleness keeps for the next step."""
        if keys is None:
            self.cache = self.kept.after_step(self.cache, self.registered) if self.kept is not None else {}
        else:
            for key in keys:
                self.cache.pop(key, None)
            if self.kept is not None:
                self.kept.drop(keys)
        self._batched = False

    # -- deferred pushes ----------------------------------------------------------------------------------------
    def defer_push(self, requests: dict[int, tuple[PushRequest, list[Any]]]) -> None:
        """Hold one ``Push`` ``(meta, tensors)`` per PS until the next call to that PS carries it; a push still
        held for one of them goes first, on its own. The cached values are stale from here on."""
        held = [ps for ps in requests if ps in self._deferred]
        if held:
            self.flush(held)
        self._deferred.update(requests)
        self.invalidate()
        self.wrote()

    def wrote(self) -> None:
        """The closure wrote to a variable (its push is held or sent, its assign sent)."""
        for hook in self.on_write:
            hook()

    def call_many(self, requests: Mapping[int, DeclaredRequest[AnswerT]],
                  timeout: float | None = None) -> dict[int, tuple[AnswerT, list[np.ndarray]]]:
        """``PSTransport.call_many`` for calls made inside the closure: a read to a PS with a deferred push
        becomes one ``PushRead`` (same answer layout as the read); before any other method the push is sent."""
        # a read that carried a push is answered the push's PushAnswer, which holds every key of the read's own
        # answer (EmptyAnswer): the answers are still AnswerT
        answers: dict[int, tuple[Any, list[np.ndarray]]] = self.transport.call_many(self.carry_pushes(requests), timeout)
        return answers

    def carry_pushes(self, requests: Mapping[int, tuple[str, Mapping[str, Any], Sequence[Any]]]
                     ) -> dict[int, tuple[str, Mapping[str, Any], Sequence[Any]]]:
        """The calls :meth:`call_many` sends for ``requests``: the deferred pushes they carry are taken (a push
        before another method is sent now); the caller sends the calls -- at once, or from another thread while
        the step computes (:func:`~kubeps.runtime.variables.variable.start_lookup`)."""
        calls: dict[int, tuple[str, Mapping[str, Any], Sequence[Any]]] = {}
        others = []
        for ps, (method, meta, arrays) in requests.items():
            if ps not in self._deferred:
                calls[ps] = (method, meta, arrays)
            elif method == PS.LOOKUP_DYNAMIC:  # a lookup of dynamic tables carries the push the same way
                push, push_arrays = self._deferred.pop(ps)
                lookup = PushLookupDynamicRequest(optimizer=push["optimizer"], updates=push["updates"],
                                                  names=list(meta.get("names", [])), rows=list(meta.get("rows", [])),
                                                  dynamic=list(meta.get("dynamic", [])))
                calls[ps] = (PS.PUSH_LOOKUP_DYNAMIC, lookup, [*push_arrays, *arrays])
            elif method in _READS:
                push, push_arrays = self._deferred.pop(ps)
                names = list(meta.get("names", [])) if method != PS.READ_ROWS else []
                rows = list(meta["names"]) if method == PS.READ_ROWS else list(meta.get("rows", []))
                read = PushReadRequest(optimizer=push["optimizer"], updates=push["updates"], names=names, rows=rows)
                calls[ps] = (PS.PUSH_READ, read, [*push_arrays, *arrays])
            else:
                others.append(ps)
                calls[ps] = (method, meta, arrays)
        if others:
            self.flush(others)
        return calls

    def prefetch_handles(self) -> list[RemoteHandle]:
        """Every registered dense variable (what a step's batched pull reads), pulled or not, but those whose value
        a bounded staleness still serves next step."""
        lasting = self.kept.lasting() | self.kept.tables if self.kept is not None else set()
        return [var for key, var in self.registered.items() if var.prefetch and key not in lasting]

    def store_pulled(self, keys: Sequence[str], arrays: Sequence[np.ndarray]) -> None:
        """The dense values a pipelined lookup pulled for this step: cached, and the step's batched pull done."""
        self.store(keys, arrays)
        self._batched = True
        self.pulls += 1

    def deferred_ps(self) -> list[int]:
        """The parameter servers a deferred push is held for."""
        return list(self._deferred)

    def flush(self, ps_indices: Sequence[int] | None = None) -> None:
        """Send the deferred pushes (of ``ps_indices``, default all) on their own, in parallel."""
        targets = list(self._deferred) if ps_indices is None else [ps for ps in ps_indices if ps in self._deferred]
        pushes = {ps: (PS.PUSH, *self._deferred.pop(ps)) for ps in targets}
        if pushes:
            self.transport.call_many(pushes)


class KeptReads:
    """The dense values one worker keeps from step to step under bounded staleness.

    A value pulled in a step serves this worker's next ``staleness`` steps too (its handle's
    :attr:`RemoteHandle.staleness`; a step ends at its push), across scheduled functions, then is pulled again. The
    worker's own pushes and those of the others reach the parameter server every step; only the reads are older,
    by at most ``staleness`` of this worker's steps (plus the other workers' pushes meanwhile): the bounded-staleness
    (stale synchronous parallel) read of parameter-server systems. The worker drops everything kept when a
    scheduled function fails (a parameter server restarted or the job restored a checkpoint).
    """

    def __init__(self) -> None:
        self._values: dict[str, tuple[np.ndarray, int]] = {}  # key -> (value, steps since it was pulled)
        self._bounds: dict[str, int] = {}  # key -> its handle's staleness
        #: keys this worker looked rows up in (tables): never pulled whole with the dense values, never kept
        self.tables: set[str] = set()

    def values(self) -> dict[str, np.ndarray]:
        """What a new closure starts its cache with."""
        return {key: value for key, (value, _) in self._values.items()}

    def lasting(self) -> set[str]:
        """The keys whose kept value also serves the next step (a pipelined pull need not fetch them)."""
        return {key for key, (_, age) in self._values.items() if key in self._bounds and age < self._bounds[key]}

    def after_step(self, cache: Mapping[str, np.ndarray], handles: Mapping[str, RemoteHandle]) -> dict[str, np.ndarray]:
        """The values of ``cache`` the next step may still read: one step older, within their handle's bound."""
        kept: dict[str, tuple[np.ndarray, int]] = {}
        bounds: dict[str, int] = {}
        for key, value in cache.items():
            handle = handles.get(key)
            bound = handle.staleness if handle is not None and key not in self.tables else 0
            if bound <= 0:
                continue
            previous = self._values.get(key)
            age = previous[1] + 1 if previous is not None and previous[0] is value else 1
            if age <= bound:
                kept[key] = (value, age)
                bounds[key] = bound
        self._values = kept
        self._bounds = bounds
        return self.values()

    def drop(self, keys: Sequence[str] | None = None) -> None:
        """Forget ``keys`` (default: everything)."""
        if keys is None:
            self._values, self._bounds = {}, {}
        else:
            for key in keys:
                self._values.pop(key, None)
                self._bounds.pop(key, None)


def current_closure_context() -> ClosureContext | None:
    return getattr(_local, "closure", None)


def set_closure_context(ctx: ClosureContext | None) -> ClosureContext | None:
    previous = getattr(_local, "closure", None)
    _local.closure = ctx
    return previous


@contextlib.contextmanager
def frozen_lookups() -> Iterator[None]:
    """In this thread, dynamic-table lookups that do not say ``train=`` count nothing and create nothing (unknown
    ids read the default row), even for a table in this process: evaluation, as the sidecar evaluator runs it."""
    previous = getattr(_local, "frozen", False)
    _local.frozen = True
    try:
        yield
    finally:
        _local.frozen = previous


def lookups_frozen() -> bool:
    """Inside :func:`frozen_lookups` in this thread."""
    return bool(getattr(_local, "frozen", False))


def register_worker_process(worker_index: int) -> None:
    """This process serves worker ``worker_index`` (``WorkerState`` calls it): threads that run no closure, such
    as a dataset's ``prefetch`` thread, still know which worker they are on."""
    with _scope_lock:
        _worker_processes.add(int(worker_index))


def get_current_worker_index() -> int:
    """The index of the worker running the current scheduled function or dataset function (TF's name).

    Any thread of a worker process knows it (a generator behind ``.prefetch()`` runs in a thread of its own)."""
    ctx = current_closure_context()
    if ctx is not None:
        return ctx.worker_index
    with _scope_lock:
        workers = sorted(_worker_processes)
    if len(workers) == 1:
        return workers[0]
    where = ("this process serves no worker: it is the coordinator or another task" if not workers else
             f"this process serves workers {workers} and this thread runs no function of theirs")
    raise RuntimeError(
        "get_current_worker_index() must be called inside a function running on a worker (a function passed "
        f"to ClusterCoordinator.schedule or create_per_worker_dataset, or a dataset it builds); {where}"
    )


def current_input_context(num_workers: int) -> Any:
    """The ``InputContext`` of the worker running the current dataset function: one input pipeline per worker."""
    return InputContext(num_input_pipelines=num_workers, input_pipeline_id=get_current_worker_index())


def push_strategy(strategy: Any) -> None:
    with _scope_lock:
        _scope_stack.append(strategy)


def pop_strategy(strategy: Any) -> None:
    with _scope_lock:
        if not _scope_stack or _scope_stack[-1] is not strategy:
            raise RuntimeError("strategy scopes must be exited in the reverse order of entering them")
        _scope_stack.pop()


def current_strategy() -> Any | None:
    """The strategy whose ``scope()`` is active, or None (variables are then local)."""
    if current_closure_context() is not None:
        return None  # variables created inside a scheduled function are local to it
    with _scope_lock:
        return _scope_stack[-1] if _scope_stack else None


def resolve_resource(resource_id: str) -> Any:
    """Unpickling hook: the worker-local object a per-worker resource reference stands for."""
    ctx = current_closure_context()
    if ctx is None:
        raise RuntimeError(f"per-worker resource {resource_id} can only be used inside a function running on a worker")
    try:
        return ctx.resources[resource_id]
    except KeyError:
        raise ResourceMissingError(
            f"worker {ctx.worker_index} holds no per-worker resource {resource_id} (it restarted?)"
        ) from None
