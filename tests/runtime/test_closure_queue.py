"""The closure queue's states, without sockets."""

from __future__ import annotations

import threading
import time

import pytest

from kubeps.runtime.coordinator.closure_queue import Closure, ClosureQueue, ClosureState, RemoteValueStatus
from kubeps.runtime.errors import CancelledError

pytestmark = pytest.mark.timeout(30)


def test_schedule_run_finish():
    q = ClosureQueue()
    c = Closure("payload")
    q.put(c)
    assert c.state is ClosureState.QUEUED and not q.done()
    got = q.get(worker=0, timeout=1)
    assert got is c and c.state is ClosureState.RUNNING and c.attempts == 1 and c.ran_on == [0]
    assert not q.done() and q.wait(timeout=0.05) is False
    q.mark_finished(c, 42)
    assert c.state is ClosureState.FINISHED and q.done() and q.wait(timeout=1) is True
    assert c.remote_value.fetch() == 42 and c.remote_value._status is RemoteValueStatus.READY


def test_get_times_out_empty():
    assert ClosureQueue().get(worker=0, timeout=0.05) is None


def test_error_cancels_queued_and_is_cleared():
    q = ClosureQueue()
    first, second, queued = Closure("a"), Closure("b"), [Closure(i) for i in range(3)]
    q.put(first)
    q.put(second)
    for c in queued:
        q.put(c)
    a = q.get(0, 1)
    b = q.get(1, 1)
    q.mark_failed(a, ValueError("first"))
    assert q.get(0, timeout=0.05) is None  # no more closures handed out while an error is pending
    with pytest.raises(ValueError, match="first"):
        q.wait()
    for c in queued:
        assert c.state is ClosureState.CANCELLED
        with pytest.raises(CancelledError):
            c.remote_value.fetch()
    with pytest.raises(ValueError, match="first"):
        a.remote_value.fetch()
    # an in-flight closure of the old epoch failing later is not the queue's error any more
    q.mark_failed(b, ValueError("second"))
    assert q.done() is True
    q.put(Closure("again"))  # error was cleared
    assert q.get(0, 1).payload == "again"


@pytest.mark.parametrize("raiser", ["put", "done"])
def test_put_and_done_raise_the_first_error(raiser):
    q = ClosureQueue()
    q.put(Closure(1))
    c = q.get(0, 1)
    queued = Closure(2)
    q.put(queued)
    q.mark_failed(c, KeyError("k1"))
    with pytest.raises(KeyError):
        q.put(Closure(3)) if raiser == "put" else q.done()
    assert queued.state is ClosureState.CANCELLED


def test_requeue_on_worker_failure_runs_elsewhere_first():
    q = ClosureQueue()
    c, later = Closure("c"), Closure("later")
    q.put(c)
    q.put(later)
    assert q.get(0, 1) is c
    q.requeue(c)  # worker 0 lost
    assert c.state is ClosureState.QUEUED
    again = q.get(1, 1)
    assert again is c and c.attempts == 2 and c.ran_on == [0, 1]
    q.mark_finished(c, "ok")
    assert c.remote_value.fetch() == "ok"


def test_requeue_after_cancellation_cancels():
    q = ClosureQueue()
    a, b = Closure("a"), Closure("b")
    q.put(a)
    q.put(b)
    ra, rb = q.get(0, 1), q.get(1, 1)
    q.mark_failed(ra, RuntimeError("x"))
    with pytest.raises(RuntimeError):
        q.done()
    q.requeue(rb)
    assert rb.state is ClosureState.CANCELLED


def test_per_worker_queue_first_and_drop():
    q = ClosureQueue()
    q.put(Closure("global"))
    tagged = Closure("tagged")
    q.put_per_worker(1, tagged)
    assert q.get(0, 1).payload == "global"
    assert q.get(0, timeout=0.05) is None  # worker 0 cannot take worker 1's closure
    other = Closure("tagged2")
    q.put_per_worker(1, other)
    assert q.drop_per_worker(1) == [tagged, other]
    assert tagged.remote_value.fetch() is None


def test_set_error_without_closure():
    q = ClosureQueue()
    q.put(Closure(1))
    q.set_error(ConnectionError("ps gone"))
    with pytest.raises(ConnectionError):
        q.wait()


def test_wait_wakes_when_last_finishes():
    q = ClosureQueue()
    q.put(Closure(1))
    c = q.get(0, 1)
    timer = threading.Timer(0.1, q.mark_finished, args=(c, None))
    timer.start()
    assert q.wait(timeout=5) is True
    timer.join()


def test_stop_cancels_and_unblocks():
    q = ClosureQueue()
    c = Closure(1)
    q.put(c)
    q.stop()
    assert q.get(0, timeout=1) is None
    with pytest.raises(CancelledError):
        c.remote_value.fetch()
    with pytest.raises(RuntimeError, match="shut down"):
        q.put(Closure(2))


def test_error_cancels_queued_closures_at_once():
    """Nothing of the global queue runs while an error is pending, so a fetch() of a queued closure must not wait
    for the user's next put/wait/done: it raises CancelledError as soon as the error is recorded."""
    q = ClosureQueue()
    running, queued = Closure("running"), [Closure(i) for i in range(3)]
    q.put(running)
    for c in queued:
        q.put(c)
    assert q.get(0, 1) is running
    q.mark_failed(running, ValueError("first"))
    for c in queued:
        assert c.state is ClosureState.CANCELLED
        with pytest.raises(CancelledError, match="first"):
            c.remote_value.fetch(timeout=0.1)
    with pytest.raises(ValueError, match="first"):
        q.done()
    assert q.done() is True


