"""Distributed input for parameter-server training: a small ``tf.data``-like ``Dataset`` over numpy arrays and files,
``InputContext``, and auto-sharding across workers with TensorFlow's ``AutoShardPolicy``.

This is not a ``tf.data`` clone. It is what a PS training program needs on a worker: build a pipeline from arrays,
a generator, any Python iterable or a list of files; ``shuffle``, ``repeat``, ``batch``, ``shard``, ``map``,
``prefetch``; and shard it across workers:

- ``AutoShardPolicy.FILE`` -- each worker reads its own subset of the files (``files[worker_index::num_workers]``);
  fewer files than workers is an error.
- ``AutoShardPolicy.DATA`` -- each worker reads everything and keeps every ``num_workers``-th element of the
  pipeline's output.
- ``AutoShardPolicy.AUTO`` (default) -- FILE if the dataset is file-based, otherwise DATA.
- ``AutoShardPolicy.OFF`` -- every worker sees every element.

A ``Dataset`` is a lazy description: every ``iter()`` starts a fresh pass, so ``repeat`` re-reads its input and a
shuffle with ``reshuffle_each_iteration=True`` changes its order from pass to pass. Elements are numpy arrays (or
Python values) nested in tuples and dicts; ``batch`` stacks them leaf by leaf and keeps the structure. As in
``tf.data``, ``map``/``filter``/``interleave`` functions receive a tuple element unpacked as positional arguments.
Datasets hold no threads or locks, so they can be pickled (cloudpickle) and shipped to workers.

One module for one class hierarchy (over 700 lines on purpose): ``Dataset``'s methods build the node classes below,
which subclass it, and the nodes share the block and structure helpers; splitting them apart would need the import
cycle the import contracts forbid. Nested structures are walked with :mod:`kubeps.runtime.util.nest` (lists are leaves,
as in ``tf.data``).
"""

from __future__ import annotations

import contextlib
import copy
import enum
import glob
import itertools
import numbers
import os
import queue
import secrets
import threading
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from kubeps.runtime.util import nest
from kubeps.runtime.util import npyfiles
from kubeps.runtime.errors import RuntimeConfigError

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

#: As ``tf.data.AUTOTUNE``: let the runtime pick a buffer size (``prefetch`` uses :data:`AUTOTUNE_PREFETCH`).
AUTOTUNE = -1
AUTOTUNE_PREFETCH = 4
#: How long closing a prefetching iterator waits for its producer thread (it exits at its next element).
PREFETCH_JOIN_TIMEOUT_S = 10.0


# -- argument checks ----------------------------------------------------------------------------------------------
def _int_arg(name: str, value: Any, minimum: int, allowed: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"argument `{name}` must be {allowed or f'an integer >= {minimum}'}, got {value!r}")
    return int(value)


def _callable_arg(name: str, value: Any) -> Callable:
    if not callable(value):
        raise TypeError(f"argument `{name}` must be callable, got {value!r} ({type(value).__name__})")
    return value


# -- InputContext -------------------------------------------------------------------------------------------------
class InputContext:
    """What an input function needs to know to shard and batch, as ``tf.distribute.InputContext``.

    ``num_input_pipelines`` is the number of workers building a pipeline, ``input_pipeline_id`` this worker's
    index among them, ``num_replicas_in_sync`` how many replicas share one global batch.
    """

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0, num_replicas_in_sync: int = 1):
        self._num_input_pipelines = _int_arg("num_input_pipelines", num_input_pipelines, 1)
        self._input_pipeline_id = _int_arg(
            "input_pipeline_id",
            input_pipeline_id,
            0,
            f"an integer in 0..{self._num_input_pipelines - 1} (num_input_pipelines={self._num_input_pipelines})",
        )
        if self._input_pipeline_id >= self._num_input_pipelines:
            raise ValueError(
                f"argument `input_pipeline_id` must be an integer in 0..{self._num_input_pipelines - 1} "
                f"(num_input_pipelines={self._num_input_pipelines}), got {input_pipeline_id!r}"
            )
        self._num_replicas_in_sync = _int_arg("num_replicas_in_sync", num_replicas_in_sync, 1)

    @property
    def num_input_pipelines(self) -> int:
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self) -> int:
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size // num_replicas_in_sync``; a ``ValueError`` when it does not divide evenly."""
        global_batch_size = _int_arg("global_batch_size", global_batch_size, 1)
        if global_batch_size % self._num_replicas_in_sync != 0:
            raise ValueError(
                f"The `global_batch_size` {global_batch_size!r} is not divisible by `num_replicas_in_sync` "
                f"{self._num_replicas_in_sync!r}"
            )
        return global_batch_size // self._num_replicas_in_sync

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, InputContext):
            return NotImplemented
        return (self._num_input_pipelines, self._input_pipeline_id, self._num_replicas_in_sync) == (
            other._num_input_pipelines,
            other._input_pipeline_id,
            other._num_replicas_in_sync,
        )

    def __repr__(self) -> str:
        return (
            f"InputContext(num_input_pipelines={self._num_input_pipelines}, "
            f"input_pipeline_id={self._input_pipeline_id}, num_replicas_in_sync={self._num_replicas_in_sync})"
        )


# -- options ------------------------------------------------------------------------------------------------------
class AutoShardPolicy(enum.IntEnum):
    """How :func:`auto_shard` splits a dataset across workers (TensorFlow's values)."""

    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2


