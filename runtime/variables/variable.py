"""``Variable`` and ``ShardedVariable``, as in TensorFlow, with their values on parameter servers.

Inside ``strategy.scope()`` a ``Variable(...)`` lives on a parameter server (round-robin placement) and, with a
``variable_partitioner``, becomes a :class:`ShardedVariable` split along axis 0 with TF's "div" rule. Outside any
scope it is local (a numpy array in this process).

A remote variable pickles as a *handle* (name, shape, dtype, owning PS), never its value: that is how a scheduled
function carries it to a worker. On the worker the handle registers in the running closure's context, so all the
dense variables a step reads come from each PS in one RPC (see :class:`kubeps.runtime.variables.context.ClosureContext`).
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, Mapping, Sequence, TypeVar

import numpy as np

from kubeps.runtime.variables import context as _context
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.variables.partitioners import div_split, owner_of
from kubeps.runtime.rpc.protocol import PS, AssignOp, AssignRequest, NamesRequest, ReadManyRequest, slot_key
from kubeps.runtime.rpc.transport import DeclaredRequest, PSTransport
from kubeps.runtime.variables.slots import slots_for

__all__ = ["PendingLookup", "ShardedVariable", "Variable", "embedding_lookup", "gather_padded_rows", "gather_unique_rows",
           "start_lookup"]

AnswerT = TypeVar("AnswerT")


def _dtype(dtype: Any) -> np.dtype:
    try:
        return np.dtype(dtype)
    except TypeError:
        raise RuntimeConfigError("dtype", dtype, "must be a numpy dtype such as 'float32'") from None


#: the dtype kinds a variable may hold, what a parameter server stores and the wire carries: bool, signed and
#: unsigned integers, floats, complex
VALUE_KINDS = "biufc"
_KIND_WORDS = {"U": "strings", "S": "byte strings", "O": "Python objects", "V": "structured records",
               "M": "datetimes", "m": "timedeltas", "T": "strings"}


def variable_array(value: Any, dtype: Any, field: str = "initial_value") -> np.ndarray:
    """``value`` as a new array for a variable (of ``dtype`` when given); strings, objects and the like are refused
    naming the field, the dtype and what a variable may hold."""
    try:
        array = np.array(value, dtype=_dtype(dtype) if dtype is not None else None, copy=True)
    except (TypeError, ValueError) as err:
        raise RuntimeConfigError(field, type(value).__name__, f"must be array-like ({err})") from None
    if array.dtype.kind not in VALUE_KINDS:
        what = _KIND_WORDS.get(array.dtype.kind, "values of that kind")
        raise RuntimeConfigError(
            field, f"array of dtype {array.dtype.str!r} ({what})",
            "a variable holds bool, integer, float or complex numbers (bool, int8..int64, uint8..uint64, "
            "float16/32/64, complex64/128): encode strings as ids, e.g. with a vocabulary lookup",
        )
    return array


def value_for(value: Any, dtype: np.dtype, field: str, owner: str) -> np.ndarray:
    """``value`` (a gradient, an assigned value) as an array of the variable's ``dtype``, without a silent cast.

    An array or numpy scalar must already have that dtype, as in TensorFlow (a float64 gradient for a float32
    variable is an error, not a rounding); Python numbers and lists are converted when the kind allows it (``1`` into
    a float variable, never ``0.5`` into an integer one)."""
    given = getattr(value, "dtype", None)
    if given is not None:
        if np.dtype(given) != dtype:
            raise RuntimeConfigError(
                field, f"array of dtype {np.dtype(given).name}",
                f"must have variable {owner!r}'s dtype {dtype.name}; kubeps does not cast silently (TensorFlow "
                f"refuses too): convert it yourself, e.g. value.astype(np.{dtype.name})",
            )
        return np.asarray(value)
    array = np.asarray(value)
    if array.dtype.kind not in VALUE_KINDS or not np.can_cast(array.dtype, dtype, casting="same_kind"):
        raise RuntimeConfigError(field, value, f"must be convertible to variable {owner!r}'s dtype {dtype.name} "
                                               f"without changing its kind")
    return array.astype(dtype, copy=False)


def _binary(op, reflected: bool = False):
    def method(self, other):
        a = self.read_value()
        other = other.read_value() if isinstance(other, (Variable, ShardedVariable)) else other
        return op(other, a) if reflected else op(a, other)

    return method


class _ArrayLike:
    """Arithmetic on a variable reads its value (as TF's variables convert to tensors)."""

    __array_priority__ = 100

    def __array__(self, dtype=None, copy=None):
        value = self.read_value()
        return np.asarray(value, dtype=dtype) if dtype is not None else np.asarray(value)

    __add__ = _binary(operator.add)
    __radd__ = _binary(operator.add, True)
    __sub__ = _binary(operator.sub)
    __rsub__ = _binary(operator.sub, True)
    __mul__ = _binary(operator.mul)
    __rmul__ = _binary(operator.mul, True)
    __truediv__ = _binary(operator.truediv)
    __rtruediv__ = _binary(operator.truediv, True)
    __matmul__ = _binary(operator.matmul)
    __rmatmul__ = _binary(operator.matmul, True)
    __pow__ = _binary(operator.pow)

    def __neg__(self):
        return -self.read_value()

    def __getitem__(self, item):
        return self.read_value()[item]

    def numpy(self) -> np.ndarray:
        return np.asarray(self.read_value())

    # subclasses set _name, _shape and _dtype, and define read_value
    _name: str
    _shape: tuple[int, ...]
    _dtype: np.dtype
    if TYPE_CHECKING:
        def read_value(self) -> Any: ...

    @property
    def name(self) -> str:
        return self._name

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


class Variable(_ArrayLike):
    """A variable: ``Variable(initial_value, name=None, dtype=None, trainable=True)``.

    ``initial_value`` is array-like or a callable returning one. Inside ``strategy.scope()`` the result lives on a
    parameter server (and may be a :class:`ShardedVariable`); outside it is local to this process.
    """

    def __new__(cls, initial_value: Any = None, name: str | None = None, dtype: Any = None, trainable: bool = True,
                shape: Any = None):
        if initial_value is None:
            raise RuntimeConfigError("initial_value", None, "a Variable needs an initial value (array-like or callable)")
        if name is not None and (not isinstance(name, str) or not name or ":" in name):
            raise RuntimeConfigError("name", name, "must be a non-empty string without ':'")
        if not isinstance(trainable, bool):
            raise RuntimeConfigError("trainable", trainable, "must be True or False")
        strategy = _context.current_strategy()
        if strategy is not None:
            return strategy.create_variable(initial_value, name=name, dtype=dtype, trainable=trainable, shape=shape)
        value = initial_value() if callable(initial_value) else initial_value
        array = variable_array(value, dtype)
        if shape is not None and tuple(array.shape) != tuple(shape):
            raise RuntimeConfigError("shape", shape, f"the initial value has shape {list(array.shape)}")
        return cls._local_variable(name or "Variable", array, trainable)

    def __init__(self, *args: Any, **kwargs: Any):
        pass  # everything happens in __new__ (which may return a ShardedVariable)

    # -- internal constructors -----------------------------------------------------------------------------------
    @classmethod
    def _local_variable(cls, name: str, array: np.ndarray, trainable: bool) -> "Variable":
        var = object.__new__(cls)
        var._init(name, name, tuple(array.shape), array.dtype, trainable)
        var._local = array
        return var

    @classmethod
    def remote_handle(cls, name: str, key: str, shape: tuple[int, ...], dtype: np.dtype, trainable: bool,
                      ps_index: int, transport: Any, prefetch: bool = True, staleness: int = 0) -> "Variable":
        """A handle to variable ``key`` on parameter server ``ps_index`` (the strategy creates the variable there;
        unpickling a handle on a worker makes one too)."""
        var = object.__new__(cls)
        var._init(name, key, shape, dtype, trainable)
        var._ps_index = ps_index
        var._transport = transport
        var._prefetch = prefetch
        var._staleness = staleness
        return var

    def _init(self, name: str, key: str, shape: tuple[int, ...], dtype: np.dtype, trainable: bool) -> None:
        self._name = name
        self._key = key  # unique name on its parameter server
        self._shape = tuple(int(d) for d in shape)
        self._dtype = np.dtype(dtype)
        self.trainable = trainable
        self._local: np.ndarray | None = None
        self._ps_index: int | None = None
        self._transport: Any = None
        self._prefetch = True
        self._staleness = 0
        #: optimizer class -> slot arrays, as a ps keeps them (``variables.slots``)
        self._local_slots: dict[str, dict[str, np.ndarray]] = {}
        self._local_updates = 0

    # -- properties --------------------------------------------------------------------------------------------
    # ``key``, ``ps_index`` and ``prefetch`` are the closure context's view of a remote variable
    # (:class:`kubeps.runtime.variables.context.RemoteHandle`).
    @property
    def key(self) -> str:
        """The variable's unique name on its parameter server (``name`` may repeat; shards are ``name/part_i``)."""
        return self._key

    @property
    def ps_index(self) -> int | None:
        """The index of the parameter server holding the variable, or None for a local variable."""
        return self._ps_index

    @property
    def prefetch(self) -> bool:
        """Whether a scheduled function's batched pull fetches this variable (dense variables; not embedding
        tables, whose rows are looked up)."""
        return self._prefetch

    @property
    def staleness(self) -> int:
        """How many of a worker's later steps may reuse a value of this variable pulled in one step (0: pulled every
        step; ``ParameterServerStrategy(dense_staleness=...)``)."""
        return self._staleness

    @property
    def is_remote(self) -> bool:
        return self._ps_index is not None

    @property
    def device(self) -> str:
        if self._ps_index is None:
            return ""
        return f"/job:ps/replica:0/task:{self._ps_index}/device:CPU:0"

    def __repr__(self) -> str:
        where = f" device={self.device!r}" if self.is_remote else ""
        return f"<kubeps.Variable {self._name!r} shape={self._shape} dtype={self._dtype.name}{where}>"

    # -- values ------------------------------------------------------------------------------------------------
    def _require_transport(self):
        if self._transport is None:
            raise RuntimeError(
                f"variable {self._name!r} is a handle to /job:ps/task:{self._ps_index} but this process has no "
                "connection to the parameter servers (handles work on the coordinator and inside scheduled functions)"
            )
        return self._transport

    @property
    def transport(self) -> Any:
        """The connection to the parameter servers this handle uses (raises where this process has none)."""
        return self._require_transport()

    # -- a local variable's in-process state: the optimizer push updates it, checkpoints copy and load it --------
    def apply_local_update(self, optimizer: Any, grad: Any) -> None:
        """Apply a dense gradient, or a row-sparse ``(indices, values)`` pair, to this local variable with
        ``optimizer``, whose slots it keeps by optimizer class, as a parameter server does."""
        slots = slots_for(self._local_slots, slot_key(optimizer.get_config()), optimizer, self._local, self._name)
        self._local_updates += 1
        if isinstance(grad, tuple):
            optimizer.apply_sparse(self._local, grad[0], grad[1], slots, self._local_updates)
        else:
            optimizer.apply_dense(self._local, grad, slots, self._local_updates)

    def local_state(self) -> tuple[np.ndarray, dict[str, dict[str, np.ndarray]], int]:
        """The live value array, its slots (``{optimizer class: {slot: array}}``, live) and the update count."""
        if self._local is None:
            raise RuntimeError(f"variable {self._name!r} lives on a parameter server: it has no local state")
        return self._local, self._local_slots, self._local_updates

    def set_local_updates(self, updates: int) -> None:
        """Set the update count of a local variable (a checkpoint restores it; the next update is ``updates + 1``)."""
        self._local_updates = int(updates)

    def read_value(self) -> np.ndarray:
        if self._local is not None:
            return self._local.copy()
        ctx = _context.current_closure_context()
        if ctx is not None and ctx.transport is self._transport:
            return ctx.read([self])[0]
        _, arrays = self._require_transport().call(self._ps_index, PS.READ, NamesRequest(names=[self._key]))
        return arrays[0]

    def value(self) -> np.ndarray:
        return self.read_value()

    def _write(self, op: AssignOp, value: Any) -> "Variable":
        array = value_for(value, self._dtype, "value", self._name)
        if array.shape != self._shape:
            raise RuntimeConfigError("value", f"array of shape {list(array.shape)}",
                                     f"variable {self._name!r} has shape {list(self._shape)}")
        if self._local is not None:
            if op == "assign":
                self._local[...] = array
            else:
                self._local += array
            return self
        assert self._ps_index is not None, "a variable is local or on a parameter server"
        _calls(self._require_transport(), {self._ps_index: (PS.ASSIGN, AssignRequest(names=[self._key], ops=[op]), [array])})
        ctx = _context.current_closure_context()
        if ctx is not None:
            ctx.invalidate([self._key])
            ctx.wrote()
        return self

    def assign(self, value: Any) -> "Variable":
        return self._write("assign", value)

    def assign_add(self, delta: Any) -> "Variable":
        return self._write("add", delta)

    def assign_sub(self, delta: Any) -> "Variable":
        return self._write("add", -value_for(delta, self._dtype, "delta", self._name))

    # -- pickling: remote variables travel as handles -----------------------------------------------------------
    def __reduce__(self):
        if self._local is not None:
            return (_rebuild_local, (self._name, self._local, self.trainable))
        return (_rebuild_handle, (self._name, self._key, self._shape, self._dtype.str, self.trainable,
                                  self._ps_index, self._prefetch, self._staleness))


def _rebuild_local(name: str, value: np.ndarray, trainable: bool) -> Variable:
    return Variable._local_variable(name, np.array(value, copy=True), trainable)


def _rebuild_handle(name: str, key: str, shape: tuple, dtype: str, trainable: bool, ps_index: int,
                    prefetch: bool, staleness: int = 0) -> Variable:
    ctx = _context.current_closure_context()
    transport = ctx.transport if ctx is not None else None
    var = Variable.remote_handle(name, key, shape, np.dtype(dtype), trainable, ps_index, transport, prefetch,
                                 staleness)
    if ctx is not None:
        ctx.register(var)
    return var


class ShardedVariable(_ArrayLike):
    """A variable split along axis 0 into ``variables`` (named ``name/part_i``), TF's "div" split."""

    def __init__(self, variables: Sequence[Variable], name: str | None = None):
        variables = list(variables)
        if not variables:
            raise RuntimeConfigError("variables", variables, "a ShardedVariable needs at least one shard")
        first = variables[0]
        for i, v in enumerate(variables):
            if not isinstance(v, Variable):
                raise RuntimeConfigError(f"variables[{i}]", v, "every shard must be a Variable")
            if v.dtype != first.dtype or v.shape[1:] != first.shape[1:] or len(v.shape) == 0:
                raise RuntimeConfigError(
                    f"variables[{i}]", v, f"shards must share dtype {first.dtype} and inner shape {first.shape[1:]}"
                )
        rows = sum(v.shape[0] for v in variables)
        expected = [stop - start for start, stop in div_split(rows, len(variables))]
        actual = [v.shape[0] for v in variables]
        if actual != expected:
            raise RuntimeConfigError("variables", actual, f"shard row counts must follow the div split {expected}")
        self._variables = variables
        self._name = name or first.name.rsplit("/part_", 1)[0]
        self._shape = (rows,) + tuple(first.shape[1:])
        self._dtype = first.dtype
        self.trainable = first.trainable
        self._offsets = [start for start, _ in div_split(rows, len(variables))] + [rows]

    @property
    def variables(self) -> list[Variable]:
        return list(self._variables)

    @property
    def num_shards(self) -> int:
        return len(self._variables)

    def __repr__(self) -> str:
        return (f"<kubeps.ShardedVariable {self._name!r} shape={self._shape} dtype={self._dtype.name} "
                f"shards={self.num_shards}>")

    def __iter__(self):
        return iter(self._variables)

    def shard_rows(self) -> list[tuple[int, int]]:
        """``(start, stop)`` of every shard along axis 0."""
        return list(zip(self._offsets[:-1], self._offsets[1:]))

    def read_value(self) -> np.ndarray:
        """The whole variable, concatenated (expensive: pulls every shard, one RPC per parameter server)."""
        return np.concatenate(_read_many(self._variables), axis=0)

    def value(self) -> np.ndarray:
        return self.read_value()

    def _write(self, op: AssignOp, value: Any) -> "ShardedVariable":
        array = value_for(value, self._dtype, "value", self._name)
        if array.shape != self._shape:
            raise RuntimeConfigError("value", f"array of shape {list(array.shape)}",
                                     f"variable {self._name!r} has shape {list(self._shape)}")
        parts = [array[a:b] for a, b in self.shard_rows()]
        _write_many(self._variables, parts, op)
        return self

    def assign(self, value: Any) -> "ShardedVariable":
        return self._write("assign", value)

    def assign_add(self, delta: Any) -> "ShardedVariable":
        return self._write("add", delta)

    def assign_sub(self, delta: Any) -> "ShardedVariable":
        return self._write("add", -value_for(delta, self._dtype, "delta", self._name))


def _calls(transport: PSTransport, requests: Mapping[int, DeclaredRequest[AnswerT]]
           ) -> dict[int, tuple[AnswerT, list[np.ndarray]]]:
    """Calls to parameter servers: inside a scheduled function through its closure context, which lets a read
    carry the closure's deferred push and keeps every other call behind it; elsewhere straight to the transport."""
    ctx = _context.current_closure_context()
    if ctx is not None and ctx.transport is transport:
        return ctx.call_many(requests)
    return transport.call_many(requests)


def _group_remote(variables: Sequence[Variable]) -> tuple[Any, dict[int, list[int]]]:
    """Positions of remote variables per parameter server (they must share one transport)."""
    transport = None
    by_ps: dict[int, list[int]] = {}
    for i, v in enumerate(variables):
        if v._local is not None:
            continue
        assert v._ps_index is not None, "a variable is local or on a parameter server"
        transport = transport or v._require_transport()
        by_ps.setdefault(v._ps_index, []).append(i)
    return transport, by_ps


def _read_many(variables: Sequence[Variable]) -> list[np.ndarray]:
    """Values of many variables: local ones copied, remote ones with one Read per parameter server, in parallel."""
    out: list[Any] = [v._local.copy() if v._local is not None else None for v in variables]
    remote = [v for v in variables if v._local is None]
    if not remote:
        return out
    ctx = _context.current_closure_context()
    if ctx is not None and all(v._transport is ctx.transport for v in remote):
        values = iter(ctx.read(remote))
        return [o if o is not None else next(values) for o in out]
    transport, by_ps = _group_remote(variables)
    results = transport.call_many(
        {ps: (PS.READ, NamesRequest(names=[variables[i]._key for i in idx]), ()) for ps, idx in by_ps.items()}
    )
    for ps, idx in by_ps.items():
        for i, array in zip(idx, results[ps][1]):
            out[i] = array
    return out


def _write_many(variables: Sequence[Variable], values: Sequence[np.ndarray], op: AssignOp) -> None:
    for v, value in zip(variables, values):
        if v._local is not None:
            v._write(op, value)
    transport, by_ps = _group_remote(variables)
    if by_ps:
        _calls(transport, {
            ps: (PS.ASSIGN, AssignRequest(names=[variables[i]._key for i in idx], ops=[op] * len(idx)),
                 [values[i] for i in idx])
            for ps, idx in by_ps.items()
        })
        ctx = _context.current_closure_context()
        if ctx is not None:
            ctx.invalidate([variables[i]._key for idx in by_ps.values() for i in idx])


def _check_ids(ids: Any, rows: int, name: str) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        raise RuntimeConfigError("ids", f"array of dtype {arr.dtype}", "embedding ids must be integers")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= rows):
        bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
        raise RuntimeConfigError("ids", bad, f"ids must be in [0, {rows}) for {name!r}")
    return arr.astype(np.int64, copy=False)


