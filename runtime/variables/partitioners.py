"""Variable partitioners, as ``tf.distribute.experimental.partitioners``, and the "div" row split.

A partitioner is called with a variable's ``shape`` and ``dtype`` and returns TensorFlow's partition list:
``[n, 1, 1, ...]`` -- ``n`` shards along axis 0 (the only axis kubeps, like ``ParameterServerStrategy``,
partitions), never more shards than rows. The arithmetic, defaults and argument checks are TensorFlow's:

- :class:`FixedShardsPartitioner` -- ``min(num_shards, shape[0])``.
- :class:`MinSizePartitioner` -- ``max(1, min(shape[0], max_shards, ceil(total_bytes / min_shard_bytes)))``.
- :class:`MaxSizePartitioner` -- ``rows_per_shard = max(1, floor(max_shard_bytes / bytes_per_row))``,
  ``n = ceil(rows / rows_per_shard)``, capped by ``max_shards``.

Rows are then split "div"-style (:func:`div_split`): ``base = N // n`` rows per shard and the first ``N % n``
shards get one more row, so 13 rows over 5 shards are ``[0,3) [3,6) [6,9) [9,11) [11,13)``.
:func:`owner_of` maps row ids to ``(shard, local row)`` with TensorFlow's closed form, vectorised.

String variables count ``bytes_per_string`` bytes per element (a string's size is unknown up front).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from kubeps.runtime.checks import NonNegativeInt, PositiveInt, check
from kubeps.runtime.errors import RuntimeConfigError

__all__ = [
    "FixedShardsPartitioner",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "Partitioner",
    "div_split",
    "owner_of",
    "shard_offsets",
]


# -- argument checks ----------------------------------------------------------------------------------------------
def _as_shape(shape: Any) -> tuple[int, ...]:
    """A fully defined shape of rank >= 1 as a tuple of ints (accepts sequences and ``TensorShape``-likes)."""
    if hasattr(shape, "as_list"):  # a tf.TensorShape, should someone pass one
        shape = shape.as_list()
    if isinstance(shape, numbers.Integral) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = list(shape)
    except TypeError:
        raise RuntimeConfigError("shape", shape, "a sequence of non-negative integers") from None
    if not dims:
        raise RuntimeConfigError("shape", tuple(dims), "a shape of rank >= 1 to be partitioned (not a scalar's)")
    out = []
    for i, dim in enumerate(dims):
        out.append(check(f"shape[{i}]", dim, NonNegativeInt,
                         allowed=f"an integer >= 0: the shape {tuple(dims)!r} must be fully defined"))
    return tuple(out)


def _is_string_dtype(dtype: Any) -> bool:
    if isinstance(dtype, str) and dtype in ("string", "tf.string"):
        return True
    if getattr(dtype, "name", None) == "string" and not isinstance(dtype, np.dtype):  # tf.string, duck-typed
        return True
    return np.dtype(dtype).kind in ("U", "S", "O")


def _bytes_per_element(dtype: Any, bytes_per_string: int) -> int:
    """Bytes of one element: the dtype's item size, or ``bytes_per_string`` for strings (and objects)."""
    try:
        if _is_string_dtype(dtype):
            return bytes_per_string
        return np.dtype(dtype).itemsize
    except TypeError:
        raise RuntimeConfigError("dtype", dtype, "a numpy dtype (or 'string')") from None


def _partition_list(shape: tuple[int, ...], num_shards: int) -> list[int]:
    result = [1] * len(shape)
    result[0] = num_shards
    return result


def _check_axis(axis: Any) -> None:
    if axis != 0:
        raise RuntimeConfigError("axis", axis, "0: like ParameterServerStrategy, kubeps only partitions the first "
                                 "(outermost) axis")


# -- partitioners -------------------------------------------------------------------------------------------------
class Partitioner:
    """Base class: ``partitioner(shape, dtype) -> [num_shards, 1, ...]``."""

    def __call__(self, shape: Any, dtype: Any, axis: int = 0) -> list[int]:
        _check_axis(axis)
        dims = _as_shape(shape)
        n = self._num_shards(dims, dtype)
        return _partition_list(dims, max(1, min(n, dims[0])) if dims[0] else 1)

    def _num_shards(self, shape: tuple[int, ...], dtype: Any) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def num_shards(self, shape: Any, dtype: Any) -> int:
        """Just the shard count along axis 0."""
        return self(shape, dtype)[0]


class FixedShardsPartitioner(Partitioner):
    """A fixed number of shards: ``min(num_shards, shape[0])``.

    >>> FixedShardsPartitioner(num_shards=2)([10, 3], "float32")
    [2, 1]
    """

    def __init__(self, num_shards: int):
        self._num_shards_arg = check("num_shards", num_shards, PositiveInt)

    def _num_shards(self, shape: tuple[int, ...], dtype: Any) -> int:
        return min(self._num_shards_arg, shape[0])

    def __repr__(self) -> str:
        return f"FixedShardsPartitioner(num_shards={self._num_shards_arg})"


