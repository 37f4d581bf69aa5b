"""The state of one parameter server, as a plain object (no sockets): variables, per-variable locks, optimizers,
slot variables and update counters.

Concurrency: every variable (a shard of a sharded variable is a variable of its own) has its own lock. Pushes to one
variable are applied one after another (no lost updates); pushes to different variables run in parallel. Reads copy
under the lock, so a reader never sees a half-applied update.

The gRPC methods of the parameter-server service are the functions in :data:`BUILTIN_METHODS`; each takes
``(state, meta, arrays)`` and returns ``(meta, arrays)``. :func:`kubeps.runtime.server.register_ps_method` adds more.
"""

from __future__ import annotations

import json
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .errors import RuntimeConfigError

__all__ = [
    "BUILTIN_METHODS",
    "ParameterServerState",
    "PSVariable",
    "UnknownVariableError",
    "optimizer_key",
]


class UnknownVariableError(KeyError):
    """The parameter server holds no variable of that name (servers answer NOT_FOUND)."""

    def __str__(self) -> str:  # KeyError's str() is the repr of its argument
        return str(self.args[0]) if self.args else "unknown variable"


@dataclass
class PSVariable:
    """One variable held by a parameter server, with its optimizer state."""

    name: str
    value: np.ndarray
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: optimizer config key -> slot arrays (created on the first push with that optimizer)
    slots: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    #: number of optimizer updates applied so far (the ``step`` the next update sees is ``updates + 1``)
    updates: int = 0


