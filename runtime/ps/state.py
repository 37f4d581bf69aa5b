"""The state of one parameter server, as a plain object (no sockets): variables, per-variable locks, optimizers,
slot variables and update counters.

Concurrency: every variable (a shard of a sharded variable is a variable of its own) has its own lock. Pushes to one
variable are applied one after another (no lost updates); pushes to different variables run in parallel. Reads copy
under the lock, so a reader never sees a half-applied update.

The gRPC methods of the parameter-server service over this state are in :mod:`kubeps.runtime.ps.methods`.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from kubeps.runtime.contract import (MAX_ANSWER_BYTES_ENV, MAX_READ_IDS_ENV, MAX_SLOT_SETS_ENV, MAX_VARIABLES_ENV,
                                     NONFINITE_GRADIENTS_ENV)
from kubeps.runtime.errors import LimitExceededError, RuntimeConfigError
from kubeps.runtime.ps.budget import AnswerBudget
from kubeps.runtime.checkpoint.shards import SaveView
from kubeps.runtime.ps.changes import RowChanges, save_view
from kubeps.runtime.rpc.protocol import optimizer_key, slot_key
from kubeps.runtime.settings import TaskSettings
from kubeps.runtime.util.storage import checkpoint_roots
from kubeps.runtime.variables.slots import slots_for

__all__ = [
    "ParameterServerState",
    "PSVariable",
    "UnknownVariableError",
]


#: how many optimizer configurations a ps keeps an optimizer object for (slots do not depend on it)
MAX_OPTIMIZERS = 16



#: a read of rows whose answer would pass this many bytes must name each row once: repeated ids would let a few KB of
#: request name an answer of hundreds of MB (a table of wide rows, one row named thousands of times); kubeps's
#: lookups always send distinct ids (``np.unique``: ascending, which :func:`all_distinct` sees in one pass)
DISTINCT_ROWS_FROM_BYTES = 1 << 20


def all_distinct(ids: np.ndarray) -> bool:
    """Whether the 1-D ``ids`` name each value once: one comparison pass when they are strictly ascending (what
    kubeps's lookups and pushes send), else a sort (``np.unique``: 285 us for 4,700 ids, against 3 us)."""
    if ids.size < 2 or bool((ids[1:] > ids[:-1]).all()):
        return True
    return bool(np.unique(ids).size == ids.size)


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
    #: the traffic this variable served, counted per call under its lock (the metrics and the chief's hot-spot
    #: detection read them): rows and bytes read, rows and bytes of gradients pushed, seconds waited for the lock
    rows_read: int = 0
    bytes_read: int = 0
    rows_pushed: int = 0
    bytes_pushed: int = 0
    lock_wait_s: float = 0.0
    #: which rows changed since which save (incremental checkpoints); a new record when the variable is loaded
    changes: RowChanges = field(init=False)

    def __post_init__(self) -> None:
        self.changes = RowChanges(self.value.shape[0] if self.value.ndim else 1)


def _all_finite(array: np.ndarray) -> bool:
    """Whether a float or complex array holds no NaN or infinity. The sum is a fast pass without an allocation
    (a finite sum proves every element finite); only a non-finite sum (NaN/Inf, or an overflow) looks closer."""
    if array.dtype.kind not in "fc" or array.size == 0:
        return True
    with np.errstate(all="ignore"):
        if np.isfinite(np.add.reduce(array, axis=None)):
            return True
    return bool(np.isfinite(array).all())


@contextlib.contextmanager
def _locked(variables: Iterable["PSVariable"]) -> Iterator[None]:
    """Hold the locks of several variables at once, taken in one global order (name, then identity), so that two
    multi-variable updates can never wait for each other."""
    unique = {id(v): v for v in variables}
    with contextlib.ExitStack() as stack:
        for var in sorted(unique.values(), key=lambda v: (v.name, id(v))):
            stack.enter_context(var.lock)
        yield


def _default_optimizer_factory(config: dict[str, Any]) -> Any:
    from kubeps.runtime.ops.optimizers import optimizer_from_config  # noqa: PLC0415 - loaded on the first push, not at start

    return optimizer_from_config(config)


class ParameterServerState:
    """Everything one parameter server holds."""

    def __init__(self, optimizer_factory: Callable[[dict[str, Any]], Any] | None = None,
                 max_slot_sets: int | None = None, allow_nonfinite: bool | None = None, *,
                 settings: TaskSettings):
        # the task's settings, from the Server that holds this state: limits, gradients policy, checkpoint roots
        #: the task's settings: the size bounds of every method (docs/runtime.md, "Limits") are read from here
        self.settings = settings
        self.variables: dict[str, PSVariable] = {}
        self._lock = threading.Lock()  # guards the dict itself, never held during math
        self._optimizer_factory = optimizer_factory or _default_optimizer_factory
        #: optimizer config (canonical JSON) -> (slot key, optimizer): the most recent ones only, so a program that
        #: pushes a new learning rate every step does not grow it
        self._optimizers: OrderedDict[str, tuple[str, Any]] = OrderedDict()
        #: the most slot sets one variable may hold (``KUBEPS_MAX_SLOT_SETS``): a push that would add one more is
        #: refused, so a client cycling through optimizer configs cannot grow a ps's memory without bound
        self.max_slot_sets = settings.max_slot_sets if max_slot_sets is None else max_slot_sets
        #: the largest answer a read builds (``KUBEPS_MAX_ANSWER_BYTES``)
        self.max_answer_bytes = settings.max_answer_bytes
        #: the bytes of answers each client may have built at once (``KUBEPS_MAX_CLIENT_ANSWER_BYTES``); the server
        #: opens a ledger per call
        self.answers = AnswerBudget(settings.max_client_answer_bytes)
        #: NaN/Inf gradients are refused unless ``KUBEPS_NONFINITE_GRADIENTS=allow``
        self.allow_nonfinite = (settings.nonfinite_gradients == "allow") if allow_nonfinite is None else allow_nonfinite
        #: where ``SaveShards``/``RestoreShards`` may read and write (``KUBEPS_CHECKPOINT_ROOT``), normalised; []:
        #: anywhere absolute
        self.checkpoint_roots = checkpoint_roots(settings.checkpoint_root)
        #: random id of this state, i.e. of this process start: a restarted parameter server comes back empty
        #: with a new one (``Ping`` and ``CreateVariables`` answer it; the coordinator compares)
        self.incarnation = uuid.uuid4().hex

    # -- variables ---------------------------------------------------------------------------------------------
    def create(self, name: str, value: np.ndarray) -> PSVariable:
        """Create (or re-create, resetting optimizer state: a restarted coordinator does that) a variable."""
        return self.create_many([name], [value])[0]

    def create_many(self, names: list[str], values: list[np.ndarray]) -> list[PSVariable]:
        """Create several variables at once: every name is checked first, then all appear together."""
        seen: set[str] = set()
        for i, name in enumerate(names):
            if not isinstance(name, str) or not name:
                raise RuntimeConfigError(f"names[{i}]", name, "a variable name must be a non-empty string")
            if name in seen:
                raise RuntimeConfigError(f"names[{i}]", name, "each variable may be named once per request")
            seen.add(name)
        made = [PSVariable(name=n, value=np.array(v, copy=True, order="C")) for n, v in zip(names, values)]
        with self._lock:
            total = len(self.variables) + sum(1 for n in seen if n not in self.variables)
            if total > self.settings.max_variables:
                raise LimitExceededError("names", names[:10], f"this ps would hold {total} variables; it holds at "
                                         f"most {self.settings.max_variables} ({MAX_VARIABLES_ENV})")
            self.variables.update((v.name, v) for v in made)
        return made

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
        asked = time.perf_counter()
        with var.lock:
            var.lock_wait_s += time.perf_counter() - asked
            value: np.ndarray = var.value.copy()
            var.rows_read += value.shape[0] if value.ndim else 1
            var.bytes_read += value.nbytes
        return value

    def read_rows(self, name: str, indices: np.ndarray) -> np.ndarray:
        var = self.get(name)
        idx = self._check_rows(var, indices, "indices")
        asked = time.perf_counter()
        with var.lock:
            var.lock_wait_s += time.perf_counter() - asked
            rows: np.ndarray = np.take(var.value, idx, axis=0)  # (2x faster than var.value[idx] for rows)
            var.rows_read += rows.shape[0]
            var.bytes_read += rows.nbytes
        return rows

    def assign(self, name: str, value: np.ndarray) -> None:
        self.assign_many([(name, "assign", value)])

    def assign_add(self, name: str, delta: np.ndarray) -> None:
        self.assign_many([(name, "add", delta)])

    def assign_many(self, ops: list[tuple[str, str, np.ndarray]]) -> None:
        """``(name, "assign" | "add", value)`` for several variables, all or nothing: every one is checked (the
        variable exists, shape, a cast that keeps the values) before the first is written."""
        checked = []
        for name, op, value in ops:
            var = self.get(name)
            checked.append((var, op, self._check_like(var, value, "value" if op == "assign" else "delta")))
        with _locked(var for var, _, _ in checked):
            for var, op, value in checked:
                if op == "assign":
                    var.value[...] = value
                else:
                    var.value += value
                var.changes.stamp(None)

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

    def push(self, config: dict[str, Any], updates: list[tuple[Any, ...]]) -> list[int]:
        """Apply ``("dense", name, grad)`` and ``("sparse", name, indices, values)`` updates with one optimizer.

        All or nothing: every update is checked (variable, dtype, shapes, rows, finite values, the optimizer
        config, the learning rate at each variable's next step, the slot-set bound) with the locks of all the
        push's variables held, before the first is applied; a refused push changes nothing, update counters
        included. Returns each variable's update count after its update."""
        key, opt = self.optimizer(config)
        checked: list[tuple[PSVariable, np.ndarray | None, np.ndarray]] = []
        for i, (kind, name, *arrays) in enumerate(updates):
            var = self.get(name)
            if var.value.dtype.kind != "f":
                raise ValueError(f"updates[{i}]: variable {name!r} has dtype {var.value.dtype}; an optimizer "
                                 "updates floating-point variables (float16, float32, float64) only")
            if kind == "dense":
                grad = self._check_like(var, arrays[0], "grad")
                rows = None
            else:
                rows = self._check_rows(var, arrays[0], "indices")
                values = np.asarray(arrays[1])
                expected = (rows.shape[0],) + var.value.shape[1:]
                if values.shape != expected:
                    raise ValueError(
                        f"sparse gradient for {name!r}: 'values' has shape {list(values.shape)}, expected "
                        f"{list(expected)} (one row per index, rows shaped like the variable's "
                        f"{list(var.value.shape[1:])})"
                    )
                if values.dtype != var.value.dtype:  # no silent cast, as in TensorFlow
                    raise ValueError(f"sparse gradient for {name!r}: 'values' has dtype {values.dtype}; the variable "
                                     f"is {var.value.dtype} (kubeps does not cast: send {var.value.dtype})")
                grad = values
            if not self.allow_nonfinite and not _all_finite(grad):
                raise ValueError(f"updates[{i}]: the gradient for {name!r} holds NaN or infinite values; allowed: "
                                 f"finite values (set {NONFINITE_GRADIENTS_ENV}=allow on the ps to apply them)")
            checked.append((var, rows, grad))
        asked = time.perf_counter()
        with _locked(var for var, _, _ in checked):
            waited = time.perf_counter() - asked
            steps = {id(var): var.updates for var, _, _ in checked}
            planned = []
            for var, _, _ in checked:
                steps[id(var)] += 1
                self._check_learning_rate(opt, var, steps[id(var)])
                planned.append(steps[id(var)])
            new_slots = {}
            for var, _, _ in checked:
                if key not in var.slots and id(var) not in new_slots:
                    if len(var.slots) >= self.max_slot_sets:
                        raise LimitExceededError(
                            "optimizer", config,
                            f"variable {var.name!r} already holds slots for {len(var.slots)} optimizer classes "
                            f"({sorted(var.slots)}), the most a variable may hold ({MAX_SLOT_SETS_ENV}="
                            f"{self.max_slot_sets}); push with one of the optimizers it was trained with"
                        )
                    new_slots[id(var)] = var
            # nothing below can be refused: apply every update (slots_for creates the new slot sets)
            for (var, idx, grad), step in zip(checked, planned):
                fresh = key not in var.slots
                slots = slots_for(var.slots, key, opt, var.value, var.name)
                # new slot arrays are a change of every row; else the rows the gradient touches
                var.changes.stamp(None if idx is None or (fresh and slots) else idx)
                if idx is None:
                    opt.apply_dense(var.value, grad, slots, step)
                else:
                    opt.apply_sparse(var.value, idx, grad, slots, step)
                var.updates = step
                var.rows_pushed += grad.shape[0] if grad.ndim else 1
                var.bytes_pushed += grad.nbytes
                var.lock_wait_s += waited
        return planned

    @staticmethod
    def _check_learning_rate(opt: Any, var: PSVariable, step: int) -> None:
        lr_at = getattr(opt, "lr_at", None)  # an optimizer factory's own optimizers may have no schedule
        if lr_at is None:
            return
        try:
            lr = float(lr_at(step))
        except (OverflowError, ZeroDivisionError, ValueError) as err:
            lr, why = float("nan"), f" ({type(err).__name__}: {err})"
        else:
            why = ""
        if not np.isfinite(lr) or lr < 0:
            raise ValueError(f"optimizer: the learning rate of update {step} of variable {var.name!r} is {lr}{why}; "
                             "allowed: a finite number >= 0 (check the learning-rate schedule)")

    def check_reads(self, names: list[str], rows: list[str], indices: Sequence[Any]) -> None:
        """Refuse a read of unknown variables or rows, or one whose answer would pass ``max_answer_bytes``, before
        anything else of the call happens."""
        ids = sum(len(idx) for idx in indices)
        if ids > self.settings.max_read_ids:
            raise LimitExceededError("rows", rows[:10], f"the call reads {ids} rows; a ps reads at most "
                                     f"{self.settings.max_read_ids} per call ({MAX_READ_IDS_ENV})")
        total = 0
        for name in names:
            total += self.get(name).value.nbytes
        for name, idx in zip(rows, indices):
            var = self.get(name)
            checked = self._check_rows(var, idx, "indices")
            row_bytes = var.value.nbytes // max(1, var.value.shape[0])
            if len(checked) * row_bytes > DISTINCT_ROWS_FROM_BYTES and (
                    len(checked) > var.value.shape[0] or not all_distinct(checked)):
                raise ValueError(f"indices for {name!r}: {len(checked)} ids name {np.unique(checked).size} distinct "
                                 f"rows; a read whose rows pass {DISTINCT_ROWS_FROM_BYTES} bytes must name each row "
                                 "once (kubeps's lookups send distinct ids and map them back themselves)")
            total += len(checked) * row_bytes
        if total > self.max_answer_bytes:
            raise LimitExceededError("names", names + rows, f"the answer would hold {total} bytes; a ps answers at "
                                     f"most {self.max_answer_bytes} ({MAX_ANSWER_BYTES_ENV}): read fewer variables "
                                     "or rows per call")
        self.answers.charge(total, "names", (names + rows)[:10])

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

    def save_view(self, name: str, source: str | None, since: int | None) -> SaveView:
        """What a save of ``name`` writes: the rows changed since the save of ``(source, since)``, or all of them,
        chunk by chunk (:func:`~kubeps.runtime.ps.changes.save_view`)."""
        return save_view(self.get(name), source, since)

    def check_load(self, name: str, value: np.ndarray, slots: dict[str, dict[str, np.ndarray]] | None) -> None:
        """Refuse (``ValueError``) what :meth:`load` would not take: another shape or dtype than the variable's
        for the value or a slot, or more slot sets than a variable may hold."""
        var = self.get(name)
        if value.shape != var.value.shape or value.dtype != var.value.dtype:
            raise ValueError(f"variable {name!r} is shape {list(var.value.shape)} dtype {var.value.dtype}; the "
                             f"value to load is shape {list(value.shape)} dtype {value.dtype}")
        if slots is None:
            return
        if len(slots) > self.max_slot_sets:
            raise LimitExceededError("slots", sorted(slots), f"variable {name!r} may hold at most "
                                     f"{self.max_slot_sets} slot sets ({MAX_SLOT_SETS_ENV})")
        for okey, group in slots.items():
            for sname, arr in group.items():
                if arr.shape != var.value.shape or arr.dtype != var.value.dtype:
                    raise ValueError(
                        f"variable {name!r}: slot {sname!r} of optimizer {okey[:80]!r} is shape {list(arr.shape)} "
                        f"dtype {arr.dtype}; slots must have the variable's shape {list(var.value.shape)} and "
                        f"dtype {var.value.dtype}"
                    )

    def load(self, name: str, value: np.ndarray, slots: dict[str, dict[str, np.ndarray]] | None,
             updates: int | None) -> None:
        """Set variable ``name``'s value and, when given, its slots and update count (checked first with
        :meth:`check_load`). The arrays are taken, as the slots always were: a value that owns its C-contiguous data
        (what a restore reads) becomes the variable's, any other is copied into it."""
        self.check_load(name, value, slots)
        var = self.get(name)
        with var.lock:
            if value.flags.c_contiguous and value.flags.writeable and value.base is None:
                var.value = value  # a restore's own array: taken, not copied (one shard's bytes less at the peak)
            else:
                var.value[...] = value
            var.changes = RowChanges(var.value.shape[0] if var.value.ndim else 1)
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
        return ParameterServerState._cast(var, value, what)

    @staticmethod
    def _cast(var: PSVariable, value: np.ndarray, what: str) -> np.ndarray:
        """``value`` unchanged when it has the variable's dtype; any other dtype is refused, as TensorFlow refuses
        it (no silent cast: a float64 gradient into a float32 variable, uint64 into int64, complex into real)."""
        if value.dtype != var.value.dtype:
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
