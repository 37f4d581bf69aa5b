"""The coordinator's closure queue: a plain object with explicit states, no sockets (TF's ``_CoordinatedClosureQueue``).

A :class:`Closure` moves through :class:`ClosureState`::

    QUEUED --get()--> RUNNING --mark_finished()--> FINISHED
                         |----mark_failed()-----> FAILED      (records the queue's first error)
                         '----requeue()---------> QUEUED      (worker lost: at-least-once)
    QUEUED --(error raised by put/wait/done)--> CANCELLED

Semantics as TensorFlow's: a non-retryable failure records the first error; the next ``put``/``wait``/``done``
raises it and clears it. No closure of the global queue runs while an error is pending, so the ones queued when it
is recorded are cancelled at once (their :class:`RemoteValue` raises :class:`~kubeps.runtime.errors.CancelledError`
right away instead of blocking a ``fetch()`` until the user's next ``put``/``wait``/``done``), and a closure
re-queued while it is pending is cancelled instead of parked (TF's ``put_back``). Closures that were in flight
belong to an older *epoch* once the error is raised: their later failures no longer count as the queue's error.

Every closure handed out by ``get`` must leave the in-flight set through exactly one of ``mark_finished``,
``mark_failed``, ``requeue`` or ``fail_if_running`` (the dispatch thread's last resort), or ``join`` never returns.

There is one global queue and one tagged queue per worker (per-worker resources); a worker takes from its tagged
queue first.

Workers come and go while the queue runs (elastic membership): ``retire_worker`` makes ``get`` hand a leaving
worker nothing more (its tagged closures are dropped, a wake-up it held passes to another idle worker), so it only
finishes what it holds; ``admit_worker`` takes an index back (a scale-up that reuses it).

Wake-ups are targeted, so that the cost of a closure does not grow with the number of workers: each worker waits
in ``get`` on a condition of its own (all share the queue's lock), and a closure queued for any worker wakes one
idle worker, the one idle longest; a tagged closure wakes its worker; a finished closure wakes only the callers of
``wait``. (With one condition for everything, every put and every finish woke every idle dispatch thread: at 64
workers the chief spent 2.2x the CPU per closure it spent at 8.)
"""

from __future__ import annotations

import collections
import enum
import itertools
import threading
import time
from typing import Any

from kubeps.runtime.errors import CancelledError

__all__ = ["Closure", "ClosureQueue", "ClosureState", "RemoteValue", "RemoteValueStatus"]


class RemoteValueStatus(enum.Enum):
    NOT_READY = "not_ready"
    READY = "ready"
    ABORTED = "aborted"


class RemoteValue:
    """The future result of a scheduled function (TF's ``RemoteValue``); ``fetch()`` returns numpy."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def _set_value(self, value: Any) -> None:
        self._value, self._error = value, None
        self._done.set()

    def _set_error(self, error: BaseException) -> None:
        self._value, self._error = None, error
        self._done.set()

    @property
    def _status(self) -> RemoteValueStatus:
        if not self._done.is_set():
            return RemoteValueStatus.NOT_READY
        return RemoteValueStatus.ABORTED if self._error is not None else RemoteValueStatus.READY

    def fetch(self, timeout: float | None = None) -> Any:
        """Wait for the result and return it (numpy arrays); raises the function's error or ``CancelledError``."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the remote value was not ready within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value

    def get(self, timeout: float | None = None) -> Any:
        return self.fetch(timeout)

    def __reduce__(self) -> tuple[Any, ...]:
        # Passed to schedule(): a finished one travels as its value, as TensorFlow resolves it on the worker.
        status = self._status
        if status is RemoteValueStatus.READY:
            return (_resolved, (self._value,))
        if status is RemoteValueStatus.ABORTED:
            raise TypeError(f"a RemoteValue passed to schedule() has no value: its function failed with "
                            f"{type(self._error).__name__}: {self._error}")
        raise TypeError("a RemoteValue passed to schedule() must be ready, and its function has not finished: "
                        "fetch() it (or join()) before scheduling the function that uses it")

    def __repr__(self) -> str:
        return f"<RemoteValue {self._status.value}>"


def _resolved(value: Any) -> Any:
    """What a finished RemoteValue becomes when it is unpickled on a worker: its value."""
    return value


class ClosureState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


_ids = itertools.count()


