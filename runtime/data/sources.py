"""The sources a pipeline starts from, as nodes: arrays (``from_tensor_slices``, ``from_tensors``), ``range``, a
generator function, any Python iterable, and a list of files (``list_files``: the only file-based source, the one
``AutoShardPolicy.FILE`` splits between workers)."""

from __future__ import annotations

import copy
import glob
import os
import secrets
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from kubeps.runtime.checks import check, integer
from kubeps.runtime.data.filesystems import glob_url, is_url
from kubeps.runtime.data.node import Node
from kubeps.runtime.data.structure import BLOCK_ROWS, as_arrays, close, closing, map_leaves, slice_leaves
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.util import nest


class TensorSlicesNode(Node):
    def __init__(self, tensors: Any):
        super().__init__()
        structure = as_arrays(tensors)
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

    def iterate(self) -> Iterator[Any]:
        for i in range(self._rows):
            yield slice_leaves(self._structure, i)

    def blocks(self) -> Iterator[Any]:
        if self._rows:
            yield self._structure  # one block of views: slicing it downstream copies nothing

    def describe(self) -> str:
        return f"from_tensor_slices({self._rows} rows)"


class TensorsNode(Node):
    def __init__(self, tensors: Any):
        super().__init__()
        self._structure = as_arrays(tensors)

    def iterate(self) -> Iterator[Any]:
        yield self._structure

    def blocks(self) -> Iterator[Any]:
        yield map_leaves(lambda a: np.asarray(a)[np.newaxis], self._structure)


class RangeNode(Node):
    def __init__(self, *args: int):
        super().__init__()
        if not 1 <= len(args) <= 3:
            raise TypeError(f"Dataset.range takes 1 to 3 integers (stop | start, stop[, step]), got {len(args)}")
        for a in args:
            check("range argument", a, integer(ge=-(2**63), allowed="an integer"))
        self._range = range(*args)

    def iterate(self) -> Iterator[Any]:
        for i in self._range:
            yield np.int64(i)

    def blocks(self) -> Iterator[Any]:
        r = self._range
        for k in range(0, len(r), BLOCK_ROWS):
            part = r[k : k + BLOCK_ROWS]
            yield np.arange(part.start, part.stop, part.step, dtype=np.int64)

    def describe(self) -> str:
        return repr(self._range)


class GeneratorNode(Node):
    def __init__(self, generator: Callable[..., Iterable[Any]], args: tuple):
        super().__init__()
        if not callable(generator):
            hint = " (pass the generator function, not a generator object)" if hasattr(generator, "__next__") else ""
            raise RuntimeConfigError("generator", type(generator).__name__, f"a callable{hint}")
        self._generator = generator
        self._args = args

    def iterate(self) -> Iterator[Any]:
        with closing(iter(self._generator(*self._args))) as it:
            yield from it


class IterableNode(Node):
    def __init__(self, iterable: Iterable[Any]):
        super().__init__()
        try:
            first = iter(iterable)
        except TypeError:
            raise TypeError(f"from_iterable needs an iterable, got {type(iterable).__name__}") from None
        self._iterable = iterable
        self._one_shot = first is iterable  # a Dataset gives a new iterator each time: re-iterable
        self._passes = 0

    def iterate(self) -> Iterator[Any]:
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
                close(it)


def _expand_patterns(file_pattern: Any) -> tuple[list[str], list[str]]:
    if isinstance(file_pattern, (str, os.PathLike)):
        patterns = [os.fspath(file_pattern)]
    else:
        try:
            patterns = [os.fspath(p) for p in file_pattern]
        except TypeError:
            raise RuntimeConfigError("file_pattern", file_pattern, "a path/glob pattern or a list of them") from None
    if not patterns:
        raise RuntimeConfigError("file_pattern", file_pattern, "at least one path or glob pattern")
    files: list[str] = []
    seen: set[str] = set()
    for pattern in patterns:
        if is_url(pattern):  # s3://, gs://, hdfs://...: listed by fsspec, sorted, files only
            matches = glob_url(pattern)
        else:
            matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else ([pattern] if os.path.exists(pattern) else [])
            matches = [m for m in matches if not os.path.isdir(m)]
        if not matches:
            raise ValueError(f"No files matched pattern: {pattern}")
        for m in matches:
            if m not in seen:
                seen.add(m)
                files.append(m)
    return files, patterns


class FileListNode(Node):
    def __init__(self, file_pattern: Any, shuffle: bool, seed: int | None):
        super().__init__()
        self._files, self._patterns = _expand_patterns(file_pattern)
        if seed is not None:
            seed = check("seed", seed, integer(ge=0, allowed="None or an integer >= 0"))
        self._shuffle = shuffle
        self._seed = seed if seed is not None else secrets.randbits(63)
        self._passes = 0

    @property
    def files(self) -> list[str]:
        """The matched files, sorted, before any shuffle."""
        return list(self._files)

    def sharded(self, num_workers: int, worker_index: int) -> FileListNode:
        """This worker's files, ``files[worker_index::num_workers]`` (AutoShardPolicy.FILE)."""
        clone = copy.copy(self)
        clone._files = self._files[worker_index::num_workers]
        clone._passes = 0
        return clone

    def iterate(self) -> Iterator[Any]:
        files = self._files
        if self._shuffle:
            rng = np.random.default_rng([self._seed, self._passes])
            self._passes += 1
            files = [files[i] for i in rng.permutation(len(files))]
        yield from files

    def describe(self) -> str:
        return f"list_files({len(self._files)} files)"
