"""Several queued functions in one call to a worker (``RunClosures``, ``max_closures_per_call``).

While more functions are queued than there are workers, a dispatch thread sends its worker up to
``max_closures_per_call`` of them in one call, its fair share of the queue: the chief's CPU per function falls with
the backlog (``bench/dispatch.py``). The worker runs them one after the other and stops after the first that does not
finish; what follows goes back to the front of the queue untouched (or is cancelled where the error cancels it).
"""

from __future__ import annotations

import pickle
import sys
import threading
import time
from typing import Any

import cloudpickle
import numpy as np
import pytest

from kubeps.runtime.coordinator.closure_queue import Closure, ClosureQueue, ClosureState
from kubeps.runtime.coordinator.cluster_coordinator import DEFAULT_GIL_SWITCH_INTERVAL, ClusterCoordinator
from kubeps.runtime.coordinator.strategy import ParameterServerStrategy
from kubeps.runtime.errors import CancelledError, RemoteError, RuntimeConfigError

from .conftest import TOKEN, LocalCluster, fake_worker_coordinator

pytestmark = pytest.mark.timeout(60)


# -- the queue -------------------------------------------------------------------------------------------------------
def _queue_with_takers(takers: int, closures: int, waiting: bool = True) -> tuple[ClosureQueue, list[Closure]]:
    """A queue with ``takers`` workers and ``closures`` queued; ``waiting``: the program then waits (``done``), so
    the queue is shared over every taker."""
    q = ClosureQueue()
    for worker in range(takers):  # a worker is a taker once it has called get()
        assert q.get(worker, timeout=0) is None
    items = [Closure(i) for i in range(closures)]
    for closure in items:
        q.put(closure)
    if waiting:
        assert not q.done()
    return q, items


def test_while_the_program_schedules_the_share_is_over_the_workers_waiting_now():
    """The queue is refilled as it drains: a worker whose call returned takes up to the limit when nobody else
    waits for closures; once the program waits (join, done) the rest is shared over every worker."""
    q, items = _queue_with_takers(2, 11, waiting=False)
    first = q.get(0, 1)
    more = q.take_more(0, 7)
    assert [first, *more] == items[:8]  # nobody waits in get(): the limit
    assert not q.done()
    assert q.take_more(1, 7) == [items[8]]  # 3 left over 2 takers: 1 more
    again = Closure(11)
    q.put(again)  # scheduling again
    assert q.take_more(1, 7) == [*items[9:11], again]


def test_while_the_program_schedules_workers_woken_for_the_queue_get_their_share():
    """Two functions scheduled while two workers wait go one to each, whichever comes first to the queue."""
    q = ClosureQueue()
    started = threading.Barrier(3)
    calls: dict[int, list[Closure]] = {}

    def worker(index: int) -> None:
        started.wait()
        first = q.get(index, timeout=10)
        calls[index] = [first, *q.take_more(index, 7)]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    started.wait()
    deadline = time.monotonic() + 10
    while len(q._idle_workers) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    items = [Closure(i) for i in range(2)]
    for closure in items:
        q.put(closure)
    for thread in threads:
        thread.join(timeout=10)
    assert sorted(len(call) for call in calls.values()) == [1, 1], calls


def test_take_more_takes_a_fair_share_of_the_backlog_only():
    q, items = _queue_with_takers(2, 11)
    first = q.get(0, 1)
    more = q.take_more(0, 7)
    assert [first, *more] == items[:6]  # 10 left over 2 takers: 5 more, in queue order
    assert all(c.state is ClosureState.RUNNING and c.attempts == 1 and c.ran_on == [0] for c in more)
    assert q.take_more(1, 7) == items[6:8]  # 5 left: 2 each
    assert q.take_more(1, 1) == [items[8]]  # capped by the limit
    assert q.take_more(0, 7) == [items[9]]  # 2 left over 2 takers: 1 each
    assert q.take_more(0, 7) == []  # 1 left over 2 takers: the share rounds down to none
    assert q.counts["batched"] == 9
    assert q.stats() == {"queued": 1, "inflight": 10, "per_worker": 0}


def test_take_more_takes_nothing_from_a_short_queue_or_when_it_must_not():
    q, items = _queue_with_takers(4, 4)
    q.get(0, 1)
    assert q.take_more(0, 7) == []  # 3 queued, 4 takers: one each, no batching
    q, items = _queue_with_takers(1, 5)
    q.get(0, 1)
    q.retire_worker(0)
    assert q.take_more(0, 7) == []  # a worker that left takes nothing more
    q, items = _queue_with_takers(1, 5)
    running = q.get(0, 1)
    q.mark_failed(running, ValueError("boom"))
    assert q.take_more(0, 7) == []  # an error is pending: nothing more is handed out


