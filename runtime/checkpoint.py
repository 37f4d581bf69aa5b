"""Checkpoints: every parameter server writes its own shards, the coordinator commits a manifest last.

Layout of a checkpoint directory (local path, shared filesystem or an fsspec URL)::

    <directory>/ckpt-<N>/manifest.json                         committed last, atomically: the checkpoint exists
    <directory>/ckpt-<N>/<variable>-<hash>.value.<a>-<b>.npy   rows a..b-1 (axis 0) of a logical variable
    <directory>/ckpt-<N>/<variable>-<hash>.<slot>-<h>.<a>-<b>.npy  the same rows of an optimizer slot

Data files are plain ``.npy`` arrays (``numpy.load`` reads them); the manifest (:class:`Manifest`, JSON) lists
every logical variable with its full shape and dtype, the slices ``(start, stop)`` of axis 0 that make it up, the
file and sha256 of each slice, the optimizer slots beside it, the training step, the format version and whether
the training finished (``final``). A checkpoint directory without a manifest is the remains of an interrupted save:
it is ignored by readers and deleted by the next save.

Restoring reads, for every shard of the variables being restored, the slices that overlap the shard's rows, so
a checkpoint restores into any number of parameter servers and shards. Every file read is checked against its
size and sha256; a corrupt or incompatible checkpoint fails with a :class:`CheckpointError` that names the
variable and what was expected versus found.

Parameter servers do their part through two methods of the PS service, ``SaveShards`` and ``RestoreShards``
(:func:`rpc_save_shards`, :func:`rpc_restore_shards`), registered with :func:`register_ps_methods`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from . import npyfiles
from .storage import Storage, is_temporary, normalize_path, storage_for

__all__ = [
    "FORMAT_VERSION",
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointReader",
    "Manifest",
    "StepCounter",
    "latest_checkpoint",
    "list_checkpoints",
    "register_ps_methods",
    "verify_checkpoint",
]

log = logging.getLogger(__name__)

#: Version of the manifest format this module writes and reads.
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
CHECKPOINT_PREFIX = "ckpt-"
_CKPT_DIR = re.compile(r"^ckpt-(\d+)$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_SAFE_FILE = re.compile(r"^[A-Za-z0-9_.\-]+\.npy$")
#: Numeric dtype kinds a checkpoint can hold (bool, signed, unsigned, float, complex).
_DTYPE_KINDS = "biufc"
_READ_CHUNK = 4 << 20


# -- errors ----------------------------------------------------------------------------------------------------
class CheckpointError(Exception):
    """A checkpoint cannot be saved or restored; the message says what and where."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No (complete) checkpoint at the given path or in the given directory."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's files do not match its manifest (checksum, size, header), or the manifest is malformed."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint does not fit the objects being restored (missing variable, other shape or dtype)."""


# -- the manifest ----------------------------------------------------------------------------------------------
def _dtype_name(dtype: Any, what: str) -> str:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise CheckpointError(f"{what}: dtype {dtype!r} is not a numpy dtype") from None
    if dt.kind not in _DTYPE_KINDS or dt.fields is not None:
        raise CheckpointError(
            f"{what}: dtype {dt} cannot be checkpointed; allowed are bool, integer, float and complex dtypes"
        )
    return dt.name


def tensor_rows(shape: Sequence[int]) -> int:
    """Rows of axis 0 (slices are taken along it); a scalar counts as one row."""
    return int(shape[0]) if len(shape) else 1


class SliceEntry(BaseModel):
    """Rows ``start..stop-1`` of a logical tensor, stored in ``file`` (relative to the checkpoint directory)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    start: int
    stop: int
    file: str
    sha256: str
    nbytes: int
    #: optimizer update count of the shard these rows came from (learning-rate schedules, Adam's bias correction)
    updates: int = 0

    @field_validator("file")
    @classmethod
    def _relative_file(cls, value: str) -> str:
        if not _SAFE_FILE.match(value) or value.startswith("."):
            raise ValueError(f"file {value!r} must be a plain '.npy' file name inside the checkpoint directory")
        return value

    @field_validator("sha256")
    @classmethod
    def _hex(cls, value: str) -> str:
        if not _HEX64.match(value):
            raise ValueError(f"sha256 {value!r} must be 64 lowercase hex digits")
        return value

    @model_validator(mode="after")
    def _range(self) -> "SliceEntry":
        if self.start < 0 or self.stop <= self.start:
            raise ValueError(f"slice ({self.start}, {self.stop}) must have 0 <= start < stop")
        if self.nbytes < 0 or self.updates < 0:
            raise ValueError("nbytes and updates must be >= 0")
        return self


class TensorEntry(BaseModel):
    """One logical tensor: full shape and dtype, and the slices of axis 0 that cover it in order."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shape: list[int]
    dtype: str
    slices: list[SliceEntry]

    @field_validator("dtype")
    @classmethod
    def _numeric(cls, value: str) -> str:
        try:
            return _dtype_name(value, "dtype")
        except CheckpointError as err:
            raise ValueError(str(err)) from None

    @field_validator("shape")
    @classmethod
    def _dims(cls, value: list[int]) -> list[int]:
        if any(d < 0 for d in value):
            raise ValueError(f"shape {value} has a negative dimension")
        return value

    def covers_all_rows(self) -> None:
        """Raise ``ValueError`` unless the slices cover rows ``0..rows-1`` exactly, in order."""
        rows = tensor_rows(self.shape)
        pos = 0
        for s in self.slices:
            if s.start != pos:
                raise ValueError(
                    f"slices must cover rows 0..{rows - 1} in order without gaps or overlaps; "
                    f"slice ({s.start}, {s.stop}) follows row {pos - 1}"
                )
            pos = s.stop
        if pos != rows and not (rows == 0 and not self.slices):
            raise ValueError(f"slices cover rows 0..{pos - 1}; the tensor of shape {self.shape} has {rows} rows")