class MinSizePartitioner(Partitioner):
    """As many shards as keep each at least ``min_shard_bytes``, at most ``max_shards``.

    ``max(1, min(shape[0], max_shards, ceil(total_bytes / min_shard_bytes)))``.

    >>> MinSizePartitioner(min_shard_bytes=4, max_shards=2)([6, 1], "float32")
    [2, 1]
    >>> MinSizePartitioner(min_shard_bytes=4, max_shards=10)([6, 1], "float32")
    [6, 1]
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1, bytes_per_string: int = 16):
        self.min_shard_bytes = check("min_shard_bytes", min_shard_bytes, PositiveInt)
        self.max_shards = check("max_shards", max_shards, PositiveInt)
        self.bytes_per_string = check("bytes_per_string", bytes_per_string, PositiveInt)

    def _num_shards(self, shape: tuple[int, ...], dtype: Any) -> int:
        total_bytes = math.prod(shape) * _bytes_per_element(dtype, self.bytes_per_string)
        wanted = math.ceil(total_bytes / self.min_shard_bytes)
        return max(1, min(shape[0], self.max_shards, wanted))

    def __repr__(self) -> str:
        return (
            f"MinSizePartitioner(min_shard_bytes={self.min_shard_bytes}, max_shards={self.max_shards}, "
            f"bytes_per_string={self.bytes_per_string})"
        )


class MaxSizePartitioner(Partitioner):
    """As few shards as keep each at most ``max_shard_bytes`` (a shard holds at least one row).

    ``rows_per_shard = max(1, floor(max_shard_bytes / bytes_per_row))``, ``n = ceil(rows / rows_per_shard)``,
    capped by ``max_shards`` when given.

    >>> MaxSizePartitioner(max_shard_bytes=4)([6, 1], "float32")
    [6, 1]
    >>> MaxSizePartitioner(max_shard_bytes=4, max_shards=2)([6, 1], "float32")
    [2, 1]
    >>> MaxSizePartitioner(max_shard_bytes=1024)([6, 1], "float32")
    [1, 1]
    """

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None, bytes_per_string: int = 16):
        self.max_shard_bytes = check("max_shard_bytes", max_shard_bytes, PositiveInt)
        self.max_shards = None if max_shards is None else check("max_shards", max_shards, PositiveInt)
        self.bytes_per_string = check("bytes_per_string", bytes_per_string, PositiveInt)

    def _num_shards(self, shape: tuple[int, ...], dtype: Any) -> int:
        rows = shape[0]
        bytes_per_row = math.prod(shape[1:]) * _bytes_per_element(dtype, self.bytes_per_string)
        if bytes_per_row == 0:  # rows of zero width fit anywhere
            return 1
        rows_per_shard = max(1, math.floor(self.max_shard_bytes / bytes_per_row))
        n = math.ceil(rows / rows_per_shard)
        if self.max_shards is not None:
            n = min(self.max_shards, n)
        return n

    def __repr__(self) -> str:
        return (
            f"MaxSizePartitioner(max_shard_bytes={self.max_shard_bytes}, max_shards={self.max_shards}, "
            f"bytes_per_string={self.bytes_per_string})"
        )


# -- the "div" split ----------------------------------------------------------------------------------------------
def _check_split(num_rows: Any, num_shards: Any) -> tuple[int, int]:
    num_rows = check("num_rows", num_rows, NonNegativeInt)
    num_shards = check("num_shards", num_shards, PositiveInt)
    if num_shards > max(1, num_rows):
        raise RuntimeConfigError("num_shards", num_shards, f"<= num_rows ({num_rows}): partitioners cap the shard "
                                 "count at shape[0] so that no shard is empty")
    return num_rows, num_shards


def shard_offsets(num_rows: int, num_shards: int) -> np.ndarray:
    """First row of every shard plus ``num_rows`` at the end (``num_shards + 1`` int64 values)."""
    num_rows, num_shards = _check_split(num_rows, num_shards)
    base, extra = divmod(num_rows, num_shards)
    sizes = np.full(num_shards, base, dtype=np.int64)
    sizes[:extra] += 1
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def div_split(num_rows: int, num_shards: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` row ranges of each shard: ``N // n`` rows each, one more for the first ``N % n``.

    >>> div_split(13, 5)
    [(0, 3), (3, 6), (6, 9), (9, 11), (11, 13)]
    """
    offsets = shard_offsets(num_rows, num_shards).tolist()
    return [(offsets[i], offsets[i + 1]) for i in range(len(offsets) - 1)]


def owner_of(ids: Any, num_rows: int, num_shards: int) -> tuple[np.ndarray, np.ndarray]:
    """``(shard index, row within that shard)`` of every row id, as int64 arrays shaped like ``ids``.

    Uses TensorFlow's closed form ``max(id // (base + 1), (id - extra) // base)`` with ``base = N // n`` and
    ``extra = N % n``; ids must be integers in ``[0, num_rows)``.
    """
    num_rows, num_shards = _check_split(num_rows, num_shards)
    arr = np.asarray(ids)
    if arr.size == 0:
        empty = np.zeros(arr.shape, dtype=np.int64)
        return empty, empty.copy()
    if arr.dtype.kind not in ("i", "u"):
        if arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.floor(arr)):
            pass  # integral floats are accepted
        else:
            raise RuntimeConfigError("ids dtype", arr.dtype, "integers")
    arr = arr.astype(np.int64, copy=False)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= num_rows:
        bad = lo if lo < 0 else hi
        raise RuntimeConfigError("ids", bad, f"ids in [0, {num_rows})")
    base, extra = divmod(num_rows, num_shards)
    shard = np.maximum(arr // (base + 1), (arr - extra) // base)
    first_row = shard * base + np.minimum(shard, extra)
    return shard, arr - first_row
