"""Failure handling against real processes: a ps that restarts empty, hung peers found by parallel pings, short
PS blips survived, and the watchdog hook."""

from __future__ import annotations

import io
import logging
import os
import signal
import threading
import time

import numpy as np
import pytest

from kubeps.runtime.coordinator.closure_queue import Closure
from kubeps.runtime.coordinator.cluster_coordinator import ClusterCoordinator
from kubeps.runtime.coordinator.shipping import dumps
from kubeps.runtime.errors import PSUnavailableError
from kubeps.runtime.ops.optimizers import SGD
from kubeps.runtime.coordinator.supervisor import EXIT_PS_UNAVAILABLE, run_coordinator
from kubeps.runtime.variables.variable import Variable
from kubeps.runtime.coordinator.watchdog import Watchdog

pytestmark = pytest.mark.timeout(120)


def _raises_within(action, seconds: float, interval: float = 0.05) -> tuple[BaseException, float]:
    """Call ``action`` until it raises; return the error and how long it took (fails after ``seconds``)."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        try:
            action()
        except Exception as err:  # noqa: BLE001 - returned to the test
            return err, time.monotonic() - start
        time.sleep(interval)
    raise AssertionError(f"nothing was raised within {seconds} s")


def test_restarted_ps_fails_the_job_with_a_restart_error(two_ps_job):
    # a generous silence budget: the restart itself (a new Python process) must not be mistaken for a hang
    job = two_ps_job(heartbeat_failures=20)
    cluster, coordinator, b, step = job.cluster, job.coordinator, job.b, job.step
    before = coordinator.ps_incarnations
    assert all(before.values())
    cluster.kill("ps", 1)
    cluster.start_task("ps", 1)  # back at the same address, empty; nobody restarts the chief

    # nothing running: the heartbeat sees the new incarnation
    error, took = _raises_within(coordinator.done, 10)
    assert isinstance(error, PSUnavailableError), repr(error)
    assert error.ps_index == 1 and "/job:ps/task:1" in str(error) and cluster.cluster["ps"][1] in str(error)
    assert "restarted and lost its variables" in str(error) and "incarnation" in str(error)
    assert took < 10

    # a function touching the lost variables: the worker gets NOT_FOUND, the job fails at once (no retries)
    start = time.monotonic()
    coordinator.schedule(step)
    with pytest.raises(PSUnavailableError, match="restarted and lost its variables.*NOT_FOUND"):
        coordinator.join()
    assert time.monotonic() - start < 10
    with pytest.raises(PSUnavailableError, match="task:1.*restarted"):
        b.numpy()  # the coordinator's own reads say so too

    # and the chief's main function ends with the retryable status, not a permanent error
    def main():
        coordinator.schedule(step)
        coordinator.join()

    with pytest.raises(SystemExit) as exit_info:
        run_coordinator(main, hard_exit=False)
    assert exit_info.value.code == EXIT_PS_UNAVAILABLE == 133
    assert coordinator.ps_incarnations == before  # it remembers the incarnation its variables lived in


def test_hung_worker_and_hung_ps_are_detected_in_parallel(make_cluster, caplog):
    """With the default heartbeat (1 s x 3) a hung worker and a hung ps are both found in about 3 s; a hung ps
    no longer delays the detection of a hung worker (pings are parallel, each with a 1 s deadline)."""
    cluster = make_cluster(num_ps=2, num_workers=2)
    strategy = cluster.strategy()
    coordinator = ClusterCoordinator(strategy)
    worker, ps = cluster.procs[("worker", 0)], cluster.procs[("ps", 1)]
    stopped = []
    try:
        from kubeps.runtime.variables.context import get_current_worker_index

        def slow(seconds):
            time.sleep(seconds)
            return get_current_worker_index()

        coordinator.fetch([coordinator.schedule(slow, args=(0.0,)) for _ in range(4)])
        long_ones = [coordinator.schedule(slow, args=(30.0,)) for _ in range(2)]  # one on each worker
        time.sleep(0.5)
        caplog.set_level(logging.WARNING, logger="kubeps.runtime.coordinator.failure")
        start = time.monotonic()
        for proc in (worker, ps):
            os.kill(proc.pid, signal.SIGSTOP)  # alive, connections open, silent: only the heartbeat notices
            stopped.append(proc)
        error, ps_detected = _raises_within(coordinator.done, 10)
        assert isinstance(error, PSUnavailableError) and error.ps_index == 1, repr(error)
        assert "no answer to pings" in str(error)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any("worker 0 missed pings" in r.getMessage()
                                                      for r in caplog.records):
            time.sleep(0.05)
        worker_seen = [r.created for r in caplog.records if "worker 0 missed pings" in r.getMessage()]
        assert worker_seen, "the hung worker was not detected"
        worker_detected = worker_seen[0] - (time.time() - (time.monotonic() - start))
        # the budget is 3 missed 1 s pings counted from the last answered ping's send time, which may be up to
        # a ping interval (plus scheduling lag) before the stop: detection lands at roughly 2-4 s
        assert ps_detected < 9, f"hung ps detected after {ps_detected:.1f} s"
        assert worker_detected < 9, f"hung worker detected after {worker_detected:.1f} s"
        assert 0.5 < min(ps_detected, worker_detected), "detected before the silence budget was spent"
        print(f"\nDETECTION hung ps {ps_detected:.2f} s, hung worker {worker_detected:.2f} s")
        del long_ones
    finally:
        for proc in stopped:
            os.kill(proc.pid, signal.SIGCONT)
        for i in range(2):  # their closures sleep on: do not wait for a graceful stop
            cluster.kill("worker", i)
        coordinator.shutdown()
        strategy.close()


def test_ps_blip_is_survived_and_a_longer_outage_is_not(make_cluster):
    cluster = make_cluster(num_ps=1, num_workers=2)
    strategy = cluster.strategy()
    coordinator = ClusterCoordinator(strategy)
    proc = cluster.procs[("ps", 0)]
    stopped = False
    try:
        with strategy.scope():
            w = Variable(np.zeros(4, np.float32), name="w")
        opt = SGD(learning_rate=1.0)

        def step():
            opt.apply_gradients([(-np.ones(4, np.float32), w)])
            time.sleep(0.02)

        results = [coordinator.schedule(step) for _ in range(10)]
        coordinator.join()
        # unreachable for half a second: calls stall, pings go unanswered, nothing fails (the silence budget of
        # 3 s counts from the last answered ping, which can be over a second old at the stop)
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = True
        blip_end = time.monotonic() + 0.5
        while time.monotonic() < blip_end:
            results.append(coordinator.schedule(step))
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGCONT)
        stopped = False
        results += [coordinator.schedule(step) for _ in range(10)]
        coordinator.join()
        coordinator.fetch(results)
        np.testing.assert_allclose(w.numpy(), np.full(4, len(results), np.float32))

        # unreachable for longer: PSUnavailableError within 10 s
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = True
        error, took = _raises_within(lambda: coordinator.schedule(step), 10, interval=0.1)
        assert isinstance(error, PSUnavailableError) and "/job:ps/task:0" in str(error), repr(error)
        assert took < 10
    finally:
        if stopped:
            os.kill(proc.pid, signal.SIGCONT)
        coordinator.shutdown()
        strategy.close()


def test_transient_errors_close_together_count_once(shared_cluster):
    """A worker whose channel is in reconnect backoff fails many calls within milliseconds: during a 1 s blip
    those must not use up the tolerance; errors that go on for seconds must fail the job."""
    strategy = shared_cluster.strategy()
    coordinator = ClusterCoordinator(strategy)  # max_transient_ps_errors=3, ps_error_interval=1 s
    payload = dumps((int, (), {}), "int")

    def hammer(seconds: float) -> None:
        def one_dispatcher():
            end = time.monotonic() + seconds
            while time.monotonic() < end and not coordinator._queue.has_error:
                closure = Closure(payload)
                coordinator.handle_ps_error(closure, 0, "UNAVAILABLE: failed to connect to all addresses")
                try:
                    closure.remote_value.fetch(timeout=30)  # it was re-queued and ran (the ps is fine really)
                except PSUnavailableError:
                    return  # this one used up the tolerance

        threads = [threading.Thread(target=one_dispatcher) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    try:
        hammer(1.0)  # a one-second blip seen by three dispatch threads
        assert coordinator.done() is not None  # no error pending
        time.sleep(0.1)
        start = time.monotonic()
        coordinator.failures.ps_errors[0].clear()  # a fresh incident (counted errors also expire after ps_error_window)
        hammer(8.0)
        took = time.monotonic() - start
        with pytest.raises(PSUnavailableError, match=r"/job:ps/task:0 .*4 errors over \d+\.\d s"):
            coordinator.join()
        assert 2.5 < took < 15, took
    finally:
        coordinator.shutdown()
        strategy.close()


def test_watchdog_dumps_stacks_when_no_closure_finishes(shared_cluster, capsys):
    strategy = shared_cluster.strategy()
    coordinator = ClusterCoordinator(strategy, watchdog_timeout=1.5)
    try:
        assert isinstance(coordinator.watchdog, Watchdog)
        time.sleep(2.0)  # idle: nothing pending is not a hang
        assert coordinator.watchdog.triggered == 0
        # closures finishing often, longer than the timeout in all: no dump either (a wide margin for each closure's
        # round trip on a loaded machine)
        for _ in range(20):
            coordinator.schedule(time.sleep, args=(0.1,)).fetch(timeout=30)
        assert coordinator.watchdog.triggered == 0
        coordinator.schedule(time.sleep, args=(4.0,)).fetch(timeout=30)  # stuck for longer than the timeout
        assert coordinator.watchdog.triggered >= 1
        err = capsys.readouterr().err
        assert "kubeps watchdog: no closure finished" in err
        assert "kubeps-worker-" in err and "_run_closure" in err  # the dispatch thread blocked on the worker
    finally:
        coordinator.shutdown()
        strategy.close()
    assert coordinator.watchdog._thread is None  # stopped with the coordinator that started it


def test_watchdog_instance_is_notified_by_the_coordinator(shared_cluster):
    strategy = shared_cluster.strategy()
    out, dumps = io.StringIO(), []
    watchdog = Watchdog(1.5, output=out, on_triggered=dumps.append, poll_interval=0.05)
    coordinator = ClusterCoordinator(strategy, watchdog=watchdog)
    try:
        for _ in range(20):  # each closure takes far less than the timeout and notifies the watchdog when it ends
            coordinator.schedule(time.sleep, args=(0.1,)).fetch(timeout=30)
        assert not dumps, out.getvalue()[:2000]
        coordinator.schedule(time.sleep, args=(4.0,)).fetch(timeout=30)
        assert dumps and "_run_closure" in dumps[0] and out.getvalue().startswith("kubeps watchdog")
        with pytest.raises(ValueError, match="either watchdog_timeout or a Watchdog"):
            ClusterCoordinator(strategy, watchdog=watchdog, watchdog_timeout=1.0)
        with pytest.raises(ValueError, match="'watchdog_timeout' has invalid|timeout=0 is invalid"):
            ClusterCoordinator(strategy, watchdog_timeout=0)
    finally:
        coordinator.shutdown()
        strategy.close()