def optimizer_key(config: dict[str, Any]) -> str:
    """The key a variable's slots are kept under: the optimizer's config as canonical JSON (checkpoints of local
    variables key their slots the same way)."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def _default_optimizer_factory(config: dict[str, Any]):
    from .optimizers import optimizer_from_config  # noqa: PLC0415 - loaded on the first push, not at start

    return optimizer_from_config(config)


class ParameterServerState:
    """Everything one parameter server holds."""

    def __init__(self, optimizer_factory: Callable[[dict[str, Any]], Any] | None = None):
        self.variables: dict[str, PSVariable] = {}
        self._lock = threading.Lock()  # guards the dict itself, never held during math
        self._optimizer_factory = optimizer_factory or _default_optimizer_factory
        self._optimizers: dict[str, Any] = {}
        #: random id of this state, i.e. of this process start: a restarted parameter server comes back empty
        #: with a new one (``Ping`` and ``CreateVariables`` answer it; the coordinator compares)
        self.incarnation = uuid.uuid4().hex

    # -- variables ---------------------------------------------------------------------------------------------
    def create(self, name: str, value: np.ndarray) -> PSVariable:
        """Create (or re-create, resetting optimizer state: a restarted coordinator does that) a variable."""
        if not isinstance(name, str) or not name:
            raise RuntimeConfigError("name", name, "a variable name must be a non-empty string")
        array = np.array(value, copy=True, order="C")
        var = PSVariable(name=name, value=array)
        with self._lock:
            self.variables[name] = var
        return var

    def get(self, name: str) -> PSVariable:
        try:
            return self.variables[name]
        except KeyError:
            known = sorted(self.variables)
            shown = known[:10] + (["..."] if len(known) > 10 else [])
            raise UnknownVariableError(
                f"no variable named {name!r} on this parameter server; it holds {shown}"
            ) from None

    def names(self) -> list[str]:
        with self._lock:
            return list(self.variables)

    def read(self, name: str) -> np.ndarray:
        var = self.get(name)
        with var.lock:
            return var.value.copy()

    def read_rows(self, name: str, indices: np.ndarray) -> np.ndarray:
        var = self.get(name)
        idx = self._check_rows(var, indices, "indices")
        with var.lock:
            return var.value[idx]

    def assign(self, name: str, value: np.ndarray) -> None:
        var = self.get(name)
        value = self._check_like(var, value, "value")
        with var.lock:
            var.value[...] = value

    def assign_add(self, name: str, delta: np.ndarray) -> None:
        var = self.get(name)
        delta = self._check_like(var, delta, "delta")
        with var.lock:
            var.value += delta

    # -- optimizer updates -------------------------------------------------------------------------------------
    def optimizer(self, config: dict[str, Any]):
        key = optimizer_key(config)
        opt = self._optimizers.get(key)
        if opt is None:
            opt = self._optimizer_factory(config)
            with self._lock:
                opt = self._optimizers.setdefault(key, opt)
        return key, opt

    def apply_dense(self, name: str, config: dict[str, Any], grad: np.ndarray) -> int:
        """Apply a dense gradient with the optimizer ``config`` describes; returns the variable's update count."""
        return self.push(config, [("dense", name, grad)])[0]

    def apply_sparse(self, name: str, config: dict[str, Any], indices: np.ndarray, values: np.ndarray) -> int:
        """Apply a row-sparse gradient (local row ids, duplicates allowed); returns the update count."""
        return self.push(config, [("sparse", name, indices, values)])[0]

    def push(self, config: dict[str, Any], updates: list[tuple]) -> list[int]:
        """Apply ``("dense", name, grad)`` and ``("sparse", name, indices, values)`` updates with one optimizer.

        Every update is checked (variable, shapes, rows, the optimizer config) before the first is applied, so a
        malformed push changes nothing. Returns each variable's update count after its update."""
        key, opt = self.optimizer(config)
        checked = []
        for kind, name, *arrays in updates:
            var = self.get(name)
            if kind == "dense":
                checked.append((var, None, self._check_like(var, arrays[0], "grad")))
                continue
            idx = self._check_rows(var, arrays[0], "indices")
            values = np.asarray(arrays[1])
            expected = (idx.shape[0],) + var.value.shape[1:]
            if values.shape != expected:
                raise ValueError(
                    f"sparse gradient for {name!r}: 'values' has shape {list(values.shape)}, expected "
                    f"{list(expected)} (one row per index, rows shaped like the variable's {list(var.value.shape[1:])})"
                )
            checked.append((var, idx, values.astype(var.value.dtype, copy=False)))
        steps = []
        for var, idx, grad in checked:
            with var.lock:
                slots = self._slots(var, key, opt)
                var.updates += 1
                if idx is None:
                    opt.apply_dense(var.value, grad, slots, var.updates)
                else:
                    opt.apply_sparse(var.value, idx, grad, slots, var.updates)
                steps.append(var.updates)
        return steps

    def check_reads(self, names: list[str], rows: list[str], indices: list) -> None:
        """Refuse a read of unknown variables or rows before anything else of the call happens."""
        for name in names:
            self.get(name)
        for name, idx in zip(rows, indices):
            self._check_rows(self.get(name), idx, "indices")

    @staticmethod
    def _slots(var: PSVariable, key: str, opt) -> dict[str, np.ndarray]:
        slots = var.slots.get(key)
        if slots is None:
            slots = var.slots[key] = opt.init_slots(var.value)
        return slots

    # -- checkpoints: one variable with its optimizer state, copied out or loaded back under its lock ----------
    def describe(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
        """Shape and dtype of variable ``name``."""
        var = self.get(name)
        return var.value.shape, var.value.dtype

    def snapshot(self, name: str) -> tuple[np.ndarray, dict[str, dict[str, np.ndarray]], int]:
        """A consistent copy of variable ``name``: ``(value, {optimizer key: {slot: array}}, updates)``."""
        var = self.get(name)
        with var.lock:
            slots = {okey: {s: np.array(a, copy=True) for s, a in group.items()} for okey, group in var.slots.items()}
            return var.value.copy(), slots, var.updates

    def load(self, name: str, value: np.ndarray, slots: dict[str, dict[str, np.ndarray]] | None,
             updates: int | None) -> None:
        """Overwrite variable ``name``'s value in place and, when given, its slots and update count."""
        var = self.get(name)
        with var.lock:
            var.value[...] = value
            if slots is not None:
                var.slots = {okey: dict(group) for okey, group in slots.items()}
            if updates is not None:
                var.updates = int(updates)

    # -- checks ------------------------------------------------------------------------------------------------
    @staticmethod
    def _check_like(var: PSVariable, value: np.ndarray, what: str) -> np.ndarray:
        value = np.asarray(value)
        if value.shape != var.value.shape:
            raise ValueError(
                f"{what} for variable {var.name!r} has shape {list(value.shape)}; the variable's shape is "
                f"{list(var.value.shape)}"
            )
        if value.dtype != var.value.dtype:
            if not np.can_cast(value.dtype, var.value.dtype, casting="same_kind"):
                raise ValueError(
                    f"{what} for variable {var.name!r} has dtype {value.dtype}; the variable is {var.value.dtype}"
                )
            value = value.astype(var.value.dtype)
        return value

    @staticmethod
    def _check_rows(var: PSVariable, indices: np.ndarray, what: str) -> np.ndarray:
        idx = np.asarray(indices)
        if var.value.ndim == 0:
            raise ValueError(f"variable {var.name!r} is a scalar; row access needs rank >= 1")
        if idx.ndim != 1 or idx.dtype.kind not in "iu":
            raise ValueError(f"{what} for {var.name!r} must be a 1-D integer array, got {idx.dtype} shape {list(idx.shape)}")
        rows = var.value.shape[0]
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= rows):
            bad = int(idx.min()) if int(idx.min()) < 0 else int(idx.max())
            raise ValueError(f"{what} for {var.name!r} holds row {bad}; the variable has rows 0..{rows - 1}")
        return idx.astype(np.int64, copy=False)


