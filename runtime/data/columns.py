"""Typed columns: what the file readers (CSV, Parquet, TFRecord) do to turn a file's values into a column's dtype.

A value is converted only when the column's dtype holds it: an integer must be in the dtype's range (an int64 id
read into float32 must be exactly representable -- float32 holds every integer up to 2**24 only, so 16777217 is
refused rather than silently read as 16777216), a float going to an integer dtype must be integral and in range, a
float going to a narrower float must stay finite, and an integral float must stay exact (a fraction rounds to the
nearest float, as every decimal does). A refused value raises :class:`ColumnValueError`, naming where it is (file,
row, column), the value and what the column allows.

Also here: the form of a variable-length column (``VarLenFeature``, a Parquet list column): one object array of
1-D arrays per block, with :func:`to_ragged` and :func:`to_sparse` for the forms a model takes.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np


class ColumnValueError(ValueError):
    """A value that its column's dtype does not hold (or a missing value without a default)."""


def as_dtype(dtype: Any, what: str) -> np.dtype:
    if dtype in (str, bytes, object):
        return np.dtype(object)  # text as Python objects, never a fixed-width numpy string
    try:
        result = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{what}: {dtype!r} is not a numpy dtype (e.g. np.int64, np.float32, str)") from None
    if result.kind not in "biufUSO":
        raise TypeError(f"{what}: dtype {result} is not supported; use a bool, integer, float or string dtype")
    return result


def _allowed(dtype: np.dtype) -> str:
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return f"integers in [{info.min}, {info.max}]"
    if dtype.kind == "f":
        exact = 2 ** (np.finfo(dtype).nmant + 1)
        return f"finite numbers, integers exactly up to +-{exact}"
    return f"{dtype} values"


def _bad_rows(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Indices (along axis 0 of the flattened values) that ``dtype`` does not hold."""
    flat = values.reshape(-1)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if flat.dtype.kind in "iu":
            if flat.dtype.kind == "u" and info.max >= np.iinfo(flat.dtype).max:
                return np.empty(0, np.int64)
            if flat.dtype.kind == "i" and dtype.kind == "i" and info.max >= np.iinfo(flat.dtype).max:
                return np.empty(0, np.int64)
            big = flat.astype(object) if flat.dtype == np.uint64 else flat
            return np.flatnonzero((big < info.min) | (big > info.max))
        if flat.dtype.kind == "f":
            with np.errstate(invalid="ignore"):
                bad = ~np.isfinite(flat) | (np.floor(flat) != flat) | (flat < info.min) | (flat >= float(info.max) + 1)
            return np.flatnonzero(bad)
        if flat.dtype.kind == "b":
            return np.empty(0, np.int64)
    if dtype.kind == "f":
        if flat.dtype.kind in "iu":
            back = flat.astype(dtype).astype(object) if flat.dtype == np.uint64 else flat.astype(dtype)
            with np.errstate(invalid="ignore"):
                if flat.dtype == np.uint64:
                    return np.flatnonzero(back != flat.astype(object))
                exact = back.astype(np.float64) == flat.astype(np.float64)
                # float64 itself is inexact above 2**53: compare as integers where it matters
                big = np.abs(flat) > 2**53
                if big.any():
                    exact[big] = back[big].astype(np.int64) == flat[big]
                return np.flatnonzero(~exact)
        if flat.dtype.kind == "f" and flat.dtype.itemsize > dtype.itemsize:
            # a value that overflows, or a whole number the narrower float rounds, is above 2**(mantissa bits + 1)
            # (float32: 2**24, every whole number up to it held exactly): only those are looked at
            limit = 2.0 ** (np.finfo(dtype).nmant + 1)
            if not flat.size or (-limit <= flat.min() and flat.max() <= limit):  # a NaN fails both: looked at
                return np.empty(0, np.int64)
            with np.errstate(invalid="ignore"):
                large = np.flatnonzero(np.abs(flat) > limit)  # NaN: not large
            if not large.size:
                return large
            flat = flat[large]
            with np.errstate(over="ignore", invalid="ignore"):
                narrow = flat.astype(dtype)
                integral = np.isfinite(flat) & (np.floor(flat) == flat)
                bad = (np.isfinite(flat) & ~np.isfinite(narrow)) | (integral & (narrow.astype(flat.dtype) != flat))
            return large[bad]
        if flat.dtype.kind in "fb":
            return np.empty(0, np.int64)
    if dtype.kind == "b" and flat.dtype.kind in "biu":
        return np.flatnonzero((flat != 0) & (flat != 1))
    if dtype.kind in "USO" and flat.dtype.kind in "USO":
        return np.empty(0, np.int64)
    return np.arange(flat.size)  # no conversion between these kinds (a string to a number is parsed, not cast)


def cast(values: np.ndarray, dtype: np.dtype, where: Callable[[int], str]) -> np.ndarray:
    """``values`` as ``dtype``, refusing any value that would change. ``where(i)`` names the place of flat value
    ``i`` (``"train.csv:12, column 'id'"``) for the error."""
    values = np.asarray(values)
    if values.dtype == dtype:
        return values
    bad = _bad_rows(values, dtype)
    if bad.size:
        i = int(bad[0])
        value = values.reshape(-1)[i]
        more = f" ({bad.size} values in this block do not fit)" if bad.size > 1 else ""
        raise ColumnValueError(
            f"{where(i)}: value {value.item() if hasattr(value, 'item') else value!r} ({values.dtype}) does not fit "
            f"the column's dtype {dtype}: it holds {_allowed(dtype)}{more}; read the column with a wider dtype "
            f"(e.g. np.int64 for ids)"
        )
    return values.astype(dtype)


# -- variable-length columns ------------------------------------------------------------------------------------------
def varlen_column(rows: list[np.ndarray]) -> np.ndarray:
    """One object array whose items are the rows' 1-D arrays (rows of a block may differ in length)."""
    out = np.empty(len(rows), dtype=object)
    out[:] = rows
    return out


def to_ragged(column: np.ndarray, dtype: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """A variable-length column (an object array of 1-D arrays, as batched) as ``(values, row_splits)``, the
    ``tf.RaggedTensor`` form: row ``i`` is ``values[row_splits[i]:row_splits[i + 1]]``."""
    rows = [np.asarray(r) for r in column]
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    splits = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=splits[1:])
    if rows:
        values = np.concatenate(rows)
    else:
        values = np.empty(0, dtype=np.float32 if dtype is None else dtype)
    return (values if dtype is None else values.astype(dtype, copy=False)), splits


def to_sparse(column: np.ndarray, dtype: Any = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A variable-length column as ``(indices [nnz, 2], values [nnz], dense_shape [2])``, the ``tf.SparseTensor``
    that ``tf.io.parse_example`` gives a ``VarLenFeature``."""
    values, splits = to_ragged(column, dtype)
    lengths = np.diff(splits)
    rows = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    cols = np.arange(len(values), dtype=np.int64) - np.repeat(splits[:-1], lengths)
    shape = np.array([len(lengths), int(lengths.max()) if len(lengths) else 0], dtype=np.int64)
    return np.stack([rows, cols], axis=1), values, shape
