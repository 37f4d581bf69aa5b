"""``CheckpointReader``: a checkpoint's variables read straight from its files, without parameter servers."""

from __future__ import annotations

from typing import Any

import numpy as np

from kubeps.runtime.util.storage import normalize_path, storage_for
from kubeps.runtime.checkpoint.format import CheckpointMismatchError, TensorEntry, read_manifest, read_rows, short_listing, tensor_rows


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
        return sorted(self.manifest.variables)

    def objects(self) -> dict[str, Any]:
        return dict(self.manifest.objects)

    def _entry(self, name: str, optimizer: str | None, slot: str | None) -> TensorEntry:
        var = self.manifest.variables.get(name)
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
