"""``DynamicEmbedding``: an embedding table keyed by ids of any size, whose rows are created on first use, sharded
over the parameter servers by a stable 64-bit hash of the key (docs/dynamic-embedding.md).

As TensorFlow Recommenders-Addons' ``dynamic_embedding.get_variable`` and DeepRec's ``get_embedding_variable``:
``DynamicEmbedding(name, dim, key_dtype="int64", initializer=..., filter_freq=..., steps_to_live=...,
capacity=...)``. Inside ``strategy.scope()`` every parameter server holds a shard (a
:class:`~kubeps.runtime.variables.dynamic_table.DynamicTable` of the keys that hash to it); outside, the table is in
this process.

A lookup deduplicates the ids, hashes them to their ps (:func:`~kubeps.runtime.util.keyhash.shard_of`) and makes
one ``LookupDynamic`` call per ps, in parallel; inside a scheduled function the step's batched pull of the dense
variables and the previous step's deferred push ride on it (``PushLookupDynamic``), so a step with a dynamic table
costs one round trip per ps, as with a fixed one. The gradient is an ``IndexedSlices`` whose indices are the keys;
``optimizer.apply_gradients`` pushes it with the step's other gradients (update kind ``dynamic``).

A handle pickles as its name and settings, never its rows: that is how a scheduled function carries it.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.rpc.protocol import (PS, CreateDynamicRequest, DynamicInfoRequest, DynamicLookup,
                                          DynamicTableInfo, LookupDynamicRequest, TableNameRequest)
from kubeps.runtime.util.keyhash import shard_of, to_keys
from kubeps.runtime.variables import context as _context
from kubeps.runtime.variables.dynamic_table import DynamicTable, TableConfig
from kubeps.runtime.variables.indexed_slices import IndexedSlices
from kubeps.runtime.variables.variable import _calls

__all__ = ["DynamicEmbedding"]

_KEY_DTYPES = ("int64", "string")


def _initializer_spec(initializer: Any) -> dict[str, Any]:
    if isinstance(initializer, dict):
        return dict(initializer)
    if isinstance(initializer, str):
        return {"kind": initializer}
    if isinstance(initializer, (int, float)) and not isinstance(initializer, bool):
        return {"kind": "constant", "value": float(initializer)}
    raise RuntimeConfigError("initializer", initializer, "must be 'zeros', 'uniform', 'normal', a number (every "
                             "value), or a dict such as {'kind': 'normal', 'stddev': 0.01, 'seed': 1}")


class DynamicEmbedding:
    """``DynamicEmbedding(name, dim, key_dtype="int64", initializer="uniform", dtype="float32", default_value=0.0,
    filter_freq=1, steps_to_live=0, capacity=0, evict_policy="lru", ...)``.

    * ``initializer``: ``"zeros"``, ``"uniform"`` (U(-0.05, 0.05)), ``"normal"`` (N(0, 0.05**2)), a number, or a
      dict ``{"kind": "uniform", "minval", "maxval", "seed"}`` / ``{"kind": "normal", "mean", "stddev", "seed"}``.
      A new row's values are a function of its key and the seed: where it is created does not matter.
    * ``key_dtype``: ``"int64"`` (any integer ids) or ``"string"`` (hashed to int64 keys with BLAKE2b-64).
    * ``filter_freq``: a key gets a trained row once it was seen this many times in training lookups; before, it
      reads ``default_value`` and takes no gradient. ``bloom_counters`` > 0 counts in a counting Bloom filter of
      that many counters per ps (``bloom_hashes`` hash functions) instead of exactly.
    * ``steps_to_live``: rows not updated in that many of their shard's updates are evicted (a sweep every
      ``sweep_every`` updates). ``capacity``: the most rows one ps holds; admitting past it evicts the least
      recently updated (``evict_policy="lru"``) or least often seen (``"lfu"``) rows.
    """

    def __init__(self, name: str, dim: int, key_dtype: str = "int64", initializer: Any = "uniform",
                 dtype: Any = "float32", default_value: float = 0.0, filter_freq: int = 1, bloom_counters: int = 0,
                 bloom_hashes: int = 3, max_pending: int = 1 << 20, steps_to_live: int = 0, capacity: int = 0,
                 evict_policy: str = "lru", sweep_every: int = 100, trainable: bool = True):
        if not isinstance(name, str) or not name or ":" in name:
            raise RuntimeConfigError("name", name, "must be a non-empty string without ':'")
        if key_dtype not in _KEY_DTYPES:
            raise RuntimeConfigError("key_dtype", key_dtype, f"must be one of {list(_KEY_DTYPES)}")
        try:
            config = TableConfig.from_dict({
                "dim": dim, "dtype": np.dtype(dtype).name, "initializer": _initializer_spec(initializer),
                "default_value": default_value, "filter_freq": filter_freq, "max_pending": max_pending,
                "bloom_counters": bloom_counters, "bloom_hashes": bloom_hashes, "steps_to_live": steps_to_live,
                "capacity": capacity, "evict_policy": evict_policy, "sweep_every": sweep_every,
            }, "DynamicEmbedding")
        except TypeError as err:
            raise RuntimeConfigError("dtype", dtype, f"must be a float dtype ({err})") from None
        except ValueError as err:
            raise RuntimeConfigError("DynamicEmbedding", name, str(err)) from None
        self._local: DynamicTable | None = None
        self._transport: Any = None
        self._init(name, name, config, key_dtype, trainable)
        strategy = _context.current_strategy()
        if strategy is None:
            self._local = DynamicTable(name, config)
            return
        strategy.wait_for_parameter_servers()
        self._key = strategy._unique_name(name)
        self._num_ps = strategy.num_ps
        self._transport = strategy.transport
        self._transport.call_many({ps: (PS.CREATE_DYNAMIC, CreateDynamicRequest(name=self._key, config=config.as_dict()), ())
                                   for ps in range(self._num_ps)})

    def _init(self, name: str, key: str, config: TableConfig, key_dtype: str, trainable: bool) -> None:
        self._name = name
        self._key = key
        self.config = config
        self.key_dtype = key_dtype
        self.trainable = trainable
        self._local = None
        self._num_ps = 0
        self._transport = None

    # -- what a user sees ----------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    @property
    def key(self) -> str:
        """The table's unique name on the parameter servers."""
        return self._key

    @property
    def dim(self) -> int:
        return self.config.dim

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.config.dtype)

    @property
    def shape(self) -> tuple[int | None, int]:
        """``(None, dim)``: the number of rows is not fixed."""
        return (None, self.config.dim)

    @property
    def is_remote(self) -> bool:
        return self._local is None

    @property
    def local_table(self) -> DynamicTable | None:
        """The rows of a table made outside ``strategy.scope()`` (``None`` for a table on the parameter servers)."""
        return self._local

    @property
    def num_shards(self) -> int:
        return self._num_ps if self.is_remote else 1

    @property
    def transport(self) -> Any:
        if self._transport is None:
            raise RuntimeError(f"dynamic table {self._name!r} is a handle but this process has no connection to "
                               "the parameter servers (handles work on the coordinator and in scheduled functions)")
        return self._transport

    def __repr__(self) -> str:
        where = f" shards={self._num_ps}" if self.is_remote else " local"
        return f"<kubeps.DynamicEmbedding {self._name!r} dim={self.dim} dtype={self.config.dtype}{where}>"

    def to_keys(self, ids: Any) -> np.ndarray:
        """Ids as the table's int64 keys (strings hashed when ``key_dtype="string"``)."""
        arr = np.asarray(ids)
        if self.key_dtype == "int64" and arr.dtype.kind not in "iu":
            raise RuntimeConfigError("ids", f"array of dtype {arr.dtype}",
                                     f"table {self._name!r} has key_dtype 'int64': ids must be integers")
        try:
            return to_keys(arr, "ids")
        except ValueError as err:
            raise RuntimeConfigError("ids", f"array of dtype {arr.dtype}", str(err)) from None

    # -- lookups -------------------------------------------------------------------------------------------------
    def lookup(self, ids: Any, train: bool | None = None) -> np.ndarray:
        """Rows for ``ids`` (any shape): ``ids.shape + (dim,)``. ``train`` (default: inside a scheduled function,
        and always for a table in this process) counts the ids for admission and creates rows; otherwise unknown ids read ``default_value`` and nothing
        changes."""
        keys, _, inverse, rows = self.gather_unique(ids, train)
        return rows[inverse].reshape(keys.shape + (self.dim,))

    def gather_unique(self, ids: Any, train: bool | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                         np.ndarray]:
        """``(keys, unique, inverse, rows)``: ``rows[i]`` is the row of ``unique[i]``, ``keys.reshape(-1) ==
        unique[inverse]``. The gradient of ``rows`` is the table's gradient over ``unique``."""
        keys = self.to_keys(ids)
        unique, inverse, counts = np.unique(keys.reshape(-1), return_inverse=True, return_counts=True)
        inverse = inverse.reshape(-1)
        if train is None:  # training where training runs: in a scheduled function, or in-process for a local table
            train = (self._local is not None or _context.current_closure_context() is not None) \
                and not _context.lookups_frozen()
        if self._local is not None:
            with self._local.lock:
                return keys, unique, inverse, self._local.lookup(unique, counts, train)
        return keys, unique, inverse, self._remote_lookup(unique, counts, train)

    def _remote_lookup(self, unique: np.ndarray, counts: np.ndarray, train: bool) -> np.ndarray:
        transport = self.transport
        shard = shard_of(unique, self._num_ps)
        positions = {ps: np.flatnonzero(shard == ps) for ps in range(self._num_ps)}
        ctx = _context.current_closure_context()
        dense: dict[int, list[str]] = {}  # a batched pull of the dense variables still due rides on these calls
        if ctx is not None and ctx.transport is transport:
            for handle in ctx.take_prefetch():
                assert handle.ps_index is not None, "the closure context registers remote variables only"
                dense.setdefault(handle.ps_index, []).append(handle.key)
        calls = {}
        for ps in range(self._num_ps):
            pos = positions[ps]
            if pos.size or ps in dense:
                spec = [DynamicLookup(name=self._key, train=bool(train))] if pos.size else []
                tensors = [unique[pos], counts[pos].astype(np.int64)] if pos.size else []
                calls[ps] = (PS.LOOKUP_DYNAMIC, LookupDynamicRequest(names=dense.get(ps, []), rows=[], dynamic=spec),
                             tensors)
        rows = np.empty((unique.size, self.dim), dtype=self.dtype)
        for ps, (_, arrays) in _calls(transport, calls).items():
            values = dense.get(ps, [])
            if values:
                assert ctx is not None, "dense is only filled from the closure context"
                ctx.store(values, arrays[: len(values)])
                ctx.pulls += 1
            if positions[ps].size:
                rows[positions[ps]] = arrays[len(values)]
        return rows

    # -- gradients -----------------------------------------------------------------------------------------------
    def push_parts(self, grad: Any) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """A gradient (``IndexedSlices`` with keys as indices) split by parameter server: ``[(ps, keys, rows)]``
        (duplicate keys are summed on the ps, by the optimizer's sparse update)."""
        if not isinstance(grad, IndexedSlices):
            raise RuntimeConfigError(f"gradient of {self._name!r}", type(grad).__name__,
                                     "a dynamic table takes an IndexedSlices whose indices are its keys")
        values = np.asarray(grad.values)
        if values.shape[1:] != (self.dim,):
            raise RuntimeConfigError(f"gradient of {self._name!r}", f"rows of shape {list(values.shape[1:])}",
                                     f"must be rows of dim {self.dim}")
        keys = self.to_keys(grad.indices).reshape(-1)
        values = values.astype(self.dtype, copy=False)
        if self._num_ps <= 1:
            return [(0, keys, values)]
        shard = shard_of(keys, self._num_ps)
        return [(ps, keys[shard == ps], values[shard == ps]) for ps in range(self._num_ps) if (shard == ps).any()]

    def apply_local_update(self, optimizer: Any, grad: Any) -> None:
        """Apply a gradient to a table in this process (what a push does on a ps)."""
        from kubeps.runtime.rpc.protocol import slot_key  # noqa: PLC0415 - kept beside its one use

        assert self._local is not None, "only a local table is updated in this process"
        self._num_ps = 1
        try:
            for _, keys, rows in self.push_parts(grad):
                with self._local.lock:
                    checked = self._local.check_push(optimizer, keys, rows)
                    self._local.apply_push(optimizer, slot_key(optimizer.get_config()), keys, checked)
        finally:
            self._num_ps = 0

    # -- the whole table -----------------------------------------------------------------------------------------
    def _info(self) -> list[DynamicTableInfo]:
        if self._local is not None:
            t = self._local
            with t.lock:
                return [DynamicTableInfo(name=t.name, size=t.size, updates=t.updates, evicted=t.evicted,
                                         nbytes=t.nbytes, capacity=t.config.capacity)]
        results = _calls(self.transport, {ps: (PS.DYNAMIC_INFO, DynamicInfoRequest(names=[self._key]), ())
                                          for ps in range(self._num_ps)})
        return [results[ps][0]["tables"][0] for ps in range(self._num_ps)]

    def size(self) -> int:
        """The number of live rows, over every shard."""
        return sum(int(i["size"]) for i in self._info())

    def shard_info(self) -> list[DynamicTableInfo]:
        """Per shard: ``size``, ``updates``, ``evicted`` (rows evicted so far), ``nbytes`` (memory), ``capacity``."""
        return self._info()

    def export(self, with_metadata: bool = False) -> tuple[np.ndarray, ...]:
        """``(keys, values)`` of every live row (``+ (freqs, steps)`` with ``with_metadata``), shard after shard."""
        parts = self.export_shards()
        out = [np.concatenate([p[i] for p in parts]) for i in range(4 if with_metadata else 2)]
        return tuple(out)

    def export_shards(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                          dict[str, dict[str, np.ndarray]], int]]:
        """Per shard: ``(keys, values, freqs, steps, {optimizer key: {slot: rows}}, updates)``."""
        if self._local is not None:
            with self._local.lock:
                keys, values, local_slots, freqs, steps = self._local.export()
                return [(keys, values, freqs, steps, local_slots, self._local.updates)]
        results = _calls(self.transport, {ps: (PS.EXPORT_DYNAMIC, TableNameRequest(name=self._key), ())
                                          for ps in range(self._num_ps)})
        out = []
        for ps in range(self._num_ps):
            meta, arrays = results[ps]
            slots: dict[str, dict[str, np.ndarray]] = {}
            for (okey, sname), arr in zip(meta["slots"], arrays[4:]):
                slots.setdefault(okey, {})[sname] = arr
            out.append((arrays[0], arrays[1], arrays[2], arrays[3], slots, meta["updates"]))
        return out

    # -- pickling: remote tables travel as handles ---------------------------------------------------------------
    def __reduce__(self):
        if self._local is not None:
            raise TypeError(f"dynamic table {self._name!r} lives in this process (made outside strategy.scope()) "
                            "and cannot be sent to a worker; make it inside strategy.scope()")
        return (_rebuild_handle, (self._name, self._key, self.config.as_dict(), self.key_dtype, self.trainable,
                                  self._num_ps))


def _rebuild_handle(name: str, key: str, config: dict[str, Any], key_dtype: str, trainable: bool,
                    num_ps: int) -> DynamicEmbedding:
    table = object.__new__(DynamicEmbedding)
    table._init(name, key, TableConfig.from_dict(config), key_dtype, trainable)
    table._num_ps = num_ps
    ctx = _context.current_closure_context()
    table._transport = ctx.transport if ctx is not None else None
    return table


def dynamic_tables(variables: Sequence[Any]) -> list[DynamicEmbedding]:
    """The dynamic tables among ``variables``."""
    return [v for v in variables if isinstance(v, DynamicEmbedding)]