def test_give_back_restores_order_and_books_and_wakes_a_taker():
    q, items = _queue_with_takers(1, 6)
    first = q.get(0, 1)
    more = q.take_more(0, 7)
    assert more == items[1:6]
    q.mark_finished(first, "done")
    q.give_back(more[1:])
    assert q.stats() == {"queued": 4, "inflight": 1, "per_worker": 0}
    assert all(c.state is ClosureState.QUEUED and c.attempts == 0 and c.ran_on == [] for c in more[1:])
    assert [q.get(0, 1) for _ in range(4)] == more[1:]  # their order kept, at the front
    assert q.counts["retried"] == 0  # not a retry: they never ran


def test_give_back_cancels_what_an_error_cancels():
    q, items = _queue_with_takers(1, 4)
    first = q.get(0, 1)
    more = q.take_more(0, 7)
    q.mark_failed(first, ValueError("boom"))
    q.give_back(more)
    for closure in more:
        assert closure.state is ClosureState.CANCELLED
        with pytest.raises(CancelledError, match="an earlier one failed"):
            closure.remote_value.fetch(timeout=1)
    with pytest.raises(ValueError, match="boom"):
        q.wait(timeout=1)
    assert q.done()


# -- the coordinator, against a worker that answers as the fake says ------------------------------------------------
class BatchingWorkerClient:
    """Stands for ``rpc.Client`` to one worker: runs the pickled functions it is sent (``RunClosure`` one,
    ``RunClosures`` several) in this process, as the worker would, unless ``script`` says otherwise for a call:
    ``script`` is a list of callables ``(calls, payloads) -> (meta, arrays) | raise``, used one per call."""

    def __init__(self, address: str, *args: Any, **kwargs: Any):
        self.address = address
        self.calls: list[tuple[str, int]] = []  # (method, functions)
        self.script: list[Any] = []
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = threading.Event()  # a call is held at the gate
        self.lock = threading.Lock()

    def call(self, name: str, meta: Any = None, arrays: Any = (), timeout: float | None = None):
        assert name == "Ping", name
        return {"incarnation": "fake"}, []

    def start(self, name: str, meta: Any = None, arrays: Any = (), timeout: float | None = None):
        return name, list(arrays)

    def finish(self, call: Any):
        if not self.gate.is_set():
            self.waiting.set()
            self.gate.wait(10)
        name, payloads = call
        with self.lock:
            self.calls.append((name, len(payloads)))
            step = self.script.pop(0) if self.script else None
        if step is not None:
            return step(name, payloads)
        return run_payloads(name, payloads)

    def close(self) -> None:
        pass


def _answer(value: Any) -> tuple[dict[str, Any], list[np.ndarray]]:
    return {"status": "ok"}, [np.frombuffer(pickle.dumps(value), dtype=np.uint8)]


def run_payloads(name: str, payloads: list[np.ndarray], fail_at: int | None = None,
                 status: str = "error") -> tuple[dict[str, Any], list[np.ndarray]]:
    answers, counts, tensors = [], [], []
    for i, payload in enumerate(payloads):
        if i == fail_at:
            meta: dict[str, Any] = {"status": status, "type": "ValueError", "message": f"function {i} failed"}
            out = [np.frombuffer(pickle.dumps(ValueError(f"function {i} failed")), dtype=np.uint8)]
        else:
            fn, args, kwargs = cloudpickle.loads(payload.tobytes())
            meta, out = _answer(fn(*args, **kwargs))
        answers.append(meta)
        counts.append(len(out))
        tensors += out
        if meta["status"] != "ok":
            break
    if name == "RunClosure":
        return answers[0], tensors
    return {"status": "ok", "answers": answers, "counts": counts, "in_pass": 0}, tensors


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """A coordinator with one fake worker (so its fair share is the whole backlog, up to the limit)."""
    with fake_worker_coordinator(monkeypatch, tmp_path, BatchingWorkerClient, max_closures_per_call=4) as made:
        yield made


def _backlog(coordinator: ClusterCoordinator, client: BatchingWorkerClient, n: int) -> list[Any]:
    """Schedule ``n`` functions, the first alone, the others while the worker's call of the first is held (so they
    queue up behind it)."""
    client.gate.clear()
    values = [coordinator.schedule(lambda: 0)]
    assert client.waiting.wait(10)
    values += [coordinator.schedule(lambda i=i: i * 10) for i in range(1, n)]
    client.gate.set()
    return values


