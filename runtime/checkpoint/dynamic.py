"""Dynamic embedding tables in checkpoints: only their live rows, per shard, restored into any number of shards.

Saving: every parameter server writes its shard of a table (``SaveDynamic``; :func:`save_table`) -- keys, values,
counts, last-update steps, optimizer slots with their initial rows, the update and eviction counts and the
admission state -- as verified ``.npy`` files, and answers a :class:`~kubeps.runtime.checkpoint.format.
DynamicShardEntry`; the coordinator puts them together under ``dynamic`` in the manifest (:func:`save_tables`).

Restoring into ``n`` shards (``RestoreDynamic``; :func:`restore_table`): shard ``j`` reads the saved shards its keys
can come from (its own when the number of shards is the same, all of them otherwise), checks every file's size and
sha256 and that every key sits on the shard the table's hash gives it, keeps the keys that hash to ``j`` of ``n``
and replaces its table with them -- after everything was read and checked, so a refused restore changes nothing on
that shard. A row's age (updates of its shard since it was last updated: what ``steps_to_live`` and ``lru`` look
at) is kept: with another number of shards a shard's update count is the highest of the saved shards' and every
row's last-update step moves with it. Exact admission counts move with their keys; a counting Bloom filter is kept
per shard when the number of shards is the same and is the saturating sum of the saved filters otherwise (an
estimate that is never below the true count, as before).

The coordinator side (:class:`TableSaveable`, :func:`save_tables`, :func:`restore_tables`) reaches a table's
shards through its handle: in this process for a table made outside ``strategy.scope()``, else one call per
parameter server.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kubeps.runtime.checkpoint.format import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    DynamicShardEntry,
    DynamicTableEntry,
    SliceEntry,
    TensorEntry,
    dynamic_file_name,
    parse_entry,
    read_rows,
    short_listing,
    tensor_rows,
    write_array,
)
from kubeps.runtime.rpc.protocol import PS, RestoreDynamicRequest, RestoreTableItem, SaveDynamicRequest, SaveTableItem
from kubeps.runtime.rpc.transport import PSTransport
from kubeps.runtime.util.keyhash import SHARD_SEED, shard_of
from kubeps.runtime.util.storage import Storage, storage_for
from kubeps.runtime.variables.dynamic import DynamicEmbedding
from kubeps.runtime.variables.dynamic_table import DynamicTable

__all__ = ["RestoreTableItem", "SaveTableItem", "TableSaveable", "check_table", "load_table", "prepare_restore",
           "restore_table", "restore_tables", "save_table", "save_tables", "table_hash", "verify_table"]

_INT32_MAX = np.iinfo(np.int32).max


def table_hash() -> str:
    """What the manifest records as the tables' key -> shard hash (``keyhash.shard_of``)."""
    return f"splitmix64-high32-mod-shards/seed={SHARD_SEED:#x}"


# -- the shard side --------------------------------------------------------------------------------------------
def save_table(table: DynamicTable, directory: str, item: SaveTableItem,
               storage: Storage | None = None) -> DynamicShardEntry:
    """Write one shard of a table (a consistent copy, taken under its lock); a save that fails half-way removes
    what it wrote. ``storage``: :func:`~kubeps.runtime.util.storage.storage_for`'s unless given (a ps's confined)."""
    storage = storage_for(directory) if storage is None else storage
    with table.lock:
        state = table.checkpoint_state()
    written: list[str] = []

    def put(part: str, array: np.ndarray, optimizer: str | None = None) -> TensorEntry:
        array = np.ascontiguousarray(array)
        rows = tensor_rows(array.shape)
        slices = []
        if rows:
            fname = dynamic_file_name(item["name"], item["shard"], part, optimizer)
            written.append(storage.join(directory, fname))
            sha, nbytes = write_array(storage, written[-1], array)
            slices = [SliceEntry(start=0, stop=rows, file=fname, sha256=sha, nbytes=nbytes)]
        return TensorEntry(shape=list(array.shape), dtype=array.dtype.name, slices=slices)

    try:
        optional = {part: put(part, state[part]) for part in ("pending_keys", "pending_counts", "bloom")
                    if state[part] is not None}
        return DynamicShardEntry(
            shard=item["shard"], rows=int(state["keys"].size), updates=int(state["updates"]),
            evicted=int(state["evicted"]), keys=put("keys", state["keys"]), values=put("values", state["values"]),
            freqs=put("freqs", state["freqs"]), steps=put("steps", state["steps"]),
            slots={okey: {s: put(s, a, okey) for s, a in group.items()} for okey, group in state["slots"].items()},
            slot_init={okey: {s: [float(x) for x in np.asarray(v).reshape(-1)] for s, v in group.items()}
                       for okey, group in state["slot_init"].items()},
            **optional)
    except BaseException:
        for path in written:
            storage.remove(path)
        raise


