"""Exactly-once input on the chief: the shards of each epoch, who holds which, and how far each was trained.

``create_per_worker_dataset(dataset_fn, exactly_once=True)`` splits every epoch of the dataset's source into shards
(``shard_records`` rows of a ``from_tensor_slices``; one file of a ``from_files``) held in a :class:`ShardBook`, a
plain object without I/O. A worker's dispatch thread leases shards to it with each call it sends (enough that the
worker holds ``ahead`` shards not done) and commits the positions the call's answer reports
(:mod:`kubeps.runtime.data.leases` on the worker's side). A shard goes back, from its last committed position, to
the front of the queue when its worker leaves, fails, or runs a function that does not finish (what that function
took up to its last write to a variable is committed, as those pushes applied, and the worker's iterator is built
again from there).

So each record of an epoch is committed once. The one case where a record trains twice: a worker killed after a
function pushed its gradients and before its answer came back; the function runs again on the same records
elsewhere. :class:`InputLeases` counts those records as read again (what the function's re-run trained: an upper
bound, as whether the lost push reached the ps is not known), and counts as lost any report that would skip or
rewind records (none is expected; such a report is not applied).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from kubeps.runtime.observe.chief_metrics import InputFigures
from kubeps.runtime.rpc.protocol import LeaseGrant

__all__ = ["DEFAULT_SHARD_RECORDS", "InputLeases", "Shard", "ShardBook"]

log = logging.getLogger("kubeps.runtime.coordinator.leases")

#: rows of a ``from_tensor_slices`` per shard, unless ``create_per_worker_dataset`` is told otherwise
DEFAULT_SHARD_RECORDS = 256
#: shards a worker holds (not done) after each lease; doubled for a worker whose function ran out of records
DEFAULT_AHEAD = 2
MAX_AHEAD = 64


@dataclass
class Shard:
    """Records ``[start, end)`` of one unit (the rows of an array source, or a file) in one epoch."""

    epoch: int
    index: int  #: its place in the epoch (a file's index in the file list)
    start: int
    end: int | None  #: None: a file, to its end
    committed: int  #: the position trained up to (records from the unit's start)
    holder: int | None = None  #: the worker it is leased to
    reissued_from: int = -1  #: the committed position when it was last taken back (-1: never)

    def grant(self) -> list[int]:
        return [self.epoch, self.index, self.committed, -1 if self.end is None else self.end]


class ShardBook:
    """One exactly-once dataset: its epochs' shards, pending (the queue) or leased, and the counts. Not
    thread-safe (:class:`InputLeases` holds the lock)."""

    def __init__(self, sizes: list[int | None], epochs: int | None, shard_records: int):
        self._template: list[tuple[int, int | None]] = []
        for size in sizes:
            if size is None:
                self._template.append((0, None))
            else:
                self._template += [(start, min(size, start + shard_records)) for start in range(0, size, shard_records)]
        self.epochs = epochs
        self._next_epoch = 0
        self._pending: deque[Shard] = deque()
        self._held: dict[int, dict[tuple[int, int], Shard]] = {}  # worker -> its shards not done
        self._reissued: dict[tuple[int, int], Shard] = {}  # shards taken back, by key (a stale report finds them)
        self.trained = self.reread = self.lost = 0

    @property
    def shards_per_epoch(self) -> int:
        return len(self._template)

    def _open_epoch(self) -> bool:
        if not self._template or (self.epochs is not None and self._next_epoch >= self.epochs):
            return False
        epoch = self._next_epoch
        self._next_epoch += 1
        self._pending.extend(Shard(epoch, i, start, end, start) for i, (start, end) in enumerate(self._template))
        return True

    def lease(self, worker: int, ahead: int) -> tuple[list[Shard], bool]:
        """Shards for ``worker`` until it holds ``ahead`` of them, and whether nothing more will ever come: the
        epochs are all leased and no other worker holds a shard (one that fails gives its shards back)."""
        held = self._held.setdefault(worker, {})
        out: list[Shard] = []
        while len(held) < ahead and (self._pending or self._open_epoch()):
            shard = self._pending.popleft()
            shard.holder = worker
            held[(shard.epoch, shard.index)] = shard
            out.append(shard)
        final = not self._pending and self.epochs is not None and self._next_epoch >= self.epochs \
            and not any(shards for other, shards in self._held.items() if other != worker)
        return out, final

    def commit(self, worker: int, reports: list[list[int]]) -> int:
        """``[epoch, index, position, done]`` reported by ``worker`` after a function: the records trained."""
        held = self._held.get(worker, {})
        trained = 0
        for epoch, index, position, done in reports:
            key = (epoch, index)
            shard = held.get(key)
            if shard is None:  # taken back before its report came: what it trained past that is trained twice
                stale = self._reissued.get(key)
                extra = position - stale.reissued_from if stale is not None else 0
                log.warning("worker %d reported shard %s of a dataset after it was taken back: %d record(s) "
                            "trained twice", worker, key, max(extra, 0))
                self.reread += max(extra, 0)
                continue
            if position < shard.committed or (shard.end is not None and position > shard.end):
                log.error("worker %d reported position %d of shard %s (committed %d, end %s): not applied",
                          worker, position, key, shard.committed, shard.end)
                self.lost += abs(position - shard.committed)
                continue
            trained += position - shard.committed
            shard.committed = position
            if done:
                del held[key]
                self._reissued.pop(key, None)
        self.trained += trained
        return trained

    def release(self, worker: int) -> int:
        """``worker``'s shards go back to the front of the queue from their committed positions; how many."""
        held = self._held.pop(worker, {})
        for shard in sorted(held.values(), key=lambda s: (s.epoch, s.index), reverse=True):
            shard.holder, shard.reissued_from = None, shard.committed
            self._reissued[(shard.epoch, shard.index)] = shard
            self._pending.appendleft(shard)
        return len(held)


