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
from typing import Any, Iterator

import numpy as np

from kubeps.runtime.checkpoint.shards import Rows, SaveView

__all__ = ["CHUNK_BYTES", "RowChanges", "save_view"]


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


#: rows a full save copies at once under the variable's lock (a push waits for one chunk's copy, not the save)
CHUNK_BYTES = 32 << 20

def save_view(var: Any, source: str | None, since: int | None, chunk_bytes: int = CHUNK_BYTES) -> SaveView:
    """:class:`~kubeps.runtime.checkpoint.shards.SaveView` of ``var`` (a :class:`~kubeps.runtime.ps.state.PSVariable`): a delta of the rows changed
    since the save of ``(source, since)`` where that save was of these very rows, else a full save -- asked for
    (``since`` None), or the rows were not tracked since that save (another ``source``, a generation from the
    future), or every row changed."""
    with var.lock:
        changes: RowChanges = var.changes
        ids = None
        if source == changes.source and since is not None and 0 < since < changes.generation and var.value.ndim:
            ids = changes.changed_since(since)
            if ids.size == var.value.shape[0]:
                ids = None
        view = SaveView(updates=var.updates, source=changes.source, generation=changes.advance())
        if ids is not None:
            view.ids, view.value = ids, np.take(var.value, ids, axis=0)
            view.slots = {o: {s: np.take(a, ids, axis=0) for s, a in g.items()} for o, g in var.slots.items()}
            return view
        value, slots = var.value, {o: dict(g) for o, g in var.slots.items()}
    view.shape, view.dtype, view.slots = value.shape, value.dtype, slots
    rows = value.shape[0] if value.ndim else 1
    row_bytes = max(1, (value.nbytes // max(rows, 1)) * (1 + sum(len(g) for g in slots.values())))
    step = max(1, chunk_bytes // row_bytes)

    def chunks() -> Iterator[Rows]:
        for a in range(0, rows, step):
            with var.lock:
                if not value.ndim:
                    yield value.copy(), {o: {s: x.copy() for s, x in g.items()} for o, g in slots.items()}
                    return
                b = min(rows, a + step)
                part = value[a:b].copy(), {o: {s: x[a:b].copy() for s, x in g.items()} for o, g in slots.items()}
            yield part

    view.chunks = chunks
    return view
