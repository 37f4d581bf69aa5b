"""The chief's membership controller: what a new membership document does to the workers (docs/elastic.md).

:meth:`MembershipController.apply_membership` compares the document with the
:class:`~kubeps.runtime.coordinator.workers.WorkerSet`: a new index joins (a worker whose dispatch thread waits for
it, builds every per-worker resource on it, then takes closures), an index beyond the new count or whose address
changed leaves (it finishes the closure it runs, takes nothing more, and drains). The per-worker datasets are
sharded again for the workers that stay; the records that cuts short are counted (:class:`RecordsReread`). A
checkpoint request above the last one served is served with the program's newest ``CheckpointManager``.
:meth:`~MembershipController.membership_status` is the acknowledgement (:class:`~kubeps.runtime.cluster.MembershipAck`)
the watcher writes to its file and the chief serves on its metrics port.

The file watcher is :mod:`~kubeps.runtime.coordinator.membership`; the controller is its target.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Sequence

from kubeps.runtime.checkpoint.manager import newest_manager
from kubeps.runtime.cluster import Membership, MembershipAck
from kubeps.runtime.coordinator.closure_queue import Closure
from kubeps.runtime.coordinator.workers import Worker, WorkerSet
from kubeps.runtime.observe.chief_metrics import MembershipFigures

__all__ = ["MembershipController", "RecordsReread"]

log = logging.getLogger("kubeps.runtime.coordinator.membership_controller")


class RecordsReread:
    """The records read in a pass that a reshard, a worker's departure or a worker's restart cut short: the new
    shards read them again from their start (at-least-once; :mod:`kubeps.runtime.data.passes`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = 0

    def answered(self, worker: Worker, in_pass: int | None, reread: int | None) -> None:
        """A worker's answer: where its iterators stand, and what an iterator built again had read in its pass."""
        if in_pass is not None:
            worker.in_pass = int(in_pass)
        if reread:
            self.add(worker, int(reread), "had its dataset sharded again")

    def add(self, worker: Worker, records: int, why: str) -> None:
        with self._lock:
            self.total += records
            total = self.total
        log.warning("worker %d %s after reading %d record(s) of its pass under way: the new shards read them "
                    "again (at-least-once; %d record(s) read again in this job so far)", worker.index, why,
                    records, total)


class MembershipController:
    """Applies membership documents to a :class:`WorkerSet`, one at a time, and says where it stands."""

    def __init__(self, workers: WorkerSet, records: RecordsReread):
        self.workers = workers
        self.records = records
        #: the generation of the last membership document applied (None: TF_CONFIG's workers)
        self.generation: int | None = None
        #: the last checkpoint request served (Membership.checkpoint)
        self.checkpoint_served = 0
        #: times the per-worker datasets were sharded again for a new membership
        self.reshards = 0
        self._apply_lock = threading.Lock()

    def apply_membership(self, membership: Membership | Sequence[str]) -> MembershipAck:
        """See :meth:`kubeps.runtime.ClusterCoordinator.apply_membership`."""
        with self._apply_lock:  # one change at a time (the watcher's thread, the program's)
            return self._apply(membership)

    def _apply(self, membership: Membership | Sequence[str]) -> MembershipAck:
        workers = self.workers
        if not isinstance(membership, Membership):
            membership = Membership(generation=(self.generation or 0) + 1, workers=list(membership),
                                    checkpoint=self.checkpoint_served)
        workers.check_open()
        first = self.generation is None
        joined: list[Worker] = []
        left: list[Worker] = []
        with workers.lock:
            current = {w.index: w for w in workers.members}
            keep = []
            for index, address in enumerate(membership.workers):
                worker = current.pop(index, None)
                if worker is not None and worker.address == address:
                    keep.append(worker)
                    continue
                if worker is not None:
                    left.append(worker)
                new = workers.new(index, address)
                new.joined = new.needs_resources = True
                keep.append(new)
                joined.append(new)
            left.extend(current.values())
            for worker in left:
                worker.retiring = True
            workers.members = keep
            workers.handles.extend(joined)
            self.generation = membership.generation
        for worker in left:
            workers.queue.retire_worker(worker.index)
            log.info("worker %d (%s) leaves (membership generation %d): it finishes what it runs and takes "
                     "nothing more", worker.index, worker.address, membership.generation)
        if joined or left:
            self._reshard([w for w in keep if w not in joined])
        for worker in joined:
            workers.queue.admit_worker(worker.index)
            worker.start()
            log.info("worker %d (%s) joins (membership generation %d)", worker.index, worker.address,
                     membership.generation)
        if joined or left:
            # a warning so that a chief without a logging configuration shows it too (as the strategy's start-up
            # lines): the one line that says what the job's workers are now
            datasets = workers.dataset_count()
            log.warning("membership generation %d: %d worker(s); joining %s, leaving %s (each finishes what it runs)"
                        "%s", membership.generation, len(membership.workers), sorted(w.index for w in joined),
                        sorted(w.index for w in left),
                        f"; {datasets} per-worker dataset(s) sharded again for {len(membership.workers)} workers "
                        "(at-least-once: what the current pass read before may be read again)" if datasets else "")
        self._serve_checkpoint(membership.checkpoint, first)
        return self.membership_status()

    def _reshard(self, stay: list[Worker]) -> None:
        """The membership changed: every per-worker resource is built again on the workers that ``stay``, before
        their next closure, so that the datasets are sharded for the new membership: the workers of now split every
        record between them (none is left to a worker that left; those read in the current pass before the change
        may be read again: at-least-once)."""
        if not self.workers.dataset_count():
            return
        for worker in stay:
            for resource_id, payload in self.workers.resources_for(worker):
                closure = Closure(payload, kind="resource", info={"resource_id": resource_id})
                self.workers.queue.put_per_worker(worker.index, closure, raise_error=False)
        with self.workers.lock:
            self.reshards += 1

    def _serve_checkpoint(self, request: int, first: bool) -> None:
        """A checkpoint request above the last one served: save with the newest ``CheckpointManager`` of the
        program (while functions run: the variables hold every update applied until the save; the step saved is the
        program's ``StepCounter``), then report it served. In the first document a chief applies, the request was
        its predecessor's: taken as served, nothing saved. A program without a manager, or a save that fails, is
        logged and reported served too: the operator then restarts with the latest checkpoint there is."""
        if request <= self.checkpoint_served:
            return
        if not first:
            manager = newest_manager()
            if manager is None:
                log.warning("checkpoint request %d: the program made no CheckpointManager, nothing saved", request)
            else:
                started = time.perf_counter()
                try:
                    path = manager.save()
                except Exception:  # noqa: BLE001 - reported served: the restart restores the latest checkpoint
                    log.exception("checkpoint request %d: the save failed", request)
                else:
                    log.warning("checkpoint request %d: saved %s in %.2f s", request, path,
                                time.perf_counter() - started)
        with self.workers.lock:
            self.checkpoint_served = request

    def membership_status(self) -> MembershipAck:
        """The generation applied, the workers dispatched to, those still draining and those drained."""
        workers = self.workers
        with workers.lock:
            return MembershipAck(
                generation=self.generation or 0, workers=[w.index for w in workers.members],
                draining=sorted(w.index for w in workers.handles if w.retiring),
                drained=list(workers.drained_indexes), checkpoint=self.checkpoint_served)

    def ack_json(self) -> str:
        """The acknowledgement as the ack file and the chief's HTTP path carry it."""
        return self.membership_status().to_json()

    def figures(self) -> MembershipFigures:
        """The membership as the chief's metrics show it."""
        status = self.membership_status()
        return MembershipFigures(workers=len(status.workers), draining=len(status.draining),
                                 generation=status.generation, checkpoint=status.checkpoint,
                                 reshards=self.reshards, records_reread=self.records.total)