class InputLeases:
    """The exactly-once datasets of one coordinator, by resource id; what each worker's dispatch thread leases and
    commits (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._books: dict[str, ShardBook] = {}
        self._ahead: dict[int, int] = {}

    def add(self, resource_id: str, book: ShardBook) -> None:
        with self._lock:
            self._books[resource_id] = book

    def __contains__(self, resource_id: object) -> bool:
        with self._lock:
            return resource_id in self._books

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._books)

    def grants(self, worker: int) -> dict[str, LeaseGrant]:
        """The shards to send ``worker`` with its next call, per dataset."""
        with self._lock:
            ahead = self._ahead.get(worker, DEFAULT_AHEAD)
            out: dict[str, LeaseGrant] = {}
            for rid, book in self._books.items():
                shards, final = book.lease(worker, ahead)
                out[rid] = {"shards": [s.grant() for s in shards], "final": final}
            return out

    def commit(self, worker: int, positions: dict[str, list[list[int]]] | None, rerun: bool) -> int:
        """A function's ``ok`` answer: commit its positions; ``rerun``: a re-run of a function lost with its worker
        (what it trained may have been trained by the lost run too). The records trained."""
        trained = 0
        with self._lock:
            for rid, reports in (positions or {}).items():
                book = self._books.get(rid)
                if book is not None:
                    done = book.commit(worker, reports)
                    trained += done
                    if rerun:
                        book.reread += done
        return trained

    def release(self, worker: int) -> int:
        """Take back ``worker``'s shards of every dataset; how many."""
        with self._lock:
            return sum(book.release(worker) for book in self._books.values())

    def ran_out(self, worker: int) -> None:
        """A function on ``worker`` needed more records than it held: lease it twice as many from now on."""
        with self._lock:
            self._ahead[worker] = min(MAX_AHEAD, 2 * self._ahead.get(worker, DEFAULT_AHEAD))

    def figures(self) -> InputFigures:
        with self._lock:
            books = list(self._books.values())
            return InputFigures(sum(b.trained for b in books), sum(b.reread for b in books),
                                sum(b.lost for b in books))
