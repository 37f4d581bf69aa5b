"""``Dataset``: a small ``tf.data``-like input pipeline over numpy arrays, generators, Python iterables and files.

This is not a ``tf.data`` clone. It is what a PS training program needs on a worker: build a pipeline from arrays,
a generator, any Python iterable or a list of files; ``shuffle``, ``repeat``, ``batch``, ``shard``, ``map``,
``prefetch``; and shard it across workers (:mod:`kubeps.runtime.data.distribute`).

A ``Dataset`` is a lazy description: every ``iter()`` starts a fresh pass, so ``repeat`` re-reads its input and a
shuffle with ``reshuffle_each_iteration=True`` changes its order from pass to pass. Elements are numpy arrays (or
Python values) nested in tuples and dicts; ``batch`` stacks them leaf by leaf and keeps the structure. As in
``tf.data``, ``map``/``filter``/``interleave`` functions receive a tuple element unpacked as positional arguments.
Datasets hold no threads or locks, so they can be pickled (cloudpickle) and shipped to workers.

``Dataset`` wraps the last node of its pipeline (:mod:`~kubeps.runtime.data.node`); each method returns a new
``Dataset`` around a new node from :mod:`~kubeps.runtime.data.sources`, :mod:`~kubeps.runtime.data.transforms`,
:mod:`~kubeps.runtime.data.shuffle` or :mod:`~kubeps.runtime.data.prefetch`. The nodes never import this module.
"""

from __future__ import annotations

import copy
import os
import threading
from typing import Any, Callable, Iterable, Iterator, Literal, Sequence

from kubeps.runtime.data import passes
from kubeps.runtime.checks import NonNegativeInt, PositiveInt, check, check_callable, index_in, integer
from kubeps.runtime.data.node import Node
from kubeps.runtime.data.structure import close
from kubeps.runtime.data.options import Options
from kubeps.runtime.data.prefetch import PrefetchNode
from kubeps.runtime.data.file_blocks import FileBlocksNode
from kubeps.runtime.data.readers import BLOCK_READERS, READERS, read_lines
from kubeps.runtime.data.shuffle import ShuffleNode
from kubeps.runtime.data.sources import FileListNode, GeneratorNode, IterableNode, RangeNode, TensorSlicesNode, TensorsNode
from kubeps.runtime.data.transforms import (
    BatchNode, FilterNode, InterleaveNode, MapNode, RepeatNode, ShardNode, SkipNode, TakeNode, batched,
)
from kubeps.runtime.errors import RuntimeConfigError

#: As ``tf.data.AUTOTUNE``: let the runtime pick a buffer size (``prefetch`` uses :data:`AUTOTUNE_PREFETCH`).
AUTOTUNE = -1
AUTOTUNE_PREFETCH = 4


