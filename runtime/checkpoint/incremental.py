"""Incremental checkpoints, the chief's side: which shards a save asks only for their changed rows, and since which
save; how a shard's delta joins the chain of files it extends; which checkpoints a kept one still needs.

A parameter server records which rows of each shard changed since each save (:mod:`kubeps.runtime.ps.changes`).
A save of a :class:`~kubeps.runtime.checkpoint.manager.CheckpointManager` made with ``incremental=True`` asks each
shard for the rows changed since the newest committed checkpoint (its *parent*); the shard's slice in the new
manifest is then the parent's -- its base file, in the checkpoint that wrote it, and its deltas -- with one more
delta: the changed rows' ids and values (and slot rows), in the new checkpoint's directory. Restore reads the base,
then applies the deltas in order (:func:`~kubeps.runtime.checkpoint.format.read_rows`).

A shard is saved in full instead (a new base: the chain is compacted by that save) when

* the parent holds no slice of exactly its rows saved with a change record of this ps (a first save, a restarted or
  restored ps, another partitioning, a plain save before);
* its chain holds :attr:`IncrementalPolicy.max_deltas` deltas, or its deltas' bytes passed
  :attr:`IncrementalPolicy.compact_fraction` of its base's: restore time stays bounded;
* its chain names a checkpoint the save's ``max_to_keep`` sweep deletes: a kept checkpoint never needs a deleted one;
* its optimizer slots are not the parent's (a new optimizer's slots are a change of every row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from kubeps.runtime.checks import Fraction, PositiveInt, check
from kubeps.runtime.checkpoint.format import (DeltaEntry, Manifest, SavedDelta, SavedShard, SliceEntry,
                                              TensorEntry, VariableEntry)
from kubeps.runtime.rpc.protocol import SaveSince

__all__ = ["IncrementalPolicy", "IncrementalSave", "referenced_checkpoints"]


@dataclass(frozen=True)
class IncrementalPolicy:
    """When a shard's chain of deltas is compacted into a new base (saved in full)."""

    #: the most deltas a slice's chain holds
    max_deltas: int = 8
    #: the deltas' bytes, as a fraction of the base's, past which the next save is a full one
    compact_fraction: float = 0.5

    def __post_init__(self) -> None:
        check("max_deltas", self.max_deltas, PositiveInt, owner="IncrementalPolicy")
        check("compact_fraction", self.compact_fraction, Fraction, owner="IncrementalPolicy")


def _chain(entry: SliceEntry, parent_number: int) -> set[int]:
    """The checkpoints whose files ``entry`` (a slice of checkpoint ``parent_number``) is read from."""
    base = parent_number if entry.checkpoint is None else entry.checkpoint
    return {base, *(d.checkpoint for d in entry.deltas)}


def referenced_checkpoints(manifest: Manifest, number: int) -> set[int]:
    """The other checkpoints whose files checkpoint ``number`` (its ``manifest``) reads."""
    out: set[int] = set()
    for var in manifest.variables.values():
        for tensor in [var, *(t for g in var.slots.values() for t in g.values())]:
            for s in tensor.slices:
                out |= _chain(s, number)
    out.discard(number)
    return out


class IncrementalSave:
    """One incremental save: its number, its parent (the newest committed checkpoint and its manifest, or none), the
    checkpoints that remain after it (None: all) and the policy."""

    def __init__(self, number: int, parent: tuple[int, Manifest] | None, keep: Iterable[int] | None,
                 policy: IncrementalPolicy):
        self.number = number
        self.parent_number: int = parent[0] if parent is not None else -1
        self.parent: Manifest | None = parent[1] if parent is not None else None
        self.keep = None if keep is None else set(keep)
        self.policy = policy

    def _slice(self, tensor: TensorEntry | None, start: int, stop: int) -> SliceEntry | None:
        if tensor is None:
            return None
        return next((s for s in tensor.slices if (s.start, s.stop) == (start, stop)), None)

    def _variable(self, name: str) -> VariableEntry | None:
        return None if self.parent is None else self.parent.variables.get(name)

    def since(self, name: str, start: int, stop: int) -> SaveSince | None:
        """The save shard ``start..stop-1`` of ``name`` is to be a delta against, or None for a full save."""
        entry = self._slice(self._variable(name), start, stop)
        if entry is None or not entry.source or entry.generation < 1:
            return None
        if len(entry.deltas) >= self.policy.max_deltas or \
                sum(d.nbytes for d in entry.deltas) > self.policy.compact_fraction * entry.nbytes:
            return None
        if self.keep is not None and not _chain(entry, self.parent_number) <= self.keep:
            return None
        return {"source": entry.source, "generation": entry.generation}

    def _extend(self, parent: SliceEntry, delta: SavedDelta, file: tuple[str, str, int] | None,
                tracked: bool) -> SliceEntry:
        deltas = list(parent.deltas)
        if delta.rows and file is not None and delta.ids is not None:
            deltas.append(DeltaEntry(checkpoint=self.number, rows=delta.rows, ids_file=delta.ids[0],
                                     ids_sha256=delta.ids[1], ids_nbytes=delta.ids[2], file=file[0], sha256=file[1],
                                     nbytes=file[2]))
        base = self.parent_number if parent.checkpoint is None else parent.checkpoint
        update: dict[str, object] = {"checkpoint": base, "deltas": deltas}
        if tracked:
            update.update(updates=delta.updates, source=delta.source, generation=delta.generation)
        return parent.model_copy(update=update)

    def resolve(self, name: str, saved: SavedShard, start: int, stop: int) -> SavedShard | None:
        """``saved`` as a full shard's answer -- a delta joined to its parent's chain -- or None where the delta
        does not fit the parent (other slots): the shard is then saved again, in full."""
        delta = saved.delta
        if delta is None:
            return saved
        var = self._variable(name)
        parent = self._slice(var, start, stop)
        if var is None or parent is None:
            return None
        slots: dict[str, dict[str, tuple[SliceEntry, str, list[int]]]] = {}
        for okey, group in var.slots.items():
            for sname, tensor in group.items():
                part = self._slice(tensor, start, stop)
                file = delta.slots.get(okey, {}).get(sname)
                if part is None or (delta.rows and file is None):
                    return None
                slots.setdefault(okey, {})[sname] = (self._extend(part, delta, file, False), tensor.dtype,
                                                     tensor.shape[1:])
        if delta.rows and {(o, n) for o, g in delta.slots.items() for n in g} != \
                {(o, n) for o, g in var.slots.items() for n in g}:
            return None
        value = self._extend(parent, delta, delta.value, True)
        return SavedShard(key=saved.key, value=value, dtype=var.dtype, slots=slots)
