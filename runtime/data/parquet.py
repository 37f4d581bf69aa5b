"""Parquet files, read with pyarrow (the optional ``kubeps[parquet]`` extra) one row group at a time, straight into
numpy: each row group is one block ``{column: array}`` of the selected columns.

Columns map to arrays by their Arrow type: a number or bool column to a 1-D array; a ``fixed_size_list`` of
numbers (``[k]``) to a 2-D array ``[rows, k]`` (e.g. the 8 hashed ids of a CTR example); a ``list`` column
(multi-hot ids, any length) to a variable-length column (:mod:`~kubeps.runtime.data.columns`: an object array of
1-D arrays); a string column to an object array of ``str``. A column asked for with a dtype is converted
checked (:func:`~kubeps.runtime.data.columns.cast`): a value the dtype does not hold is an error naming the file,
row group, row and column. Nulls are refused the same way (fill them when exporting, or read the column as a
float and test for NaN yourself).
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from kubeps.runtime.data.columns import ColumnValueError, as_dtype, cast, varlen_column
from kubeps.runtime.data.filesystems import is_url, local_path, open_binary
from kubeps.runtime.errors import RuntimeConfigError


def _pyarrow() -> tuple[Any, Any]:
    try:
        import pyarrow  # noqa: PLC0415 - optional dependency, needed for Parquet only
        import pyarrow.parquet  # noqa: PLC0415
    except ImportError:
        raise ImportError("reading Parquet needs the optional 'pyarrow' package: pip install 'kubeps[parquet]'") from None
    return pyarrow, pyarrow.parquet


def column_spec(columns: Sequence[str] | Mapping[str, Any] | None) -> dict[str, np.dtype | None] | None:
    """``columns`` as ``{name: dtype or None (the file's)}``; None for every column with the file's types."""
    if columns is None:
        return None
    if isinstance(columns, str):
        raise RuntimeConfigError("columns", columns, "a list of column names or a {name: dtype} dict")
    if isinstance(columns, Mapping):
        return {str(k): None if v is None else as_dtype(v, f"column {k!r}") for k, v in columns.items()}
    return {str(k): None for k in columns}


class ParquetReader:
    """``path -> blocks`` for :class:`~kubeps.runtime.data.file_blocks.FileBlocksNode`: one block per row group."""

    def __init__(self, columns: Mapping[str, np.dtype | None] | None, use_threads: bool = False):
        _pyarrow()  # fail when the dataset is built, not on the worker
        self._columns = None if columns is None else dict(columns)
        self._use_threads = use_threads

    def __call__(self, path: str) -> Iterator[dict[str, np.ndarray]]:
        _, pq = _pyarrow()
        source = open_binary(path) if is_url(path) else local_path(path)
        try:
            pf = pq.ParquetFile(source, memory_map=not is_url(path))
            names = pf.schema_arrow.names
            wanted = list(names) if self._columns is None else list(self._columns)
            missing = [c for c in wanted if c not in names]
            if missing:
                raise ColumnValueError(
                    f"{path}: no column(s) {missing} in this Parquet file; its columns are {names}"
                )
            for group in range(pf.num_row_groups):
                table = pf.read_row_group(group, columns=wanted, use_threads=self._use_threads)
                yield {name: self._column(table.column(name), path, group, name) for name in wanted}
        finally:
            if not isinstance(source, str):
                source.close()

    def _column(self, chunked: Any, path: str, group: int, name: str) -> np.ndarray:
        pa, _ = _pyarrow()
        array = chunked.combine_chunks() if chunked.num_chunks != 1 else chunked.chunk(0)

        def where(i: int) -> str:
            return f"{path}: row group {group}, row {i}, column {name!r}"

        if array.null_count:
            row = int(np.flatnonzero(~np.asarray(array.is_valid()))[0])
            raise ColumnValueError(f"{where(row)}: value is null; kubeps reads columns without nulls (fill them)")
        kind = array.type
        dtype = None if self._columns is None else self._columns[name]
        if pa.types.is_fixed_size_list(kind):
            width = kind.list_size
            values = array.flatten().to_numpy(zero_copy_only=False).reshape(len(array), width)
            return values if dtype is None else cast(values, dtype, lambda i: where(i // width))
        if pa.types.is_list(kind) or pa.types.is_large_list(kind):
            offsets = array.offsets.to_numpy()
            flat = array.values.slice(offsets[0], offsets[-1] - offsets[0]).to_numpy(zero_copy_only=False)
            if dtype is not None:
                row_of = np.repeat(np.arange(len(array)), np.diff(offsets))
                flat = cast(flat, dtype, lambda i: where(int(row_of[i])))
            return varlen_column(np.split(flat, offsets[1:-1] - offsets[0]))
        values = array.to_numpy(zero_copy_only=False)
        return values if dtype is None else cast(values, dtype, where)
