"""Where code is running: the strategy scope on the coordinator, and the closure context on a worker.

* :class:`ClosureContext` exists while a worker unpickles and runs one scheduled function: the variable handles
  that arrive with the function register in it, and the first read pulls every registered dense variable in one
  RPC per parameter server (folded into the embedding lookup's call when there is one); a push answers with the
  updated dense values, so later steps of the closure read them from the cache. It sees variables only through
  the small :class:`RemoteHandle` protocol, so this module does not import :mod:`kubeps.runtime.variables`
  (which imports it).
* :func:`get_current_worker_index` tells a dataset fn or scheduled fn which worker runs it.
* :func:`current_strategy` is the strategy whose ``scope()`` is active on the coordinator.

The parameter servers are reached through :class:`~kubeps.runtime.transport.PSTransport`.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol, Sequence

import numpy as np

from .transport import PSTransport

__all__ = [
    "ClosureContext",
    "RemoteHandle",
    "current_closure_context",
    "current_input_context",
    "current_strategy",
    "get_current_worker_index",
]


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
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype: ...


#: at most this many bytes of updated dense values come back in one ``Push`` answer (per PS) for the next step
READ_BACK_BYTES = 1 << 20

_local = threading.local()
_scope_lock = threading.Lock()
_scope_stack: list[Any] = []  # strategies, innermost last (scopes are process-wide, as in TF's default graph)


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
        self.registered: dict[str, RemoteHandle] = {}
        self.cache: dict[str, np.ndarray] = {}
        self._batched = False  # whether the registered variables were pulled since the last invalidation
        self.pulls = 0  # calls that pulled dense values (Read, or ReadMany carrying them); tests check batching

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
        return [var for key, var in self.registered.items() if var.prefetch and key not in self.cache]

    def store(self, keys: Sequence[str], arrays: Sequence[np.ndarray]) -> None:
        for key, array in zip(keys, arrays):
            self.cache[key] = array

    def read_back_keys(self, variables: Sequence[RemoteHandle]) -> list[str]:
        """Which of these pushed dense variables a ``Push`` should answer with (registered, prefetchable, within
        :data:`READ_BACK_BYTES` together)."""
        keys, budget = [], READ_BACK_BYTES
        for var in variables:
            known = self.registered.get(var.key)
            if known is None or not known.prefetch:
                continue
            size = int(np.prod(var.shape, dtype=np.int64)) * var.dtype.itemsize
            if size > budget:
                continue
            budget -= size
            keys.append(var.key)
        return keys

    def _pull(self, variables: list[RemoteHandle]) -> None:
        by_ps: dict[int, list[str]] = {}
        for var in variables:
            by_ps.setdefault(var.ps_index, []).append(var.key)
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
    from .data import InputContext  # noqa: PLC0415 - the input pipeline sits above this module

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
