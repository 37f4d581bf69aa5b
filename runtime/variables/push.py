"""Applying gradients: the transport behind ``Optimizer.apply_gradients``.

``apply_gradients(optimizer, grads_and_vars)`` groups the updates by parameter server into **one** ``Push`` per PS
carrying every dense gradient and every row-sparse gradient (:class:`IndexedSlices`) of the step; the PS runs the
optimizer update next to the variable, with the slots it keeps there. On the coordinator the pushes are sent at
once, in parallel. Inside a scheduled function they are handed to the closure context, and the next step's first
call to each PS carries them (``PushRead``; see :class:`kubeps.runtime.variables.context.ClosureContext`). A sharded
variable's gradient is split by shard: dense rows by the div split, sparse rows by the owner of each id.
Local variables (created outside ``strategy.scope()``) are updated in place in this process.

Several gradients of one variable in one call (a table two features read: a shared embedding) become one update, as
TensorFlow's optimizers do: row-sparse ones are concatenated (the optimizer sums duplicate rows before it applies
them), dense ones added; a table's rows travel in one update, never as two updates of the same rows.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from kubeps.runtime.variables import context as _context
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.variables.dynamic import DynamicEmbedding
from kubeps.runtime.variables.indexed_slices import IndexedSlices
from kubeps.runtime.variables.partitioners import owner_of
from kubeps.runtime.variables.variable import ShardedVariable, Variable, value_for
from kubeps.runtime.rpc.protocol import PS, PushRequest

__all__ = ["IndexedSlices", "apply_gradients"]  # IndexedSlices is defined in indexed_slices.py


def _check_dense(grad: Any, var: Variable | ShardedVariable) -> np.ndarray:
    g = value_for(grad, np.dtype(var.dtype), f"gradient of {var.name!r}", var.name)
    if g.shape != tuple(var.shape):
        raise RuntimeConfigError(f"gradient of {var.name!r}", f"array of shape {list(g.shape)}",
                                 f"must match the variable's shape {list(var.shape)}")
    return g


def _check_sparse(grad: IndexedSlices, var: Variable | ShardedVariable) -> tuple[np.ndarray, np.ndarray]:
    if len(var.shape) == 0:
        raise RuntimeConfigError(f"gradient of {var.name!r}", "IndexedSlices", "a scalar variable takes dense gradients")
    if tuple(grad.values.shape[1:]) != tuple(var.shape[1:]):
        raise RuntimeConfigError(f"gradient of {var.name!r}", f"rows of shape {list(grad.values.shape[1:])}",
                                 f"must match the variable's rows {list(var.shape[1:])}")
    idx = grad.indices.astype(np.int64, copy=False)
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= var.shape[0]):
        bad = int(idx.min()) if int(idx.min()) < 0 else int(idx.max())
        raise RuntimeConfigError(f"gradient of {var.name!r}", f"index {bad}", f"must be in [0, {var.shape[0]})")
    return idx, value_for(grad.values, np.dtype(var.dtype), f"gradient of {var.name!r} (IndexedSlices values)",
                          var.name)


def _identity(var: Any) -> Any:
    """What makes two handles one variable: a remote one's key (copies unpickled apart share it), else the object."""
    if isinstance(var, ShardedVariable):
        return tuple(_identity(v) for v in var.variables)
    if isinstance(var, (Variable, DynamicEmbedding)) and var.is_remote:
        return var.key
    return id(var)


def _sum_gradients(first: Any, second: Any) -> Any:
    """Two gradients of one variable as one: row-sparse ones concatenated (duplicate rows are summed by the
    optimizer's sparse update), dense ones added, a row-sparse one added into a dense one; None when their shapes
    disagree (each is then checked, and refused, on its own)."""
    if isinstance(first, IndexedSlices) and isinstance(second, IndexedSlices):
        return IndexedSlices(np.concatenate([np.asarray(first.values), np.asarray(second.values)]),
                             np.concatenate([np.asarray(first.indices), np.asarray(second.indices)]),
                             first.dense_shape or second.dense_shape)
    if isinstance(first, IndexedSlices):
        first, second = second, first
    total = np.array(first, copy=True)
    if not isinstance(second, IndexedSlices):
        part = np.asarray(second)
        if part.shape != total.shape:
            return None
        total += part.astype(total.dtype, copy=False)
        return total
    idx, values = np.asarray(second.indices), np.asarray(second.values)
    if total.ndim == 0 or values.shape[1:] != total.shape[1:] or (idx.size and not 0 <= idx.min() <= idx.max() < len(total)):
        return None
    np.add.at(total, idx, values.astype(total.dtype, copy=False))
    return total


