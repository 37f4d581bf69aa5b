"""Where code is running: the strategy scope on the coordinator, and the closure context on a worker.

* :class:`PSTransport` reaches the parameter servers (one client per PS, parallel fan-out, and the translation of
  "cannot reach it" into :class:`~kubeps.runtime.errors.PSUnavailableError`).
* :class:`ClosureContext` exists while a worker unpickles and runs one scheduled function: the variable handles
  that arrive with the function register in it, and the first read pulls every registered dense variable in one
  RPC per parameter server (folded into the embedding lookup's call when there is one); a push answers with the
  updated dense values, so later steps of the closure read them from the cache.
* :func:`get_current_worker_index` tells a dataset fn or scheduled fn which worker runs it.
"""

from __future__ import annotations

import collections
import threading
from typing import TYPE_CHECKING, Any, Sequence

import grpc
import numpy as np

from .errors import PSUnavailableError, RemoteError
from .rpc import DEFAULT_TIMEOUT_S, PS_SERVICE, UNKNOWN_VARIABLE, Call, Client

if TYPE_CHECKING:  # pragma: no cover
    from .variables import Variable

__all__ = [
    "ClosureContext",
    "PSTransport",
    "current_closure_context",
    "current_input_context",
    "current_strategy",
    "get_current_worker_index",
    "ps_restarted",
    "ps_restarted_error",
]

#: at most this many bytes of updated dense values come back in one ``Push`` answer (per PS) for the next step
READ_BACK_BYTES = 1 << 20
#: gRPC status codes that mean "the parameter server is not there" rather than "the request was bad".
PS_UNREACHABLE_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "UNKNOWN"})

_local = threading.local()
_scope_lock = threading.Lock()
_scope_stack: list[Any] = []  # strategies, innermost last (scopes are process-wide, as in TF's default graph)


def ps_restarted_error(ps_index: int, address: str, how: str) -> PSUnavailableError:
    """The error for a parameter server that came back as a new, empty process (``.restarted`` is True)."""
    error = PSUnavailableError(
        ps_index, address,
        f"it restarted and lost its variables ({how}); this coordinator cannot go on: restart the chief so it "
        "re-creates its variables and restores the latest checkpoint (run_coordinator exits with the retryable "
        "status 133 for that)",
        code="DATA_LOSS",
    )
    error.restarted = True
    return error


def ps_restarted(error: BaseException) -> bool:
    """Whether ``error`` says a parameter server restarted (and so lost its variables), not just that it is silent."""
    return bool(getattr(error, "restarted", False))


