"""Per-worker values, as TensorFlow's ``coordinator/values.py`` (split out of ``cluster_coordinator.py`` likewise):
:class:`PerWorkerValues` (one value per worker) and the per-worker resources a coordinator creates on every worker
-- :class:`PerWorkerDataset` and its :class:`PerWorkerIterator` -- which pickle as references that resolve, on a
worker, to that worker's own object.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Protocol

from kubeps.runtime.variables.context import resolve_resource

__all__ = ["PerWorkerDataset", "PerWorkerIterator", "PerWorkerValues", "ResourceCreator"]


class ResourceCreator(Protocol):
    """What a per-worker resource needs of its coordinator (:class:`~kubeps.runtime.ClusterCoordinator`)."""

    def create_per_worker_resource(self, creator: Callable[[], Any], kind: str, cls: type) -> Any:
        """Run ``creator`` on every worker; ``cls(coordinator, resource_id, PerWorkerValues)`` stands for it."""


def _make_iterator(dataset_id: str) -> Any:
    """Runs on a worker: a fresh iterator over the worker's dataset ``dataset_id``."""
    return iter(resolve_resource(dataset_id))


class PerWorkerValues:
    """One value per worker (TF's ``PerWorkerValues``); passed to ``schedule`` it resolves on the worker."""

    def __init__(self, values: tuple[Any, ...]):
        self._values = tuple(values)

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self):
        return iter(self._values)

    def __getitem__(self, i: int) -> Any:
        return self._values[i]


class _PerWorkerResource:
    """A resource built on every worker; pickles as a reference that resolves to the worker's own object."""

    def __init__(self, coordinator: ResourceCreator, resource_id: str, values: PerWorkerValues):
        self._coordinator = coordinator
        self._resource_id = resource_id
        self._values = values

    @property
    def resource_id(self) -> str:
        return self._resource_id

    def __reduce__(self):
        return (resolve_resource, (self._resource_id,))


class PerWorkerDataset(_PerWorkerResource):
    """The dataset ``dataset_fn`` built on every worker; ``iter()`` gives a :class:`PerWorkerIterator`."""

    def __iter__(self) -> "PerWorkerIterator":
        return self._coordinator.create_per_worker_resource(
            functools.partial(_make_iterator, self._resource_id), "iterator", PerWorkerIterator
        )

    def build(self) -> "PerWorkerDataset":
        return self


class PerWorkerIterator(_PerWorkerResource):
    """Stands for every worker's local iterator; pass it to ``schedule`` and call ``next()`` inside the function."""

    def __next__(self):
        raise TypeError(
            "next() on a per-worker iterator is not allowed on the coordinator: pass the iterator to "
            "coordinator.schedule(fn, args=(iterator,)) and call next(iterator) inside fn, on the worker"
        )

    def __iter__(self):
        return self

    get_next = __next__
