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

from kubeps.runtime.data.passes import PassLedger
from kubeps.runtime.data.structure import rows_of
from kubeps.runtime.observe import metrics as _metrics
from kubeps.runtime.variables import context as _context
from kubeps.runtime.variables.context import ClosureContext
from kubeps.runtime.errors import PSUnavailableError, ResourceMissingError
from kubeps.runtime.rpc.codec import split_structure
from kubeps.runtime.rpc.protocol import (WORKER, ClosureAnswer, CreateResourceRequest, RunClosureRequest,
                                        RunClosuresAnswer, RunClosuresRequest)
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
    return sum(r.ledger.in_pass() for r in list(resources.values()) if isinstance(r, MeasuredIterator))


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


def _run(state: WorkerState, payload: bytes, body: Callable[[Any], Any]) -> tuple[ClosureAnswer, list[np.ndarray]]:
    ctx = state.context()
    previous = _context.set_closure_context(ctx)
    try:
        try:
            obj = cloudpickle.loads(payload)
            with state.threads.measure() if state.threads is not None else contextlib.nullcontext():
                result = _run_and_flush(ctx, body, obj)
        except ResourceMissingError as err:
            state.kept.drop()
            return {"status": "resource_missing", "message": str(err)}, []
        except PSUnavailableError as err:
            state.kept.drop()  # a parameter server restarted or moved: nothing kept is worth reading again
            return {"status": "ps_unavailable", "ps_index": err.ps_index, "message": str(err),
                    "restarted": ps_restarted(err)}, []
        except BaseException as err:  # noqa: BLE001 - the user's function may raise anything; report it
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            state.kept.drop()
            try:
                blob = cloudpickle.dumps(err)
                pickle.loads(blob)  # make sure the coordinator can rebuild it
            except Exception:  # noqa: BLE001
                blob = b""
            meta: ClosureAnswer = {"status": "error", "type": type(err).__name__, "message": str(err),
                    "traceback": traceback.format_exc()}
            return meta, [_bytes_tensor(blob)]
        tensors: list[np.ndarray] = []
        skeleton = split_structure(result, tensors, _to_array)
        return ({"status": "ok", "pulls": ctx.pulls, "in_pass": records_in_pass(state.resources)},
                [_bytes_tensor(cloudpickle.dumps(skeleton))] + tensors)
    finally:
        _context.set_closure_context(previous)
        with state._lock:
            state.closures_run += 1


def _call(obj: Any) -> Any:
    return obj[0](*obj[1], **obj[2])


def rpc_run_closure(state: WorkerState, request: RunClosureRequest,  # noqa: ARG001
                    arrays: list[np.ndarray]) -> tuple[ClosureAnswer, list[np.ndarray]]:
    """Run ``fn(*args, **kwargs)`` from the pickled ``(fn, args, kwargs)``."""
    payload = _payload(arrays, WORKER.RUN_CLOSURE)
    return _run(state, payload, _call)


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
    for payload in payloads:
        meta, out = _run(state, payload, _call)
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

    def build(fn: Callable[[], Any]) -> None:
        ledger = PassLedger()
        with ledger.active():  # a pipeline opened by iter() finds its ledger
            resource = fn()
        if isinstance(resource, Iterator):
            resource = MeasuredIterator(resource, ledger)
        state.resources[resource_id] = resource
        return None

    meta, tensors = _run(state, payload, build)
    if isinstance(replaced, MeasuredIterator) and meta.get("status") == "ok":
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
