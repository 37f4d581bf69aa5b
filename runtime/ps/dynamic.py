"""Dynamic embedding tables on a parameter server: this ps's shard of every table (the keys that hash to it, see
:func:`~kubeps.runtime.util.keyhash.shard_of`) and the methods that create, describe, export and checkpoint them.

The tables of a ps live beside its :class:`~kubeps.runtime.ps.state.ParameterServerState` (:func:`tables_of`), so
a table update rides on the same ``Push`` as the step's variable updates, and a lookup on the same call as the
step's reads: those methods (``Push``, ``PushRead``, ``LookupDynamic``, ``PushLookupDynamic``) are
:mod:`kubeps.runtime.ps.push`'s, built on the checks here (:func:`split_push`, :func:`table_lookups`,
:func:`prepare_table_pushes`, :func:`check_answer_size`), which change nothing: tables known, keys 1-D int64 and
distinct, counts, the slot-set bound, the answer size.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from kubeps.runtime.checkpoint.dynamic import load_table, prepare_restore, save_table
from kubeps.runtime.checkpoint.shards import request_directory
from kubeps.runtime.contract import (MAX_ANSWER_BYTES_ENV, MAX_BLOOM_COUNTERS_ENV, MAX_READ_IDS_ENV, MAX_SLOT_SETS_ENV,
                                     MAX_TABLE_DIM_ENV, MAX_TABLES_ENV)
from kubeps.runtime.errors import LimitExceededError
from kubeps.runtime.ps.methods import expect_arrays, unique_names
from kubeps.runtime.ps.state import (DISTINCT_ROWS_FROM_BYTES, ParameterServerState, UnknownVariableError,
                                     all_distinct)
from kubeps.runtime.util.confined import confined_storage
from kubeps.runtime.rpc.protocol import (PS, CreateDynamicRequest, CreateVariablesAnswer, DynamicInfoAnswer,
                                          DynamicInfoRequest, DynamicLookup, DynamicTableInfo, ExportDynamicAnswer,
                                          RestoreDynamicAnswer, RestoreDynamicRequest, SaveDynamicRequest,
                                          SavedAnswer, TableNameRequest, UpdateSpec)
from kubeps.runtime.variables.dynamic_table import DynamicTable, TableConfig

__all__ = ["DYNAMIC_METHODS", "DynamicTables", "Lookup", "TablePush", "check_answer_size", "prepare_table_pushes",
           "split_push", "table_lookups", "tables_of"]


class DynamicTables:
    """The dynamic tables of one parameter server, by name."""

    def __init__(self) -> None:
        self.tables: dict[str, DynamicTable] = {}
        self._lock = threading.Lock()

    def create(self, name: str, config: TableConfig, max_tables: int) -> DynamicTable:
        """Create (or re-create empty: a restarted coordinator does that) a table; refused when this would make
        more than ``max_tables``."""
        with self._lock:  # the table is small until keys arrive (its dim and filter are bounded): made under the lock
            if name not in self.tables and len(self.tables) >= max_tables:
                raise LimitExceededError("name", name, f"this ps holds {len(self.tables)} dynamic tables, the most "
                                         f"it may hold ({MAX_TABLES_ENV}={max_tables})")
            table = DynamicTable(name, config)
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


# -- request checks (no state changes) ------------------------------------------------------------------------
_WIDTH = {"dense": 1, "sparse": 2, "dynamic": 2}


def split_push(updates: list[UpdateSpec], arrays: Sequence[Any]) -> tuple[list[UpdateSpec], list[Any],
                                                                           list[tuple[str, Any, Any]], int]:
    """A push's variable updates (dense and sparse) and their tensors, its table updates ``(name, keys, grads)``,
    and how many of ``arrays`` the push uses."""
    kept: list[UpdateSpec] = []
    kept_arrays: list[Any] = []
    dynamic: list[tuple[str, Any, Any]] = []
    pos = 0
    for i, update in enumerate(updates):
        kind = update.get("kind", "dense")
        width = _WIDTH[kind]
        tensors = arrays[pos: pos + width]
        if len(tensors) != width:
            raise ValueError(f"field 'tensors' holds {len(arrays)} tensor(s); 'updates' needs more "
                             f"(updates[{i}] of kind {kind!r} takes {width})")
        if kind == "dynamic":
            dynamic.append((update["name"], tensors[0], tensors[1]))
        else:
            kept.append(update)
            kept_arrays.extend(tensors)
        pos += width
    names = [name for name, _, _ in dynamic]
    if len(set(names)) != len(names):
        raise ValueError(f"field 'updates' names dynamic table(s) more than once ({names}); allowed: each once a push")
    return kept, kept_arrays, dynamic, pos


def _check_keys(keys: Any, what: str, distinct: bool = True) -> np.ndarray:
    k = np.asarray(keys)
    if k.ndim != 1 or k.dtype != np.int64:
        raise ValueError(f"{what} must be a 1-D int64 array of keys, got {k.dtype} shape {list(k.shape)}")
    if distinct and not all_distinct(k):
        raise ValueError(f"{what} holds a key more than once; allowed: distinct keys (sum duplicates first)")
    return k


#: a table lookup, checked: the table, its keys, their counts, and whether it trains
Lookup = tuple[DynamicTable, np.ndarray, np.ndarray, bool]
#: a table update, checked but for its gradient: the table, its keys, the gradient rows
TablePush = tuple[DynamicTable, np.ndarray, Any]


def table_lookups(registry: DynamicTables, raw: list[DynamicLookup], arrays: Sequence[Any]) -> list[Lookup]:
    """The lookups of a request's ``dynamic`` field with their ``(keys, counts)`` tensors, checked."""
    if len(arrays) != 2 * len(raw):
        raise ValueError(f"field 'tensors' holds {len(arrays)} tensor(s) for the table lookups, expected "
                         f"{2 * len(raw)} (keys and counts per table in 'dynamic')")
    out = []
    for i, spec in enumerate(raw):
        table = registry.get(spec["name"])
        keys = _check_keys(arrays[2 * i], f"dynamic[{i}] keys")
        counts = np.asarray(arrays[2 * i + 1])
        if counts.shape != keys.shape or counts.dtype.kind not in "iu" or (counts.size and int(counts.min()) < 0):
            raise ValueError(f"dynamic[{i}] counts must be a 1-D array of integers >= 0, one per key "
                             f"({keys.size}), got {counts.dtype} shape {list(counts.shape)}")
        out.append((table, keys, counts.astype(np.int64, copy=False), spec["train"]))
    return out


