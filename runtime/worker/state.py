"""The worker service: runs scheduled functions (closures) and holds per-worker resources (datasets, iterators).

A closure arrives as cloudpickle bytes (only after the job token was checked, see :mod:`kubeps.runtime.rpc.security`).
It is unpickled inside a :class:`~kubeps.runtime.variables.context.ClosureContext`, so its variable handles register there
and per-worker resource references resolve to this worker's objects. The result goes back as a pickled skeleton
(containers, scalars) with every numpy array replaced by a reference to a tensor of the wire frame.

Statuses a ``RunClosure`` answer carries in ``meta["status"]``:
``ok`` (result), ``error`` (the function raised; non-retryable), ``resource_missing`` (a per-worker resource is not
here: the worker restarted; the coordinator rebuilds resources and retries), ``ps_unavailable`` (a parameter server
could not be reached: the coordinator retries while the blip lasts, then fails the job; with ``restarted`` true the
ps answered NOT_FOUND for a variable, i.e. it restarted empty, and the job fails at once).
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import time
import traceback
import uuid
from typing import Any, Callable, Iterator

import cloudpickle
import numpy as np

from kubeps.runtime.data.leases import NeedsInput, ShardFeed, feed_of
from kubeps.runtime.data.passes import PassLedger
from kubeps.runtime.data.structure import rows_of
from kubeps.runtime.observe import metrics as _metrics
from kubeps.runtime.variables import context as _context
from kubeps.runtime.variables.context import ClosureContext
from kubeps.runtime.errors import PSUnavailableError, ResourceMissingError
from kubeps.runtime.rpc.codec import split_structure
from kubeps.runtime.rpc.protocol import (WORKER, ClosureAnswer, CreateResourceRequest, LeaseGrant,
                                        RunClosureRequest, RunClosuresAnswer, RunClosuresRequest)
from kubeps.runtime.rpc.transport import PSTransport, ps_restarted
from kubeps.runtime.rpc.tls import TLSConfig
from kubeps.runtime.variables.variable import ShardedVariable, Variable
from kubeps.runtime.util.threads import MathThreadTuner

__all__ = ["BUILTIN_METHODS", "MeasuredIterator", "WorkerState"]


class WorkerState:
    """What a worker task holds between closures."""

    def __init__(self, worker_index: int, ps_addresses: list[str], token: str | None, rpc_timeout: float = 30.0,
                 tls: TLSConfig | None = None):
        self.worker_index = worker_index
        _context.register_worker_process(worker_index)
        self.transport = PSTransport(ps_addresses, token, rpc_timeout, tls=tls)
        self.resources: dict[str, Any] = {}
        self.incarnation = uuid.uuid4().hex
        self.closures_run = 0
        self._lock = threading.Lock()
        #: sizes the math thread pools by what they buy over the first closures (the server sets it when it
        #: starts, knowing the task's CPU budget); None: the pools stay as they are
        self.threads: MathThreadTuner | None = None
        #: dense values kept from step to step under bounded staleness (``dense_staleness``)
        self.kept = _context.KeptReads()

    def context(self) -> ClosureContext:
        return ClosureContext(self.worker_index, self.transport, self.resources, self.kept)

    def close(self) -> None:
        self.transport.close()


class MeasuredIterator:
    """A per-worker iterator that keeps a :class:`~kubeps.runtime.data.passes.PassLedger` of what it hands out (the
    records a reshard makes read again) and, with metrics on, tells them how long each ``next()`` waited for its
    batch and how many examples the batch holds (the leading dimension of its first tensor); anything else goes to
    the iterator."""

    def __init__(self, inner: Iterator[Any], ledger: PassLedger | None = None):
        self._inner = inner
        #: the shards an exactly-once dataset's source reads (it counts the records handed out), else None
        self.feed: ShardFeed | None = getattr(inner, "feed", None)
        #: the ledger the pipeline was opened with (``rpc_create_resource`` makes it active around ``iter()``)
        self.ledger = PassLedger() if ledger is None else ledger

    def __iter__(self) -> "MeasuredIterator":
        return self

    def __next__(self) -> Any:
        started = time.perf_counter()
        try:
            with self.ledger.active():  # a pipeline opened on the first next() finds its ledger
                batch = next(self._inner)
        except StopIteration:
            self.ledger.ended()
            raise
        rows = rows_of(batch)
        self.ledger.consumed(rows)
        if self.feed is not None:
            self.feed.consumed(rows if self.ledger.batched else 1)
        if _metrics.ENABLED:
            _metrics.INPUT_WAIT.observe(time.perf_counter() - started)
            _metrics.WORKER_BATCHES.inc()
            _metrics.WORKER_EXAMPLES.inc(rows)
        return batch

    def get_next(self) -> Any:
        return self.__next__()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def records_in_pass(resources: dict[str, Any]) -> int:
    """The records the worker's iterators handed out in the passes under way: what a reshard makes read again."""
    return sum(r.ledger.in_pass() for r in list(resources.values())
               if isinstance(r, MeasuredIterator) and r.feed is None)  # an exactly-once one re-reads nothing