def test_a_backlog_goes_in_calls_of_up_to_the_limit_and_every_value_comes_back(fake):
    coordinator, client = fake
    values = _backlog(coordinator, client, 13)
    coordinator.join()
    assert [v.fetch() for v in values] == [i * 10 for i in range(13)]
    sizes = [n for _, n in client.calls]
    assert sum(sizes) == 13 and max(sizes) == 4 and ("RunClosures", 4) in client.calls
    assert all(name == ("RunClosures" if n > 1 else "RunClosure") for name, n in client.calls)
    counts = coordinator._queue.counters()
    assert counts["finished"] == 13 and counts["batched"] == 13 - len(sizes) and counts["retried"] == 0


def test_one_function_per_call_when_asked(monkeypatch, tmp_path):
    with fake_worker_coordinator(monkeypatch, tmp_path, BatchingWorkerClient, max_closures_per_call=1) as made:
        coordinator, client = made
        values = _backlog(coordinator, client, 6)
        coordinator.join()
        assert [v.fetch() for v in values] == [0, 10, 20, 30, 40, 50]
        assert client.calls == [("RunClosure", 1)] * 6


def test_the_options_are_checked_once_and_read_as_attributes(monkeypatch, tmp_path):
    with fake_worker_coordinator(monkeypatch, tmp_path, BatchingWorkerClient, closure_timeout=30,
                                 max_closures_per_call=3) as (coordinator, _):
        assert (coordinator.closure_timeout, coordinator.max_closures_per_call) == (30.0, 3)
        assert coordinator.options.heartbeat_failures == coordinator.heartbeat_failures == 10_000
        with pytest.raises(AttributeError, match="no attribute 'closure_timeout_s'"):
            getattr(coordinator, "closure_timeout_s")
    strategy = ParameterServerStrategy(LocalCluster(1, 1, tmp_path).resolver(), job_token=TOKEN)
    try:
        with pytest.raises(TypeError, match="closure_timeout_s"):
            ClusterCoordinator(strategy, closure_timeout_s=30)
    finally:
        strategy.close()


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "8"])
def test_max_closures_per_call_is_checked(tmp_path, value):
    strategy = ParameterServerStrategy(LocalCluster(1, 1, tmp_path).resolver(), job_token=TOKEN)
    try:
        with pytest.raises(RuntimeConfigError, match=r"'max_closures_per_call' has invalid value .*: an integer >= 1"):
            ClusterCoordinator(strategy, max_closures_per_call=value)
    finally:
        strategy.close()


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "0.05"])
def test_gil_switch_interval_is_checked(tmp_path, value):
    strategy = ParameterServerStrategy(LocalCluster(1, 1, tmp_path).resolver(), job_token=TOKEN)
    try:
        with pytest.raises(RuntimeConfigError, match=r"'gil_switch_interval' has invalid value .*: a number of seconds in \(0, 1\], or None"):
            ClusterCoordinator(strategy, gil_switch_interval=value)
    finally:
        strategy.close()


@pytest.mark.parametrize("asked, held", [(DEFAULT_GIL_SWITCH_INTERVAL, 0.05), (0.02, 0.02), (None, 0.005)])
def test_the_coordinator_holds_a_longer_gil_switch_interval_while_it_runs(monkeypatch, tmp_path, asked, held):
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # CPython's default
    try:
        with fake_worker_coordinator(monkeypatch, tmp_path, BatchingWorkerClient,
                                     gil_switch_interval=asked) as (coordinator, client):
            assert sys.getswitchinterval() == pytest.approx(held)
            values = _backlog(coordinator, client, 3)
            coordinator.join()
            assert [v.fetch() for v in values] == [0, 10, 20]
        assert sys.getswitchinterval() == pytest.approx(0.005)  # shutdown put the interpreter's back
    finally:
        sys.setswitchinterval(before)


def test_an_error_in_a_call_fails_its_function_and_cancels_the_rest(fake):
    coordinator, client = fake
    client.script = [None, lambda name, payloads: run_payloads(name, payloads, fail_at=1)]
    values = _backlog(coordinator, client, 5)  # the 1st alone, then 4 in one call: the 2nd of them raises
    with pytest.raises(ValueError, match="function 1 failed"):
        coordinator.join()
    assert values[0].fetch() == 0 and values[1].fetch() == 10
    with pytest.raises(ValueError, match="function 1 failed"):
        values[2].fetch()
    for value in values[3:]:
        with pytest.raises(CancelledError):
            value.fetch()
    assert client.calls == [("RunClosure", 1), ("RunClosures", 4)]
    assert coordinator._queue.stats() == {"queued": 0, "inflight": 0, "per_worker": 0}
    assert coordinator.schedule(lambda: 7).fetch(timeout=10) == 7  # and dispatch goes on