class Closure:
    """One unit of work: an opaque ``payload`` (the pickled function) and its :class:`RemoteValue`.

    ``worker`` is None for a closure any worker may run, or the index of the only worker that may run it.
    ``kind`` tells the dispatcher what the payload is (``"closure"`` or ``"resource"``).
    """

    def __init__(self, payload: Any, worker: int | None = None, kind: str = "closure",
                 info: dict[str, Any] | None = None, remote_value: RemoteValue | None = None):
        self.id = next(_ids)
        self.payload = payload
        self.worker = worker
        self.kind = kind
        self.info = dict(info or {})
        self.remote_value = remote_value if remote_value is not None else RemoteValue()
        self.state = ClosureState.QUEUED
        self.attempts = 0  # times handed to a worker
        self.epoch = 0
        self.ran_on: list[int] = []

    def __repr__(self) -> str:
        return f"<Closure {self.id} {self.kind} {self.state.value} attempts={self.attempts}>"


class ClosureQueue:
    """Thread-safe; every transition is a method named for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: the callers of wait(): woken when the queue turns idle (nothing queued or in flight) or on errors
        self._cond = threading.Condition(self._lock)
        #: one condition per worker that has called get(), on the same lock; the idle ones (waiting in get), in the
        #: order they became idle
        self._worker_conds: dict[int, threading.Condition] = {}
        self._idle_workers: collections.OrderedDict[int, None] = collections.OrderedDict()
        #: idle workers woken for the global queue that have not looked at it yet
        self._woken: set[int] = set()
        self._queue: collections.deque[Closure] = collections.deque()
        self._per_worker: dict[int, collections.deque[Closure]] = collections.defaultdict(collections.deque)
        self._inflight: set[Closure] = set()
        #: workers that left the membership: ``get`` hands them nothing
        self._retired: set[int] = set()
        self._error: BaseException | None = None
        self._epoch = 0
        self._stopped = False
        #: the program is scheduling: a closure was put since the last ``wait``/``done`` (what ``take_more`` divides
        #: the queue by depends on it)
        self._producing = False
        #: transitions counted since the queue was made (the metrics read them): closures queued by put, finished,
        #: failed, re-queued after their worker was lost, cancelled, sent in the call of the one before them
        self.counts = {"scheduled": 0, "finished": 0, "failed": 0, "retried": 0, "cancelled": 0, "batched": 0}

    # -- coordinator side --------------------------------------------------------------------------------------
    def put(self, closure: Closure) -> None:
        """Queue a closure for any worker; raises (and clears) the pending error first."""
        with self._cond:
            self._raise_if_error()
            self._enqueue(closure, self._queue)
            self.counts["scheduled"] += 1
            self._producing = True

    def put_per_worker(self, worker: int, closure: Closure, raise_error: bool = True) -> None:
        """Queue a closure only ``worker`` may run (per-worker resources); ``raise_error=False`` leaves a pending
        error to the user's next ``put``/``wait``/``done`` (the coordinator queues resources of its own accord)."""
        with self._cond:
            if raise_error:
                self._raise_if_error()
            closure.worker = worker
            self._enqueue(closure, self._per_worker[worker])

    def _enqueue(self, closure: Closure, queue: collections.deque[Closure]) -> None:
        if self._stopped:
            raise RuntimeError("the coordinator was shut down; no more functions can be scheduled")
        closure.state = ClosureState.QUEUED
        closure.epoch = self._epoch
        queue.append(closure)
        self._wake_for(closure)

    def _wake_for(self, closure: Closure) -> None:
        """Wake the worker that will take ``closure``: its own for a tagged one, else the one idle longest (a busy
        worker looks at the queue before it waits again, so a closure is never left without a taker)."""
        if closure.worker is not None:
            self._idle_workers.pop(closure.worker, None)
            cond = self._worker_conds.get(closure.worker)
        elif self._idle_workers:
            worker = self._idle_workers.popitem(last=False)[0]
            self._woken.add(worker)
            cond = self._worker_conds[worker]
        else:
            cond = None
        if cond is not None:
            cond.notify()

    def _wake_all_workers(self) -> None:
        self._idle_workers.clear()
        self._woken.clear()
        for cond in self._worker_conds.values():
            cond.notify()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or in flight (True), or an error is pending (raised); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._producing = False
            while self._error is None and not self._idle():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining if remaining is not None else 1.0)
            self._raise_if_error()
            return True

    def done(self) -> bool:
        """Non-blocking: raises the pending error, else whether everything finished."""
        with self._cond:
            self._producing = False
            self._raise_if_error()
            return self._idle()

    def _idle(self) -> bool:
        return not self._queue and not self._inflight and not any(self._per_worker.values())

    def set_error(self, error: BaseException) -> None:
        """Record an error that no single closure raised (a parameter server is gone)."""
        with self._cond:
            self._record_error(error)
            self._cond.notify_all()

    def _record_error(self, error: BaseException) -> None:
        """Make ``error`` the pending error unless one is. Nothing of the global queue is handed out while an error
        is pending and raising it cancels the queue, so what is queued now can never run: cancel it now, so that
        nobody's ``fetch()`` waits for the user's next ``put``/``wait``/``done``."""
        if self._error is None:
            self._error = error
            self._cancel_queued(error)

    @property
    def has_error(self) -> bool:
        with self._cond:
            return self._error is not None

    def _raise_if_error(self) -> None:
        if self._error is None:
            return
        error, self._error = self._error, None
        self._epoch += 1
        self._cancel_queued(error)
        raise error

    def _cancel_queued(self, error: BaseException) -> None:
        cancelled = CancelledError(f"the function was cancelled because an earlier one failed: {error!r}")
        while self._queue:
            closure = self._queue.popleft()
            closure.state = ClosureState.CANCELLED
            self.counts["cancelled"] += 1
            closure.remote_value._set_error(cancelled)
        self._cond.notify_all()

    # -- worker side -------------------------------------------------------------------------------------------
    def get(self, worker: int, timeout: float | None = None) -> Closure | None:
        """The next closure for ``worker`` (its tagged queue first), or None after ``timeout`` or on stop."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            cond = self._worker_conds.get(worker)
            if cond is None:
                cond = self._worker_conds[worker] = threading.Condition(self._lock)
            try:
                while True:
                    if self._stopped or worker in self._retired:
                        return None
                    tagged = self._per_worker.get(worker)
                    if tagged:
                        closure = tagged.popleft()
                        break
                    if self._queue and self._error is None:
                        closure = self._queue.popleft()
                        break
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return None
                    self._idle_workers[worker] = None
                    cond.wait(remaining)
                    self._woken.discard(worker)
            finally:
                self._idle_workers.pop(worker, None)
                self._woken.discard(worker)
            if len(self._queue) > len(self._woken) and self._idle_workers and self._error is None:
                # woken for a closure of the global queue, this worker took a tagged one (or the global queue
                # holds more than the workers on their way to it): pass the wake-up on
                self._wake_for(self._queue[0])
            self._start(closure, worker)
            return closure

    def _start(self, closure: Closure, worker: int) -> None:
        closure.state = ClosureState.RUNNING
        closure.attempts += 1
        closure.ran_on.append(worker)
        self._inflight.add(closure)

    def take_more(self, worker: int, limit: int) -> list[Closure]:
        """More closures for any worker, for ``worker`` to run after the one ``get`` gave it, in the same call: at
        most ``limit``, and no more than its fair share of the global queue.

        While the program is scheduling (a ``put`` since its last ``wait``/``done``) the queue is refilled as it
        drains, so the share is what is queued over the workers that could take closures now (``worker``, those
        waiting in ``get`` and those woken for the queue): the chief's cost per function falls with the calls it saves, and a worker that comes
        back finds more. Once the program waits, nothing refills the queue: the share is what is queued over every
        worker taking closures, so a backlog is spread over every worker and a short queue is not batched at all."""
        if limit <= 0:
            return []
        with self._lock:
            if self._stopped or self._error is not None or worker in self._retired:
                return []
            takers = (len(self._idle_workers) + len(self._woken) + 1 if self._producing
                      else max(1, len(self._worker_conds) - len(self._retired.intersection(self._worker_conds))))
            taken = [self._queue.popleft() for _ in range(min(limit, len(self._queue) // takers))]
            for closure in taken:
                self._start(closure, worker)
            self.counts["batched"] += len(taken)
            return taken

    def give_back(self, closures: list[Closure]) -> None:
        """Closures taken by ``get``/``take_more`` that did not run (the function before them in the same call did
        not finish): back to the front of their queue, in their order, as if never taken -- or cancelled, where
        :meth:`requeue` would cancel them."""
        with self._cond:
            for closure in reversed(closures):
                if closure not in self._inflight:
                    continue
                self._inflight.discard(closure)
                if self._cancelled_on_return(closure, "the function before it in its call did not finish"):
                    continue
                closure.state = ClosureState.QUEUED
                closure.attempts -= 1
                if closure.ran_on:
                    closure.ran_on.pop()
                (self._queue if closure.worker is None else self._per_worker[closure.worker]).appendleft(closure)
                self._wake_for(closure)
            if self._idle():
                self._cond.notify_all()

    def mark_finished(self, closure: Closure, value: Any) -> None:
        with self._cond:
            self._inflight.discard(closure)
            closure.state = ClosureState.FINISHED
            self.counts["finished"] += 1
            closure.remote_value._set_value(value)
            if self._idle():
                # wait() waits for idle or an error; a wake-up per closure cost the dispatch threads a quarter of
                # their time holding the GIL at 16 workers (the waiter woke, found work in flight, slept again)
                self._cond.notify_all()

    def mark_failed(self, closure: Closure, error: BaseException) -> None:
        """A non-retryable failure: the closure's value raises ``error``; the queue records its first error."""
        with self._cond:
            self._inflight.discard(closure)
            closure.state = ClosureState.FAILED
            self.counts["failed"] += 1
            closure.remote_value._set_error(error)
            if closure.epoch == self._epoch:
                self._record_error(error)
            self._cond.notify_all()

    def fail_if_running(self, closure: Closure, attempt: int, error: BaseException) -> bool:
        """``mark_failed`` if ``closure`` is still in flight in attempt ``attempt`` (the caller's); False when it
        already left that attempt (finished, failed, re-queued, cancelled, or running again elsewhere).

        The last resort of a dispatch thread that caught an unexpected error: whatever step raised, the closure
        it held is failed exactly once and never left in flight.
        """
        with self._cond:
            if closure.state is not ClosureState.RUNNING or closure.attempts != attempt \
                    or closure not in self._inflight:
                return False
        self.mark_failed(closure, error)
        return True

    def requeue(self, closure: Closure) -> None:
        """Its worker was lost: run it again (front of its queue).

        Cancelled instead when the queue stopped, when the closure belongs to a cancelled epoch, or when an error is
        pending and the closure is for any worker (it could not run before that error is raised, and raising it
        cancels the queue: parked there its ``fetch()`` would block until then).
        """
        with self._cond:
            self._inflight.discard(closure)
            if not self._cancelled_on_return(closure, "its worker failed"):
                closure.state = ClosureState.QUEUED
                self.counts["retried"] += 1
                target = self._queue if closure.worker is None else self._per_worker[closure.worker]
                target.appendleft(closure)
                self._wake_for(closure)
            self._cond.notify_all()

    def _cancelled_on_return(self, closure: Closure, why: str) -> bool:
        """Cancel ``closure``, on its way back to the queue, if it could never run: the queue stopped, its epoch was
        cancelled, or an error is pending and it is for any worker (it could not run before that error is raised,
        and raising it cancels the queue: parked there its ``fetch()`` would block until then)."""
        pending = self._error is not None and closure.worker is None
        if closure.epoch == self._epoch and not self._stopped and not pending:
            return False
        closure.state = ClosureState.CANCELLED
        self.counts["cancelled"] += 1
        why = f"an earlier one failed: {self._error!r}" if pending else why
        closure.remote_value._set_error(CancelledError(f"the function was cancelled after {why}"))
        return True

    def drop_per_worker(self, worker: int) -> list[Closure]:
        """Remove the closures queued for ``worker`` (its resources are rebuilt from scratch instead)."""
        with self._cond:
            dropped = list(self._per_worker.pop(worker, ()))
            for closure in dropped:
                closure.state = ClosureState.FINISHED
                closure.remote_value._set_value(None)
            self._cond.notify_all()
            return dropped

    def retire_worker(self, worker: int) -> list[Closure]:
        """``worker`` left the membership: ``get`` hands it nothing more (a call waiting in ``get`` returns None at
        once), its tagged closures are dropped as :meth:`drop_per_worker` drops them, and a wake-up for the
        global queue it had not used yet goes to another idle worker. What it runs now finishes normally (or is
        re-queued by ``requeue`` if it fails). Returns the dropped closures."""
        with self._cond:
            self._retired.add(worker)
            self._idle_workers.pop(worker, None)
            woken = worker in self._woken
            self._woken.discard(worker)
            if woken and self._queue and self._error is None and self._idle_workers:
                self._wake_for(self._queue[0])
            cond = self._worker_conds.get(worker)
            if cond is not None:
                cond.notify()
        return self.drop_per_worker(worker)

    def admit_worker(self, worker: int) -> None:
        """``worker`` (back) in the membership: ``get`` serves it again."""
        with self._cond:
            self._retired.discard(worker)

    def stop(self) -> None:
        """Shut down: cancel everything queued and wake every waiter."""
        with self._cond:
            self._stopped = True
            error = RuntimeError("the coordinator was shut down")
            self._cancel_queued(error)
            for queue in self._per_worker.values():
                while queue:
                    queue.popleft().remote_value._set_error(CancelledError("the coordinator was shut down"))
            self._wake_all_workers()
            self._cond.notify_all()

    # -- introspection -----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        with self._cond:
            return {"queued": len(self._queue), "inflight": len(self._inflight),
                    "per_worker": sum(len(q) for q in self._per_worker.values())}

    def counters(self) -> dict[str, int]:
        """A copy of :attr:`counts`, taken under the queue's lock."""
        with self._cond:
            return dict(self.counts)
