"""The shard side of a checkpoint: what a parameter server (or the coordinator, for local variables) does to save
and restore its shards, and the ``SaveShards``/``RestoreShards`` methods of the PS service."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol, Sequence, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError

from kubeps.runtime.rpc import protocol
from kubeps.runtime.rpc.protocol import (PS, RestoreDynamicRequest, RestoreShardsAnswer, RestoreShardsRequest,
                                          SaveDynamicRequest, SavedAnswer, SaveShardsRequest)
from kubeps.runtime.util.confined import confined_storage
from kubeps.runtime.util.storage import Storage, StorageError, confine, storage_for
from kubeps.runtime.checkpoint.format import (
    CheckpointError,
    CheckpointMismatchError,
    SliceEntry,
    TensorEntry,
    dtype_name,
    overlapping,
    read_rows,
    slice_file_name,
    write_array,
)


# -- the shard side: what a parameter server (or the coordinator, for local variables) does --------------------
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


class SaveItem(BaseModel):
    """Save shard ``key`` as rows ``start..stop-1`` of logical variable ``name`` (of full shape ``shape``); on the
    wire, :class:`kubeps.runtime.rpc.protocol.SaveItem` (:meth:`wire`)."""

    model_config = ConfigDict(extra="forbid")

    key: str
    name: str
    start: StrictInt
    stop: StrictInt
    shape: list[StrictInt]

    def wire(self) -> protocol.SaveItem:
        return {"key": self.key, "name": self.name, "start": self.start, "stop": self.stop, "shape": list(self.shape)}


class SavedShard(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: str
    value: SliceEntry
    dtype: str
    #: {optimizer key: {slot: (slice, dtype, trailing shape)}}
    slots: dict[str, dict[str, tuple[SliceEntry, str, list[int]]]] = {}


class RestoreItem(BaseModel):
    """Load rows ``start..stop-1`` of the checkpointed ``value`` (and slots) into shard ``key``; on the wire,
    :class:`kubeps.runtime.rpc.protocol.RestoreItem` (:meth:`wire`)."""

    model_config = ConfigDict(extra="forbid")

    key: str
    name: str
    start: StrictInt
    stop: StrictInt
    value: TensorEntry
    slots: dict[str, dict[str, TensorEntry]] = {}

    def wire(self) -> protocol.RestoreItem:
        return {"key": self.key, "name": self.name, "start": self.start, "stop": self.stop,
                "value": self.value.model_dump(mode="json"),
                "slots": {okey: {s: e.model_dump(mode="json") for s, e in group.items()}
                          for okey, group in self.slots.items()}}


def _check_save_item(item: SaveItem, shape: tuple[int, ...], dtype: Any) -> None:
    expected = (item.stop - item.start,) + tuple(item.shape[1:]) if item.shape else ()
    if tuple(shape) != expected or item.start < 0 or (item.shape and item.stop > item.shape[0]):
        raise CheckpointError(
            f"variable {item.name!r}: shard {item.key!r} has shape {list(shape)}, expected "
            f"{list(expected)} for rows {item.start}..{item.stop - 1} of shape {item.shape}"
        )
    dtype_name(dtype, f"variable {item.name!r}")


def save_items(access: ShardAccess, directory: str, items: Sequence[SaveItem], parallel: int = 4,
               storage: Storage | None = None) -> list[SavedShard]:
    """Write each shard (and its slots) to its own files; returns what the manifest needs to know.

    Every item is checked (the shard exists, its shape and dtype) before the first file is written, and the files
    of a save that fails half-way are removed: a refused save leaves nothing behind. ``storage`` defaults to
    :func:`~kubeps.runtime.util.storage.storage_for`'s (a ps passes its confined one)."""
    storage = storage_for(directory) if storage is None else storage
    for item in items:
        _check_save_item(item, *access.describe(item.key))
    written: list[str] = []

    def one(item: SaveItem) -> SavedShard:
        value, slots, updates = access.snapshot(item.key)
        _check_save_item(item, value.shape, value.dtype)  # it may have been re-created since
        dtype = dtype_name(value.dtype, f"variable {item.name!r}")
        fname = slice_file_name(item.name, item.start, item.stop)
        written.append(storage.join(directory, fname))
        sha, nbytes = write_array(storage, storage.join(directory, fname), value)
        saved_slots: dict[str, dict[str, tuple[SliceEntry, str, list[int]]]] = {}
        for okey, group in slots.items():
            for sname, arr in group.items():
                arr = np.asarray(arr)
                if arr.ndim != value.ndim or (value.ndim and arr.shape[0] != value.shape[0]):
                    raise CheckpointError(
                        f"variable {item.name!r}: slot {sname!r} has shape {list(arr.shape)}; checkpoints need "
                        f"slots with the variable's rows and rank (shard shape {list(value.shape)})"
                    )
                sfile = slice_file_name(item.name, item.start, item.stop, okey, sname)
                written.append(storage.join(directory, sfile))
                ssha, sbytes = write_array(storage, storage.join(directory, sfile), arr)
                saved_slots.setdefault(okey, {})[sname] = (
                    SliceEntry(start=item.start, stop=item.stop, file=sfile, sha256=ssha, nbytes=sbytes),
                    dtype_name(arr.dtype, f"variable {item.name!r} slot {sname!r}"),
                    list(arr.shape[1:]),
                )
        entry = SliceEntry(start=item.start, stop=item.stop, file=fname, sha256=sha, nbytes=nbytes,
                           updates=int(updates))
        return SavedShard(key=item.key, value=entry, dtype=dtype, slots=saved_slots)

    try:
        if len(items) <= 1 or parallel <= 1:
            return [one(i) for i in items]
        with ThreadPoolExecutor(max_workers=min(parallel, len(items)), thread_name_prefix="ckpt-save") as pool:
            return list(pool.map(one, items))
    except BaseException:
        for path in written:  # all-or-nothing: what this save wrote before it failed goes again
            storage.remove(path)
        raise