def _check_owner(keys: np.ndarray, shard: DynamicShardEntry, entry: DynamicTableEntry, what: str) -> np.ndarray:
    """``keys`` of a saved shard, refused unless the table's hash puts every one on that shard."""
    owner = shard_of(keys, entry.num_shards)
    wrong = np.flatnonzero(owner != shard.shard)
    if wrong.size:
        raise CheckpointCorruptError(
            f"{what}: shard {shard.shard} of {entry.num_shards} holds key {int(keys[wrong[0]])}, which the "
            f"table's hash ({entry.hash}) puts on shard {int(owner[wrong[0]])}: the checkpoint is corrupt or "
            f"was written with another hash (this kubeps uses {table_hash()})")
    return keys


def verify_table(directory: str, name: str, entry: DynamicTableEntry) -> None:
    """Read every file of a checkpointed table (size, header, sha256) and check every key is on its shard, one
    file at a time; raises a :class:`CheckpointCorruptError` naming the table, the shard and the part."""
    storage = storage_for(directory)
    what = f"dynamic table {name!r}"
    for shard in entry.shards:
        for part, t in shard.tensors().items():
            rows = read_rows(storage, directory, t, 0, tensor_rows(t.shape), f"{what} shard {shard.shard} {part}")
            if part == "keys":
                _check_owner(rows, shard, entry, what)


def read_table_shard(directory: str, item: RestoreTableItem, entry: DynamicTableEntry, dim: int, dtype: np.dtype,
                     storage: Storage | None = None) -> dict[str, Any]:
    """Everything shard ``item["shard"]`` of ``item["num_shards"]`` gets from the checkpoint's ``entry`` for the
    table (the item's ``table``, parsed), read and checked (files, keys on their shards, no key twice, the table's
    ``dim`` and ``dtype``): the arguments of
    :meth:`~kubeps.runtime.variables.dynamic_table.DynamicTable.restore_checkpoint`. Changes nothing."""
    what, shard_index, num_shards = f"dynamic table {item['name']!r}", item["shard"], item["num_shards"]
    if entry.dim != dim or np.dtype(entry.dtype) != dtype:
        raise CheckpointMismatchError(f"{what}: the checkpoint holds rows of dim {entry.dim} dtype {entry.dtype}; "
                                      f"the table on this ps has dim {dim} dtype {dtype.name}")
    if not 0 <= shard_index < num_shards:
        raise CheckpointError(f"{what}: shard {shard_index} of {num_shards} does not exist")
    storage = storage_for(directory) if storage is None else storage
    same = entry.num_shards == num_shards
    sources = [entry.shards[shard_index]] if same else entry.shards
    updates = sources[0].updates if same else max(s.updates for s in entry.shards)

    def read(shard: DynamicShardEntry, part: str, t: TensorEntry) -> np.ndarray:
        return read_rows(storage, directory, t, 0, tensor_rows(t.shape), f"{what} shard {shard.shard} {part}")

    parts: dict[str, list[np.ndarray]] = {"keys": [], "values": [], "freqs": [], "steps": [], "pending_keys": [],
                                          "pending_counts": []}
    slots: dict[str, dict[str, list[np.ndarray]]] = {}
    slot_init: dict[str, dict[str, np.ndarray]] = {}
    for shard in sources:
        keys = _check_owner(read(shard, "keys", shard.keys), shard, entry, what)
        mine = shard_of(keys, num_shards) == shard_index
        parts["keys"].append(keys[mine])
        parts["values"].append(read(shard, "values", shard.values)[mine])
        parts["freqs"].append(read(shard, "freqs", shard.freqs)[mine])
        # a row keeps its age: updates of its shard since it was last updated
        parts["steps"].append(updates - (shard.updates - read(shard, "steps", shard.steps)[mine].astype(np.int64)))
        for okey, group in shard.slots.items():
            for sname, t in group.items():
                slots.setdefault(okey, {}).setdefault(sname, []).append(read(shard, f"slot {okey}/{sname}", t)[mine])
                slot_init.setdefault(okey, {}).setdefault(sname, np.asarray(shard.slot_init[okey][sname], dtype=dtype))
        if shard.pending_keys is not None and shard.pending_counts is not None:
            pkeys = read(shard, "pending_keys", shard.pending_keys)
            pmine = shard_of(pkeys, num_shards) == shard_index
            parts["pending_keys"].append(pkeys[pmine])
            parts["pending_counts"].append(read(shard, "pending_counts", shard.pending_counts)[pmine])
    out: dict[str, Any] = {k: np.concatenate(v) if v else None for k, v in parts.items()}
    keys = out["keys"]
    uniq, counts = np.unique(keys, return_counts=True)
    if uniq.size != keys.size:
        raise CheckpointCorruptError(f"{what}: key {int(uniq[counts > 1][0])} is saved more than once")
    if any(len(a) != len(sources) for group in slots.values() for a in group.values()):
        raise CheckpointCorruptError(f"{what}: the saved shards hold slots of different optimizers "
                                     f"({short_listing(slots)}); every shard of a table holds the same slots")
    for okey, initial in slot_init.items():
        for sname, row in initial.items():
            if row.shape != (dim,):
                raise CheckpointCorruptError(f"{what}: the initial row of slot {okey}/{sname} has {row.size} values; "
                                             f"expected {dim}")
    out["slots"] = {okey: {s: np.concatenate(a) for s, a in group.items()} for okey, group in slots.items()}
    out["slot_init"] = slot_init
    out["freqs"] = np.minimum(out["freqs"].astype(np.int64), _INT32_MAX)
    out["updates"] = updates
    out["evicted"] = sources[0].evicted if same else 0
    out["bloom"] = _bloom(sources, same, lambda s, t: read(s, "bloom", t))
    return out