class DistributeOptions:
    """``options.experimental_distribute``: the auto-shard policy."""

    def __init__(self, auto_shard_policy: AutoShardPolicy = AutoShardPolicy.AUTO):
        self.auto_shard_policy = auto_shard_policy

    @property
    def auto_shard_policy(self) -> AutoShardPolicy:
        return self._auto_shard_policy

    @auto_shard_policy.setter
    def auto_shard_policy(self, value: Any) -> None:
        self._auto_shard_policy = _as_policy(value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DistributeOptions) and other.auto_shard_policy == self.auto_shard_policy

    def __repr__(self) -> str:
        return f"DistributeOptions(auto_shard_policy={self._auto_shard_policy.name})"


class Options:
    """Dataset options, as ``tf.data.Options``; only the distribution options matter to kubeps."""

    def __init__(self) -> None:
        self.experimental_distribute = DistributeOptions()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Options) and other.experimental_distribute == self.experimental_distribute

    def __repr__(self) -> str:
        return f"Options(experimental_distribute={self.experimental_distribute!r})"


def _as_policy(value: Any) -> AutoShardPolicy:
    if isinstance(value, AutoShardPolicy):
        return value
    if isinstance(value, str) and value.upper() in AutoShardPolicy.__members__:
        return AutoShardPolicy[value.upper()]
    try:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return AutoShardPolicy(int(value))
    except ValueError:
        pass
    allowed = ", ".join(f"{p.name} ({p.value})" for p in AutoShardPolicy)
    raise ValueError(f"auto_shard_policy must be an AutoShardPolicy, one of {allowed}; got {value!r}")


# -- nested structures --------------------------------------------------------------------------------------------
def _describe(x: Any) -> str:
    if isinstance(x, Mapping):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in x.items()) + "}"
    if isinstance(x, tuple):
        return "(" + ", ".join(_describe(v) for v in x) + ")"
    arr = np.asarray(x)
    return f"array{arr.shape}:{arr.dtype}"


def _stack(elements: Sequence[Any]) -> Any:
    """Stack a list of same-structured elements leaf by leaf into numpy arrays with a new leading axis."""
    first = elements[0]
    if isinstance(first, Mapping):
        for e in elements:
            if not isinstance(e, Mapping) or set(e) != set(first):
                raise ValueError(
                    f"batch: elements have different structures: {_describe(first)} and {_describe(e)}"
                )
        return {k: _stack([e[k] for e in elements]) for k in first}
    if isinstance(first, tuple):
        for e in elements:
            if not isinstance(e, tuple) or len(e) != len(first):
                raise ValueError(
                    f"batch: elements have different structures: {_describe(first)} and {_describe(e)}"
                )
        parts = [_stack([e[i] for e in elements]) for i in range(len(first))]
        return type(first)(*parts) if nest.is_namedtuple(first) else tuple(parts)
    arrays = [np.asarray(e) for e in elements]
    shape = arrays[0].shape
    for a in arrays:
        if a.shape != shape:
            raise ValueError(
                f"batch: cannot stack elements of different shapes {shape} and {a.shape}; "
                f"make every element the same shape before batching"
            )
    return np.stack(arrays)


def _slice(structure: Any, index: Any) -> Any:
    """Every leaf indexed with ``index`` (an element of a block, or a run of them)."""
    return nest.map_structure(lambda leaf: leaf[index], structure, lists=False)


def _as_arrays(structure: Any) -> Any:
    return nest.map_structure(np.asarray, structure, lists=False)


def _call(fn: Callable, element: Any) -> Any:
    """Call ``fn`` on an element as ``tf.data`` does: a (non-named) tuple is unpacked into positional arguments."""
    if isinstance(element, tuple) and not nest.is_namedtuple(element):
        return fn(*element)
    return fn(element)


def _close(it: Any) -> None:
    close = getattr(it, "close", None)
    if close is not None:
        close()


@contextlib.contextmanager
def _closing(it: Iterator[Any]) -> Iterator[Iterator[Any]]:
    """``with _closing(parent._iterate()) as it``: the input iterator is closed however this node's pass ends
    (exhausted, an error, or the consumer closing this node's generator)."""
    try:
        yield it
    finally:
        _close(it)


# -- blocks: many consecutive elements as one structure of arrays with a leading axis ---------------------------
#: rows a shuffle processes per vectorised step, and a range source per block
BLOCK_ROWS = 4096


def _map_leaves(fn: Callable[..., Any], first: Any, *rest: Any) -> Any:
    """``fn`` applied leaf by leaf to same-structured elements, keeping the structure (lists are leaves)."""
    leaves = zip(*(nest.flatten(s, lists=False) for s in (first, *rest)))
    return nest.pack(first, [fn(*group) for group in leaves], lists=False)


def _rows(block: Any) -> int:
    """Elements in a block (the leading dimension of its leaves)."""
    return int(nest.flatten(block, lists=False)[0].shape[0])


def _concat(blocks: Sequence[Any]) -> Any:
    return blocks[0] if len(blocks) == 1 else _map_leaves(lambda *leaves: np.concatenate(leaves), *blocks)


def _unblock(blocks: Iterator[Any]) -> Iterator[Any]:
    """The elements of blocks, one by one (what an element-wise consumer of a block-wise node sees)."""
    with _closing(blocks):
        for block in blocks:
            for i in range(_rows(block)):
                yield _slice(block, i)


