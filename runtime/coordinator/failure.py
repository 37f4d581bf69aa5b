"""The coordinator's failure detector, as TensorFlow's ``coordinator/watchdog.py`` and the heartbeats of
``cluster_coordinator.py``: every parameter server and every busy worker is pinged every ``heartbeat_interval``
seconds; a peer silent for ``heartbeat_failures x heartbeat_interval`` is dead (a busy worker's call is cancelled,
so its closure re-runs elsewhere; a ps fails the job, which the chief survives by exiting 133 and restoring its
latest checkpoint). It also counts the errors closures meet reaching a ps (:meth:`FailureDetector.handle_ps_error`):
a blip is retried, a ps that stays away or restarted empty fails the job.

It shares the coordinator's closure queue (to re-queue or fail closures, and to raise the job's error) and its
worker handles; it never dispatches.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

from kubeps.runtime.coordinator.closure_queue import Closure, ClosureQueue
from kubeps.runtime.errors import PSUnavailableError
from kubeps.runtime.rpc.protocol import PING
from kubeps.runtime.rpc.transport import ps_restarted

__all__ = ["FailureDetector", "Heartbeat"]

log = logging.getLogger("kubeps.runtime.coordinator.failure")

#: ping threads kept for workers at least: workers that join a running job are pinged too
MIN_WORKER_PINGERS = 64


class Heartbeat:
    """The failure detector's view of one peer: the ping in flight and when a ping was last answered."""

    def __init__(self) -> None:
        self.last_ok = time.monotonic()  # send time of the newest answered ping (the peer was alive then)
        self.sent_at = float("-inf")     # send time of the newest ping
        self.future: Future | None = None
        self.last_error: BaseException | None = None
        self.answered = False  # whether the peer ever answered: one that never listened is starting, not dead

    def collect(self) -> BaseException | None:
        """Take the result of a finished ping: None if it was answered (or none finished), else its error."""
        future = self.future
        if future is None or not future.done():
            return None
        self.future = None
        error = future.exception()
        if error is None:
            self.last_ok = max(self.last_ok, self.sent_at)
            self.last_error = None
            self.answered = True
            return None
        self.last_error = error
        return error

    def due(self, now: float, interval: float) -> bool:
        return self.future is None and now - self.sent_at >= interval



