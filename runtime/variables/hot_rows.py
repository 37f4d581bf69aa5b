"""A worker's cache of an embedding table's hottest rows, refreshed within a bounded staleness.

The ids of a CTR table are heavy-tailed: a few thousand of a million rows make a large share of every batch's
lookups. :class:`HotRowCache` keeps those rows in the worker and pulls only the batch's other ids from the parameter
servers (HET, VLDB'22, measures the same idea). ``nn.Embedding(..., hot_rows=N, hot_refresh_steps=K)`` turns it on;
docs/kernels.md ("Hot rows cached on the worker") gives its semantics and figures:

* the hot set is the ``N`` ids this worker looked up most often (counts halved at every choice, so the set follows
  a distribution that drifts), chosen again every ``K`` lookups;
* a lookup pulls the batch's ids that are not in the hot set, and those in it whose row was pulled ``K`` or more
  lookups ago (or never), in the same calls (no extra round trip); the others are served from the cache. A hot row
  nobody looks up costs nothing;
* a cached row is served at most ``K - 1`` lookups of this worker after it was pulled: it lacks what every worker,
  this one included, pushed to it since. Gradients are pushed for every row as without the cache: the parameter
  servers stay the truth.

The caches live in the worker process, one per table and connection to the parameter servers
(:func:`cache_for`), so they outlive the scheduled functions whose pickled layers look rows up through them.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np

from kubeps.runtime.variables.variable import ShardedVariable, Variable, gather_unique_rows

__all__ = ["HotRowCache", "cache_for"]

#: when the hot set is chosen again, the counts of earlier windows weigh half as much as the last window's
_DECAY = 0.5
#: ids whose counts are kept between refreshes, per row of the cache: the candidates that may enter the hot set
_CANDIDATES_PER_ROW = 4


class HotRowCache:
    """The ``rows`` ids of one table this worker looks up most often (the set chosen again every ``refresh_steps``
    lookups) and their rows; a cached row served while younger than ``refresh_steps`` lookups, pulled again with
    the lookup that finds it older. Thread-safe (a lookup holds the cache while it pulls)."""

    def __init__(self, rows: int, refresh_steps: int) -> None:
        self.rows = rows
        self.refresh_steps = refresh_steps
        self._lock = threading.Lock()
        self._ids: np.ndarray = np.empty(0, dtype=np.int64)  # the hot set, sorted
        self._values: np.ndarray | None = None  # their rows (valid where pulled)
        self._pulled_at: np.ndarray = np.empty(0, dtype=np.int64)  # the lookup that pulled each (never: -refresh)
        self._candidates: np.ndarray = np.empty(0, dtype=np.int64)
        self._weights: np.ndarray = np.empty(0, dtype=np.float64)
        self._window: list[tuple[np.ndarray, np.ndarray]] = []  # (unique ids, counts) of each lookup since
        self._lookups = 0
        #: rows pulled from the parameter servers and rows served from the cache, over this cache's life
        self.pulled = 0
        self.served = 0

    def lookup(self, params: Variable | ShardedVariable, ids: np.ndarray) -> tuple[np.ndarray, int]:
        """``(params[ids], rows pulled for it)``; ``ids`` integers in ``[0, params.shape[0])``."""
        ids = np.asarray(ids)
        unique, inverse, counts = np.unique(ids.reshape(-1).astype(np.int64, copy=False), return_inverse=True,
                                            return_counts=True)
        with self._lock:
            self._window.append((unique, counts))
            if self._lookups % self.refresh_steps == 0:
                self._choose(params)
            rows, pulled = self._serve(params, unique)
            self._lookups += 1
            self.pulled += pulled
            self.served += unique.size - pulled
        out = np.take(rows, inverse, axis=0)
        return out.reshape(ids.shape + tuple(params.shape[1:])), pulled

    def _choose(self, params: Variable | ShardedVariable) -> None:
        """Choose the hot set again: the ids of the most weight, counting the lookups since the last choice and, at
        half weight, the candidates kept from before. Rows of ids that stay keep their age; the others are due."""
        seen = [self._candidates] + [u for u, _ in self._window]
        weights = [self._weights * _DECAY] + [c.astype(np.float64) for _, c in self._window]
        self._window.clear()
        ids, where = np.unique(np.concatenate(seen), return_inverse=True)
        total = np.bincount(where, weights=np.concatenate(weights), minlength=ids.size)
        order = np.argsort(-total, kind="stable")[: min(ids.size, self.rows * _CANDIDATES_PER_ROW)]
        self._candidates, self._weights = ids[order], total[order]
        hot = np.sort(self._candidates[: self.rows])
        values = np.empty((hot.size,) + tuple(params.shape[1:]), dtype=params.dtype)
        pulled_at = np.full(hot.size, -self.refresh_steps, dtype=np.int64)
        at, kept = self._find(hot)
        if self._values is not None and kept.any():
            values[kept], pulled_at[kept] = self._values[at[kept]], self._pulled_at[at[kept]]
        self._ids, self._values, self._pulled_at = hot, values, pulled_at

    def _find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(positions, found)``: where each of ``ids`` is in the hot set, and whether it is."""
        if not self._ids.size:
            return np.zeros(ids.size, dtype=np.int64), np.zeros(ids.size, dtype=bool)
        at = np.minimum(np.searchsorted(self._ids, ids), self._ids.size - 1)
        return at, self._ids[at] == ids

    def _serve(self, params: Variable | ShardedVariable, unique: np.ndarray) -> tuple[np.ndarray, int]:
        assert self._values is not None, "the first lookup chooses the hot set"
        at, hot = self._find(unique)
        fresh = hot.copy()
        fresh[hot] = self._lookups - self._pulled_at[at[hot]] < self.refresh_steps
        rows = np.empty((unique.size,) + tuple(params.shape[1:]), dtype=params.dtype)
        rows[fresh] = self._values[at[fresh]]
        due = ~fresh
        if due.any():
            pulled = gather_unique_rows(params, unique[due])[3]
            rows[due] = pulled
            renew = hot[due]  # hot ids pulled now: cached as of this lookup
            self._values[at[due][renew]] = pulled[renew]
            self._pulled_at[at[due][renew]] = self._lookups
        return rows, int(due.sum())


_registry_lock = threading.Lock()
#: connection to the parameter servers -> (table's shard keys, shape, dtype) -> its cache
_caches: "weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], HotRowCache]]" = weakref.WeakKeyDictionary()


def cache_for(params: Variable | ShardedVariable, rows: int, refresh_steps: int) -> HotRowCache | None:
    """This process's cache of ``params`` (made on first use; made again when ``rows`` or ``refresh_steps``
    change), or None for a table that lives in this process, whose rows need no pull."""
    shards = params.variables if isinstance(params, ShardedVariable) else [params]
    if not all(v.is_remote for v in shards):
        return None
    key = (tuple(v.key for v in shards), tuple(params.shape), params.dtype.str)
    with _registry_lock:
        per_transport = _caches.setdefault(shards[0].transport, {})
        cache = per_transport.get(key)
        if cache is None or (cache.rows, cache.refresh_steps) != (rows, refresh_steps):
            cache = per_transport[key] = HotRowCache(rows, refresh_steps)
        return cache
