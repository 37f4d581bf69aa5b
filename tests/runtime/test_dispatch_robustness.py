"""Dispatch and heartbeat threads never die holding a closure, and no closure is left neither finished, failed,
re-queued nor cancelled. The worker transport is a fake injected into the coordinator (no processes, no sockets
to workers), so each failure is injected deterministically."""

from __future__ import annotations

import logging
import pickle
import threading
import time
from typing import Any

import grpc
import numpy as np
import pytest

from kubeps.runtime.rpc import client as rpc
from kubeps.runtime.rpc import protocol
from kubeps.runtime.coordinator.closure_queue import Closure, ClosureState
from kubeps.runtime.coordinator.cluster_coordinator import ClusterCoordinator
from kubeps.runtime.errors import CancelledError, PSUnavailableError, RemoteError

from .conftest import TOKEN, fake_worker_coordinator

pytestmark = pytest.mark.timeout(60)


def _ok_answer(value: Any) -> tuple[dict[str, Any], list[np.ndarray]]:
    return {"status": "ok"}, [np.frombuffer(pickle.dumps(value), dtype=np.uint8)]


class FakeWorkerClient:
    """Stands for ``rpc.Client`` to one worker. ``Ping`` answers; ``RunClosure`` fails with the next entry of
    ``failures`` (an exception raised by ``finish``) and, once they are used up, answers ``answer``."""

    def __init__(self, address: str, *args: Any, **kwargs: Any):
        self.address = address
        self.failures: list[BaseException] = []
        self.ping_failures: list[BaseException] = []
        self.runs = 0
        self.answer = _ok_answer(7)
        self.lock = threading.Lock()

    def call(self, name: str, meta: Any = None, arrays: Any = (), timeout: float | None = None):
        assert name == "Ping", name
        with self.lock:
            if self.ping_failures:
                raise self.ping_failures.pop(0)
        return {"incarnation": "fake"}, []

    def start(self, name: str, meta: Any = None, arrays: Any = (), timeout: float | None = None):
        return object()

    def finish(self, call: Any):
        with self.lock:
            self.runs += 1
            if self.failures:
                raise self.failures.pop(0)
        return self.answer

    def close(self) -> None:
        pass


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """A coordinator with one fake worker."""
    with fake_worker_coordinator(monkeypatch, tmp_path, FakeWorkerClient, ps_error_interval=0.2) as made:
        yield made


def _thread_alive(coordinator: ClusterCoordinator) -> bool:
    return all(w.thread is not None and w.thread.is_alive() for w in coordinator.workers.members)


def test_future_cancelled_error_escaping_the_transport_reruns_the_closure(fake):
    """An older ``Call.result`` let ``grpc.FutureCancelledError`` (the heartbeat cancelled a frozen worker's call)
    escape: the dispatch thread died with the closure and ``join()`` hung. Now it is a lost call: re-run."""
    coordinator, client = fake
    client.failures = [grpc.FutureCancelledError()]
    value = coordinator.schedule(int)
    assert value.fetch(timeout=10) == 7
    coordinator.join()
    assert client.runs == 2  # the cancelled run and the re-run
    assert _thread_alive(coordinator)
    assert coordinator.schedule(int).fetch(timeout=10) == 7  # and the thread goes on dispatching