class VariableEntry(TensorEntry):
    """A logical variable, with its optimizer slots: ``{optimizer config key: {slot name: tensor}}``."""

    slots: dict[str, dict[str, TensorEntry]] = {}

    @model_validator(mode="after")
    def _complete(self) -> "VariableEntry":
        self.covers_all_rows()
        rows = tensor_rows(self.shape)
        for okey, slots in self.slots.items():
            for sname, slot in slots.items():
                try:
                    slot.covers_all_rows()
                except ValueError as err:
                    raise ValueError(f"slot {sname!r}: {err}") from None
                if tensor_rows(slot.shape) != rows or len(slot.shape) != len(self.shape):
                    raise ValueError(
                        f"slot {sname!r} has shape {slot.shape}; slots must have the variable's rows ({rows}) "
                        f"and rank ({len(self.shape)})"
                    )
        return self


class Manifest(BaseModel):
    """The committed description of one checkpoint (``manifest.json``)."""

    model_config = ConfigDict(extra="forbid")

    format_version: int
    checkpoint_number: int
    step: int | None = None
    final: bool = False
    created: float
    variables: dict[str, VariableEntry] = {}
    #: JSON state of objects with ``get_state``/``set_state`` (step counters, dataset positions, ...)
    objects: dict[str, Any] = {}

    @field_validator("format_version")
    @classmethod
    def _version(cls, value: int) -> int:
        if value != FORMAT_VERSION:
            raise ValueError(f"format_version {value} is not supported; this kubeps reads version {FORMAT_VERSION}")
        return value


# -- names -----------------------------------------------------------------------------------------------------
def _safe(text: str, limit: int = 60) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9_\-]", "_", text)[:limit]
    return f"{cleaned}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"


def slice_file_name(name: str, start: int, stop: int, optimizer: str | None = None, slot: str | None = None) -> str:
    """The data file name of rows ``start..stop-1`` of variable ``name`` (or of one of its slots)."""
    part = "value" if slot is None else _safe(f"{optimizer}\0{slot}", 24)
    return f"{_safe(name)}.{part}.{start}-{stop}.npy"


def checkpoint_path(directory: str, number: int) -> str:
    return storage_for(directory).join(normalize_path(directory), f"{CHECKPOINT_PREFIX}{number}")


# -- data files ------------------------------------------------------------------------------------------------
class _HashingWriter:
    def __init__(self, f):
        self._f = f
        self.hash = hashlib.sha256()
        self.nbytes = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.hash.update(view)
        self.nbytes += view.nbytes
        self._f.write(view)
        return view.nbytes


class _HashingReader:
    def __init__(self, f):
        self._f = f
        self.hash = hashlib.sha256()
        self.nbytes = 0

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.hash.update(data)
        self.nbytes += len(data)
        return data


def write_array(storage: Storage, path: str, array: np.ndarray) -> tuple[str, int]:
    """Write ``array`` as a ``.npy`` file (fsync'ed, atomic); returns ``(sha256 hex, size in bytes)``."""
    array = np.asarray(array)
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array).reshape(array.shape)  # ascontiguousarray makes scalars 1-D
    with storage.open_write_atomic(path) as f:
        writer = _HashingWriter(f)
        np.lib.format.write_array(writer, array, allow_pickle=False)
    return writer.hash.hexdigest(), writer.nbytes


