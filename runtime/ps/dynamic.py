"""Dynamic embedding tables on a parameter server: this ps's shard of every table (the keys that hash to it, see
:func:`~kubeps.runtime.util.keyhash.shard_of`) and the methods that create, look up, update and export them.

The tables of a ps live beside its :class:`~kubeps.runtime.ps.state.ParameterServerState` (:func:`tables_of`), so
a table update rides on the same ``Push`` as the step's variable updates: ``Push`` and ``PushRead`` here accept
updates of kind ``dynamic`` and hand the rest to :mod:`kubeps.runtime.ps.methods`; ``LookupDynamic`` is a
``ReadMany`` with table lookups, and ``PushLookupDynamic`` carries a worker's deferred push on it (one round trip a
step, as for fixed tables).

Every method checks its whole request first -- tables known, keys 1-D int64 and distinct, counts, gradient shapes,
dtypes and finite values, the learning rate, the slot-set bound, the answer size -- with the locks of the tables
it touches held, and changes nothing when it refuses (the variable part is checked by ``ParameterServerState.push``,
which refuses before it applies anything, and runs before any table changes).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator

import numpy as np

from kubeps.runtime.checkpoint.dynamic import RestoreTableItem, SaveTableItem, load_table, prepare_restore, save_table
from kubeps.runtime.checkpoint.shards import request_items
from kubeps.runtime.contract import MAX_ANSWER_BYTES_ENV, MAX_SLOT_SETS_ENV
from kubeps.runtime.errors import LimitExceededError
from kubeps.runtime.ps import methods as _methods
from kubeps.runtime.ps.state import ParameterServerState, UnknownVariableError
from kubeps.runtime.rpc.protocol import PS
from kubeps.runtime.variables.dynamic_table import DynamicTable, TableConfig

__all__ = ["DYNAMIC_METHODS", "DynamicTables", "tables_of"]

Meta = dict[str, Any]


class DynamicTables:
    """The dynamic tables of one parameter server, by name."""

    def __init__(self) -> None:
        self.tables: dict[str, DynamicTable] = {}
        self._lock = threading.Lock()

    def create(self, name: str, config: TableConfig) -> DynamicTable:
        """Create (or re-create empty: a restarted coordinator does that) a table."""
        table = DynamicTable(name, config)
        with self._lock:
            self.tables[name] = table
        return table

    def get(self, name: str) -> DynamicTable:
        try:
            return self.tables[name]
        except KeyError:
            raise UnknownVariableError(f"no dynamic table named {name!r} on this parameter server; it holds "
                                       f"{sorted(self.tables)[:10]}") from None

    @staticmethod
    @contextlib.contextmanager
    def locked(tables: list[DynamicTable]) -> Iterator[None]:
        """The locks of several tables, taken in name order (always before any variable's lock)."""
        with contextlib.ExitStack() as stack:
            for table in sorted({id(t): t for t in tables}.values(), key=lambda t: t.name):
                stack.enter_context(table.lock)
            yield


_REGISTRY: "weakref.WeakKeyDictionary[ParameterServerState, DynamicTables]" = weakref.WeakKeyDictionary()
_REGISTRY_LOCK = threading.Lock()


def tables_of(state: ParameterServerState) -> DynamicTables:
    """The dynamic tables held beside ``state`` (made on first use; they go with the state)."""
    with _REGISTRY_LOCK:
        tables = _REGISTRY.get(state)
        if tables is None:
            tables = _REGISTRY[state] = DynamicTables()
        return tables


# -- request parsing (no state changes) ------------------------------------------------------------------------
_WIDTH = {"dense": 1, "sparse": 2, "dynamic": 2}


def _split_push(meta: Meta, arrays: list) -> tuple[Meta, list, list[tuple[str, Any, Any]], int]:
    """A push's variable part (meta and tensors for :mod:`kubeps.runtime.ps.methods`), its table updates
    ``(name, keys, grads)``, and how many of ``arrays`` the push uses."""
    updates = meta.get("updates")
    if not isinstance(updates, list):
        raise ValueError(f"field 'updates' must be a list, got {updates!r}")
    kept: list[Any] = []
    kept_arrays: list[Any] = []
    dynamic: list[tuple[str, Any, Any]] = []
    pos = 0
    for i, update in enumerate(updates):
        kind = update.get("kind", "dense") if isinstance(update, dict) else None
        if kind not in _WIDTH:
            raise ValueError(f"field 'updates[{i}]' must be an object with a 'name' and a 'kind' in "
                             f"{sorted(_WIDTH)}, got {update!r}")
        width = _WIDTH[kind]
        tensors = arrays[pos: pos + width]
        if len(tensors) != width:
            raise ValueError(f"field 'tensors' holds {len(arrays)} tensor(s); 'updates' needs more "
                             f"(updates[{i}] of kind {kind!r} takes {width})")
        if kind == "dynamic":
            if not isinstance(update.get("name"), str) or set(update) != {"name", "kind"}:
                raise ValueError(f"field 'updates[{i}]' must be {{'name': <table>, 'kind': 'dynamic'}}, got {update!r}")
            dynamic.append((update["name"], *tensors))
        else:
            kept.append(update)
            kept_arrays.extend(tensors)
        pos += width
    names = [name for name, _, _ in dynamic]
    if len(set(names)) != len(names):
        raise ValueError(f"field 'updates' names dynamic table(s) more than once ({names}); allowed: each once a push")
    return {**meta, "updates": kept}, kept_arrays, dynamic, pos


def _check_keys(keys: Any, what: str, distinct: bool = True) -> np.ndarray:
    k = np.asarray(keys)
    if k.ndim != 1 or k.dtype != np.int64:
        raise ValueError(f"{what} must be a 1-D int64 array of keys, got {k.dtype} shape {list(k.shape)}")
    if distinct and k.size > 1 and np.unique(k).size != k.size:
        raise ValueError(f"{what} holds a key more than once; allowed: distinct keys (sum duplicates first)")
    return k


def _lookups(registry: DynamicTables, meta: Meta, arrays: list) -> list[tuple[DynamicTable, np.ndarray, np.ndarray,
                                                                               bool]]:
    raw = meta.get("dynamic", [])
    if not isinstance(raw, list):
        raise ValueError(f"field 'dynamic' must be a list of {{'name', 'train'}} objects, got {raw!r}")
    if len(arrays) != 2 * len(raw):
        raise ValueError(f"field 'tensors' holds {len(arrays)} tensor(s) for the table lookups, expected "
                         f"{2 * len(raw)} (keys and counts per table in 'dynamic')")
    out = []
    for i, spec in enumerate(raw):
        if (not isinstance(spec, dict) or set(spec) != {"name", "train"} or not isinstance(spec["name"], str)
                or not isinstance(spec["train"], bool)):
            raise ValueError(f"field 'dynamic[{i}]' must be {{'name': <table>, 'train': true|false}}, got {spec!r}")
        table = registry.get(spec["name"])
        keys = _check_keys(arrays[2 * i], f"dynamic[{i}] keys")
        counts = np.asarray(arrays[2 * i + 1])
        if counts.shape != keys.shape or counts.dtype.kind not in "iu" or (counts.size and int(counts.min()) < 0):
            raise ValueError(f"dynamic[{i}] counts must be a 1-D array of integers >= 0, one per key "
                             f"({keys.size}), got {counts.dtype} shape {list(counts.shape)}")
        out.append((table, keys, counts.astype(np.int64, copy=False), spec["train"]))
    return out


def _check_answer(state: ParameterServerState, lookups: list, extra: int) -> None:
    total = extra + sum(keys.size * table.config.dim * table.dtype.itemsize for table, keys, _, _ in lookups)
    if total > state.max_answer_bytes:
        raise LimitExceededError("dynamic", [t.name for t, _, _, _ in lookups],
                                 f"the answer would hold {total} bytes; a ps answers at most {state.max_answer_bytes} "
                                 f"({MAX_ANSWER_BYTES_ENV}): look up fewer keys per call")


def _prepare_pushes(state: ParameterServerState, registry: DynamicTables, config: Any,
                    dynamic: list[tuple[str, Any, Any]]) -> tuple[Any, str, list[tuple[DynamicTable, np.ndarray,
                                                                                          np.ndarray]]]:
    if not dynamic:
        return None, "", []
    if not isinstance(config, dict):
        raise ValueError(f"field 'optimizer' must be an optimizer config object, got {config!r}")
    okey, opt = state.optimizer(config)
    out = []
    for name, keys, grads in dynamic:
        table = registry.get(name)
        k = _check_keys(keys, f"keys of the update to dynamic table {name!r}", distinct=False)  # summed by the update
        if okey not in table.slots and len(table.slots) >= state.max_slot_sets:
            raise LimitExceededError("optimizer", config, f"dynamic table {name!r} already holds slots for "
                                     f"{len(table.slots)} optimizer configurations, the most it may hold "
                                     f"({MAX_SLOT_SETS_ENV}={state.max_slot_sets})")
        out.append((table, k, grads))
    return opt, okey, out


# -- methods ---------------------------------------------------------------------------------------------------
def rpc_create_dynamic(state: ParameterServerState, meta: Meta, arrays: list) -> tuple[Meta, list]:
    """``{"name", "config": TableConfig}`` -> ``{"created": 1, "incarnation"}``: this ps's shard of a table."""
    _methods._expect_arrays(PS.CREATE_DYNAMIC, arrays, 0)
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"field 'name' must be a non-empty table name, got {name!r}")
    config = TableConfig.from_dict(meta.get("config"), "field 'config'")
    tables_of(state).create(name, config)
    return {"created": 1, "incarnation": state.incarnation}, []


