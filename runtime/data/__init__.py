"""Distributed input: ``Dataset`` and its sources, transformations and file readers, ``InputContext`` and
auto-sharding across workers with TensorFlow's ``AutoShardPolicy``.

Rule: runs wherever a dataset function runs (a worker, or the chief for a local dataset); imports only
:mod:`kubeps.runtime.util`, :mod:`kubeps.runtime.checks` (its arguments are checked there) and
:mod:`kubeps.runtime.errors`.

Modules, bottom to top (none imports one above it):

- ``options`` -- ``InputContext``, ``Options``, ``DistributeOptions``, ``AutoShardPolicy``;
- ``structure`` -- elements and blocks: stacking, slicing, calling a user function on an element;
- ``node`` -- ``Node``, one step of a pipeline (a source or a transformation of its parent's elements);
- ``passes`` -- ``PassLedger``: where a worker's iterator stands in its pass (the records a reshard makes read
  again);
- ``sources`` -- arrays, ``range``, generators, iterables, file lists; ``transforms`` -- ``map``, ``filter``,
  ``interleave``, ``repeat``, ``batch``, ``shard``, ``take``, ``skip``; ``shuffle``; ``prefetch``;
- ``hashing`` -- ``hash_bucket``: integer and string ids hashed into buckets (a fixed, documented hash);
- ``leases`` -- exactly-once input on a worker: the source reads the shards the chief leased (``ShardFeed``) and
  reports how far its consumer got;
- ``filesystems`` -- local paths and fsspec URLs (``s3://``, ``gs://``, ``hdfs://``): listing and opening files;
- ``columns`` -- typed columns: checked conversion to a column's dtype, variable-length columns;
- ``criteo`` -- Criteo's click-log format (tab-separated, hex categoricals, gzip'd or not), parsed in blocks;
- ``readers`` -- ``read_lines``, ``read_csv``, ``read_npy``, ``read_npz`` and the ``criteo`` block reader for
  ``Dataset.from_files``;
- ``file_blocks`` -- ``FileBlocksNode``: files read block by block, interleaved, with parallel reads;
- ``reader_processes`` -- a file's blocks read and decoded in a child process, for readers whose work holds the
  GIL (TFRecord);
- ``parquet``, ``tfrecord`` + ``example`` (``tf.Example`` and its parse spec), ``csvfiles`` -- the file formats'
  block readers;
- ``dataset`` -- ``Dataset`` (wraps the last node of its pipeline and builds the next), ``DatasetIterator``,
  ``TextLineDataset``;
- ``formats`` -- ``ParquetDataset``, ``TFRecordDataset``, ``CsvDataset`` (file formats as datasets);
- ``distribute`` -- ``auto_shard``, ``as_dataset``, ``DistributedDataset`` and the strategy's two
  ``distribute_*`` functions.
"""

from kubeps.runtime.data.dataset import AUTOTUNE, Dataset, DatasetIterator, TextLineDataset
from kubeps.runtime.data.columns import ColumnValueError, to_ragged, to_sparse
from kubeps.runtime.data.distribute import DistributedDataset, as_dataset, auto_shard
from kubeps.runtime.data.example import FixedLenFeature, VarLenFeature, parse_example, serialize_example
from kubeps.runtime.data.formats import CsvDataset, ParquetDataset, TFRecordDataset
from kubeps.runtime.data.hashing import hash_bucket
from kubeps.runtime.data.options import AutoShardPolicy, DistributeOptions, InputContext, Options
from kubeps.runtime.data.readers import read_csv, read_lines, read_npy, read_npz
from kubeps.runtime.data.tfrecord import CorruptRecordError, TFRecordWriter

__all__ = [
    "AUTOTUNE",
    "AutoShardPolicy",
    "ColumnValueError",
    "CorruptRecordError",
    "CsvDataset",
    "Dataset",
    "DatasetIterator",
    "DistributeOptions",
    "DistributedDataset",
    "FixedLenFeature",
    "InputContext",
    "Options",
    "ParquetDataset",
    "TFRecordDataset",
    "TFRecordWriter",
    "TextLineDataset",
    "VarLenFeature",
    "as_dataset",
    "auto_shard",
    "hash_bucket",
    "parse_example",
    "read_csv",
    "read_lines",
    "read_npy",
    "read_npz",
    "serialize_example",
    "to_ragged",
    "to_sparse",
]