def _read_exact(reader: _HashingReader, n: int, what: str, path: str) -> bytes:
    parts = []
    left = n
    while left > 0:
        chunk = reader.read(min(left, _READ_CHUNK))
        if not chunk:
            raise CheckpointCorruptError(
                f"{what}: file {path} is truncated: it ends after {reader.nbytes} bytes, before the data it "
                "declares"
            )
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def read_slice_rows(storage: Storage, directory: str, entry: SliceEntry, shape: Sequence[int], dtype: str,
                    lo: int, hi: int, what: str) -> np.ndarray:
    """Rows ``lo..hi-1`` (logical numbering) of one slice file, after checking its header, size and sha256.

    The whole file is streamed through the hash (the checksum covers all of it), only the wanted rows are kept.
    """
    path = storage.join(directory, entry.file)
    dt = np.dtype(dtype)
    expected_shape = tuple(shape) if not shape else (entry.stop - entry.start,) + tuple(shape[1:])
    try:
        f = storage.open_read(path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{what}: data file {path} is missing") from None
    with f:
        reader = _HashingReader(f)
        try:
            fshape, fortran, fdtype = npyfiles.read_header(reader)
        except (ValueError, SyntaxError, EOFError) as err:
            raise CheckpointCorruptError(f"{what}: file {path} is not a valid .npy file ({err})") from None
        if tuple(fshape) != expected_shape or fdtype != dt or fortran:
            raise CheckpointCorruptError(
                f"{what}: file {path} holds an array of shape {list(fshape)} dtype {fdtype}"
                f"{' (Fortran order)' if fortran else ''}; the manifest expects shape {list(expected_shape)} "
                f"dtype {dt}"
            )
        row_elems = int(np.prod(expected_shape[1:], dtype=np.int64)) if expected_shape else 1
        row_bytes = row_elems * dt.itemsize
        a, b = lo - entry.start, hi - entry.start
        _read_exact(reader, a * row_bytes, what, path)
        data = _read_exact(reader, (b - a) * row_bytes, what, path)
        rows_total = expected_shape[0] if expected_shape else 1
        _read_exact(reader, (rows_total - b) * row_bytes, what, path)
        while reader.read(_READ_CHUNK):
            pass
    if reader.nbytes != entry.nbytes:
        raise CheckpointCorruptError(
            f"{what}: file {path} has {reader.nbytes} bytes; the manifest expects {entry.nbytes}"
        )
    digest = reader.hash.hexdigest()
    if digest != entry.sha256:
        raise CheckpointCorruptError(
            f"{what}: file {path} has sha256 {digest}; the manifest expects {entry.sha256} (the file is corrupt)"
        )
    out = np.frombuffer(data, dtype=dt).copy()
    if not shape:
        return out.reshape(())
    return out.reshape((b - a,) + tuple(shape[1:]))


def overlapping(slices: Sequence[SliceEntry], lo: int, hi: int) -> list[tuple[SliceEntry, int, int]]:
    """The slices overlapping rows ``lo..hi-1``, each with the overlapping row range ``(a, b)``."""
    out = []
    for s in slices:
        a, b = max(lo, s.start), min(hi, s.stop)
        if a < b:
            out.append((s, a, b))
    return out


def read_rows(storage: Storage, directory: str, entry: TensorEntry, lo: int, hi: int, what: str) -> np.ndarray:
    """Rows ``lo..hi-1`` of a logical tensor, assembled from the slices that overlap them (re-partitioning)."""
    shape = entry.shape
    rows = tensor_rows(shape)
    if not 0 <= lo <= hi <= rows:
        raise CheckpointMismatchError(f"{what}: rows {lo}..{hi - 1} are outside the checkpointed 0..{rows - 1}")
    if not shape:
        (s,) = entry.slices
        return read_slice_rows(storage, directory, s, shape, entry.dtype, 0, 1, what)
    out = np.empty((hi - lo,) + tuple(shape[1:]), dtype=np.dtype(entry.dtype))
    covered = 0
    for s, a, b in overlapping(entry.slices, lo, hi):
        out[a - lo : b - lo] = read_slice_rows(storage, directory, s, shape, entry.dtype, a, b, what)
        covered += b - a
    if covered != hi - lo:
        raise CheckpointCorruptError(f"{what}: the manifest's slices do not cover rows {lo}..{hi - 1}")
    return out


# -- manifests on storage --------------------------------------------------------------------------------------
def read_manifest(path: str) -> Manifest:
    """The manifest of the checkpoint at ``path`` (a ``ckpt-N`` directory); raises a :class:`CheckpointError`."""
    path = normalize_path(path)
    storage = storage_for(path)
    mpath = storage.join(path, MANIFEST_NAME)
    try:
        raw = storage.read_bytes(mpath)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"no complete checkpoint at {path}: {MANIFEST_NAME} is missing (an interrupted save leaves none)"
        ) from None
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointCorruptError(f"checkpoint {path}: {MANIFEST_NAME} is not valid JSON ({err})") from None
    try:
        return Manifest.model_validate(data)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(top level)'}: {e['msg']}" for e in err.errors()[:5]
        )
        raise CheckpointCorruptError(f"checkpoint {path}: {MANIFEST_NAME} is malformed: {problems}") from None


def commit_manifest(path: str, manifest: Manifest) -> None:
    """Write the manifest last, atomically: from this moment on the checkpoint exists."""
    storage = storage_for(path)
    body = manifest.model_dump_json(indent=1).encode()
    storage.write_bytes_atomic(storage.join(path, MANIFEST_NAME), body)


def _numbered_dirs(directory: str) -> list[tuple[int, str]]:
    directory = normalize_path(directory)
    storage = storage_for(directory)
    out = []
    for name in storage.listdir(directory):
        m = _CKPT_DIR.match(name)
        if m:
            out.append((int(m.group(1)), storage.join(directory, name)))
    return sorted(out)


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
    """``(number, path)`` of every committed checkpoint in ``directory``, oldest first."""
    storage = storage_for(normalize_path(directory))
    return [(n, p) for n, p in _numbered_dirs(directory) if storage.exists(storage.join(p, MANIFEST_NAME))]


def latest_checkpoint(directory: str) -> str | None:
    """Path of the newest committed checkpoint in ``directory``, or ``None``."""
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def verify_checkpoint(path: str) -> Manifest:
    """Read every data file of a checkpoint and check it against the manifest; returns the manifest."""
    path = normalize_path(path)
    manifest = read_manifest(path)
    storage = storage_for(path)
    for name, var in manifest.variables.items():
        read_rows(storage, path, var, 0, tensor_rows(var.shape), f"variable {name!r}")
        for okey, slots in var.slots.items():
            for sname, slot in slots.items():
                read_rows(storage, path, slot, 0, tensor_rows(slot.shape), f"variable {name!r} slot {sname!r}")
    return manifest


# -- the shard side: what a parameter server (or the coordinator, for local variables) does --------------------
class ShardAccess(Protocol):
    """Snapshots and loads one shard with its optimizer state, each under the shard's lock."""

    def snapshot(self, key: str) -> tuple[np.ndarray, dict[str, dict[str, np.ndarray]], int]: ...

    def load(self, key: str, value: np.ndarray, slots: dict[str, dict[str, np.ndarray]] | None,
             updates: int | None) -> None: ...

    def describe(self, key: str) -> tuple[tuple[int, ...], np.dtype]: ...