# -- the dataset --------------------------------------------------------------------------------------------------
class Dataset:
    """A lazy, re-iterable input pipeline. Build one with the ``from_*`` constructors, :meth:`range` or
    :meth:`list_files`; transformations return new datasets and leave this one unchanged."""

    _parent: "Dataset | None" = None

    def __init__(self) -> None:
        self._options = Options()

    # -- iteration ------------------------------------------------------------------------------------------------
    def __iter__(self) -> "DatasetIterator":
        return DatasetIterator(self._iterate())

    def _iterate(self) -> Iterator[Any]:  # pragma: no cover - every concrete dataset overrides it
        raise NotImplementedError

    def _blocks(self) -> Iterator[Any] | None:
        """The elements as *blocks* -- structures of arrays whose leading axis runs over consecutive elements --,
        or None where this node works element by element.

        Array sources (``from_tensor_slices``, ``from_tensors``, ``range``) and the transformations that only
        pick, drop or reorder elements (``shard``, ``shuffle``, ``repeat``, ``take``, ``skip``) pass blocks on, so
        a ``batch`` above them is cut with array slicing and gathers: no Python step per element. ``map``,
        ``filter``, ``interleave`` and the other sources work per element (map after ``batch`` to vectorise)."""
        return None

    def _derive(self, node: "Dataset") -> "Dataset":
        """Attach ``node`` (a new transformation) after this dataset; it inherits this dataset's options."""
        node._parent = self
        node._options = copy.deepcopy(self._options)
        return node

    def as_numpy_iterator(self) -> "DatasetIterator":
        """Same as ``iter(dataset)`` (elements already are numpy), for ``tf.data`` familiarity."""
        return iter(self)

    # -- constructors ---------------------------------------------------------------------------------------------
    @staticmethod
    def from_tensor_slices(tensors: Any) -> "Dataset":
        """One element per row (axis-0 slice) of ``tensors``: an array, or a tuple/dict of arrays with the same
        number of rows (elements keep that tuple/dict structure). Lists are converted to arrays, as in TF."""
        return _TensorSlicesDataset(tensors)

    @staticmethod
    def from_tensors(tensors: Any) -> "Dataset":
        """A dataset of exactly one element: ``tensors`` (with its tuple/dict structure)."""
        return _TensorsDataset(tensors)

    @staticmethod
    def from_generator(generator: Callable[..., Iterable[Any]], args: Sequence[Any] = ()) -> "Dataset":
        """Elements of ``generator(*args)``; the callable is called again for every pass (every ``iter()``)."""
        return _GeneratorDataset(generator, tuple(args))

    @staticmethod
    def from_iterable(iterable: Iterable[Any]) -> "Dataset":
        """Elements of any Python iterable. A re-iterable (list, array, Dataset...) can be read many times; a
        one-shot iterator only once (a second pass raises rather than silently yielding nothing)."""
        return _IterableDataset(iterable)

    @staticmethod
    def range(*args: int) -> "Dataset":
        """``range(stop)``, ``range(start, stop[, step])`` as int64 scalars."""
        return _RangeDataset(*args)

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
        return _FileListDataset(file_pattern, True if shuffle is None else bool(shuffle), seed)

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
        ``"npz"`` (:func:`read_npz`) or any ``fn(path) -> iterable of records``. Unlike ``list_files``, files are
        read in sorted order unless ``shuffle=True``.
        """
        if isinstance(reader, str):
            if reader not in _READERS:
                raise ValueError(
                    f"argument `reader` must be one of {sorted(_READERS)} or a callable, got {reader!r}"
                )
            reader = _READERS[reader]
        _callable_arg("reader", reader)
        return Dataset.list_files(file_pattern, shuffle=shuffle, seed=seed).interleave(
            reader, cycle_length=cycle_length
        )

    # -- transformations ------------------------------------------------------------------------------------------
    def map(self, map_func: Callable[..., Any]) -> "Dataset":
        """Apply ``map_func`` to every element (a tuple element is passed as positional arguments)."""
        return self._derive(_MapDataset(_callable_arg("map_func", map_func)))

    def filter(self, predicate: Callable[..., Any]) -> "Dataset":
        """Keep the elements for which ``predicate`` is true."""
        return self._derive(_FilterDataset(_callable_arg("predicate", predicate)))

    def interleave(
        self, map_func: Callable[..., Iterable[Any]], cycle_length: int = 1, block_length: int = 1
    ) -> "Dataset":
        """Map every element to a dataset (or any iterable) and interleave them: ``cycle_length`` of them are
        open at once and ``block_length`` consecutive elements are taken from each in turn (deterministic,
        single-threaded). ``cycle_length=1`` concatenates, like :meth:`flat_map`."""
        return self._derive(
            _InterleaveDataset(
                _callable_arg("map_func", map_func),
                _int_arg("cycle_length", cycle_length, 1),
                _int_arg("block_length", block_length, 1),
            )
        )

    def flat_map(self, map_func: Callable[..., Iterable[Any]]) -> "Dataset":
        """Map every element to a dataset (or iterable) and concatenate them."""
        return self.interleave(map_func, cycle_length=1, block_length=1)

    def shuffle(self, buffer_size: int, seed: int | None = None, reshuffle_each_iteration: bool = True) -> "Dataset":
        """Randomly shuffle with a buffer of ``buffer_size`` elements, as ``tf.data``: the buffer is filled, then
        each output is a random pick from it, replaced by the next input. With ``seed`` the sequence of orders is
        reproducible; ``reshuffle_each_iteration=False`` repeats the same order on every pass."""
        buffer_size = _int_arg("buffer_size", buffer_size, 1)
        if seed is not None:
            seed = _int_arg("seed", seed, 0, "None or an integer >= 0")
        return self._derive(_ShuffleDataset(buffer_size, seed, bool(reshuffle_each_iteration)))

    def repeat(self, count: int | None = None) -> "Dataset":
        """Repeat ``count`` times (``None`` or ``-1``: forever). Repeating an empty dataset stays empty."""
        if count is not None:
            count = _int_arg("count", count, -1, "None, -1 (forever) or an integer >= 0")
            if count == -1:
                count = None
        return self._derive(_RepeatDataset(count))

    def batch(self, batch_size: int, drop_remainder: bool = False) -> "Dataset":
        """Stack ``batch_size`` consecutive elements (leaf by leaf, keeping tuples and dicts) into arrays with a
        leading batch axis. The last, smaller batch is kept unless ``drop_remainder``."""
        return self._derive(_BatchDataset(_int_arg("batch_size", batch_size, 1), bool(drop_remainder)))

    def shard(self, num_shards: int, index: int) -> "Dataset":
        """Keep elements ``index, index + num_shards, index + 2*num_shards, ...``."""
        num_shards = _int_arg("num_shards", num_shards, 1)
        if isinstance(index, bool) or not isinstance(index, numbers.Integral) or not 0 <= index < num_shards:
            raise ValueError(
                f"argument `index` must be an integer in 0..{num_shards - 1} (num_shards={num_shards}), got {index!r}"
            )
        return self._derive(_ShardDataset(num_shards, int(index)))

    def take(self, count: int) -> "Dataset":
        """The first ``count`` elements (``-1``: all)."""
        count = _int_arg("count", count, -1, "-1 (all) or an integer >= 0")
        return self._derive(_TakeDataset(None if count == -1 else count))

    def skip(self, count: int) -> "Dataset":
        """All but the first ``count`` elements."""
        return self._derive(_SkipDataset(_int_arg("count", count, 0)))

    def prefetch(self, buffer_size: int) -> "Dataset":
        """Produce up to ``buffer_size`` elements ahead in a background thread (``AUTOTUNE``: a small default;
        ``0``: no prefetching). Errors reach the consumer at the element where they happened; closing or
        dropping the iterator stops and joins the thread."""
        buffer_size = _int_arg("buffer_size", buffer_size, -1, "AUTOTUNE (-1) or an integer >= 0")
        if buffer_size == AUTOTUNE:
            buffer_size = AUTOTUNE_PREFETCH
        return self._derive(_PrefetchDataset(buffer_size))

    # -- options --------------------------------------------------------------------------------------------------
    @property
    def options(self) -> Options:
        """A copy of this dataset's options."""
        return copy.deepcopy(self._options)

    def with_options(self, options: Options) -> "Dataset":
        """This dataset with ``options`` (e.g. ``options.experimental_distribute.auto_shard_policy``)."""
        if not isinstance(options, Options):
            raise TypeError(f"argument `options` must be a kubeps.runtime.data.Options, got {type(options).__name__}")
        clone = copy.copy(self)
        clone._options = copy.deepcopy(options)
        return clone

    # -- introspection for auto-sharding --------------------------------------------------------------------------
    def _root(self) -> "Dataset":
        node = self
        while node._parent is not None:
            node = node._parent
        return node

    @property
    def is_file_based(self) -> bool:
        """Whether the pipeline starts from a list of files (``list_files``, ``from_files``, ``TextLineDataset``)."""
        return isinstance(self._root(), _FileListDataset)

    def _with_root(self, root: "Dataset") -> "Dataset":
        """A copy of this pipeline whose source is replaced by ``root``."""
        if self._parent is None:
            return root
        clone = copy.copy(self)
        clone._parent = self._parent._with_root(root)
        return clone

    def _describe_source(self) -> str:
        return type(self._root()).__name__.lstrip("_").replace("Dataset", "") or "Dataset"

    def __repr__(self) -> str:
        chain = []
        node: Dataset | None = self
        while node is not None:
            chain.append(node._repr_node())
            node = node._parent
        return "Dataset(" + " -> ".join(reversed(chain)) + ")"

    def _repr_node(self) -> str:
        return type(self).__name__.lstrip("_").replace("Dataset", "").lower()