def _run(state: ParameterServerState, meta: Meta, arrays: list, push: bool, read: bool) -> tuple[Meta, list]:
    """The body of ``Push``, ``PushRead``, ``LookupDynamic`` and ``PushLookupDynamic``: check everything, then the
    variables' part (which refuses before it applies anything), then the tables' pushes, then the lookups."""
    registry = tables_of(state)
    var_meta: Meta = {}
    var_arrays: list = []
    dynamic: list[tuple[str, Any, Any]] = []
    used = 0
    if push:
        var_meta, var_arrays, dynamic, used = _split_push(meta, arrays)
    rest = arrays[used:]
    rows = _methods._names(meta, "rows") if read and "rows" in meta else []
    names = _methods._names(meta) if read and "names" in meta else []
    lookups = _lookups(registry, meta, rest[len(rows):]) if read else []
    opt, okey, pushes = _prepare_pushes(state, registry, meta.get("optimizer"), dynamic)
    with DynamicTables.locked([t for t, _, _ in pushes] + [t for t, _, _, _ in lookups]):
        checked = [(t, k, t.check_push(opt, k, g, state.allow_nonfinite)) for t, k, g in pushes]
        if read:
            _methods._expect_arrays(PS.READ_MANY, rest[: len(rows)], len(rows))  # the row indices of the read
            _check_answer(state, lookups, 0)
        answer: Meta = {}
        out: list = []
        if not (var_meta.get("updates") or names or rows):
            answer = {"steps": []} if push else {}  # the call is the tables' alone: no variable to push or read
        elif push and read:
            answer, out = _methods.rpc_push_read(state, {**var_meta, "names": names, "rows": rows},
                                                 var_arrays + rest[: len(rows)])
        elif push:
            answer, out = _methods.rpc_push(state, var_meta, var_arrays)
        elif read:
            answer, out = _methods.rpc_read_many(state, {"names": names, "rows": rows}, rest[: len(rows)])
        # everything was checked and the variables' part is applied: nothing below is refused
        if checked:
            answer["dynamic_steps"] = [t.apply_push(opt, okey, k, g) for t, k, g in checked]
        out += [table.lookup(keys, counts, train) for table, keys, counts, train in lookups]
    return answer, out


