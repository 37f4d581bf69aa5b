"""The checkpoint format: errors, the manifest (pydantic), file names, verified ``.npy`` data files and the
listing of checkpoint directories on a storage. No knowledge of variables or parameter servers."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
from typing import Any, Callable, Iterable, Protocol, Sequence, TypeVar

import numpy as np
from pydantic import (BaseModel, ConfigDict, SerializerFunctionWrapHandler, StrictInt, ValidationError,
                      field_validator, model_serializer, model_validator)

from kubeps.runtime.rpc.protocol import legacy_slot_key
from kubeps.runtime.util import npyfiles
from kubeps.runtime.util.storage import Storage, normalize_path, storage_for

log = logging.getLogger("kubeps.runtime.checkpoint.format")


#: Version of the manifest format this module writes for checkpoints without dynamic tables (readable by every
#: kubeps); :data:`DYNAMIC_FORMAT_VERSION` for checkpoints holding one, so that an older kubeps refuses them with
#: "format_version 2 is not supported" instead of misreading them. Both are read.
FORMAT_VERSION = 1
DYNAMIC_FORMAT_VERSION = 2
#: checkpoints of an incremental manager (slices with a save's generation, files in an earlier checkpoint, deltas)
INCREMENTAL_FORMAT_VERSION = 3
READABLE_VERSIONS = (FORMAT_VERSION, DYNAMIC_FORMAT_VERSION, INCREMENTAL_FORMAT_VERSION)
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


class CheckpointSpaceError(CheckpointError, OSError):
    """A save ran out of space (``ENOSPC``), quota (``EDQUOT``) or file size (``EFBIG``): the message names the file
    and the bytes; what the save had written is removed, the previous checkpoint is untouched."""


#: errno values of a storage that is full
SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def space_error(err: OSError, path: str, needed: int, written: int) -> CheckpointSpaceError | None:
    """``err`` as a :class:`CheckpointSpaceError` about file ``path`` when it says the storage is full, else None."""
    if err.errno not in SPACE_ERRNOS:
        return None
    out = CheckpointSpaceError(
        f"no space to save the checkpoint: writing {path} ({needed} bytes) failed with "
        f"{errno.errorcode.get(err.errno or 0, err.errno)} ({os.strerror(err.errno or 0)}) after this save had written "
        f"{written} bytes; those files are removed and the previous checkpoint is untouched: free space (the save "
        f"needs more than {needed + written} bytes), or lower max_to_keep, and save again")
    out.errno = err.errno
    return out


class CheckpointMismatchError(CheckpointError):
    """A checkpoint does not fit the objects being restored (missing variable, other shape or dtype)."""


# -- the manifest ----------------------------------------------------------------------------------------------
def dtype_name(dtype: Any, what: str) -> str:
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


def _plain_file(value: str) -> str:
    if not _SAFE_FILE.match(value) or value.startswith("."):
        raise ValueError(f"file {value!r} must be a plain '.npy' file name inside the checkpoint directory")
    return value


def _hex64(value: str) -> str:
    if not _HEX64.match(value):
        raise ValueError(f"sha256 {value!r} must be 64 lowercase hex digits")
    return value


class DeltaEntry(BaseModel):
    """The rows of a slice that changed since the save before, written by checkpoint ``checkpoint`` (a sibling
    ``ckpt-<checkpoint>`` directory): ``ids_file`` holds their logical row numbers (int64, ascending), ``file`` the
    rows themselves, in the same order. Restore applies a slice's deltas in order over its base file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint: StrictInt
    rows: StrictInt
    ids_file: str
    ids_sha256: str
    ids_nbytes: StrictInt
    file: str
    sha256: str
    nbytes: StrictInt

    _files = field_validator("file", "ids_file")(_plain_file)
    _hex = field_validator("sha256", "ids_sha256")(_hex64)

    @model_validator(mode="after")
    def _sizes(self) -> "DeltaEntry":
        if min(self.checkpoint, self.rows, self.nbytes, self.ids_nbytes) < 0:
            raise ValueError("checkpoint, rows and the byte counts of a delta must be >= 0")
        return self


#: the fields of a slice that only an incremental save writes; left out when at their defaults, so that a manifest
#: of a plain save reads in every kubeps
_INCREMENTAL_FIELDS: dict[str, Any] = {"checkpoint": None, "source": "", "generation": 0, "deltas": []}