class DatasetIterator:
    """An iterator over one pass of a dataset. ``next()`` is thread-safe; ``close()`` (or dropping the iterator,
    or leaving a ``with`` block) stops any prefetch threads behind it."""

    def __init__(self, generator: Iterator[Any]):
        self._gen = generator
        self._lock = threading.Lock()

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
            self._gen.close()

    def __enter__(self) -> "DatasetIterator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- sources ------------------------------------------------------------------------------------------------------
class _TensorSlicesDataset(Dataset):
    def __init__(self, tensors: Any):
        super().__init__()
        structure = _as_arrays(tensors)
        leaves = [(path or "<element>", leaf) for path, leaf in nest.flatten_with_paths(structure, lists=False)]
        if not leaves:
            raise ValueError("from_tensor_slices: `tensors` holds no arrays")
        rows = None
        for path, leaf in leaves:
            if leaf.ndim == 0:
                raise ValueError(
                    f"from_tensor_slices: `tensors{'' if path == '<element>' else path}` is a scalar; every "
                    f"component needs at least one dimension to slice"
                )
            if rows is None:
                rows = leaf.shape[0]
            elif leaf.shape[0] != rows:
                sizes = ", ".join(f"{p}: {a.shape[0]}" for p, a in leaves)
                raise ValueError(
                    f"from_tensor_slices: all components must have the same size in their first dimension, got {sizes}"
                )
        self._structure = structure
        self._rows = rows or 0

    def _iterate(self) -> Iterator[Any]:
        for i in range(self._rows):
            yield _slice(self._structure, i)

    def _blocks(self) -> Iterator[Any]:
        if self._rows:
            yield self._structure  # one block of views: slicing it downstream copies nothing

    def _repr_node(self) -> str:
        return f"from_tensor_slices({self._rows} rows)"