def _feeds(resources: dict[str, Any]) -> dict[str, ShardFeed]:
    """The worker's exactly-once datasets' feeds, by resource id."""
    feeds = {rid: feed_of(resource) for rid, resource in list(resources.items())}
    return {rid: feed for rid, feed in feeds.items() if feed is not None}


@contextlib.contextmanager
def _leases(state: "WorkerState", ctx: ClosureContext,
            grants: dict[str, LeaseGrant] | None) -> Iterator[dict[str, ShardFeed]]:
    """The shards a call leased given to their datasets' feeds, which know a function runs while it does and when
    it writes to a variable (what its steps took up to there is trained)."""
    feeds = _feeds(state.resources)
    for rid, grant in (grants or {}).items():
        if rid not in feeds:
            raise ResourceMissingError(f"exactly-once dataset {rid!r} is not built on this worker")
        feeds[rid].grant(grant["shards"], grant["final"])
    for feed in feeds.values():
        feed.in_function(True)
        ctx.on_write.append(feed.wrote)
    try:
        yield feeds
    finally:
        for feed in feeds.values():
            feed.in_function(False)


def _to_array(item: Any) -> Any:
    """A variable in a result travels as its value."""
    return np.asarray(item.read_value()) if isinstance(item, (Variable, ShardedVariable)) else item


def _payload(arrays: list[np.ndarray], method: str) -> bytes:
    if len(arrays) != 1 or arrays[0].dtype != np.uint8 or arrays[0].ndim != 1:
        raise ValueError(f"{method}: field 'tensors' must hold exactly one 1-D uint8 tensor (the pickled function)")
    return bytes(arrays[0].tobytes())