def embedding_lookup(params: Variable | ShardedVariable, ids: Any) -> np.ndarray:
    """Rows ``params[ids]``, fetching only the requested rows (deduplicated) from the shards that own them.

    Remote shards are read with one ``ReadRows`` call per parameter server, all in parallel; the result has shape
    ``ids.shape + params.shape[1:]``. Inside a scheduled function, when the batched pull of the registered dense
    variables is still due, it rides on these calls (``ReadMany``, one per PS) instead of costing calls of its own.
    """
    ids_arr, unique, inverse, rows = gather_unique_rows(params, ids)
    return np.take(rows, inverse, axis=0).reshape(ids_arr.shape + tuple(params.shape[1:]))  # (take: 2.5x rows[inverse])


def gather_unique_rows(params: Variable | ShardedVariable,
                       ids: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What :func:`embedding_lookup` reads, before it expands duplicates: ``(ids, unique, inverse, rows)`` with
    ``rows[i] = params[unique[i]]`` and ``params[ids] = rows[inverse].reshape(...)``. A gradient with respect to
    ``rows`` is the row-sparse gradient of ``params`` over ``unique`` (what autodiff on the workers pushes)."""
    lookup = _RowLookup(params, ids, pipelined=False)
    return lookup.finish(lookup.send())


def gather_padded_rows(params: Variable | ShardedVariable, ids: Any,
                       padding: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What a jitted step on a worker takes for a table: ``(unique, inverse, rows)`` with ``rows`` the unique ids'
    rows (:func:`gather_unique_rows`) padded with zeros to one row per id (at least one), so the compiled function
    sees one shape whatever the number of distinct ids, and ``inverse`` (int32, shaped as ``ids``) indexing them.
    The gradient of ``rows[: unique.size]`` is the table's row-sparse gradient over ``unique``.

    With ``padding``, an id of -1 marks an empty position of a multi-hot feature: it is not pulled, not in
    ``unique``, and its ``inverse`` points to a zero row (``rows[unique.size]``)."""
    arr = np.asarray(ids)
    real = arr != -1 if padding and arr.dtype.kind == "i" else None
    ids_arr, unique, inverse, gathered = gather_unique_rows(params, arr if real is None else arr[real])
    rows = np.empty((max(arr.size, 1),) + tuple(params.shape[1:]), dtype=params.dtype)
    rows[: unique.size] = gathered
    rows[unique.size:] = 0
    if real is None:
        return unique, inverse.reshape(ids_arr.shape).astype(np.int32), rows
    full = np.full(arr.shape, unique.size, dtype=np.int32)
    full[real] = inverse.reshape(-1)
    return unique, full, rows


class PendingLookup:
    """A lookup :func:`start_lookup` sent from a background thread; :meth:`result` waits for it."""

    def __init__(self, lookup: "_RowLookup", future: Any) -> None:
        self._lookup, self._future = lookup, future

    def result(self) -> np.ndarray:
        """``params[ids]`` (shape ``ids.shape + row shape``); inside a scheduled function the dense values pulled
        with it become the closure's values for the step that takes them."""
        _, _, inverse, rows = self._lookup.finish(self._future.result())
        return np.take(rows, inverse, axis=0).reshape(self._lookup.ids.shape + tuple(self._lookup.params.shape[1:]))


_lookup_pool: Any = None


def start_lookup(params: Variable | ShardedVariable, ids: Any) -> PendingLookup:
    """Start :func:`embedding_lookup` of ``ids`` -- the *next* step's -- and return at once; the calls go out from a
    background thread while this step computes.

    Inside a scheduled function the calls also pull every dense variable of the closure and carry this worker's
    deferred push (``PushRead``): one call per parameter server, as a step without overlap makes. The step that takes
    the result (:meth:`PendingLookup.result`) computes on values read before the push of the step that ran
    meanwhile -- one step stale, as between TF's asynchronous workers. Take the result before the next push (at the
    start of the next step); at most one lookup of a closure is in flight."""
    global _lookup_pool
    lookup = _RowLookup(params, ids, pipelined=True)
    if _lookup_pool is None:
        from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415 - only an overlapping worker needs it

        _lookup_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kubeps-lookup")
    return PendingLookup(lookup, _lookup_pool.submit(lookup.send))


class _RowLookup:
    """One lookup of rows in three steps: plan (the calls, in the calling thread, which takes the closure's
    deferred pushes), send (the calls, from any thread), finish (the rows and the dense values, in the calling
    thread)."""

    def __init__(self, params: Variable | ShardedVariable, ids: Any, pipelined: bool) -> None:
        if not isinstance(params, (Variable, ShardedVariable)):
            raise RuntimeConfigError("params", type(params).__name__, "must be a Variable or ShardedVariable")
        if len(params.shape) == 0:
            raise RuntimeConfigError("params", params.name, "embedding_lookup needs a variable of rank >= 1")
        self.params = params
        self.pipelined = pipelined
        self.ids = _check_ids(ids, params.shape[0], params.name)
        self.unique, self.inverse = np.unique(self.ids.reshape(-1), return_inverse=True)
        shards = params.variables if isinstance(params, ShardedVariable) else [params]
        self.shards = shards
        if len(shards) == 1:
            shard_of, local = np.zeros_like(self.unique), self.unique
        else:
            shard_of, local = owner_of(self.unique, params.shape[0], len(shards))
        self.rows = np.empty((self.unique.size,) + tuple(params.shape[1:]), dtype=params.dtype)
        self.requests: dict[int, list[tuple[int, np.ndarray]]] = {}  # ps -> [(shard, positions)]
        self.ctx = _context.current_closure_context()
        transport = None
        for s, var in enumerate(shards):
            positions = np.nonzero(shard_of == s)[0]
            if positions.size == 0:
                continue
            if var._local is not None:
                self.rows[positions] = var._local[local[positions]]
                continue
            if not pipelined and self.ctx is not None and var._key in self.ctx.cache:
                self.rows[positions] = self.ctx.cache[var._key][local[positions]]
                continue
            transport = transport or var._require_transport()
            assert var._ps_index is not None, "a variable is local or on a parameter server"
            self.requests.setdefault(var._ps_index, []).append((s, positions))
        self.transport: Any = transport
        self.dense: dict[int, list[str]] = {}  # a batched pull rides on these calls (ReadMany)
        self.calls: dict[int, tuple[str, Mapping[str, Any], Sequence[Any]]] = {}
        if not self.requests:
            return
        ctx = self.ctx if self.ctx is not None and self.ctx.transport is transport else None
        self.ctx = ctx
        if ctx is not None:
            ctx.note_rows([var._key for var in shards])  # a table: its rows are looked up, never pulled whole
            handles = ctx.prefetch_handles() if pipelined else ctx.take_prefetch()
            for handle in handles:
                assert handle.ps_index is not None, "the closure context registers remote variables only"
                self.dense.setdefault(handle.ps_index, []).append(handle.key)
        calls: dict[int, tuple[str, Mapping[str, Any], Sequence[Any]]] = {}
        for ps in sorted(set(self.requests) | set(self.dense)):
            items = self.requests.get(ps, [])
            rows_names = [shards[s]._key for s, _ in items]
            indices = [local[pos] for _, pos in items]
            if ps in self.dense:
                calls[ps] = (PS.READ_MANY, ReadManyRequest(names=self.dense[ps], rows=rows_names), indices)
            else:
                calls[ps] = (PS.READ_ROWS, NamesRequest(names=rows_names), indices)
        self.calls = ctx.carry_pushes(calls) if ctx is not None else calls

    def send(self) -> dict[int, Any]:
        if not self.calls:
            return {}
        assert self.transport is not None, "calls are planned for remote shards, which have a transport"
        return self.transport.call_many(self.calls)

    def finish(self, results: Mapping[int, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        for ps, (_, arrays) in results.items():
            values = self.dense.get(ps, [])
            if values:
                assert self.ctx is not None, "dense is only filled from the closure context"
                if self.pipelined:
                    self.ctx.store_pulled(values, arrays[: len(values)])
                else:
                    self.ctx.store(values, arrays[: len(values)])
                    self.ctx.pulls += 1
            for (_, positions), block in zip(self.requests.get(ps, []), arrays[len(values):]):
                _set_positions(self.rows, positions, block)
        return self.ids, self.unique, self.inverse, self.rows


def _set_positions(rows: np.ndarray, positions: np.ndarray, block: np.ndarray) -> None:
    """``rows[positions] = block`` for ascending ``positions``; one slice copy when they are consecutive (a shard of
    a range-partitioned table holds a run of the sorted unique ids), 25x faster than the fancy-index assignment."""
    if positions.size and int(positions[-1]) - int(positions[0]) + 1 == positions.size:
        rows[int(positions[0]) : int(positions[-1]) + 1] = block
    else:
        rows[positions] = block
