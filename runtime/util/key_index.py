"""``KeyIndex``: an int64 key -> row map as an open-addressing hash table in numpy arrays, probed for a whole batch
of keys at once; ``RowIndex``: the same map over keys its owner already keeps in an array, storing only rows.

Why not a ``dict``: a Python dict costs about 100 bytes per entry (the entry, an int object for the key, one for
the row) and a Python-level loop per key; this table costs 12 bytes per slot (an int64 key, an int32 row) at a load
of at most :data:`MAX_LOAD`, and a lookup of a batch is a few vectorised passes (linear probing: each pass moves the
keys not yet resolved one slot on). Slots are found by :func:`~kubeps.runtime.util.keyhash.mix64` with
:data:`~kubeps.runtime.util.keyhash.INDEX_SEED`, so sequential keys do not cluster.

A :class:`RowIndex` indexes the rows of an owner that keeps each row's key in an array of its own (a dynamic table's
``keys``): a slot holds only the row (4 bytes), and a probe compares the key it looks for with the owner's key of the
slot's row. That halves what the index costs beside the rows it indexes (12 bytes a slot -> 4).

A removed key leaves a tombstone (lookups probe past it, inserts reuse it); the table is rebuilt without tombstones
when live keys and tombstones together pass the load bound. Not thread-safe: its owner holds a lock.
"""

from __future__ import annotations

import numpy as np

from kubeps.runtime.util.keyhash import INDEX_SEED, mix64

__all__ = ["MAX_LOAD", "KeyIndex", "RowIndex"]

#: the largest share of slots holding a key or a tombstone
MAX_LOAD = 0.7
_EMPTY = -1
_TOMB = -2


class KeyIndex:
    """Maps int64 keys to non-negative int32 rows."""

    def __init__(self, expected: int = 0):
        self._alloc(_slots_for(expected))
        self.live = 0

    def _alloc(self, slots: int) -> None:
        self._keys = np.zeros(slots, dtype=np.int64)
        self._rows = np.full(slots, _EMPTY, dtype=np.int32)
        self._mask = np.uint64(slots - 1)
        self._used = 0  # live keys and tombstones

    @property
    def nbytes(self) -> int:
        return int(self._keys.nbytes + self._rows.nbytes)

    # where a slot's key is: in the index here, in the owner's array in RowIndex
    def _slot_keys(self, pos: np.ndarray, rows: np.ndarray) -> np.ndarray:  # noqa: ARG002 - RowIndex reads rows
        return self._keys[pos]

    def _set_keys(self, slots: np.ndarray, keys: np.ndarray) -> None:
        self._keys[slots] = keys

    def __len__(self) -> int:
        return self.live

    def _start(self, keys: np.ndarray) -> np.ndarray:
        return (mix64(keys, INDEX_SEED) & self._mask).astype(np.int64)

    def _find(self, keys: np.ndarray) -> np.ndarray:
        """The slot holding each key, or -1."""
        out = np.full(keys.size, -1, dtype=np.int64)
        active = np.arange(keys.size)
        pos = self._start(keys)
        mask = int(self._mask)
        while active.size:
            rows = self._rows[pos]
            hit = (rows >= 0) & (self._slot_keys(pos, rows) == keys[active])
            out[active[hit]] = pos[hit]
            more = (rows != _EMPTY) & ~hit
            active = active[more]
            pos = (pos[more] + 1) & mask
        return out

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """The row of each key, or -1 where the key is absent (int64 array)."""
        keys = np.asarray(keys, dtype=np.int64)
        slots = self._find(keys)
        found = slots >= 0
        out = np.full(keys.size, -1, dtype=np.int64)
        out[found] = self._rows[slots[found]]
        return out

    def insert(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Add keys that are absent and distinct, with their rows."""
        keys = np.asarray(keys, dtype=np.int64)
        rows = np.asarray(rows, dtype=np.int32)
        if not keys.size:
            return
        if self._used + keys.size > MAX_LOAD * self._rows.size:
            self._rebuild(self.live + keys.size)
        active = np.arange(keys.size)
        pos = self._start(keys)
        mask = int(self._mask)
        while active.size:
            free = np.flatnonzero(self._rows[pos] < 0)  # empty or a tombstone
            slots, first = np.unique(pos[free], return_index=True)  # one key per free slot this pass
            winners = active[free[first]]
            self._used += int(np.count_nonzero(self._rows[slots] == _EMPTY))
            self._set_keys(slots, keys[winners])
            self._rows[slots] = rows[winners]
            placed = np.zeros(active.size, dtype=bool)
            placed[free[first]] = True
            active = active[~placed]
            pos = (pos[~placed] + 1) & mask
        self.live += keys.size

    def update(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Give keys that are present new rows."""
        slots = self._find(np.asarray(keys, dtype=np.int64))
        self._rows[slots] = np.asarray(rows, dtype=np.int32)

    def remove(self, keys: np.ndarray) -> None:
        """Remove keys that are present."""
        slots = self._find(np.asarray(keys, dtype=np.int64))
        slots = slots[slots >= 0]
        self._rows[slots] = _TOMB
        self.live -= slots.size

    def clear(self) -> None:
        self._alloc(_slots_for(0))
        self.live = 0

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """``(keys, rows)`` of every live key, in slot order."""
        live = self._rows >= 0
        rows = self._rows[live]
        return self._slot_keys(np.flatnonzero(live), rows).copy(), rows.astype(np.int64)

    def _rebuild(self, expected: int) -> None:
        keys, rows = self.items()
        self._alloc(_slots_for(expected))
        self.live = 0
        self.insert(keys, rows)


class RowIndex(KeyIndex):
    """Maps the keys in an owner's array ``store`` to their rows (``store[row] == key``), holding only the rows.

    The owner writes a row's key into ``store`` before it inserts the key, re-points :attr:`store` when it
    reallocates the array, and keeps a moved key's old row in ``store`` until :meth:`update` gave it its new row.
    """

    def __init__(self, store: np.ndarray, expected: int = 0):
        self.store = store
        super().__init__(expected)

    def _alloc(self, slots: int) -> None:
        self._rows = np.full(slots, _EMPTY, dtype=np.int32)
        self._mask = np.uint64(slots - 1)
        self._used = 0

    @property
    def nbytes(self) -> int:
        return int(self._rows.nbytes)

    def _slot_keys(self, pos: np.ndarray, rows: np.ndarray) -> np.ndarray:  # noqa: ARG002 - the rows say it
        if self.store.size < 2:
            return self.store[np.maximum(rows, 0)] if self.store.size else np.zeros(rows.size, dtype=np.int64)
        # empty slots (-1) and tombstones (-2) index from the end: some key, never a hit (rows >= 0 is required)
        return self.store[rows]

    def _set_keys(self, slots: np.ndarray, keys: np.ndarray) -> None:
        pass  # the owner holds them


def _slots_for(expected: int) -> int:
    slots = 64
    while expected > MAX_LOAD * slots * 0.75:  # leave room: a rebuild is not due at once
        slots *= 2
    return slots
