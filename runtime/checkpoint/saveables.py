"""The coordinator side of a checkpoint: where each shard of a logical variable lives (in this process or on a
parameter server), how other modules' types become checkpoint variables (:func:`register_saveable`), and the
:class:`StepCounter`."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import numpy as np
from kubeps.runtime.checkpoint.format import CheckpointMismatchError, SavedShard, parse_entry
from kubeps.runtime.checkpoint.shards import ShardAccess, restore_items, save_items
from kubeps.runtime.rpc.protocol import PS, RestoreItem, RestoreShardsRequest, SaveItem, SaveShardsRequest
from kubeps.runtime.rpc.transport import PSTransport



# -- the coordinator side: which objects a checkpoint holds ----------------------------------------------------
class ShardExecutor(Protocol):
    """Runs save/restore items where the shards live: in this process, or on one parameter server."""

    label: str

    def save(self, directory: str, items: list[SaveItem]) -> list[SavedShard]: ...

    def restore(self, directory: str, items: list[RestoreItem]) -> int: ...


class ArrayAccess:
    """:class:`ShardAccess` over local numpy arrays (restored in place)."""

    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}
        self.slots: dict[str, dict[str, dict[str, np.ndarray]]] = {}
        self.updates: dict[str, int] = {}

    def snapshot(self, key):
        return np.array(self.arrays[key], copy=True), self.slots.get(key, {}), self.updates.get(key, 0)

    def describe(self, key):
        return self.arrays[key].shape, self.arrays[key].dtype

    def load(self, key, value, slots, updates):
        self.arrays[key][...] = value
        if slots:
            self.slots[key] = slots
        if updates is not None:
            self.updates[key] = updates


class LocalExecutor:
    """Saves and restores shards held in this process."""

    label = "local"

    def __init__(self, access: ShardAccess):
        self.access = access

    def save(self, directory, items):
        return save_items(self.access, directory, items)

    def restore(self, directory, items):
        return restore_items(self.access, directory, items)


class PSExecutor:
    """Sends save/restore items to one parameter server through a PS transport (``call(ps, method, meta, ...)``)."""

    def __init__(self, transport: PSTransport, ps_index: int, timeout: float | None = 600.0):
        self.transport = transport
        self.ps_index = ps_index
        self.timeout = timeout
        self.label = f"/job:ps/task:{ps_index}"
        self.group_key = ("ps", id(transport), ps_index)

    def save(self, directory: str, items: list[SaveItem]) -> list[SavedShard]:
        request: SaveShardsRequest = {"directory": directory, "items": items}
        meta, _ = self.transport.call(self.ps_index, PS.SAVE_SHARDS, request, (), self.timeout)
        return [parse_entry(SavedShard, s, f"saved[{i}]") for i, s in enumerate(meta["saved"])]

    def restore(self, directory: str, items: list[RestoreItem]) -> int:
        request: RestoreShardsRequest = {"directory": directory, "items": items}
        meta, _ = self.transport.call(self.ps_index, PS.RESTORE_SHARDS, request, (), self.timeout)
        return meta["restored"]


def group_key(executor: ShardExecutor) -> Any:
    """Shards of one executor (one parameter server) travel in one request."""
    return getattr(executor, "group_key", None) or id(executor)


@dataclass
class ShardRef:
    """One shard of a logical variable: rows ``start..stop-1``, held as ``key`` by ``executor``."""

    start: int
    stop: int
    key: str
    executor: ShardExecutor


@dataclass
class Saveable:
    """A logical variable as a checkpoint sees it."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    shards: list[ShardRef] = field(default_factory=list)


#: ``type -> fn(obj, name) -> list[Saveable]``: how objects of other modules become checkpoint variables.
SAVEABLE_ADAPTERS: dict[type, Callable[[Any, str], list[Saveable]]] = {}


def register_saveable(cls: type, adapter: Callable[[Any, str], list[Saveable]]) -> None:
    """Teach checkpoints a variable type: ``adapter(obj, name)`` returns its :class:`Saveable` parts."""
    SAVEABLE_ADAPTERS[cls] = adapter


class StepCounter:
    """A thread-safe integer (the training step) that checkpoints save and restore."""

    def __init__(self, value: int = 0):
        self._value = int(value)
        self._lock = threading.Lock()

    @property
    def value(self) -> int:
        return self._value

    def numpy(self) -> int:
        return self._value

    def __int__(self) -> int:
        return self._value

    def __index__(self) -> int:
        return self._value

    def __repr__(self) -> str:
        return f"StepCounter({self._value})"

    def assign(self, value: int) -> int:
        with self._lock:
            self._value = int(value)
            return self._value

    def assign_add(self, delta: int = 1) -> int:
        with self._lock:
            self._value += int(delta)
            return self._value

    def get_state(self) -> dict[str, int]:
        return {"value": self._value}

    def set_state(self, state: Mapping[str, Any]) -> None:
        value = state.get("value") if isinstance(state, Mapping) else None
        if not isinstance(value, int) or isinstance(value, bool):
            raise CheckpointMismatchError(f"step counter state {state!r} has no integer 'value'")
        self.assign(value)