def rpc_push(state: ParameterServerState, meta: Meta, arrays: list) -> tuple[Meta, list]:
    """``Push`` whose updates may include dynamic tables (``kind: dynamic``, tensors: keys, gradient rows)."""
    return _run(state, meta, arrays, push=True, read=False)


def rpc_push_read(state: ParameterServerState, meta: Meta, arrays: list) -> tuple[Meta, list]:
    """``PushRead`` whose push may include dynamic tables."""
    return _run(state, meta, arrays, push=True, read=True)


def rpc_lookup_dynamic(state: ParameterServerState, meta: Meta, arrays: list) -> tuple[Meta, list]:
    """``LookupDynamic``: a ``ReadMany`` (``names``, ``rows``) and table lookups (``dynamic``)."""
    return _run(state, meta, arrays, push=False, read=True)


def rpc_push_lookup_dynamic(state: ParameterServerState, meta: Meta, arrays: list) -> tuple[Meta, list]:
    """``PushLookupDynamic``: a ``Push`` (tables included), then a ``LookupDynamic``, in one call."""
    return _run(state, meta, arrays, push=True, read=True)


def rpc_dynamic_info(state: ParameterServerState, meta: Meta, arrays: list) -> tuple[Meta, list]:
    """``{"names"}`` -> ``{"tables": [{name, size, updates, evicted, nbytes, capacity}]}``."""
    _methods._expect_arrays(PS.DYNAMIC_INFO, arrays, 0)
    registry = tables_of(state)
    names = _methods._names(meta) if "names" in meta else sorted(registry.tables)
    tables = [registry.get(n) for n in names]
    out = []
    for table in tables:
        with table.lock:
            out.append({"name": table.name, "size": table.size, "updates": table.updates, "evicted": table.evicted,
                        "nbytes": table.nbytes, "capacity": table.config.capacity})
    return {"tables": out}, []