class _TensorsDataset(Dataset):
    def __init__(self, tensors: Any):
        super().__init__()
        self._structure = _as_arrays(tensors)

    def _iterate(self) -> Iterator[Any]:
        yield self._structure

    def _blocks(self) -> Iterator[Any]:
        yield _map_leaves(lambda a: np.asarray(a)[np.newaxis], self._structure)


class _RangeDataset(Dataset):
    def __init__(self, *args: int):
        super().__init__()
        if not 1 <= len(args) <= 3:
            raise TypeError(f"Dataset.range takes 1 to 3 integers (stop | start, stop[, step]), got {len(args)}")
        for a in args:
            _int_arg("range argument", a, -(2**63), "an integer")
        self._range = range(*args)

    def _iterate(self) -> Iterator[Any]:
        for i in self._range:
            yield np.int64(i)

    def _blocks(self) -> Iterator[Any]:
        r = self._range
        for k in range(0, len(r), BLOCK_ROWS):
            part = r[k : k + BLOCK_ROWS]
            yield np.arange(part.start, part.stop, part.step, dtype=np.int64)

    def _repr_node(self) -> str:
        return repr(self._range)


class _GeneratorDataset(Dataset):
    def __init__(self, generator: Callable[..., Iterable[Any]], args: tuple):
        super().__init__()
        if not callable(generator):
            hint = " (pass the generator function, not a generator object)" if hasattr(generator, "__next__") else ""
            raise TypeError(f"argument `generator` must be callable{hint}, got {type(generator).__name__}")
        self._generator = generator
        self._args = args

    def _iterate(self) -> Iterator[Any]:
        with _closing(iter(self._generator(*self._args))) as it:
            yield from it


class _IterableDataset(Dataset):
    def __init__(self, iterable: Iterable[Any]):
        super().__init__()
        try:
            iter(iterable)
        except TypeError:
            raise TypeError(f"from_iterable needs an iterable, got {type(iterable).__name__}") from None
        self._iterable = iterable
        self._one_shot = iter(iterable) is iterable if not isinstance(iterable, Dataset) else False
        self._passes = 0

    def _iterate(self) -> Iterator[Any]:
        if self._one_shot:
            if self._passes:
                raise RuntimeError(
                    f"this dataset reads a one-shot iterator ({type(self._iterable).__name__}) that was already "
                    f"consumed; use a re-iterable (list, array, Dataset) or Dataset.from_generator(fn)"
                )
            self._passes += 1
        it = iter(self._iterable)
        try:
            yield from it
        finally:
            if not self._one_shot:
                _close(it)


def _expand_patterns(file_pattern: Any) -> tuple[list[str], list[str]]:
    if isinstance(file_pattern, (str, os.PathLike)):
        patterns = [os.fspath(file_pattern)]
    else:
        try:
            patterns = [os.fspath(p) for p in file_pattern]
        except TypeError:
            raise TypeError(
                f"argument `file_pattern` must be a path/glob pattern or a list of them, got {file_pattern!r}"
            ) from None
    if not patterns:
        raise ValueError("argument `file_pattern` is an empty list; give at least one path or glob pattern")
    files: list[str] = []
    seen: set[str] = set()
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else ([pattern] if os.path.exists(pattern) else [])
        matches = [m for m in matches if not os.path.isdir(m)]
        if not matches:
            raise ValueError(f"No files matched pattern: {pattern}")
        for m in matches:
            if m not in seen:
                seen.add(m)
                files.append(m)
    return files, patterns


class _FileListDataset(Dataset):
    def __init__(self, file_pattern: Any, shuffle: bool, seed: int | None):
        super().__init__()
        self._files, self._patterns = _expand_patterns(file_pattern)
        if seed is not None:
            seed = _int_arg("seed", seed, 0, "None or an integer >= 0")
        self._shuffle = shuffle
        self._seed = seed if seed is not None else secrets.randbits(63)
        self._passes = 0

    @property
    def files(self) -> list[str]:
        return list(self._files)

    def _sharded(self, num_workers: int, worker_index: int) -> "_FileListDataset":
        clone = copy.copy(self)
        clone._files = self._files[worker_index::num_workers]
        clone._passes = 0
        return clone

    def _iterate(self) -> Iterator[Any]:
        files = self._files
        if self._shuffle:
            rng = np.random.default_rng([self._seed, self._passes])
            self._passes += 1
            files = [files[i] for i in rng.permutation(len(files))]
        yield from files

    def _repr_node(self) -> str:
        return f"list_files({len(self._files)} files)"


def TextLineDataset(filenames: str | os.PathLike | Sequence[str | os.PathLike]) -> Dataset:
    """Lines of text files (without the newline), file after file, as ``tf.data.TextLineDataset``."""
    return Dataset.from_files(filenames, reader=read_lines)


# -- transformations ----------------------------------------------------------------------------------------------
class _MapDataset(Dataset):
    def __init__(self, fn: Callable):
        super().__init__()
        self._fn = fn

    def _iterate(self) -> Iterator[Any]:
        with _closing(self._parent._iterate()) as it:
            for element in it:
                yield _call(self._fn, element)


class _FilterDataset(Dataset):
    def __init__(self, fn: Callable):
        super().__init__()
        self._fn = fn

    def _iterate(self) -> Iterator[Any]:
        with _closing(self._parent._iterate()) as it:
            for element in it:
                if _call(self._fn, element):
                    yield element


