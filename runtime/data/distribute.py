"""Distribution across workers: :func:`auto_shard` (TensorFlow's ``AutoShardPolicy``) and what the strategy's
``experimental_distribute_dataset`` and ``distribute_datasets_from_function`` return, :class:`DistributedDataset`.

- ``AutoShardPolicy.FILE`` -- each worker reads its own subset of the files (``files[worker_index::num_workers]``);
  fewer files than workers is an error.
- ``AutoShardPolicy.DATA`` -- each worker reads everything and keeps every ``num_workers``-th element of the
  pipeline's output.
- ``AutoShardPolicy.AUTO`` (default) -- FILE if the dataset is file-based, otherwise DATA.
- ``AutoShardPolicy.OFF`` -- every worker sees every element.
"""

from __future__ import annotations

from typing import Any, Callable

from kubeps.runtime.checks import PositiveInt, check, index_in
from kubeps.runtime.data.dataset import Dataset
from kubeps.runtime.data.options import AutoShardPolicy, InputContext, as_policy
from kubeps.runtime.data.sources import FileListNode
from kubeps.runtime.errors import RuntimeConfigError


def as_dataset(data: Any) -> Dataset:
    """A :class:`Dataset` as is; any other iterable wrapped with :meth:`Dataset.from_iterable`."""
    if isinstance(data, Dataset):
        return data
    if isinstance(data, (str, bytes)) or not hasattr(data, "__iter__"):
        raise TypeError(f"expected a Dataset or an iterable of elements, got {type(data).__name__}")
    return Dataset.from_iterable(data)


def auto_shard(
    dataset: Any, num_workers: int, worker_index: int, policy: AutoShardPolicy | str | int | None = None
) -> Dataset:
    """The part of ``dataset`` that worker ``worker_index`` of ``num_workers`` should read.

    ``policy`` defaults to the dataset's ``options.experimental_distribute.auto_shard_policy`` (AUTO):

    - FILE: the dataset's file list is split, ``files[worker_index::num_workers]`` (before any ``list_files``
      shuffle, so workers never overlap); a dataset that is not file-based, or has fewer files than workers,
      is an error.
    - DATA: every worker reads everything and keeps elements ``worker_index::num_workers`` of the output (whole
      batches if the dataset is batched: batch with the per-worker batch size).
    - AUTO: FILE when the dataset is file-based, DATA otherwise.
    - OFF: the dataset unchanged; every worker sees every element.

    The result's policy is OFF, so it is not sharded twice. Any iterable is accepted as the dataset.
    """
    dataset = as_dataset(dataset)
    num_workers = check("num_workers", num_workers, PositiveInt)
    worker_index = check("worker_index", worker_index, index_in(num_workers, "num_workers"))
    policy = dataset._options.experimental_distribute.auto_shard_policy if policy is None else as_policy(policy)
    if policy == AutoShardPolicy.AUTO:
        policy = AutoShardPolicy.FILE if dataset.is_file_based else AutoShardPolicy.DATA

    if policy == AutoShardPolicy.OFF:
        sharded = dataset
    elif policy == AutoShardPolicy.FILE:
        root = dataset._root()
        if not isinstance(root, FileListNode):
            raise ValueError(
                f"AutoShardPolicy.FILE needs a file-based dataset (Dataset.list_files, Dataset.from_files or "
                f"TextLineDataset), but this one reads from {dataset._describe_source()}; use AutoShardPolicy.DATA "
                f"to shard its elements or OFF to give every worker everything"
            )
        files = root.files
        if len(files) < num_workers:
            raise ValueError(
                f"AutoShardPolicy.FILE: the dataset has {len(files)} file(s) for {num_workers} workers; "
                f"each worker needs at least one file (files: {files[:5]}{' ...' if len(files) > 5 else ''}); "
                f"use AutoShardPolicy.DATA or split the input into at least {num_workers} files"
            )
        sharded = dataset if num_workers == 1 else dataset._with_root(root.sharded(num_workers, worker_index))
    else:  # DATA
        sharded = dataset if num_workers == 1 else dataset.shard(num_workers, worker_index)

    options = sharded.options
    options.experimental_distribute.auto_shard_policy = AutoShardPolicy.OFF
    return sharded.with_options(options)


# -- the strategy's dataset distribution ----------------------------------------------------------------------------
class DistributedDataset:
    """What ``strategy.experimental_distribute_dataset`` and ``strategy.distribute_datasets_from_function`` return on
    the coordinator (TF's ``DistributedDataset``): a recipe that ``ClusterCoordinator.create_per_worker_dataset``
    builds on every worker. It is not iterated on the coordinator."""

    def __init__(self, per_worker_fn: Callable[[InputContext], Any], what: str):
        self.per_worker_fn = per_worker_fn  #: ``InputContext -> dataset``, run on each worker
        self._what = what

    def build(self, input_context: InputContext) -> Any:
        """The dataset of the worker ``input_context`` describes (runs on that worker)."""
        return self.per_worker_fn(input_context)

    def __iter__(self):
        raise TypeError(
            f"a distributed dataset ({self._what}) is read on the workers: pass it to "
            "coordinator.create_per_worker_dataset() and schedule functions that take iter() of the result"
        )

    def __repr__(self) -> str:
        return f"DistributedDataset({self._what})"


def _check_input_options(options: Any) -> None:
    if options is not None:
        raise RuntimeConfigError(
            "options", type(options).__name__,
            "must be None: tf.distribute.InputOptions place input on accelerators, and kubeps workers feed from host "
            "memory",
        )


def distribute_dataset(dataset: Any, options: Any = None) -> DistributedDataset:
    """``experimental_distribute_dataset``: every worker reads its auto-shard of ``dataset`` (see :func:`auto_shard`;
    one replica per worker, so batches keep their size)."""
    _check_input_options(options)
    dataset = as_dataset(dataset)
    return DistributedDataset(
        lambda ctx: auto_shard(dataset, ctx.num_input_pipelines, ctx.input_pipeline_id),
        "experimental_distribute_dataset",
    )


def distribute_datasets_from_function(dataset_fn: Any, options: Any = None) -> DistributedDataset:
    """``distribute_datasets_from_function``: every worker calls ``dataset_fn(input_context)``; batching and
    sharding are the function's own."""
    _check_input_options(options)
    if not callable(dataset_fn):
        raise RuntimeConfigError("dataset_fn", type(dataset_fn).__name__,
                                 "must be a function of an InputContext that returns a dataset")
    name = getattr(dataset_fn, "__name__", type(dataset_fn).__name__)
    return DistributedDataset(dataset_fn, f"distribute_datasets_from_function({name})")
