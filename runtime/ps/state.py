"""The state of one parameter server, as a plain object (no sockets): variables, per-variable locks, optimizers,
slot variables and update counters.

Concurrency: every variable (a shard of a sharded variable is a variable of its own) has its own lock. Pushes to one
variable are applied one after another (no lost updates); pushes to different variables run in parallel. Reads copy
under the lock, so a reader never sees a half-applied update.

The gRPC methods of the parameter-server service over this state are in :mod:`kubeps.runtime.ps.methods`.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.rpc.protocol import optimizer_key, slot_key
from kubeps.runtime.variables.slots import slots_for

__all__ = [
    "ParameterServerState",
    "PSVariable",
    "UnknownVariableError",
]


#: how many optimizer configurations a ps keeps an optimizer object for (slots do not depend on it)
MAX_OPTIMIZERS = 16


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
    #: optimizer class -> slot arrays (created on the first push with that class; see ``variables.slots``)
    slots: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    #: number of optimizer updates applied so far (the ``step`` the next update sees is ``updates + 1``)
    updates: int = 0


def _default_optimizer_factory(config: dict[str, Any]):
    from kubeps.runtime.ops.optimizers import optimizer_from_config  # noqa: PLC0415 - loaded on the first push, not at start

    return optimizer_from_config(config)


class ParameterServerState:
    """Everything one parameter server holds."""

    def __init__(self, optimizer_factory: Callable[[dict[str, Any]], Any] | None = None):
        self.variables: dict[str, PSVariable] = {}
        self._lock = threading.Lock()  # guards the dict itself, never held during math
        self._optimizer_factory = optimizer_factory or _default_optimizer_factory
        #: optimizer config (canonical JSON) -> (slot key, optimizer): the most recent ones only, so a program that
        #: pushes a new learning rate every step does not grow it
        self._optimizers: OrderedDict[str, tuple[str, Any]] = OrderedDict()
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
    def optimizer(self, config: dict[str, Any]) -> tuple[str, Any]:
        """``(slot key, optimizer)`` for ``config``: the slot key is the optimizer's class (slots survive a
        hyperparameter change); the optimizer object is cached per whole config, at most ``MAX_OPTIMIZERS``."""
        key = optimizer_key(config)
        with self._lock:
            entry = self._optimizers.get(key)
            if entry is not None:
                self._optimizers.move_to_end(key)
                return entry
        entry = (slot_key(config), self._optimizer_factory(config))
        with self._lock:
            entry = self._optimizers.setdefault(key, entry)
            while len(self._optimizers) > MAX_OPTIMIZERS:
                self._optimizers.popitem(last=False)
        return entry

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
        checked: list[tuple[PSVariable, np.ndarray | None, np.ndarray]] = []
        for kind, name, *arrays in updates:
            var = self.get(name)
            if kind == "dense":
                checked.append((var, None, self._check_like(var, arrays[0], "grad")))
                continue
            rows = self._check_rows(var, arrays[0], "indices")
            values = np.asarray(arrays[1])
            expected = (rows.shape[0],) + var.value.shape[1:]
            if values.shape != expected:
                raise ValueError(
                    f"sparse gradient for {name!r}: 'values' has shape {list(values.shape)}, expected "
                    f"{list(expected)} (one row per index, rows shaped like the variable's {list(var.value.shape[1:])})"
                )
            if values.dtype != var.value.dtype:
                raise ValueError(f"sparse gradient for {name!r}: 'values' has dtype {values.dtype}; the variable is "
                                 f"{var.value.dtype} (kubeps does not cast: send {var.value.dtype})")
            checked.append((var, rows, values))
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
        return slots_for(var.slots, key, opt, var.value, var.name)

    # -- checkpoints: one variable with its optimizer state, copied out or loaded back under its lock ----------
    def describe(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
        """Shape and dtype of variable ``name``."""
        var = self.get(name)
        return var.value.shape, var.value.dtype

    def snapshot(self, name: str) -> tuple[np.ndarray, dict[str, dict[str, np.ndarray]], int]:
        """A consistent copy of variable ``name``: ``(value, {optimizer class: {slot: array}}, updates)``."""
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
        if value.dtype != var.value.dtype:  # no silent cast, as in TensorFlow
            raise ValueError(
                f"{what} for variable {var.name!r} has dtype {value.dtype}; the variable is {var.value.dtype} "
                f"(kubeps does not cast: send {var.value.dtype})"
            )
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