def restore_items(access: ShardAccess, directory: str, items: Sequence[RestoreItem], parallel: int = 4,
                  storage: Storage | None = None) -> int:
    """Read and verify everything first, then load each shard; returns the number of shards loaded."""
    storage = storage_for(directory) if storage is None else storage

    def read(item: RestoreItem):
        what = f"variable {item.name!r}"
        shape, dtype = access.describe(item.key)
        expected = (item.stop - item.start,) + tuple(item.value.shape[1:]) if item.value.shape else ()
        if tuple(shape) != expected or np.dtype(dtype) != np.dtype(item.value.dtype):
            raise CheckpointMismatchError(
                f"{what}: shard {item.key!r} is shape {list(shape)} dtype {np.dtype(dtype).name}; the checkpoint "
                f"gives shape {list(expected)} dtype {item.value.dtype} for rows {item.start}..{item.stop - 1}"
            )
        value = read_rows(storage, directory, item.value, item.start, item.stop, what)
        updates = max((s.updates for s, _, _ in overlapping(item.value.slices, item.start, item.stop)), default=0)
        slots: dict[str, dict[str, np.ndarray]] = {}
        for okey, group in item.slots.items():
            for sname, entry in group.items():
                if list(entry.shape[1:]) != list(shape[1:]) or len(entry.shape) != len(shape) \
                        or np.dtype(entry.dtype) != np.dtype(dtype):
                    raise CheckpointMismatchError(
                        f"{what}: slot {sname!r} is shape {entry.shape} dtype {entry.dtype} in the checkpoint; a "
                        f"slot of shard {item.key!r} must have its trailing shape {list(shape[1:])} and dtype "
                        f"{np.dtype(dtype).name}"
                    )
                slots.setdefault(okey, {})[sname] = read_rows(
                    storage, directory, entry, item.start, item.stop, f"{what} slot {sname!r}"
                )
        return item.key, value, slots, updates

    if len(items) <= 1 or parallel <= 1:
        loaded = [read(i) for i in items]
    else:
        with ThreadPoolExecutor(max_workers=min(parallel, len(items)), thread_name_prefix="ckpt-read") as pool:
            loaded = list(pool.map(read, items))
    check = getattr(access, "check_load", None)  # a ps's state refuses more slot sets than it may hold
    if check is not None:
        for key, value, slots, _ in loaded:
            check(key, value, slots)
    for key, value, slots, updates in loaded:  # everything was read and checked: nothing below is refused
        access.load(key, value, slots, updates)
    return len(loaded)


ItemModel = TypeVar("ItemModel", bound=BaseModel)


def request_items(request: SaveShardsRequest | RestoreShardsRequest | SaveDynamicRequest | RestoreDynamicRequest,
                  model: type[ItemModel], roots: list[str]) -> tuple[str, list[ItemModel]]:
    """The request's directory -- normalised, and confined to the ps's checkpoint ``roots``
    (``KUBEPS_CHECKPOINT_ROOT``, :attr:`ConfinedShardAccess.checkpoint_roots`) before anything touches the file
    system -- and its items as ``model`` objects (the server validated the request's shape; the manifest entries an
    item carries are the manifest format's to check), each shard named once. The messages name the field; the
    server puts the method's name before them (``SaveShards: field 'directory' ...``)."""
    directory = request["directory"]
    if not directory:
        raise ValueError(f"field 'directory' must be a checkpoint directory path or URL, got {directory!r}")
    try:
        directory = confine(directory, roots)
    except StorageError as err:
        raise ValueError(str(err)) from None
    try:
        items = [model.model_validate(i) for i in request["items"]]
    except ValidationError as err:
        raise ValueError(f"field 'items' is malformed: {err}") from None
    keys = [getattr(i, "key", None) for i in items]  # every item model has one
    if len(set(keys)) != len(keys):
        raise ValueError(f"field 'items' names a shard more than once ({keys}); each once")
    return directory, items


def rpc_save_shards(state: ConfinedShardAccess, request: SaveShardsRequest,
                    arrays: list[Any]) -> tuple[SavedAnswer, list[Any]]:  # noqa: ARG001
    """PS method ``SaveShards``: ``{"directory", "items": [SaveItem]}`` -> ``{"saved": [SavedShard]}``."""
    directory, items = request_items(request, SaveItem, state.checkpoint_roots)
    saved = save_items(state, directory, items, storage=confined_storage(directory, state.checkpoint_roots))
    return {"saved": [s.model_dump(mode="json") for s in saved]}, []


def rpc_restore_shards(state: ConfinedShardAccess, request: RestoreShardsRequest,
                       arrays: list[Any]) -> tuple[RestoreShardsAnswer, list[Any]]:  # noqa: ARG001
    """PS method ``RestoreShards``: ``{"directory", "items": [RestoreItem]}`` -> ``{"restored": n}``."""
    directory, items = request_items(request, RestoreItem, state.checkpoint_roots)
    storage = confined_storage(directory, state.checkpoint_roots)
    return {"restored": restore_items(state, directory, items, storage=storage)}, []


#: the checkpoint methods of the parameter-server service (:mod:`kubeps.runtime.server.methods` serves them)
PS_METHODS: dict[str, Callable[..., tuple[Any, list[Any]]]] = {PS.SAVE_SHARDS: rpc_save_shards,
                                                                PS.RESTORE_SHARDS: rpc_restore_shards}

