"""The work queue: one reconcile per job at a time, triggers coalesced, timers (Kubeflow's WorkQueue).

* :meth:`WorkQueue.trigger` marks a job dirty and starts its worker task if it has none; a trigger during a
  reconcile makes the worker run one more pass after it, however many triggers came (they coalesce).
* A worker waits until the job's scope is ready (both lists in, and the peering gate open) before each pass, and
  at most ``workers`` reconciles run at once.
* :meth:`WorkQueue.schedule` triggers a job later (deadlines, TTLs, retries): one timer per job, the latest wins.
* A reconcile that raises is logged, kept as :attr:`WorkQueue.last_error` (the liveness probe shows it) and
  retried in 5 s.

Runs on kopf's event loop; knows nothing of what a reconcile does.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from .cache import Key

log = logging.getLogger("kubeps.operator")

#: Seconds before a reconcile that raised is tried again.
RETRY_AFTER_ERROR = 5.0


class WorkQueue:
    """Per-job reconcile tasks and timers; ``reconcile(key)`` does one pass, ``ready(key)`` waits until the job's
    scope may be planned, ``wanted(key)`` says whether a timer that fires still has a job to reconcile."""

    def __init__(self, workers: int, reconcile: Callable[[Key], Awaitable[None]],
                 ready: Callable[[Key], Awaitable[None]], wanted: Callable[[Key], bool]):
        self.reconcile, self.ready, self.wanted = reconcile, ready, wanted
        self.dirty: set[Key] = set()
        self.tasks: dict[Key, asyncio.Task[None]] = {}
        self.timers: dict[Key, asyncio.TimerHandle] = {}
        self.limit = asyncio.Semaphore(workers)
        self.last_error: str | None = None

    def trigger(self, key: Key) -> None:
        self.dirty.add(key)
        if key not in self.tasks:
            self.tasks[key] = asyncio.get_running_loop().create_task(self._worker(key))

    def again(self, key: Key) -> None:
        """Run one more pass of the job's current worker (called from within a reconcile)."""
        self.dirty.add(key)

    async def _worker(self, key: Key) -> None:
        try:
            while key in self.dirty:
                await self.ready(key)
                self.dirty.discard(key)
                async with self.limit:
                    try:
                        await self.reconcile(key)
                    except Exception as err:  # noqa: BLE001 - logged; retried by the next trigger or timer
                        self.last_error = f"{key[0]}/{key[1]}: {err}"
                        log.exception("reconcile of %s/%s failed; retrying in 5 s", *key)
                        self.schedule(key, RETRY_AFTER_ERROR)
        finally:
            self.tasks.pop(key, None)

    def schedule(self, key: Key, delay: float) -> None:
        """Trigger the job after ``delay`` seconds (replacing a timer it had)."""
        self.cancel(key)
        loop = asyncio.get_running_loop()
        self.timers[key] = loop.call_later(delay, self._fire, key)

    def cancel(self, key: Key) -> None:
        """Drop the job's timer, if it has one."""
        timer = self.timers.pop(key, None)
        if timer is not None:
            timer.cancel()

    def _fire(self, key: Key) -> None:
        self.timers.pop(key, None)
        if self.wanted(key):
            self.trigger(key)

    def close(self) -> None:
        for timer in self.timers.values():
            timer.cancel()
        self.timers.clear()