class SaveItem(BaseModel):
    """Save shard ``key`` as rows ``start..stop-1`` of logical variable ``name`` (of full shape ``shape``)."""

    model_config = ConfigDict(extra="forbid")

    key: str
    name: str
    start: int
    stop: int
    shape: list[int]


class SavedShard(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: str
    value: SliceEntry
    dtype: str
    #: {optimizer key: {slot: (slice, dtype, trailing shape)}}
    slots: dict[str, dict[str, tuple[SliceEntry, str, list[int]]]] = {}


class RestoreItem(BaseModel):
    """Load rows ``start..stop-1`` of the checkpointed ``value`` (and slots) into shard ``key``."""

    model_config = ConfigDict(extra="forbid")

    key: str
    name: str
    start: int
    stop: int
    value: TensorEntry
    slots: dict[str, dict[str, TensorEntry]] = {}


def save_items(access: ShardAccess, directory: str, items: Sequence[SaveItem], parallel: int = 4) -> list[SavedShard]:
    """Write each shard (and its slots) to its own files; returns what the manifest needs to know."""
    storage = storage_for(directory)

    def one(item: SaveItem) -> SavedShard:
        value, slots, updates = access.snapshot(item.key)
        expected = (item.stop - item.start,) + tuple(item.shape[1:]) if item.shape else ()
        if tuple(value.shape) != expected:
            raise CheckpointError(
                f"variable {item.name!r}: shard {item.key!r} has shape {list(value.shape)}, expected "
                f"{list(expected)} for rows {item.start}..{item.stop - 1} of shape {item.shape}"
            )
        dtype = _dtype_name(value.dtype, f"variable {item.name!r}")
        fname = slice_file_name(item.name, item.start, item.stop)
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
                ssha, sbytes = write_array(storage, storage.join(directory, sfile), arr)
                saved_slots.setdefault(okey, {})[sname] = (
                    SliceEntry(start=item.start, stop=item.stop, file=sfile, sha256=ssha, nbytes=sbytes),
                    _dtype_name(arr.dtype, f"variable {item.name!r} slot {sname!r}"),
                    list(arr.shape[1:]),
                )
        entry = SliceEntry(start=item.start, stop=item.stop, file=fname, sha256=sha, nbytes=nbytes,
                           updates=int(updates))
        return SavedShard(key=item.key, value=entry, dtype=dtype, slots=saved_slots)

    if len(items) <= 1 or parallel <= 1:
        return [one(i) for i in items]
    with ThreadPoolExecutor(max_workers=min(parallel, len(items)), thread_name_prefix="ckpt-save") as pool:
        return list(pool.map(one, items))


def restore_items(access: ShardAccess, directory: str, items: Sequence[RestoreItem], parallel: int = 4) -> int:
    """Read and verify everything first, then load each shard; returns the number of shards loaded."""
    storage = storage_for(directory)

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
                slots.setdefault(okey, {})[sname] = read_rows(
                    storage, directory, entry, item.start, item.stop, f"{what} slot {sname!r}"
                )
        return item.key, value, slots, updates

    if len(items) <= 1 or parallel <= 1:
        loaded = [read(i) for i in items]
    else:
        with ThreadPoolExecutor(max_workers=min(parallel, len(items)), thread_name_prefix="ckpt-read") as pool:
            loaded = list(pool.map(read, items))
    for key, value, slots, updates in loaded:
        access.load(key, value, slots, updates)
    return len(loaded)


class PSStateAccess:
    """:class:`ShardAccess` over a parameter server's :class:`~kubeps.runtime.ps.ParameterServerState`."""

    def __init__(self, state):
        self.state = state

    def snapshot(self, key: str):
        var = self.state.get(key)
        with var.lock:
            value = var.value.copy()
            slots = {okey: {s: np.array(a, copy=True) for s, a in group.items()} for okey, group in var.slots.items()}
            return value, slots, var.updates

    def describe(self, key: str):
        var = self.state.get(key)
        return var.value.shape, var.value.dtype

    def load(self, key: str, value, slots, updates) -> None:
        var = self.state.get(key)
        with var.lock:
            var.value[...] = value
            if slots is not None:
                var.slots = {okey: dict(group) for okey, group in slots.items()}
            if updates is not None:
                var.updates = int(updates)


def _request_list(meta: Mapping[str, Any], model: type[BaseModel], method: str) -> tuple[str, list]:
    directory = meta.get("directory")
    if not isinstance(directory, str) or not directory:
        raise ValueError(f"{method}: field 'directory' must be a checkpoint directory path or URL, got {directory!r}")
    raw = meta.get("items")
    if not isinstance(raw, list):
        raise ValueError(f"{method}: field 'items' must be a list, got {type(raw).__name__}")
    try:
        return directory, [model.model_validate(i) for i in raw]
    except ValidationError as err:
        raise ValueError(f"{method}: field 'items' is malformed: {err}") from None


def rpc_save_shards(state, meta: dict[str, Any], arrays: list) -> tuple[dict[str, Any], list]:  # noqa: ARG001
    """PS method ``SaveShards``: ``{"directory", "items": [SaveItem]}`` -> ``{"saved": [SavedShard]}``."""
    directory, items = _request_list(meta, SaveItem, "SaveShards")
    saved = save_items(PSStateAccess(state), directory, items)
    return {"saved": [s.model_dump(mode="json") for s in saved]}, []


def rpc_restore_shards(state, meta: dict[str, Any], arrays: list) -> tuple[dict[str, Any], list]:  # noqa: ARG001
    """PS method ``RestoreShards``: ``{"directory", "items": [RestoreItem]}`` -> ``{"restored": n}``."""
    directory, items = _request_list(meta, RestoreItem, "RestoreShards")
    return {"restored": restore_items(PSStateAccess(state), directory, items)}, []


PS_METHODS = {"SaveShards": rpc_save_shards, "RestoreShards": rpc_restore_shards}


def register_ps_methods() -> None:
    """Add ``SaveShards`` and ``RestoreShards`` to the parameter-server service's method table."""
    from . import server  # noqa: PLC0415 - above this module in the layering only for the registration

    for name, fn in PS_METHODS.items():
        server.register_ps_method(name, fn, replace=True)  # idempotent: a re-import must not fail


# -- the coordinator side: which objects a checkpoint holds ----------------------------------------------------
class ShardExecutor(Protocol):
    """Runs save/restore items where the shards live: in this process, or on one parameter server."""

    label: str

    def save(self, directory: str, items: list[SaveItem]) -> list[SavedShard]: ...

    def restore(self, directory: str, items: list[RestoreItem]) -> int: ...


class _ArrayAccess:
    """:class:`ShardAccess` over local numpy arrays (restored in place)."""

    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}
        self.slots: dict[str, dict[str, dict[str, np.ndarray]]] = {}
        self.updates: dict[str, int] = {}

    def snapshot(self, key):
        return np.array(self.arrays[key], copy=True), self.slots.get(key, {}), self.updates.get(key, 0)

    def describe(self, key):
        return self.arrays[key].shape, self.arrays[key].dtype

    def load(self, key, value, slots, updates):
        self.arrays[key][...] = value
        if slots:
            self.slots[key] = slots
        if updates is not None:
            self.updates[key] = updates


