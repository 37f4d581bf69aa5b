"""Pooling a multi-hot feature: ids of shape ``(batch, L)`` padded with ``-1`` to ``(batch, dim)``, as TensorFlow's
``tf.nn.embedding_lookup_sparse`` and its feature columns' ``combiner`` do.

For row ``b`` with real (non-padding) positions ``j``, ids ``i_bj`` and weights ``w_bj`` (1 when none are given)::

    sum:    y_b = sum_j w_bj * e[i_bj]
    mean:   y_b = sum_j w_bj * e[i_bj] / sum_j w_bj
    sqrtn:  y_b = sum_j w_bj * e[i_bj] / sqrt(sum_j w_bj ** 2)

A zero denominator gives zeros (TensorFlow's ``div_no_nan``), so a row of padding alone pools to zeros. The pooling is
linear in the rows: ``y_b = sum_j c_bj * e[i_bj]`` with coefficients :func:`coefficients` (0 at padding), and the
gradient of row ``e[i]`` is ``sum over (b, j) with i_bj == i of c_bj * dy_b``: padding gets none.

Every function takes the array module (``numpy``, ``cupy`` or ``jax.numpy``), so ``nn`` (numpy/CuPy), the Keras
layer and the JAX path (traced) share one definition. Rule: pure array math, no I/O, nothing of the runtime but the
argument checks.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from kubeps.runtime.checks import check
from kubeps.runtime.errors import RuntimeConfigError

__all__ = ["COMBINERS", "PADDING", "Combiner", "check_combiner", "check_multi_hot", "coefficients", "pool"]

#: the id that marks an empty position of a multi-hot row
PADDING = -1
#: the combiners, as TensorFlow names them
COMBINERS = ("sum", "mean", "sqrtn")
Combiner = Literal["sum", "mean", "sqrtn"]


def check_combiner(combiner: Any, owner: str) -> str | None:
    """``combiner`` if it is one of :data:`COMBINERS` or None, else a refusal naming the allowed ones."""
    return check("combiner", combiner, Combiner | None, owner=owner,
                 allowed=f"one of {list(COMBINERS)}, or None (no pooling: one row per id)")


def check_multi_hot(ids_shape: tuple[Any, ...], ids_dtype: Any, weights: Any, owner: str) -> None:
    """Refuse ids that are not integers of shape ``(batch, L)``, and weights that are not floats of the ids' shape
    (shapes as the caller's arrays give them: a Keras symbolic batch size is None)."""
    if np.dtype(ids_dtype).kind not in "iu":
        raise RuntimeConfigError(f"{owner} ids", f"an array of dtype {np.dtype(ids_dtype)}", "integer ids")
    if len(ids_shape) != 2:
        raise RuntimeConfigError(f"{owner} ids", f"an array of shape {list(ids_shape)}",
                                 "shape (batch, L) with a combiner: L ids per example, padded with -1")
    if weights is None:
        return
    if tuple(weights.shape) != tuple(ids_shape):
        raise RuntimeConfigError(f"{owner} weights", f"an array of shape {list(weights.shape)}",
                                 f"the shape of the ids {list(ids_shape)} (one weight per id)")
    if np.dtype(weights.dtype).kind != "f":
        raise RuntimeConfigError(f"{owner} weights", f"an array of dtype {np.dtype(weights.dtype)}",
                                 "floating weights")


def coefficients(xp: Any, ids: Any, weights: Any, combiner: str, dtype: Any) -> Any:
    """``c`` of shape ``ids.shape`` with ``pooled[b] = sum_j c[b, j] * e[ids[b, j]]``: the weights (ones when None)
    divided by the row's denominator for ``combiner``, and 0 at padding and in a row whose denominator is 0."""
    real = ids != PADDING
    w = real.astype(dtype) if weights is None else xp.where(real, weights.astype(dtype), xp.zeros((), dtype=dtype))
    if combiner == "sum":
        return w
    denom = w.sum(axis=-1, keepdims=True) if combiner == "mean" else xp.sqrt((w * w).sum(axis=-1, keepdims=True))
    nonzero = denom != 0
    return xp.where(nonzero, w / xp.where(nonzero, denom, xp.ones((), dtype=dtype)), xp.zeros((), dtype=dtype))


def pool(rows: Any, coef: Any) -> Any:
    """``(batch, L, dim)`` rows (any value at padding: its coefficient is 0) pooled to ``(batch, dim)``."""
    return (rows * coef[..., None]).sum(axis=-2)