class SliceEntry(BaseModel):
    """Rows ``start..stop-1`` of a logical tensor, stored in ``file`` (relative to the checkpoint directory, or to
    the sibling ``ckpt-<checkpoint>`` where ``checkpoint`` is set) and updated by ``deltas``, in order."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # strict ints everywhere: "2", 2.0 and true are refused, not read as 2, 2 and 1
    start: StrictInt
    stop: StrictInt
    file: str
    sha256: str
    nbytes: StrictInt
    #: optimizer update count of the shard these rows came from (learning-rate schedules, Adam's bias correction)
    updates: StrictInt = 0
    #: the checkpoint whose directory holds ``file`` (None: this one)
    checkpoint: StrictInt | None = None
    #: the ps's change record these rows were saved from and the generation of that save: a later save asks the ps
    #: for the rows changed since it (:mod:`kubeps.runtime.checkpoint.incremental`)
    source: str = ""
    generation: StrictInt = 0
    deltas: list[DeltaEntry] = []

    _file = field_validator("file")(_plain_file)
    _hex = field_validator("sha256")(_hex64)

    @model_validator(mode="after")
    def _range(self) -> "SliceEntry":
        if self.start < 0 or self.stop <= self.start:
            raise ValueError(f"slice ({self.start}, {self.stop}) must have 0 <= start < stop")
        if self.nbytes < 0 or self.updates < 0 or self.generation < 0 or (self.checkpoint or 0) < 0:
            raise ValueError("nbytes, updates, generation and checkpoint must be >= 0")
        return self

    @model_serializer(mode="wrap")
    def _compact(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name, default in _INCREMENTAL_FIELDS.items():
            if data.get(name, default) == default:
                data.pop(name, None)
        return data

    @property
    def incremental(self) -> bool:
        """Whether only an incremental save writes this slice (a reader needs format version 3)."""
        return bool(self.source or self.deltas or self.checkpoint is not None)


class TensorEntry(BaseModel):
    """One logical tensor: full shape and dtype, and the slices of axis 0 that cover it in order."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shape: list[StrictInt]
    dtype: str
    slices: list[SliceEntry]

    @field_validator("dtype")
    @classmethod
    def _numeric(cls, value: str) -> str:
        try:
            return dtype_name(value, "dtype")
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
    """A logical variable, with its optimizer slots: ``{optimizer class: {slot name: tensor}}``.

    Older kubeps checkpoints keyed slots by the optimizer's whole config (JSON); they are read with their
    keys mapped to the class. Where such a checkpoint holds two slot sets of one class (a resume with another
    learning rate started a second set), the first in the manifest is kept and a warning names the other."""

    slots: dict[str, dict[str, TensorEntry]] = {}

    @field_validator("slots", mode="before")
    @classmethod
    def _slot_keys(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        merged: dict[str, Any] = {}
        for key, group in value.items():
            if not isinstance(key, str):
                return value  # the type check says what is wrong
            new = legacy_slot_key(key)
            if new in merged:
                log.warning("checkpoint holds two %s slot sets for one variable (written before slots were keyed "
                            "by optimizer class); restoring the first, ignoring the one saved under %s", new, key)
                continue
            merged[new] = group
        return merged

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


class SavedDelta(BaseModel):
    """What an incremental save of one shard wrote: its ``rows`` changed since the save it was asked against, and
    the files (``(file, sha256, nbytes)``) of their logical ids, their values and their slots' rows -- None and
    empty when no row changed -- with the shard's ``updates`` and the save's ``source`` and ``generation``."""

    model_config = ConfigDict(extra="forbid")

    rows: StrictInt
    updates: StrictInt
    source: str
    generation: StrictInt
    ids: tuple[str, str, StrictInt] | None = None
    value: tuple[str, str, StrictInt] | None = None
    slots: dict[str, dict[str, tuple[str, str, StrictInt]]] = {}


class SavedShard(BaseModel):
    """What saving one shard of a variable wrote (a ``SaveShards`` answer holds one per item): the value's slice,
    its dtype, and ``slots``: ``{optimizer key: {slot: (slice, dtype, trailing shape)}}``. The coordinator puts the
    shards of a variable together into its :class:`VariableEntry`."""

    model_config = ConfigDict(extra="forbid")

    key: str
    #: the full save's slice; None for a delta (``delta``)
    value: SliceEntry | None = None
    dtype: str
    slots: dict[str, dict[str, tuple[SliceEntry, str, list[int]]]] = {}
    delta: SavedDelta | None = None

    @model_validator(mode="after")
    def _one(self) -> "SavedShard":
        if (self.value is None) == (self.delta is None):
            raise ValueError("a saved shard holds either a full slice (value) or a delta, one of them")
        return self


#: the parts of a dynamic table's shard that are not one entry per live row (the admission state)
_UNALIGNED = ("pending_keys", "pending_counts", "bloom")


class DynamicShardEntry(BaseModel):
    """The live rows of one parameter server's shard of a dynamic table (shard ``shard`` of ``num_shards``):
    ``keys`` (int64, ``rows``), ``values`` (``rows x dim``), ``freqs`` (how often each key was seen), ``steps`` (the
    shard's update that last changed each row), the optimizer slots (``rows x dim`` each) with each slot's initial
    row (``slot_init``: what a row admitted later starts from), and the admission state: the counts of keys seen but
    not admitted (``pending_keys``/``pending_counts``, exact counting) or the counting Bloom filter (``bloom``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shard: StrictInt
    rows: StrictInt
    #: the shard's update count (the ``step`` its optimizer sees) and how many rows it had evicted
    updates: StrictInt
    evicted: StrictInt = 0
    keys: TensorEntry
    values: TensorEntry
    freqs: TensorEntry
    steps: TensorEntry
    slots: dict[str, dict[str, TensorEntry]] = {}
    slot_init: dict[str, dict[str, list[float]]] = {}
    pending_keys: TensorEntry | None = None
    pending_counts: TensorEntry | None = None
    bloom: TensorEntry | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "DynamicShardEntry":
        if self.shard < 0 or self.rows < 0 or self.updates < 0 or self.evicted < 0:
            raise ValueError("shard, rows, updates and evicted must be >= 0")
        for part, t in self.tensors().items():
            t.covers_all_rows()
            if part not in _UNALIGNED and (tensor_rows(t.shape) != self.rows or not t.shape):
                raise ValueError(f"{part} has shape {t.shape}; the shard holds {self.rows} rows")
        for part, key_part in (("keys", self.keys), ("pending_keys", self.pending_keys)):
            if key_part is not None and (key_part.dtype != "int64" or len(key_part.shape) != 1):
                raise ValueError(f"{part} must be a 1-D int64 array, got shape {key_part.shape} dtype "
                                 f"{key_part.dtype}")
        if (self.pending_keys is None) != (self.pending_counts is None) or (
                self.pending_keys is not None and self.pending_counts is not None
                and self.pending_keys.shape != self.pending_counts.shape):
            raise ValueError("pending_keys and pending_counts go together, one count per key")
        for okey, group in self.slots.items():
            if set(group) != set(self.slot_init.get(okey, {})):
                raise ValueError(f"slots of {okey!r} are {sorted(group)} but their initial rows (slot_init) are "
                                 f"{sorted(self.slot_init.get(okey, {}))}")
        return self

    def tensors(self) -> dict[str, TensorEntry]:
        """Every data file of the shard by what it holds (``values``, ``slot <optimizer>/<slot>``, ...)."""
        out = {"keys": self.keys, "values": self.values, "freqs": self.freqs, "steps": self.steps}
        out.update({f"slot {o}/{n}": t for o, g in self.slots.items() for n, t in g.items()})
        for part in _UNALIGNED:
            t = getattr(self, part)
            if t is not None:
                out[part] = t
        return out


class DynamicTableEntry(BaseModel):
    """A dynamic embedding table: its settings and one :class:`DynamicShardEntry` per shard it was saved from. Which
    shard a key was on is ``hash`` (the high 32 bits of SplitMix64 with the table's shard seed, mod
    ``num_shards``); a restore re-hashes every key onto the shards it restores into."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dim: StrictInt
    dtype: str
    key_dtype: str
    #: the table's settings when it was saved (``TableConfig.as_dict()``)
    config: dict[str, Any]
    hash: str
    num_shards: StrictInt
    shards: list[DynamicShardEntry]

    @field_validator("dtype")
    @classmethod
    def _float(cls, value: str) -> str:
        if value not in ("float16", "float32", "float64"):
            raise ValueError(f"dtype {value!r} is not a dynamic table's; allowed: float16, float32, float64")
        return value

    @model_validator(mode="after")
    def _complete(self) -> "DynamicTableEntry":
        if self.dim < 1 or self.num_shards < 1:
            raise ValueError(f"dim ({self.dim}) and num_shards ({self.num_shards}) must be >= 1")
        if [s.shard for s in self.shards] != list(range(self.num_shards)):
            raise ValueError(f"shards are {[s.shard for s in self.shards]}; expected one per shard "
                             f"0..{self.num_shards - 1}, in order")
        for s in self.shards:
            for part, t in s.tensors().items():
                if part == "values" or part.startswith("slot "):
                    if t.shape[1:] != [self.dim] or t.dtype != self.dtype:
                        raise ValueError(f"shard {s.shard} {part} is shape {t.shape} dtype {t.dtype}; expected "
                                         f"rows of dim {self.dim} dtype {self.dtype}")
        return self

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)


