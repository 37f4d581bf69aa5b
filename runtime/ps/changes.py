"""Which rows of a parameter server's variable changed since a save: the dirty-row record incremental checkpoints
read.

Each variable (shard) carries a :class:`RowChanges`: a generation counter and, per row of axis 0, the generation
that last changed the row (``uint32``: 4 bytes a row, 1/16 of a float32 row of dim 16). Every write stamps the rows
it touches with the current generation; a snapshot for a save returns the generation it saw and starts the next one.
A save "since generation ``g``" then holds exactly the rows stamped above ``g``. A save that fails changes nothing a
later save relies on: the next one asks again since the last *committed* save's generation, so no change is lost
and no bitmap has to be put back.

``source`` names this record (a random id): a variable re-created or loaded from a checkpoint gets a new one, so a
delta is only ever taken against a save of the very same rows (a restarted ps, a restore, a re-created variable
make the next save a full one).
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np

__all__ = ["RowChanges", "snapshot_changes"]


class RowChanges:
    """The generation that last changed each row of one variable (see the module's docstring)."""

    def __init__(self, rows: int):
        self.source = uuid.uuid4().hex
        self.generation = 1
        self.stamps = np.zeros(max(rows, 1), dtype=np.uint32)

    def stamp(self, rows: np.ndarray | None) -> None:
        """Rows ``rows`` (local ids; None: every row) changed now."""
        if rows is None:
            self.stamps[:] = self.generation
        else:
            self.stamps[rows] = self.generation

    def changed_since(self, generation: int) -> np.ndarray:
        """The ids (ascending int64) of the rows changed after the snapshot of ``generation``."""
        return np.flatnonzero(self.stamps > generation).astype(np.int64, copy=False)

    def advance(self) -> int:
        """A snapshot: the generation it covers; later writes belong to the next one."""
        seen = self.generation
        self.generation += 1
        return seen


def snapshot_changes(var: Any, source: str | None, since: int | None) -> tuple[
        np.ndarray | None, np.ndarray, dict[str, dict[str, np.ndarray]], int, str, int]:
    """A consistent copy, under ``var``'s lock, of what a save of ``var`` (a
    :class:`~kubeps.runtime.ps.state.PSVariable`) writes: ``(ids, value rows, slot rows, updates, source,
    generation)``. ``ids`` is None for a full copy -- asked for (``since`` None), or the rows were not tracked since
    that save (another ``source``, a generation from the future), or every row changed; else the changed rows'
    ids, ascending, with only those rows copied."""
    with var.lock:
        changes: RowChanges = var.changes
        ids = None
        if source == changes.source and since is not None and 0 < since < changes.generation and var.value.ndim:
            ids = changes.changed_since(since)
            if ids.size == var.value.shape[0]:
                ids = None
        if ids is None:
            value = var.value.copy()
            slots = {okey: {s: np.array(a, copy=True) for s, a in group.items()} for okey, group in var.slots.items()}
        else:
            value = np.take(var.value, ids, axis=0)
            slots = {okey: {s: np.take(a, ids, axis=0) for s, a in group.items()} for okey, group in var.slots.items()}
        return ids, value, slots, var.updates, changes.source, changes.advance()
