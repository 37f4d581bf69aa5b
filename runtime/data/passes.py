"""Where a per-worker iterator stands in its pass over the data: the records a reshard makes read again.

When the membership changes, every worker builds its dataset again for the new count and reads its new shard from
the start (:mod:`kubeps.runtime.coordinator.cluster_coordinator`). The records it had taken in the pass then under way
are read a second time in the new pass, by whichever worker's new shard holds them. A :class:`PassLedger` counts
them: a worker's iterator reports the rows of every element it hands to a function (:meth:`PassLedger.consumed`),
and the ``repeat`` of its pipeline (the one nearest the consumer) says where each pass starts, counted in the same records.
Both sides count *records*: one per element of an unbatched pipeline, the rows of a batch (its first tensor's leading
dimension) of a batched one, the rows of a block where ``repeat`` works on blocks.

The producer runs ahead of the consumer (``prefetch``), so a pass may start on the producer's side while the consumer
still takes the previous one: the ledger keeps the starts the consumer has not reached. A pipeline with no
``repeat`` is one pass, the iterator's life; an iterator that ended has no pass under way.
"""

from __future__ import annotations

import contextvars
import threading
from collections import deque

__all__ = ["PassLedger", "current"]

_CURRENT: contextvars.ContextVar["PassLedger | None"] = contextvars.ContextVar("kubeps_pass_ledger", default=None)


def current() -> "PassLedger | None":
    """The ledger of the iterator being built or advanced in this thread, if any."""
    return _CURRENT.get()


class _Active:
    """``with ledger.active():`` -- a plain class: it is entered on every batch a worker hands out."""

    __slots__ = ("_ledger", "_token")

    def __init__(self, ledger: "PassLedger"):
        self._ledger = ledger

    def __enter__(self) -> "PassLedger":
        self._token = _CURRENT.set(self._ledger)
        return self._ledger

    def __exit__(self, *exc: object) -> None:
        _CURRENT.reset(self._token)


class PassLedger:
    """The records one iterator handed out, and where its passes start (both in records)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.batched = True  #: whether the consumer's elements are batches (set when the pipeline is opened)
        self._consumed = 0
        self._produced = 0
        self._starts: deque[int] = deque([0])  # pass starts, first the one the consumer is in
        self._owner_depth = -1
        self._ended = False

    def active(self) -> "_Active":
        """This ledger is :func:`current` in this thread for a ``with`` block (a node opened in it keeps it)."""
        return _Active(self)

    def claim(self, depth: int) -> None:
        """A ``repeat`` at ``depth`` nodes from the source offers to mark the passes: the deepest (the one nearest
        the consumer) does; one nested inside it only repeats part of a pass. Offered when a pipeline is opened,
        before any record flows; the others' reports are ignored."""
        with self._lock:
            self._owner_depth = max(self._owner_depth, depth)

    def produced(self, depth: int, rows: int) -> None:
        """The ``repeat`` at ``depth`` yielded ``rows`` records."""
        if depth == self._owner_depth:
            with self._lock:
                self._produced += rows

    def pass_started(self, depth: int) -> None:
        """The ``repeat`` at ``depth`` opened another pass (its next record is that pass's first)."""
        if depth == self._owner_depth:
            with self._lock:
                self._starts.append(self._produced)

    def consumed(self, rows: int) -> None:
        """The iterator handed an element of ``rows`` rows to a function (one record unless the pipeline batches)."""
        if not self.batched:
            rows = 1
        with self._lock:
            self._consumed += rows
            while len(self._starts) > 1 and self._starts[1] <= self._consumed:
                self._starts.popleft()

    def ended(self) -> None:
        """The iterator is exhausted: its last pass is complete."""
        with self._lock:
            self._ended = True

    def in_pass(self) -> int:
        """The records handed out in the pass under way (0 once the iterator ended)."""
        with self._lock:
            return 0 if self._ended else self._consumed - self._starts[0]