class LocalExecutor:
    """Saves and restores shards held in this process."""

    label = "local"

    def __init__(self, access: ShardAccess):
        self.access = access

    def save(self, directory, items):
        return save_items(self.access, directory, items)

    def restore(self, directory, items):
        return restore_items(self.access, directory, items)


class PSExecutor:
    """Sends save/restore items to one parameter server through a PS transport (``call(ps, method, meta, ...)``)."""

    def __init__(self, transport, ps_index: int, timeout: float | None = 600.0):
        self.transport = transport
        self.ps_index = ps_index
        self.timeout = timeout
        self.label = f"/job:ps/task:{ps_index}"
        self.group_key = ("ps", id(transport), ps_index)

    def save(self, directory, items):
        meta, _ = self.transport.call(self.ps_index, "SaveShards",
                                      {"directory": directory, "items": [i.model_dump() for i in items]},
                                      (), self.timeout)
        return [SavedShard.model_validate(s) for s in meta["saved"]]

    def restore(self, directory, items):
        meta, _ = self.transport.call(self.ps_index, "RestoreShards",
                                      {"directory": directory, "items": [i.model_dump(mode="json") for i in items]},
                                      (), self.timeout)
        return int(meta.get("restored", 0))


def _group_key(executor: ShardExecutor) -> Any:
    """Shards of one executor (one parameter server) travel in one request."""
    return getattr(executor, "group_key", None) or id(executor)


@dataclass
class ShardRef:
    """One shard of a logical variable: rows ``start..stop-1``, held as ``key`` by ``executor``."""

    start: int
    stop: int
    key: str
    executor: ShardExecutor


