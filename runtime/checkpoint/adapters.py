"""Checkpoint adapters for kubeps variables: a ``Variable`` or ``ShardedVariable`` becomes a :class:`Saveable`
whose shards are saved where they live (on their parameter servers, or in this process for local variables)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from kubeps.runtime.variables.variable import ShardedVariable, Variable
from kubeps.runtime.checkpoint.format import tensor_rows
from kubeps.runtime.checkpoint.saveables import LocalExecutor, PSExecutor, Saveable, ShardRef, register_saveable



# -- kubeps variables ------------------------------------------------------------------------------------------
class _LocalVariableAccess:
    """:class:`ShardAccess` over local :class:`~kubeps.runtime.variables.variable.Variable` objects (coordinator-side)."""

    def __init__(self):
        self.variables: dict[str, Any] = {}

    def snapshot(self, key):
        var = self.variables[key]
        value, optimizer_slots, updates = var.local_state()
        slots = {okey: {n: a.copy() for n, a in group.items()} for okey, group in optimizer_slots.items()}
        return value.copy(), slots, updates

    def describe(self, key):
        var = self.variables[key]
        value = var.local_state()[0]
        return value.shape, value.dtype

    def load(self, key, value, slots, updates):
        var = self.variables[key]
        array, optimizer_slots, _ = var.local_state()
        array[...] = value
        if updates is not None:
            var.set_local_updates(updates)
        if slots is not None:  # as a ps loads them: the next update with that optimizer class goes on from them
            optimizer_slots.clear()
            optimizer_slots.update({okey: {n: np.array(a, copy=True) for n, a in group.items()}
                                    for okey, group in slots.items()})


def _variable_shards(variables: Sequence[Any], rows: Sequence[tuple[int, int]]) -> list[ShardRef]:
    refs = []
    for var, (start, stop) in zip(variables, rows):
        if not var.is_remote:
            access = _LocalVariableAccess()
            access.variables[var.key] = var
            refs.append(ShardRef(start, stop, var.key, LocalExecutor(access)))
        else:
            refs.append(ShardRef(start, stop, var.key, PSExecutor(var.transport, var.ps_index)))
    return refs


def _variable_saveable(var: Any, path: str) -> list[Saveable]:
    rows = tensor_rows(var.shape)
    shards = _variable_shards([var], [(0, rows)]) if rows else []
    return [Saveable(path, tuple(var.shape), np.dtype(var.dtype), shards)]


def _sharded_saveable(var: Any, path: str) -> list[Saveable]:
    return [Saveable(path, tuple(var.shape), np.dtype(var.dtype), _variable_shards(var.variables, var.shard_rows()))]


def register_variable_adapters() -> None:
    """Teach checkpoints kubeps's ``Variable`` and ``ShardedVariable``."""
    register_saveable(Variable, _variable_saveable)
    register_saveable(ShardedVariable, _sharded_saveable)

