"""Checkpoints: every parameter server writes its own shards, the coordinator commits a manifest last.

Layout of a checkpoint directory (local path, shared filesystem or an fsspec URL)::

    <directory>/ckpt-<N>/manifest.json                         committed last, atomically: the checkpoint exists
    <directory>/ckpt-<N>/<variable>-<hash>.value.<a>-<b>.npy   rows a..b-1 (axis 0) of a logical variable
    <directory>/ckpt-<N>/<variable>-<hash>.<slot>-<h>.<a>-<b>.npy  the same rows of an optimizer slot
    <directory>/ckpt-<N>/<table>-<hash>.dyn<s>.<part>.npy            shard s of a dynamic table: keys, values, ...
    <directory>/ckpt-<N>/<variable>-<hash>.<part>.<a>-<b>.delta.npy  an incremental save's changed rows: their ids,
                                                                     values and slot rows (format version 3)

Data files are plain ``.npy`` arrays (``numpy.load`` reads them); the manifest (:class:`Manifest`, JSON) lists
every logical variable with its full shape and dtype, the slices ``(start, stop)`` of axis 0 that make it up, the
file and sha256 of each slice, the optimizer slots beside it, the training step, the format version and whether
the training finished (``final``). A checkpoint directory without a manifest is the remains of an interrupted save:
it is ignored by readers and deleted by the next save. A checkpoint of an incremental
:class:`CheckpointManager` names, per slice, the earlier checkpoint holding its base file and the deltas (changed
rows) to apply over it, in order.

Restoring reads, for every shard of the variables being restored, the slices that overlap the shard's rows, so
a checkpoint restores into any number of parameter servers and shards. Every file read is checked against its
size and sha256; a corrupt or incompatible checkpoint fails with a :class:`CheckpointError` that names the
variable and what was expected versus found.

Parameter servers do their part through two methods of the PS service, ``SaveShards`` and ``RestoreShards``
(:func:`rpc_save_shards`, :func:`rpc_restore_shards`), served through :mod:`kubeps.runtime.server.methods`.

The package, one module per part (importing it registers the adapters for kubeps variables):

* ``format``: errors, the manifest, file names, verified ``.npy`` files, listing checkpoint directories;
* ``shards``: saving and restoring shards where they live, and the PS methods;
* ``saveables``: where each shard of a logical variable lives, ``register_saveable``, ``StepCounter``;
* ``dynamic``: dynamic embedding tables (their live rows per shard, restored into any number of shards) and the
  shard side of the PS methods ``SaveDynamic``/``RestoreDynamic``;
* ``incremental``: which shards an incremental save writes as deltas (only their rows changed since the newest
  checkpoint) and how a delta joins its chain of files; which checkpoints a kept one reads;
* ``preemption``: on SIGTERM the chief saves with its newest ``CheckpointManager`` before it exits;
* ``api``: ``Checkpoint``; ``manager``: ``CheckpointManager``; ``reader``: ``CheckpointReader``;
* ``adapters``: kubeps ``Variable`` and ``ShardedVariable`` as checkpoint variables;
* ``evaluator``: ``SidecarEvaluator``, which evaluates each new checkpoint from its files, without the ps.
"""

from __future__ import annotations

from kubeps.runtime.checkpoint.adapters import register_variable_adapters
from kubeps.runtime.checkpoint.api import Checkpoint

# the public names (__all__) and, as `X as X`, the building blocks the single module had, for extensions and tests
from kubeps.runtime.checkpoint.format import (
    CHECKPOINT_PREFIX as CHECKPOINT_PREFIX,
    FORMAT_VERSION,
    MANIFEST_NAME as MANIFEST_NAME,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointSpaceError,
    Manifest,
    SliceEntry as SliceEntry,
    TensorEntry as TensorEntry,
    VariableEntry as VariableEntry,
    commit_manifest as commit_manifest,
    latest_checkpoint,
    list_checkpoints,
    overlapping as overlapping,
    read_manifest as read_manifest,
    read_rows as read_rows,
    read_slice_rows as read_slice_rows,
    slice_file_name as slice_file_name,
    tensor_rows as tensor_rows,
    verify_checkpoint,
    write_array as write_array,
)
from kubeps.runtime.checkpoint.manager import CheckpointManager
from kubeps.runtime.checkpoint.reader import CheckpointReader
from kubeps.runtime.checkpoint.saveables import (
    ArrayAccess as ArrayAccess,
    LocalExecutor as LocalExecutor,
    PSExecutor as PSExecutor,
    Saveable as Saveable,
    ShardExecutor as ShardExecutor,
    ShardRef as ShardRef,
    StepCounter,
    register_saveable as register_saveable,
)
from kubeps.runtime.checkpoint.shards import (
    PS_METHODS as PS_METHODS,
    RestoreItem as RestoreItem,
    SavedShard as SavedShard,
    SaveItem as SaveItem,
    ShardAccess as ShardAccess,
    restore_items as restore_items,
    rpc_restore_shards as rpc_restore_shards,
    rpc_save_shards as rpc_save_shards,
    save_items as save_items,
)

__all__ = [
    "FORMAT_VERSION",
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointReader",
    "CheckpointSpaceError",
    "Manifest",
    "StepCounter",
    "latest_checkpoint",
    "list_checkpoints",
    "verify_checkpoint",
]

register_variable_adapters()
