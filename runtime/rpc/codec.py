"""The result codec of scheduled functions: a worker sends a function's result back as a pickled skeleton
(containers, scalars) in which every numpy array is replaced by a :class:`TensorRef` to a tensor of the wire frame,
so arrays travel as raw bytes, never pickled. The coordinator joins them back.

>>> import numpy as np
>>> tensors = []
>>> skeleton = split_structure({"loss": np.float32(1.5), "grad": np.ones(3)}, tensors)
>>> len(tensors), join_structure(skeleton, tensors)["grad"].tolist()
(1, [1.0, 1.0, 1.0])
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from kubeps.runtime.util import nest

__all__ = ["TensorRef", "join_structure", "split_structure"]


class TensorRef:
    """Stands for tensor ``index`` of the frame inside a pickled result skeleton."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __reduce__(self) -> tuple[type[TensorRef], tuple[int]]:
        return (TensorRef, (self.index,))


def split_structure(value: Any, tensors: list[np.ndarray], to_array: Callable[[Any], Any] | None = None) -> Any:
    """Replace every numpy array in nested lists/tuples/dicts by a :class:`TensorRef`, appending it to ``tensors``;
    ``to_array`` first turns other leaves that stand for arrays (a worker's variables) into arrays."""

    def leaf(item: Any) -> Any:
        if to_array is not None:
            item = to_array(item)
        if isinstance(item, np.ndarray) and item.dtype != object:
            tensors.append(item)
            return TensorRef(len(tensors) - 1)
        return item

    return nest.map_structure(leaf, value)


def join_structure(skeleton: Any, tensors: list[np.ndarray]) -> Any:
    """Inverse of :func:`split_structure` (arrays come back writable)."""

    def leaf(item: Any) -> Any:
        if isinstance(item, TensorRef):
            array = tensors[item.index]
            return array if array.flags.writeable else array.copy()
        return item

    return nest.map_structure(leaf, skeleton)
