"""Array kernels for training: one backend switch (numpy or CuPy) and the math workers and PS tasks run.

Backend selection (``backend()``):

* ``KUBEPS_DEVICE=cpu``  -> numpy, always (the task's settings, :mod:`kubeps.runtime.settings`, parse the variable).
* ``KUBEPS_DEVICE=gpu``  -> CuPy; if CuPy is not importable or no GPU is visible this raises
  ``DeviceUnavailableError`` instead of silently running on the CPU.
* unset / empty          -> CuPy when it is importable and a GPU is visible, numpy otherwise.

Every kernel takes the array module from its inputs (``array_module(x)``), so the same function serves numpy
arrays on a PS and CuPy arrays on a GPU worker.

Placement (where a worker's ``nn`` layers compute): :func:`use_device` resolves the task's setting once when a worker
starts (a GPU that is asked for and absent raises :class:`DeviceUnavailableError` there, never later) and caps CuPy's
memory pool at the task's share of the GPU (``KUBEPS_GPU_TASKS``); :func:`compute_module` is then the module the
layers compute with. :func:`to_device` moves several host arrays to it in **one** transfer (packed into one buffer),
:func:`to_host` moves several device arrays back in one transfer. A task that never calls :func:`use_device` (a
ps, the chief) computes with numpy and never touches a GPU. This module sits low in the runtime's layers: of the rest of
``kubeps.runtime`` it imports only the pod contract and the task's settings (:mod:`kubeps.runtime.settings`).
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import numpy as np

from kubeps.runtime import contract
from kubeps.runtime.settings import TaskSettings

__all__ = [
    "DEVICE_ENV",
    "DeviceUnavailableError",
    "array_module",
    "backend",
    "compute_module",
    "device_description",
    "memory_share",
    "to_device",
    "to_host",
    "use_device",
    "backend_name",
    "cupy_available",
    "embedding_gather",
    "reduce_sparse",
    "set_rows",
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

DEVICE_ENV = contract.DEVICE_ENV


class DeviceUnavailableError(RuntimeError):
    """The requested device (``KUBEPS_DEVICE=gpu``) cannot be used on this machine."""


# --------------------------------------------------------------------------------------------------------------
# Backend selection
# --------------------------------------------------------------------------------------------------------------


def _import_cupy() -> ModuleType | None:
    try:
        import cupy  # noqa: PLC0415 - optional: the `gpu` extra
    except Exception:  # noqa: BLE001 - ImportError, or a CUDA library error raised at import time
        return None
    return cupy


def _gpu_count(cupy: ModuleType) -> int:
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no driver, or a driver error, means no GPU
        return 0


def cupy_available() -> tuple[bool, str]:
    """``(True, "")`` when CuPy imports and sees a GPU, else ``(False, reason)``."""
    cupy = _import_cupy()
    if cupy is None:
        return False, "CuPy is not installed (pip install 'kubeps[gpu]')"
    if _gpu_count(cupy) < 1:
        return False, "CuPy is installed but no CUDA GPU is visible"
    return True, ""


def backend_name(settings: TaskSettings) -> str:
    """The backend the task's settings ask for (``settings.device``): ``"numpy"`` or ``"cupy"``. Raises if gpu is
    forced but absent."""
    wanted = settings.device
    if wanted == "cpu":
        return "numpy"
    ok, reason = cupy_available()
    if wanted == "gpu":
        if not ok:
            raise DeviceUnavailableError(f"{DEVICE_ENV}=gpu was requested but {reason}; set {DEVICE_ENV}=cpu to run on the CPU")
        return "cupy"
    return "cupy" if ok else "numpy"


def backend(settings: TaskSettings) -> ModuleType:
    """The array module to create new arrays with: numpy or cupy (see module docstring)."""
    if backend_name(settings) == "cupy":
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


# --------------------------------------------------------------------------------------------------------------
# Placement: the device a worker's layers compute on, and batched transfers
# --------------------------------------------------------------------------------------------------------------

#: the part of a GPU's memory the GPU tasks on it share between them (the rest: the driver, fragmentation)
GPU_MEMORY_USABLE = 0.9
_compute: ModuleType = np
_description = "CPU (numpy)"
#: byte alignment of each array inside a packed transfer buffer (any dtype's alignment divides it)
_ALIGN = 256


def memory_share(settings: TaskSettings) -> float:
    """The fraction of its GPU's memory one GPU task may use: ``GPU_MEMORY_USABLE / KUBEPS_GPU_TASKS``."""
    return GPU_MEMORY_USABLE / settings.gpu_tasks