class PSTransport:
    """Clients for every parameter server of a cluster.

    It remembers the incarnation (random id per process start) every parameter server answered ``Ping`` and
    ``CreateVariables`` with. Once a ps holds variables created through this transport, an answer with another
    incarnation -- or a NOT_FOUND for one of its variables -- means the ps restarted empty: the call raises
    :func:`ps_restarted_error` (a :class:`PSUnavailableError` with ``restarted=True``), and keeps raising it.
    """

    def __init__(self, ps_addresses: Sequence[str], token: str | None, timeout: float = DEFAULT_TIMEOUT_S):
        self.ps_addresses = list(ps_addresses)
        self._clients = [Client(a, PS_SERVICE, token, timeout) for a in self.ps_addresses]
        #: calls started per ps (tests and benchmarks count RPCs per step with it)
        self.calls: collections.Counter[int] = collections.Counter()
        self._count_lock = threading.Lock()
        self._incarnation_lock = threading.Lock()
        self._incarnations: dict[int, str] = {}
        self._holds_variables: set[int] = set()

    def incarnation(self, ps_index: int) -> str | None:
        """The incarnation of ps ``ps_index`` this transport first saw (the one its variables live in)."""
        with self._incarnation_lock:
            return self._incarnations.get(ps_index)

    def _observe(self, ps_index: int, incarnation: str, created: bool) -> None:
        with self._incarnation_lock:
            known = self._incarnations.get(ps_index)
            if known is not None and known != incarnation and ps_index in self._holds_variables:
                error = ps_restarted_error(ps_index, self.ps_addresses[ps_index],
                                           f"incarnation {known[:8]} became {incarnation[:8]}")
            else:
                self._incarnations[ps_index] = incarnation
                if created:
                    self._holds_variables.add(ps_index)
                return
        raise error

    @property
    def num_ps(self) -> int:
        return len(self._clients)

    def client(self, ps_index: int) -> Client:
        return self._clients[ps_index]

    def _unavailable(self, ps_index: int, method: str, err: RemoteError) -> BaseException:
        """The error a failed call to ps ``ps_index`` raises: unreachable -> PSUnavailableError, lost variable ->
        the restarted error, anything else (a bad request) as it is."""
        if err.code in PS_UNREACHABLE_CODES:
            return PSUnavailableError(ps_index, self.ps_addresses[ps_index], str(err), err.code)
        if err.code == "NOT_FOUND" and getattr(err, "reason", None) == UNKNOWN_VARIABLE:
            # every variable a ps is asked for was created on it by the coordinator: it came back empty
            return ps_restarted_error(ps_index, self.ps_addresses[ps_index],
                                      f"it answered {method} with NOT_FOUND: {err}")
        return err

    def _start(self, ps_index: int, method: str, meta: dict[str, Any] | None, arrays: Sequence[Any],
               timeout: float | None) -> Call:
        with self._count_lock:
            self.calls[ps_index] += 1
        try:
            return self._clients[ps_index].start(method, meta, arrays, timeout)
        except grpc.RpcError as err:  # a call refused before it left (channel closed...)
            raise self._unavailable(ps_index, method, self._clients[ps_index]._error(err)) from None

    def _finish(self, ps_index: int, method: str, call: Call) -> tuple[dict[str, Any], list[np.ndarray]]:
        try:
            answer = call.result()
        except RemoteError as err:
            raise self._unavailable(ps_index, method, err) from None
        incarnation = answer[0].get("incarnation") if isinstance(answer[0], dict) else None
        if isinstance(incarnation, str) and incarnation:
            self._observe(ps_index, incarnation, created=method == "CreateVariables")
        return answer

    def call(self, ps_index: int, method: str, meta: dict[str, Any] | None = None, arrays: Sequence[Any] = (),
             timeout: float | None = None) -> tuple[dict[str, Any], list[np.ndarray]]:
        return self._finish(ps_index, method, self._start(ps_index, method, meta, arrays, timeout))

    def call_many(self, requests: dict[int, tuple[str, dict[str, Any], Sequence[Any]]],
                  timeout: float | None = None) -> dict[int, tuple[dict[str, Any], list[np.ndarray]]]:
        """One call per parameter server, in parallel; the first failure is raised after all have finished.

        Every call is started (a gRPC future, or a chunk stream for big requests) before any answer is read, so
        they overlap without a thread per call.
        """
        started: dict[int, tuple[str, Call]] = {}
        first_error: BaseException | None = None
        for ps, (method, meta, arrays) in requests.items():
            try:
                started[ps] = (method, self._start(ps, method, meta, arrays, timeout))
            except BaseException as err:  # noqa: BLE001 - re-raised below, once the started calls finished
                first_error = err
                break
        results = {}
        for ps, (method, call) in started.items():
            try:
                results[ps] = self._finish(ps, method, call)
            except BaseException as err:  # noqa: BLE001 - re-raised below
                first_error = first_error or err
        if first_error is not None:
            raise first_error
        return results

    def close(self) -> None:
        for client in self._clients:
            client.close()


