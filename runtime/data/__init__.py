"""Distributed input: ``Dataset`` and its sources, transformations and file readers, ``InputContext`` and
auto-sharding across workers with TensorFlow's ``AutoShardPolicy``.

Rule: runs wherever a dataset function runs (a worker, or the chief for a local dataset); imports only
:mod:`kubeps.runtime.util` and :mod:`kubeps.runtime.errors`.

Modules, bottom to top (none imports one above it):

- ``arguments`` -- argument checks whose errors name the argument;
- ``options`` -- ``InputContext``, ``Options``, ``DistributeOptions``, ``AutoShardPolicy``;
- ``structure`` -- elements and blocks: stacking, slicing, calling a user function on an element;
- ``node`` -- ``Node``, one step of a pipeline (a source or a transformation of its parent's elements);
- ``sources`` -- arrays, ``range``, generators, iterables, file lists; ``transforms`` -- ``map``, ``filter``,
  ``interleave``, ``repeat``, ``batch``, ``shard``, ``take``, ``skip``; ``shuffle``; ``prefetch``;
- ``readers`` -- ``read_lines``, ``read_csv``, ``read_npy``, ``read_npz`` for ``Dataset.from_files``;
- ``dataset`` -- ``Dataset`` (wraps the last node of its pipeline and builds the next), ``DatasetIterator``,
  ``TextLineDataset``;
- ``distribute`` -- ``auto_shard``, ``as_dataset``, ``DistributedDataset`` and the strategy's two
  ``distribute_*`` functions.
"""

from kubeps.runtime.data.dataset import AUTOTUNE, Dataset, DatasetIterator, TextLineDataset
from kubeps.runtime.data.distribute import DistributedDataset, as_dataset, auto_shard
from kubeps.runtime.data.options import AutoShardPolicy, DistributeOptions, InputContext, Options
from kubeps.runtime.data.readers import read_csv, read_lines, read_npy, read_npz

__all__ = [
    "AUTOTUNE",
    "AutoShardPolicy",
    "Dataset",
    "DatasetIterator",
    "DistributeOptions",
    "DistributedDataset",
    "InputContext",
    "Options",
    "TextLineDataset",
    "as_dataset",
    "auto_shard",
    "read_csv",
    "read_lines",
    "read_npy",
    "read_npz",
]