# -- the parameter-server service's methods ----------------------------------------------------------------------
Meta = dict[str, Any]


def _names(meta: Meta, key: str = "names") -> list[str]:
    names = meta.get(key)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"field '{key}' must be a list of variable names, got {names!r}")
    return names


def _expect_arrays(method: str, arrays: list, count: int) -> None:
    if len(arrays) != count:
        raise ValueError(f"{method}: field 'tensors' holds {len(arrays)} tensor(s), expected {count}")


def rpc_create_variables(state: ParameterServerState, meta: Meta, arrays: list) -> tuple[Meta, list]:
    names = _names(meta)
    _expect_arrays("CreateVariables", arrays, len(names))
    for name, value in zip(names, arrays):
        state.create(name, value)
    return {"created": len(names), "incarnation": state.incarnation}, []


def rpc_read(state: ParameterServerState, meta: Meta, arrays: list) -> tuple[Meta, list]:  # noqa: ARG001
    return {}, [state.read(n) for n in _names(meta)]


def rpc_read_rows(state: ParameterServerState, meta: Meta, arrays: list) -> tuple[Meta, list]:
    names = _names(meta)
    _expect_arrays("ReadRows", arrays, len(names))
    return {}, [state.read_rows(n, idx) for n, idx in zip(names, arrays)]


def rpc_read_many(state: ParameterServerState, meta: Meta, arrays: list) -> tuple[Meta, list]:
    """``Read`` and ``ReadRows`` in one call: whole values of ``names``, then the rows of ``rows`` (one int index
    array per name in ``rows``); the answer lists the values, then the row blocks, in that order."""
    names = _names(meta)
    rows = _names(meta, "rows") if "rows" in meta else []
    _expect_arrays("ReadMany", arrays, len(rows))
    return {}, [state.read(n) for n in names] + [state.read_rows(n, idx) for n, idx in zip(rows, arrays)]


def rpc_assign(state: ParameterServerState, meta: Meta, arrays: list) -> tuple[Meta, list]:
    names = _names(meta)
    ops = meta.get("ops", ["assign"] * len(names))
    if not isinstance(ops, list) or len(ops) != len(names) or not set(ops) <= {"assign", "add"}:
        raise ValueError(f"field 'ops' must list 'assign' or 'add' for each of {len(names)} names, got {ops!r}")
    _expect_arrays("Assign", arrays, len(names))
    for name, op, value in zip(names, ops, arrays):
        (state.assign if op == "assign" else state.assign_add)(name, value)
    return {}, []


