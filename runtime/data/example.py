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
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    for name in ("Example", "Features", "Feature", "BytesList", "FloatList", "Int64List", "Records", "Examples"):
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
            try:
                column = cast(wire, s.dtype, str)
            except ColumnValueError:
                return None
        if isinstance(s, FixedLenFeature):
            out[name] = column.reshape((n, *s.shape))
        else:
            out[name] = varlen_column(np.split(column, np.cumsum(lengths)[:-1]))
    return out


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