def test_requeue_while_an_error_is_pending_cancels():
    """TF's put_back: a closure re-queued while an error is pending is cancelled, not parked in the queue (where
    nothing would hand it out, nor cancel it before the next put/wait/done)."""
    q = ClosureQueue()
    a, b = Closure("a"), Closure("b")
    q.put(a)
    q.put(b)
    ra, rb = q.get(0, 1), q.get(1, 1)
    q.set_error(ConnectionError("ps gone"))
    q.requeue(rb)  # its worker was lost after the error was recorded
    assert rb.state is ClosureState.CANCELLED and q.stats() == {"queued": 0, "inflight": 1, "per_worker": 0}
    with pytest.raises(CancelledError, match="ps gone"):
        rb.remote_value.fetch(timeout=0.1)
    q.mark_finished(ra, 1)
    with pytest.raises(ConnectionError):
        q.wait(timeout=1)
    assert q.wait(timeout=1) is True


def test_fail_if_running_only_fails_the_callers_attempt():
    q = ClosureQueue()
    c = Closure("c")
    q.put(c)
    assert q.get(0, 1) is c
    attempt = c.attempts
    q.requeue(c)  # handed on before the dispatch thread's error handler ran
    assert q.fail_if_running(c, attempt, RuntimeError("late")) is False
    assert q.get(1, 1) is c  # running again elsewhere: not the old attempt's to fail either
    assert q.fail_if_running(c, attempt, RuntimeError("late")) is False and c.state is ClosureState.RUNNING
    assert q.fail_if_running(c, c.attempts, RuntimeError("now")) is True
    assert c.state is ClosureState.FAILED and q.stats()["inflight"] == 0
    with pytest.raises(RuntimeError, match="now"):
        c.remote_value.fetch()


class _CountingCondition(threading.Condition):
    """A condition that counts how often a waiter woke up (notified or timed out)."""

    def __init__(self, lock):
        super().__init__(lock)
        self.wakeups = 0

    def wait(self, timeout=None):
        try:
            return super().wait(timeout)
        finally:
            self.wakeups += 1


def _idle_getters(q, workers, taken):
    def take(worker):
        closure = q.get(worker, timeout=60)
        if closure is not None:
            taken.append((worker, closure))

    threads = []
    for worker in workers:
        thread = threading.Thread(target=take, args=(worker,), daemon=True)
        thread.start()
        threads.append(thread)
        deadline = time.monotonic() + 5
        while worker not in q._idle_workers and time.monotonic() < deadline:
            time.sleep(0.001)
        assert worker in q._idle_workers
    return threads


def test_a_queued_closure_wakes_one_idle_worker_not_all():
    """With one condition for everything, each put woke every idle dispatch thread: the chief's CPU per closure grew
    with the number of workers. Now a closure for any worker wakes one, the idle longest; a tagged one its own."""
    q = ClosureQueue()
    conds = {w: _CountingCondition(q._lock) for w in range(32)}
    q._worker_conds.update(conds)
    taken: list = []
    threads = _idle_getters(q, range(32), taken)
    closures = [Closure(i) for i in range(4)]
    for closure in closures:
        q.put(closure)
    tagged = Closure("tagged")
    q.put_per_worker(20, tagged)
    deadline = time.monotonic() + 5
    while len(taken) < 5 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert sorted(w for w, _ in taken) == [0, 1, 2, 3, 20]
    assert {c for _, c in taken} == {*closures, tagged}
    assert sum(c.wakeups for c in conds.values()) == 5  # nobody else woke up
    q.stop()
    for thread in threads:
        thread.join(5)
    assert not any(thread.is_alive() for thread in threads)


def test_a_woken_worker_that_takes_its_tagged_closure_passes_the_wake_up_on():
    """The closure that woke worker 0 must not wait for a timeout when worker 0 takes a tagged one instead."""
    q = ClosureQueue()
    taken: list = []
    threads = _idle_getters(q, [0, 1], taken)
    started = time.monotonic()
    anyone, tagged = Closure("any"), Closure("tagged")
    q.put(anyone)  # wakes worker 0, idle longest
    q.put_per_worker(0, tagged)  # worker 0 prefers its tagged closure when it runs
    for thread in threads:
        thread.join(5)
    assert {c for _, c in taken} == {anyone, tagged}
    assert time.monotonic() - started < 5  # not the getters' 60 s timeout


def test_join_wakes_once_when_the_queue_turns_idle_not_per_closure():
    """``wait()`` (the user's ``join``) waits for the queue to turn idle. A wake-up for every finished or queued
    closure cost the dispatch threads a quarter of the time they held the GIL at 16 workers (``bench/dispatch.py``):
    the waiter woke, found work in flight and slept again. Now it wakes when the last closure leaves the books."""
    q = ClosureQueue()
    q._cond = cond = _CountingCondition(q._lock)
    closures = [Closure(i) for i in range(20)]
    for closure in closures[:10]:
        q.put(closure)
    running = [q.get(0, 1) for _ in range(10)]
    returned = threading.Event()
    waiter = threading.Thread(target=lambda: (q.wait(timeout=30), returned.set()), daemon=True)
    waiter.start()
    while not cond._waiters:  # the waiter is in wait()
        time.sleep(0.001)
    for closure in closures[10:]:
        q.put(closure)
    running += [q.get(0, 1) for _ in range(10)]
    for closure in running[:-1]:
        q.mark_finished(closure, None)
    assert not returned.wait(0.05) and cond.wakeups == 0  # work is still in flight: nobody was woken
    q.mark_finished(running[-1], None)
    assert returned.wait(5)
    waiter.join(5)
    assert cond.wakeups == 1