def _sub_iterator(result: Any) -> Iterator[Any]:
    if isinstance(result, Dataset):
        return result._iterate()
    try:
        return iter(result)
    except TypeError:
        raise TypeError(
            f"interleave/flat_map: map_func must return a Dataset or an iterable, got {type(result).__name__}"
        ) from None


class _InterleaveDataset(Dataset):
    def __init__(self, fn: Callable, cycle_length: int, block_length: int):
        super().__init__()
        self._fn = fn
        self._cycle_length = cycle_length
        self._block_length = block_length

    def _iterate(self) -> Iterator[Any]:
        # tf.data's InterleaveDataset: a cycle of ``cycle_length`` slots visited in turn, ``block_length``
        # elements from each; an exhausted iterator frees its slot and the cycle moves on to the next one; an
        # empty slot is filled from the input when the cycle reaches it
        outer = self._parent._iterate()
        slots: list[Iterator[Any] | None] = [None] * self._cycle_length
        num_open = 0
        index = 0
        end_of_input = False
        try:
            while not end_of_input or num_open:
                it = slots[index]
                if it is not None:
                    for _ in range(self._block_length):
                        try:
                            element = next(it)
                        except StopIteration:
                            slots[index] = None
                            num_open -= 1
                            _close(it)
                            break
                        yield element
                    index = (index + 1) % self._cycle_length
                elif not end_of_input:
                    try:
                        element = next(outer)
                    except StopIteration:
                        end_of_input = True
                        continue
                    slots[index] = _sub_iterator(_call(self._fn, element))
                    num_open += 1
                else:
                    index = (index + 1) % self._cycle_length
        finally:
            for it in slots:
                if it is not None:
                    _close(it)
            outer.close()

    def _repr_node(self) -> str:
        return f"interleave(cycle_length={self._cycle_length})"


class _RowwiseDataset(Dataset):
    """A transformation that only picks, drops or reorders elements: block-wise when its input is, else per
    element. Subclasses give both forms (``_on_blocks``, ``_on_elements``) of the same sequence."""

    def _blocks(self) -> Iterator[Any] | None:
        parent = self._parent._blocks()
        return None if parent is None else self._on_blocks(parent)

    def _iterate(self) -> Iterator[Any]:
        blocks = self._blocks()
        return _unblock(blocks) if blocks is not None else self._on_elements()

    def _on_blocks(self, parent: Iterator[Any]) -> Iterator[Any]:  # pragma: no cover - overridden
        raise NotImplementedError

    def _on_elements(self) -> Iterator[Any]:  # pragma: no cover - overridden
        raise NotImplementedError


class _ShuffleDataset(_RowwiseDataset):
    """tf.data's shuffle buffer: fill it with ``buffer_size`` elements; then every input element takes the place of
    a uniformly picked one, which is output; at the end of the input the rest is output in random order.

    Both forms draw the same random numbers in the same order, so a seeded shuffle gives the same sequence whether
    its input comes in blocks or element by element."""

    def __init__(self, buffer_size: int, seed: int | None, reshuffle: bool):
        super().__init__()
        self._buffer_size = buffer_size
        self._seed = seed if seed is not None else secrets.randbits(63)
        self._reshuffle = reshuffle
        self._passes = 0

    def _rng(self) -> np.random.Generator:
        epoch = self._passes if self._reshuffle else 0
        self._passes += 1
        return np.random.default_rng([self._seed, epoch])

    @staticmethod
    def _drain_order(rng: np.random.Generator, size: int) -> list[int]:
        """Positions in the buffer, in the order the end-of-input drain outputs them (swap the pick with the last
        element, pop the last)."""
        randoms = rng.random(size).tolist()
        slots = list(range(size))
        out = []
        for r in randoms:
            n = len(slots)
            j = min(int(r * n), n - 1)
            slots[j], slots[-1] = slots[-1], slots[j]
            out.append(slots.pop())
        return out

    def _on_elements(self) -> Iterator[Any]:
        rng = self._rng()
        size = self._buffer_size
        buf: list[Any] = []
        with _closing(self._parent._iterate()) as it:
            for element in it:
                if len(buf) < size:
                    buf.append(element)
                    continue
                j = min(int(rng.random() * size), size - 1)
                out, buf[j] = buf[j], element
                yield out
        for j in self._drain_order(rng, len(buf)):
            yield buf[j]

    def _on_blocks(self, parent: Iterator[Any]) -> Iterator[Any]:
        rng = self._rng()
        size = self._buffer_size
        filling: list[Any] = []  # blocks read while the buffer fills
        filled = 0
        buf = None  # once full: a writable block of `size` rows
        with _closing(parent):
            for block in parent:
                n, pos = _rows(block), 0
                if buf is None:
                    pos = min(size - filled, n)
                    filling.append(_slice(block, slice(0, pos)))
                    filled += pos
                    if filled < size:
                        continue
                    buf = _map_leaves(np.array, _concat(filling))  # np.array copies: the buffer is written
                    filling = []
                while pos < n:
                    k = min(BLOCK_ROWS, n - pos)
                    yield self._exchange(buf, _slice(block, slice(pos, pos + k)), rng, size)
                    pos += k
        if buf is None:  # the input ended before the buffer was full
            if not filling:
                return
            buf = _concat(filling)
        order = np.asarray(self._drain_order(rng, _rows(buf)), dtype=np.int64)
        for k in range(0, len(order), BLOCK_ROWS):
            yield _map_leaves(lambda a, idx=order[k : k + BLOCK_ROWS]: a[idx], buf)

    @staticmethod
    def _exchange(buf: Any, incoming: Any, rng: np.random.Generator, size: int) -> Any:
        """``k`` incoming elements through the full buffer at once: element ``t`` goes to slot ``j[t]``, and the
        output ``t`` is what that slot held then -- the last earlier incoming element sent to the same slot in
        this block, or else the buffer's element from before the block."""
        k = _rows(incoming)
        slots = np.minimum((rng.random(k) * size).astype(np.int64), size - 1)
        order = np.argsort(slots, kind="stable")  # by slot, then by arrival
        sorted_slots = slots[order]
        same = np.zeros(k, dtype=bool)
        same[1:] = sorted_slots[1:] == sorted_slots[:-1]
        previous_sorted = np.full(k, -1, dtype=np.int64)
        previous_sorted[1:] = order[:-1]
        previous_sorted[~same] = -1
        previous = np.empty(k, dtype=np.int64)
        previous[order] = previous_sorted  # the earlier incoming element in the same slot, or -1
        from_buffer = previous < 0
        last = np.ones(k, dtype=bool)
        last[:-1] = sorted_slots[1:] != sorted_slots[:-1]  # the last arrival per slot stays in the buffer

        def exchange(b: np.ndarray, x: np.ndarray) -> np.ndarray:
            out = b[slots]
            out[~from_buffer] = x[previous[~from_buffer]]
            b[sorted_slots[last]] = x[order[last]]
            return out

        return _map_leaves(exchange, buf, incoming)

    def _repr_node(self) -> str:
        return f"shuffle({self._buffer_size})"


