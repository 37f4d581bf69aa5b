"""``CheckpointReader``: a checkpoint's variables read straight from its files, without parameter servers."""

from __future__ import annotations

from typing import Any

import numpy as np

from kubeps.runtime.util.storage import normalize_path, storage_for
from kubeps.runtime.checkpoint.format import (
    CheckpointMismatchError,
    DynamicTableEntry,
    TensorEntry,
    read_manifest,
    read_rows,
    short_listing,
    tensor_rows,
)
from kubeps.runtime.util.keyhash import to_keys


class CheckpointTable:
    """A dynamic embedding table as a checkpoint holds it: every shard's live rows, read from the files, sorted by
    key. :meth:`lookup` reads rows as an evaluation lookup does: ids without a row read the table's
    ``default_value``; nothing is counted or created."""

    def __init__(self, name: str, entry: DynamicTableEntry, keys: np.ndarray, values: np.ndarray,
                 freqs: np.ndarray, steps: np.ndarray):
        order = np.argsort(keys, kind="stable")
        self.name = name
        self.entry = entry
        self.dim = entry.dim
        self.dtype = np.dtype(entry.dtype)
        self.key_dtype = entry.key_dtype
        self.default_value = float(entry.config.get("default_value", 0.0))
        self.keys, self.values = keys[order], values[order]
        self.freqs, self.steps = freqs[order], steps[order]

    def __repr__(self) -> str:
        return f"<CheckpointTable {self.name!r} rows={self.keys.size} dim={self.dim} dtype={self.dtype.name}>"

    def size(self) -> int:
        return int(self.keys.size)

    def export(self, with_metadata: bool = False) -> tuple[np.ndarray, ...]:
        """``(keys, values)`` of every saved row (``+ (freqs, steps)``), sorted by key."""
        out = (self.keys, self.values)
        return out + (self.freqs, self.steps) if with_metadata else out

    def lookup(self, ids: Any, train: bool | None = None) -> np.ndarray:  # noqa: ARG002 - the table's signature
        """Rows for ``ids`` (any shape; strings hashed for a ``key_dtype="string"`` table): ``ids.shape + (dim,)``."""
        keys = to_keys(np.asarray(ids), "ids")
        flat = keys.reshape(-1)
        pos = np.searchsorted(self.keys, flat).clip(0, max(self.keys.size - 1, 0))
        found = self.keys[pos] == flat if self.keys.size else np.zeros(flat.size, dtype=bool)
        out = np.full((flat.size, self.dim), self.default_value, dtype=self.dtype)
        out[found] = self.values[pos[found]]
        return out.reshape(keys.shape + (self.dim,))


class CheckpointReader:
    """Reads a checkpoint directly from its files, whatever the number of shards it was saved with."""

    def __init__(self, path: str):
        self.path = normalize_path(path)
        self.storage = storage_for(self.path)
        self.manifest = read_manifest(self.path)

    @property
    def step(self) -> int | None:
        return self.manifest.step

    @property
    def final(self) -> bool:
        return self.manifest.final

    def names(self) -> list[str]:
        """The (fixed-shape) variables; :meth:`tables` lists the dynamic tables."""
        return sorted(self.manifest.variables)

    def tables(self) -> list[str]:
        """The dynamic embedding tables."""
        return sorted(self.manifest.dynamic)

    def table(self, name: str) -> CheckpointTable:
        """Dynamic table ``name``: every shard's live rows with their counts and last-update steps."""
        entry = self.manifest.dynamic.get(name)
        if entry is None:
            raise CheckpointMismatchError(
                f"dynamic table {name!r} is not in checkpoint {self.path}; it holds dynamic tables "
                f"{short_listing(self.manifest.dynamic)}"
            )
        parts: dict[str, list[np.ndarray]] = {"keys": [], "values": [], "freqs": [], "steps": []}
        for shard in entry.shards:
            for part in parts:
                t = getattr(shard, part)
                parts[part].append(read_rows(self.storage, self.path, t, 0, tensor_rows(t.shape),
                                             f"dynamic table {name!r} shard {shard.shard} {part}"))
        return CheckpointTable(name, entry, *(np.concatenate(parts[p]) for p in ("keys", "values", "freqs", "steps")))

    def objects(self) -> dict[str, Any]:
        return dict(self.manifest.objects)

    def _entry(self, name: str, optimizer: str | None, slot: str | None) -> TensorEntry:
        var = self.manifest.variables.get(name)
        if var is None and name in self.manifest.dynamic:
            raise CheckpointMismatchError(
                f"{name!r} in checkpoint {self.path} is a dynamic embedding table (rows by key, no fixed shape): "
                "read it with CheckpointReader.table(name)"
            )
        if var is None:
            raise CheckpointMismatchError(
                f"variable {name!r} is not in checkpoint {self.path}; it holds {short_listing(self.manifest.variables)}"
            )
        if slot is None:
            return var
        groups = [var.slots[optimizer]] if optimizer is not None and optimizer in var.slots else (
            list(var.slots.values()) if optimizer is None else [])
        found = [g[slot] for g in groups if slot in g]
        if len(found) != 1:
            have = sorted({s for g in var.slots.values() for s in g})
            raise CheckpointMismatchError(
                f"variable {name!r}: slot {slot!r} is {'ambiguous' if found else 'not'} in checkpoint {self.path} "
                f"(slots: {have or 'none'})"
            )
        return found[0]

    def get(self, name: str, slot: str | None = None, optimizer: str | None = None) -> np.ndarray:
        """The full value of variable ``name`` (or of one of its optimizer slots)."""
        entry = self._entry(name, optimizer, slot)
        what = f"variable {name!r}" + (f" slot {slot!r}" if slot else "")
        return read_rows(self.storage, self.path, entry, 0, tensor_rows(entry.shape), what)

    def get_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        return read_rows(self.storage, self.path, self._entry(name, None, None), start, stop, f"variable {name!r}")

    def values(self) -> dict[str, np.ndarray]:
        return {name: self.get(name) for name in self.names()}
