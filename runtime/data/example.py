"""``tf.Example`` records without TensorFlow: the message, a parse spec like ``tf.io.parse_example``'s, and
:func:`parse_example` turning a list of serialized records into numpy columns.

The message is TensorFlow's ``example.proto``/``feature.proto`` (``Example{Features features = 1}``,
``Features{map<string, Feature> feature = 1}``, ``Feature{oneof kind: BytesList bytes_list = 1; FloatList
float_list = 2; Int64List int64_list = 3}``), declared here as a descriptor and built by Google's ``protobuf``
package (its C ``upb`` parser does the decoding) in a descriptor pool of its own, so it never clashes with
TensorFlow's generated classes in the same process. That avoids both generated code to keep in sync and the
unmaintained packages that copy TensorFlow's ``_pb2`` files.

Features:

- :class:`FixedLenFeature` ``(shape, dtype, default_value=None)``: every record has exactly ``prod(shape)``
  values (or the feature is absent and the default is used); the column is an array ``[rows, *shape]``.
- :class:`VarLenFeature` ``(dtype)``: any number of values per record (multi-hot ids); the column is a
  variable-length column -- an object array of 1-D arrays, one per record -- which
  :func:`~kubeps.runtime.data.columns.to_sparse` turns into ``tf.io.parse_example``'s ``SparseTensor`` parts
  ``(indices, values, dense_shape)`` and :func:`~kubeps.runtime.data.columns.to_ragged` into ``(values,
  row_splits)``.

``dtype`` is the kind of list the feature holds: an integer dtype reads ``int64_list`` (np.int64 as is, narrower
integers range-checked), a float dtype ``float_list`` (float32, or float64 widened), ``bytes``/``object``
``bytes_list``. A record that lacks a feature without default, holds another kind of list, or the wrong number of
values is an error naming the file, the record's byte offset, the feature, what it holds and what is allowed.
"""

from __future__ import annotations

import itertools
from operator import attrgetter, itemgetter, methodcaller
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from kubeps.runtime.data.columns import ColumnValueError, cast, varlen_column
from kubeps.runtime.data.tfrecord import RecordRun
from kubeps.runtime.errors import RuntimeConfigError


class FixedLenFeature(NamedTuple):
    shape: Sequence[int]
    dtype: Any
    default_value: Any = None


class VarLenFeature(NamedTuple):
    dtype: Any


_message_classes: dict[str, Any] = {}


