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
    message("RawEntry", ("key", 1, F.TYPE_STRING, F.LABEL_REPEATED, ""), ("value", 2, F.TYPE_BYTES, F.LABEL_REPEATED, ""))
    message("RawFeatures", ("feature", 1, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.RawEntry"))
    message("RawExample", ("features", 1, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.RawFeatures"))
    message("RawExamples", ("example", 1, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.RawExample"))
    message("FlatFeature", ("bytes_list", 1, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.BytesList"),
            ("float_list", 2, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.FloatList"),
            ("int64_list", 3, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.Int64List"))
    message("ListsFeature", ("bytes_list", 1, F.TYPE_BYTES, F.LABEL_REPEATED, ""),
            ("float_list", 2, F.TYPE_BYTES, F.LABEL_REPEATED, ""), ("int64_list", 3, F.TYPE_BYTES, F.LABEL_REPEATED, ""))
    message("FlatFeatures", ("feature", 2, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.FlatFeature"))
    message("ListsFeatures", ("feature", 2, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.ListsFeature"))
    message("Chunks", ("value", 1, F.TYPE_BYTES, F.LABEL_REPEATED, ""))
    message("ChunksFeature", *((kind, number, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.Chunks")
                               for kind, number in (("bytes_list", 1), ("float_list", 2), ("int64_list", 3))))
    message("ChunksFeatures", ("feature", 2, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.ChunksFeature"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    for name in ("Example", "Features", "Feature", "BytesList", "FloatList", "Int64List", "Records", "Examples",
                 "RawEntry", "RawExample", "RawExamples", "FlatFeatures", "ListsFeatures",
                 "ChunksFeatures"):
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
        raise TypeError(f"argument `features` must be a non-empty {{name: FixedLenFeature | VarLenFeature}} dict, "
                        f"got {features!r}")
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
    spec = feature_spec(features)
    block = (_parse_columns(serialized, spec) or _parse_block(serialized, spec)) if len(serialized) else None
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
    """The block's columns with no Python step per record or value: protobuf's C parser decodes the block into a
    few messages, one per *view*, and numpy cuts the columns out of them. ``None`` when the block is anything but
    plain: then :func:`_parse_block`, then the record-by-record path, decide (and name the record in an error).

    Still protobuf parsing, by protobuf's documented merge rule: parsing a concatenation of messages is merging
    them -- a singular embedded message merges recursively, a repeated field appends. The views are messages
    declared here with the wire numbers and types of ``tf.Example`` but other labels, so that the merge of a
    block's records *is* its columns:

    - ``RawExamples{RawExample example = 1}`` over the ``Records`` message of the block (each record a
      length-delimited field 1, as in :func:`_parse_block`'s trick): ``example`` *singular*, so the records merge
      into one; ``RawExample{RawFeatures features = 1}``, ``RawFeatures{RawEntry feature = 1}`` -- the map's entry
      singular, so all N x F entries merge into one -- and ``RawEntry{repeated string key = 1; repeated bytes
      value = 2}``: every entry's key, and its ``Feature`` undecoded, in wire order.
    - that merged entry serialized is its keys, then its ``Feature`` s, each a length-delimited field 2 (parsed
      on its own below, so a malformed one is a DecodeError): ``FlatFeatures{FlatFeature feature = 2}`` with
      ``FlatFeature{BytesList bytes_list = 1; FloatList float_list = 2; Int64List int64_list = 3}`` (no oneof):
      ``int64_list.value`` then holds every int64 of the block in wire order and ``float_list.value`` every
      float, decoded by protobuf; ``ListsFeatures`` (each list field as one ``bytes``) and ``ChunksFeatures``
      (each packed run of values as one ``bytes``) count the lists and runs.

    That the merged values are columns is checked, not assumed. The merged keys must be the first record's keys
    (each once) N times over, and every record as many bytes as it would take with those entries in that order,
    each a key and a Feature, written as protobuf writes them (a record short of an entry, or with one more, has
    other bytes). The views must have no unknown fields (an unpacked list, which TensorFlow never writes, would
    be one), the count of lists must be the count of non-empty ``Feature`` s, so every entry holds exactly one
    list, whose tag is the first byte of its ``Feature``; the count of a kind's runs must be that of its non-empty
    lists, so every non-empty list holds one packed run (a list of values and no unknown field has at least one).
    Each run's bytes are then taken to be the Feature's less the fewest bytes its tags and lengths can take: its
    true bytes, or more if a tag or length was written long (legal, never written). A float run's count of values
    is those bytes / 4: each list's count comes out right, or, for a run taken 4 or more bytes too long, larger, and
    as no run is taken short, the counts' sum is then more than the floats protobuf decoded. An int64 run's count
    is taken from the values protobuf decoded: each value's varint as protobuf writes it must fill the runs' bytes
    exactly (so no varint, tag or length was written long: those only add bytes), and then the values end where the
    runs do. (A bytes list's size is not checked: it is only read to refuse the list where the spec wants another
    kind.) Counts are computed by numpy to check the layout and cut the columns; every value itself is decoded by
    protobuf. A record with 2 values for one feature and 0 for the next thus fails its feature's count instead of
    shifting the columns.

    A map entry is taken to be one key and one value, as every protobuf serializer writes it: an entry of no
    value next to an entry of two values *in the same record* (wire-legal, written by no serializer) is the one
    input these checks do not tell apart from a plain record.
    """
    if any(_list_kind(s.dtype) == "bytes_list" for s in spec.values()):
        return None  # bytes lists: left to _parse_block
    from google.protobuf.unknown_fields import UnknownFieldSet  # noqa: PLC0415 - protobuf is optional (_messages)

    m = _messages()
    n = len(serialized)
    try:
        names = list(m["RawExample"].FromString(serialized[0]).features.feature.key)
        entries = m["RawExamples"].FromString(m["Records"](record=serialized).SerializeToString()).example.features.feature
    except Exception:  # noqa: BLE001 - protobuf's DecodeError: the record-by-record path names the record
        return None
    width = len(names)
    if not width or len(set(names)) != width or len(entries.key) != n * width or len(entries.value) != n * width:
        return None  # no features, or the first record's twice: decided record by record
    # the merged entry serialized: its keys (field 1), then its Features (field 2), each as protobuf writes a
    # length-delimited field: a one-byte tag, the length as a varint no longer than it must be, the bytes
    merged = entries.SerializeToString()
    keys = m["RawEntry"](key=names).SerializeToString() * n
    if merged[: len(keys)] != keys:
        return None  # records with other features, or in another order: decided record by record
    blob = memoryview(merged)[len(keys) :]
    key_bytes = np.array([len(name.encode()) for name in names], dtype=np.int64)
    key_fields = 1 + _varint_size(key_bytes) + key_bytes  # each entry's key, as a field
    lengths = np.fromiter(map(len, serialized), dtype=np.int64, count=n)
    sizes = _feature_sizes(blob, lengths, key_fields)  # each entry's Feature's bytes
    if sizes is None:
        sizes = np.array(list(map(len, entries.value)), dtype=np.int64)
    # each record's bytes if its entries are the first record's keys with the Features in their order, each entry
    # a key and a Feature, written as protobuf writes them: a record of other entries has other bytes
    entry = np.tile(key_fields, n) + 1 + _varint_size(sizes) + sizes
    features = (1 + _varint_size(entry) + entry).reshape(n, width).sum(axis=1)
    if ((1 + _varint_size(features) + features) != lengths).any():
        return None  # records of other features (or the same ones, other lengths), or written otherwise
    try:
        decoded = m["FlatFeatures"].FromString(blob).feature  # each Feature parsed on its own (bounded), merged
    except Exception:  # noqa: BLE001 - a Feature that does not parse
        return None
    lists = m["ListsFeatures"].FromString(blob).feature
    runs = m["ChunksFeatures"].FromString(blob).feature
    starts = np.cumsum(1 + _varint_size(sizes) + sizes) - sizes  # each Feature's first byte in `blob`
    present = sizes > 0
    tags = np.zeros(len(sizes), dtype=np.uint8)
    tags[present] = np.frombuffer(blob, dtype=np.uint8)[starts[present]]
    if (len(UnknownFieldSet(lists)) or len(UnknownFieldSet(runs))
            or sum(map(len, (lists.bytes_list, lists.float_list, lists.int64_list))) != int(present.sum())):
        return None  # an entry with two lists or another field
    counts = np.zeros(len(sizes), dtype=np.int64)
    offsets: dict[str, np.ndarray] = {}
    columns: dict[str, np.ndarray] = {}
    for kind, tag in _TAG.items():
        held = tags == tag
        if int(held.sum()) != len(getattr(lists, kind)):
            return None  # a Feature that starts with no list's tag (a tag written long: legal, never written)
        content = _content_size(sizes[held])  # the list's bytes
        if kind == "bytes_list":
            counts[held] = content  # not zero for a list that is not empty: enough to refuse it as another kind
            continue
        run = getattr(runs, kind)
        if len(UnknownFieldSet(run)) or len(run.value) != int((content > 0).sum()):
            return None  # an unpacked list (its values are unknown fields of Chunks), a list of several runs
        # the packed run's bytes (0 for an empty list) if the list's and the run's tags and lengths take the fewest
        # bytes they can; more than the run's true bytes if any takes more
        payload = _content_size(content)
        column = np.array(getattr(decoded, kind).value, dtype=np.int64 if kind == "int64_list" else np.float32)
        if kind == "float_list":
            per_list = payload // 4  # each run's true bytes a multiple of 4 (protobuf refuses others) up to 3 less
        else:
            # each value's varint as protobuf writes it (no longer than it must be): if those fill the runs' bytes
            # exactly, every varint was written so, and the values end where the runs end (protobuf parsed each
            # run bounded: no varint crosses the end of one)
            ends = np.cumsum(_varint_size(column.view(np.uint64), 10))
            bounds = np.cumsum(payload)
            if (int(ends[-1]) if ends.size else 0) != (int(bounds[-1]) if bounds.size else 0):
                return None
            taken = np.searchsorted(ends, bounds, side="right")  # the values that end by each run's end
            if (ends[taken[bounds > 0] - 1] != bounds[bounds > 0]).any():
                return None
            per_list = np.diff(taken, prepend=0)
        counts[held] = per_list
        if column.size != int(per_list.sum()):
            return None
        columns[kind] = column
        in_kind = np.where(held, counts, 0)
        offsets[kind] = (np.cumsum(in_kind) - in_kind).reshape(n, width)
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


def _feature_sizes(blob: memoryview, lengths: np.ndarray, key_fields: np.ndarray) -> np.ndarray | None:
    """Each entry's ``Feature`` bytes, read from ``blob`` (the Features of a block's merged map entry, as
    protobuf serialized them: each a tag byte, its length as a varint no longer than it must be, its bytes) a
    record at a time for all records at once; None where that does not work out (the caller then asks protobuf for
    each Feature). ``lengths``: each record's bytes; ``key_fields``: each entry's key field's bytes.

    Each record's Features take its bytes less the framing of the record and its entries, if every entry is below
    128 bytes (a one-byte length): that places each record's first Feature in ``blob``. Then numpy reads the
    records' first Feature's length (one byte too: a Feature is smaller than its entry), then their second, and so
    on. The placing is checked, not assumed: a record's last Feature must end where the next record's first
    begins, and the last record's at the end of ``blob``, so record 0's Features (which start at 0) are read
    right, then record 1's, and so on."""
    width = key_fields.size
    group = _content_size(lengths) - int(key_fields.sum()) - 2 * width  # each record's Features' bytes
    ends = np.cumsum(group)
    if not ends.size or int(ends[-1]) != len(blob) or (group < 2 * width).any():
        return None
    u8 = np.frombuffer(blob, dtype=np.uint8)
    at = ends - group
    sizes = np.empty((lengths.size, width), dtype=np.int64)
    last = ends - 1
    for j in range(width):
        # a tag and a length byte left in the record's bytes, and the tag a Feature's (field 2, length-delimited)
        if (at >= last).any() or (u8[at] != 0x12).any():
            return None
        size = u8[at + 1].astype(np.int64)
        if (size >= 0x80).any():  # a length of two bytes or more: a Feature of 128 bytes or more, in an entry
            return None  # of more than 128 bytes, which the placing above did not take
        sizes[:, j] = size
        at = at + 2 + size
    if (at != ends).any():
        return None
    return sizes.reshape(-1)


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


def _content_size(total: np.ndarray) -> np.ndarray:
    """The payload's bytes of each length-delimited field of a one-byte tag and ``total`` bytes in all, its length
    written as protobuf writes it: ``total = 1 + _varint_size(payload) + payload`` (0 for ``total`` 0)."""
    payload = np.maximum(total - 2, 0)
    for width in (2, 3, 4, 5):
        longer = total - 1 - width >= 1 << 7 * (width - 1)
        if not longer.any():
            break  # no field needs this length's byte, nor any later one
        payload[longer] = total[longer] - 1 - width
    return payload


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