def _bytes_tensor(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


def _run_and_flush(ctx: ClosureContext, body: Callable[[Any], Any], obj: Any) -> Any:
    """``body(obj)``, then the pushes the closure still holds (its last step's) are sent before it counts as done.
    If the function fails, the pushes it made before still apply (to every parameter server but one that failed
    it), as they would have without deferral; the function's error is what the coordinator sees."""
    try:
        result = body(obj)
    except BaseException as err:
        failed = getattr(err, "ps_index", None)
        try:
            ctx.flush([ps for ps in ctx.deferred_ps() if ps != failed])
        except Exception:  # noqa: BLE001 - the function's own error is the one to report
            pass
        raise
    ctx.flush()
    return result


def _run(state: WorkerState, payload: bytes, body: Callable[[Any], Any], grants: dict[str, LeaseGrant] | None = None,
         report: bool = True) -> tuple[ClosureAnswer, list[np.ndarray]]:
    """Run ``body`` on the unpickled payload. With ``report``, the answer says where the worker's exactly-once
    datasets stand after it (what the chief commits: asked once per function, as a report moves past what it
    reports), whatever its status: a function that did not finish trained what it took up to its last write to a
    variable (those pushes applied), no further."""
    ctx = state.context()
    previous = _context.set_closure_context(ctx)
    feeds: dict[str, ShardFeed] = {}
    try:
        try:
            with _leases(state, ctx, grants) as feeds:
                meta, tensors = _answer(state, ctx, payload, body)
        except ResourceMissingError as err:  # a leased dataset this worker does not have (it restarted)
            state.kept.drop()
            return {"status": "resource_missing", "message": str(err)}, []
        if meta["status"] not in ("ok", "needs_input"):  # a ps restarted or moved, a checkpoint restored, ...:
            state.kept.drop()  # nothing kept under a bounded staleness is worth reading again
        if feeds and report:
            finished = meta.get("status") == "ok"
            meta["positions"] = {rid: feed.positions(finished) for rid, feed in feeds.items()}
        return meta, tensors
    finally:
        _context.set_closure_context(previous)
        with state._lock:
            state.closures_run += 1


def _answer(state: WorkerState, ctx: ClosureContext, payload: bytes,
            body: Callable[[Any], Any]) -> tuple[ClosureAnswer, list[np.ndarray]]:
    try:
        obj = cloudpickle.loads(payload)
        with state.threads.measure() if state.threads is not None else contextlib.nullcontext():
            result = _run_and_flush(ctx, body, obj)
    except NeedsInput as err:
        return {"status": "needs_input", "message": str(err)}, []
    except ResourceMissingError as err:
        return {"status": "resource_missing", "message": str(err)}, []
    except PSUnavailableError as err:
        return {"status": "ps_unavailable", "ps_index": err.ps_index, "message": str(err),
                "restarted": ps_restarted(err)}, []
    except BaseException as err:  # noqa: BLE001 - the user's function may raise anything; report it
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        try:
            blob = cloudpickle.dumps(err)
            pickle.loads(blob)  # make sure the coordinator can rebuild it
        except Exception:  # noqa: BLE001
            blob = b""
        failed: ClosureAnswer = {"status": "error", "type": type(err).__name__, "message": str(err),
                                 "traceback": traceback.format_exc()}
        return failed, [_bytes_tensor(blob)]
    tensors: list[np.ndarray] = []
    skeleton = split_structure(result, tensors, _to_array)
    meta: ClosureAnswer = {"status": "ok", "pulls": ctx.pulls, "in_pass": records_in_pass(state.resources)}
    return meta, [_bytes_tensor(cloudpickle.dumps(skeleton))] + tensors


def _call(obj: Any) -> Any:
    return obj[0](*obj[1], **obj[2])


def rpc_run_closure(state: WorkerState, request: RunClosureRequest,
                    arrays: list[np.ndarray]) -> tuple[ClosureAnswer, list[np.ndarray]]:
    """Run ``fn(*args, **kwargs)`` from the pickled ``(fn, args, kwargs)``, with the shards the call leased."""
    payload = _payload(arrays, WORKER.RUN_CLOSURE)
    return _run(state, payload, _call, request.get("leases"))


def rpc_run_closures(state: WorkerState, request: RunClosuresRequest,
                     arrays: list[np.ndarray]) -> tuple[RunClosuresAnswer, list[np.ndarray]]:
    """Run several pickled ``(fn, args, kwargs)`` one after the other, as many ``RunClosure`` calls would; stop
    after the first whose answer is not ``ok`` (what follows it is not run: the coordinator queues it again)."""
    ids = request["closure_ids"]
    if not ids or len(ids) != len(arrays):
        raise ValueError(f"{WORKER.RUN_CLOSURES}: field 'closure_ids' must name one function per tensor, got "
                         f"{len(ids)} id(s) for {len(arrays)} tensor(s)")
    for i, array in enumerate(arrays):
        if array.dtype != np.uint8 or array.ndim != 1:
            raise ValueError(f"{WORKER.RUN_CLOSURES}: field 'tensors' must hold 1-D uint8 tensors (the pickled "
                             f"functions); tensor {i} is {array.ndim}-D {array.dtype}")
    payloads = [bytes(array.tobytes()) for array in arrays]
    answers: list[ClosureAnswer] = []
    counts: list[int] = []
    tensors: list[np.ndarray] = []
    grants = request.get("leases")
    for payload in payloads:
        meta, out = _run(state, payload, _call, grants)
        grants = None  # given with the first
        answers.append(meta)
        counts.append(len(out))
        tensors += out
        if meta.get("status") != "ok":
            break
    return ({"status": "ok", "answers": answers, "counts": counts, "in_pass": records_in_pass(state.resources)},
            tensors)


def rpc_create_resource(state: WorkerState, request: CreateResourceRequest,
                        arrays: list[np.ndarray]) -> tuple[ClosureAnswer, list[np.ndarray]]:
    """Build a per-worker resource: ``resources[resource_id] = fn()`` from the pickled ``fn``."""
    resource_id = request["resource_id"]
    if not resource_id:
        raise ValueError(f"field 'resource_id' must be a non-empty string, got {resource_id!r}")
    payload = _payload(arrays, WORKER.CREATE_RESOURCE)

    replaced = state.resources.get(resource_id)
    old_feed = feed_of(replaced)
    if old_feed is not None:  # built again: its shards went back to the chief; a source waiting for more ends
        old_feed.close()

    def build(fn: Callable[[], Any]) -> None:
        ledger = PassLedger()
        with ledger.active():  # a pipeline opened by iter() finds its ledger
            resource = fn()
        if isinstance(resource, Iterator):
            resource = MeasuredIterator(resource, ledger)
            if resource.feed is not None:  # an exactly-once dataset's: it reads from the commits on
                resource.feed.take_over()
        state.resources[resource_id] = resource
        return None

    meta, tensors = _run(state, payload, build, report=False)
    if isinstance(replaced, MeasuredIterator) and replaced.feed is None and meta.get("status") == "ok":
        # built again for a new membership (or after a failure): the new iterator reads its shard from the start,
        # so what the old one handed out in the pass under way is read again
        meta["reread"] = replaced.ledger.in_pass()
    return meta, tensors


#: the methods of the worker service (:mod:`kubeps.runtime.server.methods` serves them)
BUILTIN_METHODS: dict[str, Callable[..., tuple[Any, list[np.ndarray]]]] = {
    WORKER.RUN_CLOSURE: rpc_run_closure,
    WORKER.RUN_CLOSURES: rpc_run_closures,
    WORKER.CREATE_RESOURCE: rpc_create_resource,
}