def check_answer_size(state: ParameterServerState, lookups: list[Lookup], extra: int) -> None:
    """Refuse lookups whose rows (and ``extra`` bytes) would pass the ps's answer size limit."""
    keys_total = sum(keys.size for _, keys, _, _ in lookups)
    if keys_total > state.settings.max_read_ids:
        raise LimitExceededError("dynamic", [t.name for t, _, _, _ in lookups][:10],
                                 f"the call looks up {keys_total} keys; a ps looks up at most "
                                 f"{state.settings.max_read_ids} per call ({MAX_READ_IDS_ENV})")
    for table, keys, _, _ in lookups:
        if keys.size * table.config.dim * table.dtype.itemsize > DISTINCT_ROWS_FROM_BYTES and \
                not all_distinct(keys):
            raise ValueError(f"dynamic keys for {table.name!r}: {keys.size} keys name {np.unique(keys).size} distinct "
                             f"rows; a lookup whose rows pass {DISTINCT_ROWS_FROM_BYTES} bytes must name each key once "
                             "(kubeps's lookups send distinct keys with their counts)")
    total = extra + sum(keys.size * table.config.dim * table.dtype.itemsize for table, keys, _, _ in lookups)
    if total > state.max_answer_bytes:
        raise LimitExceededError("dynamic", [t.name for t, _, _, _ in lookups],
                                 f"the answer would hold {total} bytes; a ps answers at most {state.max_answer_bytes} "
                                 f"({MAX_ANSWER_BYTES_ENV}): look up fewer keys per call")
    state.answers.charge(total - extra, "dynamic", [t.name for t, _, _, _ in lookups][:10])


def prepare_table_pushes(state: ParameterServerState, registry: DynamicTables, config: dict[str, Any] | None,
                         dynamic: list[tuple[str, Any, Any]]) -> tuple[Any, str, list[TablePush]]:
    """The optimizer (object and key) and the checked tables and keys of a push's table updates."""
    if not dynamic or config is None:
        return None, "", []
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
def rpc_create_dynamic(state: ParameterServerState, request: CreateDynamicRequest,
                       arrays: list[Any]) -> tuple[CreateVariablesAnswer, list[Any]]:
    """``{"name", "config": TableConfig}`` -> ``{"created": 1, "incarnation"}``: this ps's shard of a table."""
    expect_arrays(PS.CREATE_DYNAMIC, arrays, 0)
    name = request["name"]
    if not name:
        raise ValueError(f"field 'name' must be a non-empty table name, got {name!r}")
    config = TableConfig.from_spec(request["config"], "field 'config'")
    limits = state.settings
    for field, value, most, env in (("dim", config.dim, limits.max_table_dim, MAX_TABLE_DIM_ENV),
                                    ("bloom_counters", config.bloom_counters, limits.max_bloom_counters,
                                     MAX_BLOOM_COUNTERS_ENV)):
        if value > most:
            raise LimitExceededError(f"config.{field}", value, f"a ps allows at most {most} ({env})")
    tables_of(state).create(name, config, limits.max_tables)
    return {"created": 1, "incarnation": state.incarnation}, []