def rpc_export_dynamic(state: ParameterServerState, meta: Meta, arrays: list) -> tuple[Meta, list]:
    """``{"name"}`` -> ``{"slots": [[optimizer key, slot name]], "updates"}`` + keys, values, freqs, steps and one
    array per slot: a consistent copy of this ps's live rows."""
    _methods._expect_arrays(PS.EXPORT_DYNAMIC, arrays, 0)
    name = meta.get("name")
    if not isinstance(name, str):
        raise ValueError(f"field 'name' must be a table name, got {name!r}")
    table = tables_of(state).get(name)
    with table.lock:
        nbytes = table.size * (table.config.dim * table.dtype.itemsize * (1 + sum(map(len, table.slots.values())))
                               + 24)
        if nbytes > state.max_answer_bytes:
            raise LimitExceededError("name", name, f"the export would hold {nbytes} bytes; a ps answers at most "
                                     f"{state.max_answer_bytes} ({MAX_ANSWER_BYTES_ENV})")
        keys, values, slots, freqs, steps = table.export()
        updates = table.updates
    order = [[okey, s] for okey, group in slots.items() for s in group]
    return ({"slots": order, "updates": updates},
            [keys, values, freqs, steps] + [slots[okey][s] for okey, s in order])


def rpc_save_dynamic(state: ParameterServerState, meta: Meta, arrays: list) -> tuple[Meta, list]:
    """``SaveDynamic``: ``{"directory", "items": [SaveTableItem]}`` -> ``{"saved": [DynamicShardEntry]}``: this
    ps's shard of each table written to the checkpoint directory."""
    _methods._expect_arrays(PS.SAVE_DYNAMIC, arrays, 0)
    directory, items = request_items(meta, SaveTableItem, "SaveDynamic", state.checkpoint_roots)
    registry = tables_of(state)
    tables = [registry.get(i.key) for i in items]  # every table known before the first file is written
    saved = [save_table(t, directory, i) for t, i in zip(tables, items)]
    return {"saved": [s.model_dump(mode="json") for s in saved]}, []


def rpc_restore_dynamic(state: ParameterServerState, meta: Meta, arrays: list) -> tuple[Meta, list]:
    """``RestoreDynamic``: ``{"directory", "items": [RestoreTableItem]}`` -> ``{"restored": [rows]}``: each table
    replaced by the checkpointed keys that hash to this ps (read and checked before it changes)."""
    _methods._expect_arrays(PS.RESTORE_DYNAMIC, arrays, 0)
    directory, items = request_items(meta, RestoreTableItem, "RestoreDynamic", state.checkpoint_roots)
    registry = tables_of(state)
    tables = [registry.get(i.key) for i in items]
    prepared = [prepare_restore(t, directory, i, state.max_slot_sets) for t, i in zip(tables, items)]
    # every table's part was read and checked: nothing below is refused
    return {"restored": [load_table(t, loaded) for t, loaded in zip(tables, prepared)]}, []


#: the dynamic-table methods of the parameter-server service, and the ``Push``/``PushRead`` that accept table
#: updates (:mod:`kubeps.runtime.server.methods` serves them in place of the plain ones)
DYNAMIC_METHODS = {
    PS.CREATE_DYNAMIC: rpc_create_dynamic,
    PS.LOOKUP_DYNAMIC: rpc_lookup_dynamic,
    PS.PUSH_LOOKUP_DYNAMIC: rpc_push_lookup_dynamic,
    PS.DYNAMIC_INFO: rpc_dynamic_info,
    PS.EXPORT_DYNAMIC: rpc_export_dynamic,
    PS.SAVE_DYNAMIC: rpc_save_dynamic,
    PS.RESTORE_DYNAMIC: rpc_restore_dynamic,
    PS.PUSH: rpc_push,
    PS.PUSH_READ: rpc_push_read,
}