class _RepeatDataset(_RowwiseDataset):
    def __init__(self, count: int | None):
        super().__init__()
        self._count = count

    def _passes_of(self, first: Iterator[Any] | None, open_pass: Callable[[], Iterator[Any]]) -> Iterator[Any]:
        passes = itertools.count() if self._count is None else range(self._count)
        for n in passes:
            with _closing(first if n == 0 and first is not None else open_pass()) as it:
                empty = True
                for item in it:
                    empty = False
                    yield item
            if empty:
                return

    def _on_blocks(self, parent: Iterator[Any]) -> Iterator[Any]:
        return self._passes_of(parent, self._parent._blocks)

    def _on_elements(self) -> Iterator[Any]:
        return self._passes_of(None, self._parent._iterate)

    def _repr_node(self) -> str:
        return f"repeat({'' if self._count is None else self._count})"


class _BatchDataset(Dataset):
    def __init__(self, batch_size: int, drop_remainder: bool):
        super().__init__()
        self._batch_size = batch_size
        self._drop_remainder = drop_remainder

    def _iterate(self) -> Iterator[Any]:
        blocks = self._parent._blocks()
        return self._from_elements() if blocks is None else self._from_blocks(blocks)

    def _from_blocks(self, blocks: Iterator[Any]) -> Iterator[Any]:
        """Batches cut out of blocks: a slice (no copy) when a batch lies inside one block, else concatenated."""
        b = self._batch_size
        pending: list[Any] = []
        have = 0
        with _closing(blocks):
            for block in blocks:
                n, pos = _rows(block), 0
                while pos < n:
                    if not pending and n - pos >= b:
                        yield _slice(block, slice(pos, pos + b))
                        pos += b
                        continue
                    take = min(b - have, n - pos)
                    pending.append(_slice(block, slice(pos, pos + take)))
                    have += take
                    pos += take
                    if have == b:
                        yield _concat(pending)
                        pending, have = [], 0
        if pending and not self._drop_remainder:
            yield _concat(pending)

    def _from_elements(self) -> Iterator[Any]:
        with _closing(self._parent._iterate()) as it:
            buf: list[Any] = []
            for element in it:
                buf.append(element)
                if len(buf) == self._batch_size:
                    yield _stack(buf)
                    buf = []
            if buf and not self._drop_remainder:
                yield _stack(buf)

    def _repr_node(self) -> str:
        return f"batch({self._batch_size}{', drop_remainder' if self._drop_remainder else ''})"


class _ShardDataset(_RowwiseDataset):
    def __init__(self, num_shards: int, index: int):
        super().__init__()
        self._num_shards = num_shards
        self._index = index

    def _on_blocks(self, parent: Iterator[Any]) -> Iterator[Any]:
        seen = 0  # elements of the input before the current block
        with _closing(parent):
            for block in parent:
                n = _rows(block)
                first = (self._index - seen) % self._num_shards
                if first < n:
                    yield _slice(block, slice(first, n, self._num_shards))
                seen += n

    def _on_elements(self) -> Iterator[Any]:
        with _closing(self._parent._iterate()) as it:
            for i, element in enumerate(it):
                if i % self._num_shards == self._index:
                    yield element

    def _repr_node(self) -> str:
        return f"shard({self._num_shards}, {self._index})"


class _TakeDataset(_RowwiseDataset):
    def __init__(self, count: int | None):
        super().__init__()
        self._count = count

    def _on_blocks(self, parent: Iterator[Any]) -> Iterator[Any]:
        left = self._count
        with _closing(parent):
            if left == 0:
                return
            for block in parent:
                n = _rows(block)
                if left is not None and n >= left:
                    yield _slice(block, slice(0, left))
                    return
                yield block
                if left is not None:
                    left -= n

    def _on_elements(self) -> Iterator[Any]:
        if self._count == 0:
            return
        with _closing(self._parent._iterate()) as it:
            for i, element in enumerate(it, 1):
                yield element
                if self._count is not None and i >= self._count:
                    return


