"""The shard side of a checkpoint: what a parameter server (or the coordinator, for local variables) does to save
and restore its shards, and the ``SaveShards``/``RestoreShards`` methods of the PS service.

The items a save or restore carries are the protocol's declarations (:class:`~kubeps.runtime.rpc.protocol.SaveItem`,
:class:`~kubeps.runtime.rpc.protocol.RestoreItem`), in this process as on the wire; the manifest entries a
``RestoreItem`` carries are the manifest format's to check (:func:`~kubeps.runtime.checkpoint.format.parse_entry`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np

from kubeps.runtime.rpc.protocol import (PS, RestoreDynamicRequest, RestoreItem, RestoreShardsAnswer,
                                          RestoreShardsRequest, SaveDynamicRequest, SavedAnswer, SaveItem,
                                          SaveShardsRequest)
from kubeps.runtime.util.confined import confined_storage
from kubeps.runtime.util.storage import Storage, StorageError, confine, storage_for
from kubeps.runtime.checkpoint.format import (
    CheckpointError,
    CheckpointMismatchError,
    SavedDelta,
    SavedShard,
    Siblings,
    SliceEntry,
    TensorEntry,
    delta_file_name,
    dtype_name,
    overlapping,
    parse_entry,
    read_rows,
    sibling_directory,
    slice_file_name,
    space_error,
    write_array,
    write_streamed,
)

__all__ = ["PS_METHODS", "ConfinedShardAccess", "confined_siblings", "RestoreItem", "SaveItem", "SavedShard", "ShardAccess",
           "request_directory", "restore_items", "rpc_restore_shards", "rpc_save_shards", "save_items"]


# -- the shard side: what a parameter server (or the coordinator, for local variables) does --------------------
Rows = tuple[np.ndarray, dict[str, dict[str, np.ndarray]]]


@dataclass
class SaveView:
    """What a save of one variable writes, taken under its lock: the shard's ``updates`` and the save's ``source``
    and ``generation``; then either a delta -- the changed rows' ``ids`` (ascending), their ``value`` rows and
    ``slots`` rows, copied -- or a full save: the ``shape`` and ``dtype`` of the value and slots (``slots`` holds the
    live arrays, to be read only through ``chunks``), and ``chunks()``, which yields the rows chunk by chunk, each
    chunk copied under the lock. A full save so never holds a second copy of the shard: training goes on between
    chunks, and a row it changes meanwhile has the next generation, so the next delta holds it again."""

    updates: int
    source: str
    generation: int
    ids: np.ndarray | None = None
    value: np.ndarray | None = None
    slots: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    shape: tuple[int, ...] = ()
    dtype: np.dtype = field(default_factory=lambda: np.dtype(np.float32))
    chunks: Callable[[], Iterator[Rows]] | None = None


class ShardAccess(Protocol):
    """Snapshots and loads one shard with its optimizer state, each under the shard's lock
    (:class:`~kubeps.runtime.ps.state.ParameterServerState` is one)."""

    def snapshot(self, key: str) -> tuple[np.ndarray, dict[str, dict[str, np.ndarray]], int]: ...

    def load(self, key: str, value: np.ndarray, slots: dict[str, dict[str, np.ndarray]] | None,
             updates: int | None) -> None: ...

    def describe(self, key: str) -> tuple[tuple[int, ...], np.dtype]: ...


class ConfinedShardAccess(ShardAccess, Protocol):
    """A parameter server's shards: :class:`ShardAccess` that also says where its checkpoints may go."""

    #: the normalised ``KUBEPS_CHECKPOINT_ROOT`` of the task's settings ([]: anywhere absolute)
    checkpoint_roots: list[str]


def _check_save_item(item: SaveItem, shape: tuple[int, ...], dtype: Any) -> None:
    start, stop, full = item["start"], item["stop"], item["shape"]
    expected = (stop - start,) + tuple(full[1:]) if full else ()
    if tuple(shape) != expected or start < 0 or (full and stop > full[0]):
        raise CheckpointError(
            f"variable {item['name']!r}: shard {item['key']!r} has shape {list(shape)}, expected "
            f"{list(expected)} for rows {start}..{stop - 1} of shape {full}"
        )
    dtype_name(dtype, f"variable {item['name']!r}")