class Manifest(BaseModel):
    """The committed description of one checkpoint (``manifest.json``)."""

    model_config = ConfigDict(extra="forbid")

    format_version: StrictInt
    checkpoint_number: StrictInt
    step: StrictInt | None = None
    final: bool = False
    created: float
    variables: dict[str, VariableEntry] = {}
    #: dynamic embedding tables: only their live rows, per shard (format version 2)
    dynamic: dict[str, DynamicTableEntry] = {}
    #: JSON state of objects with ``get_state``/``set_state`` (step counters, dataset positions, ...)
    objects: dict[str, Any] = {}

    @field_validator("format_version")
    @classmethod
    def _version(cls, value: int) -> int:
        if value not in READABLE_VERSIONS:
            raise ValueError(f"format_version {value} is not supported; this kubeps reads versions "
                             f"{list(READABLE_VERSIONS)}")
        return value

    @model_validator(mode="after")
    def _dynamic_needs_v2(self) -> "Manifest":
        if self.dynamic and self.format_version < DYNAMIC_FORMAT_VERSION:
            raise ValueError(f"format_version {self.format_version} cannot hold dynamic tables; they need version "
                             f"{DYNAMIC_FORMAT_VERSION}")
        if self.format_version < INCREMENTAL_FORMAT_VERSION and incremental_slices(self.variables):
            raise ValueError(f"format_version {self.format_version} cannot hold an incremental save's slices; they "
                             f"need version {INCREMENTAL_FORMAT_VERSION}")
        return self


