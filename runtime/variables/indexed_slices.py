"""``IndexedSlices``: the row-sparse gradient value, as ``tf.IndexedSlices`` (TensorFlow keeps it low, in
``framework/indexed_slices.py``, for the same reason): layers produce it (:mod:`kubeps.runtime.ops.nn`), the optimizer
push sends it (:mod:`kubeps.runtime.variables.push`). A plain value type: numpy (or, on a GPU worker until the push, CuPy) arrays and a shape, no I/O.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kubeps.runtime.errors import RuntimeConfigError

__all__ = ["IndexedSlices"]


def _array(x: Any) -> Any:
    """A numpy array, or a CuPy array as it is (a GPU worker's gradient, moved to the host when it is pushed)."""
    return x if type(x).__module__.startswith("cupy") else np.asarray(x)


class IndexedSlices:
    """A row-sparse gradient, as ``tf.IndexedSlices``: rows ``values[i]`` belong to row ``indices[i]``."""

    def __init__(self, values: Any, indices: Any, dense_shape: Any = None):
        self.values = _array(values)
        self.indices = _array(indices)
        if self.indices.ndim != 1 or self.indices.dtype.kind not in "iu":
            raise RuntimeConfigError("indices", f"{self.indices.dtype} array of shape {list(self.indices.shape)}",
                                     "IndexedSlices indices must be a 1-D integer array")
        if self.values.ndim < 1 or self.values.shape[0] != self.indices.shape[0]:
            raise RuntimeConfigError("values", f"array of shape {list(self.values.shape)}",
                                     f"IndexedSlices needs one row per index ({self.indices.shape[0]})")
        self.dense_shape = tuple(dense_shape) if dense_shape is not None else None

    def __repr__(self) -> str:
        return f"IndexedSlices(values.shape={self.values.shape}, indices.shape={self.indices.shape})"