def _bloom(sources: list[DynamicShardEntry], same: bool,
           read: Callable[[DynamicShardEntry, TensorEntry], np.ndarray]) -> np.ndarray | None:
    """The shard's counting Bloom filter: its own with the same number of shards, else the saturating sum of all
    (never below a key's true count); ``None`` when the table did not count with one."""
    saved = [(s, s.bloom) for s in sources if s.bloom is not None]
    if not saved:
        return None
    filters = [read(s, t).astype(np.int64) for s, t in saved]
    if same or len({f.shape for f in filters}) != 1:
        return filters[0].astype(np.uint16)
    return np.minimum(np.sum(filters, axis=0), np.iinfo(np.uint16).max).astype(np.uint16)


def prepare_restore(table: DynamicTable, directory: str, item: RestoreTableItem,
                    max_slot_sets: int | None = None, storage: Storage | None = None, field: str = "table") -> dict[str, Any]:
    """Read and check what ``table`` gets from the checkpoint (:func:`read_table_shard`, and the number of slot
    sets it may hold); changes nothing. :func:`load_table` then loads it. The item's ``table`` is checked as the
    manifest format's :class:`~kubeps.runtime.checkpoint.format.DynamicTableEntry` (a ``ValueError`` naming
    ``field`` when it is not one)."""
    entry = parse_entry(DynamicTableEntry, item["table"], field)
    loaded = read_table_shard(directory, item, entry, table.config.dim, table.dtype, storage)
    if max_slot_sets is not None and len(loaded["slot_init"]) > max_slot_sets:
        raise CheckpointMismatchError(f"dynamic table {item['name']!r}: the checkpoint holds slots of "
                                      f"{len(loaded['slot_init'])} optimizers; a table here holds at most "
                                      f"{max_slot_sets}")
    if entry.config.get("bloom_hashes") != table.config.bloom_hashes:
        loaded["bloom"] = None  # other hash functions: the saved counters mean nothing here
    return loaded


def load_table(table: DynamicTable, loaded: dict[str, Any]) -> int:
    """Replace ``table`` with what :func:`prepare_restore` read; returns its rows."""
    with table.lock:
        table.restore_checkpoint(**loaded)
        return table.size


def restore_table(table: DynamicTable, directory: str, item: RestoreTableItem, max_slot_sets: int | None = None) -> int:
    """Replace ``table`` with its rows from the checkpoint (read and checked first); returns the rows loaded."""
    return load_table(table, prepare_restore(table, directory, item, max_slot_sets))


# -- the coordinator side --------------------------------------------------------------------------------------
@dataclass
class TableSaveable:
    """A dynamic table as a checkpoint sees it: ``name`` in the checkpoint, the handle reaching its shards."""

    name: str
    table: DynamicEmbedding