def save_items(access: ShardAccess, directory: str, items: Sequence[SaveItem], parallel: int = 4,
               storage: Storage | None = None) -> list[SavedShard]:
    """Write each shard (and its slots) to its own files; returns what the manifest needs to know.

    Every item is checked (the shard exists, its shape and dtype) before the first file is written, and the files
    of a save that fails half-way are removed: a refused save leaves nothing behind. ``storage`` defaults to
    :func:`~kubeps.runtime.util.storage.storage_for`'s (a ps passes its confined one). A ps's state gives a
    :class:`SaveView` of each shard: its changed rows (an item with ``since``), or its rows chunk by chunk, streamed
    into the files (no copy of the whole shard); local arrays are copied whole."""
    storage = storage_for(directory) if storage is None else storage
    for item in items:
        _check_save_item(item, *access.describe(item["key"]))
    written: list[str] = []
    sizes: list[int] = []
    #: a ps's state: which rows changed since a save, and its rows chunk by chunk; local arrays have no view
    view_of: Callable[[str, str | None, int | None], SaveView] | None = getattr(access, "save_view", None)

    def failed(err: OSError, path: str, needed: int) -> BaseException:
        full = space_error(err, path, needed, sum(sizes))
        return err if full is None else full

    def write(fname: str, array: np.ndarray) -> tuple[str, str, int]:
        path = storage.join(directory, fname)
        written.append(path)
        try:
            sha, nbytes = write_array(storage, path, array)
        except OSError as err:
            raise failed(err, path, array.nbytes) from None
        sizes.append(nbytes)
        return fname, sha, nbytes

    def stream(item: SaveItem, view: SaveView, names: list[tuple[str, str]]) -> list[tuple[str, str, int]]:
        start, stop, name = item["start"], item["stop"], item["name"]
        files = [slice_file_name(name, start, stop)] + [slice_file_name(name, start, stop, o, n) for o, n in names]
        paths = [storage.join(directory, f) for f in files]
        layouts = [(view.shape, view.dtype)] + [(view.slots[o][n].shape, view.slots[o][n].dtype) for o, n in names]
        written.extend(paths)
        chunks = view.chunks
        if chunks is None:
            raise CheckpointError(f"variable {name!r}: the ps gave neither changed rows nor its rows to save")

        def rows() -> Iterator[list[np.ndarray]]:
            for value, slots in chunks():
                yield [value] + [slots[o][n] for o, n in names]
        try:
            done = write_streamed(storage, paths, layouts, rows())
        except OSError as err:
            raise failed(err, directory, sum(int(np.prod(s)) * d.itemsize for s, d in layouts)) from None
        sizes.extend(n for _, n in done)
        return [(f, sha, n) for f, (sha, n) in zip(files, done)]

    def check_slot(name: str, sname: str, arr: np.ndarray, shape: tuple[int, ...]) -> None:
        if arr.ndim != len(shape) or (shape and arr.shape[0] != shape[0]):
            raise CheckpointError(
                f"variable {name!r}: slot {sname!r} has shape {list(arr.shape)}; checkpoints need "
                f"slots with the variable's rows and rank (shard shape {list(shape)})"
            )

    def delta(item: SaveItem, dtype: str, view: SaveView) -> SavedShard:
        name, start, stop = item["name"], item["start"], item["stop"]
        if view.ids is None or view.value is None:
            raise CheckpointError(f"variable {name!r}: the ps gave changed rows without their ids or values")
        out = SavedDelta(rows=int(view.ids.size), updates=int(view.updates), source=view.source,
                         generation=view.generation)
        if view.ids.size:  # no row changed: no file
            out.ids = write(delta_file_name(name, start, stop, "ids"), view.ids + start)
            out.value = write(delta_file_name(name, start, stop, "value"), view.value)
            for okey, group in view.slots.items():
                for sname, arr in group.items():
                    check_slot(name, sname, arr, view.value.shape)
                    out.slots.setdefault(okey, {})[sname] = write(delta_file_name(name, start, stop, sname, okey), arr)
        return SavedShard(key=item["key"], dtype=dtype, delta=out)

    def one(item: SaveItem) -> SavedShard:
        key, name, start, stop = item["key"], item["name"], item["start"], item["stop"]
        tracked = "since" in item
        source, generation = "", 0
        if view_of is not None:
            since = item.get("since")
            view = view_of(key, since["source"] if since else None, since["generation"] if since else None)
            if view.ids is not None:
                return delta(item, dtype_name(view.dtype if view.value is None else view.value.dtype,
                                              f"variable {name!r}"), view)
            _check_save_item(item, view.shape, view.dtype)  # it may have been re-created since
            dtype, updates, slots = dtype_name(view.dtype, f"variable {name!r}"), view.updates, view.slots
            if tracked:
                source, generation = view.source, view.generation
            names = [(o, n) for o, g in slots.items() for n in g]
            for o, n in names:
                check_slot(name, n, slots[o][n], view.shape)
            value_file, *slot_files = stream(item, view, names)
        else:
            value, slots, updates = access.snapshot(key)
            _check_save_item(item, value.shape, value.dtype)
            dtype = dtype_name(value.dtype, f"variable {name!r}")
            names = [(o, n) for o, g in slots.items() for n in g]
            for o, n in names:
                check_slot(name, n, np.asarray(slots[o][n]), value.shape)
            value_file = write(slice_file_name(name, start, stop), value)
            slot_files = [write(slice_file_name(name, start, stop, o, n), np.asarray(slots[o][n])) for o, n in names]
        saved_slots: dict[str, dict[str, tuple[SliceEntry, str, list[int]]]] = {}
        for (okey, sname), (sfile, ssha, sbytes) in zip(names, slot_files):
            arr = slots[okey][sname]
            saved_slots.setdefault(okey, {})[sname] = (
                SliceEntry(start=start, stop=stop, file=sfile, sha256=ssha, nbytes=sbytes),
                dtype_name(arr.dtype, f"variable {name!r} slot {sname!r}"),
                list(arr.shape[1:]),
            )
        fname, sha, nbytes = value_file
        entry = SliceEntry(start=start, stop=stop, file=fname, sha256=sha, nbytes=nbytes, updates=int(updates),
                           source=source, generation=generation)
        return SavedShard(key=key, value=entry, dtype=dtype, slots=saved_slots)

    try:
        if len(items) <= 1 or parallel <= 1:
            return [one(i) for i in items]
        with ThreadPoolExecutor(max_workers=min(parallel, len(items)), thread_name_prefix="ckpt-save") as pool:
            return list(pool.map(one, items))
    except BaseException:
        for path in written:  # all-or-nothing: what this save wrote before it failed goes again
            storage.remove(path)
        raise