def incremental_slices(variables: dict[str, VariableEntry]) -> bool:
    """Whether any slice of ``variables`` (values or slots) is an incremental save's."""
    return any(s.incremental for v in variables.values()
               for t in [v, *(t for g in v.slots.values() for t in g.values())] for s in t.slices)


def manifest_version(variables: dict[str, VariableEntry], dynamic: bool) -> int:
    """The oldest format version that holds these variables (and dynamic tables, where ``dynamic``)."""
    if incremental_slices(variables):
        return INCREMENTAL_FORMAT_VERSION
    return DYNAMIC_FORMAT_VERSION if dynamic else FORMAT_VERSION


# -- names -----------------------------------------------------------------------------------------------------
def _safe(text: str, limit: int = 60) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9_\-]", "_", text)[:limit]
    return f"{cleaned}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"


def slice_file_name(name: str, start: int, stop: int, optimizer: str | None = None, slot: str | None = None) -> str:
    """The data file name of rows ``start..stop-1`` of variable ``name`` (or of one of its slots)."""
    part = "value" if slot is None else _safe(f"{optimizer}\0{slot}", 24)
    return f"{_safe(name)}.{part}.{start}-{stop}.npy"


def delta_file_name(name: str, start: int, stop: int, part: str, optimizer: str | None = None) -> str:
    """The data file name of the rows of ``name`` (``start..stop-1``) an incremental save wrote: their ``ids``, their
    ``value`` rows, or (with ``optimizer``) the rows of slot ``part``."""
    label = part if optimizer is None else _safe(f"{optimizer}\0{part}", 24)
    return f"{_safe(name)}.{label}.{start}-{stop}.delta.npy"