def use_device(settings: TaskSettings) -> str:
    """Resolve where this process's layers compute (once, when a worker starts) and say it in words.

    ``KUBEPS_DEVICE=gpu`` without a usable GPU raises :class:`DeviceUnavailableError` naming the reason. On a GPU,
    CuPy's default memory pool is capped at :func:`memory_share` of the device, so ``KUBEPS_GPU_TASKS`` processes
    fit on one GPU."""
    global _compute, _description
    if backend_name(settings) == "numpy":
        _compute, _description = np, "CPU (numpy)"
        return _description
    cupy = _import_cupy()
    assert cupy is not None, "backend_name said cupy"
    share = memory_share(settings)
    total = int(cupy.cuda.runtime.memGetInfo()[1])
    cupy.get_default_memory_pool().set_limit(size=int(total * share))
    device = cupy.cuda.Device()
    name = cupy.cuda.runtime.getDeviceProperties(device.id)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    _compute = cupy
    _description = (f"GPU {device.id} ({name}, {total / 2**30:.0f} GiB; CuPy {cupy.__version__}, memory pool limit "
                    f"{share:.0%} = {total * share / 2**30:.1f} GiB for {settings.gpu_tasks} GPU task(s))")
    return _description


def compute_module() -> ModuleType:
    """The array module this process's layers compute with: cupy after :func:`use_device` chose a GPU, else
    numpy."""
    return _compute


def device_description() -> str:
    """Where this process's layers compute, in words (what a worker logs when it starts)."""
    return _description


