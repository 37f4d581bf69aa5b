"""Elements and blocks: the helpers every pipeline node shares.

An element is a numpy array (or a Python value) nested in tuples and dicts, walked with
:mod:`kubeps.runtime.util.nest` (lists are leaves, as in ``tf.data``). A *block* is many consecutive elements as
one structure of arrays whose leading axis runs over them; nodes that pass blocks on let ``batch`` cut batches with
array slicing instead of a Python step per element. Also here: calling a user function on an element as
``tf.data`` does, and closing the input iterator of a pass however it ends.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from kubeps.runtime.util import nest


# -- nested structures --------------------------------------------------------------------------------------------
def _describe(x: Any) -> str:
    if isinstance(x, Mapping):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in x.items()) + "}"
    if isinstance(x, tuple):
        return "(" + ", ".join(_describe(v) for v in x) + ")"
    arr = np.asarray(x)
    return f"array{arr.shape}:{arr.dtype}"


def stack(elements: Sequence[Any]) -> Any:
    """Stack a list of same-structured elements leaf by leaf into numpy arrays with a new leading axis."""
    first = elements[0]
    if isinstance(first, Mapping):
        for e in elements:
            if not isinstance(e, Mapping) or set(e) != set(first):
                raise ValueError(
                    f"batch: elements have different structures: {_describe(first)} and {_describe(e)}"
                )
        return {k: stack([e[k] for e in elements]) for k in first}
    if isinstance(first, tuple):
        for e in elements:
            if not isinstance(e, tuple) or len(e) != len(first):
                raise ValueError(
                    f"batch: elements have different structures: {_describe(first)} and {_describe(e)}"
                )
        parts = [stack([e[i] for e in elements]) for i in range(len(first))]
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


def slice_leaves(structure: Any, index: Any) -> Any:
    """Every leaf indexed with ``index`` (an element of a block, or a run of them)."""
    return nest.map_structure(operator.itemgetter(index), structure, lists=False)


def as_arrays(structure: Any) -> Any:
    return nest.map_structure(np.asarray, structure, lists=False)


def call(fn: Callable, element: Any) -> Any:
    """Call ``fn`` on an element as ``tf.data`` does: a (non-named) tuple is unpacked into positional arguments."""
    if isinstance(element, tuple) and not nest.is_namedtuple(element):
        return fn(*element)
    return fn(element)


def close(it: Any) -> None:
    """``it.close()`` where ``it`` has one (a generator, a dataset iterator); nothing for a plain iterator."""
    method = getattr(it, "close", None)
    if method is not None:
        method()


@contextlib.contextmanager
def closing(it: Iterator[Any]) -> Iterator[Iterator[Any]]:
    """``with closing(self.parent.iterate()) as it``: the input iterator is closed however this node's pass ends
    (exhausted, an error, or the consumer closing this node's generator)."""
    try:
        yield it
    finally:
        close(it)


# -- blocks: many consecutive elements as one structure of arrays with a leading axis ---------------------------
#: rows a shuffle processes per vectorised step, and a range source per block
BLOCK_ROWS = 4096


def map_leaves(fn: Callable[..., Any], first: Any, *rest: Any) -> Any:
    """``fn`` applied leaf by leaf to same-structured elements, keeping the structure (lists are leaves)."""
    leaves = zip(*(nest.flatten(s, lists=False) for s in (first, *rest)))
    return nest.pack(first, [fn(*group) for group in leaves], lists=False)


def num_rows(block: Any) -> int:
    """Elements in a block (the leading dimension of its leaves)."""
    return int(nest.first_leaf(block, lists=False).shape[0])


def rows_of(element: Any) -> int:
    """How many records a batch a user's pipeline made holds: its first tensor's leading dimension, 1 where it has
    no tensor or a scalar one (:func:`num_rows` is for blocks, which always have one)."""
    try:
        shape = getattr(nest.first_leaf(element), "shape", None)
    except IndexError:
        return 1
    return int(shape[0]) if shape else 1


def concat(blocks: Sequence[Any]) -> Any:
    return blocks[0] if len(blocks) == 1 else map_leaves(lambda *leaves: np.concatenate(leaves), *blocks)


def unblock(blocks: Iterator[Any]) -> Iterator[Any]:
    """The elements of blocks, one by one (what an element-wise consumer of a block-wise node sees)."""
    with closing(blocks):
        for block in blocks:
            for i in range(num_rows(block)):
                yield slice_leaves(block, i)