def _restore_entries(item: RestoreItem, index: int) -> tuple[TensorEntry, dict[str, dict[str, TensorEntry]]]:
    """The manifest entries restore item ``index`` carries: its value's and its slots'."""
    field = f"items[{index}]"
    value = parse_entry(TensorEntry, item["value"], f"{field}.value")
    slots = {okey: {sname: parse_entry(TensorEntry, raw, f"{field}.slots.{okey}.{sname}")
                    for sname, raw in group.items()}
             for okey, group in item.get("slots", {}).items()}
    return value, slots


def restore_items(access: ShardAccess, directory: str, items: Sequence[RestoreItem], parallel: int = 4,
                  storage: Storage | None = None, siblings: Siblings | None = None) -> int:
    """Read and verify everything first, then load each shard; returns the number of shards loaded. ``siblings``
    says where the files of the earlier checkpoints an incremental one names are read (default: beside
    ``directory``, with ``storage``)."""
    storage = storage_for(directory) if storage is None else storage
    entries = [_restore_entries(item, index) for index, item in enumerate(items)]

    def read(job: tuple[RestoreItem, tuple[TensorEntry, dict[str, dict[str, TensorEntry]]]]):
        item, (entry_value, entry_slots) = job
        key, start, stop = item["key"], item["start"], item["stop"]
        what = f"variable {item['name']!r}"
        shape, dtype = access.describe(key)
        expected = (stop - start,) + tuple(entry_value.shape[1:]) if entry_value.shape else ()
        if tuple(shape) != expected or np.dtype(dtype) != np.dtype(entry_value.dtype):
            raise CheckpointMismatchError(
                f"{what}: shard {key!r} is shape {list(shape)} dtype {np.dtype(dtype).name}; the checkpoint "
                f"gives shape {list(expected)} dtype {entry_value.dtype} for rows {start}..{stop - 1}"
            )
        value = read_rows(storage, directory, entry_value, start, stop, what, siblings)
        updates = max((s.updates for s, _, _ in overlapping(entry_value.slices, start, stop)), default=0)
        slots: dict[str, dict[str, np.ndarray]] = {}
        for okey, group in entry_slots.items():
            for sname, entry in group.items():
                if list(entry.shape[1:]) != list(shape[1:]) or len(entry.shape) != len(shape) \
                        or np.dtype(entry.dtype) != np.dtype(dtype):
                    raise CheckpointMismatchError(
                        f"{what}: slot {sname!r} is shape {entry.shape} dtype {entry.dtype} in the checkpoint; a "
                        f"slot of shard {key!r} must have its trailing shape {list(shape[1:])} and dtype "
                        f"{np.dtype(dtype).name}"
                    )
                slots.setdefault(okey, {})[sname] = read_rows(
                    storage, directory, entry, start, stop, f"{what} slot {sname!r}", siblings
                )
        return key, value, slots, updates

    jobs = list(zip(items, entries))
    if len(jobs) <= 1 or parallel <= 1:
        loaded = [read(job) for job in jobs]
    else:
        with ThreadPoolExecutor(max_workers=min(parallel, len(jobs)), thread_name_prefix="ckpt-read") as pool:
            loaded = list(pool.map(read, jobs))
    check = getattr(access, "check_load", None)  # a ps's state refuses more slot sets than it may hold
    if check is not None:
        for key, value, slots, _ in loaded:
            check(key, value, slots)
    for key, value, slots, updates in loaded:  # everything was read and checked: nothing below is refused
        access.load(key, value, slots, updates)
    return len(loaded)