def test_functions_after_a_lost_resource_run_again_unchanged(fake):
    """A function that found its worker's resources gone stops the call; the ones after it did not run and go
    back as they were (not retries); the worker is reconnected and everything runs."""
    coordinator, client = fake
    client.script = [None, lambda name, payloads: run_payloads(name, payloads, fail_at=2, status="resource_missing")]
    values = _backlog(coordinator, client, 5)
    coordinator.join()
    assert [v.fetch() for v in values] == [0, 10, 20, 30, 40]
    counts = coordinator._queue.counters()
    assert counts["retried"] == 1 and counts["finished"] == 5  # only the one that found nothing is a retry


def test_a_lost_call_runs_each_of_its_functions_again(fake):
    coordinator, client = fake

    def unavailable(name, payloads):
        raise RemoteError("worker at fake failed with UNAVAILABLE: gone", code="UNAVAILABLE", address="fake")

    client.script = [None, unavailable]
    values = _backlog(coordinator, client, 5)
    coordinator.join()
    assert [v.fetch() for v in values] == [0, 10, 20, 30, 40]
    assert coordinator._queue.counters()["retried"] == 4  # at-least-once: any of them may have run


def test_an_unexpected_error_in_a_call_fails_each_of_its_functions_and_dispatch_goes_on(fake):
    """The dispatch thread's last resort fails the function it held with an unexpected error (a bug, not re-run);
    with several in the call, each of them, so none is left in flight (join would wait forever)."""
    coordinator, client = fake

    def bug(name, payloads):
        raise KeyError("a bug in the dispatch path")

    client.script = [None, bug]
    values = _backlog(coordinator, client, 5)
    with pytest.raises(KeyError, match="a bug in the dispatch path"):
        coordinator.join()
    assert values[0].fetch() == 0
    for value in values[1:]:
        with pytest.raises((KeyError, CancelledError)):
            value.fetch(timeout=10)
    assert coordinator._queue.stats() == {"queued": 0, "inflight": 0, "per_worker": 0}
    assert coordinator.schedule(lambda: 7).fetch(timeout=20) == 7


def test_a_malformed_answer_fails_the_first_function_and_cancels_the_rest(fake):
    coordinator, client = fake

    def short(name, payloads):
        meta, tensors = run_payloads(name, payloads)
        meta["counts"][0] += 1  # more tensors claimed than sent
        return meta, tensors

    client.script = [None, short]
    values = _backlog(coordinator, client, 5)
    with pytest.raises(ValueError, match="malformed RunClosures answer from worker 0: 4 function"):
        coordinator.join()
    for value in values[2:]:
        with pytest.raises(CancelledError):
            value.fetch()
    assert coordinator._queue.stats() == {"queued": 0, "inflight": 0, "per_worker": 0}


# -- the worker ------------------------------------------------------------------------------------------------------
def _pickled(fn) -> np.ndarray:
    return np.frombuffer(cloudpickle.dumps((fn, (), {})), np.uint8)


def test_the_worker_runs_a_call_s_functions_in_order_and_stops_at_the_first_that_fails(shared_cluster, tmp_path):
    marker = tmp_path / "third ran"

    def boom():
        raise KeyError("second")

    client = shared_cluster.client("worker", 0)
    try:
        meta, tensors = client.call("RunClosures", {"closure_ids": [1, 2, 3]},
                                    [_pickled(lambda: 1), _pickled(boom), _pickled(lambda: marker.write_text("x"))])
        assert meta["status"] == "ok" and [a["status"] for a in meta["answers"]] == ["ok", "error"]
        assert sum(meta["counts"]) == len(tensors) and not marker.exists()
        assert meta["answers"][1]["type"] == "KeyError"
        first = tensors[:meta["counts"][0]]
        assert pickle.loads(first[0].tobytes()) == 1  # the result skeleton of a plain value is the value
        with pytest.raises(RemoteError, match="INVALID_ARGUMENT.*field 'closure_ids' must name one function per "
                                              "tensor, got 2 id"):
            client.call("RunClosures", {"closure_ids": [1, 2]}, [_pickled(lambda: 1)])
        with pytest.raises(RemoteError, match="INVALID_ARGUMENT.*tensor 1 is 1-D float32"):
            client.call("RunClosures", {"closure_ids": [1, 2]}, [_pickled(lambda: 1), np.zeros(3, np.float32)])
        with pytest.raises(RemoteError, match="INVALID_ARGUMENT.*closure_ids"):
            client.call("RunClosures", {"closure_ids": "1"}, [_pickled(lambda: 1)])
    finally:
        client.close()