def rpc_dynamic_info(state: ParameterServerState, request: DynamicInfoRequest,
                     arrays: list[Any]) -> tuple[DynamicInfoAnswer, list[Any]]:
    """``{"names"}`` -> ``{"tables": [{name, size, updates, evicted, nbytes, capacity}]}``."""
    expect_arrays(PS.DYNAMIC_INFO, arrays, 0)
    registry = tables_of(state)
    names = unique_names(request["names"]) if "names" in request else sorted(registry.tables)
    tables = [registry.get(n) for n in names]
    out: list[DynamicTableInfo] = []
    for table in tables:
        with table.lock:
            out.append({"name": table.name, "size": table.size, "updates": table.updates, "evicted": table.evicted,
                        "nbytes": table.nbytes, "capacity": table.config.capacity})
    return {"tables": out}, []


def rpc_export_dynamic(state: ParameterServerState, request: TableNameRequest,
                       arrays: list[Any]) -> tuple[ExportDynamicAnswer, list[Any]]:
    """``{"name"}`` -> ``{"slots": [[optimizer key, slot name]], "updates"}`` + keys, values, freqs, steps and one
    array per slot: a consistent copy of this ps's live rows."""
    expect_arrays(PS.EXPORT_DYNAMIC, arrays, 0)
    name = request["name"]
    table = tables_of(state).get(name)
    with table.lock:
        nbytes = table.size * (table.config.dim * table.dtype.itemsize * (1 + sum(map(len, table.slots.values())))
                               + 24)
        if nbytes > state.max_answer_bytes:
            raise LimitExceededError("name", name, f"the export would hold {nbytes} bytes; a ps answers at most "
                                     f"{state.max_answer_bytes} ({MAX_ANSWER_BYTES_ENV})")
        state.answers.charge(nbytes, "name", name)
        keys, values, slots, freqs, steps = table.export()
        updates = table.updates
    order = [[okey, s] for okey, group in slots.items() for s in group]
    return ({"slots": order, "updates": updates},
            [keys, values, freqs, steps] + [slots[okey][s] for okey, s in order])


def rpc_save_dynamic(state: ParameterServerState, request: SaveDynamicRequest,
                     arrays: list[Any]) -> tuple[SavedAnswer, list[Any]]:
    """``SaveDynamic``: ``{"directory", "items": [SaveTableItem]}`` -> ``{"saved": [DynamicShardEntry]}``: this
    ps's shard of each table written to the checkpoint directory."""
    expect_arrays(PS.SAVE_DYNAMIC, arrays, 0)
    directory, items = request_directory(request, state.checkpoint_roots), request["items"]
    registry = tables_of(state)
    tables = [registry.get(i["key"]) for i in items]  # every table known before the first file is written
    storage = confined_storage(directory, state.checkpoint_roots)
    saved = [save_table(t, directory, i, storage) for t, i in zip(tables, items)]
    return {"saved": [s.model_dump(mode="json") for s in saved]}, []


def rpc_restore_dynamic(state: ParameterServerState, request: RestoreDynamicRequest,
                        arrays: list[Any]) -> tuple[RestoreDynamicAnswer, list[Any]]:
    """``RestoreDynamic``: ``{"directory", "items": [RestoreTableItem]}`` -> ``{"restored": [rows]}``: each table
    replaced by the checkpointed keys that hash to this ps (read and checked before it changes)."""
    expect_arrays(PS.RESTORE_DYNAMIC, arrays, 0)
    directory, items = request_directory(request, state.checkpoint_roots), request["items"]
    registry = tables_of(state)
    tables = [registry.get(i["key"]) for i in items]
    storage = confined_storage(directory, state.checkpoint_roots)
    prepared = [prepare_restore(t, directory, i, state.max_slot_sets, storage, f"items[{n}].table")
                for n, (t, i) in enumerate(zip(tables, items))]
    # every table's part was read and checked: nothing below is refused
    return {"restored": [load_table(t, loaded) for t, loaded in zip(tables, prepared)]}, []


#: the dynamic-table methods of the parameter-server service (:mod:`kubeps.runtime.server.methods` serves them); the
#: calls of a step that look tables up or push to them are :mod:`kubeps.runtime.ps.push`'s
DYNAMIC_METHODS: dict[str, Callable[..., tuple[Any, list[Any]]]] = {
    PS.CREATE_DYNAMIC: rpc_create_dynamic,
    PS.DYNAMIC_INFO: rpc_dynamic_info,
    PS.EXPORT_DYNAMIC: rpc_export_dynamic,
    PS.SAVE_DYNAMIC: rpc_save_dynamic,
    PS.RESTORE_DYNAMIC: rpc_restore_dynamic,
}