class FailureDetector:
    """Heartbeats and ps error accounting for one :class:`~kubeps.runtime.ClusterCoordinator` (its settings are
    the coordinator's keyword arguments of the same names)."""

    def __init__(self, strategy: Any, queue: ClosureQueue, workers: Sequence[Any], stopping: threading.Event, *,
                 heartbeat_interval: float, heartbeat_failures: int, ping_timeout: float,
                 max_transient_ps_errors: int, ps_error_interval: float, ps_error_window: float):
        self.strategy = strategy
        self.queue = queue
        self.workers = workers
        self.stopping = stopping
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_failures = heartbeat_failures
        self.ping_timeout = ping_timeout
        self.max_transient_ps_errors = max_transient_ps_errors
        self.ps_error_interval = ps_error_interval
        self.ps_error_window = ps_error_window
        self._lock = threading.Lock()
        #: per ps, the monotonic times of the counted transient errors (see ``handle_ps_error``)
        self.ps_errors: dict[int, collections.deque[float]] = {i: collections.deque() for i in range(strategy.num_ps)}
        self.ps_heartbeats = [Heartbeat() for _ in range(strategy.num_ps)]
        self.ps_failed: dict[int, PSUnavailableError] = {}
        #: per ps, when it was last marked failed and why (kept when the heartbeat sees it answer again)
        self.ps_failed_at: dict[int, tuple[float, PSUnavailableError]] = {}
        # room for workers that join later (elastic membership); the pool starts its threads only as pings need them
        self.pinger = ThreadPoolExecutor(max_workers=strategy.num_ps + max(len(workers), MIN_WORKER_PINGERS),
                                         thread_name_prefix="kubeps-ping")
        self.thread = threading.Thread(target=self.monitor_loop, daemon=True, name="kubeps-monitor")

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Called after the coordinator set ``stopping``: the monitor ends, pings in flight are dropped."""
        self.thread.join(timeout=5)
        self.pinger.shutdown(wait=False, cancel_futures=True)

    def handle_ps_error(self, closure: Closure, ps_index: int, message: str, restarted: bool = False) -> None:
        """A closure could not reach a PS: retry it while the blip lasts, then fail the job.

        Errors from one PS less than ``ps_error_interval`` apart count as one (a worker's channel in reconnect
        backoff fails many calls within milliseconds); counted errors older than ``ps_error_window`` are
        forgotten; more than ``max_transient_ps_errors`` counted errors fail the job. A PS that ``restarted``
        (it answered NOT_FOUND for a variable the coordinator created) lost its variables: that fails at once.
        """
        address = self.strategy.ps_addresses[ps_index] if 0 <= ps_index < self.strategy.num_ps else "?"
        prefix = f"parameter server /job:ps/task:{ps_index} at {address} is unavailable: "
        detail = message[len(prefix):] if message.startswith(prefix) else message
        if restarted:
            error = PSUnavailableError(ps_index, address, detail, code="DATA_LOSS")
            error.restarted = True
            self.queue.mark_failed(closure, error)
            self.mark_ps_failed(ps_index, error)
            return
        now = time.monotonic()
        with self._lock:
            times = self.ps_errors.setdefault(ps_index, collections.deque())
            while times and now - times[0] > self.ps_error_window:
                times.popleft()
            counted = not times or now - times[-1] >= self.ps_error_interval
            if counted:
                times.append(now)
            count, first = len(times), times[0]
            failed = ps_index in self.ps_failed
        if count <= self.max_transient_ps_errors and not failed:
            if counted:
                log.warning("transient error %d/%d from ps %d (errors less than %.1f s apart count once): %s",
                            count, self.max_transient_ps_errors, ps_index, self.ps_error_interval, message)
            # retry after a pause, so a worker in reconnect backoff does not spin through the queue
            paused_at = time.monotonic()
            self.stopping.wait(max(0.05, self.ps_error_interval / 2))
            with self._lock:
                failed_at, failure = self.ps_failed_at.get(ps_index, (float("-inf"), None))
                if ps_index in self.ps_failed:
                    failure = self.ps_failed[ps_index]
                elif failed_at < paused_at:
                    failure = None  # an older incident, recovered from before this error
            if failure is not None:
                # another closure used up the tolerance (or the heartbeat gave up on the ps) during the pause:
                # this one failed for the same reason. Re-queued, it would sit behind the pending error (no
                # closure is handed out then) and only be cancelled. (Checked even when the heartbeat already saw
                # the ps answer again: the job failed all the same.)
                self.queue.mark_failed(closure, failure)
                return
            self.queue.requeue(closure)
            return
        error = PSUnavailableError(
            ps_index, address,
            f"{count} errors over {now - first:.1f} s (more than max_transient_ps_errors="
            f"{self.max_transient_ps_errors}, counting errors less than ps_error_interval={self.ps_error_interval:g} s "
            f"apart once); last: {detail}")
        self.queue.mark_failed(closure, error)
        self.mark_ps_failed(ps_index, error)

    def mark_ps_failed(self, ps_index: int, error: PSUnavailableError) -> None:
        """The PS is gone: the error reaches the user through schedule/join/done (restart from a checkpoint)."""
        with self._lock:
            known = self.ps_failed.get(ps_index)
            # a restart found after the ps fell silent is news: it says why, and that waiting will not help
            first = known is None or (ps_restarted(error) and not ps_restarted(known))
            if first:
                self.ps_failed[ps_index] = error
                self.ps_failed_at[ps_index] = (time.monotonic(), error)
        if first:
            log.error("%s", error)
            self.queue.set_error(error)

    def ps_recovered(self, ps_index: int) -> None:
        with self._lock:
            self.ps_failed.pop(ps_index, None)

    def monitor_loop(self) -> None:
        # the loop ticks faster than the ping interval so that a silent peer is declared dead on time
        tick = min(self.heartbeat_interval, 0.1)
        while not self.stopping.wait(tick):
            now = time.monotonic()
            # one peer's error must neither end the failure detector nor skip the other peers
            for ps in range(self.strategy.num_ps):
                self._guarded(self._heartbeat_ps, ps, now)
            for worker in list(self.workers):  # a copy: workers join and leave while the monitor runs
                self._guarded(self._heartbeat_worker, worker, now)

    def _guarded(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - logged; the monitor thread goes on
            log.exception("failure detector: %s%r raised", getattr(fn, "__name__", fn), args)

    @property
    def _dead_after(self) -> float:
        return self.heartbeat_failures * self.heartbeat_interval

    def _ping_submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future | None:
        try:
            return self.pinger.submit(fn, *args, **kwargs)
        except RuntimeError:  # shut down
            return None

    def _heartbeat_ps(self, ps: int, now: float) -> None:
        beat = self.ps_heartbeats[ps]
        answered = beat.future is not None and beat.future.done()
        error = beat.collect()
        if error is not None and ps_restarted(error):
            self.mark_ps_failed(ps, error)  # a new, empty process answered: its variables are gone
        elif error is not None and not isinstance(error, PSUnavailableError):
            log.warning("ping of ps %d failed: %s", ps, error)  # it answers (e.g. UNAUTHENTICATED): alive
            beat.last_ok = max(beat.last_ok, beat.sent_at)
        elif answered and error is None and ps in self.ps_failed and not ps_restarted(self.ps_failed[ps]):
            self.ps_recovered(ps)
        if beat.due(now, self.heartbeat_interval):
            beat.sent_at = now
            beat.future = self._ping_submit(self.strategy.transport.call, ps, PING, timeout=self.ping_timeout)
        if not beat.answered and (getattr(self.strategy, "ps_waiting", False) or (
                not getattr(self.strategy, "ps_ready", True) and _not_listening(beat.last_error))):
            # a ps that never answered is starting, not dead, while the strategy waits for every ps to start, or
            # before it has waited (no variable created yet: e.g. per-worker resources built first) while nothing
            # listens at its address (on a loaded machine a ps takes seconds to listen): the strategy's wait bounds
            # it (ps_startup_timeout) and says so itself. One that listens but does not answer (hung) or answered
            # once and then stops answering is dead after the usual silence.
            beat.last_ok = now
            return
        silent = now - beat.last_ok
        if silent >= self._dead_after and ps not in self.ps_failed:
            last = beat.last_error
            address = self.strategy.ps_addresses[ps]
            self.mark_ps_failed(ps, PSUnavailableError(
                ps, address,
                f"no answer to pings for {silent:.1f} s (heartbeat_failures={self.heartbeat_failures} x "
                f"heartbeat_interval={self.heartbeat_interval:g} s); last error: {last}",
                getattr(last, "code", "DEADLINE_EXCEEDED")))

    def _heartbeat_worker(self, worker: Any, now: float) -> None:
        beat = worker.heartbeat
        beat.collect()
        call = worker.call
        if call is None or not worker.healthy:
            beat.last_ok = now  # only busy workers are watched: the clock starts with the next call
            return
        if beat.due(now, self.heartbeat_interval):
            beat.sent_at = now
            beat.future = self._ping_submit(worker.client.call, PING, timeout=self.ping_timeout)
        silent = now - beat.last_ok
        if silent >= self._dead_after:
            log.warning("worker %d missed pings for %.1f s (heartbeat_failures=%d x heartbeat_interval=%g s; "
                        "last error: %s); cancelling its call", worker.index, silent, self.heartbeat_failures,
                        self.heartbeat_interval, beat.last_error)
            beat.last_ok = now  # cancelled once; the dispatch thread re-queues the closure
            call.cancel()


def _not_listening(error: BaseException | None) -> bool:
    """Whether a ping failed because nothing listens at the address yet (connection refused; in Kubernetes also a
    name that does not resolve until the pod has an address), not because a peer that listens was silent (a hung
    process accepts the connection and never answers: "timed out before receiving SETTINGS frame")."""
    text = str(error).lower()
    return getattr(error, "code", None) == "UNAVAILABLE" and any(
        sign in text for sign in ("connection refused", "dns resolution failed", "name resolution"))