def _is_device(x: Any) -> bool:
    return type(x).__module__.startswith("cupy")


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def to_device(*arrays: Any) -> tuple[Any, ...]:
    """The host arrays among ``arrays`` on the compute device (:func:`compute_module`), copied in one transfer:
    packed into one host buffer, moved once, viewed back as arrays of their dtypes and shapes. Arrays already on
    the device, and everything on a CPU task, are returned as they are."""
    if _compute is np:
        return tuple(arrays)
    host = [i for i, a in enumerate(arrays) if not _is_device(a)]
    if not host:
        return tuple(arrays)
    items = [np.asarray(arrays[i], order="C") for i in host]  # ascontiguousarray would make a 0-d array 1-d
    offsets, total = [], 0
    for a in items:
        offsets.append(total)
        total += _aligned(a.nbytes)
    buffer = np.empty(max(total, 1), np.uint8)
    for a, off in zip(items, offsets):
        buffer[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
    moved = _compute.asarray(buffer)  # the one host-to-device copy
    out = list(arrays)
    for i, a, off in zip(host, items, offsets):
        out[i] = moved[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    return tuple(out)


def to_host(arrays: Any) -> list[Any]:
    """``arrays`` with every device array copied to a host numpy array, all in one transfer (packed on the device
    into one buffer, copied once); host arrays are returned as they are."""
    arrays = list(arrays)
    dev = [i for i, a in enumerate(arrays) if _is_device(a)]
    if not dev:
        return arrays
    cupy = _import_cupy()
    assert cupy is not None, "a CuPy array exists"
    offsets, total = [], 0
    for i in dev:
        offsets.append(total)
        total += _aligned(arrays[i].nbytes)
    packed = cupy.empty(max(total, 1), cupy.uint8)
    for i, off in zip(dev, offsets):
        a = cupy.ascontiguousarray(arrays[i])
        packed[off:off + a.nbytes] = a.reshape(-1).view(cupy.uint8)
    host = packed.get()  # the one device-to-host copy
    for i, off in zip(dev, offsets):
        a = arrays[i]
        arrays[i] = host[off:off + a.nbytes].view(np.dtype(a.dtype)).reshape(a.shape)
    return arrays


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


def set_rows(table: Any, ids: Any, rows: Any) -> None:
    """``table[ids] = rows`` for 1-D in-range ``ids`` and ``rows`` shaped ``(len(ids),) + table.shape[1:]``.

    On numpy, with both arrays C-contiguous and of one dtype, each row is written as one opaque item (``np.put``
    on a view of the rows as ``void`` items): a fancy-index assignment of row blocks copies element by element,
    1.6x the time for 4,700 rows of 64 floats and 2.7x for 1,400 rows of 16. Anything else is the plain assignment."""
    row_items = math.prod(table.shape[1:]) if table.ndim >= 2 else 0
    if (array_module(table, rows) is np and row_items and table.flags.c_contiguous and rows.flags.c_contiguous
            and rows.dtype == table.dtype and rows.shape == (len(ids),) + table.shape[1:]):
        item = np.dtype((np.void, table.dtype.itemsize * row_items))
        np.put(table.reshape(table.shape[0], row_items).view(item).reshape(table.shape[0]), ids,
               rows.reshape(rows.shape[0], row_items).view(item).reshape(rows.shape[0]))
    else:
        table[ids] = rows


def reduce_sparse(indices: Any, values: Any) -> tuple[Any, Any]:
    """Sum the rows of ``values`` that share an index: returns ``(unique_ids, summed_values)``, ids ascending.

    ``indices`` is 1-D (length n), ``values`` has shape ``(n, ...)``. Vectorised, no Python loop per row:

    1. one argsort of the ids; segment starts where the sorted id changes; ``unique_ids`` = first of each segment;
    2. the output starts as the first row of every segment (one gather);
    3. the second and third occurrences are added by their rank inside the segment: all second occurrences in one
       fancy-index ``+=`` (no two of them hit the same output row, so it is exact), then all third occurrences;
    4. the rows left (the fourth occurrence on, in the few segments that long) are summed per segment by one
       ``np.add.reduceat`` over just those rows, and added.

    ``np.add.reduceat`` over every segment pays a per-segment cost for each of the thousands of ids that occur once or
    twice; level passes cost one pass per multiplicity, and a popular id can occur hundreds of times in a batch. The
    mix is 2-3x faster than either on the CTR benchmark's batches (see docs/kernels.md).
    Indices already strictly ascending (what a worker's push carries: it summed them before sending) are returned
    as they are, with ``values`` uncopied, after one O(n) check.
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
    if n == 1 or bool((indices[1:] > indices[:-1]).all()):  # already unique and ascending (a worker's push)
        return indices.astype(xp.int64, copy=False), values
    order = xp.argsort(indices)
    sorted_ids = indices[order]
    new_segment = sorted_ids[1:] != sorted_ids[:-1]
    starts = xp.concatenate([xp.zeros(1, dtype=xp.int64), xp.nonzero(new_segment)[0].astype(xp.int64) + 1])
    unique_ids = sorted_ids[starts].astype(xp.int64, copy=False)
    if starts.shape[0] == n:  # no duplicates
        return unique_ids, xp.take(values, order, axis=0)
    segment = xp.concatenate([xp.zeros(1, dtype=xp.int64), xp.cumsum(new_segment, dtype=xp.int64)])
    if xp is not np:  # CuPy: one atomic scatter-add kernel is the fast path on a GPU
        summed = xp.zeros((starts.shape[0],) + tuple(values.shape[1:]), dtype=values.dtype)
        xp.add.at(summed, segment, xp.take(values, order, axis=0))
        return unique_ids, summed
    rank = np.arange(n, dtype=np.int64) - starts[segment]  # 0 for the first row of a segment
    later = np.nonzero(rank)[0]
    rank, seg, src = rank[later], segment[later], order[later]
    summed = np.take(values, order[starts], axis=0)
    for level in range(1, _RANK_PASSES + 1):
        if not rank.size:
            break
        hit = rank == level
        summed[seg[hit]] += np.take(values, src[hit], axis=0)
        rest = ~hit
        rank, seg, src = rank[rest], seg[rest], src[rest]
    if rank.size:  # the rest of the long segments; still in sorted order, so each segment's rows are adjacent
        first = np.concatenate([np.zeros(1, dtype=np.int64), np.nonzero(seg[1:] != seg[:-1])[0] + 1])
        summed[seg[first]] += np.add.reduceat(np.take(values, src, axis=0), first, axis=0)
    return unique_ids, summed


#: occurrences of an id added by level passes before the rest of its rows are summed by ``np.add.reduceat``
#: (2: fastest on the CTR batches, 512 x 8 ids of width 16 and 2048 x 8 of width 64; see docs/kernels.md)
_RANK_PASSES = 2


# --------------------------------------------------------------------------------------------------------------
# Dense layers and activations
# --------------------------------------------------------------------------------------------------------------


def dense_forward(x: Any, w: Any, b: Any = None) -> Any:
    """``x @ w + b`` for ``x`` of shape ``(batch, in)``, ``w`` ``(in, out)``, ``b`` ``(out,)`` or None."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"dense_forward: x {tuple(x.shape)} @ w {tuple(w.shape)}; allowed: x (batch, n), w (n, m)")
    y = x @ w
    if b is not None:
        if tuple(b.shape) != (w.shape[1],):
            raise ValueError(f"dense_forward: b has shape {tuple(b.shape)}; expected ({w.shape[1]},)")
        y += b
    return y


def dense_backward(x: Any, w: Any, dy: Any, with_bias: bool = True) -> tuple[Any, Any, Any]:
    """Gradients of ``y = x @ w + b``: returns ``(dx, dw, db)`` (``db`` is None without a bias)."""
    if tuple(dy.shape) != (x.shape[0], w.shape[1]):
        raise ValueError(f"dense_backward: dy has shape {tuple(dy.shape)}; expected {(x.shape[0], w.shape[1])}")
    dx = dy @ w.T
    dw = x.T @ dy
    db = dy.sum(axis=0) if with_bias else None
    return dx, dw, db


def relu(x: Any) -> Any:
    xp = array_module(x)
    return xp.maximum(x, 0)


def relu_grad(x: Any, dy: Any) -> Any:
    """``d relu(x) / dx * dy`` (0 at ``x == 0``, as TF)."""
    return dy * (x > 0)


def sigmoid(x: Any) -> Any:
    """Overflow-free logistic function: ``exp`` only of non-positive numbers."""
    xp = array_module(x)
    e = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(x.dtype, copy=False)


def sigmoid_grad(y: Any, dy: Any) -> Any:
    """Given ``y = sigmoid(x)``: ``dy * y * (1 - y)``."""
    return dy * y * (1.0 - y)


def tanh(x: Any) -> Any:
    return array_module(x).tanh(x)


def tanh_grad(y: Any, dy: Any) -> Any:
    """Given ``y = tanh(x)``: ``dy * (1 - y ** 2)``."""
    return dy * (1.0 - y * y)


# --------------------------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------------------------


def _check_same_shape(fn: str, logits: Any, labels: Any) -> None:
    if tuple(logits.shape) != tuple(labels.shape):
        raise ValueError(f"{fn}: labels has shape {tuple(labels.shape)}; expected the logits' shape "
                         f"{tuple(logits.shape)}")


def sigmoid_cross_entropy_with_logits(logits: Any, labels: Any) -> Any:
    """Element-wise ``-z log sigmoid(x) - (1 - z) log(1 - sigmoid(x))``, computed as TF does without overflow:
    ``max(x, 0) - x z + log1p(exp(-|x|))``."""
    _check_same_shape("sigmoid_cross_entropy_with_logits", logits, labels)
    xp = array_module(logits)
    return xp.maximum(logits, 0) - logits * labels + xp.log1p(xp.exp(-xp.abs(logits)))


def sigmoid_cross_entropy_with_logits_grad(logits: Any, labels: Any) -> Any:
    """d/dlogits of the element-wise loss: ``sigmoid(x) - z``."""
    _check_same_shape("sigmoid_cross_entropy_with_logits_grad", logits, labels)
    return sigmoid(logits) - labels


def softmax(logits: Any, axis: int = -1) -> Any:
    xp = array_module(logits)
    shifted = logits - logits.max(axis=axis, keepdims=True)
    e = xp.exp(shifted)
    return e / e.sum(axis=axis, keepdims=True)


def softmax_cross_entropy_with_logits(logits: Any, labels: Any) -> Any:
    """Per-example ``-sum(labels * log_softmax(logits))`` over the last axis (labels: probability rows)."""
    _check_same_shape("softmax_cross_entropy_with_logits", logits, labels)
    xp = array_module(logits)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_z = xp.log(xp.exp(shifted).sum(axis=-1, keepdims=True))
    return -(labels * (shifted - log_z)).sum(axis=-1)


def softmax_cross_entropy_with_logits_grad(logits: Any, labels: Any) -> Any:
    """d/dlogits of the per-example loss: ``softmax(logits) * sum(labels) - labels``."""
    _check_same_shape("softmax_cross_entropy_with_logits_grad", logits, labels)
    return softmax(logits) * labels.sum(axis=-1, keepdims=True) - labels


# --------------------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------------------


def auc(labels: Any, scores: Any) -> float:
    """ROC AUC by ranks (Mann-Whitney U): the probability that a random positive outscores a random negative,
    ties counted as one half (tied scores share their average rank). Labels must be 0/1 with both present."""
    y = to_numpy(labels).ravel()
    s = to_numpy(scores).ravel().astype(np.float64)
    if y.shape != s.shape:
        raise ValueError(f"auc: labels has {y.size} values, scores has {s.size}; they must match")
    if not np.all((y == 0) | (y == 1)):
        raise ValueError("auc: labels must be 0 or 1")
    if np.isnan(s).any():
        raise ValueError("auc: scores contain NaN")
    pos = int(y.sum())
    neg = y.size - pos
    if pos == 0 or neg == 0:
        raise ValueError(f"auc: needs both classes, got {pos} positives and {neg} negatives")
    order = np.argsort(s, kind="stable")
    sorted_s = s[order]
    starts = np.concatenate([[0], np.nonzero(sorted_s[1:] != sorted_s[:-1])[0] + 1])
    ends = np.concatenate([starts[1:], [s.size]])
    avg_rank = (starts + ends + 1) / 2.0  # 1-based average rank of each tie group
    ranks = np.empty(s.size)
    ranks[order] = np.repeat(avg_rank, ends - starts)
    u = ranks[y == 1].sum() - pos * (pos + 1) / 2.0
    return float(u / (pos * neg))
