"""Datasets over the files training data comes in: :func:`ParquetDataset`, :func:`TFRecordDataset` and
:func:`CsvDataset` (TensorFlow's names), for local paths and fsspec URLs (``s3://``, ``gs://``, ``hdfs://``).

Each is ``list_files(filenames, shuffle=False)`` followed by a :class:`~kubeps.runtime.data.file_blocks.FileBlocksNode`
reading the files in blocks, so:

- the dataset is file-based: ``AutoShardPolicy.FILE`` (and ``AUTO``) gives each worker its share of the files,
  ``DATA`` every ``num_workers``-th row (or batch, after ``batch``) of the whole dataset;
- ``batch``, ``shard``, ``shuffle``, ``take``/``skip``/``repeat`` above it work on blocks (array slicing and
  gathers), never one Python step per record;
- ``num_parallel_reads`` files are read at once by as many threads, block by block in turn, in a deterministic
  order (``tf.data``'s ``interleave(cycle_length=n, num_parallel_calls=n)``; ``AUTOTUNE``: one per CPU, at most 8);
  TFRecord files by as many child processes instead (:mod:`~kubeps.runtime.data.reader_processes`: their reading
  holds the GIL, so threads would take turns).
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Mapping, Sequence

from pydantic import AfterValidator

from kubeps.runtime.checks import PositiveInt, check, integer
from kubeps.runtime.data.csvfiles import CsvReader
from kubeps.runtime.data.dataset import AUTOTUNE, Dataset
from kubeps.runtime.data.example import FixedLenFeature, VarLenFeature, feature_spec, parse_run
from kubeps.runtime.data.file_blocks import AUTOTUNE_READERS, FileBlocksNode
from kubeps.runtime.data.parquet import ParquetReader, column_spec
from kubeps.runtime.data.sources import FileListNode
from kubeps.runtime.data.tfrecord import compression_arg, read_records, read_runs

Filenames = str | os.PathLike | Sequence[str | os.PathLike]


def _refuse_zero(n: int) -> int:
    if n == 0:
        raise ValueError("zero readers")
    return n


#: ``num_parallel_reads``: AUTOTUNE (-1) or a count of readers (None, the default, is one)
_PARALLEL_READS: Any = Annotated[integer(ge=-1, allowed="None, AUTOTUNE (-1) or an integer >= 1"),
                                 AfterValidator(_refuse_zero)]


def _readers(num_parallel_reads: int | None) -> int:
    if num_parallel_reads is None:
        return 1
    n = check("num_parallel_reads", num_parallel_reads, _PARALLEL_READS)
    return AUTOTUNE_READERS if n == AUTOTUNE else n


def _files_dataset(filenames: Filenames, reader: Any, num_parallel_reads: int | None, name: str) -> Dataset:
    readers = _readers(num_parallel_reads)
    files = FileListNode(filenames, shuffle=False, seed=0)
    return Dataset(FileBlocksNode(files, reader, cycle_length=readers, num_parallel_calls=readers, name=name))


def ParquetDataset(
    filenames: Filenames,
    columns: Sequence[str] | Mapping[str, Any] | None = None,
    num_parallel_reads: int | None = None,
) -> Dataset:
    """Rows of Parquet files as ``{column: value}`` elements, read one row group at a time
    (:mod:`~kubeps.runtime.data.parquet`). ``columns``: the names to read (their types from the file), or
    ``{name: dtype}`` to convert each (checked: a value the dtype does not hold is an error), or None for all."""
    reader = ParquetReader(column_spec(columns), use_threads=_readers(num_parallel_reads) == 1)
    return _files_dataset(filenames, reader, num_parallel_reads, "read_parquet")


class _TFRecordReader:
    #: the framing walk and the decoding hold the GIL: with num_parallel_reads > 1, files are read in processes
    in_processes = True

    def __init__(self, compression_type: str, skip_corrupt: bool, features: Mapping[str, Any] | None,
                 block_records: int):
        self._compression = compression_type
        self._skip = skip_corrupt
        self._features = features
        self._block_records = block_records

    def __call__(self, path: str) -> Any:
        if self._features is None:
            for _, records in read_records(path, self._compression, self._skip, self._block_records):
                yield _object_array(records)
            return
        for run in read_runs(path, self._compression, self._skip):
            for piece in run.pieces(self._block_records):
                yield parse_run(piece, self._features, path)


def _object_array(items: list[Any]) -> Any:
    import numpy as np  # noqa: PLC0415 - kept beside its only use

    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


def TFRecordDataset(
    filenames: Filenames,
    compression_type: str | None = None,
    num_parallel_reads: int | None = None,
    features: Mapping[str, FixedLenFeature | VarLenFeature] | None = None,
    skip_corrupt: bool = False,
    block_records: int = 4096,
) -> Dataset:
    """Records of TFRecord files (:mod:`~kubeps.runtime.data.tfrecord`), as ``tf.data.TFRecordDataset``.

    Without ``features`` the elements are the serialized records (``bytes``); parse batches of them with
    :func:`~kubeps.runtime.data.example.parse_example`, as TF programs do. With ``features`` (a parse spec of
    ``FixedLenFeature``/``VarLenFeature``) each block of ``block_records`` records is parsed as it is read,
    and the elements are ``{feature: value}``. A corrupt record is an error naming the file and byte offset, unless
    ``skip_corrupt`` (the warning is then logged by the process that read it). With ``num_parallel_reads`` > 1 the
    files are read and parsed in that many child processes (:mod:`~kubeps.runtime.data.reader_processes`), in the
    same deterministic order as with one."""
    reader = _TFRecordReader(
        compression_arg(compression_type), bool(skip_corrupt), None if features is None else feature_spec(features),
        check("block_records", block_records, PositiveInt),
    )
    return _files_dataset(filenames, reader, num_parallel_reads, "read_tfrecord")


def CsvDataset(
    filenames: Filenames,
    record_defaults: Sequence[Any],
    header: bool = False,
    field_delim: str = ",",
    na_value: str = "",
    select_cols: Sequence[int] | None = None,
    names: Sequence[str] | None = None,
    num_parallel_reads: int | None = None,
    block_rows: int = 8192,
) -> Dataset:
    """Rows of CSV files as tuples of typed values (a dict with ``names``), as ``tf.data.experimental.CsvDataset``
    (:mod:`~kubeps.runtime.data.csvfiles`): ``record_defaults`` gives each column read its dtype and, optionally,
    the default for an empty field; ``select_cols`` picks the columns read (increasing indices)."""
    reader = CsvReader(record_defaults, header, field_delim, na_value, select_cols, names,
                       check("block_rows", block_rows, PositiveInt), use_threads=_readers(num_parallel_reads) == 1)
    return _files_dataset(filenames, reader, num_parallel_reads, "read_csv")