@dataclass
class Saveable:
    """A logical variable as a checkpoint sees it."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    shards: list[ShardRef] = field(default_factory=list)


#: ``type -> fn(obj, name) -> list[Saveable]``: how objects of other modules become checkpoint variables.
_SAVEABLE_ADAPTERS: dict[type, Callable[[Any, str], list[Saveable]]] = {}


def register_saveable(cls: type, adapter: Callable[[Any, str], list[Saveable]]) -> None:
    """Teach checkpoints a variable type: ``adapter(obj, name)`` returns its :class:`Saveable` parts."""
    _SAVEABLE_ADAPTERS[cls] = adapter


class StepCounter:
    """A thread-safe integer (the training step) that checkpoints save and restore."""

    def __init__(self, value: int = 0):
        self._value = int(value)
        self._lock = threading.Lock()

    @property
    def value(self) -> int:
        return self._value

    def numpy(self) -> int:
        return self._value

    def __int__(self) -> int:
        return self._value

    def __index__(self) -> int:
        return self._value

    def __repr__(self) -> str:
        return f"StepCounter({self._value})"

    def assign(self, value: int) -> int:
        with self._lock:
            self._value = int(value)
            return self._value

    def assign_add(self, delta: int = 1) -> int:
        with self._lock:
            self._value += int(delta)
            return self._value

    def get_state(self) -> dict[str, int]:
        return {"value": self._value}

    def set_state(self, state: Mapping[str, Any]) -> None:
        value = state.get("value") if isinstance(state, Mapping) else None
        if not isinstance(value, int) or isinstance(value, bool):
            raise CheckpointMismatchError(f"step counter state {state!r} has no integer 'value'")
        self.assign(value)


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "get_state", None)) and callable(getattr(obj, "set_state", None))


class Checkpoint:
    """The objects a checkpoint holds, by name: ``Checkpoint(model=..., optimizer=..., step=StepCounter())``.

    Accepted objects: numpy arrays (restored in place), kubeps variables and sharded variables (any type with an
    adapter from :func:`register_saveable`), objects with ``get_state()``/``set_state(state)`` (JSON state), and
    dicts, lists and objects with a ``variables`` attribute holding any of these.
    """

    def __init__(self, **objects: Any):
        if not objects:
            raise CheckpointError("Checkpoint() needs at least one object, e.g. Checkpoint(model=model, step=step)")
        for key in objects:
            if "/" in key:
                raise CheckpointError(f"Checkpoint object name {key!r} must not contain '/'")
        self._objects = dict(objects)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_objects"][name]
        except KeyError:
            raise AttributeError(name) from None

    # -- flattening --------------------------------------------------------------------------------------------
    def _flatten(self) -> tuple[list[Saveable], dict[str, Any], _ArrayAccess]:
        saveables: list[Saveable] = []
        stateful: dict[str, Any] = {}
        local = _ArrayAccess()
        local_exec = LocalExecutor(local)
        seen: dict[int, str] = {}

        def visit(path: str, obj: Any) -> None:
            if id(obj) in seen and not isinstance(obj, (int, str)):
                return  # the same object reachable twice (an optimizer's and a model's reference)
            seen[id(obj)] = path
            for cls in type(obj).__mro__:
                adapter = _SAVEABLE_ADAPTERS.get(cls)
                if adapter is not None:
                    saveables.extend(adapter(obj, path))
                    return
            if isinstance(obj, np.ndarray):
                dtype = np.dtype(_dtype_name(obj.dtype, f"checkpoint object {path!r}"))
                local.arrays[path] = obj
                rows = tensor_rows(obj.shape)
                shards = [ShardRef(0, rows, path, local_exec)] if rows else []
                saveables.append(Saveable(path, tuple(obj.shape), dtype, shards))
            elif _is_stateful(obj):
                stateful[path] = obj
            elif isinstance(obj, Mapping):
                for k, v in obj.items():
                    visit(f"{path}/{k}", v)
            elif isinstance(obj, (list, tuple)):
                # variables in a list are named by their own names (stable when the list order changes)
                labels = [getattr(v, "name", None) for v in obj]
                if not (all(isinstance(n, str) and n for n in labels) and len(set(labels)) == len(labels)):
                    labels = [str(i) for i in range(len(obj))]
                for label, v in zip(labels, obj):
                    visit(f"{path}/{label}", v)
            elif hasattr(obj, "variables") and not callable(obj.variables):
                visit(path, obj.variables)
            else:
                raise CheckpointError(
                    f"checkpoint object {path!r} of type {type(obj).__name__} cannot be checkpointed: give numpy "
                    "arrays, kubeps variables, objects with get_state()/set_state(), or dicts/lists of them"
                )

        for key, obj in self._objects.items():
            visit(key, obj)
        names = [s.name for s in saveables]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise CheckpointError(f"two checkpoint variables share the name(s) {sorted(dup)}")
        return saveables, stateful, local

    def _step_value(self) -> int | None:
        for key in ("step", "global_step", "iterations"):
            obj = self._objects.get(key)
            if obj is None:
                continue
            try:
                return int(obj.numpy() if hasattr(obj, "numpy") else obj)
            except (TypeError, ValueError):
                continue
        return None

    # -- save ------------------------------------------------------------------------------------------------
    def write(self, path: str, *, checkpoint_number: int = 0, step: int | None = None, final: bool = False) -> str:
        """Write a complete checkpoint to the directory ``path`` (a ``ckpt-N`` directory); returns ``path``."""
        path = normalize_path(path)
        storage = storage_for(path)
        saveables, stateful, _ = self._flatten()
        if storage.exists(storage.join(path, MANIFEST_NAME)):
            raise CheckpointError(f"checkpoint {path} already exists; refusing to overwrite a committed checkpoint")
        storage.remove_tree(path)  # the remains of an interrupted save of the same number
        storage.makedirs(path)
        groups: dict[Any, tuple[ShardExecutor, list[tuple[SaveItem, Saveable]]]] = {}
        for sv in saveables:
            for shard in sv.shards:
                item = SaveItem(key=shard.key, name=sv.name, start=shard.start, stop=shard.stop, shape=list(sv.shape))
                groups.setdefault(_group_key(shard.executor), (shard.executor, []))[1].append((item, sv))
        results: dict[tuple[str, int], SavedShard] = {}

        def run(group):
            executor, pairs = group
            saved = executor.save(path, [item for item, _ in pairs])
            if len(saved) != len(pairs):
                raise CheckpointError(f"{executor.label} saved {len(saved)} shards, {len(pairs)} were asked for")
            return [((sv.name, item.start), s) for (item, sv), s in zip(pairs, saved)]

        if groups:
            with ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="ckpt-shards") as pool:
                for pairs in pool.map(run, list(groups.values())):
                    results.update(pairs)
        variables: dict[str, VariableEntry] = {}
        for sv in saveables:
            parts = sorted((results[(sv.name, sh.start)] for sh in sv.shards), key=lambda s: s.value.start)
            slot_keys = {(ok, sn) for p in parts for ok, g in p.slots.items() for sn in g}
            slots: dict[str, dict[str, TensorEntry]] = {}
            for okey, sname in sorted(slot_keys):
                have = [p.slots.get(okey, {}).get(sname) for p in parts]
                if any(h is None for h in have):
                    # some shards never received an update with this optimizer: their slots do not exist yet
                    log.warning("variable %r: slot %r exists on only some shards; not saved", sv.name, sname)
                    continue
                tail, dt = have[0][2], have[0][1]
                slots.setdefault(okey, {})[sname] = TensorEntry(
                    shape=[tensor_rows(sv.shape)] + list(tail) if sv.shape else [], dtype=dt,
                    slices=[h[0] for h in have],
                )
            dtype = parts[0].dtype if parts else np.dtype(sv.dtype).name
            variables[sv.name] = VariableEntry(
                shape=list(sv.shape), dtype=dtype, slices=[p.value for p in parts], slots=slots
            )
        objects = {}
        for key, obj in stateful.items():
            state = obj.get_state()
            try:
                json.dumps(state)
            except (TypeError, ValueError) as err:
                raise CheckpointError(f"checkpoint object {key!r}: get_state() is not JSON-serialisable ({err})") from None
            objects[key] = state
        if step is None:
            step = self._step_value()
        manifest = Manifest(format_version=FORMAT_VERSION, checkpoint_number=checkpoint_number, step=step,
                            final=final, created=time.time(), variables=variables, objects=objects)
        commit_manifest(path, manifest)
        return path

    # -- restore ---------------------------------------------------------------------------------------------
    def restore(self, path: str) -> int | None:
        """Restore every object from the checkpoint at ``path``; returns the checkpoint's training step."""
        path = normalize_path(path)
        manifest = read_manifest(path)
        saveables, stateful, _ = self._flatten()
        groups: dict[Any, tuple[ShardExecutor, list[RestoreItem]]] = {}
        for sv in saveables:
            entry = manifest.variables.get(sv.name)
            if entry is None:
                raise CheckpointMismatchError(
                    f"variable {sv.name!r} is not in checkpoint {path}; it holds {_listing(manifest.variables)}"
                )
            dtype = np.dtype(sv.dtype).name
            if list(sv.shape) != entry.shape or dtype != entry.dtype:
                raise CheckpointMismatchError(
                    f"variable {sv.name!r}: expected shape {list(sv.shape)} dtype {dtype}, checkpoint {path} has "
                    f"shape {entry.shape} dtype {entry.dtype}"
                )
            for shard in sv.shards:
                value = TensorEntry(shape=entry.shape, dtype=entry.dtype,
                                    slices=[s for s, _, _ in overlapping(entry.slices, shard.start, shard.stop)]
                                    if entry.shape else entry.slices)
                slots = {
                    okey: {
                        sname: TensorEntry(shape=t.shape, dtype=t.dtype,
                                           slices=[s for s, _, _ in overlapping(t.slices, shard.start, shard.stop)]
                                           if t.shape else t.slices)
                        for sname, t in group.items()
                    }
                    for okey, group in entry.slots.items()
                }
                item = RestoreItem(key=shard.key, name=sv.name, start=shard.start, stop=shard.stop, value=value,
                                   slots=slots)
                groups.setdefault(_group_key(shard.executor), (shard.executor, []))[1].append(item)
        for key in stateful:
            if key not in manifest.objects:
                raise CheckpointMismatchError(
                    f"object {key!r} is not in checkpoint {path}; it holds objects {_listing(manifest.objects)}"
                )
        if groups:
            with ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="ckpt-shards") as pool:
                list(pool.map(lambda g: g[0].restore(path, g[1]), list(groups.values())))
        for key, obj in stateful.items():
            obj.set_state(manifest.objects[key])
        return manifest.step