def _per_place(tables: list[TableSaveable], one: Callable[[TableSaveable, int], Any],
               call: Callable[[Any, int, list], list]) -> dict[str, list[Any]]:
    """Run ``one(saveable, shard)`` for every shard of every table: local tables here, remote ones as one
    ``call(transport, ps, items)`` per parameter server, in parallel; returns the answers by table and shard."""
    remote: dict[tuple[int, int], tuple[Any, int, list[tuple[TableSaveable, int]]]] = {}
    out: dict[str, list[Any]] = {t.name: [None] * t.table.num_shards for t in tables}
    local = []
    for t in tables:
        if not t.table.is_remote:
            local.append(t)
            continue
        for ps in range(t.table.num_shards):
            remote.setdefault((id(t.table.transport), ps), (t.table.transport, ps, []))[2].append((t, ps))

    def run(group: tuple[Any, int, list[tuple[TableSaveable, int]]]) -> None:
        transport, ps, pairs = group
        answers = call(transport, ps, [one(t, shard) for t, shard in pairs])
        if len(answers) != len(pairs):
            raise CheckpointError(f"/job:ps/task:{ps} answered {len(answers)} tables, {len(pairs)} were asked for")
        for (t, shard), answer in zip(pairs, answers):
            out[t.name][shard] = answer

    if remote:
        with ThreadPoolExecutor(max_workers=len(remote), thread_name_prefix="ckpt-tables") as pool:
            list(pool.map(run, list(remote.values())))
    for t in local:
        out[t.name][0] = one(t, 0)
    return out


def save_tables(tables: list[TableSaveable], directory: str, timeout: float | None = 600.0
                ) -> dict[str, DynamicTableEntry]:
    """Save every shard of every table where it lives; returns the manifest's ``dynamic`` entries."""

    def one(t: TableSaveable, shard: int) -> Any:
        item = SaveTableItem(key=t.table.key, name=t.name, shard=shard)
        local = t.table.local_table
        return item if local is None else save_table(local, directory, item)

    def call(transport: PSTransport, ps: int, items: list[SaveTableItem]) -> list[DynamicShardEntry]:
        request: SaveDynamicRequest = {"directory": directory, "items": items}
        meta, _ = transport.call(ps, PS.SAVE_DYNAMIC, request, (), timeout)
        return [parse_entry(DynamicShardEntry, s, f"saved[{i}]") for i, s in enumerate(meta["saved"])]

    shards = _per_place(tables, one, call)
    return {t.name: DynamicTableEntry(dim=t.table.dim, dtype=t.table.dtype.name, key_dtype=t.table.key_dtype,
                                      config=t.table.config.as_dict(), hash=table_hash(),
                                      num_shards=t.table.num_shards, shards=shards[t.name])
            for t in tables}


def check_table(t: TableSaveable, entry: DynamicTableEntry | None, path: str, holds: Any) -> DynamicTableEntry:
    """The checkpoint's entry for ``t``, refused (naming the table) when missing or of another shape."""
    what = f"dynamic table {t.name!r}"
    if entry is None:
        raise CheckpointMismatchError(f"{what} is not in checkpoint {path}; it holds dynamic tables "
                                      f"{short_listing(holds)}")
    found = (entry.dim, entry.dtype, entry.key_dtype)
    wanted = (t.table.dim, t.table.dtype.name, t.table.key_dtype)
    if found != wanted:
        raise CheckpointMismatchError(f"{what}: expected dim {wanted[0]} dtype {wanted[1]} key_dtype {wanted[2]!r}, "
                                      f"checkpoint {path} has dim {found[0]} dtype {found[1]} key_dtype {found[2]!r}")
    if entry.hash != table_hash():
        raise CheckpointMismatchError(f"{what}: checkpoint {path} placed keys with hash {entry.hash!r}; this kubeps "
                                      f"uses {table_hash()!r}")
    return entry


def restore_tables(tables: list[TableSaveable], entries: dict[str, DynamicTableEntry], directory: str,
                   timeout: float | None = 600.0, verify: bool = True) -> None:
    """Restore every shard of every table (checked with :func:`check_table` first) from ``entries``. Every file is
    verified first (:func:`verify_table`; ``verify=False``: the caller did), so a corrupt checkpoint is refused
    before any shard changes; each shard checks what it reads again."""
    if verify:
        for t in tables:
            verify_table(directory, t.name, entries[t.name])

    wired = {t.name: entries[t.name].model_dump(mode="json") for t in tables}

    def one(t: TableSaveable, shard: int) -> Any:
        item = RestoreTableItem(key=t.table.key, name=t.name, shard=shard, num_shards=t.table.num_shards,
                                table=wired[t.name])
        local = t.table.local_table
        return item if local is None else restore_table(local, directory, item)

    def call(transport: PSTransport, ps: int, items: list[RestoreTableItem]) -> list[int]:
        request: RestoreDynamicRequest = {"directory": directory, "items": items}
        meta, _ = transport.call(ps, PS.RESTORE_DYNAMIC, request, (), timeout)
        return meta["restored"]

    _per_place(tables, one, call)