def request_directory(request: SaveShardsRequest | RestoreShardsRequest | SaveDynamicRequest | RestoreDynamicRequest,
                      roots: list[str]) -> str:
    """The request's directory -- normalised, and confined to the ps's checkpoint ``roots``
    (``KUBEPS_CHECKPOINT_ROOT``, :attr:`ConfinedShardAccess.checkpoint_roots`) before anything touches the file
    system -- once its items (which the server validated against their declarations; the manifest entries an item
    carries are the manifest format's to check) are found to name each shard once. The messages name the field; the
    server puts the method's name before them (``SaveShards: field 'directory' ...``)."""
    directory = request["directory"]
    if not directory:
        raise ValueError(f"field 'directory' must be a checkpoint directory path or URL, got {directory!r}")
    try:
        directory = confine(directory, roots)
    except StorageError as err:
        raise ValueError(str(err)) from None
    keys = [item["key"] for item in request["items"]]
    if len(set(keys)) != len(keys):
        raise ValueError(f"field 'items' names a shard more than once ({keys}); each once")
    return directory


def rpc_save_shards(state: ConfinedShardAccess, request: SaveShardsRequest,
                    arrays: list[Any]) -> tuple[SavedAnswer, list[Any]]:  # noqa: ARG001
    """PS method ``SaveShards``: ``{"directory", "items": [SaveItem]}`` -> ``{"saved": [SavedShard]}``."""
    directory = request_directory(request, state.checkpoint_roots)
    saved = save_items(state, directory, request["items"],
                       storage=confined_storage(directory, state.checkpoint_roots))
    return {"saved": [s.model_dump(mode="json") for s in saved]}, []


def rpc_restore_shards(state: ConfinedShardAccess, request: RestoreShardsRequest,
                       arrays: list[Any]) -> tuple[RestoreShardsAnswer, list[Any]]:  # noqa: ARG001
    """PS method ``RestoreShards``: ``{"directory", "items": [RestoreItem]}`` -> ``{"restored": n}``."""
    directory = request_directory(request, state.checkpoint_roots)
    storage = confined_storage(directory, state.checkpoint_roots)
    return {"restored": restore_items(state, directory, request["items"], storage=storage,
                                      siblings=confined_siblings(directory, state.checkpoint_roots))}, []


def confined_siblings(directory: str, roots: list[str]) -> Siblings:
    """Where a ps reads the files of checkpoint ``ckpt-<n>`` beside ``directory`` that an incremental checkpoint
    names: confined to the ps's checkpoint ``roots`` as the request's own directory is."""
    def locate(number: int) -> tuple[Storage, str]:
        try:
            path = confine(sibling_directory(directory, number), roots)
        except StorageError as err:
            raise ValueError(str(err)) from None
        return confined_storage(path, roots), path
    return locate


#: the checkpoint methods of the parameter-server service (:mod:`kubeps.runtime.server.methods` serves them)
PS_METHODS: dict[str, Callable[..., tuple[Any, list[Any]]]] = {PS.SAVE_SHARDS: rpc_save_shards,
                                                                PS.RESTORE_SHARDS: rpc_restore_shards}