class ClosureContext:
    """The per-closure variable registry and read cache on a worker.

    Reads inside one scheduled function are batched and, where possible, ride on calls the step makes anyway:

    * the first read of a dense variable pulls **every** registered dense variable, one call per PS;
    * an ``embedding_lookup`` that needs rows while that pull is still due folds it into its own call
      (``ReadMany``: the dense values and the rows in one answer per PS);
    * ``apply_gradients`` asks each ``Push`` to answer with the new values of the registered dense variables it
      updated (``read_back``, up to :data:`READ_BACK_BYTES` per PS), and caches them: the next step of the same
      closure reads them without another call.

    Semantics (TF's async parameter-server training): a value read in a step is the PS's value when it was read
    or, after a push, when that push was applied on the PS -- updates other workers push in between are seen from
    the next read after the next push, i.e. at most one step stale, as in TF's async PS training. A new closure
    starts with an empty cache.
    """

    def __init__(self, worker_index: int, transport: PSTransport, resources: dict[str, Any]):
        self.worker_index = worker_index
        self.transport = transport
        self.resources = resources
        self.registered: dict[str, "Variable"] = {}
        self.cache: dict[str, np.ndarray] = {}
        self._batched = False  # whether the registered variables were pulled since the last invalidation
        self.pulls = 0  # calls that pulled dense values (Read, or ReadMany carrying them); tests check batching

    def register(self, var: "Variable") -> None:
        self.registered.setdefault(var._key, var)

    def read(self, variables: Sequence["Variable"]) -> list[np.ndarray]:
        missing = [v for v in variables if v._key not in self.cache]
        if missing:
            wanted = {v._key: v for v in missing}
            for var in self.take_prefetch():
                wanted.setdefault(var._key, var)
            self._pull(list(wanted.values()))
        return [self.cache[v._key] for v in variables]

    def take_prefetch(self) -> list["Variable"]:
        """The registered dense variables a batched pull is still due for (none once pulled); the caller pulls
        them (and :meth:`store` s them)."""
        if self._batched:
            return []
        self._batched = True
        return [var for key, var in self.registered.items() if var._prefetch and key not in self.cache]

    def store(self, keys: Sequence[str], arrays: Sequence[np.ndarray]) -> None:
        for key, array in zip(keys, arrays):
            self.cache[key] = array

    def read_back_keys(self, variables: Sequence["Variable"]) -> list[str]:
        """Which of these pushed dense variables a ``Push`` should answer with (registered, prefetchable, within
        :data:`READ_BACK_BYTES` together)."""
        keys, budget = [], READ_BACK_BYTES
        for var in variables:
            known = self.registered.get(var._key)
            if known is None or not known._prefetch:
                continue
            size = int(np.prod(var.shape, dtype=np.int64)) * var.dtype.itemsize
            if size > budget:
                continue
            budget -= size
            keys.append(var._key)
        return keys

    def _pull(self, variables: list["Variable"]) -> None:
        by_ps: dict[int, list[str]] = {}
        for var in variables:
            by_ps.setdefault(var._ps_index, []).append(var._key)
        results = self.transport.call_many({ps: ("Read", {"names": names}, ()) for ps, names in by_ps.items()})
        self.pulls += len(results)
        for ps, (_, arrays) in results.items():
            self.store(by_ps[ps], arrays)

    def invalidate(self, keys: Sequence[str] | None = None) -> None:
        if keys is None:
            self.cache.clear()
        else:
            for key in keys:
                self.cache.pop(key, None)
        self._batched = False


def current_closure_context() -> ClosureContext | None:
    return getattr(_local, "closure", None)


def set_closure_context(ctx: ClosureContext | None) -> ClosureContext | None:
    previous = getattr(_local, "closure", None)
    _local.closure = ctx
    return previous


def get_current_worker_index() -> int:
    """The index of the worker running the current scheduled function or dataset function (TF's name)."""
    ctx = current_closure_context()
    if ctx is None:
        raise RuntimeError(
            "get_current_worker_index() must be called inside a function running on a worker (a function passed "
            "to ClusterCoordinator.schedule or create_per_worker_dataset); this code runs on the coordinator"
        )
    return ctx.worker_index


def current_input_context(num_workers: int) -> Any:
    """The ``InputContext`` of the worker running the current dataset function: one input pipeline per worker."""
    from .data import InputContext

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