def _messages() -> dict[str, Any]:
    """``Example``, ``Features``, ``Feature`` and the three list messages, built once per process."""
    if _message_classes:
        return _message_classes
    try:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory  # noqa: PLC0415 - optional
    except ImportError:
        raise ImportError("tf.Example records need the optional 'protobuf' package: pip install 'kubeps[tfrecord]'") from None
    F = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="kubeps/tensorflow_example.proto", package="tensorflow",
                                               syntax="proto3")

    def message(name: str, *fields: tuple[str, int, int, int, str]) -> Any:
        m = proto.message_type.add(name=name)
        for field_name, number, kind, label, type_name in fields:
            m.field.add(name=field_name, number=number, type=kind, label=label, type_name=type_name or None)
        return m

    packed = descriptor_pb2.FieldOptions(packed=True)
    message("BytesList", ("value", 1, F.TYPE_BYTES, F.LABEL_REPEATED, ""))
    message("FloatList", ("value", 1, F.TYPE_FLOAT, F.LABEL_REPEATED, "")).field[0].options.CopyFrom(packed)
    message("Int64List", ("value", 1, F.TYPE_INT64, F.LABEL_REPEATED, "")).field[0].options.CopyFrom(packed)
    feature = message("Feature",
                      ("bytes_list", 1, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.BytesList"),
                      ("float_list", 2, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.FloatList"),
                      ("int64_list", 3, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.Int64List"))
    feature.oneof_decl.add(name="kind")
    for f in feature.field:
        f.oneof_index = 0
    features = message("Features", ("feature", 1, F.TYPE_MESSAGE, F.LABEL_REPEATED, ".tensorflow.Features.FeatureEntry"))
    entry = features.nested_type.add(name="FeatureEntry")
    entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=F.TYPE_MESSAGE, label=F.LABEL_OPTIONAL, type_name=".tensorflow.Feature")
    entry.options.map_entry = True
    message("Example", ("features", 1, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.Features"))
    # a block of records parsed by one call: `Records` (bytes) serialized is, on the wire, `Examples` (messages)
    message("Records", ("record", 1, F.TYPE_BYTES, F.LABEL_REPEATED, ""))
    message("Examples", ("example", 1, F.TYPE_MESSAGE, F.LABEL_REPEATED, ".tensorflow.Example"))
    # the columnar views of a block (see _parse_columns): the same wire, declared so that the records merge
    message("RawEntry", ("key", 1, F.TYPE_STRING, F.LABEL_REPEATED, ""))
    message("RawFeatures", ("feature", 1, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.RawEntry"))
    message("RawExample", ("features", 1, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.RawFeatures"))
    message("FlatFeature", ("bytes_list", 1, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.BytesList"),
            ("float_list", 2, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.FloatList"),
            ("int64_list", 3, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.Int64List"))
    message("ValueEntry", ("key", 1, F.TYPE_BYTES, F.LABEL_REPEATED, ""),
            ("value", 2, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.FlatFeature"))
    message("ValueFeatures", ("feature", 1, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.ValueEntry"))
    message("ValueExample", ("features", 1, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.ValueFeatures"))
    message("ValueExamples", ("example", 1, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.ValueExample"),
            ("gap", 2, F.TYPE_BYTES, F.LABEL_OPTIONAL, ""))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    for name in ("Example", "Features", "Feature", "BytesList", "FloatList", "Int64List", "Records", "Examples",
                 "RawExample", "ValueEntry", "ValueExamples"):
        _message_classes[name] = message_factory.GetMessageClass(pool.FindMessageTypeByName(f"tensorflow.{name}"))
    return _message_classes


def example_class() -> Any:
    """The ``tensorflow.Example`` message class (for writing records: see :func:`serialize_example`)."""
    return _messages()["Example"]


def _list_kind(dtype: np.dtype) -> str:
    if dtype.kind in "iub":
        return "int64_list"
    if dtype.kind == "f":
        return "float_list"
    return "bytes_list"


def serialize_example(features: Mapping[str, Any]) -> bytes:
    """One ``tf.Example`` record from ``{name: values}``: integers go to ``int64_list``, floats to ``float_list``
    (float32 on the wire), bytes/str to ``bytes_list``."""
    example = example_class()()
    fmap = example.features.feature
    for name, values in features.items():
        array = np.asarray(values).reshape(-1)
        kind = _list_kind(array.dtype) if array.size else "float_list"
        target = getattr(fmap[name], kind)
        if kind == "bytes_list":
            target.value.extend(v.encode() if isinstance(v, str) else bytes(v) for v in array.tolist())
        else:
            target.value.extend(array.tolist())
    return example.SerializeToString()


_WIRE = {"int64_list": "int64", "float_list": "float32", "bytes_list": "bytes"}


def feature_spec(features: Mapping[str, Any]) -> dict[str, FixedLenFeature | VarLenFeature]:
    if not isinstance(features, Mapping) or not features:
        raise RuntimeConfigError("features", features, "a non-empty {name: FixedLenFeature | VarLenFeature} dict")
    out: dict[str, FixedLenFeature | VarLenFeature] = {}
    for name, spec in features.items():
        if isinstance(spec, FixedLenFeature):
            dims: Any = spec.shape if isinstance(spec.shape, (list, tuple)) else [spec.shape]  # a scalar: one dim
            shape = tuple(int(d) for d in dims)
            if any(d < 0 for d in shape):
                raise ValueError(f"feature {name!r}: shape {shape} has a negative dimension")
            dtype = _dtype(spec.dtype, name)
            default = None if spec.default_value is None else np.broadcast_to(np.asarray(spec.default_value, dtype), shape)
            out[name] = FixedLenFeature(shape, dtype, default)
        elif isinstance(spec, VarLenFeature):
            out[name] = VarLenFeature(_dtype(spec.dtype, name))
        else:
            raise TypeError(f"feature {name!r}: expected FixedLenFeature(shape, dtype) or VarLenFeature(dtype), got {spec!r}")
    return out


def _dtype(dtype: Any, name: str) -> np.dtype:
    if dtype in (bytes, str, object):
        return np.dtype(object)
    try:
        result = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"feature {name!r}: dtype {dtype!r} is not a numpy dtype (np.int64, np.float32, bytes)") from None
    if result.kind not in "iuf" and result.kind != "O":
        raise TypeError(f"feature {name!r}: dtype {result} is not an integer, float or bytes dtype")
    return result


def parse_example(
    serialized: Sequence[bytes], features: Mapping[str, FixedLenFeature | VarLenFeature],
    path: str = "<records>", offsets: Sequence[int] | None = None,
) -> dict[str, np.ndarray]:
    """``tf.io.parse_example`` for numpy: serialized ``tf.Example`` records -> ``{feature: column}`` (see the
    module's docstring for the columns' forms). ``path`` and ``offsets`` name where a bad record is."""
    return _parse_records(serialized, feature_spec(features), path, offsets, _parse_columns)


def parse_run(run: RecordRun, features: Mapping[str, FixedLenFeature | VarLenFeature], path: str = "<records>") -> dict[str, np.ndarray]:
    """:func:`parse_example` of the records of a :class:`~kubeps.runtime.data.tfrecord.RecordRun`, read where they
    lie in their buffer (:func:`_run_columns`: the run's framing bytes are rewritten)."""
    spec = feature_spec(features)
    return _parse_records(run.records, spec, path, run.offsets.tolist, lambda _, spec: _run_columns(run, spec))


def _parse_records(serialized: Any, spec: Mapping[str, FixedLenFeature | VarLenFeature], path: str, offsets: Any,
                   columnar: Any) -> dict[str, np.ndarray]:
    """The columns of ``serialized`` (the records, or a function that gives them): ``columnar(serialized, spec)``,
    else :func:`_parse_block`, else record by record. ``offsets``: a list, a function giving one, or None."""
    block = columnar(serialized, spec)
    if block is not None:
        return block
    serialized = serialized() if callable(serialized) else serialized
    offsets = offsets() if callable(offsets) else offsets
    block = _parse_block(serialized, spec) if len(serialized) else None
    if block is not None:
        return block
    parse = example_class().FromString
    n = len(serialized)
    fixed: dict[str, list[Any]] = {}
    sizes: dict[str, int] = {}
    varlen: dict[str, list[Any]] = {}
    kinds = {name: _list_kind(s.dtype) for name, s in spec.items()}
    for name, s in spec.items():
        if isinstance(s, FixedLenFeature):
            fixed[name] = []
            sizes[name] = int(np.prod(s.shape)) if len(s.shape) else 1
        else:
            varlen[name] = []

    def where(i: int) -> str:
        return f"{path}: record at byte offset {offsets[i]}" if offsets is not None else f"{path}: record {i}"

    for i, record in enumerate(serialized):
        try:
            fmap = parse(record).features.feature
        except Exception as err:  # noqa: BLE001 - protobuf's DecodeError, named with the record
            raise ColumnValueError(f"{where(i)}: not a tf.Example ({type(err).__name__}: {err})") from None
        for name, values in fixed.items():
            if name in fmap:
                feature = fmap[name]
                kind = feature.WhichOneof("kind")
                got = getattr(feature, kind).value if kind is not None else ()
                if (kind != kinds[name] and len(got)) or len(got) != sizes[name]:  # an empty list has no kind
                    raise ColumnValueError(_mismatch(where(i), name, spec[name], kind, len(got), sizes[name]))
                values.extend(got)
            else:
                default = spec[name].default_value  # type: ignore[union-attr]  # `fixed` holds FixedLenFeatures only
                if default is None:
                    raise ColumnValueError(
                        f"{where(i)}: feature {name!r} is missing and its FixedLenFeature has no default_value; "
                        f"the record has {sorted(fmap)}"
                    )
                values.extend(default.reshape(-1).tolist())
        for name, rows in varlen.items():
            if name in fmap:
                feature = fmap[name]
                kind = feature.WhichOneof("kind")
                if kind is not None and kind != kinds[name] and len(getattr(feature, kind).value):
                    raise ColumnValueError(_mismatch(where(i), name, spec[name], kind,
                                                     len(getattr(feature, kind).value), None))
                rows.append(getattr(feature, kinds[name]).value if kind == kinds[name] else ())
            else:
                rows.append(())

    out: dict[str, np.ndarray] = {}
    for name, values in fixed.items():
        out[name] = _column(values, spec[name].dtype, kinds[name], name, where, sizes[name]).reshape(
            (n, *spec[name].shape))  # type: ignore[union-attr]  # `fixed` holds FixedLenFeatures only
    for name, rows in varlen.items():
        dtype, kind = spec[name].dtype, kinds[name]
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=n)
        flat = [v for r in rows for v in r]
        row_of = np.repeat(np.arange(n), lengths)
        column = _column(flat, dtype, kind, name, lambda j: where(int(row_of[j])), 1)
        out[name] = varlen_column(np.split(column, np.cumsum(lengths)[:-1]))
    return out


_TAG = {"bytes_list": 1 << 3 | 2, "float_list": 2 << 3 | 2, "int64_list": 3 << 3 | 2}  # a Feature's list fields


def _parse_columns(serialized: Sequence[bytes], spec: Mapping[str, FixedLenFeature | VarLenFeature]) -> dict[str, np.ndarray] | None:
    """The block's columns with no Python step per record or value: numpy reads the block's layout, protobuf's C
    parser decodes every value of the block in one call, and numpy cuts the columns out of them. ``None`` when the
    block is anything but plain: then :func:`_parse_block`, then the record-by-record path, decide (and name the
    record in an error).

    The values are decoded by protobuf's documented merge rule: parsing a concatenation of messages is merging
    them -- a singular embedded message merges recursively, a repeated field appends. The block's records, each a
    length-delimited field 1 of a ``Records`` message (as in :func:`_parse_block`'s trick), are parsed as
    ``ValueExamples{ValueExample example = 1}``, a view declared here with the wire numbers and types of
    ``tf.Example`` but other labels: ``example`` *singular*, so the records merge into one;
    ``ValueExample{ValueFeatures features = 1}``, ``ValueFeatures{ValueEntry feature = 1}`` -- the map's entry
    singular, so all N x F entries merge into one -- ``ValueEntry{repeated bytes key = 1; FlatFeature value = 2}``,
    ``FlatFeature{BytesList bytes_list = 1; FloatList float_list = 2; Int64List int64_list = 3}`` (no oneof):
    ``key`` then holds every entry's key and ``int64_list.value`` every int64 of the block, in wire order, and
    ``float_list.value`` every float.

    That the merged values are columns is checked, not assumed: :func:`_layout` reads every record's fields and
    lengths with numpy and requires each record to hold as many entries as the first record, each a key (as long
    as that entry's key in the first record) and a ``Feature``, each non-empty ``Feature`` one list (of one of the
    three kinds) and each non-empty list of floats or int64s one packed run -- every byte of the record accounted
    for, so there is no other field, known or unknown, that the merge could take values from. The merged keys
    (every entry's, in wire order) must then be the first record's, in the same order, in every record: compared
    as protobuf serializes them, one bytes comparison. Each run's bytes are then known exactly.
    A float run's count of values is its bytes / 4. An int64 run's count is taken from the values protobuf decoded:
    each value's varint as protobuf writes it (no longer than it must be) must fill the runs' bytes exactly, and
    then the values end where the runs do (protobuf parsed each run bounded: no varint crosses the end of one). A
    bytes list's size is not checked: it is only read to refuse the list where the spec wants another kind.
    Counts are computed by numpy to check the layout and cut the columns; every value itself is decoded by
    protobuf. A record with 2 values for one feature and 0 for the next thus fails its feature's count instead of
    shifting the columns.
    """
    if not len(serialized) or _reads_bytes(spec):
        return None
    lengths = np.fromiter(map(len, serialized), dtype=np.int64, count=len(serialized))
    ends = np.cumsum(1 + _varint_size(lengths) + lengths)  # each record's end in the `Records` message
    return _stream_columns(_messages()["Records"](record=serialized).SerializeToString(), ends - lengths, ends, spec)


def _reads_bytes(spec: Mapping[str, FixedLenFeature | VarLenFeature]) -> bool:
    """Whether the spec reads a bytes list: such blocks are left to :func:`_parse_block`."""
    return any(_list_kind(s.dtype) == "bytes_list" for s in spec.values())


def _run_columns(run: RecordRun, spec: Mapping[str, FixedLenFeature | VarLenFeature]) -> dict[str, np.ndarray] | None:
    """:func:`_parse_columns` of a run's records where they lie: the 6 bytes before each record (in its frame's
    header) become its field 1 tag and its length, a varint written 5 bytes long (legal: protobuf reads lengths so
    written, never writes them), and the 10 before those (the trailer of the record before, the start of the
    header) a field 2 of 8 bytes, declared in the view ``ValueExamples`` (``bytes gap = 2``, singular: each one
    replaces the last): the run's bytes are then a ``Records`` message, with no copy of a record."""
    if _reads_bytes(spec):
        return None
    u8 = np.frombuffer(run.data, dtype=np.uint8)
    starts, ends = run.starts, run.ends
    lengths = ends - starts
    for k in range(5):
        u8[starts - 5 + k] = (lengths >> 7 * k) & 0x7F | (0x80 if k < 4 else 0)
    u8[starts - 6] = 0x0A
    u8[starts[1:] - 16] = 0x12
    u8[starts[1:] - 15] = 8
    base = int(starts[0]) - 6
    return _stream_columns(memoryview(run.data)[base : int(ends[-1])], starts - base, ends - base, spec)


def _stream_columns(stream: Any, starts: np.ndarray, ends: np.ndarray,
                    spec: Mapping[str, FixedLenFeature | VarLenFeature]) -> dict[str, np.ndarray] | None:
    """:func:`_parse_columns` of ``stream`` (bytes-like), a ``Records`` message whose record ``i`` is
    ``stream[starts[i]:ends[i]]``."""
    m = _messages()
    n = len(starts)
    try:
        names = list(m["RawExample"].FromString(stream[int(starts[0]) : int(ends[0])]).features.feature.key)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError: the record-by-record path names the record
        return None
    width = len(names)
    if not width or len(set(names)) != width:
        return None  # no features, or the first record's twice: decided record by record
    keys = [name.encode() for name in names]
    layout = _layout(np.frombuffer(stream, dtype=np.uint8), starts, ends, keys)
    if layout is None:
        return None  # records of other features, or in another order, or written otherwise
    tags, runs = layout
    try:
        merged = m["ValueExamples"].FromString(stream).example.features.feature
    except Exception:  # noqa: BLE001 - a run protobuf does not parse (a float run of 5 bytes, a varint cut short)
        return None
    decoded = merged.value
    counts = np.zeros(n * width, dtype=np.int64)
    offsets: dict[str, np.ndarray] = {}
    columns: dict[str, np.ndarray] = {}
    for kind, tag in _TAG.items():
        held = tags == tag
        payload = runs[held]  # the run's bytes; a bytes list's (not 0 if it is not empty: enough to refuse it)
        if kind == "bytes_list":
            counts[held] = payload
            continue
        column = np.array(getattr(decoded, kind).value, dtype=np.int64 if kind == "int64_list" else np.float32)
        if kind == "float_list":
            if (payload % 4).any():
                return None
            per_list = payload // 4
        else:
            # each value's varint as protobuf writes it (no longer than it must be): if those fill the runs' bytes
            # exactly, every varint was written so, and the values end where the runs end
            value_ends = np.cumsum(_varint_size(column.view(np.uint64), 10))
            bounds = np.cumsum(payload)
            if (int(value_ends[-1]) if value_ends.size else 0) != (int(bounds[-1]) if bounds.size else 0):
                return None
            taken = np.searchsorted(value_ends, bounds, side="right")  # the values that end by each run's end
            if (value_ends[taken[bounds > 0] - 1] != bounds[bounds > 0]).any():
                return None
            per_list = np.diff(taken, prepend=0)
        counts[held] = per_list
        if column.size != int(per_list.sum()):
            return None
        columns[kind] = column
        in_kind = np.where(held, counts, 0)
        offsets[kind] = (np.cumsum(in_kind) - in_kind).reshape(n, width)
    merged.ClearField("value")  # the keys alone: every entry's, in wire order (each entry has one: _layout)
    if merged.SerializeToString() != m["ValueEntry"](key=keys).SerializeToString() * n:
        return None  # records of other features, or in another order: decided record by record
    counts_at, tags_at = counts.reshape(n, width), tags.reshape(n, width)  # [record, entry]
    out: dict[str, np.ndarray] = {}
    for name, s in spec.items():
        kind = _list_kind(s.dtype)
        wire = np.int64 if kind == "int64_list" else np.float32
        if name not in names:  # in no record: its default, or no values
            if isinstance(s, FixedLenFeature):
                if s.default_value is None:
                    return None  # an error: the record-by-record path names the record
                flat = np.tile(np.array(s.default_value.reshape(-1).tolist(), dtype=wire), n)
            else:
                flat = np.empty(0, dtype=wire)
            lengths = np.full(n, flat.size // n, dtype=np.int64)
        else:
            j = names.index(name)
            lengths, other_kind = counts_at[:, j], tags_at[:, j] != _TAG[kind]
            if isinstance(s, FixedLenFeature):
                size = int(np.prod(s.shape)) if len(s.shape) else 1
                if (lengths != size).any() or (size and other_kind.any()):
                    return None  # a list of another length or kind: an error named record by record
            elif (other_kind & (lengths > 0)).any():
                return None
            at, values = offsets[kind][:, j], columns[kind]
            stride = values.size // n
            if isinstance(s, FixedLenFeature) and stride * n == values.size and at[0] + size <= stride and (
                    at == at[0] + stride * np.arange(n)).all():  # the kind's values laid out alike in every record
                flat = np.ascontiguousarray(values.reshape(n, stride)[:, at[0] : at[0] + size])
            else:
                rows = np.cumsum(lengths) - lengths
                flat = values[np.repeat(at - rows, lengths) + np.arange(int(lengths.sum()))]
        shaped = _block_column(flat, s, lengths)
        if shaped is None:
            return None
        out[name] = shaped
    return out


def _layout(u8: np.ndarray, records: np.ndarray, ends: np.ndarray, keys: list[bytes]) -> tuple[np.ndarray, np.ndarray] | None:
    """Each entry's list tag and run bytes (flat, ``[record, entry]`` order) if every record of ``u8`` (record
    ``i``: ``u8[records[i]:ends[i]]``) is ``len(keys)`` map entries, each a key field of the length of that entry's
    key in ``keys``, then a ``Feature`` field; each non-empty ``Feature`` one list field and each non-empty float
    or int64 list one packed run -- nothing else, every byte accounted for -- else None. The list tag is 0 for an
    empty ``Feature`` (no list); the run bytes are a packed list's run's, a bytes list's own, 0 for no values. (The
    keys' bytes are the caller's to compare.)

    Numpy reads every record's fields at once, a level at a time: each field's one-byte tag (the only tags taken:
    field 1, 2 or 3, length-delimited) and its length, a varint of up to 5 bytes (read as written, long or not).
    Each field must end where its parent ends, its last child too, so a record that holds anything else, or a
    length that points elsewhere, fails a check; reads past the end of ``u8`` (by records that fail) read its last
    byte."""
    sizes = np.array([len(key) for key in keys], dtype=np.int64)
    if (sizes >= 128).any():
        return None  # a key whose length takes two bytes: decided record by record
    n, width = records.size, len(keys)
    ok = _bytes_at(u8, records) == 0x0A  # Example.features
    size, taken = _varints(u8, records + 1)
    at = records + 1 + taken
    ok &= at + size == ends
    starts = np.empty((n, width), dtype=np.int64)  # each entry's first byte after its length
    stops = np.empty((n, width), dtype=np.int64)  # each entry's end
    for j in range(width):
        ok &= _bytes_at(u8, at) == 0x0A  # Features.feature: a map entry
        size, taken = _varints(u8, at + 1)
        starts[:, j] = at + 1 + taken
        at = stops[:, j] = starts[:, j] + size
    ok &= at == ends
    if not ok.all():
        return None
    entry, stop = starts.reshape(-1), stops.reshape(-1)  # [record, entry] order
    key = np.tile(sizes, n)
    good = ((_bytes_at(u8, entry) == 0x0A) & (_bytes_at(u8, entry + 1) == key)
            & (_bytes_at(u8, entry + 2 + key) == 0x12))  # the key field, then the value's tag
    size, taken = _varints(u8, entry + 3 + key)
    feature = entry + 3 + key + taken  # the Feature's first byte
    good &= feature + size == stop
    present = size > 0
    tag = np.where(present, _bytes_at(u8, feature), 0)
    listed, taken = _varints(u8, feature + 1)
    good &= ~present | ((1 + taken + listed == size) & ((tag == 0x0A) | (tag == 0x12) | (tag == 0x1A)))
    run = feature + 1 + taken  # the list's first byte
    packed = present & (listed > 0) & (tag != 0x0A)  # a list of floats or int64s with values: one packed run
    held, taken = _varints(u8, run + 1)
    good &= ~packed | ((_bytes_at(u8, run) == 0x0A) & (1 + taken + held == listed))
    if not good.all():
        return None
    return tag, np.where(packed, held, np.where(present, listed, 0))


def _varints(u8: np.ndarray, at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The varint at each offset ``at`` of ``u8`` and its bytes (at most 5; for a longer one, 2**40). Reads past
    the end of ``u8`` read its last byte: the caller's checks refuse the records they belong to."""
    byte = _bytes_at(u8, at).astype(np.int64)
    more = byte >= 0x80
    if not more.any():
        return byte, np.ones(1, dtype=np.int64)  # one byte each (the common case: lengths below 128)
    value, size = byte & 0x7F, np.ones(at.shape, dtype=np.int64)
    for k in range(1, 5):
        if not more.any():
            break
        byte = _bytes_at(u8, at + k).astype(np.int64)
        value += np.where(more, (byte & 0x7F) << 7 * k, 0)
        size += more
        more &= byte >= 0x80
    size[more] = 1 << 40  # longer than 5 bytes: no field ends where it must
    return value, size


def _bytes_at(u8: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The byte at each offset ``at`` of ``u8``; offsets past its end read its last byte."""
    return u8[np.minimum(at, u8.size - 1)]


def _varint_size(n: np.ndarray, longest: int = 5) -> np.ndarray:
    """Bytes of the varint of each of ``n`` as protobuf writes it (no longer than it must): lengths (``n`` >= 0,
    below 2**35), or with ``longest=10`` int64 values viewed as uint64 (a negative value takes 10 bytes)."""
    size = np.ones(n.shape, dtype=np.int64)
    for k in range(1, longest):
        longer = n >= (np.uint64(1 << 7 * k) if n.dtype == np.uint64 else 1 << 7 * k)
        if not longer.any():
            break  # no value needs this byte, nor any later one
        size += longer
    return size


def _parse_block(serialized: Sequence[bytes], spec: Mapping[str, FixedLenFeature | VarLenFeature]) -> dict[str, np.ndarray] | None:
    """The block's columns, with no Python step per value: the records are parsed by one call of protobuf's C
    parser (a ``Records`` message of ``bytes`` fields is, on the wire, an ``Examples`` message of ``Example``
    fields: protobuf documents embedded messages as encoded exactly as ``bytes``), each feature's lists of all
    records are concatenated by protobuf (``extend`` of a repeated field by another copies in C) and turned into
    one numpy array. ``None`` when anything is off (a record that does not parse, a missing feature, a list of
    another kind or length, a value the dtype does not hold): :func:`parse_example`'s record-by-record path then
    fills defaults or names the record."""
    m = _messages()
    n = len(serialized)
    try:
        examples = m["Examples"].FromString(m["Records"](record=serialized).SerializeToString()).example
    except Exception:  # noqa: BLE001 - protobuf's DecodeError: the record-by-record path names the record
        return None
    fmaps = list(map(attrgetter("features.feature"), examples))
    out: dict[str, np.ndarray] = {}
    for name, s in spec.items():
        kind = _list_kind(s.dtype)
        feats = list(map(itemgetter(name), fmaps))  # a missing feature reads (and is added to this copy) empty
        values = list(map(attrgetter(f"{kind}.value"), feats))
        lengths = np.fromiter(map(len, values), dtype=np.int64, count=n)
        if isinstance(s, FixedLenFeature):
            size = int(np.prod(s.shape)) if len(s.shape) else 1
            if size == 0 or (lengths != size).any():
                return None  # missing (default) or wrong length: decided record by record
        else:
            kinds = list(map(methodcaller("WhichOneof", "kind"), feats))
            if any(k not in (kind, None) and len(getattr(feats[i], k).value) for i, k in enumerate(kinds)):
                return None  # a list of another kind (an empty one has no kind: serialize_example writes float_list)
        total = int(lengths.sum())
        if kind == "bytes_list":
            column = np.empty(total, dtype=object)
            column[:] = list(itertools.chain.from_iterable(values))
        else:
            into = m["Int64List" if kind == "int64_list" else "FloatList"]().value
            extend = into.extend
            for v in values:
                extend(v)
            wire = np.fromiter(into, dtype=np.int64 if kind == "int64_list" else np.float32, count=total)
            column = wire
        shaped = _block_column(column, s, lengths)
        if shaped is None:
            return None
        out[name] = shaped
    return out


def _block_column(values: np.ndarray, spec: FixedLenFeature | VarLenFeature, lengths: np.ndarray) -> np.ndarray | None:
    """A feature's values in a block (flat, in record order) as its column -- ``[records, *shape]``, or one array
    per record of ``lengths`` values -- in the spec's dtype; ``None`` for a value the dtype does not hold (the
    record-by-record path names it)."""
    try:
        column = cast(values, spec.dtype, str)
    except ColumnValueError:
        return None
    if isinstance(spec, FixedLenFeature):
        return column.reshape((len(lengths), *spec.shape))
    return varlen_column(np.split(column, np.cumsum(lengths)[:-1]))


def _column(values: list[Any], dtype: np.dtype, kind: str, name: str, where: Any, per_row: int) -> np.ndarray:
    if kind == "bytes_list":
        column = np.empty(len(values), dtype=object)
        column[:] = values
        return column
    wire = np.array(values, dtype=np.int64 if kind == "int64_list" else np.float32)
    return cast(wire, dtype, lambda j: f"{where(j // per_row)}, feature {name!r}")


def _mismatch(where: str, name: str, spec: Any, kind: str | None, got: int | None, want: int | None) -> str:
    expected = f"{_WIRE[_list_kind(spec.dtype)]} ({_list_kind(spec.dtype)})"
    holds = "no list" if kind is None else f"a {kind}" + ("" if got is None else f" of {got} values")
    if isinstance(spec, FixedLenFeature):
        expected += f" of exactly {want} values (shape {tuple(spec.shape)})"
    return f"{where}: feature {name!r} holds {holds}; its spec {type(spec).__name__} wants {expected}"