def dynamic_file_name(name: str, shard: int, part: str, optimizer: str | None = None) -> str:
    """The data file name of one part (``keys``, ``values``, ..., or a slot with ``optimizer``) of shard ``shard`` of
    dynamic table ``name``."""
    label = part if optimizer is None else _safe(f"{optimizer}\0{part}", 24)
    return f"{_safe(name)}.dyn{shard}.{label}.npy"


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


def write_array(storage: Storage, path: str, array: np.ndarray) -> tuple[str, int]:
    """Write ``array`` as a ``.npy`` file (fsync'ed, atomic); returns ``(sha256 hex, size in bytes)``."""
    array = np.asarray(array)
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array).reshape(array.shape)  # ascontiguousarray makes scalars 1-D
    with storage.open_write_atomic(path) as f:
        writer = _HashingWriter(f)
        np.lib.format.write_array(writer, array, allow_pickle=False)
    return writer.hash.hexdigest(), writer.nbytes


def write_streamed(storage: Storage, paths: Sequence[str], layouts: Sequence[tuple[tuple[int, ...], np.dtype]],
                   chunks: Iterable[list[np.ndarray]]) -> list[tuple[str, int]]:
    """Write several ``.npy`` files at once (each fsync'ed, atomic), ``layouts[i]`` the shape and dtype of file
    ``i``, from ``chunks``: per chunk, the next rows of every file. Returns ``(sha256 hex, size)`` per file; the
    files are byte for byte what :func:`write_array` writes for the whole arrays."""
    with contextlib.ExitStack() as stack:
        writers = []
        for path, (shape, dtype) in zip(paths, layouts):
            writer = _HashingWriter(stack.enter_context(storage.open_write_atomic(path)))
            np.lib.format.write_array_header_1_0(writer, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                                          "fortran_order": False, "shape": tuple(shape)})
            writers.append(writer)
        for parts in chunks:
            for writer, part in zip(writers, parts):
                writer.write(np.ascontiguousarray(part).reshape(-1).view(np.uint8).data)
    return [(w.hash.hexdigest(), w.nbytes) for w in writers]


Siblings = Callable[[int], tuple[Storage, str]]
"""``siblings(n) -> (storage, directory)``: where the files of checkpoint ``ckpt-<n>`` beside this one are read."""


def sibling_directory(directory: str, number: int) -> str:
    """The directory of checkpoint ``number`` beside the checkpoint directory ``directory`` (its files that an
    incremental checkpoint names by number)."""
    parent = directory.rstrip("/").rsplit("/", 1)[0] if "/" in directory.rstrip("/") else "."
    return f"{parent}/{CHECKPOINT_PREFIX}{int(number)}"


def _locate(storage: Storage, directory: str, number: int | None,
            siblings: Siblings | None) -> tuple[Storage, str]:
    if number is None:
        return storage, directory
    if siblings is not None:
        return siblings(number)
    return storage, sibling_directory(directory, number)


class _Readable(Protocol):
    """A binary file as storages open it for reading (local files and fsspec's both read into buffers)."""

    def read(self, n: int = -1, /) -> bytes: ...

    def readinto(self, buffer: memoryview, /) -> int | None: ...


