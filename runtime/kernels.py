"""Array kernels for training: one backend switch (numpy or CuPy) and the math workers and PS tasks run.

Backend selection (``backend()``):

* ``KUBEPS_DEVICE=cpu``  -> numpy, always.
* ``KUBEPS_DEVICE=gpu``  -> CuPy; if CuPy is not importable or no GPU is visible this raises
  ``DeviceUnavailableError`` instead of silently running on the CPU.
* unset / empty          -> CuPy when it is importable and a GPU is visible, numpy otherwise.

Every kernel takes the array module from its inputs (``array_module(x)``), so the same function serves numpy
arrays on a PS and CuPy arrays on a GPU worker. This module sits at the bottom of the runtime's layers: it imports
nothing from the rest of ``kubeps.runtime``.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "DEVICE_ENV",
    "DeviceUnavailableError",
    "IndexedSlices",
    "array_module",
    "backend",
    "backend_name",
    "cupy_available",
    "embedding_gather",
    "reduce_sparse",
    "dense_forward",
    "dense_backward",
    "relu",
    "relu_grad",
    "sigmoid",
    "sigmoid_grad",
    "tanh",
    "tanh_grad",
    "sigmoid_cross_entropy_with_logits",
    "sigmoid_cross_entropy_with_logits_grad",
    "softmax",
    "softmax_cross_entropy_with_logits",
    "softmax_cross_entropy_with_logits_grad",
    "auc",
    "to_numpy",
]

DEVICE_ENV = "KUBEPS_DEVICE"
_DEVICE_CHOICES = ("cpu", "gpu")


class DeviceUnavailableError(RuntimeError):
    """The requested device (``KUBEPS_DEVICE=gpu``) cannot be used on this machine."""


class IndexedSlices(NamedTuple):
    """A row-sparse gradient: ``values[k]`` is the gradient of row ``indices[k]`` of the variable.

    It is a plain ``(values, indices)`` tuple, so ``values, ids = grad`` works. ``indices`` may repeat; consumers
    sum duplicates with ``reduce_sparse`` before applying.
    """

    values: Any
    indices: Any


# --------------------------------------------------------------------------------------------------------------
# Backend selection
# --------------------------------------------------------------------------------------------------------------


def _import_cupy() -> ModuleType | None:
    try:
        import cupy  # type: ignore[import-not-found]
    except Exception:  # ImportError, or a CUDA library error raised at import time
        return None
    return cupy


def _gpu_count(cupy: ModuleType) -> int:
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def cupy_available() -> tuple[bool, str]:
    """``(True, "")`` when CuPy imports and sees a GPU, else ``(False, reason)``."""
    cupy = _import_cupy()
    if cupy is None:
        return False, "CuPy is not installed (pip install 'kubeps[gpu]')"
    if _gpu_count(cupy) < 1:
        return False, "CuPy is installed but no CUDA GPU is visible"
    return True, ""


def backend_name(env: dict[str, str] | None = None) -> str:
    """The backend the environment asks for: ``"numpy"`` or ``"cupy"``. Raises if gpu is forced but absent."""
    environ = os.environ if env is None else env
    raw = environ.get(DEVICE_ENV, "")
    wanted = raw.strip().lower()
    if wanted not in ("",) + _DEVICE_CHOICES:
        raise ValueError(f"{DEVICE_ENV}={raw!r} is not a device; allowed: 'cpu', 'gpu' or unset (auto)")
    if wanted == "cpu":
        return "numpy"
    ok, reason = cupy_available()
    if wanted == "gpu":
        if not ok:
            raise DeviceUnavailableError(f"{DEVICE_ENV}=gpu was requested but {reason}; set {DEVICE_ENV}=cpu to run on the CPU")
        return "cupy"
    return "cupy" if ok else "numpy"


def backend(env: dict[str, str] | None = None) -> ModuleType:
    """The array module to create new arrays with: numpy or cupy (see module docstring)."""
    if backend_name(env) == "cupy":
        cupy = _import_cupy()
        assert cupy is not None
        return cupy
    return np


def array_module(*arrays: Any) -> ModuleType:
    """numpy, or cupy if any argument is a CuPy array (CuPy's own ``get_array_module`` rule)."""
    for a in arrays:
        mod = type(a).__module__
        if mod.startswith("cupy"):
            cupy = _import_cupy()
            assert cupy is not None
            return cupy
    return np


def to_numpy(x: Any) -> np.ndarray:
    """A host numpy array for ``x`` (copies from the GPU when ``x`` is a CuPy array)."""
    if type(x).__module__.startswith("cupy"):
        return x.get()
    return np.asarray(x)


# --------------------------------------------------------------------------------------------------------------
# Embeddings and row-sparse gradients
# --------------------------------------------------------------------------------------------------------------


def _check_ids(xp: ModuleType, ids: Any, num_rows: int, what: str) -> Any:
    ids = xp.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integer row ids, got dtype {ids.dtype}")
    if ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_rows:
            bad = lo if lo < 0 else hi
            raise IndexError(f"{what} contains row id {bad}; allowed: 0 <= id < {num_rows}")
    return ids.astype(xp.int64, copy=False)


def embedding_gather(table: Any, ids: Any) -> Any:
    """Rows ``table[ids]`` for ids of any shape; result shape ``ids.shape + table.shape[1:]``."""
    xp = array_module(table, ids)
    if table.ndim < 1:
        raise ValueError(f"table must have rank >= 1, got shape {tuple(table.shape)}")
    ids = _check_ids(xp, ids, table.shape[0], "ids")
    return xp.take(table, ids, axis=0)


def reduce_sparse(indices: Any, values: Any) -> tuple[Any, Any]:
    """Sum the rows of ``values`` that share an index: returns ``(unique_ids, summed_values)``, ids ascending.

    ``indices`` is 1-D (length n), ``values`` has shape ``(n, ...)``. Vectorised: one stable argsort, then a
    segment sum (``np.add.reduceat``) over the sorted order; no Python loop per row. When there are no duplicates
    it only reorders.
    """
    xp = array_module(indices, values)
    indices = xp.asarray(indices)
    values = xp.asarray(values)
    if indices.ndim != 1:
        raise ValueError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
    if indices.dtype.kind not in "iu":
        raise TypeError(f"indices must be integer row ids, got dtype {indices.dtype}")
    if values.ndim < 1 or values.shape[0] != indices.shape[0]:
        raise ValueError(
            f"values must have shape (len(indices), ...) = ({indices.shape[0]}, ...), got {tuple(values.shape)}"
        )
    n = indices.shape[0]
    if n == 0:
        return indices.astype(xp.int64), values
    order = xp.argsort(indices, kind="stable") if xp is np else xp.argsort(indices)
    sorted_ids = indices[order]
    new_segment = sorted_ids[1:] != sorted_ids[:-1]
    starts = xp.concatenate([xp.zeros(1, dtype=xp.int64), xp.nonzero(new_segment)[0].astype(xp.int64) + 1])
    unique_ids = sorted_ids[starts].astype(xp.int64, copy=False)
    sorted_values = values[order]
    if starts.shape[0] == n:  # no duplicates
        return unique_ids, sorted_values
    if xp is np:
        summed = np.add.reduceat(sorted_values, starts, axis=0)
    else:  # CuPy has no ufunc.reduceat: scatter-add the sorted rows into their segment
        segment = xp.cumsum(xp.concatenate([xp.zeros(1, dtype=xp.int64), new_segment.astype(xp.int64)]))
        summed = xp.zeros((starts.shape[0],) + tuple(values.shape[1:]), dtype=values.dtype)
        xp.add.at(summed, segment, sorted_values)
    return unique_ids, summed