class Dataset:
    """A lazy, re-iterable input pipeline. Build one with the ``from_*`` constructors, :meth:`range` or
    :meth:`list_files`; transformations return new datasets and leave this one unchanged.

    A dataset is the last :class:`~kubeps.runtime.data.node.Node` of its pipeline and the pipeline's
    :class:`Options`."""

    def __init__(self, node: Node, options: Options | None = None):
        self._node = node
        self._options = Options() if options is None else options

    # -- iteration ------------------------------------------------------------------------------------------------
    def __iter__(self) -> "DatasetIterator":
        ledger = passes.current()
        if ledger is not None:  # a worker's iterator: it counts what it hands out in batches or in elements
            ledger.batched = batched(self._node)
        return DatasetIterator(self._node.iterate(), getattr(self._node.root(), "feed", None))

    def _derive(self, node: Node) -> "Dataset":
        """A dataset around ``node`` (a new transformation of this one's node), with a copy of this one's options."""
        return Dataset(node, copy.deepcopy(self._options))

    def as_numpy_iterator(self) -> "DatasetIterator":
        """Same as ``iter(dataset)`` (elements already are numpy), for ``tf.data`` familiarity."""
        return iter(self)

    # -- constructors ---------------------------------------------------------------------------------------------
    @staticmethod
    def from_tensor_slices(tensors: Any) -> "Dataset":
        """One element per row (axis-0 slice) of ``tensors``: an array, or a tuple/dict of arrays with the same
        number of rows (elements keep that tuple/dict structure). Lists are converted to arrays, as in TF."""
        return Dataset(TensorSlicesNode(tensors))

    @staticmethod
    def from_tensors(tensors: Any) -> "Dataset":
        """A dataset of exactly one element: ``tensors`` (with its tuple/dict structure)."""
        return Dataset(TensorsNode(tensors))

    @staticmethod
    def from_generator(generator: Callable[..., Iterable[Any]], args: Sequence[Any] = ()) -> "Dataset":
        """Elements of ``generator(*args)``; the callable is called again for every pass (every ``iter()``)."""
        return Dataset(GeneratorNode(generator, tuple(args)))

    @staticmethod
    def from_iterable(iterable: Iterable[Any]) -> "Dataset":
        """Elements of any Python iterable. A re-iterable (list, array, Dataset...) can be read many times; a
        one-shot iterator only once (a second pass raises rather than silently yielding nothing)."""
        return Dataset(IterableNode(iterable))

    @staticmethod
    def range(*args: int) -> "Dataset":
        """``range(stop)``, ``range(start, stop[, step])`` as int64 scalars."""
        return Dataset(RangeNode(*args))

    @staticmethod
    def list_files(
        file_pattern: str | os.PathLike | Sequence[str | os.PathLike],
        shuffle: bool | None = None,
        seed: int | None = None,
    ) -> "Dataset":
        """File names matching a glob pattern (or a list of patterns), as ``tf.data.Dataset.list_files``.

        Matches are sorted; ``shuffle`` (default True, as in TF) shuffles them on every pass, reproducibly when
        ``seed`` is given. No match raises ``ValueError`` naming the pattern. The result is file-based: under
        ``AutoShardPolicy.FILE``/``AUTO`` workers split these files between them.
        """
        return Dataset(FileListNode(file_pattern, True if shuffle is None else bool(shuffle), seed))

    @staticmethod
    def from_files(
        file_pattern: str | os.PathLike | Sequence[str | os.PathLike],
        reader: str | Callable[[str], Iterable[Any]] = "lines",
        shuffle: bool = False,
        seed: int | None = None,
        cycle_length: int = 1,
    ) -> "Dataset":
        """Records read from files: ``list_files(file_pattern, shuffle, seed).interleave(reader, cycle_length)``.

        ``reader`` is ``"lines"`` (:func:`read_lines`), ``"csv"`` (:func:`read_csv`), ``"npy"`` (:func:`read_npy`),
        ``"npz"`` (:func:`read_npz`), ``"criteo"`` (:mod:`~kubeps.runtime.data.criteo`, read in blocks of lines)
        or any ``fn(path) -> iterable of records``. Unlike ``list_files``, files are read in sorted order unless
        ``shuffle=True``.
        """
        names = (*READERS, *BLOCK_READERS)
        allowed = f"one of {sorted(names)} or a callable"
        if isinstance(reader, str):
            name = check("reader", reader, Literal[names], allowed=allowed)
            if name in BLOCK_READERS:
                files = FileListNode(file_pattern, bool(shuffle), seed)
                cycle = check("cycle_length", cycle_length, PositiveInt)
                return Dataset(FileBlocksNode(files, BLOCK_READERS[name](), cycle_length=cycle, num_parallel_calls=1,
                                              name=f"read_{name}"))
            reader = READERS[name]
        check_callable("reader", reader, allowed=allowed)
        return Dataset.list_files(file_pattern, shuffle=shuffle, seed=seed).interleave(
            reader, cycle_length=cycle_length
        )

    # -- transformations ------------------------------------------------------------------------------------------
    def map(self, map_func: Callable[..., Any]) -> "Dataset":
        """Apply ``map_func`` to every element (a tuple element is passed as positional arguments)."""
        return self._derive(MapNode(self._node, check_callable("map_func", map_func)))

    def filter(self, predicate: Callable[..., Any]) -> "Dataset":
        """Keep the elements for which ``predicate`` is true."""
        return self._derive(FilterNode(self._node, check_callable("predicate", predicate)))

    def interleave(
        self, map_func: Callable[..., Iterable[Any]], cycle_length: int = 1, block_length: int = 1
    ) -> "Dataset":
        """Map every element to a dataset (or any iterable) and interleave them: ``cycle_length`` of them are
        open at once and ``block_length`` consecutive elements are taken from each in turn (deterministic,
        single-threaded). ``cycle_length=1`` concatenates, like :meth:`flat_map`."""
        return self._derive(
            InterleaveNode(
                self._node,
                check_callable("map_func", map_func),
                check("cycle_length", cycle_length, PositiveInt),
                check("block_length", block_length, PositiveInt),
                _open_pass,
            )
        )

    def flat_map(self, map_func: Callable[..., Iterable[Any]]) -> "Dataset":
        """Map every element to a dataset (or iterable) and concatenate them."""
        return self.interleave(map_func, cycle_length=1, block_length=1)

    def shuffle(self, buffer_size: int, seed: int | None = None, reshuffle_each_iteration: bool = True) -> "Dataset":
        """Randomly shuffle with a buffer of ``buffer_size`` elements, as ``tf.data``: the buffer is filled, then
        each output is a random pick from it, replaced by the next input. With ``seed`` the sequence of orders is
        reproducible; ``reshuffle_each_iteration=False`` repeats the same order on every pass."""
        buffer_size = check("buffer_size", buffer_size, PositiveInt)
        if seed is not None:
            seed = check("seed", seed, integer(ge=0, allowed="None or an integer >= 0"))
        return self._derive(ShuffleNode(self._node, buffer_size, seed, bool(reshuffle_each_iteration)))

    def repeat(self, count: int | None = None) -> "Dataset":
        """Repeat ``count`` times (``None`` or ``-1``: forever). Repeating an empty dataset stays empty."""
        if count is not None:
            count = check("count", count, integer(ge=-1, allowed="None, -1 (forever) or an integer >= 0"))
            if count == -1:
                count = None
        return self._derive(RepeatNode(self._node, count))

    def batch(self, batch_size: int, drop_remainder: bool = False) -> "Dataset":
        """Stack ``batch_size`` consecutive elements (leaf by leaf, keeping tuples and dicts) into arrays with a
        leading batch axis. The last, smaller batch is kept unless ``drop_remainder``."""
        batch_size = check("batch_size", batch_size, PositiveInt)
        return self._derive(BatchNode(self._node, batch_size, bool(drop_remainder)))

    def shard(self, num_shards: int, index: int) -> "Dataset":
        """Keep elements ``index, index + num_shards, index + 2*num_shards, ...``."""
        num_shards = check("num_shards", num_shards, PositiveInt)
        index = check("index", index, index_in(num_shards, "num_shards"))
        return self._derive(ShardNode(self._node, num_shards, index))

    def take(self, count: int) -> "Dataset":
        """The first ``count`` elements (``-1``: all)."""
        count = check("count", count, integer(ge=-1, allowed="-1 (all) or an integer >= 0"))
        return self._derive(TakeNode(self._node, None if count == -1 else count))

    def skip(self, count: int) -> "Dataset":
        """All but the first ``count`` elements."""
        return self._derive(SkipNode(self._node, check("count", count, NonNegativeInt)))

    def prefetch(self, buffer_size: int) -> "Dataset":
        """Produce up to ``buffer_size`` elements ahead in a background thread (``AUTOTUNE``: a small default;
        ``0``: no prefetching). Errors reach the consumer at the element where they happened; closing or
        dropping the iterator stops and joins the thread."""
        buffer_size = check("buffer_size", buffer_size, integer(ge=-1, allowed="AUTOTUNE (-1) or an integer >= 0"))
        if buffer_size == AUTOTUNE:
            buffer_size = AUTOTUNE_PREFETCH
        return self._derive(PrefetchNode(self._node, buffer_size))

    # -- options --------------------------------------------------------------------------------------------------
    @property
    def options(self) -> Options:
        """A copy of this dataset's options."""
        return copy.deepcopy(self._options)

    def with_options(self, options: Options) -> "Dataset":
        """This dataset with ``options`` (e.g. ``options.experimental_distribute.auto_shard_policy``)."""
        if not isinstance(options, Options):
            raise RuntimeConfigError("options", type(options).__name__, "a kubeps.runtime.data.Options")
        clone = copy.copy(self)
        clone._node = copy.copy(self._node)  # its own pass counters (a shuffle's epoch, a one-shot iterator's use)
        clone._options = copy.deepcopy(options)
        return clone

    # -- introspection for auto-sharding --------------------------------------------------------------------------
    def _root(self) -> Node:
        return self._node.root()

    @property
    def is_file_based(self) -> bool:
        """Whether the pipeline starts from a list of files (``list_files``, ``from_files``, ``TextLineDataset``)."""
        return isinstance(self._node.root(), FileListNode)

    def _with_root(self, root: Node) -> "Dataset":
        """A copy of this pipeline whose source is replaced by ``root``."""
        clone = copy.copy(self)
        clone._node = self._node.with_root(root)
        return clone

    def _describe_source(self) -> str:
        return self._node.root().kind()

    def __repr__(self) -> str:
        return "Dataset(" + " -> ".join(node.describe() for node in self._node.chain()) + ")"


