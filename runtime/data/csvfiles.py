"""CSV files with a dtype and a default per column, as TensorFlow's ``CsvDataset`` ``record_defaults``, read in
blocks of rows straight into numpy columns.

``record_defaults`` has one entry per column read: a dtype (``np.int64``, ``np.float32``, ``str`` ...) for a
column every row must fill, or a value (``0``, ``0.0``, ``np.float32(-1)``, ``""``) used where a field is empty
(or equals ``na_value``) and whose dtype is the column's (a Python ``int`` is int64, a ``float`` float32, a
``str`` a string column). Every value must fit its column: an integer column refuses ``1.5`` and values out of
its range, a float32 column refuses an integer it cannot hold exactly (16777217: float32 has 24 bits of mantissa)
instead of rounding it; read ids as ``np.int64``. Errors name the file, the line, the column, the value and what
the column allows.

With pyarrow installed (the ``parquet`` extra), a file is read by pyarrow's CSV reader (``pyarrow.csv.open_csv``:
C++, typed columns, the GIL released, so ``num_parallel_reads`` reads in parallel) into blocks of ``block_rows``
rows: ints as int64, floats as float64, only ``""`` and ``na_value`` as empty, then cast to the column's dtype
with the same refusals. Anything it does not take as is -- a value it cannot convert, a required field empty, a
value the dtype refuses, rows of uneven width -- hands the file, from the first row not yet handed out, to the path below, which names the file, the line and the
column exactly as without pyarrow.

Without pyarrow, a block of rows is parsed by numpy's C parser (``np.loadtxt``) when it is clean; a block with an empty field, a
quoted field numpy cannot take, or a bad value is parsed again row by row with Python's ``csv`` module, which
fills defaults and names the first bad value.
"""

from __future__ import annotations

import csv
import io
import itertools
from typing import Any, Iterator, Sequence

import numpy as np

from kubeps.runtime.data.columns import ColumnValueError, as_dtype, cast
from kubeps.runtime.data.filesystems import is_url, local_path, open_binary
from kubeps.runtime.errors import RuntimeConfigError


class _Refused(Exception):
    """pyarrow's reader does not take the file as is: the python path reads it and names what is wrong."""


def _pyarrow_csv() -> tuple[Any, Any] | None:
    try:
        import pyarrow  # noqa: PLC0415 - optional dependency (the parquet extra): the fast CSV path
        import pyarrow.csv  # noqa: PLC0415
    except ImportError:
        return None
    return pyarrow, pyarrow.csv


class _Column:
    def __init__(self, entry: Any, position: int):
        if isinstance(entry, (type, np.dtype)) and not isinstance(entry, np.generic):
            self.dtype = as_dtype(object if entry is str else entry, f"record_defaults[{position}]")
            self.default: Any = None
        else:
            if isinstance(entry, bool):
                self.dtype = np.dtype(bool)
            elif isinstance(entry, int):
                self.dtype = np.dtype(np.int64)
            elif isinstance(entry, float):
                self.dtype = np.dtype(np.float32)
            elif isinstance(entry, str):
                self.dtype = np.dtype(object)
            elif isinstance(entry, np.generic):
                self.dtype = entry.dtype
            else:
                raise TypeError(
                    f"record_defaults[{position}] must be a dtype (a required column) or a default value (int, float, "
                    f"str or a numpy scalar), got {entry!r}"
                )
            self.default = entry if self.dtype.kind == "O" else np.asarray(entry, self.dtype)
        if self.dtype.kind == "O":
            self.parse_as: np.dtype | None = None  # text as is
        elif self.dtype.kind in "iu":
            self.parse_as = np.dtype(np.int64) if self.dtype != np.uint64 else self.dtype
        elif self.dtype.kind == "b":
            self.parse_as = np.dtype(np.int64)
        else:
            self.parse_as = np.dtype(np.float64)


