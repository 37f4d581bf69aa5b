"""The checkpoint format: errors, the manifest (pydantic), file names, verified ``.npy`` data files and the
listing of checkpoint directories on a storage. No knowledge of variables or parameter servers."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from typing import Iterable, Any, Sequence, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError, field_validator, model_validator

from kubeps.runtime.rpc.protocol import legacy_slot_key
from kubeps.runtime.util import npyfiles
from kubeps.runtime.util.storage import Storage, normalize_path, storage_for

log = logging.getLogger("kubeps.runtime.checkpoint.format")


#: Version of the manifest format this module writes for checkpoints without dynamic tables (readable by every
#: kubeps); :data:`DYNAMIC_FORMAT_VERSION` for checkpoints holding one, so that an older kubeps refuses them with
#: "format_version 2 is not supported" instead of misreading them. Both are read.
FORMAT_VERSION = 1
DYNAMIC_FORMAT_VERSION = 2
READABLE_VERSIONS = (FORMAT_VERSION, DYNAMIC_FORMAT_VERSION)
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


class SliceEntry(BaseModel):
    """Rows ``start..stop-1`` of a logical tensor, stored in ``file`` (relative to the checkpoint directory)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # strict ints everywhere: "2", 2.0 and true are refused, not read as 2, 2 and 1
    start: StrictInt
    stop: StrictInt
    file: str
    sha256: str
    nbytes: StrictInt
    #: optimizer update count of the shard these rows came from (learning-rate schedules, Adam's bias correction)
    updates: StrictInt = 0

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


class SavedShard(BaseModel):
    """What saving one shard of a variable wrote (a ``SaveShards`` answer holds one per item): the value's slice,
    its dtype, and ``slots``: ``{optimizer key: {slot: (slice, dtype, trailing shape)}}``. The coordinator puts the
    shards of a variable together into its :class:`VariableEntry`."""

    model_config = ConfigDict(extra="forbid")

    key: str
    value: SliceEntry
    dtype: str
    slots: dict[str, dict[str, tuple[SliceEntry, str, list[int]]]] = {}


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
        return self


# -- names -----------------------------------------------------------------------------------------------------
def _safe(text: str, limit: int = 60) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9_\-]", "_", text)[:limit]
    return f"{cleaned}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"


def slice_file_name(name: str, start: int, stop: int, optimizer: str | None = None, slot: str | None = None) -> str:
    """The data file name of rows ``start..stop-1`` of variable ``name`` (or of one of its slots)."""
    part = "value" if slot is None else _safe(f"{optimizer}\0{slot}", 24)
    return f"{_safe(name)}.{part}.{start}-{stop}.npy"


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
    storage.write_bytes_atomic(storage.join(path, MANIFEST_NAME), body)


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