def _push_array_count(updates: Any) -> int:
    """Tensors a push's ``updates`` use: one per dense update, two (indices, values) per sparse one."""
    if not isinstance(updates, list):
        return 0  # rpc_push refuses it, naming the field
    return sum(2 if isinstance(u, dict) and u.get("kind") == "sparse" else 1 for u in updates)


def _push_updates(meta: Meta, arrays: list) -> tuple[dict[str, Any], list[tuple]]:
    """The optimizer config and the ``(kind, name, *tensors)`` updates of a ``Push`` request."""
    config = meta.get("optimizer")
    if not isinstance(config, dict):
        raise ValueError(f"field 'optimizer' must be an optimizer config object, got {config!r}")
    updates = meta.get("updates")
    if not isinstance(updates, list):
        raise ValueError(f"field 'updates' must be a list, got {updates!r}")
    _expect_arrays("Push", arrays, _push_array_count(updates))
    out = []
    pos = 0
    for i, update in enumerate(updates):
        if not isinstance(update, dict) or not isinstance(update.get("name"), str):
            raise ValueError(f"field 'updates[{i}]' must be an object with a 'name', got {update!r}")
        kind = update.get("kind", "dense")
        if kind not in ("dense", "sparse"):
            raise ValueError(f"field 'updates[{i}].kind' has value {kind!r}: allowed are 'dense' and 'sparse'")
        width = 2 if kind == "sparse" else 1
        out.append((kind, update["name"], *arrays[pos : pos + width]))
        pos += width
    return config, out


def _push_array_count(updates: Any) -> int:
    """Tensors a push's ``updates`` use: one per dense update, two (indices, values) per sparse one."""
    if not isinstance(updates, list):
        return 0  # _push_updates refuses it, naming the field
    return sum(2 if isinstance(u, dict) and u.get("kind") == "sparse" else 1 for u in updates)


def rpc_push(state: ParameterServerState, meta: Meta, arrays: list) -> tuple[Meta, list]:
    """Apply gradients to many variables with one optimizer: dense ``[grad]`` or sparse ``[indices, values]``
    (all checked before any is applied)."""
    config, updates = _push_updates(meta, arrays)
    return {"steps": state.push(config, updates)}, []


def rpc_push_read(state: ParameterServerState, meta: Meta, arrays: list) -> tuple[Meta, list]:
    """``Push`` then ``ReadMany`` in one call: a worker's step pushes its gradients with the next step's reads.

    ``meta`` holds the push's ``optimizer`` and ``updates`` and the read's ``names`` and ``rows``; ``arrays`` the
    push's tensors, then one index array per name in ``rows``. The whole request is checked first (nothing is
    applied if any of it is malformed); every update is applied before anything is read, so the answer (the values
    of ``names``, then the row blocks) includes this push."""
    needed = _push_array_count(meta.get("updates"))
    config, updates = _push_updates(meta, arrays[:needed])
    names = _names(meta)
    rows = _names(meta, "rows") if "rows" in meta else []
    indices = arrays[needed:]
    _expect_arrays("ReadMany", indices, len(rows))
    state.check_reads(names, rows, indices)
    steps = state.push(config, updates)
    return {"steps": steps}, [state.read(n) for n in names] + [state.read_rows(n, i) for n, i in zip(rows, indices)]


def rpc_list_variables(state: ParameterServerState, meta: Meta, arrays: list) -> tuple[Meta, list]:  # noqa: ARG001
    out = []
    for name in state.names():
        var = state.variables[name]
        out.append({"name": name, "shape": list(var.value.shape), "dtype": var.value.dtype.name,
                    "updates": var.updates})
    return {"variables": out}, []


BUILTIN_METHODS: dict[str, Callable[[ParameterServerState, Meta, list], tuple[Meta, list]]] = {
    "CreateVariables": rpc_create_variables,
    "Read": rpc_read,
    "ReadRows": rpc_read_rows,
    "ReadMany": rpc_read_many,
    "Assign": rpc_assign,
    "Push": rpc_push,
    "PushRead": rpc_push_read,
    "ListVariables": rpc_list_variables,
}