def _listing(names: Iterable[str], limit: int = 12) -> str:
    names = sorted(names)
    if not names:
        return "nothing"
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


class CheckpointManager:
    """Numbered checkpoints in one directory, keeping the newest ``max_to_keep``."""

    def __init__(self, checkpoint: Checkpoint, directory: str, max_to_keep: int | None = 5):
        if not isinstance(checkpoint, Checkpoint):
            raise CheckpointError(f"checkpoint must be a kubeps Checkpoint, got {type(checkpoint).__name__}")
        if max_to_keep is not None and (isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int)
                                        or max_to_keep < 1):
            raise CheckpointError(f"max_to_keep={max_to_keep!r} is invalid: allowed are None (keep all) or an int >= 1")
        self.checkpoint = checkpoint
        self.directory = normalize_path(directory)
        self.storage = storage_for(self.directory)
        self.max_to_keep = max_to_keep
        self.storage.makedirs(self.directory)

    @property
    def checkpoints(self) -> list[str]:
        """Paths of the committed checkpoints, oldest first."""
        return [p for _, p in list_checkpoints(self.directory)]

    @property
    def latest_checkpoint(self) -> str | None:
        return latest_checkpoint(self.directory)

    def save(self, checkpoint_number: int | None = None, *, step: int | None = None, final: bool = False) -> str:
        """Save a new checkpoint (number: given, or one more than the newest); returns its path."""
        existing = _numbered_dirs(self.directory)
        committed = list_checkpoints(self.directory)
        if checkpoint_number is None:
            checkpoint_number = (committed[-1][0] + 1) if committed else 0
        if isinstance(checkpoint_number, bool) or not isinstance(checkpoint_number, (int, np.integer)) \
                or checkpoint_number < 0:
            raise CheckpointError(f"checkpoint_number={checkpoint_number!r} is invalid: allowed is an int >= 0")
        checkpoint_number = int(checkpoint_number)
        if committed and checkpoint_number < committed[-1][0]:
            # checkpoints are ordered by number (latest_checkpoint, max_to_keep, the evaluator): a lower one would
            # never be the latest, and once max_to_keep is reached the sweep would delete it right away
            raise CheckpointError(
                f"checkpoint_number={checkpoint_number} is invalid: the newest committed checkpoint is "
                f"{committed[-1][0]}; allowed is a number above it (or None for the next one)"
            )
        path = self.storage.join(self.directory, f"{CHECKPOINT_PREFIX}{checkpoint_number}")
        # partial checkpoints (no manifest) are the remains of interrupted saves: nobody reads them
        committed_paths = {p for _, p in committed}
        for _, p in existing:
            if p not in committed_paths and p != path:
                self.storage.remove_tree(p)
        self.checkpoint.write(path, checkpoint_number=checkpoint_number, step=step, final=final)
        self._sweep()
        return path

    def _sweep(self) -> None:
        if self.max_to_keep is None:
            return
        committed = list_checkpoints(self.directory)
        for _, p in committed[: max(0, len(committed) - self.max_to_keep)]:
            # the manifest goes first: a sweep interrupted half-way leaves an uncommitted directory, not a broken one
            self.storage.remove(self.storage.join(p, MANIFEST_NAME))
            self.storage.remove_tree(p)
        for name in self.storage.listdir(self.directory):
            if is_temporary(name):
                self.storage.remove(self.storage.join(self.directory, name))

    def restore(self, path: str | None = None) -> int | None:
        """Restore ``path`` (default: the newest checkpoint); returns its step. No checkpoint: ``None``."""
        if path is None:
            path = self.latest_checkpoint
            if path is None:
                return None
        return self.checkpoint.restore(path)

    def restore_or_initialize(self) -> int:
        """Restore the newest checkpoint if there is one; returns its step, or 0 for a fresh start."""
        step = self.restore()
        return 0 if step is None else int(step)