def test_unexpected_exception_fails_the_closure_and_the_thread_goes_on(fake, caplog):
    coordinator, client = fake
    caplog.set_level(logging.ERROR, logger="kubeps.runtime.coordinator.workers")
    boom = KeyError("a bug in the dispatch path")
    client.failures = [boom]
    value = coordinator.schedule(int)
    with pytest.raises(KeyError, match="a bug in the dispatch path"):
        value.fetch(timeout=10)
    with pytest.raises(KeyError):
        coordinator.join()  # the error reaches the user, once
    assert any("caught an unexpected error" in r.getMessage() and r.exc_info and r.exc_info[1] is boom
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert _thread_alive(coordinator)
    assert coordinator.schedule(int).fetch(timeout=10) == 7
    coordinator.join()
    assert client.runs == 2  # failed, not re-run: an unexpected error would likely come back forever


def test_malformed_answer_fails_the_closure(fake):
    coordinator, client = fake
    client.answer = ({"status": "ok"}, [np.frombuffer(b"not a pickle", dtype=np.uint8)])
    value = coordinator.schedule(int)
    with pytest.raises(Exception):
        value.fetch(timeout=10)
    with pytest.raises(Exception):
        coordinator.join()
    client.answer = _ok_answer(3)
    assert coordinator.schedule(int).fetch(timeout=10) == 3
    assert _thread_alive(coordinator)


def test_error_while_reconnecting_does_not_end_the_thread(fake):
    coordinator, client = fake
    worker = coordinator.workers.members[0]
    with client.lock:
        client.ping_failures = [ValueError("Cannot invoke RPC on closed channel!")]
        worker.healthy = False  # the next iteration reconnects first; that raises once
    value = coordinator.schedule(int)
    assert value.fetch(timeout=10) == 7
    deadline = time.monotonic() + 10  # the failure may be used up just after the closure is answered
    while client.ping_failures and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _thread_alive(coordinator) and not client.ping_failures


@pytest.mark.parametrize("answers_again", [False, True], ids=["silent", "heartbeat-saw-it-answer-again"])
def test_ps_failed_during_the_retry_pause_fails_the_closure_instead_of_parking_it(fake, answers_again):
    """The race behind test_transient_errors_close_together_count_once taking 33 s: a closure pausing before its
    retry while another closure's error used up the tolerance was re-queued behind the now pending error, where
    nothing hands it out and nothing cancels it until the next schedule/join/done: its fetch() blocked."""
    coordinator, _ = fake
    closure = Closure(b"")
    coordinator._queue._inflight.add(closure)  # as if a dispatch thread held it
    closure.state = ClosureState.RUNNING
    ps_error = PSUnavailableError(0, coordinator.strategy.ps_addresses[0], "4 errors over 3.0 s")
    real_wait = coordinator.workers.stopping.wait

    def pause(timeout=None):  # the other closure's error lands during this closure's pause
        coordinator.mark_ps_failed(0, ps_error)
        if answers_again:
            coordinator.failures.ps_recovered(0)  # the job failed all the same: the error is pending
        return real_wait(0)

    coordinator.workers.stopping.wait = pause
    try:
        coordinator.handle_ps_error(closure, 0, "UNAVAILABLE: failed to connect to all addresses")
    finally:
        coordinator.workers.stopping.wait = real_wait
    start = time.monotonic()
    with pytest.raises(PSUnavailableError, match="4 errors"):
        closure.remote_value.fetch(timeout=5)
    assert time.monotonic() - start < 4  # failed, not left waiting for the 5 s timeout
    assert closure.state is ClosureState.FAILED
    with pytest.raises(PSUnavailableError):
        coordinator.join()


def test_fetch_of_a_queued_closure_does_not_block_on_a_pending_error(fake):
    """A closure queued when another one fails can never run before the error is raised: its value raises
    CancelledError at once, instead of blocking until the user happens to call schedule/join/done."""
    coordinator, client = fake
    gate = threading.Event()
    started = threading.Event()
    real_finish = client.finish

    def slow_finish(call):
        started.set()
        gate.wait(10)
        return real_finish(call)

    client.finish = slow_finish
    client.failures = [RemoteError("bad request", code="INVALID_ARGUMENT")]  # non-retryable
    failing = coordinator.schedule(int)
    assert started.wait(10)
    queued = [coordinator.schedule(int) for _ in range(3)]
    gate.set()
    with pytest.raises(RemoteError, match="bad request"):
        failing.fetch(timeout=10)
    for value in queued:
        with pytest.raises(CancelledError, match="earlier one failed"):
            value.fetch(timeout=5)
    with pytest.raises(RemoteError):
        coordinator.join()
    assert coordinator.done()


def test_monitor_survives_a_failing_heartbeat(fake, monkeypatch, caplog):
    coordinator, _ = fake
    caplog.set_level(logging.ERROR, logger="kubeps.runtime.coordinator.failure")
    calls = []
    real = coordinator.failures._heartbeat_ps

    def flaky(ps, now):
        calls.append(now)
        if len(calls) == 1:
            raise RuntimeError("injected heartbeat failure")
        return real(ps, now)

    monkeypatch.setattr(coordinator.failures, "_heartbeat_ps", flaky)
    deadline = time.monotonic() + 10
    while len(calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(calls) >= 3 and coordinator.failures.thread.is_alive()
    assert any("injected heartbeat failure" in (r.exc_text or str(r.exc_info)) for r in caplog.records)


# -- rpc.Call: every failure is a RemoteError ---------------------------------------------------------------------
class _FakeFuture:
    def __init__(self, error: BaseException):
        self.error = error
        self.cancelled = False

    def result(self):
        raise self.error

    def cancel(self):
        self.cancelled = True
        return True


class _ParkedError(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self):
        return "answer parked"

    def trailing_metadata(self):
        return ((protocol.ERROR_REASON_KEY, protocol.ANSWER_PARKED), (protocol.ANSWER_ID_KEY, "id-1"))


class _BlockingStream:
    """A Collect stream that yields nothing until cancelled, then fails as gRPC does."""

    def __init__(self):
        self.cancelled = threading.Event()

    def __iter__(self):
        return self

    def __next__(self):
        self.cancelled.wait(10)
        raise _CancelledRpc()

    def cancel(self):
        self.cancelled.set()
        return True


class _CancelledRpc(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.CANCELLED

    def details(self):
        return "Locally cancelled by application!"

    def trailing_metadata(self):
        return ()


def test_call_result_turns_future_cancelled_into_remote_error():
    client = rpc.Client("127.0.0.1:1", protocol.WORKER_SERVICE, TOKEN)
    call = rpc.Call(client, "RunClosure", 5.0, future=_FakeFuture(grpc.FutureCancelledError()))
    with pytest.raises(RemoteError) as info:
        call.result()
    assert info.value.code == "CANCELLED" and "RunClosure was cancelled locally" in str(info.value)


def test_cancel_reaches_the_collect_stream_of_a_parked_answer(monkeypatch):
    """The heartbeat cancels a frozen worker's call; when the answer was parked and is being collected, cancelling
    the (finished) unary future alone would leave the dispatch thread reading the stream until its deadline."""
    client = rpc.Client("127.0.0.1:1", protocol.WORKER_SERVICE, TOKEN)
    stream = _BlockingStream()
    monkeypatch.setattr(client, "_method", lambda name, unary=False: (lambda chunks, **kw: stream))
    call = rpc.Call(client, "RunClosure", 30.0, future=_FakeFuture(_ParkedError()))
    outcome: list[BaseException] = []

    def read():
        try:
            call.result()
        except BaseException as err:  # noqa: BLE001 - checked below
            outcome.append(err)

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 5
    while call._collecting is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert call._collecting is stream
    call.cancel()
    reader.join(5)
    assert not reader.is_alive()
    assert isinstance(outcome[0], RemoteError) and outcome[0].code == "CANCELLED"

    # cancelled before the answer turned out parked: no collection at all
    started = []
    monkeypatch.setattr(client, "_method", lambda name, unary=False: started.append(name))
    early = rpc.Call(client, "RunClosure", 30.0, future=_FakeFuture(_ParkedError()))
    early.cancel()
    with pytest.raises(RemoteError, match="CANCELLED"):
        early.result()
    assert not started