class CsvReader:
    """``path -> blocks`` for :class:`~kubeps.runtime.data.file_blocks.FileBlocksNode`: one tuple (or dict, with
    ``names``) of columns per ``block_rows`` rows. ``use_threads``: pyarrow parses a file's blocks in its thread
    pool (for a file read alone: files read in parallel already keep the cores busy)."""

    #: blocks a reader thread works ahead of the consumer (``num_parallel_reads`` > 1): 3 blocks of 8192 rows are
    #: a few MB; with 1 a reader that finished its block idled until the consumer took it (CSV 674k examples/s
    #: against 759k with 3, bench/input_formats.py's files, alternating in one process)
    read_ahead = 3

    def __init__(
        self,
        record_defaults: Sequence[Any],
        header: bool = False,
        field_delim: str = ",",
        na_value: str = "",
        select_cols: Sequence[int] | None = None,
        names: Sequence[str] | None = None,
        block_rows: int = 8192,
        use_threads: bool = True,
    ):
        if isinstance(record_defaults, (str, bytes)) or not len(record_defaults):
            raise RuntimeConfigError("record_defaults", record_defaults, "a non-empty list (one entry per column)")
        self._columns = [_Column(entry, i) for i, entry in enumerate(record_defaults)]
        if select_cols is not None:
            select_cols = [int(c) for c in select_cols]
            if len(select_cols) != len(self._columns) or sorted(set(select_cols)) != select_cols or select_cols[0] < 0:
                raise RuntimeConfigError("select_cols", select_cols, f"increasing column indices >= 0, one per "
                                         f"record_defaults entry ({len(self._columns)})")
        if names is not None and len(names) != len(self._columns):
            raise RuntimeConfigError("names", names, f"a name for every column read ({len(self._columns)})")
        if len(field_delim) != 1:
            raise RuntimeConfigError("field_delim", field_delim, "one character")
        self._select = select_cols
        self._names = None if names is None else [str(n) for n in names]
        self._header = bool(header)
        self._delim = field_delim
        self._na = na_value
        self._block_rows = block_rows
        self._use_threads = use_threads

    def _label(self, j: int) -> str:
        index = j if self._select is None else self._select[j]
        return f"column {index}" + ("" if self._names is None else f" ({self._names[j]!r})")

    def __call__(self, path: str) -> Iterator[Any]:
        arrow = _pyarrow_csv()
        if arrow is None:
            yield from self._python_blocks(path)
            return
        done = 0  # rows handed out
        try:
            for columns in self._arrow_blocks(path, *arrow):
                yield self._out(columns)
                done += len(columns[0])
        except _Refused:
            for columns in self._python_columns(path):
                if done >= len(columns[0]):
                    done -= len(columns[0])
                    continue
                yield self._out([c[done:] for c in columns])
                done = 0

    def _out(self, columns: list[np.ndarray]) -> Any:
        return dict(zip(self._names, columns)) if self._names is not None else tuple(columns)

    def _arrow_blocks(self, path: str, pa: Any, pacsv: Any) -> Iterator[list[np.ndarray]]:
        width = len(self._columns)
        select = self._select or list(range(width))
        names = [f"f{c}" for c in select]
        types = {}
        for name, column in zip(names, self._columns):
            kind = column.parse_as
            types[name] = pa.string() if kind is None else pa.uint64() if kind == np.uint64 else \
                pa.int64() if kind.kind == "i" else pa.float64()
        nulls = sorted({"", self._na})
        try:
            # a local file is read by pyarrow itself: a Python file object takes the GIL for every read
            with open_binary(path) if is_url(path) else pa.OSFile(local_path(path)) as raw:
                reader = pacsv.open_csv(
                    raw,
                    read_options=pacsv.ReadOptions(skip_rows=int(self._header), autogenerate_column_names=True,
                                                   block_size=1 << 20, use_threads=self._use_threads),
                    parse_options=pacsv.ParseOptions(delimiter=self._delim),
                    convert_options=pacsv.ConvertOptions(
                        column_types=types, null_values=nulls, strings_can_be_null=True,
                        include_columns=names if self._select is not None else None),
                )
                if self._select is None and reader.schema.names != names:
                    raise _Refused  # another number of fields: the python path names the line
                pending: list[Any] = []
                count = 0
                for batch in reader:
                    pending.append(batch)
                    count += batch.num_rows
                    while count >= self._block_rows:
                        table = pa.Table.from_batches(pending)
                        yield self._arrow_columns(table.slice(0, self._block_rows))
                        pending = table.slice(self._block_rows).to_batches()
                        count -= self._block_rows
                if count:
                    yield self._arrow_columns(pa.Table.from_batches(pending))
        except (pa.ArrowInvalid, pa.ArrowKeyError, pa.ArrowTypeError):
            raise _Refused from None  # a value, a field count, an empty file: the python path decides and names it

    def _arrow_columns(self, table: Any) -> list[np.ndarray]:
        out = []
        for j, column in enumerate(self._columns):
            values = table.column(j)
            empty = values.null_count
            if empty and column.default is None:
                raise _Refused
            if column.dtype.kind == "O":
                array = values.to_numpy(zero_copy_only=False).astype(object)
                if empty:
                    array[values.is_null().to_numpy(zero_copy_only=False)] = column.default
                out.append(array)
                continue
            wire = values.fill_null(0).to_numpy() if empty else values.to_numpy()
            try:
                typed = np.ascontiguousarray(cast(wire, column.dtype, str))
            except ColumnValueError:
                raise _Refused from None
            if empty:
                typed[values.is_null().to_numpy(zero_copy_only=False)] = column.default
            out.append(typed)
        return out

    def _python_blocks(self, path: str) -> Iterator[Any]:
        for columns in self._python_columns(path):
            yield self._out(columns)

    def _python_columns(self, path: str) -> Iterator[list[np.ndarray]]:
        with open_binary(path) as raw, io.TextIOWrapper(raw, encoding="utf-8", newline="") as f:
            lineno = 0
            if self._header:
                next(f, None)
                lineno = 1
            while True:
                lines = list(itertools.islice(f, self._block_rows))
                if not lines:
                    return
                columns = self._parse(lines, path, lineno)
                lineno += len(lines)
                if columns is not None:
                    yield columns

    def _parse(self, lines: list[str], path: str, first: int) -> list[np.ndarray] | None:
        fast = None
        # numpy's parser skips blank lines, which would shift the line numbers errors name: those blocks go slow
        if all(c.parse_as is not None for c in self._columns) and all(map(str.strip, lines)):
            try:
                fast = self._parse_fast(lines)
            except ValueError:
                fast = None  # an empty field, a quote, a bad value: the careful path says which
        if fast is None:
            rows, numbers = self._parse_rows(lines, path, first)
            if not rows:
                return None
        else:
            if len(fast) == 0:
                return None
            rows, numbers = None, None
        out = []
        for j, column in enumerate(self._columns):
            if fast is not None:
                values = fast[f"f{j}"]
                line_of = None
            else:
                assert rows is not None and numbers is not None
                values = rows[j]
                line_of = numbers

            def where(i: int, j: int = j, line_of: Any = line_of) -> str:
                line = f"line {line_of[i] if line_of is not None else first + 1 + i}"
                return f"{path}: {line}, {self._label(j)}"

            if column.dtype.kind == "O":
                out.append(values)
            else:
                out.append(np.ascontiguousarray(cast(values, column.dtype, where)))
        return out

    def _parse_fast(self, lines: list[str]) -> np.ndarray:
        dtype = np.dtype([(f"f{j}", c.parse_as) for j, c in enumerate(self._columns)])
        return np.loadtxt(lines, dtype=dtype, delimiter=self._delim, usecols=self._select, ndmin=1,
                          quotechar='"', encoding=None)

    def _parse_rows(self, lines: list[str], path: str, first: int) -> tuple[list[Any], list[int]]:
        width = len(self._columns)
        values: list[list[Any]] = [[] for _ in range(width)]
        numbers: list[int] = []
        select = self._select or list(range(width))
        for k, fields in enumerate(csv.reader(lines, delimiter=self._delim)):
            lineno = first + k + 1
            if not fields:
                continue
            if (self._select is None and len(fields) != width) or len(fields) <= select[-1]:
                raise ColumnValueError(
                    f"{path}: line {lineno}: {len(fields)} fields, expected "
                    f"{width if self._select is None else f'at least {select[-1] + 1}'} (one per record_defaults "
                    f"entry{'' if self._select is None else ', select_cols ' + str(self._select)})"
                )
            numbers.append(lineno)
            for j, column in enumerate(self._columns):
                text = fields[select[j]]
                values[j].append(self._value(text, column, path, lineno, j))
        out: list[Any] = []
        for j, column in enumerate(self._columns):
            if column.dtype.kind == "O":
                array = np.empty(len(values[j]), dtype=object)
                array[:] = values[j]
                out.append(array)
            else:
                out.append(np.array(values[j], dtype=object if column.parse_as == np.uint64 else None))
        return out, numbers

    def _value(self, text: str, column: _Column, path: str, lineno: int, j: int) -> Any:
        if text == "" or text == self._na:
            if column.default is None:
                raise ColumnValueError(
                    f"{path}: line {lineno}, {self._label(j)}: the field is empty and the column is required "
                    f"(record_defaults gives a dtype, {column.dtype}); give a default value to fill empty fields"
                )
            return column.default
        if column.dtype.kind == "O":
            return text
        try:
            return int(text) if column.dtype.kind in "iub" else float(text)
        except ValueError:
            allowed = "an integer" if column.dtype.kind in "iub" else "a number"
            raise ColumnValueError(
                f"{path}: line {lineno}, {self._label(j)}: value {text!r} is not {allowed} (the column is "
                f"{column.dtype})"
            ) from None