class CheckpointReader:
    """Reads a checkpoint directly from its files, whatever the number of shards it was saved with."""

    def __init__(self, path: str):
        self.path = normalize_path(path)
        self.storage = storage_for(self.path)
        self.manifest = read_manifest(self.path)

    @property
    def step(self) -> int | None:
        return self.manifest.step

    @property
    def final(self) -> bool:
        return self.manifest.final

    def names(self) -> list[str]:
        return sorted(self.manifest.variables)

    def objects(self) -> dict[str, Any]:
        return dict(self.manifest.objects)

    def _entry(self, name: str, optimizer: str | None, slot: str | None) -> TensorEntry:
        var = self.manifest.variables.get(name)
        if var is None:
            raise CheckpointMismatchError(
                f"variable {name!r} is not in checkpoint {self.path}; it holds {_listing(self.manifest.variables)}"
            )
        if slot is None:
            return var
        groups = [var.slots[optimizer]] if optimizer is not None and optimizer in var.slots else (
            list(var.slots.values()) if optimizer is None else [])
        found = [g[slot] for g in groups if slot in g]
        if len(found) != 1:
            have = sorted({s for g in var.slots.values() for s in g})
            raise CheckpointMismatchError(
                f"variable {name!r}: slot {slot!r} is {'ambiguous' if found else 'not'} in checkpoint {self.path} "
                f"(slots: {have or 'none'})"
            )
        return found[0]

    def get(self, name: str, slot: str | None = None, optimizer: str | None = None) -> np.ndarray:
        """The full value of variable ``name`` (or of one of its optimizer slots)."""
        entry = self._entry(name, optimizer, slot)
        what = f"variable {name!r}" + (f" slot {slot!r}" if slot else "")
        return read_rows(self.storage, self.path, entry, 0, tensor_rows(entry.shape), what)

    def get_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        return read_rows(self.storage, self.path, self._entry(name, None, None), start, stop, f"variable {name!r}")

    def values(self) -> dict[str, np.ndarray]:
        return {name: self.get(name) for name in self.names()}


# -- kubeps variables ------------------------------------------------------------------------------------------
def _config_key_of(optimizer: Any) -> str:
    from .ps import _config_key  # noqa: PLC0415 - the PS keys slots by this, local variables must match

    return _config_key(optimizer.get_config())


class _LocalVariableAccess:
    """:class:`ShardAccess` over local :class:`~kubeps.runtime.variables.Variable` objects (coordinator-side)."""

    def __init__(self):
        self.variables: dict[str, Any] = {}

    def snapshot(self, key):
        var = self.variables[key]
        slots = {_config_key_of(opt): {n: a.copy() for n, a in group.items()}
                 for opt, group in var._local_slots.values()}
        return var._local.copy(), slots, var._local_updates

    def describe(self, key):
        var = self.variables[key]
        return var._local.shape, var._local.dtype

    def load(self, key, value, slots, updates):
        var = self.variables[key]
        var._local[...] = value
        if updates is not None:
            var._local_updates = int(updates)
        for opt, group in var._local_slots.values():  # slots of optimizers this process already has
            saved = (slots or {}).get(_config_key_of(opt))
            if saved:
                for name, arr in saved.items():
                    if name in group:
                        group[name][...] = arr


def _variable_shards(variables: Sequence[Any], rows: Sequence[tuple[int, int]]) -> list[ShardRef]:
    refs = []
    for var, (start, stop) in zip(variables, rows):
        if var._local is not None:
            access = _LocalVariableAccess()
            access.variables[var._key] = var
            refs.append(ShardRef(start, stop, var._key, LocalExecutor(access)))
        else:
            refs.append(ShardRef(start, stop, var._key, PSExecutor(var._require_transport(), var._ps_index)))
    return refs


def _variable_saveable(var: Any, path: str) -> list[Saveable]:
    rows = tensor_rows(var.shape)
    shards = _variable_shards([var], [(0, rows)]) if rows else []
    return [Saveable(path, tuple(var.shape), np.dtype(var.dtype), shards)]


def _sharded_saveable(var: Any, path: str) -> list[Saveable]:
    return [Saveable(path, tuple(var.shape), np.dtype(var.dtype), _variable_shards(var.variables, var.shard_rows()))]


def _register_builtin_adapters() -> None:
    from .variables import ShardedVariable, Variable  # noqa: PLC0415

    register_saveable(Variable, _variable_saveable)
    register_saveable(ShardedVariable, _sharded_saveable)


_register_builtin_adapters()
register_ps_methods()