class _SkipDataset(_RowwiseDataset):
    def __init__(self, count: int):
        super().__init__()
        self._count = count

    def _on_blocks(self, parent: Iterator[Any]) -> Iterator[Any]:
        left = self._count
        with _closing(parent):
            for block in parent:
                n = _rows(block)
                if left >= n:
                    left -= n
                    continue
                yield _slice(block, slice(left, n)) if left else block
                left = 0

    def _on_elements(self) -> Iterator[Any]:
        with _closing(self._parent._iterate()) as it:
            for i, element in enumerate(it):
                if i >= self._count:
                    yield element


_ITEM, _ERROR, _END = "item", "error", "end"


def _put(q: "queue.Queue", item: tuple, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def _produce(source: Iterator[Any], q: "queue.Queue", stop: threading.Event) -> None:
    # A plain function (not a method) so the thread holds no reference to the consumer's iterator, which can
    # therefore be garbage-collected -- and its finaliser stop this thread.
    try:
        for element in source:
            if not _put(q, (_ITEM, element), stop):
                return
        _put(q, (_END, None), stop)
    except BaseException as err:  # noqa: BLE001 - handed to the consumer, which re-raises it
        _put(q, (_ERROR, err), stop)
    finally:
        _close(source)


class _PrefetchDataset(Dataset):
    def __init__(self, buffer_size: int):
        super().__init__()
        self._buffer_size = buffer_size

    def _iterate(self) -> Iterator[Any]:
        if self._buffer_size == 0:
            it = self._parent._iterate()
            try:
                yield from it
            finally:
                it.close()
            return
        q: queue.Queue = queue.Queue(maxsize=self._buffer_size)
        stop = threading.Event()
        thread = threading.Thread(
            target=_produce, args=(self._parent._iterate(), q, stop), name="kubeps-prefetch", daemon=True
        )
        thread.start()
        try:
            while True:
                kind, value = q.get()
                if kind is _ITEM:
                    yield value
                elif kind is _ERROR:
                    raise value
                else:
                    return
        finally:
            stop.set()
            while True:  # unblock a producer waiting on a full queue
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
            thread.join(PREFETCH_JOIN_TIMEOUT_S)

    def _repr_node(self) -> str:
        return f"prefetch({self._buffer_size})"


# -- readers ------------------------------------------------------------------------------------------------------
def read_lines(path: str) -> Iterator[str]:
    """Lines of a text file, without their line ending."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield line.rstrip("\r\n")


def read_csv(
    path: str, delimiter: str = ",", skip_header: bool = False, dtype: Any = np.float32
) -> Iterator[np.ndarray]:
    """One 1-D array per CSV row (``dtype`` float32 by default; ``dtype=str`` keeps the text)."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if (skip_header and lineno == 1) or not line:
                continue
            fields = line.split(delimiter)
            try:
                yield np.asarray(fields, dtype=dtype)
            except ValueError as err:
                raise ValueError(f"{path}:{lineno}: cannot read {fields!r} as {np.dtype(dtype)}: {err}") from None


def read_npy(path: str) -> Iterator[np.ndarray]:
    """Rows (axis-0 slices) of a ``.npy`` array, memory-mapped."""
    array = npyfiles.load(path, mmap_mode="r", allow_pickle=False)
    if array.ndim == 0:
        raise ValueError(f"{path}: holds a scalar; read_npy needs an array with at least one dimension")
    for i in range(array.shape[0]):
        yield np.array(array[i])


def read_npz(path: str) -> Iterator[dict[str, np.ndarray]]:
    """Rows of the arrays of a ``.npz`` file as ``{name: row}`` dicts (all arrays need the same row count)."""
    arrays = npyfiles.load_npz(path)
    yield from _TensorSlicesDataset(arrays)._iterate()


_READERS: dict[str, Callable[[str], Iterable[Any]]] = {
    "lines": read_lines,
    "csv": read_csv,
    "npy": read_npy,
    "npz": read_npz,
}


# -- auto-sharding ------------------------------------------------------------------------------------------------
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
    num_workers = _int_arg("num_workers", num_workers, 1)
    if isinstance(worker_index, bool) or not isinstance(worker_index, numbers.Integral) or not (
        0 <= worker_index < num_workers
    ):
        raise ValueError(
            f"argument `worker_index` must be an integer in 0..{num_workers - 1} (num_workers={num_workers}), "
            f"got {worker_index!r}"
        )
    policy = dataset._options.experimental_distribute.auto_shard_policy if policy is None else _as_policy(policy)
    if policy == AutoShardPolicy.AUTO:
        policy = AutoShardPolicy.FILE if dataset.is_file_based else AutoShardPolicy.DATA

    if policy == AutoShardPolicy.OFF:
        sharded = dataset
    elif policy == AutoShardPolicy.FILE:
        root = dataset._root()
        if not isinstance(root, _FileListDataset):
            raise ValueError(
                f"AutoShardPolicy.FILE needs a file-based dataset (Dataset.list_files, Dataset.from_files or "
                f"TextLineDataset), but this one reads from {dataset._describe_source()}; use AutoShardPolicy.DATA "
                f"to shard its elements or OFF to give every worker everything"
            )
        if len(root._files) < num_workers:
            raise ValueError(
                f"AutoShardPolicy.FILE: the dataset has {len(root._files)} file(s) for {num_workers} workers; "
                f"each worker needs at least one file (files: {root._files[:5]}{' ...' if len(root._files) > 5 else ''}); "
                f"use AutoShardPolicy.DATA or split the input into at least {num_workers} files"
            )
        sharded = dataset if num_workers == 1 else dataset._with_root(root._sharded(num_workers, int(worker_index)))
    else:  # DATA
        sharded = dataset if num_workers == 1 else dataset.shard(num_workers, int(worker_index))

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