def _one_gradient_per_variable(pairs: list[Any]) -> list[Any]:
    """``pairs`` with the gradients of a variable that occurs more than once summed into its first pair."""
    seen: dict[Any, int] = {}
    merged: list[Any] = []
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or pair[0] is None:
            merged.append(pair)  # refused or skipped below, as it is
            continue
        key = _identity(pair[1])
        if key not in seen:
            seen[key] = len(merged)
            merged.append(pair)
            continue
        at = seen[key]
        total = _sum_gradients(merged[at][0], pair[0])
        if total is None:
            merged.append(pair)
        else:
            merged[at] = (total, pair[1])
    return merged


def apply_gradients(optimizer: Any, grads_and_vars: Iterable[tuple[Any, Any]]) -> None:
    """Apply ``(gradient, variable)`` pairs: one ``Push`` RPC per parameter server for all of them.

    ``gradient`` is array-like (dense) or an :class:`IndexedSlices`; ``None`` gradients are skipped (as in TF).
    """
    pairs = _one_gradient_per_variable(list(grads_and_vars))
    config = None
    # (transport id) -> (transport, {ps: (updates, arrays)})
    batches: dict[int, tuple[Any, dict[int, tuple[list, list]]]] = {}
    touched: list[str] = []

    def add(var: Variable | DynamicEmbedding, grad: Any) -> None:
        nonlocal config
        if not var.is_remote:
            var.apply_local_update(optimizer, grad)
            return
        if config is None:
            config = optimizer.get_config()
        per_ps = batches.setdefault(id(var.transport), (var.transport, {}))[1]
        if isinstance(var, DynamicEmbedding):  # a table's keys go to the ps their hash names, one update per ps
            parts = [(ps, "dynamic", [keys, rows]) for ps, keys, rows in var.push_parts(grad)]
        else:
            assert var.ps_index is not None, "a remote variable has a ps index"
            parts = [(var.ps_index, "sparse", list(grad)) if isinstance(grad, tuple) else
                     (var.ps_index, "dense", [grad])]
        for ps, kind, tensors in parts:
            updates, arrays = per_ps.setdefault(ps, ([], []))
            updates.append({"name": var.key, "kind": kind})
            arrays.extend(tensors)
        touched.append(var.key)

    for i, pair in enumerate(pairs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise RuntimeConfigError(f"grads_and_vars[{i}]", pair, "must be a (gradient, variable) pair")
        grad, var = pair
        if grad is None:
            continue
        if isinstance(var, DynamicEmbedding):
            add(var, grad)
            continue
        if not isinstance(var, (Variable, ShardedVariable)):
            raise RuntimeConfigError(f"grads_and_vars[{i}][1]", type(var).__name__,
                                     "must be a kubeps Variable, ShardedVariable or DynamicEmbedding")
        if isinstance(grad, IndexedSlices):
            idx, values = _check_sparse(grad, var)
            if isinstance(var, ShardedVariable):
                shard, local = owner_of(idx, var.shape[0], var.num_shards) if idx.size else (idx, idx)
                for s, shard_var in enumerate(var.variables):
                    mask = shard == s
                    if mask.any():
                        add(shard_var, (local[mask], values[mask]))
            else:
                add(var, (idx, values))
        else:
            dense = _check_dense(grad, var)
            if isinstance(var, ShardedVariable):
                for (a, b), shard_var in zip(var.shard_rows(), var.variables):
                    add(shard_var, dense[a:b])
            else:
                add(var, dense)

    ctx = _context.current_closure_context()
    for transport, per_ps in batches.values():
        assert config is not None, "a batch is made by a remote update, which took the optimizer's config"
        requests = {ps: (PushRequest(optimizer=config, updates=updates), arrays) for ps, (updates, arrays) in per_ps.items()}
        if ctx is not None and ctx.transport is transport:
            ctx.defer_push(requests)
        else:
            transport.call_many({ps: (PS.PUSH, meta, arrays) for ps, (meta, arrays) in requests.items()})
            if ctx is not None:
                ctx.wrote()
    if ctx is not None and touched and not any(ctx.transport is t for t, _ in batches.values()):
        ctx.invalidate()