class _VerifiedFile:
    """One data file read through its sha256, straight into the caller's arrays (``readinto``, no copy)."""

    def __init__(self, f: _Readable, path: str, what: str):
        self._f, self.path, self.what = f, path, what
        self.hash = hashlib.sha256()
        self.nbytes = 0

    def read(self, n: int = -1) -> bytes:  # the .npy header
        data = self._f.read(n)
        self.hash.update(data)
        self.nbytes += len(data)
        return data

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` (bytes) from the file, hashing as it goes."""
        pos, total = 0, view.nbytes
        while pos < total:
            got = self._f.readinto(view[pos:min(total, pos + _READ_CHUNK)])
            if not got:
                raise CheckpointCorruptError(f"{self.what}: file {self.path} is truncated: it ends after "
                                             f"{self.nbytes} bytes, before the data it declares")
            self.hash.update(view[pos:pos + got])
            self.nbytes += got
            pos += got

    def skip(self, n: int) -> None:
        scratch = memoryview(bytearray(min(max(n, 1), _READ_CHUNK)))
        while n > 0:
            k = min(n, scratch.nbytes)
            self.read_into(scratch[:k])
            n -= k

    def rest(self) -> None:
        while True:
            data = self._f.read(_READ_CHUNK)
            if not data:
                return
            self.hash.update(data)
            self.nbytes += len(data)


def read_verified(storage: Storage, path: str, shape: tuple[int, ...], dtype: np.dtype, sha256: str, nbytes: int,
                  what: str, lo: int = 0, hi: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """Rows ``lo..hi-1`` of the ``.npy`` file ``path`` of ``shape`` and ``dtype``, after checking its header, size
    and sha256, read straight into ``out`` (or a new array); the rest of the file is streamed through the hash."""
    hi = (shape[0] if shape else 1) if hi is None else hi
    try:
        f = storage.open_read(path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{what}: data file {path} is missing") from None
    with f:
        reader = _VerifiedFile(f, path, what)  # type: ignore[arg-type]  # IO[bytes] declares no readinto; files do
        try:
            fshape, fortran, fdtype = npyfiles.read_header(reader)
        except (ValueError, SyntaxError, EOFError) as err:
            raise CheckpointCorruptError(f"{what}: file {path} is not a valid .npy file ({err})") from None
        if tuple(fshape) != tuple(shape) or fdtype != dtype or fortran:
            raise CheckpointCorruptError(
                f"{what}: file {path} holds an array of shape {list(fshape)} dtype {fdtype}"
                f"{' (Fortran order)' if fortran else ''}; the manifest expects shape {list(shape)} dtype {dtype}"
            )
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize if shape else dtype.itemsize
        if out is None:
            out = np.empty(((hi - lo),) + tuple(shape[1:]) if shape else (), dtype=dtype)
        reader.skip(lo * row_bytes)
        reader.read_into(out.reshape(-1).view(np.uint8).data if out.size else memoryview(b""))
        reader.skip(((shape[0] if shape else 1) - hi) * row_bytes)
        reader.rest()
    if reader.nbytes != nbytes:
        raise CheckpointCorruptError(f"{what}: file {path} has {reader.nbytes} bytes; the manifest expects {nbytes}")
    digest = reader.hash.hexdigest()
    if digest != sha256:
        raise CheckpointCorruptError(
            f"{what}: file {path} has sha256 {digest}; the manifest expects {sha256} (the file is corrupt)"
        )
    return out


def read_slice_rows(storage: Storage, directory: str, entry: SliceEntry, shape: Sequence[int], dtype: str,
                    lo: int, hi: int, what: str, out: np.ndarray | None = None,
                    siblings: Siblings | None = None) -> np.ndarray:
    """Rows ``lo..hi-1`` (logical numbering) of one slice's base file, after checking its header, size and sha256
    (deltas apart: :func:`read_rows` applies them). The whole file is streamed through the hash (the checksum
    covers all of it); the wanted rows are read straight into ``out`` (or a new array)."""
    where, folder = _locate(storage, directory, entry.checkpoint, siblings)
    expected = tuple(shape) if not shape else (entry.stop - entry.start,) + tuple(shape[1:])
    return read_verified(where, where.join(folder, entry.file), expected, np.dtype(dtype), entry.sha256,
                         entry.nbytes, what, lo - entry.start if shape else 0, hi - entry.start if shape else 1, out)


def apply_deltas(storage: Storage, directory: str, entry: SliceEntry, shape: Sequence[int], dtype: str,
                 out: np.ndarray, lo: int, what: str, siblings: Siblings | None = None) -> None:
    """Apply ``entry``'s deltas, in order, to ``out`` (rows ``lo..lo+len(out)-1``, logical numbering)."""
    hi = lo + out.shape[0]
    for delta in entry.deltas:
        where, folder = _locate(storage, directory, delta.checkpoint, siblings)
        ids = read_verified(where, where.join(folder, delta.ids_file), (delta.rows,), np.dtype(np.int64),
                            delta.ids_sha256, delta.ids_nbytes, f"{what} (changed rows of checkpoint {delta.checkpoint})")
        if ids.size and (int(ids[0]) < entry.start or int(ids[-1]) >= entry.stop or bool((ids[1:] <= ids[:-1]).any())):
            raise CheckpointCorruptError(f"{what}: the changed rows of checkpoint {delta.checkpoint} are not ascending "
                                         f"rows of the slice {entry.start}..{entry.stop - 1}")
        rows = read_verified(where, where.join(folder, delta.file), (delta.rows,) + tuple(shape[1:]),
                             np.dtype(dtype), delta.sha256, delta.nbytes,
                             f"{what} (changed rows of checkpoint {delta.checkpoint})")
        a, b = np.searchsorted(ids, lo), np.searchsorted(ids, hi)
        out[ids[a:b] - lo] = rows[a:b]


def overlapping(slices: Sequence[SliceEntry], lo: int, hi: int) -> list[tuple[SliceEntry, int, int]]:
    """The slices overlapping rows ``lo..hi-1``, each with the overlapping row range ``(a, b)``."""
    out = []
    for s in slices:
        a, b = max(lo, s.start), min(hi, s.stop)
        if a < b:
            out.append((s, a, b))
    return out


def read_rows(storage: Storage, directory: str, entry: TensorEntry, lo: int, hi: int, what: str,
              siblings: Siblings | None = None) -> np.ndarray:
    """Rows ``lo..hi-1`` of a logical tensor, assembled from the slices that overlap them (re-partitioning): each
    slice's rows are read straight into the result, then its deltas applied over them. ``siblings`` says where the
    files of an earlier checkpoint that an incremental one names are read (default: beside ``directory``, with
    ``storage``)."""
    shape = entry.shape
    rows = tensor_rows(shape)
    if not 0 <= lo <= hi <= rows:
        raise CheckpointMismatchError(f"{what}: rows {lo}..{hi - 1} are outside the checkpointed 0..{rows - 1}")
    if not shape:
        (s,) = entry.slices
        return read_slice_rows(storage, directory, s, shape, entry.dtype, 0, 1, what, siblings=siblings)
    out = np.empty((hi - lo,) + tuple(shape[1:]), dtype=np.dtype(entry.dtype))
    covered = 0
    for s, a, b in overlapping(entry.slices, lo, hi):
        read_slice_rows(storage, directory, s, shape, entry.dtype, a, b, what, out[a - lo:b - lo], siblings)
        apply_deltas(storage, directory, s, shape, entry.dtype, out[a - lo:b - lo], a, what, siblings)
        covered += b - a
    if covered != hi - lo:
        raise CheckpointCorruptError(f"{what}: the manifest's slices do not cover rows {lo}..{hi - 1}")
    return out


def _problems(err: ValidationError) -> str:
    """A manifest entry's problems in words: per problem (the first five), its path and pydantic's message."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(top level)'}: {e['msg']}"
                     for e in err.errors(include_url=False)[:5])


EntryT = TypeVar("EntryT", bound=BaseModel)


def parse_entry(model: type[EntryT], raw: object, field: str) -> EntryT:
    """A manifest entry carried in a message (a restore item's ``value``, a table item's ``table``, a save's
    answer), checked by the format's ``model``; a ``ValueError`` naming the field and the problems when malformed.
    The protocol declares such an entry as a JSON object: the manifest format is its one definition."""
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        raise ValueError(f"field '{field}' is not a valid {model.__name__}: {_problems(err)}") from None


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
        raise CheckpointCorruptError(f"checkpoint {path}: {MANIFEST_NAME} is malformed: {_problems(err)}") from None


def commit_manifest(path: str, manifest: Manifest) -> None:
    """Write the manifest last, atomically: from this moment on the checkpoint exists."""
    storage = storage_for(path)
    body = manifest.model_dump_json(indent=1).encode()
    target = storage.join(path, MANIFEST_NAME)
    try:
        storage.write_bytes_atomic(target, body)
    except OSError as err:
        full = space_error(err, target, len(body), 0)
        if full is None:
            raise
        raise full from None


def numbered_dirs(directory: str) -> list[tuple[int, str]]:
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
    return [(n, p) for n, p in numbered_dirs(directory) if storage.exists(storage.join(p, MANIFEST_NAME))]


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
    for name, table in manifest.dynamic.items():
        for shard in table.shards:
            for part, t in shard.tensors().items():
                read_rows(storage, path, t, 0, tensor_rows(t.shape), f"dynamic table {name!r} shard {shard.shard} {part}")
    return manifest


def short_listing(names: Iterable[str], limit: int = 12) -> str:
    names = sorted(names)
    if not names:
        return "nothing"
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