class DatasetIterator:
    """An iterator over one pass of a dataset. ``next()`` is thread-safe; ``close()`` (or dropping the iterator,
    or leaving a ``with`` block) stops any prefetch threads behind it."""

    def __init__(self, generator: Iterator[Any], feed: Any = None):
        self._gen = generator
        self._lock = threading.Lock()
        #: the :class:`~kubeps.runtime.data.leases.ShardFeed` of an exactly-once dataset's source (None otherwise)
        self.feed = feed

    def __iter__(self) -> "DatasetIterator":
        return self

    def __next__(self) -> Any:
        with self._lock:
            return next(self._gen)

    def get_next(self) -> Any:
        """The next element; ``StopIteration`` at the end."""
        return self.__next__()

    def close(self) -> None:
        with self._lock:
            close(self._gen)

    def __enter__(self) -> "DatasetIterator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()



def TextLineDataset(filenames: str | os.PathLike | Sequence[str | os.PathLike]) -> Dataset:
    """Lines of text files (without the newline), file after file, as ``tf.data.TextLineDataset``."""
    return Dataset.from_files(filenames, reader=read_lines)


def _open_pass(result: Any) -> Iterator[Any]:
    """What an ``interleave``/``flat_map`` function returned, as an iterator over one pass: a dataset's own node
    (no thread-safe wrapper), or any iterable."""
    if isinstance(result, Dataset):
        return result._node.iterate()
    try:
        return iter(result)
    except TypeError:
        raise TypeError(
            f"interleave/flat_map: map_func must return a Dataset or an iterable, got {type(result).__name__}"
        ) from None
